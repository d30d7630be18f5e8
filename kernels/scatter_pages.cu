// scatter_pages: page-first staging buffer -> pages of the layer-first pool (gather's reverse).
//   staging  (n, layers, 2, block)  ->  pool (2, layers, pool_pages, block)
#include "copy_block.cuh"

extern "C" __global__ void scatter_pages(const unsigned char* __restrict__ staging, unsigned char* __restrict__ pool,
                                         const i64* __restrict__ pages, i64 num_pages, i64 num_layers,
                                         i64 pool_pages, i64 block_bytes) {
  for (i64 b = blockIdx.x; b < num_pages * num_layers * 2; b += gridDim.x) {
    const i64 kv = b % 2;
    const i64 layer = (b / 2) % num_layers;
    const i64 page = pages[b / (2 * num_layers)];
    unsigned char* dst = pool + ((kv * num_layers + layer) * pool_pages + page) * block_bytes;
    copy_bytes(staging + b * block_bytes, dst, block_bytes, threadIdx.x, blockDim.x);
  }
}
