// Failure reports of the kernels' host code (launchers and runtime helpers). Plain C++ (no device code).
//
// Host code compiled by nvcc does not throw: a C++ exception thrown there does not reach the caller (the process
// ends with SIGSEGV instead of raising in Python). Every host function of csrc/kernels that can fail returns a
// Status instead, and the host layer (csrc/*.cpp, compiled by the host compiler) turns a failed one into an
// exception (throw_if_failed, csrc/status.hpp). tools/compile_check.sh rejects a kernel object that throws.
//
// * DEEP_EP_REQUIRE_ARG(cond, parts...): returns an invalid-argument Status built from the streamed parts; the
//   message names the argument, the rule and the value, e.g.
//   DEEP_EP_REQUIRE_ARG(k <= 16, "num_topk must be <= 16, got ", k).
// * DEEP_EP_RETURN_IF_CUDA_ERROR(expr): returns a runtime-error Status
//   "CUDA error <name>: <text> at <file>:<line> '<expr>'".
// * DEEP_EP_RETURN_IF_FAILED(expr): returns the Status of `expr` when it failed.
// Kernels never trap: device-side failures go to the ErrorRecord of api.cuh instead.
#pragma once

#include <cuda_runtime.h>

#include <sstream>
#include <string>

namespace deep_ep {
namespace kernels {

enum class StatusKind : int { kOk = 0, kInvalidArgument = 1, kRuntimeError = 2 };

// Success (the default) or a failure of `kind` described by `message`.
struct [[nodiscard]] Status {
    StatusKind kind = StatusKind::kOk;
    std::string message;

    bool ok() const { return kind == StatusKind::kOk; }
};

template <typename... Parts>
std::string concat_message(const Parts&... parts) {
    std::ostringstream stream;
    (stream << ... << parts);
    return stream.str();
}

template <typename... Parts>
Status invalid_argument_status(const Parts&... parts) {
    return Status{StatusKind::kInvalidArgument, concat_message(parts...)};
}

template <typename... Parts>
Status runtime_error_status(const Parts&... parts) {
    return Status{StatusKind::kRuntimeError, concat_message(parts...)};
}

inline Status cuda_status(cudaError_t error, const char* expr, const char* file, int line) {
    if (error == cudaSuccess) return {};
    return runtime_error_status("CUDA error ", cudaGetErrorName(error), ": ", cudaGetErrorString(error), " at ", file,
                                ":", line, " '", expr, "'");
}

}  // namespace kernels
}  // namespace deep_ep

#define DEEP_EP_RETURN_IF_FAILED(expr)                       \
    do {                                                     \
        ::deep_ep::kernels::Status deep_ep_status_ = (expr); \
        if (!deep_ep_status_.ok()) return deep_ep_status_;   \
    } while (0)

#define DEEP_EP_RETURN_IF_CUDA_ERROR(expr) \
    DEEP_EP_RETURN_IF_FAILED(::deep_ep::kernels::cuda_status((expr), #expr, __FILE__, __LINE__))

#define DEEP_EP_REQUIRE_ARG(cond, ...)                                                \
    do {                                                                              \
        if (!(cond)) return ::deep_ep::kernels::invalid_argument_status(__VA_ARGS__); \
    } while (0)
