// Low-latency dispatch over NVSHMEM (low_latency.cuh has the data path and the carving). Per call, half h and
// epoch n (a per-CTA copy, incremented by every call on that half, so CUDA-graph replays stay consistent):
//   send     every CTA waits until the peers released half h (low_latency_device.cuh acquire_half), counts the
//            whole top-k (shared-memory histograms; no atomics across CTAs), writes the
//            per-(destination, local expert) counts as (n mod 2^16 << 48 | signature hash << 16 | count) words
//            first, then casts its tile of tokens
//            once and stores each message to every destination rank that holds one of the token's experts, then
//            adds its message count to the destination's per-source arrival word.
//   receive  every CTA waits for all count words of epoch n, derives the per-(expert, source) blocks in source
//            order, waits until each source's arrival word reaches its private base + messages, and expands its
//            share of the messages into the packed outputs. A source whose signature hash differs from this
//            rank's gets no rows, the error record gets kErrorArgumentMismatch, the rank's other waits of the call
//            stop, and later LL dispatch and combine kernels return at once until clean_low_latency_buffer (the
//            arrival bases are then out of step with the peers'). The rank's next send releases half h, or, for a
//            hooked receive issued after that send, the receive at its end (low_latency_device.cuh).
#include <cuda_bf16.h>
#include <cuda_fp8.h>


#include "low_latency_device.cuh"

namespace deep_ep {
namespace kernels {
namespace ll {

namespace {

// ceil(log2(v)) from the float bits (positive normal v), as deep_ep.numerics.ceil_log2_bits.
__device__ __forceinline__ int ceil_log2_bits(float v) {
    const uint32_t bits = __float_as_uint(v);
    return int((bits >> 23) & 0xff) - 127 + ((bits & 0x7fffff) != 0 ? 1 : 0);
}
__device__ __forceinline__ float exp2_int(int e) { return __uint_as_float(uint32_t(e + 127) << 23); }

}  // namespace

constexpr int kMaxTile = 64;

struct DispatchShared {
    int plan_entry[kMaxTile][kMaxTopk];  // per tile token, per k: (expert << 16 | row) or -1
    int plan_dst[kMaxTile][kMaxTopk];    // distinct destination ranks of the token
    int plan_slot[kMaxTile][kMaxTopk];   // message slot of the token at that destination
    int plan_ndst[kMaxTile];
    uint32_t epoch;
    int stop;  // the ranks' call signatures differed (signatures_disagreed)
    int failed;
    int last;  // release_half: this CTA is the last of the grid to finish the hooked receive
};

// The send (1) and receive (2) launches of a hooked call are one kernel with the phase as an argument, so a profile
// shows a hooked dispatch as two launches of one kernel, as DeepEP's profiling of its own kernels expects; the fused
// launch (3) is its own instantiation, with the phases known at compile time.
template <bool kFused>
__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(Context ctx, DispatchArgs a) {
    const int phases = kFused ? (kPhaseSend | kPhaseRecv) : a.phases;
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
    // Thread 0 loads the disagreement words with this CTA's epoch (one round trip for both): when the signatures
    // differed, no state advances.
    if (tid == 0) {
        const DisagreementWords words = load_disagreement(ctx);
        const uint32_t last_epoch = *reinterpret_cast<volatile uint32_t*>(epoch_ptr);
        sh.stop = signatures_disagreed(ctx, words) ? 1 : 0;
        if (sh.stop == 0) {
            if (!kFused && phases == kPhaseRecv && a.release_by_next_send) defer_release(ctx, h);
            sh.epoch = (phases & kPhaseSend) ? last_epoch + 1 : last_epoch;
            if (phases & kPhaseSend) *epoch_ptr = sh.epoch;
        }
        sh.failed = 0;
    }
    __syncthreads();
    if (sh.stop != 0) return;
    const uint32_t epoch = sh.epoch;

    if (phases & kPhaseSend) {
        // The peers' half h is written below (count words, messages): only once they released it.
        if (!acquire_half(ctx, h, kFused, kKernelLlDispatch, &sh.failed)) return;
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
                const uint64_t word = (uint64_t(epoch & 0xffffu) << 48) | (uint64_t(a.signature_hash) << 16) | v;
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

    if (!(phases & kPhaseRecv)) return;

    int* cnt = dyn;                  // [R][L] rows per (source, local expert)
    int* beg = cnt + E;              // [L][R] first row of (expert, source) block
    int* nmsg = beg + E;             // [R] messages per source
    int* mpre = nmsg + R;            // [R + 1] exclusive prefix of messages
    int* gone = mpre + R + 1;        // [R] 1 = source masked / skipped, 2 = its signature differs (no rows)
    for (int s = tid; s < R; s += kThreads) gone[s] = is_masked(ctx, s) ? 1 : 0;
    __syncthreads();
    for (int i = tid; i < R * (L + 1); i += kThreads) {
        const int s = i / (L + 1), j = i % (L + 1);
        uint32_t value = 0;
        if (gone[s] != 1) {
            uint64_t* word = reinterpret_cast<uint64_t*>(my_half + lay.count_off + int64_t(i) * 8);
            uint64_t seen = 0, elapsed = 0;
            const WaitResult res = wait_word(
                ctx, word, [epoch](uint64_t v) { return int16_t(uint16_t(v >> 48) - uint16_t(epoch)) >= 0; }, &seen,
                &elapsed, -1, true);
            if (res == kWaitOk) {
                value = uint32_t(seen & 0xffffu);
                const uint32_t hash = uint32_t(seen >> 16);
                if (hash != a.signature_hash) {
                    gone[s] = 2;
                    *reinterpret_cast<volatile unsigned int*>(static_cast<char*>(ctx.workspace) + kWsMismatch) = 1u;
                    fill_error_record(ctx.error, reinterpret_cast<unsigned int*>(static_cast<char*>(ctx.workspace) +
                                                                                 kWsClaim),
                                      kErrorArgumentMismatch, kKernelLlDispatch, kPhaseLlDispatchAgreement, me, s, -1,
                                      ctx.call_seq, a.signature_hash, hash, 0);
                }
                if (j == L && b == 0 && a.wait_stats != nullptr)
                    atomicAdd(reinterpret_cast<unsigned long long*>(a.wait_stats + s), elapsed);
            } else if (res == kWaitDisagreed) {
                gone[s] = 2;
            } else if (on_wait_failure(ctx, res, kKernelLlDispatch, kPhaseLlDispatchWaitCounts, s, -1,
                                       epoch & 0xffffu, seen >> 48, elapsed)) {
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
        const WaitResult res = wait_word(
            ctx, word, [target](uint64_t v) { return int64_t((v & kArrivalMask) - target) >= 0; }, &seen, &elapsed,
            -1, true);
        seen &= kArrivalMask;
        if (res == kWaitDisagreed) {
            gone[s] = 2;
        } else if (res == kWaitOk) {
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
    // A hooked receive issued after its rank's next send releases half h itself (every read of the half, count
    // words, arrival words and messages, is done).
    if (!kFused && !a.release_by_next_send) release_half(ctx, h, &sh.last);
}

namespace {

int dispatch_smem(const Context& ctx) {
    const int E = ctx.layout.num_experts, R = ctx.num_ranks;
    return (2 * E + 3 * R + 1) * 4;
}

constexpr int kMaxDynamicSmem = 160 * 1024;

}  // namespace

Status configure_dispatch_kernels() {
    for (const void* kernel : {reinterpret_cast<const void*>(&dispatch_kernel<false>),
                               reinterpret_cast<const void*>(&dispatch_kernel<true>)})
        DEEP_EP_RETURN_IF_CUDA_ERROR(
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxDynamicSmem));
    return {};
}

Status dispatch(const Context& ctx, const DispatchArgs& args, cudaStream_t stream) {
    DEEP_EP_REQUIRE_ARG(args.num_topk >= 0 && args.num_topk <= kMaxTopk, "num_topk must be <= ", kMaxTopk, ", got ",
                        args.num_topk);
    DEEP_EP_REQUIRE_ARG(args.num_tokens >= 0 && args.num_tokens <= ctx.layout.num_tokens_max,
                        "num_tokens must be <= num_max_dispatch_tokens_per_rank (", ctx.layout.num_tokens_max,
                        "), got ", args.num_tokens);
    DEEP_EP_REQUIRE_ARG((args.num_tokens + ctx.num_blocks - 1) / ctx.num_blocks <= kMaxTile,
                        "too many tokens per CTA: ", args.num_tokens, " tokens over ", ctx.num_blocks, " CTAs");
    DEEP_EP_REQUIRE_ARG(!args.use_ue8m0 || ctx.layout.hidden % 512 == 0,
                        "use_ue8m0 needs hidden to be a multiple of 512, got ", ctx.layout.hidden);
    const int smem = dispatch_smem(ctx);
    DEEP_EP_REQUIRE_ARG(smem <= kMaxDynamicSmem, "the low-latency dispatch needs ", smem,
                        " bytes of shared memory (num_experts too large)");
    switch (args.phases) {
        case kPhaseSend:
        case kPhaseRecv: return launch_cooperative(dispatch_kernel<false>, ctx.num_blocks, smem, stream, ctx, args);
        case kPhaseSend | kPhaseRecv:
            return launch_cooperative(dispatch_kernel<true>, ctx.num_blocks, smem, stream, ctx, args);
        default: return invalid_argument_status("phases must be 1, 2 or 3, got ", args.phases);
    }
}

}  // namespace ll
}  // namespace kernels
}  // namespace deep_ep
