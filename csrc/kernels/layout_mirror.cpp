// Prints the intranode buffer layout of layout.cuh as "key value" lines, for comparison with deep_ep/layout.py (no
// CUDA device needed; any C++17 compiler with the CUDA headers on the include path):
//   g++ -std=c++17 -I/usr/local/cuda/include csrc/kernels/layout_mirror.cpp -o /tmp/layout_mirror
// Keys: control.<region> / workspace.<region> offsets, control_bytes, and for each line of
// "geometry <num_nvl_bytes> <num_ranks> <num_channels> <record_bytes> <max_capacity> <is_combine>" read from stdin the
// values "half_offset source_bytes capacity last_slot_offset".
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <string>

#include "layout.cuh"

using namespace deep_ep::kernels;

int main() {
    const struct { const char* name; long long value; } fixed[] = {
        {"control.abort", kAbortOffset},
        {"control.barrier", kBarrierOffset},
        {"control.notify_flags", kNotifyFlagOffset},
        {"control.notify_data", kNotifyDataOffset},
        {"control.dispatch_tail", kDispatchTailOffset},
        {"control.dispatch_head", kDispatchHeadOffset},
        {"control.combine_tail", kCombineTailOffset},
        {"control.combine_head", kCombineHeadOffset},
        {"control_bytes", kControlBytes},
        {"workspace.notify_epoch", kWsNotifyEpochOffset},
        {"workspace.barrier_epoch", kWsBarrierEpochOffset},
        {"workspace.dispatch_max_channels", kWsDispatchMaxChannelsOffset},
        {"workspace.combine_max_channels", kWsCombineMaxChannelsOffset},
        {"workspace.error_claim", kWsErrorClaimOffset},
        {"workspace.dispatch_tail_shadow", kWsDispatchTailShadowOffset},
        {"workspace.dispatch_head_shadow", kWsDispatchHeadShadowOffset},
        {"workspace.combine_tail_shadow", kWsCombineTailShadowOffset},
        {"workspace.combine_head_shadow", kWsCombineHeadShadowOffset},
        {"workspace_bytes", kWorkspaceBytes},
        {"max_ranks", kMaxRanks},
        {"max_channels", kMaxChannels},
        {"max_topk", kMaxTopk},
        {"max_local_experts", kMaxLocalExperts},
        {"notify_ints", kNotifyInts},
    };
    for (const auto& f : fixed) std::printf("%s %lld\n", f.name, f.value);
    std::string word;
    long long nvl_bytes, record_bytes;
    int num_ranks, num_channels, max_capacity, is_combine;
    while (std::cin >> word >> nvl_bytes >> num_ranks >> num_channels >> record_bytes >> max_capacity >> is_combine) {
        const RingGeometry g = ring_geometry(nvl_bytes, num_ranks, num_channels, record_bytes, max_capacity, is_combine != 0);
        const long long last = g.capacity > 0 ? g.slot_offset(num_channels - 1, num_ranks - 1, g.capacity - 1) : -1;
        std::printf("geometry %lld %lld %d %lld\n", static_cast<long long>(g.half_offset),
                    static_cast<long long>(g.source_bytes), g.capacity, last);
    }
    return 0;
}
