// Standalone, torch-free self-test of the intranode kernels against a CPU reference.
//
// One process drives R "ranks" spread round-robin over the visible GPUs (peer access between GPUs; several ranks
// may share one GPU, their kernels then run concurrently from separate streams). For each case it checks
// get_dispatch_layout, notify, dispatch (then a cached dispatch from the same handle), and combine with biases,
// bit-exactly against a CPU model of the spec; it repeats calls with changing channel counts (ring geometry) and
// finally injects a fault (rank 1 skips its sends) and expects error records instead of a hang.
//
// Build and run (on a GPU machine):
//   nvcc -std=c++17 -O3 -arch=sm_90a csrc/kernels/selftest/intranode_selftest.cu csrc/kernels/intranode.cu \
//        csrc/kernels/layout.cu -o /tmp/intranode_selftest && /tmp/intranode_selftest [num_ranks ...]
// Exit status 0 = every check passed; the last line says "SELFTEST PASSED" or names the first failure.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../api.cuh"
#include "../exception.cuh"

using namespace deep_ep::kernels;

namespace {

int g_failures = 0;

#define EXPECT(cond, ...)                                          \
    do {                                                           \
        if (!(cond)) {                                             \
            if (g_failures++ < 20) {                               \
                std::printf("FAIL %s:%d: ", __FILE__, __LINE__);   \
                std::printf(__VA_ARGS__);                          \
                std::printf("\n");                                 \
            }                                                      \
        }                                                          \
    } while (0)

uint16_t float_to_bf16_rne(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
    const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<uint16_t>((bits + rounding) >> 16);
}

float bf16_to_float(uint16_t h) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

template <typename T>
T* device_alloc(int device, size_t count) {
    T* ptr = nullptr;
    DEEP_EP_CUDA_CHECK(cudaSetDevice(device));
    DEEP_EP_CUDA_CHECK(cudaMalloc(&ptr, sizeof(T) * (count > 0 ? count : 1)));
    DEEP_EP_CUDA_CHECK(cudaMemset(ptr, 0xff, sizeof(T) * (count > 0 ? count : 1)));  // poison
    return ptr;
}

template <typename T>
void upload(int device, T* dst, const std::vector<T>& src) {
    DEEP_EP_CUDA_CHECK(cudaSetDevice(device));
    if (!src.empty()) DEEP_EP_CUDA_CHECK(cudaMemcpy(dst, src.data(), sizeof(T) * src.size(), cudaMemcpyHostToDevice));
}

template <typename T>
std::vector<T> download(int device, const T* src, size_t count) {
    std::vector<T> out(count);
    DEEP_EP_CUDA_CHECK(cudaSetDevice(device));
    if (count > 0) DEEP_EP_CUDA_CHECK(cudaMemcpy(out.data(), src, sizeof(T) * count, cudaMemcpyDeviceToHost));
    return out;
}

struct Rank {
    int device;
    cudaStream_t stream;
    void* buffer;
    void* workspace;
    ErrorRecord* error_host;
    ErrorRecord* error_dev;
    int* counters_host;
    int* counters_dev;
};

struct Case {
    int num_tokens, hidden_bytes, num_topk, num_experts, num_scales, num_channels, send_tokens, recv_tokens;
    bool column_major_scales;
    int64_t nvl_bytes;
};

struct World {
    int num_ranks;
    int64_t nvl_bytes;
    std::vector<Rank> ranks;
    int64_t call_seq = 0;

    KernelContext context(int r, uint64_t timeout_ns = 20ull * 1000 * 1000 * 1000) {
        KernelContext ctx{};
        for (int i = 0; i < num_ranks; ++i) ctx.buffers[i] = ranks[i].buffer;
        ctx.workspace = ranks[r].workspace;
        ctx.error = ranks[r].error_dev;
        ctx.num_nvl_bytes = nvl_bytes;
        ctx.timeout_ns = timeout_ns;
        ctx.call_seq = ++call_seq;
        ctx.rank = r;
        ctx.num_ranks = num_ranks;
        return ctx;
    }

    void sync_all() {
        for (auto& rk : ranks) {
            DEEP_EP_CUDA_CHECK(cudaSetDevice(rk.device));
            DEEP_EP_CUDA_CHECK(cudaStreamSynchronize(rk.stream));
        }
    }

    bool any_error(bool print) {
        bool any = false;
        for (int r = 0; r < num_ranks; ++r) {
            const volatile ErrorRecord* e = ranks[r].error_host;
            if (e->code != kErrorNone) {
                any = true;
                if (print)
                    std::printf("  rank %d error: %s, %s, peer %d, channel %d, expected %lld, observed %lld\n", r,
                                error_code_name(e->code), phase_name(e->phase), e->peer, e->channel,
                                static_cast<long long>(e->expected), static_cast<long long>(e->observed));
            }
        }
        return any;
    }
};

World make_world(int num_ranks, int64_t nvl_bytes) {
    int num_devices = 0;
    DEEP_EP_CUDA_CHECK(cudaGetDeviceCount(&num_devices));
    World w;
    w.num_ranks = num_ranks;
    w.nvl_bytes = nvl_bytes;
    for (int a = 0; a < num_devices; ++a)
        for (int b = 0; b < num_devices; ++b) {
            if (a == b) continue;
            int ok = 0;
            DEEP_EP_CUDA_CHECK(cudaDeviceCanAccessPeer(&ok, a, b));
            if (ok) {
                DEEP_EP_CUDA_CHECK(cudaSetDevice(a));
                cudaError_t e = cudaDeviceEnablePeerAccess(b, 0);
                if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) DEEP_EP_CUDA_CHECK(e);
                (void)cudaGetLastError();
            }
        }
    for (int r = 0; r < num_ranks; ++r) {
        Rank rk{};
        rk.device = r % num_devices;
        DEEP_EP_CUDA_CHECK(cudaSetDevice(rk.device));
        DEEP_EP_CUDA_CHECK(cudaStreamCreateWithFlags(&rk.stream, cudaStreamNonBlocking));
        DEEP_EP_CUDA_CHECK(cudaMalloc(&rk.buffer, nvl_bytes));
        DEEP_EP_CUDA_CHECK(cudaMemset(rk.buffer, 0, nvl_bytes));
        DEEP_EP_CUDA_CHECK(cudaMalloc(&rk.workspace, kWorkspaceBytes));
        DEEP_EP_CUDA_CHECK(cudaMemset(rk.workspace, 0, kWorkspaceBytes));
        DEEP_EP_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&rk.error_host), sizeof(ErrorRecord), cudaHostAllocMapped));
        std::memset(rk.error_host, 0, sizeof(ErrorRecord));
        DEEP_EP_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&rk.error_dev), rk.error_host, 0));
        DEEP_EP_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&rk.counters_host), sizeof(int) * (1 + kMaxLocalExperts),
                                         cudaHostAllocMapped));
        DEEP_EP_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&rk.counters_dev), rk.counters_host, 0));
        w.ranks.push_back(rk);
    }
    DEEP_EP_CUDA_CHECK(cudaDeviceSynchronize());
    return w;
}

// Per-rank host data of one case.
struct Inputs {
    std::vector<uint8_t> x;          // [N, hidden_bytes]
    std::vector<float> scales;       // stored [N, S] row-major or [S, N] column-major
    std::vector<int64_t> topk_idx;   // [N, K]
    std::vector<float> topk_weights; // [N, K]
};

void run_case(World& w, const Case& cs, std::mt19937& rng, bool with_topk, int num_worst) {
    const int R = w.num_ranks, N = cs.num_tokens, K = with_topk ? cs.num_topk : 0, E = cs.num_experts;
    const int L = E / R, C = cs.num_channels, S = cs.num_scales, HB = cs.hidden_bytes;
    std::printf("case R=%d N=%d HB=%d K=%d E=%d S=%d C=%d Sn=%d Nn=%d worst=%d colmajor=%d\n", R, N, HB, K, E, S, C,
                cs.send_tokens, cs.recv_tokens, num_worst, cs.column_major_scales ? 1 : 0);

    // ---- inputs and the CPU layout ----
    std::vector<Inputs> in(R);
    std::vector<std::vector<uint8_t>> mask(R);  // [N, R]
    std::uniform_int_distribution<int> byte(0, 255), expert(-1, E - 1), coin(0, 3);
    std::uniform_real_distribution<float> uni(0.0f, 1.0f);
    for (int r = 0; r < R; ++r) {
        in[r].x.resize(static_cast<size_t>(N) * HB);
        for (auto& b : in[r].x) b = static_cast<uint8_t>(byte(rng));
        in[r].scales.resize(static_cast<size_t>(N) * S);
        for (auto& s : in[r].scales) s = uni(rng);
        in[r].topk_idx.resize(static_cast<size_t>(N) * cs.num_topk);
        in[r].topk_weights.resize(static_cast<size_t>(N) * cs.num_topk);
        mask[r].assign(static_cast<size_t>(N) * R, 0);
        for (int t = 0; t < N; ++t) {
            const bool empty = coin(rng) == 0 && t % 7 == 0;
            for (int k = 0; k < cs.num_topk; ++k) {
                const int e = empty ? -1 : expert(rng);
                in[r].topk_idx[t * cs.num_topk + k] = e;
                in[r].topk_weights[t * cs.num_topk + k] = uni(rng);
                if (e >= 0) mask[r][t * R + e / L] = 1;
            }
        }
    }

    // ---- device buffers per rank ----
    struct Dev {
        int64_t* topk_idx; float* topk_weights; uint8_t* x; float* scales;
        int *per_rank, *per_expert; bool* in_rank;
        int *rank_prefix, *channel_prefix, *recv_channel_prefix, *send_head;
    };
    std::vector<Dev> dev(R);
    for (int r = 0; r < R; ++r) {
        const int d = w.ranks[r].device;
        dev[r].topk_idx = device_alloc<int64_t>(d, in[r].topk_idx.size());
        dev[r].topk_weights = device_alloc<float>(d, in[r].topk_weights.size());
        dev[r].x = device_alloc<uint8_t>(d, in[r].x.size());
        dev[r].scales = device_alloc<float>(d, in[r].scales.size());
        dev[r].per_rank = device_alloc<int>(d, R);
        dev[r].per_expert = device_alloc<int>(d, E);
        dev[r].in_rank = device_alloc<bool>(d, static_cast<size_t>(N) * R);
        dev[r].rank_prefix = device_alloc<int>(d, R * R);
        dev[r].channel_prefix = device_alloc<int>(d, R * C);
        dev[r].recv_channel_prefix = device_alloc<int>(d, R * C);
        dev[r].send_head = device_alloc<int>(d, static_cast<size_t>(N) * R);
        upload(d, dev[r].topk_idx, in[r].topk_idx);
        upload(d, dev[r].topk_weights, in[r].topk_weights);
        upload(d, dev[r].x, in[r].x);
        upload(d, dev[r].scales, in[r].scales);
    }

    // ---- get_dispatch_layout ----
    std::vector<std::vector<int>> ref_per_rank(R, std::vector<int>(R, 0)), ref_per_expert(R, std::vector<int>(E, 0));
    for (int r = 0; r < R; ++r) {
        DEEP_EP_CUDA_CHECK(cudaSetDevice(w.ranks[r].device));
        get_dispatch_layout(dev[r].topk_idx, 8, N, cs.num_topk, R, E, R, dev[r].per_rank, nullptr, dev[r].per_expert,
                            dev[r].in_rank, w.ranks[r].stream);
        for (int t = 0; t < N; ++t) {
            for (int d = 0; d < R; ++d) ref_per_rank[r][d] += mask[r][t * R + d];
            for (int k = 0; k < cs.num_topk; ++k)
                if (in[r].topk_idx[t * cs.num_topk + k] >= 0) ++ref_per_expert[r][in[r].topk_idx[t * cs.num_topk + k]];
        }
    }
    w.sync_all();
    for (int r = 0; r < R; ++r) {
        const int d = w.ranks[r].device;
        EXPECT(download(d, dev[r].per_rank, R) == ref_per_rank[r], "layout num_tokens_per_rank, rank %d", r);
        EXPECT(download(d, dev[r].per_expert, E) == ref_per_expert[r], "layout num_tokens_per_expert, rank %d", r);
        auto got = download(d, reinterpret_cast<const uint8_t*>(dev[r].in_rank), static_cast<size_t>(N) * R);
        bool same = true;
        for (size_t i = 0; i < got.size(); ++i) same &= (got[i] ? 1 : 0) == mask[r][i];
        EXPECT(same, "layout is_token_in_rank, rank %d", r);
    }

    // ---- CPU model: channel counts, prefix matrices, receive order ----
    auto channel_of = [&](int t) { return t / ((N + C - 1) / C); };
    std::vector<std::vector<int>> count(R, std::vector<int>(R * C, 0));  // count[s][d * C + c]
    for (int s = 0; s < R; ++s)
        for (int t = 0; t < N; ++t)
            for (int d = 0; d < R; ++d)
                if (mask[s][t * R + d]) ++count[s][d * C + channel_of(t)];
    std::vector<int> P(R * R, 0);
    for (int d = 0; d < R; ++d)
        for (int s = 0, acc = 0; s < R; ++s) {
            for (int c = 0; c < C; ++c) acc += count[s][d * C + c];
            P[s * R + d] = acc;
        }

    // ---- notify ----
    for (int r = 0; r < R; ++r) {
        w.ranks[r].counters_host[0] = -1;
        NotifyArgs a{};
        a.num_tokens_per_rank = dev[r].per_rank;
        a.num_tokens_per_expert = dev[r].per_expert;
        a.is_token_in_rank = dev[r].in_rank;
        a.num_tokens = N;
        a.num_experts = E;
        a.num_channels = C;
        a.expert_alignment = 4;
        a.rank_prefix_matrix = dev[r].rank_prefix;
        a.channel_prefix_matrix = dev[r].channel_prefix;
        a.recv_channel_prefix_matrix = dev[r].recv_channel_prefix;
        a.host_counters = num_worst > 0 ? nullptr : w.ranks[r].counters_dev;
        DEEP_EP_CUDA_CHECK(cudaSetDevice(w.ranks[r].device));
        intranode_notify(w.context(r), a, w.ranks[r].stream);
    }
    w.sync_all();
    EXPECT(!w.any_error(true), "notify reported an error");
    std::vector<int> M(R);
    for (int r = 0; r < R; ++r) {
        const int d = w.ranks[r].device;
        M[r] = P[(R - 1) * R + r];
        EXPECT(download(d, dev[r].rank_prefix, R * R) == P, "notify rank_prefix_matrix, rank %d", r);
        std::vector<int> cp(R * C), rcp(R * C);
        for (int dd = 0; dd < R; ++dd)
            for (int c = 0, acc = 0; c < C; ++c) cp[dd * C + c] = (acc += count[r][dd * C + c]);
        for (int s = 0; s < R; ++s)
            for (int c = 0, acc = 0; c < C; ++c) {
                rcp[s * C + c] = acc;
                acc += count[s][r * C + c];
            }
        EXPECT(download(d, dev[r].channel_prefix, R * C) == cp, "notify channel_prefix_matrix, rank %d", r);
        EXPECT(download(d, dev[r].recv_channel_prefix, R * C) == rcp, "notify recv_channel_prefix_matrix, rank %d", r);
        if (num_worst == 0) {
            EXPECT(w.ranks[r].counters_host[0] == M[r], "notify host count rank %d: %d vs %d", r,
                   w.ranks[r].counters_host[0], M[r]);
            for (int e = 0; e < L; ++e) {
                int sum = 0;
                for (int s = 0; s < R; ++s) sum += ref_per_expert[s][r * L + e];
                EXPECT(w.ranks[r].counters_host[1 + e] == (sum + 3) / 4 * 4, "notify expert count rank %d e %d", r, e);
            }
        }
    }

    // ---- dispatch (non-cached), then cached ----
    for (int pass = 0; pass < 2; ++pass) {
        struct Out { uint8_t* x; float* scales; int* src; int64_t* idx; float* w; int rows; };
        std::vector<Out> out(R);
        for (int r = 0; r < R; ++r) {
            const int d = w.ranks[r].device, rows = num_worst > 0 ? num_worst : M[r];
            out[r] = {device_alloc<uint8_t>(d, static_cast<size_t>(rows) * HB), device_alloc<float>(d, static_cast<size_t>(rows) * S),
                      device_alloc<int>(d, rows), device_alloc<int64_t>(d, static_cast<size_t>(rows) * K),
                      device_alloc<float>(d, static_cast<size_t>(rows) * K), rows};
            DispatchArgs a{};
            a.x = dev[r].x;
            a.hidden_bytes = HB;
            a.x_scales = S > 0 ? dev[r].scales : nullptr;
            a.num_scales = S;
            a.scale_token_stride = cs.column_major_scales ? 1 : S;
            a.scale_hidden_stride = cs.column_major_scales ? N : 1;
            a.topk_idx = K > 0 && pass == 0 ? dev[r].topk_idx : nullptr;
            a.topk_weights = K > 0 && pass == 0 ? dev[r].topk_weights : nullptr;
            a.num_topk = pass == 0 ? K : 0;
            a.topk_idx_bytes = 8;
            a.num_experts = E;
            a.is_token_in_rank = dev[r].in_rank;
            a.num_tokens = N;
            a.rank_prefix_matrix = dev[r].rank_prefix;
            a.recv_channel_prefix_matrix = dev[r].recv_channel_prefix;
            a.send_head = dev[r].send_head;
            a.recv_x = out[r].x;
            a.recv_x_scales = S > 0 ? out[r].scales : nullptr;
            a.recv_src_idx = out[r].src;
            a.recv_topk_idx = pass == 0 && K > 0 ? out[r].idx : nullptr;
            a.recv_topk_weights = pass == 0 && K > 0 ? out[r].w : nullptr;
            a.num_recv_rows = rows;
            a.worst_token_mode = num_worst > 0;
            a.num_channels = C;
            a.num_max_send_tokens = cs.send_tokens;
            a.num_max_recv_tokens = cs.recv_tokens;
            a.num_send_warps = R + 1 + pass * 6;  // the fewest copy warps, then more
            DEEP_EP_CUDA_CHECK(cudaSetDevice(d));
            intranode_dispatch(w.context(r), a, w.ranks[r].stream);
        }
        w.sync_all();
        EXPECT(!w.any_error(true), "dispatch reported an error (pass %d)", pass);
        for (int r = 0; r < R; ++r) {
            const int d = w.ranks[r].device;
            auto rx = download(d, out[r].x, static_cast<size_t>(out[r].rows) * HB);
            auto rs = download(d, out[r].scales, static_cast<size_t>(out[r].rows) * S);
            auto src = download(d, out[r].src, out[r].rows);
            auto idx = download(d, out[r].idx, static_cast<size_t>(out[r].rows) * K);
            auto wt = download(d, out[r].w, static_cast<size_t>(out[r].rows) * K);
            int row = 0, bad = 0;
            for (int s = 0; s < R; ++s)
                for (int t = 0; t < N; ++t) {
                    if (!mask[s][t * R + r]) continue;
                    bad += std::memcmp(&rx[static_cast<size_t>(row) * HB], &in[s].x[static_cast<size_t>(t) * HB], HB) != 0;
                    bad += src[row] != t;
                    for (int j = 0; j < S; ++j) {
                        const float want = cs.column_major_scales ? in[s].scales[static_cast<size_t>(j) * N + t]
                                                                  : in[s].scales[static_cast<size_t>(t) * S + j];
                        bad += rs[static_cast<size_t>(row) * S + j] != want;
                    }
                    if (pass == 0)
                        for (int k = 0; k < K; ++k) {
                            const int64_t e = in[s].topk_idx[t * cs.num_topk + k];
                            const bool mine = e >= static_cast<int64_t>(r) * L && e < static_cast<int64_t>(r + 1) * L;
                            bad += idx[static_cast<size_t>(row) * K + k] != (mine ? e - static_cast<int64_t>(r) * L : -1);
                            bad += wt[static_cast<size_t>(row) * K + k] != (mine ? in[s].topk_weights[t * cs.num_topk + k] : 0.0f);
                        }
                    ++row;
                }
            EXPECT(row == M[r], "dispatch row count rank %d", r);
            EXPECT(bad == 0, "dispatch rank %d pass %d: %d mismatching fields", r, pass, bad);
            if (num_worst > 0 && pass == 0)
                for (int i = M[r]; i < num_worst; ++i)
                    for (int k = 0; k < K; ++k) EXPECT(idx[static_cast<size_t>(i) * K + k] == -1, "worst-token fill rank %d row %d", r, i);
            // send_head: index among the channel's tokens to d, or -1.
            auto sh = download(d, dev[r].send_head, static_cast<size_t>(N) * R);
            int sh_bad = 0;
            std::vector<int> running(R * C, 0);
            for (int t = 0; t < N; ++t)
                for (int dd = 0; dd < R; ++dd)
                    sh_bad += sh[t * R + dd] != (mask[r][t * R + dd] ? running[dd * C + channel_of(t)]++ : -1);
            EXPECT(sh_bad == 0, "send_head rank %d: %d mismatches", r, sh_bad);
        }

        // ---- combine (first pass only): x = recv_x viewed as BF16, weights = recv_topk_weights, two biases ----
        if (pass == 0 && HB % 16 == 0) {
            const int H = HB / 2;
            std::vector<std::vector<uint16_t>> bias0(R), bias1(R);
            std::vector<uint16_t*> b0d(R), b1d(R), outd(R);
            std::vector<float*> woutd(R);
            for (int r = 0; r < R; ++r) {
                const int d = w.ranks[r].device;
                bias0[r].resize(static_cast<size_t>(N) * H);
                bias1[r].resize(static_cast<size_t>(N) * H);
                for (auto& v : bias0[r]) v = float_to_bf16_rne(uni(rng) - 0.5f);
                for (auto& v : bias1[r]) v = float_to_bf16_rne(uni(rng) - 0.5f);
                b0d[r] = device_alloc<uint16_t>(d, bias0[r].size());
                b1d[r] = device_alloc<uint16_t>(d, bias1[r].size());
                upload(d, b0d[r], bias0[r]);
                upload(d, b1d[r], bias1[r]);
                outd[r] = device_alloc<uint16_t>(d, static_cast<size_t>(N) * H);
                woutd[r] = device_alloc<float>(d, static_cast<size_t>(N) * K);
                CombineArgs a{};
                a.x = out[r].x;
                a.hidden = H;
                a.num_recv_tokens = out[r].rows;
                a.topk_weights = K > 0 ? out[r].w : nullptr;
                a.num_topk = K;
                a.bias_0 = b0d[r];
                a.bias_1 = b1d[r];
                a.rank_prefix_matrix = dev[r].rank_prefix;
                a.recv_channel_prefix_matrix = dev[r].recv_channel_prefix;
                a.send_head = dev[r].send_head;
                a.num_tokens = N;
                a.combined_x = outd[r];
                a.combined_topk_weights = K > 0 ? woutd[r] : nullptr;
                a.num_channels = C;
                a.num_max_send_tokens = cs.send_tokens > 1 ? cs.send_tokens - 1 : 1;
                a.num_max_recv_tokens = cs.recv_tokens;
                a.num_send_warps = R > 1 ? R - 1 + (cs.send_tokens % 12) : 0;
                DEEP_EP_CUDA_CHECK(cudaSetDevice(d));
                intranode_combine(w.context(r), a, w.ranks[r].stream);
            }
            w.sync_all();
            EXPECT(!w.any_error(true), "combine reported an error");
            // Row of token t of rank s on rank d: position among d's received rows.
            std::vector<std::vector<int>> row_on(R, std::vector<int>(static_cast<size_t>(N) * R, -1));  // [s][t * R + d]
            for (int d = 0; d < R; ++d) {
                int row = 0;
                for (int s = 0; s < R; ++s)
                    for (int t = 0; t < N; ++t)
                        if (mask[s][t * R + d]) row_on[s][t * R + d] = row++;
            }
            std::vector<std::vector<float>> recv_w(R);
            for (int d = 0; d < R; ++d) recv_w[d] = download(w.ranks[d].device, out[d].w, static_cast<size_t>(out[d].rows) * K);
            for (int s = 0; s < R; ++s) {
                auto got = download(w.ranks[s].device, outd[s], static_cast<size_t>(N) * H);
                auto gotw = download(w.ranks[s].device, woutd[s], static_cast<size_t>(N) * K);
                int bad = 0;
                for (int t = 0; t < N; ++t) {
                    for (int h = 0; h < H; ++h) {
                        float acc = 0.0f;
                        acc += bf16_to_float(bias0[s][static_cast<size_t>(t) * H + h]);
                        acc += bf16_to_float(bias1[s][static_cast<size_t>(t) * H + h]);
                        for (int d = 0; d < R; ++d) {
                            const int row = row_on[s][t * R + d];
                            if (row < 0) continue;
                            uint16_t v;
                            std::memcpy(&v, &in[s].x[static_cast<size_t>(t) * HB + 2 * h], 2);  // recv_x row == x row
                            acc += bf16_to_float(v);
                        }
                        bad += got[static_cast<size_t>(t) * H + h] != float_to_bf16_rne(acc) &&
                               !(std::isnan(acc) && std::isnan(bf16_to_float(got[static_cast<size_t>(t) * H + h])));
                    }
                    for (int k = 0; k < K; ++k) {
                        float acc = 0.0f;
                        for (int d = 0; d < R; ++d) {
                            const int row = row_on[s][t * R + d];
                            if (row >= 0) acc += recv_w[d][static_cast<size_t>(row) * K + k];
                        }
                        bad += gotw[static_cast<size_t>(t) * K + k] != acc;
                    }
                }
                EXPECT(bad == 0, "combine rank %d: %d mismatching values", s, bad);
            }
            for (int r = 0; r < R; ++r) {
                DEEP_EP_CUDA_CHECK(cudaSetDevice(w.ranks[r].device));
                cudaFree(b0d[r]); cudaFree(b1d[r]); cudaFree(outd[r]); cudaFree(woutd[r]);
            }
        }
        for (int r = 0; r < R; ++r) {
            DEEP_EP_CUDA_CHECK(cudaSetDevice(w.ranks[r].device));
            cudaFree(out[r].x); cudaFree(out[r].scales); cudaFree(out[r].src); cudaFree(out[r].idx); cudaFree(out[r].w);
        }
    }
    for (int r = 0; r < R; ++r) {
        DEEP_EP_CUDA_CHECK(cudaSetDevice(w.ranks[r].device));
        for (void* p : {static_cast<void*>(dev[r].topk_idx), static_cast<void*>(dev[r].topk_weights),
                        static_cast<void*>(dev[r].x), static_cast<void*>(dev[r].scales), static_cast<void*>(dev[r].per_rank),
                        static_cast<void*>(dev[r].per_expert), static_cast<void*>(dev[r].in_rank),
                        static_cast<void*>(dev[r].rank_prefix), static_cast<void*>(dev[r].channel_prefix),
                        static_cast<void*>(dev[r].recv_channel_prefix), static_cast<void*>(dev[r].send_head)})
            cudaFree(p);
    }
}

// Rank 1 skips its sends: the ranks waiting for it must end with an error record (timeout or peer aborted) within
// the 2 s budget instead of hanging; after a collective reset a barrier must pass.
void run_fault(World& w) {
    if (w.num_ranks < 2) return;
    std::printf("fault injection: rank 1 skips its sends (2 s timeout)\n");
    const int R = w.num_ranks, N = 64, HB = 256, C = 2;
    std::vector<int*> in_rank_i(R), rp(R), rcp(R), sh(R), src(R);
    std::vector<uint8_t*> x(R), rx(R);
    for (int r = 0; r < R; ++r) {
        const int d = w.ranks[r].device;
        std::vector<uint8_t> ones(static_cast<size_t>(N) * R, 1);
        bool* in_rank = device_alloc<bool>(d, ones.size());
        DEEP_EP_CUDA_CHECK(cudaMemcpy(in_rank, ones.data(), ones.size(), cudaMemcpyHostToDevice));
        std::vector<int> P(R * R), RCP(R * C);
        for (int s = 0; s < R; ++s)
            for (int dd = 0; dd < R; ++dd) P[s * R + dd] = (s + 1) * N;
        for (int s = 0; s < R; ++s)
            for (int c = 0; c < C; ++c) RCP[s * C + c] = c * (N / C);
        rp[r] = device_alloc<int>(d, R * R);
        rcp[r] = device_alloc<int>(d, R * C);
        upload(d, rp[r], P);
        upload(d, rcp[r], RCP);
        sh[r] = device_alloc<int>(d, static_cast<size_t>(N) * R);
        src[r] = device_alloc<int>(d, static_cast<size_t>(N) * R);
        x[r] = device_alloc<uint8_t>(d, static_cast<size_t>(N) * HB);
        rx[r] = device_alloc<uint8_t>(d, static_cast<size_t>(N) * R * HB);
        DispatchArgs a{};
        a.x = x[r];
        a.hidden_bytes = HB;
        a.topk_idx_bytes = 8;
        a.is_token_in_rank = in_rank;
        a.num_tokens = N;
        a.rank_prefix_matrix = rp[r];
        a.recv_channel_prefix_matrix = rcp[r];
        a.send_head = sh[r];
        a.recv_x = rx[r];
        a.recv_src_idx = src[r];
        a.num_recv_rows = N * R;
        a.num_channels = C;
        a.num_max_send_tokens = 4;
        a.num_max_recv_tokens = 16;
        a.num_send_warps = 16;
        KernelContext ctx = w.context(r, 2ull * 1000 * 1000 * 1000);
        ctx.skip_sends = r == 1;
        DEEP_EP_CUDA_CHECK(cudaSetDevice(d));
        intranode_dispatch(ctx, a, w.ranks[r].stream);
    }
    w.sync_all();
    // Every rank that receives from rank 1 must report (a timeout, or the abort of the rank that timed out first);
    // rank 1 itself may finish cleanly.
    for (int r = 0; r < R; ++r)
        if (r != 1) EXPECT(w.ranks[r].error_host->code != kErrorNone, "rank %d has no error record after the fault", r);
    EXPECT(w.ranks[0].error_host->code == kErrorTimeout || w.ranks[0].error_host->code == kErrorPeerAborted,
           "rank 0 error code %d", w.ranks[0].error_host->code);
    w.any_error(true);
    // Collective reset; then a healthy barrier must pass.
    for (int r = 0; r < R; ++r) {
        DEEP_EP_CUDA_CHECK(cudaSetDevice(w.ranks[r].device));
        intranode_reset(w.context(r), w.ranks[r].stream);
    }
    w.sync_all();
    for (int r = 0; r < R; ++r) std::memset(w.ranks[r].error_host, 0, sizeof(ErrorRecord));
    for (int r = 0; r < R; ++r) {
        DEEP_EP_CUDA_CHECK(cudaSetDevice(w.ranks[r].device));
        intranode_barrier(w.context(r), w.ranks[r].stream);
    }
    w.sync_all();
    EXPECT(!w.any_error(true), "barrier after reset reported an error");
}

}  // namespace

int main(int argc, char** argv) {
    std::vector<int> rank_counts;
    for (int i = 1; i < argc; ++i) rank_counts.push_back(std::atoi(argv[i]));
    if (rank_counts.empty()) rank_counts = {1, 2, 3, 4};
    std::mt19937 rng(1234);
    try {
        for (int R : rank_counts) {
            const int64_t nvl_bytes = 64ll << 20;
            World w = make_world(R, nvl_bytes);
            const int E = 16 * R;
            // BF16-sized rows (combine checked), FP8-like rows with scales (column- and row-major), odd sizes.
            const std::vector<Case> cases = {
                {300, 1024, 4, E, 0, 4, 6, 64, false, nvl_bytes},
                {257, 512, 8, E, 8, 3, 4, 32, true, nvl_bytes},
                {1000, 7168 * 2, 8, E, 0, 8, 8, 24, false, nvl_bytes},
                {77, 256, 16, E, 5, 5, 2, 8, false, nvl_bytes},
                {0, 128, 2, E, 0, 2, 2, 8, false, nvl_bytes},
                {513, 2048, 6, E, 16, 6, 5, 16, true, nvl_bytes},
            };
            for (const Case& cs : cases) {
                run_case(w, cs, rng, true, 0);
                run_case(w, cs, rng, false, 0);
            }
            run_case(w, cases[0], rng, true, cases[0].num_tokens * R);  // worst-token mode
            run_fault(w);
        }
    } catch (const std::exception& e) {
        std::printf("EXCEPTION: %s\n", e.what());
        ++g_failures;
    }
    std::printf(g_failures == 0 ? "SELFTEST PASSED\n" : "SELFTEST FAILED (%d failures)\n", g_failures);
    return g_failures == 0 ? 0 : 1;
}
