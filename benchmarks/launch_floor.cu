// Launch floor of an LL-shaped kernel on one GPU: how long a grid of one CTA per SM x 512 threads that does almost
// nothing occupies the GPU, by launch kind. The low-latency kernels' fixed cost (~9 us per hook launch, ~17 us per
// fused kernel in the simulator fit) is compared against this floor.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a benchmarks/launch_floor.cu -o launch_floor
//   ./launch_floor            (prints one line per variant; --json FILE writes them too)
//
// Per variant, 200 launches, each behind a ~50 us spin kernel so the host is ahead of the GPU:
//   event us  - CUDA events recorded right before and after the launch (what a caller's events see);
//   span us   - last CTA exit minus first CTA entry, from %globaltimer inside the kernel;
//   entry us  - last CTA entry minus first CTA entry (how long the grid takes to start everywhere).
// Variants: plain launch; cooperative attribute; cooperative with a 160 KB dynamic shared-memory ceiling (as the LL
// kernels set it) and 2 KB requested; the same after an L2 flush (256 MB memset) instead of the spin kernel.
#include <cuda_runtime.h>

#include "bench_common.cuh"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>


// stamps[0] = min entry, [1] = max entry, [2] = max exit (reset by the host before each launch).
__global__ void __launch_bounds__(512, 1) floor_kernel(unsigned long long* stamps, int* sink) {
    extern __shared__ int smem[];
    const unsigned long long entry = global_ns();
    if (threadIdx.x == 0) {
        atomicMin(stamps, entry);
        atomicMax(stamps + 1, entry);
    }
    smem[threadIdx.x] = threadIdx.x;
    __syncthreads();
    if (smem[(threadIdx.x + 1) % blockDim.x] == -1) *sink = 1;  // keeps the shared store
    __syncthreads();
    if (threadIdx.x == 0) atomicMax(stamps + 2, global_ns());
}

__global__ void spin_kernel(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {
    }
}

struct Result {
    std::string name;
    double event_us, span_us, entry_us;
};

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main(int argc, char** argv) {
    const char* json = nullptr;
    for (int i = 1; i < argc; ++i)
        if (std::strcmp(argv[i], "--json") == 0 && i + 1 < argc) json = argv[++i];
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    unsigned long long* stamps;
    int* sink;
    CHECK(cudaMalloc(&stamps, 3 * sizeof(unsigned long long)));
    CHECK(cudaMalloc(&sink, sizeof(int)));
    void* flush;
    const size_t flush_bytes = 256u << 20;
    CHECK(cudaMalloc(&flush, flush_bytes));
    cudaStream_t stream;
    CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaEvent_t before, after;
    CHECK(cudaEventCreate(&before));
    CHECK(cudaEventCreate(&after));
    const unsigned long long init[3] = {~0ull, 0ull, 0ull};

    std::vector<Result> results;
    for (int variant = 0; variant < 4; ++variant) {
        const bool cooperative = variant >= 1, big_smem = variant >= 2, flushed = variant == 3;
        CHECK(cudaFuncSetAttribute(floor_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   big_smem ? 160 * 1024 : 48 * 1024));
        std::vector<double> ev, span, entry;
        for (int it = 0; it < 200; ++it) {
            CHECK(cudaMemcpyAsync(stamps, init, sizeof(init), cudaMemcpyHostToDevice, stream));
            if (flushed) CHECK(cudaMemsetAsync(flush, it & 0xff, flush_bytes, stream));
            else spin_kernel<<<1, 32, 0, stream>>>(100000);  // ~50 us: the host gets ahead
            CHECK(cudaEventRecord(before, stream));
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = dim3(sms);
            cfg.blockDim = dim3(512);
            cfg.dynamicSmemBytes = 2048;
            cfg.stream = stream;
            cudaLaunchAttribute attr[1];
            attr[0].id = cudaLaunchAttributeCooperative;
            attr[0].val.cooperative = 1;
            cfg.attrs = attr;
            cfg.numAttrs = cooperative ? 1 : 0;
            CHECK(cudaLaunchKernelEx(&cfg, floor_kernel, stamps, sink));
            CHECK(cudaEventRecord(after, stream));
            unsigned long long got[3];
            CHECK(cudaMemcpyAsync(got, stamps, sizeof(got), cudaMemcpyDeviceToHost, stream));
            CHECK(cudaStreamSynchronize(stream));
            float ms = 0.0f;
            CHECK(cudaEventElapsedTime(&ms, before, after));
            if (it < 20) continue;  // warm-up
            ev.push_back(ms * 1e3);
            span.push_back((got[2] - got[0]) / 1e3);
            entry.push_back((got[1] - got[0]) / 1e3);
        }
        static const char* names[] = {"plain", "cooperative", "cooperative+160KB", "cooperative+160KB after flush"};
        results.push_back({names[variant], median(ev), median(span), median(entry)});
    }
    std::printf("%-32s %9s %9s %9s   (%d CTAs x 512 threads, medians of 180)\n", "variant", "event us", "span us",
                "entry us", sms);
    for (const Result& r : results)
        std::printf("%-32s %9.2f %9.2f %9.2f\n", r.name.c_str(), r.event_us, r.span_us, r.entry_us);
    if (json != nullptr) {
        FILE* f = std::fopen(json, "w");
        if (f == nullptr) return 1;
        std::fprintf(f, "{\"ctas\": %d, \"threads\": 512, \"variants\": [", sms);
        for (size_t i = 0; i < results.size(); ++i)
            std::fprintf(f, "%s{\"name\": \"%s\", \"event_us\": %.3f, \"span_us\": %.3f, \"entry_us\": %.3f}",
                         i ? ", " : "", results[i].name.c_str(), results[i].event_us, results[i].span_us,
                         results[i].entry_us);
        std::fprintf(f, "]}\n");
        std::fclose(f);
    }
    return 0;
}
