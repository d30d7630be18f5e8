// Just enough of CUDA to run our kernels on the CPU, one (block, thread) after another, so their
// index arithmetic is tested without a GPU. Valid because the page kernels use no shared memory,
// no __syncthreads and no atomics: each thread's work is independent of the others'.
#pragma once
#include <cstdint>

struct dim3_emulated { unsigned x = 0, y = 0, z = 0; };
static dim3_emulated blockIdx, threadIdx, blockDim, gridDim;
struct alignas(16) uint4 { unsigned int x, y, z, w; };

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
