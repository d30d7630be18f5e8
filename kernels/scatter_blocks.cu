// scatter_blocks: the inverse of gather_blocks (same arguments): page-first staging in our page
// layout (HND) -> blocks of an engine's per-layer KV. One warp per (block, layer, K/V, head) unit.
#include "copy_block.cuh"

extern "C" __global__ void scatter_blocks(const i64* __restrict__ layers, const unsigned char* __restrict__ staging,
                                          const i64* __restrict__ blocks, i64 num_blocks, i64 num_layers, i64 heads,
                                          i64 block_size, i64 row_bytes, i64 kv_stride, i64 block_stride,
                                          i64 token_stride, i64 head_stride) {
  move_engine_blocks<false>(layers, const_cast<unsigned char*>(staging), blocks, num_blocks, num_layers, heads,
                            block_size, row_bytes, kv_stride, block_stride, token_stride, head_stride);
}
