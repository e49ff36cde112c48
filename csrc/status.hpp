// The host layer's side of the kernels' Status (csrc/kernels/status.cuh): the kernels' host code reports failures
// as values, and the host files, compiled by the host compiler, raise them as exceptions here.
#pragma once

#include <stdexcept>

#include "kernels/status.cuh"

namespace deep_ep {

// Throws std::invalid_argument (Python ValueError) or std::runtime_error (RuntimeError) with the status's message
// when it failed.
inline void throw_if_failed(const kernels::Status& status) {
    switch (status.kind) {
        case kernels::StatusKind::kOk: return;
        case kernels::StatusKind::kInvalidArgument: throw std::invalid_argument(status.message);
        case kernels::StatusKind::kRuntimeError: throw std::runtime_error(status.message);
    }
    throw std::runtime_error(status.message);
}

}  // namespace deep_ep
