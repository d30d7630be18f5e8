// store_kv: write the K/V of new tokens into their slots of the layer-first pool.
//   kv    (layers, 2, n, heads, head_dim)            the tensor API layout
//   pool  (2, layers, pool_pages, page_size, heads, head_dim)   layout NHD (hnd == 0)
//         (2, layers, pool_pages, heads, page_size, head_dim)   layout HND (hnd == 1)
//   slot  = page * page_size + offset, one per token
// One warp per row of head_dim elements (one layer, K or V, token, head), as in the store kernel
// of the seed material; each lane moves 16 bytes at a time when alignment allows.
#include "copy_block.cuh"

extern "C" __global__ void store_kv(const unsigned char* __restrict__ kv, unsigned char* __restrict__ pool,
                                    const i64* __restrict__ slots, i64 num_layers, i64 num_tokens, i64 heads,
                                    i64 pool_pages, i64 page_size, i64 row_bytes, int hnd) {
  const i64 warps_per_block = blockDim.x / 32;
  const int lane = threadIdx.x % 32;
  const i64 rows = num_layers * 2 * num_tokens * heads;
  for (i64 row = (i64)blockIdx.x * warps_per_block + threadIdx.x / 32; row < rows;
       row += (i64)gridDim.x * warps_per_block) {
    const i64 head = row % heads;
    const i64 token = (row / heads) % num_tokens;
    const i64 kv_index = (row / (heads * num_tokens)) % 2;
    const i64 layer = row / (heads * num_tokens * 2);
    const i64 slot = slots[token];
    const i64 page = slot / page_size;
    const i64 offset = slot % page_size;
    const i64 block = ((kv_index * num_layers + layer) * pool_pages + page) * page_size * heads;
    const i64 within = hnd ? head * page_size + offset : offset * heads + head;
    copy_bytes(kv + row * row_bytes, pool + (block + within) * row_bytes, row_bytes, lane, 32);
  }
}
