#!/usr/bin/env bash
# Compile-only check of csrc/ for sm_90a on a machine without a GPU (CI): every kernel file through nvcc (its object
# must not throw, see check_no_throw), every host file through the host compiler in syntax-only mode against torch's
# headers. No linking, no GPU needed.
#
# Usage: tools/compile_check.sh            (from anywhere; exits non-zero on the first failing file)
# Needs: nvcc (CUDA 12.8+ for sm_90a; 13.x here), python3 with torch (a CPU wheel is enough: its headers are used),
# nm (binutils).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NVCC="${NVCC:-$(command -v nvcc || true)}"
if [[ -z "$NVCC" ]]; then
    echo "compile_check: nvcc not found (install the CUDA toolkit or set NVCC=/path/to/nvcc)" >&2
    exit 2
fi
# The toolkit root: $CUDA_HOME, else where nvcc's include/ is (nvcc may be a wrapper script), else /usr/local/cuda*.
if [[ -z "${CUDA_HOME:-}" || ! -f "${CUDA_HOME}/include/cuda_runtime.h" ]]; then
    CUDA_HOME=""
    for candidate in "$(dirname "$(readlink -f "$NVCC")")/.." /usr/local/cuda /usr/local/cuda-*; do
        if [[ -f "$candidate/include/cuda_runtime.h" ]]; then CUDA_HOME="$(cd "$candidate" && pwd)"; break; fi
    done
fi
if [[ -z "$CUDA_HOME" ]]; then
    echo "compile_check: no CUDA include directory found (set CUDA_HOME)" >&2
    exit 2
fi
PYTHON="${PYTHON:-python3}"
mapfile -t TORCH_INCLUDES < <("$PYTHON" -c "import torch.utils.cpp_extension as c; print('\n'.join(c.include_paths()))")
PY_INCLUDE="$("$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['include'])")"
TOPK_BITS="$("$PYTHON" -c "import importlib.util as u, sys; s=u.spec_from_file_location('e', '$ROOT/deep_ep/envs.py'); m=u.module_from_spec(s); sys.modules['e']=m; s.loader.exec_module(m); print(m.TOPK_IDX_BITS.get())")"

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
# A CPU torch wheel ships c10/cuda headers but not the CMake-generated macro header they include; supply it.
STUBS="$WORK/stubs"
if ! ls "${TORCH_INCLUDES[0]}/c10/cuda/impl/cuda_cmake_macros.h" >/dev/null 2>&1; then
    mkdir -p "$STUBS/c10/cuda/impl"
    echo '#pragma once' > "$STUBS/c10/cuda/impl/cuda_cmake_macros.h"
fi

DEFINES=(-DDEEP_EP_TOPK_IDX_BITS="$TOPK_BITS" -DDEEP_EP_DISABLE_NVSHMEM)
INCLUDES=(-I"$ROOT/csrc" -I"$ROOT/csrc/kernels" -I"$CUDA_HOME/include")
[[ -d "$CUDA_HOME/include/cccl" ]] && INCLUDES+=(-I"$CUDA_HOME/include/cccl")

# Host code compiled by nvcc must not throw: a C++ exception thrown there does not reach Python (the extension's
# process ends with SIGSEGV instead), so the kernels' host code reports failures as a returned Status
# (csrc/kernels/status.cuh) that csrc/*.cpp raises. An object referencing __cxa_throw has a throw in it. A discarded
# Status is an error too (nvcc diagnostic 3004 and -Werror=unused-result: the type is [[nodiscard]]).
check_no_throw() {
    local symbols
    symbols="$(nm "$1")"
    if grep -w '__cxa_throw' <<<"$symbols" >/dev/null; then
        echo "compile_check: ${2#$ROOT/} throws a C++ exception from nvcc-compiled host code (return a Status)" >&2
        return 1
    fi
}

status=0
shopt -s nullglob
for src in "$ROOT"/csrc/kernels/*.cu "$ROOT"/csrc/*.cu; do
    case "$(basename "$src")" in
        low_latency*.cu|internode*.cu|*_nvshmem.cu) echo "skip (needs NVSHMEM): ${src#$ROOT/}"; continue;;
    esac
    echo "nvcc sm_90a: ${src#$ROOT/}"
    if ! "$NVCC" -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -rdc=true \
            --diag-error=3004 "${DEFINES[@]}" "${INCLUDES[@]}" -c "$src" -o "$WORK/$(basename "$src").o" ||
       ! check_no_throw "$WORK/$(basename "$src").o" "$src"; then
        status=1
    fi
done
# NVSHMEM kernels (low-latency mode, and the ring kernels' put path of csrc/kernels/put.cuh): compiled when
# NVSHMEM headers exist ($NVSHMEM_DIR, else the pip wheel nvidia-nvshmem-cu13 of $PYTHON), as setup.py does:
# relocatable device code and torch's macros undone.
NVSHMEM_ROOT="${NVSHMEM_DIR:-$("$PYTHON" -c "import nvidia.nvshmem as n, os; print(os.path.dirname(n.__file__) if n.__file__ else list(n.__path__)[0])" 2>/dev/null || true)}"
if [[ -n "$NVSHMEM_ROOT" && -f "$NVSHMEM_ROOT/include/nvshmem.h" ]]; then
    for src in "$ROOT"/csrc/kernels/low_latency*.cu "$ROOT"/csrc/kernels/*_nvshmem.cu "$ROOT"/csrc/kernels/internode*.cu \
               "$ROOT"/csrc/kernels/intranode*.cu "$ROOT"/csrc/kernels/fused*.cu; do
        echo "nvcc sm_90a (NVSHMEM at $NVSHMEM_ROOT): ${src#$ROOT/}"
        if ! "$NVCC" -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -rdc=true \
                --diag-error=3004 -D__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_OPERATORS__ \
                -DDEEP_EP_TOPK_IDX_BITS="$TOPK_BITS" \
                "${INCLUDES[@]}" -I"$NVSHMEM_ROOT/include" -c "$src" -o "$WORK/$(basename "$src").o" ||
           ! check_no_throw "$WORK/$(basename "$src").o" "$src"; then
            status=1
        fi
    done
else
    echo "skip NVSHMEM kernels: no NVSHMEM headers (set NVSHMEM_DIR or pip install nvidia-nvshmem-cu13)"
fi
CXX="${CXX:-g++}"
# Host files: in the build without NVSHMEM, and, when NVSHMEM is here, in the build with it (the body of
# csrc/low_latency.cpp, the symmetric paths of csrc/buffer.cpp; no host file includes an NVSHMEM header).
HOST_BUILDS=("-DDEEP_EP_DISABLE_NVSHMEM")
[[ -n "$NVSHMEM_ROOT" && -f "$NVSHMEM_ROOT/include/nvshmem.h" ]] && HOST_BUILDS+=("-UDEEP_EP_DISABLE_NVSHMEM")
inc=()
for d in "${TORCH_INCLUDES[@]}"; do inc+=(-isystem "$d"); done
for src in "$ROOT"/csrc/*.cpp; do
    for build in "${HOST_BUILDS[@]}"; do
        echo "$CXX syntax ($build): ${src#$ROOT/}"
        if ! "$CXX" -std=c++17 -fsyntax-only -Wall -Werror=unused-result -Wno-unused-function \
                -DDEEP_EP_TOPK_IDX_BITS="$TOPK_BITS" "$build" -DTORCH_EXTENSION_NAME=_C \
                -isystem "$STUBS" "${inc[@]}" -isystem "$PY_INCLUDE" "${INCLUDES[@]}" "$src"; then
            status=1
        fi
    done
done
if [[ $status -ne 0 ]]; then
    echo "compile_check: FAILED" >&2
else
    echo "compile_check: OK"
fi
exit $status
