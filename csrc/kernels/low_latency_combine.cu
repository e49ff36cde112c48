// Low-latency combine over NVSHMEM (low_latency.cuh has the data path and the carving):
//   send     once the peers released half h (low_latency_device.cuh acquire_half), one warp per received row
//            writes the row into the token owner's [expert][token] slot and adds 1 + (call-signature hash << 32) to
//            the token owner's arrival word (token, sender).
//   receive  one CTA per token; warp 0's lanes wait in parallel, one per distinct expert owner, for that owner's
//            rows, check that the rows' hash sum is their count times this rank's hash (else no row of that owner
//            is reduced and every rank is told: tell_disagreement), consume them (subtract), and (shrink) mask an
//            owner that times out; then the CTA reduces sum_k w_k * y_k over the arrived entries in fp32 in
//            ascending k, rounding to BF16 once. The rank's next send releases half h, or, for a hooked receive
//            issued after that send, the receive at its end.
#include <cuda_bf16.h>

#include <algorithm>

#include "low_latency_device.cuh"

namespace deep_ep {
namespace kernels {
namespace ll {

namespace {

// 16 bytes at a 4-byte-aligned address. Combine send slots have a row stride of H/128*4 + 2H bytes (DeepEP's
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

__device__ __forceinline__ uint16_t float_to_bf16(float v) {
    __nv_bfloat16 b = __float2bfloat16_rn(v);
    return *reinterpret_cast<uint16_t*>(&b);
}

// acc[i] += w * (BF16 value i of `raw`), i < 8: the product rounded, then the sum (no FMA), as the reference
// computes it. A 32-bit word holds values 2i (low half) and 2i + 1 (high half): one shift or one mask each.
__device__ __forceinline__ void add_weighted_bf16x8(float* acc, float w, const int4& raw) {
    const uint32_t word[4] = {uint32_t(raw.x), uint32_t(raw.y), uint32_t(raw.z), uint32_t(raw.w)};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        acc[2 * i] = __fadd_rn(acc[2 * i], __fmul_rn(w, __uint_as_float(word[i] << 16)));
        acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], __fmul_rn(w, __uint_as_float(word[i] & 0xffff0000u)));
    }
}

// ---------------------------------------------------------------------------------------------------------------
// LogFMT-10 (deep_ep.numerics.logfmt_roundtrip). A row keeps the BF16 slot size (2H bytes); chunk c covers bytes
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

struct CombineShared {
    int ok;
    int num;                   // valid top-k entries of the current token (slots, ascending k)
    int64_t expert[kMaxTopk];  // their experts
    float weight[kMaxTopk];
    const char* row[kMaxTopk];  // where each expert's row is read (receive slot, or in place for own rows);
                                // nullptr: its owner was masked
    int staged;                 // the rows are staged in shared memory (stage_bar's current phase)
    int failed;                 // acquire_half
    int last;                   // release_half
    uint64_t stage_bar;
};

// Rows a rank sends to itself are not copied in a fused combine (both phases in one launch, so `x` is read while
// the kernel runs): the sender writes the row's packed index into the (expert, token) word of the LogFMT flag area
// (unused without LogFMT) and the reducer reads the row in place. Zero-copy slots qualify when 16-byte aligned.
__device__ __forceinline__ bool own_rows_in_place(int phases, const Layout& lay, const CombineArgs& a) {
    return phases == (kPhaseSend | kPhaseRecv) && !a.use_logfmt && (!a.zero_copy || lay.cmsg % 16 == 0);
}

// What each row adds to its arrival word: one arrival, and the sender's call-signature hash in the high half.
__device__ __forceinline__ uint64_t arrival_word(const CombineArgs& a) {
    return 1ull + (uint64_t(a.signature_hash) << 32);
}

// As the dispatch kernel: the send and receive launches of a hooked call are one kernel with the phase as an
// argument; the fused launch is its own instantiation.
template <bool kFused>
__global__ void __launch_bounds__(kThreads, 1) combine_kernel(Context ctx, CombineArgs a) {
    if (signatures_disagreed(ctx)) return;  // the ranks' call signatures differed: no rank combines
    const int phases = kFused ? (kPhaseSend | kPhaseRecv) : a.phases;
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
    const bool in_place = own_rows_in_place(phases, lay, a);
    // The receive's stage barrier, initialised once; the first __syncthreads of either phase publishes it.
    if (tid == 0 && (phases & kPhaseRecv) && a.stage_slots > 0) mbar_init(&sh.stage_bar, 1);
    if (!kFused && phases == kPhaseRecv && a.release_by_next_send) defer_release(ctx, h);

    if (phases & kPhaseSend) {
        // The peers' half h is written below (rows, arrival and flag words): only once they released it.
        if (!acquire_half(ctx, h, kFused, kKernelLlCombine, &sh.failed)) return;
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
        const int first_sender = (phases & kPhaseRecv) ? 1 : 0;
        const int senders = kWarps - first_sender;
        const int sw = warp - first_sender;
        for (int g = sw * nb + b; sw >= 0 && g < total; g += nb * senders) {
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
                if (lane == 0) red_add_release_sys_u64(arrive, arrival_word(a));
            } else {
                nvshmemx_putmem_signal_nbi_warp(my_half + dst_off, send_slot, row_bytes,
                                                reinterpret_cast<uint64_t*>(static_cast<char*>(ctx.sym) + arrive_off),
                                                arrival_word(a), NVSHMEM_SIGNAL_ADD, s);
            }
        }
    }

    if (!(phases & kPhaseRecv)) return;
    // Staging: with a.stage_slots > 0 each row of the token is brought into shared memory by a bulk copy issued as
    // soon as the row is known to be complete (own rows read in place: at once, their index words are written
    // before the own arrival; other rows: when their owner's arrival word says so), so own rows load while the
    // peers' rows are still in flight and the reduction after the last arrival reads shared memory only.
    char* stage = reinterpret_cast<char*>(dyn_smem4) + a.stage_offset;
    uint32_t stage_parity = 0;
    if (!(phases & kPhaseSend)) __syncthreads();  // the stage barrier's initialisation
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
                    res = wait_word(ctx, word, [expected](uint64_t v) { return uint32_t(v) >= expected; }, &seen,
                                    &elapsed, ctx.mask != nullptr ? owner : -1, true);
                    // Every row (of this call, or of a later one already here) carried its sender's hash.
                    if (res == kWaitOk && uint32_t(seen >> 32) != uint32_t(seen) * a.signature_hash) {
                        tell_disagreement(ctx, kKernelLlCombine, kPhaseLlCombineAgreement, owner, t,
                                          uint32_t(seen) * a.signature_hash, int64_t(seen >> 32));
                        res = kWaitDisagreed;
                    }
                    if (res == kWaitOk) {
                        // Consume this call's arrivals: the word returns to what later calls' senders add. A
                        // device-scope atomic suffices: the owner added its last row for this token before the
                        // wait saw it, and the next call on this half adds only after this rank released the half.
                        atomicAdd(reinterpret_cast<unsigned long long*>(word),
                                  static_cast<unsigned long long>(-int64_t(expected * arrival_word(a))));
                        if (a.wait_stats != nullptr)
                            atomicAdd(reinterpret_cast<unsigned long long*>(a.wait_stats + owner), elapsed);
                    } else if (res == kWaitDisagreed) {
                        ok = 0;  // recorded; no row of this call is reduced
                    } else if (res != kWaitMasked) {
                        // Shrink: a timeout masks the owner and the token goes on without its experts (true).
                        ok = on_wait_failure(ctx, res, kKernelLlCombine, kPhaseLlCombineWaitToken, owner, t,
                                             int64_t(expected), seen, elapsed);
                    }
                }
                __syncwarp();  // each leader's acquire orders its owner's lanes' reads below
                // Every lane takes part in the full-mask shuffle (a short-circuited `valid && __shfl_sync(...)`
                // would leave the invalid lanes out and hang the warp).
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
    // A hooked receive issued after its rank's next send releases half h itself (every read of the half, arrival
    // words, rows and flag words, is done).
    if (!kFused && !a.release_by_next_send) release_half(ctx, h, &sh.last);
}

namespace {

// The combine kernels' ceiling: H100 / H200 allow 227 KB per CTA, static shared memory (< 1 KB here) included.
constexpr int kMaxCombineSmem = 224 * 1024;

}  // namespace

Status configure_combine_kernels() {
    for (const void* kernel : {reinterpret_cast<const void*>(&combine_kernel<false>),
                               reinterpret_cast<const void*>(&combine_kernel<true>)})
        DEEP_EP_RETURN_IF_CUDA_ERROR(
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxCombineSmem));
    return {};
}

Status combine(const Context& ctx, const CombineArgs& args, cudaStream_t stream) {
    DEEP_EP_REQUIRE_ARG(args.num_topk >= 0 && args.num_topk <= kMaxTopk, "num_topk must be <= ", kMaxTopk, ", got ",
                        args.num_topk);
    // Shared memory: the send phase's row prefix [L + 1], then (receive, BF16 rows) as many staged rows of 2H bytes
    // as fit, at most top-k; a token with more valid entries than slots is reduced from global memory.
    CombineArgs a = args;
    const int64_t row_bytes = int64_t(ctx.layout.hidden) * 2;
    a.stage_offset = static_cast<int>((int64_t(ctx.layout.num_local + 1) * 4 + 127) / 128 * 128);
    DEEP_EP_REQUIRE_ARG(a.stage_offset <= kMaxCombineSmem, "the low-latency combine needs ", a.stage_offset,
                        " bytes of shared memory (num_experts / num_ranks too large)");
    const bool stage = (a.phases & kPhaseRecv) && !a.use_logfmt;
    const int64_t fit = (kMaxCombineSmem - a.stage_offset) / row_bytes;
    a.stage_slots = stage ? static_cast<int>(std::min<int64_t>(a.num_topk, fit)) : 0;
    const int smem = static_cast<int>(a.stage_offset + a.stage_slots * row_bytes);
    switch (a.phases) {
        case kPhaseSend:
        case kPhaseRecv: return launch_cooperative(combine_kernel<false>, ctx.num_blocks, smem, stream, ctx, a);
        case kPhaseSend | kPhaseRecv:
            return launch_cooperative(combine_kernel<true>, ctx.num_blocks, smem, stream, ctx, a);
        default: return invalid_argument_status("phases must be 1, 2 or 3, got ", args.phases);
    }
}

}  // namespace ll
}  // namespace kernels
}  // namespace deep_ep
