// Pieces shared by the stand-alone CUDA benchmarks (launch_floor.cu, nvlink_bidir.cu, nvlink_burst.cu).
#pragma once
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

// A failing CUDA call ends the benchmark with the call and the error.
#define CHECK(call)                                                                                  \
    do {                                                                                             \
        cudaError_t err_ = (call);                                                                   \
        if (err_ != cudaSuccess) {                                                                   \
            std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
            std::exit(1);                                                                            \
        }                                                                                            \
    } while (0)

// The two-GPU benchmarks: false (and a line saying why) with fewer than two GPUs.
inline bool have_two_gpus() {
    int count = 0;
    CHECK(cudaGetDeviceCount(&count));
    if (count < 2) std::printf("need 2 GPUs, found %d\n", count);
    return count >= 2;
}

__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Grid-stride copy of n 16-byte words, four independent loads per thread before the four stores.
__device__ __forceinline__ void copy4_grid_stride(int4* __restrict__ dst, const int4* __restrict__ src, size_t n) {
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        int4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) v[u] = src[i + u * stride];
#pragma unroll
        for (int u = 0; u < 4; ++u) dst[i + u * stride] = v[u];
    }
    for (; i < n; i += stride) dst[i] = src[i];
}
