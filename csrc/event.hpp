// EventHandle: a CUDA event recorded on a stream, for DeepEP V1 compatibility (`deep_ep._C.EventHandle`).
//
// The Python backend works with torch.cuda.Event (deep_ep.event.CudaEventHandle); this class exists so that code
// written against DeepEP's extension (`EventHandle()`, `.current_stream_wait()`) keeps working.
#pragma once

#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <memory>
#include <stdexcept>
#include <string>

namespace deep_ep {

struct EventHandle {
    std::shared_ptr<cudaEvent_t> event;

    // Records an event on the current CUDA stream of the current device.
    EventHandle() : EventHandle(c10::cuda::getCurrentCUDAStream().stream()) {}

    // Records an event on `stream`.
    explicit EventHandle(cudaStream_t stream) {
        auto* raw = new cudaEvent_t;
        check(cudaEventCreateWithFlags(raw, cudaEventDisableTiming), "cudaEventCreateWithFlags");
        event = std::shared_ptr<cudaEvent_t>(raw, [](cudaEvent_t* e) {
            cudaEventDestroy(*e);
            delete e;
        });
        check(cudaEventRecord(*event, stream), "cudaEventRecord");
    }

    // Makes the current stream wait for the event (no host synchronisation).
    void current_stream_wait() const {
        check(cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream().stream(), *event, 0), "cudaStreamWaitEvent");
    }

    // True once all work captured by the event has completed.
    bool query() const { return cudaEventQuery(*event) == cudaSuccess; }

   private:
    static void check(cudaError_t status, const char* what) {
        if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
    }
};

}  // namespace deep_ep
