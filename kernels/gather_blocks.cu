// gather_blocks: blocks of an engine's per-layer KV (vLLM's, any layout strides describe) -> one
// contiguous page-first staging buffer in our page layout, ready for a single device-to-host copy.
//   layers   num_layers device addresses, one per layer tensor (the layers need not be one tensor)
//   strides  in bytes: a (block, K/V, head) unit's token rows are token_stride apart, row_bytes long
//   staging  (n, layers, 2, heads, block_size, row_bytes): our pages, HND
// One warp per (block, layer, K/V, head) unit, in staging order (move_engine_blocks).
#include "copy_block.cuh"

extern "C" __global__ void gather_blocks(const i64* __restrict__ layers, unsigned char* __restrict__ staging,
                                         const i64* __restrict__ blocks, i64 num_blocks, i64 num_layers, i64 heads,
                                         i64 block_size, i64 row_bytes, i64 kv_stride, i64 block_stride,
                                         i64 token_stride, i64 head_stride) {
  move_engine_blocks<true>(layers, staging, blocks, num_blocks, num_layers, heads, block_size, row_bytes, kv_stride,
                           block_stride, token_stride, head_stride);
}
