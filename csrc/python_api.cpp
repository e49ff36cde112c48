// deep_ep._C: Python bindings of the ring-kernel runtime (buffer.cpp) and the low-latency runtime (low_latency.cpp).
// Registration only.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/python.h>

#include "buffer.hpp"
#include "event.hpp"
#include "kernels/fused_internode.cuh"
#include "low_latency.hpp"

namespace py = pybind11;

namespace {

// The error record as a dict for the Python CUDA backend (which picks the exception type), or None.
py::object error_dict(const deep_ep::Runtime& runtime) {
    auto record = runtime.read_error();
    if (!record.has_value()) return py::none();
    static const char* codes[] = {"none", "timeout", "peer_aborted", "bad_routing", "count_mismatch",
                                  "argument_mismatch"};
    const int code = record->code;
    py::dict out;
    out["code"] = (code >= 0 && code <= 5) ? codes[code] : "unknown";
    out["message"] = deep_ep::format_error(*record);
    out["rank"] = record->rank;
    out["peer"] = record->peer;
    out["channel"] = record->channel;
    out["phase"] = deep_ep::kernels::phase_name(record->phase);
    out["expected"] = record->expected;
    out["observed"] = record->observed;
    out["elapsed_s"] = record->elapsed_ns * 1e-9;
    out["call_seq"] = record->call_seq;
    return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "deep_ep CUDA extension: ring kernels (intranode and internode) and low-latency kernels";

    py::register_exception<deep_ep::HostTimeout>(m, "HostTimeout", PyExc_TimeoutError);
    py::register_exception<deep_ep::DeviceError>(m, "DeviceError", PyExc_RuntimeError);

    m.attr("MAX_RANKS") = deep_ep::kernels::kMaxRanks;
    m.attr("MAX_RUNTIME_RANKS") = deep_ep::kernels::kMaxRuntimeRanks;
    m.attr("FUSED_MAX_RANKS") = deep_ep::kernels::kFusedMaxRanks;
    m.attr("MAX_CHANNELS") = deep_ep::kernels::kMaxChannels;
    m.attr("MAX_TOPK") = deep_ep::kernels::kMaxTopk;
    m.attr("MAX_LOCAL_EXPERTS") = deep_ep::kernels::kMaxLocalExperts;
    m.attr("CONTROL_BYTES") = deep_ep::kernels::kControlBytes;
    m.attr("WORKSPACE_BYTES") = deep_ep::kernels::kWorkspaceBytes;
    m.def("num_channels_for_sms", [](int num_sms) {
        if (num_sms < 1 || num_sms > deep_ep::kernels::kMaxChannels)
            throw std::invalid_argument("config.num_sms must be in [1, " +
                                        std::to_string(deep_ep::kernels::kMaxChannels) + "], got " +
                                        std::to_string(num_sms));
        return num_sms;  // one CTA per channel
    });
    // torch.Tensor.record_stream for many tensors in one crossing; the stream is given as torch.Stream's
    // (stream_id, device_index, device_type).
    m.def("record_stream", [](const std::vector<at::Tensor>& tensors, int64_t stream_id, int64_t device_index,
                              int64_t device_type) {
        const auto stream = c10::Stream::unpack3(stream_id, static_cast<c10::DeviceIndex>(device_index),
                                                 static_cast<c10::DeviceType>(device_type));
        for (const auto& tensor : tensors) tensor.record_stream(stream);
    });

    py::class_<deep_ep::EventHandle>(m, "EventHandle")
        .def(py::init<>())
        .def("current_stream_wait", &deep_ep::EventHandle::current_stream_wait)
        .def("query", &deep_ep::EventHandle::query);

    py::class_<deep_ep::Runtime>(m, "Runtime")
        .def(py::init<int, int, int64_t, double, bool>(), py::arg("rank"), py::arg("num_ranks"),
             py::arg("num_nvl_bytes"), py::arg("timeout_s"), py::arg("symmetric") = false)
        .def("get_local_device_id", &deep_ep::Runtime::get_local_device_id)
        .def("get_local_ipc_handle", [](const deep_ep::Runtime& r) { return py::bytes(r.get_local_ipc_handle()); })
        .def("sync", &deep_ep::Runtime::sync)
        .def("sync_symmetric", &deep_ep::Runtime::sync_symmetric, py::arg("unique_id"))
        .def("set_put_peers", &deep_ep::Runtime::set_put_peers)
        .def("get_put_mask", &deep_ep::Runtime::get_put_mask)
        .def("get_ring_bytes", &deep_ep::Runtime::get_ring_bytes)
        .def("destroy", &deep_ep::Runtime::destroy)
        .def("read_error", &error_dict)
        .def("reset", &deep_ep::Runtime::reset)
        .def("signal_abort", &deep_ep::Runtime::signal_abort)
        .def("set_fault_injection", &deep_ep::Runtime::set_fault_injection)
        .def("get_local_buffer_tensor", &deep_ep::Runtime::get_local_buffer_tensor)
        .def("get_dispatch_layout", &deep_ep::Runtime::get_dispatch_layout)
        .def("notify_dispatch", &deep_ep::Runtime::notify_dispatch)
        .def("wait_recv_counts", &deep_ep::Runtime::wait_recv_counts, py::call_guard<py::gil_scoped_release>())
        .def("pair_counts", &deep_ep::Runtime::pair_counts)
        .def("gathered_signatures", &deep_ep::Runtime::gathered_signatures)
        .def("refuse_notify", &deep_ep::Runtime::refuse_notify)
        .def("clear_argument_error", &deep_ep::Runtime::clear_argument_error)
        .def("await_agreement", &deep_ep::Runtime::await_agreement, py::call_guard<py::gil_scoped_release>())
        .def("would_copy", &deep_ep::Runtime::would_copy)
        .def("get_copy_epoch", &deep_ep::Runtime::get_copy_epoch)
        .def("get_pool_offset", &deep_ep::Runtime::get_pool_offset)
        .def("get_pool_bytes", &deep_ep::Runtime::get_pool_bytes)
        .def("collect_pool_blocks", &deep_ep::Runtime::collect_pool_blocks)
        .def("dispatch", &deep_ep::Runtime::dispatch)
        .def("combine", &deep_ep::Runtime::combine)
        .def("fused_notify", &deep_ep::Runtime::fused_notify)
        .def("forward_count", &deep_ep::Runtime::forward_count)
        .def("fused_refuse_notify", &deep_ep::Runtime::fused_refuse_notify)
        .def("fused_dispatch", &deep_ep::Runtime::fused_dispatch)
        .def("fused_combine", &deep_ep::Runtime::fused_combine)
        .def("barrier", &deep_ep::Runtime::barrier);

    // ---- low-latency kernels over NVSHMEM (absent from an intranode-only build) ----
#ifdef DEEP_EP_DISABLE_NVSHMEM
    m.attr("HAS_LOW_LATENCY") = false;
#else
    m.attr("HAS_LOW_LATENCY") = true;
    m.attr("LL_MAX_TOPK") = deep_ep::kernels::kMaxTopk;
    m.attr("LL_MAX_TOKENS") = deep_ep::kernels::ll::kMaxTokens;
    m.def("ll_unique_id", [] { return py::bytes(deep_ep::ll_unique_id()); });
    // (PE, number of PEs) of the NVSHMEM world this process joined, or None before it joined one.
    m.def("ll_world", []() -> py::object {
        const auto world = deep_ep::kernels::ll::nvshmem_world();
        if (world.second == 0) return py::none();
        return py::make_tuple(world.first, world.second);
    });
    py::class_<deep_ep::LowLatencyRuntime>(m, "LowLatencyRuntime")
        .def(py::init<int, int, int64_t, double, bool, const std::string&, bool>(), py::arg("rank"),
             py::arg("num_ranks"), py::arg("num_rdma_bytes"), py::arg("timeout_s"), py::arg("enable_shrink"),
             py::arg("unique_id"), py::arg("put_only") = false)
        .def("all_p2p", &deep_ep::LowLatencyRuntime::all_p2p)
        .def("num_blocks", &deep_ep::LowLatencyRuntime::num_blocks)
        .def("required_bytes", &deep_ep::LowLatencyRuntime::required_bytes)
        .def("dispatch", &deep_ep::LowLatencyRuntime::dispatch)
        .def("combine", &deep_ep::LowLatencyRuntime::combine)
        .def("refuse_combine", &deep_ep::LowLatencyRuntime::refuse_combine)
        .def("combine_buffer", &deep_ep::LowLatencyRuntime::combine_buffer)
        .def("clean", &deep_ep::LowLatencyRuntime::clean)
        .def("barrier", &deep_ep::LowLatencyRuntime::barrier)
        .def("update_mask", &deep_ep::LowLatencyRuntime::update_mask)
        .def("query_mask", &deep_ep::LowLatencyRuntime::query_mask)
        .def("clean_mask", &deep_ep::LowLatencyRuntime::clean_mask)
        .def("read_error",
             [](const deep_ep::LowLatencyRuntime& r) -> py::object {
                 auto record = r.read_error();
                 if (!record.has_value()) return py::none();
                 static const char* codes[] = {"none", "timeout", "peer_aborted", "bad_routing", "count_mismatch",
                                               "argument_mismatch"};
                 const int code = record->code;
                 py::dict out;
                 out["code"] = (code >= 0 && code <= 5) ? codes[code] : "unknown";
                 out["message"] = deep_ep::format_ll_error(*record);
                 out["rank"] = record->rank;
                 out["peer"] = record->peer;
                 out["phase"] = deep_ep::kernels::ll::ll_phase_name(record->phase);
                 return out;
             })
        .def("reset", &deep_ep::LowLatencyRuntime::reset)
        .def("clear_argument_error", &deep_ep::LowLatencyRuntime::clear_argument_error)
        .def("destroy", &deep_ep::LowLatencyRuntime::destroy);
#endif
}
