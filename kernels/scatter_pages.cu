// scatter_pages: page-first staging buffer -> pages of the layer-first pool (gather's reverse).
//   staging  (n, layers, 2, block)  ->  pool (2, layers, pool_pages, block)
#include "copy_block.cuh"

extern "C" __global__ void scatter_pages(const unsigned char* __restrict__ staging, unsigned char* __restrict__ pool,
                                         const i64* __restrict__ pages, i64 num_pages, i64 num_layers,
                                         i64 pool_pages, i64 block_bytes) {
  // One warp per block, grid-stride over warps: a block of a small model is a few KiB, too
  // little to keep a whole thread block busy (the launch sizes the grid by warps).
  const i64 warps = (i64)gridDim.x * (blockDim.x / 32);
  const int lane = threadIdx.x % 32;
  for (i64 b = (i64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; b < num_pages * num_layers * 2; b += warps) {
    copy_bytes(staging + b * block_bytes, pool + pool_block_offset(b, pages, num_layers, pool_pages, block_bytes),
               block_bytes, lane, 32);
  }
}
