// Host entry points that run each kernel over a whole grid (see cuda_shim.h).
#include "cuda_shim.h"
#include "copy_pages.cu"
#include "gather_blocks.cu"
#include "gather_pages.cu"
#include "scatter_blocks.cu"
#include "scatter_pages.cu"
#include "store_kv.cu"

#define RUN_GRID(grid, block, call)                                  \
  for (unsigned b = 0; b < (grid); ++b)                              \
    for (unsigned t = 0; t < (block); ++t) {                         \
      blockIdx.x = b; threadIdx.x = t; blockDim.x = (block); gridDim.x = (grid); \
      call;                                                          \
    }

extern "C" void run_gather(unsigned grid, unsigned block, const unsigned char* pool, unsigned char* staging,
                           const i64* pages, i64 n, i64 layers, i64 pool_pages, i64 block_bytes) {
  RUN_GRID(grid, block, gather_pages(pool, staging, pages, n, layers, pool_pages, block_bytes));
}

extern "C" void run_scatter(unsigned grid, unsigned block, const unsigned char* staging, unsigned char* pool,
                            const i64* pages, i64 n, i64 layers, i64 pool_pages, i64 block_bytes) {
  RUN_GRID(grid, block, scatter_pages(staging, pool, pages, n, layers, pool_pages, block_bytes));
}

extern "C" void run_store(unsigned grid, unsigned block, const unsigned char* kv, unsigned char* pool,
                          const i64* slots, i64 layers, i64 tokens, i64 heads, i64 pool_pages, i64 page_size,
                          i64 row_bytes, int hnd) {
  RUN_GRID(grid, block, store_kv(kv, pool, slots, layers, tokens, heads, pool_pages, page_size, row_bytes, hnd));
}

extern "C" void run_copy(unsigned grid, unsigned block, unsigned char* pool, const i64* src, const i64* dst,
                         i64 n, i64 layers, i64 pool_pages, i64 block_bytes) {
  RUN_GRID(grid, block, copy_pages(pool, src, dst, n, layers, pool_pages, block_bytes));
}

extern "C" void run_gather_blocks(unsigned grid, unsigned block, const i64* layers, unsigned char* staging,
                                  const i64* blocks, i64 n, i64 num_layers, i64 heads, i64 block_size,
                                  i64 row_bytes, i64 kv_stride, i64 block_stride, i64 token_stride,
                                  i64 head_stride) {
  RUN_GRID(grid, block, gather_blocks(layers, staging, blocks, n, num_layers, heads, block_size, row_bytes,
                                      kv_stride, block_stride, token_stride, head_stride));
}

extern "C" void run_scatter_blocks(unsigned grid, unsigned block, const i64* layers, const unsigned char* staging,
                                   const i64* blocks, i64 n, i64 num_layers, i64 heads, i64 block_size,
                                   i64 row_bytes, i64 kv_stride, i64 block_stride, i64 token_stride,
                                   i64 head_stride) {
  RUN_GRID(grid, block, scatter_blocks(layers, staging, blocks, n, num_layers, heads, block_size, row_bytes,
                                       kv_stride, block_stride, token_stride, head_stride));
}
