// How long one burst of rows takes to cross NVLink when both GPUs push to each other at once: the floor under the
// low-latency combine's send phase (EP2, T = 128: 512 rows of 14336 bytes = 7.3 MB each way).
//
// Both GPUs run the same kernel; every block waits until the peer's kernel has started (a flag word written over
// NVLink), stamps %globaltimer, pushes its share, makes its stores visible system-wide (every thread fences once at
// the end) and stamps again. A burst's time is the latest end minus the earliest start over the blocks of one GPU;
// the figure is the slower GPU's, median of 20 bursts. Columns (both GPUs pushing, except "rows one"):
//   rows     one warp per row (16-byte loads, kUnroll in flight per lane, 16-byte stores), 512 threads per block:
//            the combine send's shape
//   halves   each row split over two warps (twice the warps, half the bytes each)
//   stream   the same bytes as one grid-stride copy, 1024 threads per block, 4 loads in flight per thread
//   signal   rows, and after each row the warp adds 1 to one word at the peer with red.release.sys (the combine's
//            arrival signal: the fence waits for the row's stores to be acknowledged, then the atomic crosses); the
//            closing fence then also waits for the atomic
//   hbm      signal, with the source rows scattered over 516 MB and the L2 flushed before each burst (the combine's
//            expert outputs after a GEMM)
//   spread   signal to word row / 4 instead of one word (the combine's (token, sender) words hold ~4 rows each)
//   relaxed  spread with red.relaxed.sys and no fence: unordered (the row may land after its signal), timing only
// A second table times a full exchange: every warp sends its row and then receives the peer's row of the same
// index, so a burst ends when every row has been received and read (the receiver keeps kBatch 16-byte loads in flight
// per lane):
//   ordered  the row, then red.release.sys on word row / 4 at the peer; the receiver waits for its word, then reads
//   lines    LL128-style: the row as 120-byte payloads, each in a 128-byte line whose last 8 bytes carry the burst's
//            epoch (+7 % bytes, no fence); the receiver polls every line until its flag is the epoch. The payloads
//            are the source XOR the epoch and are checked: a line seen with its flag but not its payload counts as
//            torn (128-byte stores landing whole is what this protocol assumes)
// Build and run on a 2-GPU machine:
//   nvcc -O3 -std=c++17 -arch=sm_90a benchmarks/nvlink_burst.cu -o /tmp/burst && /tmp/burst
#include <cuda_runtime.h>

#include "bench_common.cuh"

#include <algorithm>
#include <cstdio>
#include <vector>


constexpr int kRowBytes = 14336;  // hidden 7168, BF16
constexpr int kUnroll = 7;

struct Stamps {
    unsigned long long first_start;  // atomicMin
    unsigned long long last_end;     // atomicMax
    unsigned long long bad;          // exchange: torn lines, wrong payloads or timed-out waits
};


// Every block: wait for the peer's start flag (block 0 of each GPU raises the peer's), then stamp.
__device__ void start(volatile unsigned* my_flag, unsigned* peer_flag, unsigned epoch, Stamps* st) {
    if (threadIdx.x == 0) {
        if (blockIdx.x == 0) atomicExch_system(peer_flag, epoch);
        const unsigned long long t0 = global_ns();
        while (*my_flag != epoch && global_ns() - t0 < 1000000000ull) {  // bounded: 1 s (the result is then absurd)
        }
        atomicMin(&st->first_start, global_ns());
    }
    __syncthreads();
}

__device__ void finish(Stamps* st) {
    __threadfence_system();  // this thread's stores acknowledged
    __syncthreads();
    if (threadIdx.x == 0) atomicMax(&st->last_end, global_ns());
}

// push_rows' mode bits: kSpread: the signal goes to word row / 4 (the combine's (token, sender) words hold ~4 rows
// each) instead of one word; kRelaxed: red.relaxed.sys without a fence (unordered: timing only).
constexpr int kHalves = 1, kSignal = 2, kScattered = 4, kSpread = 8, kRelaxed = 16;
constexpr int64_t kScatterRows = 36000;                   // 516 MB of source rows for kScattered

__global__ void __launch_bounds__(512) push_rows(char* dst, const char* src, int rows, int mode, volatile unsigned* my_flag,
                                                 unsigned* peer_flag, unsigned epoch, Stamps* st) {
    start(my_flag, peer_flag, epoch, st);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    const int parts = (mode & kHalves) ? 2 : 1;
    const int n16 = kRowBytes / 16, part16 = n16 / parts;
    for (int q = warp * gridDim.x + blockIdx.x; q < rows * parts; q += gridDim.x * warps) {
        const int row = q / parts, part = q % parts;
        const int64_t src_row = (mode & kScattered) ? int64_t(row) * 35 % kScatterRows : row;
        const int4* from = reinterpret_cast<const int4*>(src + src_row * kRowBytes) + part * part16;
        int4* to = reinterpret_cast<int4*>(dst + int64_t(row) * kRowBytes) + part * part16;
        for (int base = 0; base < part16; base += 32 * kUnroll) {
            int4 v[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int c = base + u * 32 + lane;
                if (c < part16) v[u] = __ldg(from + c);
            }
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int c = base + u * 32 + lane;
                if (c < part16) to[c] = v[u];
            }
        }
        if (mode & kSignal) {
            __syncwarp();
            auto* word = reinterpret_cast<unsigned long long*>(peer_flag) + 1 + ((mode & kSpread) ? row / 4 : 0);
            if (lane == 0 && (mode & kRelaxed))
                asm volatile("red.relaxed.sys.global.add.u64 [%0], 1;" ::"l"(word) : "memory");
            else if (lane == 0)
                asm volatile("red.release.sys.global.add.u64 [%0], 1;" ::"l"(word) : "memory");
        }
    }
    finish(st);
}

constexpr int kLineBytes = 128, kLinePayload = 120;
constexpr int kLines = (kRowBytes + kLinePayload - 1) / kLinePayload;  // 120 lines of a 14336-byte row
constexpr int kLineRowBytes = kLines * kLineBytes;                      // 15360 bytes on the wire
constexpr unsigned long long kWaitNs = 1000000000ull;                   // every wait: at most 1 s, then counted bad
constexpr int kBatch = 8;                                               // receive loads in flight per lane

__device__ __forceinline__ int4 ld_volatile_int4(const int4* p) {
    int4 v;
    asm volatile("ld.volatile.global.v4.s32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// 64-bit word `w` (of 8-byte words) of a row of GPU g's source: every byte is g + 1 (cudaMemset).
__device__ __forceinline__ unsigned long long source_word(int g) { return 0x0101010101010101ull * (g + 1); }

// mode: 0 = ordered, 1 = lines. Every warp sends row q then receives row q (q = its rows, grid-strided).
__global__ void __launch_bounds__(512) exchange_rows(char* dst, const char* inbox, int rows, int mode, int me,
                                                     volatile unsigned* my_flag, unsigned* peer_flag, unsigned epoch,
                                                     Stamps* st) {
    start(my_flag, peer_flag, epoch, st);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    const unsigned long long tag = epoch, mine = source_word(me) ^ tag, theirs = source_word(1 - me) ^ tag;
    unsigned long long bad = 0;
    for (int row = warp * gridDim.x + blockIdx.x; row < rows; row += gridDim.x * warps) {
        if (mode == 0) {
            int4* to = reinterpret_cast<int4*>(dst + int64_t(row) * kRowBytes);
            const int4 v = make_int4(int(mine), int(mine >> 32), int(mine), int(mine >> 32));
            for (int c = lane; c < kRowBytes / 16; c += 32) to[c] = v;
            __syncwarp();
            auto* word = reinterpret_cast<unsigned long long*>(peer_flag) + 1 + row / 4;
            if (lane == 0) asm volatile("red.release.sys.global.add.u64 [%0], 1;" ::"l"(word) : "memory");
            // Receive: this row's word at home counts the rows of its group of four.
            const unsigned long long want = min(4, rows - row / 4 * 4);
            volatile unsigned long long* home =
                reinterpret_cast<volatile unsigned long long*>(const_cast<unsigned*>(my_flag)) + 1 + row / 4;
            const unsigned long long t0 = global_ns();
            bool ok = true;
            if (lane == 0)
                while (*home < want)
                    if (global_ns() - t0 > kWaitNs) { ok = false; break; }
            ok = __shfl_sync(0xffffffffu, ok, 0);
            asm volatile("fence.acq_rel.sys;" ::: "memory");
            const int4* from = reinterpret_cast<const int4*>(inbox + int64_t(row) * kRowBytes);
            for (int base = 0; base < kRowBytes / 16; base += 32 * kBatch) {  // kBatch loads in flight per lane
                int4 v2[kBatch];
#pragma unroll
                for (int u = 0; u < kBatch; ++u) {
                    const int c = base + u * 32 + lane;
                    if (c < kRowBytes / 16) v2[u] = ld_volatile_int4(from + c);
                }
#pragma unroll
                for (int u = 0; u < kBatch; ++u) {
                    const int c = base + u * 32 + lane;
                    const unsigned long long lo = (unsigned long long)(unsigned)v2[u].x |
                                                  ((unsigned long long)(unsigned)v2[u].y << 32);
                    if (c < kRowBytes / 16 && lo != theirs) ++bad;
                }
            }
            if (!ok) ++bad;
        } else {
            // A warp stores 4 lines per instruction: lanes 8i..8i+7 cover line i, lane 8i+7 carries 8 payload
            // bytes and the flag.
            int4* to = reinterpret_cast<int4*>(dst + int64_t(row) * kLineRowBytes);
            const int j = lane % 8;
            for (int base = 0; base < kLines * 8; base += 32) {
                const int c = base + lane;  // 16-byte unit of the line row
                int4 v = make_int4(int(mine), int(mine >> 32), int(mine), int(mine >> 32));
                if (j == 7) v = make_int4(int(mine), int(mine >> 32), int(tag), int(tag >> 32));
                if (c < kLines * 8) to[c] = v;
            }
            const int4* from = reinterpret_cast<const int4*>(inbox + int64_t(row) * kLineRowBytes);
            const unsigned long long t0 = global_ns();
            constexpr int kUnits = kLines * 8;  // 16-byte units of the line row
            for (int base = 0; base < kUnits; base += 32 * kBatch) {  // kBatch loads in flight, reloaded until whole
                int4 v[kBatch];
                bool seen = false;
                while (true) {
#pragma unroll
                    for (int u = 0; u < kBatch; ++u) {
                        const int c = base + u * 32 + lane;
                        if (c < kUnits) v[u] = ld_volatile_int4(from + c);
                    }
                    bool lines_ok = true;
#pragma unroll
                    for (int u = 0; u < kBatch; ++u) {
                        const int c = base + u * 32 + lane;
                        const bool flag = c >= kUnits || j != 7 ||
                                          ((unsigned long long)(unsigned)v[u].z |
                                           ((unsigned long long)(unsigned)v[u].w << 32)) == tag;
                        // Lanes 8i..8i+6 take their line's flag from lane 8i+7 of the same load.
                        const unsigned flags = __ballot_sync(0xffffffffu, flag);
                        lines_ok = lines_ok && ((flags >> (lane / 8 * 8)) & 0xffu) == 0xffu;
                    }
                    if (__all_sync(0xffffffffu, lines_ok)) { seen = true; break; }
                    if (global_ns() - t0 > kWaitNs) break;
                }
#pragma unroll
                for (int u = 0; u < kBatch; ++u) {
                    const int c = base + u * 32 + lane;
                    const unsigned long long lo = (unsigned long long)(unsigned)v[u].x |
                                                  ((unsigned long long)(unsigned)v[u].y << 32);
                    if (c < kUnits && (!seen || lo != theirs)) ++bad;
                }
            }
        }
    }
    if (bad) atomicAdd(&st->bad, bad);
    finish(st);
}

__global__ void __launch_bounds__(1024) push_stream(int4* dst, const int4* src, size_t n, volatile unsigned* my_flag,
                                                    unsigned* peer_flag, unsigned epoch, Stamps* st) {
    start(my_flag, peer_flag, epoch, st);
    copy4_grid_stride(dst, src, n);
    finish(st);
}

struct Gpu {
    char* local;
    char* inbox;  // written by the peer; its first 4 bytes are the start flag, then the signal words (rows start at 4096)
    Stamps* stamps;
    cudaStream_t stream;
};

int main() {
    if (!have_two_gpus()) return 0;
    const int max_rows = 1024;
    const size_t bytes = size_t(max_rows) * kLineRowBytes + 4096;  // signal words first
    const size_t src_bytes = size_t(kScatterRows) * kRowBytes, flush_bytes = size_t(256) << 20;
    char* flush[2];
    Gpu gpus[2];
    int sms = 0;
    for (int g = 0; g < 2; ++g) {
        CHECK(cudaSetDevice(g));
        CHECK(cudaDeviceEnablePeerAccess(1 - g, 0));
        CHECK(cudaMalloc(&gpus[g].local, src_bytes));
        CHECK(cudaMalloc(&gpus[g].inbox, bytes));
        CHECK(cudaMalloc(&flush[g], flush_bytes));
        CHECK(cudaMemset(gpus[g].local, g + 1, src_bytes));
        CHECK(cudaMemset(gpus[g].inbox, 0, bytes));
        CHECK(cudaMalloc(&gpus[g].stamps, sizeof(Stamps)));
        CHECK(cudaStreamCreateWithFlags(&gpus[g].stream, cudaStreamNonBlocking));
        CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, g));
    }
    unsigned epoch = 0;
    unsigned long long bad = 0;  // exchange variants: summed over the bursts of the last burst() call
    // Median over 20 bursts of the slower GPU's span, in microseconds; both = false: GPU 0 pushes alone.
    // variant: a push_rows mode, or -1 for push_stream.
    auto burst = [&](int variant, int rows, bool both) -> double {
        std::vector<double> spans;
        bad = 0;
        for (int rep = 0; rep < 22; ++rep) {
            ++epoch;
            const int active = both ? 2 : 1;
            for (int g = 0; g < 2; ++g) {
                cudaSetDevice(g);
                Stamps init = {~0ull, 0ull, 0ull};
                cudaMemcpyAsync(gpus[g].stamps, &init, sizeof(init), cudaMemcpyHostToDevice, gpus[g].stream);
                if (variant >= 0 && variant < 100 && (variant & kScattered))
                    cudaMemsetAsync(flush[g], rep, flush_bytes, gpus[g].stream);
                cudaMemsetAsync(gpus[g].inbox, 0, 4096, gpus[g].stream);  // start flag and signal words
                cudaStreamSynchronize(gpus[g].stream);
            }
            for (int g = 0; g < 2; ++g) {
                cudaSetDevice(g);
                Gpu& me = gpus[g];
                Gpu& peer = gpus[1 - g];
                auto* my_flag = reinterpret_cast<volatile unsigned*>(me.inbox);
                auto* peer_flag = reinterpret_cast<unsigned*>(peer.inbox);
                char* dst = peer.inbox + 4096;
                const int my_rows = (g < active) ? rows : 0;  // an idle GPU still raises the flag
                if (variant >= 100)
                    exchange_rows<<<sms, 512, 0, me.stream>>>(dst, me.inbox + 4096, my_rows, variant - 100, g, my_flag,
                                                              peer_flag, epoch, me.stamps);
                else if (variant < 0)
                    push_stream<<<sms, 1024, 0, me.stream>>>(reinterpret_cast<int4*>(dst),
                                                             reinterpret_cast<const int4*>(me.local),
                                                             size_t(my_rows) * kRowBytes / 16, my_flag, peer_flag,
                                                             epoch, me.stamps);
                else
                    push_rows<<<sms, 512, 0, me.stream>>>(dst, me.local, my_rows, variant, my_flag, peer_flag, epoch,
                                                          me.stamps);
            }
            double slowest = 0.0;
            for (int g = 0; g < active; ++g) {
                cudaSetDevice(g);
                cudaStreamSynchronize(gpus[g].stream);
                Stamps s;
                cudaMemcpy(&s, gpus[g].stamps, sizeof(s), cudaMemcpyDeviceToHost);
                slowest = std::max(slowest, (s.last_end - s.first_start) * 1e-3);
                bad += s.bad;
            }
            if (rep >= 2) spans.push_back(slowest);
        }
        std::sort(spans.begin(), spans.end());
        return spans[spans.size() / 2];
    };
    std::printf("burst span (first block start -> last block's fence done), us, median of 20; %d SMs per GPU\n", sms);
    std::printf("%5s %8s %9s | both directions: %6s %9s %9s %9s %9s %9s %9s\n", "rows", "MB", "rows one", "rows",
                "halves", "stream", "signal", "hbm", "spread", "relaxed");
    for (int rows : {64, 128, 256, 512, 768, 1024}) {
        std::printf("%5d %8.2f %9.2f | %23.2f", rows, rows * double(kRowBytes) / 1e6, burst(0, rows, false),
                    burst(0, rows, true));
        for (int v : {kHalves, -1, kSignal, kSignal | kScattered, kSignal | kSpread, kSignal | kSpread | kRelaxed})
            std::printf(" %9.2f", burst(v, rows, true));
        std::printf("\n");
    }
    std::printf("\nexchange (each row sent, then the peer's row of the same index received and read), us\n");
    std::printf("%5s %9s %9s %11s\n", "rows", "ordered", "lines", "bad o/l");
    for (int rows : {128, 256, 512, 1024}) {
        const double ordered = burst(100, rows, true);
        const unsigned long long bad_ordered = bad;
        const double lines = burst(101, rows, true);
        std::printf("%5d %9.2f %9.2f %5llu/%-5llu\n", rows, ordered, lines, bad_ordered, bad);
    }
    for (int g = 0; g < 2; ++g) {
        CHECK(cudaSetDevice(g));
        CHECK(cudaGetLastError());
        CHECK(cudaDeviceSynchronize());
    }
    return 0;
}
