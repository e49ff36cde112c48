#!/usr/bin/env bash
# Compile-only check of csrc/ for sm_90a on a machine without a GPU (CI): every kernel file through nvcc, every
# host file through the host compiler in syntax-only mode against torch's headers. No linking, no GPU needed.
#
# Usage: tools/compile_check.sh            (from anywhere; exits non-zero on the first failing file)
# Needs: nvcc (CUDA 12.8+ for sm_90a; 13.x here), python3 with torch (a CPU wheel is enough: its headers are used).
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

status=0
shopt -s nullglob
for src in "$ROOT"/csrc/kernels/*.cu "$ROOT"/csrc/*.cu; do
    case "$(basename "$src")" in
        low_latency*.cu|internode*.cu|*_nvshmem.cu) echo "skip (needs NVSHMEM): ${src#$ROOT/}"; continue;;
    esac
    echo "nvcc sm_90a: ${src#$ROOT/}"
    if ! "$NVCC" -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -rdc=true \
            "${DEFINES[@]}" "${INCLUDES[@]}" -c "$src" -o "$WORK/$(basename "$src").o"; then
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
                -D__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_OPERATORS__ -DDEEP_EP_TOPK_IDX_BITS="$TOPK_BITS" \
                "${INCLUDES[@]}" -I"$NVSHMEM_ROOT/include" -c "$src" -o "$WORK/$(basename "$src").o"; then
            status=1
        fi
    done
else
    echo "skip NVSHMEM kernels: no NVSHMEM headers (set NVSHMEM_DIR or pip install nvidia-nvshmem-cu13)"
fi
CXX="${CXX:-g++}"
for src in "$ROOT"/csrc/*.cpp; do
    echo "$CXX syntax: ${src#$ROOT/}"
    inc=()
    for d in "${TORCH_INCLUDES[@]}"; do inc+=(-isystem "$d"); done
    if ! "$CXX" -std=c++17 -fsyntax-only -Wall -Wno-unused-function "${DEFINES[@]}" -DTORCH_EXTENSION_NAME=_C \
            -isystem "$STUBS" "${inc[@]}" -isystem "$PY_INCLUDE" "${INCLUDES[@]}" "$src"; then
        status=1
    fi
done
if [[ $status -ne 0 ]]; then
    echo "compile_check: FAILED" >&2
else
    echo "compile_check: OK"
fi
exit $status
