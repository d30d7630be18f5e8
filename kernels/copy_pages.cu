// copy_pages: pool page src[i] -> pool page dst[i], every layer and K/V, inside one pool (the
// copy a copy-on-write fork makes of a shared page before writing into it).
//   pool     (2, layers, pool_pages, block)   block = one page of one layer's K or V
// One warp per (pair, layer, K/V) block, as gather_pages; src and dst pages must differ.
#include "copy_block.cuh"

extern "C" __global__ void copy_pages(unsigned char* __restrict__ pool, const i64* __restrict__ src,
                                      const i64* __restrict__ dst, i64 num_pairs, i64 num_layers, i64 pool_pages,
                                      i64 block_bytes) {
  const i64 warps = (i64)gridDim.x * (blockDim.x / 32);
  const int lane = threadIdx.x % 32;
  for (i64 b = (i64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; b < num_pairs * num_layers * 2; b += warps) {
    copy_bytes(pool + pool_block_offset(b, src, num_layers, pool_pages, block_bytes),
               pool + pool_block_offset(b, dst, num_layers, pool_pages, block_bytes), block_bytes, lane, 32);
  }
}
