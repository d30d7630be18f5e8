// gather_pages: pages of the layer-first pool -> one contiguous page-first staging buffer.
//   pool     (2, layers, pool_pages, block)   block = one page of one layer's K or V
//   staging  (n, layers, 2, block)
// One warp per (page, layer, K/V) block of `block_bytes`, in staging order, so writes to the
// staging buffer are sequential.
#include "copy_block.cuh"

extern "C" __global__ void gather_pages(const unsigned char* __restrict__ pool, unsigned char* __restrict__ staging,
                                        const i64* __restrict__ pages, i64 num_pages, i64 num_layers,
                                        i64 pool_pages, i64 block_bytes) {
  // One warp per block, grid-stride over warps: a block of a small model is a few KiB, too
  // little to keep a whole thread block busy (the launch sizes the grid by warps).
  const i64 warps = (i64)gridDim.x * (blockDim.x / 32);
  const int lane = threadIdx.x % 32;
  for (i64 b = (i64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; b < num_pages * num_layers * 2; b += warps) {
    copy_bytes(pool + pool_block_offset(b, pages, num_layers, pool_pages, block_bytes), staging + b * block_bytes,
               block_bytes, lane, 32);
  }
}
