// Compile-time limits of the intranode normal-mode kernels. Plain C++ (no device code): host files include it too.
//
// The matching Python constants live in deep_ep/layout.py (INTRANODE_*); keep both in step.
#pragma once

#include <cstdint>

namespace deep_ep {
namespace kernels {

// Largest group of the ring kernels (ranks 1..24, any count): an NVLink domain of up to 8 GPUs for the intranode
// Buffer, up to 24 nodes for the one-GPU-per-node internode backend and the composed path's rail stage. The kernels'
// structure allows up to 30 (lane-per-rank code needs < 32; the dispatch a receiver warp per source beside three
// sender warps, the combine a ring-sender warp per destination beside the publisher and a reducer); 24 is the
// largest count run on a GPU. Raising it: NUM_MAX_RING_RANKS in deep_ep/config.py too, then run the GPU internode
// tests at the new cap.
constexpr int kMaxRanks = 24;
// Largest group of one runtime (KernelContext's peer arrays, the barrier, the gathered call signatures): the ring
// kernels serve up to kMaxRanks of it, the fused internode kernels up to kFusedMaxRanks (fused_internode.cuh).
constexpr int kMaxRuntimeRanks = 64;
// Largest number of channels (one CTA each) of a dispatch or combine kernel; Config.num_sms must not exceed it.
constexpr int kMaxChannels = 160;
// Largest top-k the intranode kernels carry per token.
constexpr int kMaxTopk = 16;
// Largest number of local experts per rank (per-expert counts exchanged by the notify kernel).
constexpr int kMaxLocalExperts = 1024;
// int64 words of a call's signature (deep_ep/backends/agreement.py SIGNATURE_WORDS), carried by the notify slots.
constexpr int kSignatureWords = 32;
// Largest number of experts in total (get_dispatch_layout).
constexpr int kMaxExperts = 8 * 1024;

// Threads of the dispatch and combine kernels (one CTA per channel): 32 warps.
constexpr int kChannelThreads = 1024;
constexpr int kChannelWarps = kChannelThreads / 32;
// Threads of the single-CTA notify kernel.
constexpr int kNotifyThreads = 1024;
// Threads per block of the layout kernel.
constexpr int kLayoutThreads = 256;

// Every region of the scale-up buffer starts at a multiple of this (deep_ep.config.BUFFER_ALIGNMENT).
constexpr int64_t kBufferAlignment = 128;

// Bytes of the zeroed device workspace that holds the kernels' private state (see layout.cuh, Workspace).
constexpr int64_t kWorkspaceBytes = 1 << 20;

}  // namespace kernels
}  // namespace deep_ep
