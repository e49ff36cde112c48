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

#include <cstdio>
#include <string>
#include <type_traits>

namespace deep_ep {
namespace kernels {

enum class StatusKind : int { kOk = 0, kInvalidArgument = 1, kRuntimeError = 2 };

// Success (the default) or a failure of `kind` described by `message`.
struct [[nodiscard]] Status {
    StatusKind kind = StatusKind::kOk;
    std::string message;

    bool ok() const { return kind == StatusKind::kOk; }
};

// Message parts are appended without iostreams: a std::ostream insertion compiled by nvcc into the extension ends
// the process with SIGSEGV (the stream's locale code), so numbers go through snprintf.
inline void append_part(std::string& out, const char* part) { out += part; }
inline void append_part(std::string& out, const std::string& part) { out += part; }
inline void append_part(std::string& out, char part) { out += part; }
template <typename T>
void append_part(std::string& out, const T& part) {
    static_assert(std::is_arithmetic<T>::value || std::is_enum<T>::value, "message parts: strings and numbers");
    char text[32];
    if constexpr (std::is_floating_point<T>::value) {
        std::snprintf(text, sizeof(text), "%g", static_cast<double>(part));
    } else if constexpr (std::is_same<T, bool>::value) {
        std::snprintf(text, sizeof(text), "%s", part ? "true" : "false");
    } else if constexpr (std::is_signed<T>::value || std::is_enum<T>::value) {
        std::snprintf(text, sizeof(text), "%lld", static_cast<long long>(part));
    } else {
        std::snprintf(text, sizeof(text), "%llu", static_cast<unsigned long long>(part));
    }
    out += text;
}

template <typename... Parts>
std::string concat_message(const Parts&... parts) {
    std::string out;
    (append_part(out, parts), ...);
    return out;
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
