// Host-side error helpers of the kernel launchers. Plain C++ (no device code).
//
// * DEEP_EP_CUDA_CHECK(expr): throws std::runtime_error("CUDA error <name>: <text> at <file>:<line> '<expr>'").
// * DEEP_EP_CHECK_ARG(cond, parts...): throws std::invalid_argument built from the streamed parts; the message
//   names the argument, the rule and the value, e.g. DEEP_EP_CHECK_ARG(k <= 16, "num_topk must be <= 16, got ", k).
// Kernels never trap: device-side failures go to the ErrorRecord of api.cuh instead.
#pragma once

#include <cuda_runtime.h>

#include <sstream>
#include <stdexcept>
#include <string>

namespace deep_ep {
namespace kernels {

template <typename... Parts>
std::string concat_message(const Parts&... parts) {
    std::ostringstream stream;
    (stream << ... << parts);
    return stream.str();
}

inline void throw_cuda_error(cudaError_t error, const char* expr, const char* file, int line) {
    throw std::runtime_error(concat_message("CUDA error ", cudaGetErrorName(error), ": ", cudaGetErrorString(error),
                                            " at ", file, ":", line, " '", expr, "'"));
}

}  // namespace kernels
}  // namespace deep_ep

#define DEEP_EP_CUDA_CHECK(expr)                                                        \
    do {                                                                                \
        cudaError_t deep_ep_error_ = (expr);                                            \
        if (deep_ep_error_ != cudaSuccess)                                              \
            ::deep_ep::kernels::throw_cuda_error(deep_ep_error_, #expr, __FILE__, __LINE__); \
    } while (0)

#define DEEP_EP_CHECK_ARG(cond, ...)                                                          \
    do {                                                                                      \
        if (!(cond)) throw std::invalid_argument(::deep_ep::kernels::concat_message(__VA_ARGS__)); \
    } while (0)
