// Shared device helpers for the page kernels: copy a run of bytes with the widest access the
// pointers and length allow. Kernels move bytes, not typed elements, so every dtype and head
// size works (fp16, bf16, fp32, fp8; odd head dims): no "unsupported element size" gaps.
#pragma once

typedef long long i64;
typedef unsigned long long u64;

// Copy n bytes from src to dst using the threads [first, first + count) of the calling group,
// thread `rank` of them: 16-byte vectors when both pointers and n are 16-byte aligned, else
// 4-byte words when 4-byte aligned, else single bytes. Each thread issues four independent
// 16-byte loads before its stores: with one load in flight per thread the copy runs far below a
// device-to-device copy (docs/PERFORMANCE.md, "GPU path").
__device__ __forceinline__ void copy_bytes(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                                           i64 n, int rank, int count) {
  const u64 align = (u64)src | (u64)dst | (u64)n;
  if ((align & 15) == 0) {
    const uint4* __restrict__ s = reinterpret_cast<const uint4*>(src);
    uint4* __restrict__ d = reinterpret_cast<uint4*>(dst);
    const i64 nv = n / 16;
    i64 k = rank;
    for (; k + 3 * (i64)count < nv; k += 4 * (i64)count) {
      const uint4 a = s[k], b = s[k + count], c = s[k + 2 * count], e = s[k + 3 * count];
      d[k] = a;
      d[k + count] = b;
      d[k + 2 * count] = c;
      d[k + 3 * count] = e;
    }
    for (; k < nv; k += count) d[k] = s[k];
  } else if ((align & 3) == 0) {
    const unsigned int* s = reinterpret_cast<const unsigned int*>(src);
    unsigned int* d = reinterpret_cast<unsigned int*>(dst);
    for (i64 k = rank; k < n / 4; k += count) d[k] = s[k];
  } else {
    for (i64 k = rank; k < n; k += count) dst[k] = src[k];
  }
}

// Byte offset, in the layer-first pool (2, layers, pool_pages, block), of staging block `b` of a
// page-first staging buffer (n, layers, 2, block) that holds `pages` in order.
__device__ __forceinline__ i64 pool_block_offset(i64 b, const i64* __restrict__ pages, i64 num_layers,
                                                 i64 pool_pages, i64 block_bytes) {
  const i64 kv = b % 2;
  const i64 layer = (b / 2) % num_layers;
  const i64 page = pages[b / (2 * num_layers)];
  return ((kv * num_layers + layer) * pool_pages + page) * block_bytes;
}

// Copy `rows` rows of `row_bytes` each, row r from src + r * src_stride to dst + r * dst_stride,
// using the threads [0, count) of the calling group, thread `rank` of them: 16-byte vectors when
// every pointer, stride and the row length are 16-byte aligned, else 4-byte words, else bytes.
// For an engine's strided KV (a block's tokens are rows `heads * head_dim` apart in vLLM's layout).
__device__ __forceinline__ void copy_rows(const unsigned char* __restrict__ src, i64 src_stride,
                                          unsigned char* __restrict__ dst, i64 dst_stride, i64 rows, i64 row_bytes,
                                          int rank, int count) {
  const u64 align = (u64)src | (u64)dst | (u64)src_stride | (u64)dst_stride | (u64)row_bytes;
  if ((align & 15) == 0) {
    const i64 per_row = row_bytes / 16;
    for (i64 k = rank; k < rows * per_row; k += count) {
      const i64 r = k / per_row, c = k % per_row;
      reinterpret_cast<uint4*>(dst + r * dst_stride)[c] = reinterpret_cast<const uint4*>(src + r * src_stride)[c];
    }
  } else if ((align & 3) == 0) {
    const i64 per_row = row_bytes / 4;
    for (i64 k = rank; k < rows * per_row; k += count) {
      const i64 r = k / per_row, c = k % per_row;
      reinterpret_cast<unsigned int*>(dst + r * dst_stride)[c] =
          reinterpret_cast<const unsigned int*>(src + r * src_stride)[c];
    }
  } else {
    for (i64 k = rank; k < rows * row_bytes; k += count) {
      const i64 r = k / row_bytes, c = k % row_bytes;
      dst[r * dst_stride + c] = src[r * src_stride + c];
    }
  }
}

// The body of gather_blocks (kGather) and scatter_blocks: one warp per (block, layer, K/V, head)
// unit, in staging order, grid-stride over units. A unit of layer `layer` starts at
// layers[layer] + kv * kv_stride + block * block_stride + head * head_stride (bytes), its
// block_size token rows token_stride apart; in staging, units follow each other whole.
template <bool kGather>
__device__ __forceinline__ void move_engine_blocks(const i64* __restrict__ layers, unsigned char* staging,
                                                   const i64* __restrict__ blocks, i64 num_blocks, i64 num_layers,
                                                   i64 heads, i64 block_size, i64 row_bytes, i64 kv_stride,
                                                   i64 block_stride, i64 token_stride, i64 head_stride) {
  const i64 warps = (i64)gridDim.x * (blockDim.x / 32);
  const int lane = threadIdx.x % 32;
  const i64 units = num_blocks * num_layers * 2 * heads;
  const i64 unit_bytes = block_size * row_bytes;
  for (i64 u = (i64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; u < units; u += warps) {
    const i64 head = u % heads, kv = (u / heads) % 2, layer = (u / (2 * heads)) % num_layers;
    const i64 block = blocks[u / (2 * heads * num_layers)];
    unsigned char* engine = reinterpret_cast<unsigned char*>(layers[layer]) + kv * kv_stride +
                            block * block_stride + head * head_stride;
    if (kGather) {
      copy_rows(engine, token_stride, staging + u * unit_bytes, row_bytes, block_size, row_bytes, lane, 32);
    } else {
      copy_rows(staging + u * unit_bytes, row_bytes, engine, token_stride, block_size, row_bytes, lane, 32);
    }
  }
}
