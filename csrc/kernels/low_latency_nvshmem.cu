// Low-latency dispatch / combine kernels over NVSHMEM (see low_latency.cuh for the data path and the carving).
//
// Per call, half h and epoch n (a per-CTA copy, incremented by every call on that half, so CUDA-graph replays stay
// consistent):
//   dispatch send   every CTA counts the whole top-k (shared-memory histograms; no atomics across CTAs), writes the
//                   per-(destination, local expert) counts as (n << 32 | count) words first, then casts its tile of
//                   tokens once and stores each message to every destination rank that holds one of the token's
//                   experts, then adds its message count to the destination's per-source arrival word.
//   dispatch recv   every CTA waits for all count words of epoch n, derives the per-(expert, source) blocks in
//                   source order, waits until each source's arrival word reaches its private base + messages, and
//                   expands its share of the messages into the packed outputs.
//   combine send    one warp per received row writes the row into the token owner's [expert][token] slot and adds 1
//                   to the token owner's arrival word (token, sender).
//   combine recv    one CTA per token; warp 0's lanes wait in parallel, one per distinct expert owner, for that
//                   owner's rows, consume them (subtract), and (shrink) mask an owner that times out; then the CTA
//                   reduces sum_k w_k * y_k over the arrived entries in fp32 in ascending k, rounding to BF16 once.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstring>
#include <algorithm>
#include <mutex>

#include "exception.cuh"
#include "error_record.cuh"
#include "low_latency.cuh"
#include "ptx.cuh"

namespace deep_ep {
namespace kernels {
namespace ll {

// ---------------------------------------------------------------------------------------------------------------
// Carving
// ---------------------------------------------------------------------------------------------------------------

namespace {
constexpr int64_t kAlign = 128;
constexpr int64_t kGlobalBytes = 128;     // barrier word at 0, abort word at 8
constexpr int64_t kBarrierOffset = 0;
constexpr int64_t kAbortOffset = 8;
// Private workspace.
constexpr int64_t kWsClaim = 0;
constexpr int64_t kWsBarrierBase = 8;
constexpr int64_t kWsEpochs = 256;        // u32 [kMaxBlocks][2]
constexpr int64_t kWsBases = 2048;        // u64 [kMaxBlocks][2][R]
constexpr int kHeaderInts = 1 + kMaxTopk;
__host__ __device__ inline int64_t workspace_end(int num_ranks) {
    return kWsBases + int64_t(kMaxBlocks) * 2 * num_ranks * 8;
}

int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }
}  // namespace

int64_t workspace_bytes(int num_ranks) { return workspace_end(num_ranks); }

Layout make_layout(int num_ranks, int num_tokens_max, int hidden, int num_experts, int64_t num_rdma_bytes) {
    DEEP_EP_CHECK_ARG(num_ranks >= 1 && num_ranks <= kMaxRanks, "num_ranks must be in [1, ", kMaxRanks, "], got ",
                      num_ranks);
    DEEP_EP_CHECK_ARG(hidden % kFp8Block == 0 && hidden >= kMinHidden && hidden <= kMaxHidden,
                      "hidden must be a multiple of 128 in [", kMinHidden, ", ", kMaxHidden, "], got ", hidden);
    DEEP_EP_CHECK_ARG(num_tokens_max >= 1 && num_tokens_max <= kMaxTokens,
                      "num_max_dispatch_tokens_per_rank must be in [1, ", kMaxTokens, "], got ", num_tokens_max);
    DEEP_EP_CHECK_ARG(num_experts >= 1 && num_experts <= kMaxExperts && num_experts % num_ranks == 0,
                      "num_experts must be a multiple of num_ranks (", num_ranks, ") and <= ", kMaxExperts, ", got ",
                      num_experts);
    Layout l{};
    l.num_ranks = num_ranks;
    l.num_tokens_max = num_tokens_max;
    l.hidden = hidden;
    l.num_experts = num_experts;
    l.num_local = num_experts / num_ranks;
    l.num_topk_max = kMaxTopk;
    const int64_t num_scales = hidden / kFp8Block;
    l.cmsg = num_scales * 4 + int64_t(hidden) * 2;
    l.header_bytes = align_up(kHeaderInts * 4, 16);
    l.dmsg = l.header_bytes + std::max<int64_t>(int64_t(hidden) * 2, hidden + num_scales * 4);
    const int64_t R = num_ranks, T = num_tokens_max, E = num_experts, L = l.num_local;
    l.count_off = 0;
    l.darrive_off = l.count_off + R * (L + 1) * 8;
    l.carrive_off = l.darrive_off + R * 8;
    l.data_off = align_up(l.carrive_off + T * R * 8, kAlign);
    l.csend_off = l.data_off;
    l.crecv_off = l.csend_off + align_up(E * T * l.cmsg, kAlign);
    const int64_t combine_end = l.crecv_off + E * T * int64_t(hidden) * 2;  // (expert, token) words: csend tails
    l.drecv_off = l.data_off;
    l.dstage_off = l.drecv_off + R * T * l.dmsg;
    // A world of one rank has no remote peer (nvshmem_ptr resolves the rank itself), so no dispatch staging.
    const int64_t dispatch_end = l.dstage_off + (R > 1 ? T * l.dmsg : 0);
    const int64_t half = align_up(std::max(combine_end, dispatch_end), kAlign);
    l.half_offset[0] = kGlobalBytes;
    l.half_offset[1] = kGlobalBytes + half;
    l.total_bytes = kGlobalBytes + 2 * half;
    DEEP_EP_CHECK_ARG(l.total_bytes <= num_rdma_bytes, "num_rdma_bytes (", num_rdma_bytes,
                      ") is too small for the CUDA low-latency kernels: num_max_dispatch_tokens_per_rank=",
                      num_tokens_max, ", hidden=", hidden, ", num_experts=", num_experts, ", num_ranks=", num_ranks,
                      " need ", l.total_bytes, " bytes");
    return l;
}

const char* ll_phase_name(int32_t phase) {
    switch (phase) {
        case kPhaseLlDispatchWaitCounts: return "low_latency_dispatch wait counts";
        case kPhaseLlDispatchWaitData: return "low_latency_dispatch wait data";
        case kPhaseLlCombineWaitToken: return "low_latency_combine wait token";
        case kPhaseLlBarrierWait: return "low_latency barrier wait";
        case kPhaseLlBadRouting: return "low_latency_dispatch bad routing";
        default: return "unknown phase";
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Device primitives
// ---------------------------------------------------------------------------------------------------------------

namespace {

// 16 bytes at a 4-byte-aligned address. Combine send slots have a row stride of H/128*4 + 2H bytes (the spec's
// zero-copy layout), a multiple of 16 only when H % 512 == 0; other hidden sizes read / write those rows in words.
__device__ __forceinline__ int4 ld_nc_int4_words(const int4* ptr) {
    const int* q = reinterpret_cast<const int*>(ptr);
    return make_int4(__ldg(q), __ldg(q + 1), __ldg(q + 2), __ldg(q + 3));
}
__device__ __forceinline__ void st_int4_words(int4* ptr, const int4& v) {
    int* q = reinterpret_cast<int*>(ptr);
    q[0] = v.x;
    q[1] = v.y;
    q[2] = v.z;
    q[3] = v.w;
}

__device__ __forceinline__ char* half_base(const Context& ctx, void* base, int half) {
    return static_cast<char*>(base) + ctx.layout.half_start(half);
}

__device__ __forceinline__ int64_t load_topk(const void* topk, int bytes, int64_t i) {
    return bytes == 8 ? static_cast<const int64_t*>(topk)[i] : static_cast<const int32_t*>(topk)[i];
}

__device__ __forceinline__ bool is_masked(const Context& ctx, int r) {
    return ctx.mask != nullptr && *reinterpret_cast<volatile int*>(ctx.mask + r) != 0;
}

// First failing thread of this rank fills the record (claim word in the workspace), then raises every peer's abort.
static __device__ __noinline__ void report(const Context ctx, int32_t code, int32_t kernel, int32_t phase,
                                           int32_t peer, int32_t channel, int64_t expected, int64_t observed,
                                           int64_t elapsed) {
    auto* claim = reinterpret_cast<unsigned int*>(static_cast<char*>(ctx.workspace) + kWsClaim);
    fill_error_record(ctx.error, claim, code, kernel, phase, ctx.rank, peer, channel, ctx.call_seq, expected, observed,
                      elapsed);
    const uint64_t word = (uint64_t(code) << 32) | uint64_t(ctx.rank + 1);
    for (int r = 0; r < ctx.num_ranks; ++r) {
        if (ctx.peers[r] != nullptr) {
            atomicCAS(reinterpret_cast<unsigned long long*>(static_cast<char*>(ctx.peers[r]) + kAbortOffset), 0ull,
                      static_cast<unsigned long long>(word));
        } else {
            nvshmemx_signal_op(reinterpret_cast<uint64_t*>(static_cast<char*>(ctx.sym) + kAbortOffset), word,
                               NVSHMEM_SIGNAL_SET, r);
        }
    }
    __threadfence_system();
}

// kWaitMasked: the awaited peer was masked meanwhile (by another thread's timeout in shrink mode).
enum WaitResult { kWaitOk = 0, kWaitTimeout = 1, kWaitAborted = 2, kWaitMasked = 3 };

// Bounded spin until pred(value) holds on a local symmetric word. Every 64 spins: abort word, deadline and, when
// `watch_peer` >= 0, its mask bit (so waits on a peer that another CTA has just masked stop within ~64 spins
// instead of each running its own full timeout).
// Uses nvshmem_uint64_test when some peer is remote (its success path runs the proxy transports' consistency op).
template <typename Pred>
__device__ __forceinline__ WaitResult wait_word(const Context& ctx, uint64_t* addr, Pred pred, uint64_t* seen,
                                                uint64_t* elapsed_ns, int watch_peer = -1) {
    const uint64_t* abort = reinterpret_cast<const uint64_t*>(static_cast<char*>(ctx.sym) + kAbortOffset);
    const uint64_t start = global_timer_ns();
    for (uint64_t spins = 0;; ++spins) {
        const uint64_t v = ld_acquire_sys_u64(addr);
        if (pred(v)) {
            if (!ctx.all_p2p) nvshmem_uint64_test(addr, NVSHMEM_CMP_EQ, v);
            *seen = v;
            *elapsed_ns = global_timer_ns() - start;
            return kWaitOk;
        }
        if ((spins & 63) == 63) {
            const uint64_t elapsed = global_timer_ns() - start;
            *seen = v;
            *elapsed_ns = elapsed;
            if (ld_acquire_sys_u64(abort) != 0) return kWaitAborted;
            if (watch_peer >= 0 && is_masked(ctx, watch_peer)) return kWaitMasked;
            if (elapsed > ctx.timeout_ns) return kWaitTimeout;
            if (spins > 4096) __nanosleep(64);
        }
    }
}

// Handles a failed wait: with shrink, masks `peer` and returns true (the caller continues without it); otherwise
// reports (timeout or peer aborted) and returns false.
__device__ bool on_wait_failure(const Context& ctx, WaitResult res, int kernel, int phase, int peer, int channel,
                                int64_t expected, uint64_t seen, uint64_t elapsed) {
    if (res == kWaitTimeout && ctx.mask != nullptr && peer >= 0) {
        atomicExch(ctx.mask + peer, 1);
        return true;
    }
    if (res == kWaitAborted) {
        const uint64_t word =
            ld_acquire_sys_u64(reinterpret_cast<const uint64_t*>(static_cast<char*>(ctx.sym) + kAbortOffset));
        report(ctx, kErrorPeerAborted, kernel, phase, static_cast<int32_t>(word & 0xffffffffu) - 1, channel,
               expected, static_cast<int64_t>(seen), static_cast<int64_t>(elapsed));
    } else {
        report(ctx, kErrorTimeout, kernel, phase, peer, channel, expected, static_cast<int64_t>(seen),
               static_cast<int64_t>(elapsed));
    }
    return false;
}

// Adds `value` to the word at `offset` of PE `pe` (NVLink store or NVSHMEM signal), release-ordered after the
// caller's prior writes (and after whatever the caller observed through a barrier).
__device__ __forceinline__ void signal_add(const Context& ctx, int pe, int64_t offset, uint64_t value) {
    if (ctx.peers[pe] != nullptr) {
        red_add_release_sys_u64(reinterpret_cast<uint64_t*>(static_cast<char*>(ctx.peers[pe]) + offset), value);
    } else {
        nvshmem_fence();
        nvshmemx_signal_op(reinterpret_cast<uint64_t*>(static_cast<char*>(ctx.sym) + offset), value,
                           NVSHMEM_SIGNAL_ADD, pe);
    }
}

__device__ __forceinline__ float bf16_to_float(uint16_t bits) { return __uint_as_float(uint32_t(bits) << 16); }
__device__ __forceinline__ uint16_t float_to_bf16(float v) {
    __nv_bfloat16 b = __float2bfloat16_rn(v);
    return *reinterpret_cast<uint16_t*>(&b);
}

// acc[i] += w * (BF16 value i of `raw`), i < 8: the product rounded, then the sum (no FMA), as the spec's formula. A
// 32-bit word holds values 2i (low half) and 2i + 1 (high half): one shift or one mask each.
__device__ __forceinline__ void add_weighted_bf16x8(float* acc, float w, const int4& raw) {
    const uint32_t word[4] = {uint32_t(raw.x), uint32_t(raw.y), uint32_t(raw.z), uint32_t(raw.w)};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        acc[2 * i] = __fadd_rn(acc[2 * i], __fmul_rn(w, __uint_as_float(word[i] << 16)));
        acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], __fmul_rn(w, __uint_as_float(word[i] & 0xffff0000u)));
    }
}

// ceil(log2(v)) from the float bits (positive normal v), as deep_ep.numerics.ceil_log2_bits.
__device__ __forceinline__ int ceil_log2_bits(float v) {
    const uint32_t bits = __float_as_uint(v);
    return int((bits >> 23) & 0xff) - 127 + ((bits & 0x7fffff) != 0 ? 1 : 0);
}
__device__ __forceinline__ float exp2_int(int e) { return __uint_as_float(uint32_t(e + 127) << 23); }

// ---------------------------------------------------------------------------------------------------------------
// LogFMT-10 (spec §11.3, numerics.logfmt_roundtrip). A row keeps the BF16 slot size (2H bytes); chunk c covers bytes
// [2 * c0, 2 * (c0 + cc)). An encoded chunk holds, per 16-channel group, 5 words (16 nine-bit codes from bit 0, 16
// sign bits in the upper half of word 4), then its blocks' (bf16 amax, bf16 amin) pairs; a raw chunk holds BF16.
// Bit c of the row's flag word says whether chunk c is encoded (chunks <= 16384 / 512 = 32).
// ---------------------------------------------------------------------------------------------------------------

constexpr float kLogfmtSteps = 510.0f;

__device__ __forceinline__ int logfmt_chunk(int hidden) { return 32 * (hidden % 1024 == 0 ? 4 : 2) * 8; }

struct LogParams {
    float lm, step, bias;
};

__device__ __forceinline__ LogParams logfmt_params(float la, float lm) {
    LogParams p;
    p.lm = lm;
    p.step = __fdiv_rn(__fsub_rn(la, lm), kLogfmtSteps);
    p.bias = __fdiv_rn(log2f(__fdiv_rn(__fadd_rn(1.0f, exp2f(p.step)), 2.0f)), p.step);
    return p;
}

__device__ __forceinline__ bool logfmt_block_ok(float amax, float amin, float* la, float* lm) {
    *la = log2f(amax);
    *lm = fmaxf(log2f(amin), __fsub_rn(*la, 32.0f));
    return *la < 0.0f && *lm < *la;
}

// One warp encodes the BF16 row `src` (H channels) into `dst` (2H bytes); returns the chunk flag word.
__device__ uint32_t logfmt_encode_row(const uint16_t* src, char* dst, int hidden, int lane) {
    const int chunk = logfmt_chunk(hidden);
    uint32_t flags = 0;
    for (int c0 = 0, ci = 0; c0 < hidden; c0 += chunk, ++ci) {
        const int groups = min(chunk, hidden - c0) / 16;
        char* region = dst + int64_t(c0) * 2;
        float vals[2][16];
        float la[2] = {0.0f, 0.0f}, lm[2] = {0.0f, 0.0f}, amax[2], amin[2];
        bool present[2], ok = true;
        for (int q = 0; q < 2; ++q) {
            const int g = lane + 32 * q;
            present[q] = g < groups;
            amax[q] = 0.0f;
            amin[q] = INFINITY;
            if (present[q]) {
                const int4* p = reinterpret_cast<const int4*>(src + c0 + g * 16);
                int4 raw[2] = {ld_nc_int4(p), ld_nc_int4(p + 1)};
                const uint16_t* hv = reinterpret_cast<const uint16_t*>(raw);
                for (int v = 0; v < 16; ++v) {
                    vals[q][v] = bf16_to_float(hv[v]);
                    amax[q] = fmaxf(amax[q], fabsf(vals[q][v]));
                    amin[q] = fminf(amin[q], fabsf(vals[q][v]));
                }
            }
            // A 128-channel block = 8 consecutive groups = 8 consecutive lanes.
            for (int m = 1; m < 8; m <<= 1) {
                amax[q] = fmaxf(amax[q], __shfl_xor_sync(0xffffffffu, amax[q], m));
                amin[q] = fminf(amin[q], __shfl_xor_sync(0xffffffffu, amin[q], m));
            }
            if (present[q]) ok &= logfmt_block_ok(amax[q], amin[q], &la[q], &lm[q]);
        }
        const bool encode = __all_sync(0xffffffffu, ok);
        flags |= encode ? (1u << ci) : 0u;
        for (int q = 0; q < 2; ++q) {
            const int g = lane + 32 * q;
            if (!present[q]) continue;
            if (!encode) {
                // Raw chunk. `dst` is a send slot (stride H/128*4 + 2H: 4-byte aligned only when H % 512 != 0) on
                // the put path, a 16-byte aligned receive slot on the NVLink path.
                const int4* p = reinterpret_cast<const int4*>(src + c0 + g * 16);
                int4* o = reinterpret_cast<int4*>(region + g * 32);
                const int4 v0 = ld_nc_int4(p), v1 = ld_nc_int4(p + 1);
                if ((reinterpret_cast<uintptr_t>(o) & 15) == 0) {
                    o[0] = v0;
                    o[1] = v1;
                } else {
                    st_int4_words(o, v0);
                    st_int4_words(o + 1, v1);
                }
                continue;
            }
            if (g % 8 == 0) {
                const uint32_t pair = uint32_t(float_to_bf16(amax[q])) | (uint32_t(float_to_bf16(amin[q])) << 16);
                reinterpret_cast<uint32_t*>(region + groups * 20)[g / 8] = pair;
            }
            const LogParams prm = logfmt_params(la[q], lm[q]);
            uint32_t words[5] = {0, 0, 0, 0, 0};
            for (int v = 0; v < 16; ++v) {
                const float mag = fabsf(vals[q][v]);
                const float pos =
                    __fsub_rn(__fadd_rn(__fdiv_rn(__fsub_rn(log2f(mag), prm.lm), prm.step), 2.0f), prm.bias);
                const float code_f = fminf(floorf(fmaxf(pos, 0.0f)), kLogfmtSteps + 1.0f);
                const uint32_t code = static_cast<uint32_t>(code_f);
                const int bit = 9 * v;
                words[bit / 32] |= code << (bit % 32);
                if (bit % 32 > 23) words[bit / 32 + 1] |= code >> (32 - bit % 32);
                if (signbit(vals[q][v])) words[4] |= 1u << (16 + v);
            }
            uint32_t* o = reinterpret_cast<uint32_t*>(region + g * 20);
            for (int w = 0; w < 5; ++w) o[w] = words[w];
        }
    }
    return flags;
}

// Decodes the 16 channels of group `gc` (channels [16 gc, 16 gc + 16)) of a received LogFMT row to BF16-rounded floats.
__device__ __forceinline__ void logfmt_decode_group(const char* row, uint32_t flags, int hidden, int gc, float* out) {
    const int chunk = logfmt_chunk(hidden);
    const int c = gc * 16, ci = c / chunk, c0 = ci * chunk;
    const char* region = row + int64_t(c0) * 2;
    const int g = (c - c0) / 16;
    if (((flags >> ci) & 1u) == 0) {
        const int4* p = reinterpret_cast<const int4*>(region + g * 32);
        int4 raw[2] = {ld_ring_int4(p), ld_ring_int4(p + 1)};
        const uint16_t* hv = reinterpret_cast<const uint16_t*>(raw);
        for (int v = 0; v < 16; ++v) out[v] = bf16_to_float(hv[v]);
        return;
    }
    const int groups = min(chunk, hidden - c0) / 16;
    const uint32_t pair = static_cast<uint32_t>(ld_ring_int(reinterpret_cast<const int*>(region + groups * 20) + g / 8));
    float la, lm;
    logfmt_block_ok(bf16_to_float(pair & 0xffff), bf16_to_float(pair >> 16), &la, &lm);
    const LogParams prm = logfmt_params(la, lm);
    uint32_t words[5];
    for (int w = 0; w < 5; ++w) words[w] = static_cast<uint32_t>(ld_ring_int(reinterpret_cast<const int*>(region + g * 20) + w));
    for (int v = 0; v < 16; ++v) {
        const int bit = 9 * v;
        uint32_t code = words[bit / 32] >> (bit % 32);
        if (bit % 32 > 23) code |= words[bit / 32 + 1] << (32 - bit % 32);
        code &= 0x1ffu;
        float value = 0.0f;
        if (code != 0) value = exp2f(__fadd_rn(__fmul_rn(float(code) - 1.0f, prm.step), prm.lm));
        if ((words[4] >> (16 + v)) & 1u) value = -value;
        out[v] = bf16_to_float(float_to_bf16(value));
    }
}

}  // namespace

// The kernels have external linkage so that profilers show readable names (deep_ep::kernels::ll::ll_*_kernel<N>).

// ---------------------------------------------------------------------------------------------------------------
// Dispatch
// ---------------------------------------------------------------------------------------------------------------

constexpr int kMaxTile = 64;

struct DispatchShared {
    int plan_entry[kMaxTile][kMaxTopk];  // per tile token, per k: (expert << 16 | row) or -1
    int plan_dst[kMaxTile][kMaxTopk];    // distinct destination ranks of the token
    int plan_slot[kMaxTile][kMaxTopk];   // message slot of the token at that destination
    int plan_ndst[kMaxTile];
    uint32_t epoch;
    int failed;
};

// kPhases is part of the kernel's name, so profilers tell the send (1), receive (2) and fused (3) launches apart.
template <int kPhases>
__global__ void __launch_bounds__(kThreads, 1) ll_dispatch_kernel(Context ctx, DispatchArgs a) {
    extern __shared__ int4 dyn_smem4[];
    int* dyn = reinterpret_cast<int*>(dyn_smem4);
    __shared__ DispatchShared sh;
    const Layout& lay = ctx.layout;
    const int R = ctx.num_ranks, me = ctx.rank, E = lay.num_experts, L = lay.num_local, T = lay.num_tokens_max;
    const int H = lay.hidden, S = H / kFp8Block, RT = R * T, K = a.num_topk, N = a.num_tokens;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, b = blockIdx.x, nb = gridDim.x;
    const int h = a.half;
    char* my_half = half_base(ctx, ctx.sym, h);
    uint32_t* epoch_ptr = reinterpret_cast<uint32_t*>(static_cast<char*>(ctx.workspace) + kWsEpochs) + b * 2 + h;
    uint64_t* bases = reinterpret_cast<uint64_t*>(static_cast<char*>(ctx.workspace) + kWsBases) + (int64_t(b) * 2 + h) * R;
    const int64_t payload_bytes = a.use_fp8 ? H + S * 4 : int64_t(H) * 2;
    const int64_t msg_bytes = lay.header_bytes + payload_bytes;
    if (tid == 0) {
        sh.epoch = (kPhases & kPhaseSend) ? *epoch_ptr + 1 : *epoch_ptr;
        if (kPhases & kPhaseSend) *epoch_ptr = sh.epoch;
        sh.failed = 0;
    }
    __syncthreads();
    const uint32_t epoch = sh.epoch;

    if (kPhases & kPhaseSend) {
        int* tot_e = dyn;            // [E] entries per expert (all tokens)
        int* pre_e = tot_e + E;      // [E] entries per expert before the current tile token (running)
        int* tot_r = pre_e + E;      // [R] messages per destination (all tokens)
        int* pre_r = tot_r + R;      // [R] messages per destination before the current tile token (running)
        int* sent = pre_r + R;       // [R] messages this CTA sends per destination
        for (int i = tid; i < 2 * E + 3 * R; i += kThreads) dyn[i] = 0;
        __syncthreads();
        const int tile = (N + nb - 1) / nb;
        const int tile_begin = min(N, b * tile), tile_end = min(N, tile_begin + tile);
        // A warp takes whole tokens (32 / K of them), a lane one (token, k) entry; the first lane of each
        // (token, destination) group counts the token's message to that destination.
        if (K > 0) {
            const int per_warp = 32 / K, tl = lane / K, k = lane % K;
            for (int t0 = warp * per_warp; t0 < N; t0 += kWarps * per_warp) {
                const int t = t0 + tl;
                int e = -1, d = -1;
                if (tl < per_warp && t < N) {
                    const int64_t v = load_topk(a.topk_idx, a.topk_idx_bytes, int64_t(t) * K + k);
                    if (v >= E) {
                        if (b == 0)
                            report(ctx, kErrorBadRouting, kKernelLlDispatch, kPhaseLlBadRouting, -1, t, E, v, 0);
                    } else if (v >= 0 && !is_masked(ctx, int(v) / L)) {
                        e = int(v);
                        d = e / L;
                    }
                }
                const bool before = t < tile_begin;
                if (e >= 0) {
                    atomicAdd(tot_e + e, 1);
                    if (before) atomicAdd(pre_e + e, 1);
                }
                const unsigned same = __match_any_sync(0xffffffffu, d >= 0 ? (tl << 16) | d : -1 - lane);
                if (d >= 0 && (same & ((1u << lane) - 1)) == 0) {
                    atomicAdd(tot_r + d, 1);
                    if (before) atomicAdd(pre_r + d, 1);
                }
            }
        }
        __syncthreads();
        // Counts first: CTA (d mod nb) writes destination d's words.
        for (int d = b; d < R; d += nb) {
            if (is_masked(ctx, d)) continue;
            for (int j = tid; j <= L; j += kThreads) {
                const uint32_t v = j < L ? tot_e[d * L + j] : tot_r[d];
                const uint64_t word = (uint64_t(epoch) << 32) | v;
                const int64_t off = lay.half_start(h) + lay.count_off + (int64_t(me) * (L + 1) + j) * 8;
                if (ctx.peers[d] != nullptr) {
                    st_relaxed_sys_u64(reinterpret_cast<uint64_t*>(static_cast<char*>(ctx.peers[d]) + off), word);
                } else {
                    nvshmemx_signal_op(reinterpret_cast<uint64_t*>(static_cast<char*>(ctx.sym) + off), word,
                                       NVSHMEM_SIGNAL_SET, d);
                }
            }
        }
        // Plan the tile: rows inside (expert, source) blocks in (token, k) order, message slots per destination.
        if (warp == 0) {
            for (int i = 0; i < tile_end - tile_begin; ++i) {
                const int t = tile_begin + i;
                int e = -1;
                if (lane < K) {
                    const int64_t v = load_topk(a.topk_idx, a.topk_idx_bytes, int64_t(t) * K + lane);
                    if (v >= 0 && v < E && !is_masked(ctx, int(v) / L)) e = int(v);
                }
                const unsigned same_e = __match_any_sync(0xffffffffu, e);
                const int rank_in = __popc(same_e & ((1u << lane) - 1));
                int row = e >= 0 ? pre_e[e] + rank_in : 0;
                __syncwarp();
                if (e >= 0 && rank_in == 0) pre_e[e] += __popc(same_e);
                const int d = e >= 0 ? e / L : -1;
                const unsigned same_d = __match_any_sync(0xffffffffu, d);
                const bool leader = d >= 0 && __popc(same_d & ((1u << lane) - 1)) == 0;
                const unsigned leaders = __ballot_sync(0xffffffffu, leader);
                if (lane < kMaxTopk) sh.plan_entry[i][lane] = e >= 0 ? (e << 16) | row : -1;
                if (leader) {
                    const int idx = __popc(leaders & ((1u << lane) - 1));
                    sh.plan_dst[i][idx] = d;
                    sh.plan_slot[i][idx] = pre_r[d];
                    pre_r[d] += 1;
                    sent[d] += 1;
                }
                if (lane == 0) sh.plan_ndst[i] = __popc(leaders);
                __syncwarp();
            }
        }
        __syncthreads();
        // Messages: the warp of unit (token, four 128-channel blocks) casts once and stores to every destination.
        // Each lane owns 16 consecutive channels (two 16-byte loads): 8 lanes per block, one 16-byte FP8 store (two
        // in BF16) per destination; the block's amax is reduced over its 8 lanes.
        const int quads = (S + 3) / 4;
        const int num_units = (tile_end - tile_begin) * quads;
        for (int u = warp; u < num_units; u += kWarps) {
            const int i = u / quads, bq = u % quads, t = tile_begin + i;
            const int block = bq * 4 + lane / 8, l8 = lane % 8;
            const int ndst = sh.plan_ndst[i];
            const bool active = block < S;
            int4 raw[2] = {make_int4(0, 0, 0, 0), make_int4(0, 0, 0, 0)};
            if (active) {
                const int4* src = reinterpret_cast<const int4*>(static_cast<const uint16_t*>(a.x) + int64_t(t) * H +
                                                                block * kFp8Block + l8 * 16);
                raw[0] = ld_nc_int4(src);
                raw[1] = ld_nc_int4(src + 1);
            }
            uint4 fp8_out = make_uint4(0, 0, 0, 0);
            float scale_inv = 0.0f;
            if (a.use_fp8) {
                const uint16_t* hv = reinterpret_cast<const uint16_t*>(raw);
                float f[16], amax = 0.0f;
                for (int v = 0; v < 16; ++v) {
                    f[v] = bf16_to_float(hv[v]);
                    amax = fmaxf(amax, fabsf(f[v]));
                }
                for (int m = 1; m < 8; m <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
                amax = fmaxf(amax, 1e-4f);
                float scale;
                if (a.round_scale) {
                    const int ex = ceil_log2_bits(__fdiv_rn(amax, 448.0f));
                    scale_inv = exp2_int(ex);
                    scale = exp2_int(-ex);
                } else {
                    scale_inv = __fmul_rn(amax, static_cast<float>(1.0 / 448.0));
                    scale = __fmul_rn(__frcp_rn(amax), 448.0f);  // torch: 448 / t == t.reciprocal() * 448
                }
                uint32_t words[4] = {0, 0, 0, 0};
                for (int v = 0; v < 16; ++v) {
                    const float s = fminf(fmaxf(__fmul_rn(f[v], scale), -448.0f), 448.0f);
                    const uint32_t q = static_cast<uint8_t>(__nv_cvt_float_to_fp8(s, __NV_SATFINITE, __NV_E4M3));
                    words[v / 4] |= q << (8 * (v % 4));
                }
                fp8_out = make_uint4(words[0], words[1], words[2], words[3]);
            }
            bool staged = false;
            for (int di = 0; di < ndst; ++di) {
                const int d = sh.plan_dst[i][di];
                char* msg;
                if (ctx.peers[d] != nullptr) {
                    msg = half_base(ctx, ctx.peers[d], h) + lay.drecv_off + (int64_t(me) * T + sh.plan_slot[i][di]) * lay.dmsg;
                } else {
                    if (staged) continue;
                    staged = true;
                    msg = my_half + lay.dstage_off + int64_t(t) * lay.dmsg;
                }
                if (bq == 0 && lane < kHeaderInts)
                    reinterpret_cast<int*>(msg)[lane] = lane == 0 ? t : sh.plan_entry[i][lane - 1];
                if (!active) continue;
                char* payload = msg + lay.header_bytes;
                if (a.use_fp8) {
                    *reinterpret_cast<uint4*>(payload + block * kFp8Block + l8 * 16) = fp8_out;
                    if (l8 == 0) reinterpret_cast<float*>(payload + H)[block] = scale_inv;
                } else {
                    int4* out = reinterpret_cast<int4*>(payload + (int64_t(block) * kFp8Block + l8 * 16) * 2);
                    st_na_int4(out, raw[0]);
                    st_na_int4(out + 1, raw[1]);
                }
            }
        }
        __syncthreads();
        // Remote destinations: put the staged message with a signal (one message = +1 on the arrival word).
        if (!ctx.all_p2p) {
            for (int u = warp; u < (tile_end - tile_begin) * kMaxTopk; u += kWarps) {
                const int i = u / kMaxTopk, di = u % kMaxTopk;
                if (di >= sh.plan_ndst[i]) continue;
                const int d = sh.plan_dst[i][di];
                if (ctx.peers[d] != nullptr) continue;
                const int t = tile_begin + i;
                char* dst = my_half + lay.drecv_off + (int64_t(me) * T + sh.plan_slot[i][di]) * lay.dmsg;
                nvshmemx_putmem_signal_nbi_warp(
                    dst, my_half + lay.dstage_off + int64_t(t) * lay.dmsg, msg_bytes,
                    reinterpret_cast<uint64_t*>(my_half + lay.darrive_off + int64_t(me) * 8), 1, NVSHMEM_SIGNAL_ADD, d);
            }
        }
        for (int d = tid; d < R; d += kThreads)
            if (sent[d] > 0 && ctx.peers[d] != nullptr)
                signal_add(ctx, d, lay.half_start(h) + lay.darrive_off + int64_t(me) * 8, sent[d]);
        __syncthreads();
    }

    if (!(kPhases & kPhaseRecv)) return;

    int* cnt = dyn;                  // [R][L] rows per (source, local expert)
    int* beg = cnt + E;              // [L][R] first row of (expert, source) block
    int* nmsg = beg + E;             // [R] messages per source
    int* mpre = nmsg + R;            // [R + 1] exclusive prefix of messages
    int* gone = mpre + R + 1;        // [R] 1 = source masked / skipped
    for (int s = tid; s < R; s += kThreads) gone[s] = is_masked(ctx, s) ? 1 : 0;
    __syncthreads();
    for (int i = tid; i < R * (L + 1); i += kThreads) {
        const int s = i / (L + 1), j = i % (L + 1);
        uint32_t value = 0;
        if (!gone[s]) {
            uint64_t* word = reinterpret_cast<uint64_t*>(my_half + lay.count_off + int64_t(i) * 8);
            uint64_t seen = 0, elapsed = 0;
            const WaitResult res = wait_word(
                ctx, word, [epoch](uint64_t v) { return int32_t(uint32_t(v >> 32) - epoch) >= 0; }, &seen, &elapsed);
            if (res == kWaitOk) {
                value = uint32_t(seen & 0xffffffffu);
                if (j == L && b == 0 && a.wait_stats != nullptr)
                    atomicAdd(reinterpret_cast<unsigned long long*>(a.wait_stats + s), elapsed);
            } else if (on_wait_failure(ctx, res, kKernelLlDispatch, kPhaseLlDispatchWaitCounts, s, -1, epoch,
                                       seen >> 32, elapsed)) {
                gone[s] = 1;
            } else {
                sh.failed = 1;
            }
        }
        if (j < L) cnt[s * L + j] = value;
        else nmsg[s] = value;
    }
    __syncthreads();
    if (sh.failed) return;
    for (int j = tid; j < L; j += kThreads) {
        int acc = 0;
        for (int s = 0; s < R; ++s) {
            const int c = gone[s] ? 0 : cnt[s * L + j];
            beg[j * R + s] = acc;
            if (b == 0) a.layout_range[int64_t(j) * R + s] = (int64_t(acc) << 32) | int64_t(c);
            acc += c;
        }
        if (b == 0) {
            a.packed_recv_count[j] = acc;
            if (a.cumulative_stats != nullptr) a.cumulative_stats[j] += acc;
        }
    }
    if (tid == 0) {
        int acc = 0;
        for (int s = 0; s < R; ++s) {
            mpre[s] = acc;
            acc += gone[s] ? 0 : nmsg[s];
        }
        mpre[R] = acc;
    }
    // Data: the arrival word of each source reaches this CTA's base plus its message count.
    for (int s = tid; s < R; s += kThreads) {
        if (gone[s] || nmsg[s] == 0) continue;
        const uint64_t target = bases[s] + uint64_t(nmsg[s]);
        uint64_t seen = 0, elapsed = 0;
        uint64_t* word = reinterpret_cast<uint64_t*>(my_half + lay.darrive_off + int64_t(s) * 8);
        const WaitResult res =
            wait_word(ctx, word, [target](uint64_t v) { return int64_t(v - target) >= 0; }, &seen, &elapsed);
        if (res == kWaitOk) {
            bases[s] = target;
            if (b == 0 && a.wait_stats != nullptr)
                atomicAdd(reinterpret_cast<unsigned long long*>(a.wait_stats + s), elapsed);
        } else if (on_wait_failure(ctx, res, kKernelLlDispatch, kPhaseLlDispatchWaitData, s, -1, target, seen,
                                   elapsed)) {
            gone[s] = 1;
        } else {
            sh.failed = 1;
        }
    }
    __syncthreads();
    if (sh.failed) return;
    // Expand: a warp copies one part (32 lanes x kUnroll x 16 bytes) of one message to each of its rows;
    // consecutive units on different SMs. The first part also writes the source info, the last the scales.
    const int total = mpre[R];
    const int64_t out_row_bytes = a.use_fp8 ? H : int64_t(H) * 2;
    const int n16 = static_cast<int>(out_row_bytes / 16);
    constexpr int kUnroll = 4;
    const int parts = (n16 + 32 * kUnroll - 1) / (32 * kUnroll);
    for (int g = warp * nb + b; g < total * parts; g += nb * kWarps) {
        const int part = g % parts, msg_index = g / parts;
        int s = 0;
        while (mpre[s + 1] <= msg_index) ++s;
        if (gone[s]) continue;
        const int m = msg_index - mpre[s];
        const char* msg = my_half + lay.drecv_off + (int64_t(s) * T + m) * lay.dmsg;
        int head = lane < kHeaderInts ? ld_ring_int(reinterpret_cast<const int*>(msg) + lane) : -1;
        const int t = __shfl_sync(0xffffffffu, head, 0);
        int dest_j = -1, dest_row = 0;
        if (lane >= 1 && lane < kHeaderInts && head >= 0) {
            const int e = head >> 16;
            if (e / L == me) {
                dest_j = e % L;
                dest_row = beg[dest_j * R + s] + (head & 0xffff);
            }
        }
        const unsigned dests = __ballot_sync(0xffffffffu, dest_j >= 0);
        if (dest_j >= 0 && part == 0) a.src_info[int64_t(dest_j) * RT + dest_row] = t;
        // Destination rows, broadcast to every lane (at most kMaxTopk).
        int num_dests = 0;
        int64_t out_rows[kMaxTopk];
        for (unsigned rest = dests; rest != 0; rest &= rest - 1) {
            const int src_lane = __ffs(rest) - 1;
            const int j = __shfl_sync(0xffffffffu, dest_j, src_lane);
            const int row = __shfl_sync(0xffffffffu, dest_row, src_lane);
            out_rows[num_dests++] = int64_t(j) * RT + row;
        }
        const char* payload = msg + lay.header_bytes;
        {
            const int base = part * 32 * kUnroll;
            int4 v[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int c = base + u * 32 + lane;
                if (c < n16) v[u] = ld_ring_int4(reinterpret_cast<const int4*>(payload) + c);
            }
            for (int di = 0; di < num_dests; ++di) {
                int4* out = reinterpret_cast<int4*>(static_cast<char*>(a.recv_x) + out_rows[di] * out_row_bytes);
#pragma unroll
                for (int u = 0; u < kUnroll; ++u) {
                    const int c = base + u * 32 + lane;
                    if (c < n16) st_na_int4(out + c, v[u]);
                }
            }
        }
        if (a.use_fp8 && part == parts - 1) {
            const float* scales = reinterpret_cast<const float*>(payload + H);
            const int cols = a.use_ue8m0 ? S / 4 : S;
            for (int c = lane; c < cols; c += 32) {
                uint32_t word = 0;
                if (a.use_ue8m0) {
                    for (int q = 0; q < 4; ++q) {
                        const uint32_t bits =
                            static_cast<uint32_t>(ld_ring_int(reinterpret_cast<const int*>(scales + c * 4 + q)));
                        word |= ((bits >> 23) & 0xffu) << (8 * q);
                    }
                } else {
                    word = static_cast<uint32_t>(ld_ring_int(reinterpret_cast<const int*>(scales + c)));
                }
                // Scales are [L, cols, R*T]: column-major in the last two dims.
                for (int di = 0; di < num_dests; ++di) {
                    const int64_t j = out_rows[di] / RT, row = out_rows[di] % RT;
                    reinterpret_cast<uint32_t*>(a.recv_scales)[(j * cols + c) * RT + row] = word;
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Combine
// ---------------------------------------------------------------------------------------------------------------

struct CombineShared {
    int ok;
    int num;                   // valid top-k entries of the current token (slots, ascending k)
    int64_t expert[kMaxTopk];  // their experts
    float weight[kMaxTopk];
    const char* row[kMaxTopk];  // where each expert's row is read (receive slot, or in place for own rows);
                                // nullptr: its owner was masked
    int staged;                 // the rows are staged in shared memory (stage_bar's current phase)
    uint64_t stage_bar;
};

// Rows a rank sends to itself are not copied in a fused combine (both phases in one launch, so `x` is read while
// the kernel runs): the sender writes the row's packed index into the (expert, token) word of the LogFMT flag area
// (unused without LogFMT) and the reducer reads the row in place. Zero-copy slots qualify when 16-byte aligned.
__device__ __forceinline__ bool own_rows_in_place(int phases, const Layout& lay, const CombineArgs& a) {
    return phases == (kPhaseSend | kPhaseRecv) && !a.use_logfmt && (!a.zero_copy || lay.cmsg % 16 == 0);
}

template <int kPhases>
__global__ void __launch_bounds__(kThreads, 1) ll_combine_kernel(Context ctx, CombineArgs a) {
    extern __shared__ int4 dyn_smem4[];
    int* rowpre = reinterpret_cast<int*>(dyn_smem4);  // [L + 1] exclusive prefix of rows per local expert
    __shared__ CombineShared sh;
    const Layout& lay = ctx.layout;
    const int R = ctx.num_ranks, me = ctx.rank, E = lay.num_experts, L = lay.num_local, T = lay.num_tokens_max;
    const int H = lay.hidden, RT = R * T, K = a.num_topk, N = a.num_tokens;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, b = blockIdx.x, nb = gridDim.x;
    const int h = a.half;
    char* my_half = half_base(ctx, ctx.sym, h);
    const int64_t row_bytes = int64_t(H) * 2;
    const bool in_place = own_rows_in_place(kPhases, lay, a);
    // The receive's stage barrier, initialised once; the first __syncthreads of either phase publishes it.
    if (tid == 0 && (kPhases & kPhaseRecv) && a.stage_slots > 0) mbar_init(&sh.stage_bar, 1);

    if (kPhases & kPhaseSend) {
        if (warp == 0) {
            int carry = 0;
            for (int j0 = 0; j0 < L; j0 += 32) {
                const int j = j0 + lane;
                int v = 0;
                if (j < L) {
                    const int64_t last = a.layout_range[int64_t(j) * R + R - 1];
                    v = int(last >> 32) + int(last & 0xffffffff);
                }
                int incl = v;
                for (int m = 1; m < 32; m <<= 1) {
                    const int o = __shfl_up_sync(0xffffffffu, incl, m);
                    if (lane >= m) incl += o;
                }
                if (j < L) rowpre[j] = carry + incl - v;
                carry += __shfl_sync(0xffffffffu, incl, 31);
            }
            if (lane == 0) rowpre[L] = carry;
        }
        __syncthreads();
        const int total = rowpre[L];
        // In a fused launch warp 0 does not send: it starts on the receive at once (routing, own rows' copies).
        constexpr int kFirstSender = (kPhases & kPhaseRecv) ? 1 : 0;
        constexpr int kSenders = kWarps - kFirstSender;
        const int sw = warp - kFirstSender;
        for (int g = sw * nb + b; sw >= 0 && g < total; g += nb * kSenders) {
            int lo = 0, hi = L;  // last j with rowpre[j] <= g
            while (hi - lo > 1) {
                const int mid = (lo + hi) / 2;
                if (rowpre[mid] <= g) lo = mid; else hi = mid;
            }
            const int j = lo, i = g - rowpre[j];
            int slo = 0, shi = R;  // last s with begin <= i
            while (shi - slo > 1) {
                const int mid = (slo + shi) / 2;
                if (int(a.layout_range[int64_t(j) * R + mid] >> 32) <= i) slo = mid; else shi = mid;
            }
            const int s = slo;
            if (is_masked(ctx, s)) continue;
            const int t = a.src_info[int64_t(j) * RT + i];
            const int e = me * L + j;
            char* send_slot = my_half + lay.csend_off + (int64_t(j) * RT + i) * lay.cmsg;
            const uint16_t* src = a.zero_copy ? reinterpret_cast<const uint16_t*>(send_slot)
                                              : static_cast<const uint16_t*>(a.x) + (int64_t(j) * RT + i) * H;
            const bool p2p = ctx.peers[s] != nullptr;
            const int64_t dst_off = lay.crecv_off + (int64_t(e) * T + t) * row_bytes;
            char* dst = p2p ? half_base(ctx, ctx.peers[s], h) + dst_off : send_slot;
            if (s == me && in_place) {
                if (lane == 0) *reinterpret_cast<int*>(my_half + combine_flag_off(lay, e, t)) = j * RT + i;
            } else if (a.use_logfmt) {
                const uint32_t flags = logfmt_encode_row(src, dst, H, lane);
                const int64_t flag_off = combine_flag_off(lay, e, t);
                if (lane == 0) {
                    if (p2p) {
                        *reinterpret_cast<uint32_t*>(half_base(ctx, ctx.peers[s], h) + flag_off) = flags;
                    } else {
                        *reinterpret_cast<uint32_t*>(send_slot + row_bytes) = flags;
                        nvshmem_putmem_nbi(my_half + flag_off, send_slot + row_bytes, 4, s);
                        nvshmem_fence();
                    }
                }
            } else if (!(a.zero_copy && !p2p)) {
                const int n16 = H / 8;
                const bool slot16 = lay.cmsg % 16 == 0;
                const bool src16 = !a.zero_copy || slot16, dst16 = p2p || slot16;
                constexpr int kUnroll = 7;
                for (int base = 0; base < n16; base += 32 * kUnroll) {
                    int4 v[kUnroll];
#pragma unroll
                    for (int u = 0; u < kUnroll; ++u) {
                        const int c = base + u * 32 + lane;
                        const int4* from = reinterpret_cast<const int4*>(src) + c;
                        if (c < n16) v[u] = src16 ? ld_nc_int4(from) : ld_nc_int4_words(from);
                    }
#pragma unroll
                    for (int u = 0; u < kUnroll; ++u) {
                        const int c = base + u * 32 + lane;
                        int4* to = reinterpret_cast<int4*>(dst) + c;
                        if (c < n16) {
                            if (dst16) st_na_int4(to, v[u]);
                            else st_int4_words(to, v[u]);
                        }
                    }
                }
            }
            __syncwarp();
            const int64_t arrive_off = lay.half_start(h) + combine_arrive_off(lay, t, me);  // (t, sender) at s
            if (p2p) {
                auto* arrive = reinterpret_cast<uint64_t*>(static_cast<char*>(ctx.peers[s]) + arrive_off);
                if (lane == 0) red_add_release_sys_u64(arrive, 1);
            } else {
                nvshmemx_putmem_signal_nbi_warp(my_half + dst_off, send_slot, row_bytes,
                                                reinterpret_cast<uint64_t*>(static_cast<char*>(ctx.sym) + arrive_off),
                                                1, NVSHMEM_SIGNAL_ADD, s);
            }
        }
    }

    if (!(kPhases & kPhaseRecv)) return;
    // Staging: with a.stage_slots > 0 each row of the token is brought into shared memory by a bulk copy issued as
    // soon as the row is known to be complete (own rows read in place: at once, their index words are written
    // before the own arrival; other rows: when their owner's arrival word says so), so own rows load while the
    // peers' rows are still in flight and the reduction after the last arrival reads shared memory only.
    char* stage = reinterpret_cast<char*>(dyn_smem4) + a.stage_offset;
    uint32_t stage_parity = 0;
    if (!(kPhases & kPhaseSend)) __syncthreads();  // the stage barrier's initialisation
    const int n16 = H / 8;  // 16-byte chunks of a row
    for (int t = b; t < N; t += nb) {
        // Warp 0 reads the token's routing (lane k: entry k); slot = rank of k among the valid entries (ascending
        // k). One arrival word per (token, expert owner): the first lane of each distinct owner waits for that
        // owner's rows, all owners in parallel lanes, so a missing owner is known by name. Own rows read in place
        // are waited for first (pass 0), the peers' rows after (pass 1).
        if (warp == 0) {
            int64_t e = -1;
            if (lane < K) e = load_topk(a.topk_idx, a.topk_idx_bytes, int64_t(t) * K + lane);
            const bool valid = lane < K && e >= 0 && e < E && !is_masked(ctx, int(e) / L);
            const float w = valid ? a.topk_weights[int64_t(t) * K + lane] : 0.0f;
            const int owner = valid ? int(e) / L : -1 - lane;
            const unsigned same = __match_any_sync(0xffffffffu, owner);
            const int leader = __ffs(same) - 1;
            const unsigned valid_mask = __ballot_sync(0xffffffffu, valid);
            const int slot = __popc(valid_mask & ((1u << lane) - 1));
            const int num = __popc(valid_mask);
            const bool staged = a.stage_slots > 0 && num <= a.stage_slots;
            const bool own_in_place = in_place && owner == me;
            int ok = 1;
            uint32_t copied = 0;
            const char* row = nullptr;
            for (int pass = 0; pass < 2; ++pass) {
                const bool mine = valid && own_in_place == (pass == 0);
                WaitResult res = kWaitOk;
                // The wait is the only divergent part: every lane meets the others at the __syncwarp below.
                if (mine && leader == lane) {
                    const uint64_t expected = __popc(same);
                    uint64_t* word = reinterpret_cast<uint64_t*>(my_half + combine_arrive_off(lay, t, owner));
                    uint64_t seen = 0, elapsed = 0;
                    res = wait_word(ctx, word, [expected](uint64_t v) { return v >= expected; }, &seen, &elapsed,
                                    ctx.mask != nullptr ? owner : -1);
                    if (res == kWaitOk) {
                        // Consume this call's arrivals: the word returns to what later calls' senders add.
                        atomicAdd(reinterpret_cast<unsigned long long*>(word),
                                  static_cast<unsigned long long>(-int64_t(expected)));
                        if (a.wait_stats != nullptr)
                            atomicAdd(reinterpret_cast<unsigned long long*>(a.wait_stats + owner), elapsed);
                    } else if (res != kWaitMasked) {
                        // Shrink: a timeout masks the owner and the token goes on without its experts (true).
                        ok = on_wait_failure(ctx, res, kKernelLlCombine, kPhaseLlCombineWaitToken, owner, t,
                                             int64_t(expected), seen, elapsed);
                    }
                }
                __syncwarp();  // each leader's acquire orders its owner's lanes' reads below
                // Every lane takes part in the full-mask shuffle (a short-circuited `valid && __shfl_sync(...)`
                // left the invalid lanes out and deadlocked the warp).
                const int leader_res = __shfl_sync(0xffffffffu, int(res), leader);
                if (mine && leader_res == kWaitOk) {
                    if (own_in_place) {
                        const int64_t idx =
                            ld_ring_int(reinterpret_cast<const int*>(my_half + combine_flag_off(lay, e, t)));
                        row = a.zero_copy ? my_half + lay.csend_off + idx * lay.cmsg
                                          : static_cast<const char*>(a.x) + idx * row_bytes;
                    } else {
                        row = my_half + lay.crecv_off + (e * T + t) * row_bytes;
                    }
                    if (staged) {
                        fence_proxy_async_global();
                        bulk_load_to_smem(stage + slot * row_bytes, row, uint32_t(row_bytes), &sh.stage_bar);
                        copied = uint32_t(row_bytes);
                    }
                }
            }
            ok = __all_sync(0xffffffffu, ok);
            if (valid) {
                sh.expert[slot] = e;
                sh.weight[slot] = w;
                sh.row[slot] = row;  // nullptr: the owner was masked, the entry is left out
            }
            const uint32_t bytes = static_cast<uint32_t>(warp_sum(static_cast<int>(copied)));
            if (lane == 0) {
                sh.num = num;
                sh.ok = ok;
                sh.staged = staged;
                if (staged) mbar_arrive_expect_tx(&sh.stage_bar, bytes);
            }
        }
        __syncthreads();
        bool stage_failed = false;
        if (sh.staged) {
            // Bulk copies always complete (no peer is involved any more); bounded all the same.
            const uint64_t start = global_timer_ns();
            for (uint32_t spins = 0; !mbar_try_wait(&sh.stage_bar, stage_parity); ++spins) {
                if ((spins & 1023) == 1023 && global_timer_ns() - start > ctx.timeout_ns) {
                    if (tid == 0)
                        report(ctx, kErrorTimeout, kKernelLlCombine, kPhaseLlCombineWaitToken, me, t, 0, 0,
                               int64_t(global_timer_ns() - start));
                    stage_failed = true;
                    break;
                }
            }
            stage_parity ^= 1;
        }
        if (__syncthreads_or(stage_failed) || !sh.ok) break;
        const int num = sh.num;
        if (sh.staged) {
            // Ascending k from shared memory: chunk c of every row, 8 channels per 16 bytes.
            for (int c = tid; c < n16; c += kThreads) {
                float acc[8];
                for (int v = 0; v < 8; ++v) acc[v] = 0.0f;
                for (int k = 0; k < num; ++k) {
                    if (sh.row[k] == nullptr) continue;
                    const float w = sh.weight[k];
                    add_weighted_bf16x8(acc, w, reinterpret_cast<const int4*>(stage + k * row_bytes)[c]);
                }
                int4 o;
                uint16_t* ov = reinterpret_cast<uint16_t*>(&o);
                for (int v = 0; v < 8; ++v) ov[v] = float_to_bf16(acc[v]);
                reinterpret_cast<int4*>(static_cast<char*>(a.out) + int64_t(t) * row_bytes)[c] = o;
            }
        } else {
            for (int gc = tid; gc < H / 16; gc += kThreads) {
                float acc[16];
                for (int v = 0; v < 16; ++v) acc[v] = 0.0f;
                if (a.use_logfmt) {
                    for (int k = 0; k < num; ++k) {
                        if (sh.row[k] == nullptr) continue;
                        float y[16];
                        const uint32_t flags = static_cast<uint32_t>(ld_ring_int(
                            reinterpret_cast<const int*>(my_half + combine_flag_off(lay, sh.expert[k], t))));
                        logfmt_decode_group(sh.row[k], flags, H, gc, y);
                        for (int v = 0; v < 16; ++v) acc[v] = __fadd_rn(acc[v], __fmul_rn(sh.weight[k], y[v]));
                    }
                } else {
                    // Four rows' loads in flight at once, then accumulated in ascending k.
                    constexpr int kBatch = 4;
                    for (int k0 = 0; k0 < num; k0 += kBatch) {
                        int4 raw[kBatch][2];
#pragma unroll
                        for (int q = 0; q < kBatch; ++q) {
                            if (k0 + q < num && sh.row[k0 + q] != nullptr) {
                                const int4* p = reinterpret_cast<const int4*>(sh.row[k0 + q]) + gc * 2;
                                raw[q][0] = ld_ring_int4(p);
                                raw[q][1] = ld_ring_int4(p + 1);
                            }
                        }
#pragma unroll
                        for (int q = 0; q < kBatch; ++q) {
                            if (k0 + q < num && sh.row[k0 + q] != nullptr) {
                                const float w = sh.weight[k0 + q];
                                add_weighted_bf16x8(acc, w, raw[q][0]);
                                add_weighted_bf16x8(acc + 8, w, raw[q][1]);
                            }
                        }
                    }
                }
                int4 o[2];
                uint16_t* ov = reinterpret_cast<uint16_t*>(o);
                for (int v = 0; v < 16; ++v) ov[v] = float_to_bf16(acc[v]);
                int4* out = reinterpret_cast<int4*>(static_cast<char*>(a.out) + int64_t(t) * row_bytes) + gc * 2;
                out[0] = o[0];
                out[1] = o[1];
            }
        }
        __syncthreads();  // the next token reuses the routing slots and the stage
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Barrier and clean
// ---------------------------------------------------------------------------------------------------------------

__global__ void ll_barrier_kernel(Context ctx) {
    const int tid = threadIdx.x;
    for (int r = tid; r < ctx.num_ranks; r += blockDim.x)
        if (!is_masked(ctx, r)) signal_add(ctx, r, kBarrierOffset, 1);
    __syncthreads();
    if (tid != 0) return;
    int alive = 0;
    for (int r = 0; r < ctx.num_ranks; ++r) alive += is_masked(ctx, r) ? 0 : 1;
    auto* base = reinterpret_cast<uint64_t*>(static_cast<char*>(ctx.workspace) + kWsBarrierBase);
    const uint64_t target = *base + uint64_t(alive);
    uint64_t seen = 0, elapsed = 0;
    uint64_t* word = reinterpret_cast<uint64_t*>(static_cast<char*>(ctx.sym) + kBarrierOffset);
    const WaitResult res =
        wait_word(ctx, word, [target](uint64_t v) { return int64_t(v - target) >= 0; }, &seen, &elapsed);
    if (res == kWaitOk) {
        *base = target;
    } else {
        on_wait_failure(ctx, res == kWaitTimeout ? kWaitTimeout : res, kKernelLlBarrier, kPhaseLlBarrierWait, -1, -1,
                        target, seen, elapsed);
        *base = seen;  // keep later barriers meaningful for the ranks that did arrive
    }
}

__global__ void ll_clean_kernel(Context ctx) {
    const Layout& lay = ctx.layout;
    const int64_t ctrl_words = lay.data_off / 8;
    const int64_t stride = int64_t(gridDim.x) * blockDim.x;
    const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    for (int h = 0; h < 2; ++h) {
        uint64_t* ctrl = reinterpret_cast<uint64_t*>(half_base(ctx, ctx.sym, h));
        for (int64_t i = first; i < ctrl_words; i += stride) ctrl[i] = 0;
    }
    auto* ws = reinterpret_cast<uint64_t*>(static_cast<char*>(ctx.workspace) + kWsEpochs);
    const int64_t ws_words = (workspace_end(ctx.num_ranks) - kWsEpochs) / 8;
    for (int64_t i = first; i < ws_words; i += stride) ws[i] = 0;
    if (first == 0) *reinterpret_cast<uint64_t*>(static_cast<char*>(ctx.sym) + kAbortOffset) = 0;
    if (first == 0) *reinterpret_cast<unsigned int*>(static_cast<char*>(ctx.workspace) + kWsClaim) = 0;
}

namespace {

int dispatch_smem(const Context& ctx) {
    const int E = ctx.layout.num_experts, R = ctx.num_ranks;
    return static_cast<int>(std::max<int64_t>(2 * E + 3 * R, 2 * E + 3 * R + 1) * 4);
}

constexpr int kMaxDynamicSmem = 160 * 1024;
// The combine kernels' ceiling: H100 / H200 allow 227 KB per CTA, static shared memory (< 1 KB here) included.
constexpr int kMaxCombineSmem = 224 * 1024;

// Cooperative launch: co-residency of every CTA is required, not a grid.sync() — in dispatch every CTA spins on the
// count words that CTA (d mod nb) of each rank writes, its own grid's included, so a CTA left unscheduled would
// stall the others (bounded, but a spurious timeout). The shared-memory ceiling is set once (configure_kernels).
template <typename Kernel, typename... Args>
void launch_cooperative(Kernel kernel, int blocks, int smem, cudaStream_t stream, Args... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeCooperative;
    attr[0].val.cooperative = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    DEEP_EP_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

}  // namespace

void configure_kernels() {
    const void* kernels[] = {
        reinterpret_cast<const void*>(&ll_dispatch_kernel<kPhaseSend>),
        reinterpret_cast<const void*>(&ll_dispatch_kernel<kPhaseRecv>),
        reinterpret_cast<const void*>(&ll_dispatch_kernel<kPhaseSend | kPhaseRecv>),
        reinterpret_cast<const void*>(&ll_combine_kernel<kPhaseSend>),
        reinterpret_cast<const void*>(&ll_combine_kernel<kPhaseRecv>),
        reinterpret_cast<const void*>(&ll_combine_kernel<kPhaseSend | kPhaseRecv>),
    };
    for (int i = 0; i < 6; ++i)
        DEEP_EP_CUDA_CHECK(cudaFuncSetAttribute(kernels[i], cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                i < 3 ? kMaxDynamicSmem : kMaxCombineSmem));
}

void dispatch(const Context& ctx, const DispatchArgs& args, cudaStream_t stream) {
    DEEP_EP_CHECK_ARG(args.num_topk >= 0 && args.num_topk <= kMaxTopk, "num_topk must be <= ", kMaxTopk, ", got ",
                      args.num_topk);
    DEEP_EP_CHECK_ARG(args.num_tokens >= 0 && args.num_tokens <= ctx.layout.num_tokens_max,
                      "num_tokens must be <= num_max_dispatch_tokens_per_rank (", ctx.layout.num_tokens_max,
                      "), got ", args.num_tokens);
    DEEP_EP_CHECK_ARG((args.num_tokens + ctx.num_blocks - 1) / ctx.num_blocks <= kMaxTile,
                      "too many tokens per CTA: ", args.num_tokens, " tokens over ", ctx.num_blocks, " CTAs");
    DEEP_EP_CHECK_ARG(!args.use_ue8m0 || ctx.layout.hidden % 512 == 0,
                      "use_ue8m0 needs hidden to be a multiple of 512, got ", ctx.layout.hidden);
    const int smem = dispatch_smem(ctx);
    DEEP_EP_CHECK_ARG(smem <= kMaxDynamicSmem, "the low-latency dispatch needs ", smem,
                      " bytes of shared memory (num_experts too large)");
    switch (args.phases) {
        case kPhaseSend: launch_cooperative(ll_dispatch_kernel<kPhaseSend>, ctx.num_blocks, smem, stream, ctx, args); break;
        case kPhaseRecv: launch_cooperative(ll_dispatch_kernel<kPhaseRecv>, ctx.num_blocks, smem, stream, ctx, args); break;
        case kPhaseSend | kPhaseRecv:
            launch_cooperative(ll_dispatch_kernel<kPhaseSend | kPhaseRecv>, ctx.num_blocks, smem, stream, ctx, args);
            break;
        default: DEEP_EP_CHECK_ARG(false, "phases must be 1, 2 or 3, got ", args.phases);
    }
}

void combine(const Context& ctx, const CombineArgs& args, cudaStream_t stream) {
    DEEP_EP_CHECK_ARG(args.num_topk >= 0 && args.num_topk <= kMaxTopk, "num_topk must be <= ", kMaxTopk, ", got ",
                      args.num_topk);
    // Shared memory: the send phase's row prefix [L + 1], then (receive, BF16 rows) as many staged rows of 2H bytes
    // as fit, at most top-k; a token with more valid entries than slots is reduced from global memory.
    CombineArgs a = args;
    const int64_t row_bytes = int64_t(ctx.layout.hidden) * 2;
    a.stage_offset = static_cast<int>((int64_t(ctx.layout.num_local + 1) * 4 + 127) / 128 * 128);
    DEEP_EP_CHECK_ARG(a.stage_offset <= kMaxCombineSmem, "the low-latency combine needs ", a.stage_offset,
                      " bytes of shared memory (num_experts / num_ranks too large)");
    const bool stage = (a.phases & kPhaseRecv) && !a.use_logfmt;
    const int64_t fit = (kMaxCombineSmem - a.stage_offset) / row_bytes;
    a.stage_slots = stage ? static_cast<int>(std::min<int64_t>(a.num_topk, fit)) : 0;
    const int smem = static_cast<int>(a.stage_offset + a.stage_slots * row_bytes);
    switch (a.phases) {
        case kPhaseSend: launch_cooperative(ll_combine_kernel<kPhaseSend>, ctx.num_blocks, smem, stream, ctx, a); break;
        case kPhaseRecv: launch_cooperative(ll_combine_kernel<kPhaseRecv>, ctx.num_blocks, smem, stream, ctx, a); break;
        case kPhaseSend | kPhaseRecv:
            launch_cooperative(ll_combine_kernel<kPhaseSend | kPhaseRecv>, ctx.num_blocks, smem, stream, ctx, a);
            break;
        default: DEEP_EP_CHECK_ARG(false, "phases must be 1, 2 or 3, got ", args.phases);
    }
}

void barrier(const Context& ctx, cudaStream_t stream) {
    ll_barrier_kernel<<<1, 256, 0, stream>>>(ctx);
    DEEP_EP_CUDA_CHECK(cudaGetLastError());
}

void clean(const Context& ctx, cudaStream_t stream) {
    ll_clean_kernel<<<64, 256, 0, stream>>>(ctx);
    DEEP_EP_CUDA_CHECK(cudaGetLastError());
}

// ---------------------------------------------------------------------------------------------------------------
// NVSHMEM host side
// ---------------------------------------------------------------------------------------------------------------

namespace {
std::mutex g_init_mutex;
int g_init_rank = -1, g_init_ranks = 0;
}  // namespace

std::vector<uint8_t> nvshmem_unique_id() {
    nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
    if (nvshmemx_get_uniqueid(&id) != 0) throw std::runtime_error("nvshmemx_get_uniqueid failed");
    std::vector<uint8_t> out(sizeof(id));
    std::memcpy(out.data(), &id, sizeof(id));
    return out;
}

void nvshmem_bootstrap(const std::vector<uint8_t>& unique_id, int rank, int num_ranks) {
    std::lock_guard<std::mutex> lock(g_init_mutex);
    if (g_init_ranks != 0) {
        DEEP_EP_CHECK_ARG(g_init_rank == rank && g_init_ranks == num_ranks,
                          "NVSHMEM is already initialised in this process as PE ", g_init_rank, " of ", g_init_ranks,
                          "; a low-latency Buffer for rank ", rank, " of ", num_ranks, " cannot join another world");
        return;
    }
    nvshmemx_uniqueid_t id;
    DEEP_EP_CHECK_ARG(unique_id.size() == sizeof(id), "the NVSHMEM unique id must have ", sizeof(id),
                      " bytes, got ", unique_id.size());
    std::memcpy(&id, unique_id.data(), sizeof(id));
    nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
    if (nvshmemx_set_attr_uniqueid_args(rank, num_ranks, &id, &attr) != 0)
        throw std::runtime_error("nvshmemx_set_attr_uniqueid_args failed");
    if (nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr) != 0)
        throw std::runtime_error("nvshmemx_init_attr failed");
    if (nvshmem_my_pe() != rank || nvshmem_n_pes() != num_ranks)
        throw std::runtime_error(concat_message("NVSHMEM initialised as PE ", nvshmem_my_pe(), " of ", nvshmem_n_pes(),
                                                ", expected ", rank, " of ", num_ranks));
    g_init_rank = rank;
    g_init_ranks = num_ranks;
}

void* nvshmem_alloc_zeroed(int64_t bytes) {
    void* ptr = nvshmem_align(128, static_cast<size_t>(bytes));
    if (ptr == nullptr) throw std::runtime_error(concat_message("nvshmem_align of ", bytes, " bytes failed"));
    DEEP_EP_CUDA_CHECK(cudaMemset(ptr, 0, static_cast<size_t>(bytes)));
    DEEP_EP_CUDA_CHECK(cudaDeviceSynchronize());
    nvshmem_barrier_all();
    return ptr;
}

void nvshmem_release(void* ptr) {
    if (ptr != nullptr) nvshmem_free(ptr);
}

std::vector<void*> nvshmem_peer_pointers(void* ptr, const std::vector<int>& pes) {
    std::vector<void*> out(pes.size());
    for (size_t r = 0; r < pes.size(); ++r) out[r] = nvshmem_ptr(ptr, pes[r]);
    return out;
}

}  // namespace ll
}  // namespace kernels
}  // namespace deep_ep
