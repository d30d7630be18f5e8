// gather_pages: pages of the layer-first pool -> one contiguous page-first staging buffer.
//   pool     (2, layers, pool_pages, block)   block = one page of one layer's K or V
//   staging  (n, layers, 2, block)
// One thread block per (page, layer, K/V) block of `block_bytes`, in staging order, so writes
// to the staging buffer are sequential.
#include "copy_block.cuh"

extern "C" __global__ void gather_pages(const unsigned char* __restrict__ pool, unsigned char* __restrict__ staging,
                                        const i64* __restrict__ pages, i64 num_pages, i64 num_layers,
                                        i64 pool_pages, i64 block_bytes) {
  for (i64 b = blockIdx.x; b < num_pages * num_layers * 2; b += gridDim.x) {
    const i64 kv = b % 2;
    const i64 layer = (b / 2) % num_layers;
    const i64 page = pages[b / (2 * num_layers)];
    const unsigned char* src = pool + ((kv * num_layers + layer) * pool_pages + page) * block_bytes;
    copy_bytes(src, staging + b * block_bytes, block_bytes, threadIdx.x, blockDim.x);
  }
}
