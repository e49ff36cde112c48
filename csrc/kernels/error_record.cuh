// Device side of the host-mapped ErrorRecord (api.cuh), shared by the intranode (sync.cuh) and the NVSHMEM
// low-latency kernels: the first failing thread of a rank claims the record and fills it.
#pragma once

#include <cstdint>

#include "api.cuh"

namespace deep_ep {
namespace kernels {

// Claims the record through `claim` (a zeroed word in this rank's device workspace: system atomics on host-mapped
// memory are not available on every PCIe host) and fills it; `ready` is written last, between system fences, so the
// host never reads a half-written record. A no-op when `record` is null or another thread claimed it first.
__device__ __forceinline__ void fill_error_record(ErrorRecord* record, unsigned int* claim, int32_t code,
                                                  int32_t kernel, int32_t phase, int32_t rank, int32_t peer,
                                                  int32_t channel, int64_t call_seq, int64_t expected,
                                                  int64_t observed, int64_t elapsed_ns) {
    if (record == nullptr || atomicCAS(claim, 0u, 1u) != 0u) return;
    volatile ErrorRecord* v = record;
    v->code = code;
    v->kernel = kernel;
    v->phase = phase;
    v->rank = rank;
    v->peer = peer;
    v->channel = channel;
    v->block = static_cast<int32_t>(blockIdx.x);
    v->call_seq = call_seq;
    v->expected = expected;
    v->observed = observed;
    v->elapsed_ns = elapsed_ns;
    __threadfence_system();
    v->ready = 1;
    __threadfence_system();
}

}  // namespace kernels
}  // namespace deep_ep
