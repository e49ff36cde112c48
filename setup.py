"""Build script for deep_ep.

Always installs the pure-Python packages ``deep_ep``, ``reference`` and ``simulator`` (metadata lives in
``pyproject.toml``). The CUDA extension ``deep_ep._C`` is added only when every prerequisite is present:

* ``DEEP_EP_CPU_ONLY`` is not set;
* torch is importable in the build environment and is a CUDA build (``torch.version.cuda``);
* ``nvcc`` exists under torch's ``CUDA_HOME``;
* ``csrc/`` has sources.

NVSHMEM (internode and low-latency kernels) comes from ``NVSHMEM_DIR`` or, failing that, from the
``nvidia-nvshmem-cu12/cu13`` pip wheel; ``DEEP_EP_DISABLE_NVSHMEM=1`` builds the intranode kernels only.
``DEEP_EP_DEBUG_BUILD=1`` adds source line info (``-lineinfo``). A build summary is printed either way.
GPU build (see docs/build.md)::

    MAX_JOBS=32 pip install -e . --no-build-isolation
"""

import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
DEFAULT_ARCH_LIST = "9.0a"
# Kernel files that need NVSHMEM (the low-latency kernels); left out of an intranode-only build.
NVSHMEM_ONLY_PATTERNS = ("low_latency*.cu", "*_nvshmem.cu", "internode*.cu")


def load_envs():
    """Load ``deep_ep/envs.py`` by file path, so that neither ``deep_ep/__init__`` nor torch is imported."""
    spec = importlib.util.spec_from_file_location("_deep_ep_build_envs", ROOT / "deep_ep" / "envs.py")
    module = importlib.util.module_from_spec(spec)
    # dataclasses resolves string annotations through sys.modules, so register before executing.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


envs = load_envs()


@dataclass
class NvshmemInstall:
    """Where NVSHMEM lives and how to link it."""

    root: Path
    origin: str  # "NVSHMEM_DIR" or "pip wheel"
    host_lib_flag: str  # "-lnvshmem_host" or "-l:libnvshmem_host.so.3"

    @property
    def include_dir(self) -> Path:
        return self.root / "include"

    @property
    def lib_dir(self) -> Path:
        return self.root / "lib"


@dataclass
class ExtensionSpec:
    """Everything ``CUDAExtension`` needs, or the reason the extension is skipped (``sources`` empty)."""

    sources: list[str] = field(default_factory=list)
    skipped_sources: list[str] = field(default_factory=list)
    include_dirs: list[str] = field(default_factory=list)
    library_dirs: list[str] = field(default_factory=list)
    define_macros: list[tuple[str, str | None]] = field(default_factory=list)
    cxx_flags: list[str] = field(default_factory=list)
    nvcc_flags: list[str] = field(default_factory=list)
    nvcc_dlink_flags: list[str] = field(default_factory=list)
    link_flags: list[str] = field(default_factory=list)
    arch_list: str = ""
    nvshmem: NvshmemInstall | None = None
    nvshmem_note: str = ""
    skip_reason: str = ""


def _host_lib_flag(lib_dir: Path) -> str:
    """Linker flag for the NVSHMEM host library: the plain name if an unversioned ``.so`` exists, else the
    versioned file by exact name (the pip wheel ships only ``libnvshmem_host.so.3``)."""
    if (lib_dir / "libnvshmem_host.so").exists():
        return "-lnvshmem_host"
    versioned = sorted(lib_dir.glob("libnvshmem_host.so.*"))
    if not versioned:
        raise RuntimeError(f"NVSHMEM at {lib_dir.parent} has no libnvshmem_host.so* in {lib_dir}")
    return f"-l:{versioned[0].name}"


def find_nvshmem() -> tuple[NvshmemInstall | None, str]:
    """Locate NVSHMEM: ``NVSHMEM_DIR`` first, then ``nvidia/nvshmem`` in any ``sys.path`` entry (the pip wheel).

    Returns the install (or ``None``) and a one-line note for the build summary.
    """
    if envs.DISABLE_NVSHMEM.get():
        return None, f"disabled by {envs.DISABLE_NVSHMEM.name}=1 (intranode kernels only)"
    if envs.NVSHMEM_DIR.is_set():
        root = Path(envs.NVSHMEM_DIR.get()).expanduser().resolve()
        if not (root / "include" / "nvshmem.h").exists():
            raise RuntimeError(f"{envs.NVSHMEM_DIR.name}={root} is not an NVSHMEM install: "
                               f"{root / 'include' / 'nvshmem.h'} does not exist")
        return NvshmemInstall(root, envs.NVSHMEM_DIR.name, _host_lib_flag(root / "lib")), f"{root} (from NVSHMEM_DIR)"
    for entry in sys.path:
        root = Path(entry or ".") / "nvidia" / "nvshmem"
        if (root / "include" / "nvshmem.h").exists() and (root / "lib").is_dir():
            root = root.resolve()
            return NvshmemInstall(root, "pip wheel", _host_lib_flag(root / "lib")), f"{root} (pip wheel)"
    return None, ("not found (set NVSHMEM_DIR or pip install nvidia-nvshmem-cu12/cu13); "
                  "internode and low-latency kernels are left out")


def _is_nvshmem_only(path: Path) -> bool:
    return any(path.match(pattern) for pattern in NVSHMEM_ONLY_PATTERNS)


def cuda_extension_spec(cuda_home: str) -> ExtensionSpec:
    """Sources and flags of ``deep_ep._C`` for the CUDA toolkit at ``cuda_home``.

    The single place that decides sources, defines, include paths and compiler/linker flags. Paths are
    relative to the repository root, as setuptools wants.
    """
    spec = ExtensionSpec()
    all_sources = sorted(ROOT.glob("csrc/*.cpp")) + sorted(ROOT.glob("csrc/*.cu")) + sorted(
        ROOT.glob("csrc/kernels/*.cu"))
    if not all_sources:
        spec.skip_reason = "csrc/ has no sources yet"
        return spec

    spec.nvshmem, spec.nvshmem_note = find_nvshmem()
    for path in all_sources:
        rel = str(path.relative_to(ROOT))
        if spec.nvshmem is None and _is_nvshmem_only(path):
            spec.skipped_sources.append(rel)
        else:
            spec.sources.append(rel)
    if not spec.sources:
        spec.skip_reason = "every source in csrc/ needs NVSHMEM, which is absent"
        return spec
    if spec.nvshmem is not None and not any(_is_nvshmem_only(ROOT / rel) for rel in spec.sources):
        # Relocatable device code and the device link cost build time and change code generation; take them
        # only when a source actually uses NVSHMEM.
        spec.nvshmem_note = f"found at {spec.nvshmem.root}, but no source in csrc/ needs it yet: not linked"
        spec.nvshmem = None

    spec.arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST") or DEFAULT_ARCH_LIST
    spec.include_dirs = [str(ROOT / "csrc"), str(ROOT / "csrc" / "kernels")]
    cccl = Path(cuda_home) / "include" / "cccl"
    if cccl.is_dir():  # CUDA 13 moved libcu++ (cuda/std/...) here; NVSHMEM's headers include it.
        spec.include_dirs.append(str(cccl))

    spec.define_macros.append(("DEEP_EP_TOPK_IDX_BITS", str(envs.TOPK_IDX_BITS.get())))
    spec.cxx_flags = ["-O3", "-Wno-deprecated-declarations", "-Wno-unused-function"]
    spec.nvcc_flags = ["-O3", "-Xcompiler", "-O3", "--expt-relaxed-constexpr", "--expt-extended-lambda",
                       "-Xptxas", "-O3"]
    if envs.DEBUG_BUILD.get():
        # Source line info for profilers and compute-sanitizer; the kernels' code is the release code.
        spec.define_macros.append(("DEEP_EP_DEBUG", None))
        spec.nvcc_flags.append("-lineinfo")

    if spec.nvshmem is None:
        spec.define_macros.append(("DEEP_EP_DISABLE_NVSHMEM", None))
    else:
        lib_dir = str(spec.nvshmem.lib_dir)
        spec.include_dirs.append(str(spec.nvshmem.include_dir))
        spec.library_dirs.append(lib_dir)
        # NVSHMEM device code needs relocatable device code plus a device-link step against the static lib.
        spec.nvcc_flags.append("-rdc=true")
        # torch's extension build defines __CUDA_NO_HALF_OPERATORS__ and friends, which removes the half/bfloat16
        # operators that NVSHMEM's device headers (reductions) use: undefine them again.
        spec.nvcc_flags += ["-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                            "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__"]
        spec.nvcc_dlink_flags = ["-dlink", f"-L{lib_dir}", "-lnvshmem_device"]
        spec.link_flags = [spec.nvshmem.host_lib_flag, "-l:libnvshmem_device.a", f"-Wl,-rpath,{lib_dir}"]
    return spec


def _torch_cuda_status() -> tuple[object | None, str]:
    """Return (torch.utils.cpp_extension module, "") when a CUDA build is possible, else (None, reason)."""
    if envs.CPU_ONLY.get():
        return None, f"{envs.CPU_ONLY.name}=1"
    if importlib.util.find_spec("torch") is None:
        return None, ("torch is not importable in the build environment "
                      "(for a GPU build install torch first and use pip's --no-build-isolation)")
    import torch
    if torch.version.cuda is None:
        return None, f"torch {torch.__version__} is a CPU-only build"
    from torch.utils import cpp_extension
    if cpp_extension.CUDA_HOME is None or not Path(cpp_extension.CUDA_HOME, "bin", "nvcc").exists():
        return None, f"nvcc not found (CUDA_HOME={cpp_extension.CUDA_HOME})"
    return cpp_extension, ""


def extension_setup_kwargs() -> dict:
    """``ext_modules``/``cmdclass`` for ``setup()``, printing a build summary."""
    lines = ["", "=" * 20 + " deep_ep build summary " + "=" * 20,
             "pure-Python packages: deep_ep, reference, simulator"]
    cpp_extension, reason = _torch_cuda_status()
    kwargs: dict = {}
    if cpp_extension is not None:
        spec = cuda_extension_spec(cpp_extension.CUDA_HOME)
        reason = spec.skip_reason
    if cpp_extension is None or reason:
        lines.append(f"CUDA extension deep_ep._C: skipped ({reason})")
    else:
        os.environ["TORCH_CUDA_ARCH_LIST"] = spec.arch_list
        os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
        extension = cpp_extension.CUDAExtension(
            name="deep_ep._C",
            sources=spec.sources,
            include_dirs=spec.include_dirs,
            library_dirs=spec.library_dirs,
            define_macros=spec.define_macros,
            extra_compile_args={"cxx": spec.cxx_flags, "nvcc": spec.nvcc_flags,
                                **({"nvcc_dlink": spec.nvcc_dlink_flags} if spec.nvcc_dlink_flags else {})},
            # rpath to torch's libraries (libc10, ...): `import deep_ep._C` then works before `import torch`.
            extra_link_args=spec.link_flags + [f"-Wl,-rpath,{cpp_extension.TORCH_LIB_PATH}"],
        )
        kwargs = {"ext_modules": [extension],
                  "cmdclass": {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)}}
        defines = " ".join(f"-D{k}" + (f"={v}" if v is not None else "") for k, v in spec.define_macros)
        lines += ["CUDA extension deep_ep._C: built",
                  f"  CUDA_HOME:      {cpp_extension.CUDA_HOME}",
                  f"  arch list:      {spec.arch_list}",
                  f"  MAX_JOBS:       {os.environ['MAX_JOBS']}",
                  f"  NVSHMEM:        {spec.nvshmem_note}",
                  f"  sources:        {' '.join(spec.sources)}",
                  f"  left out:       {' '.join(spec.skipped_sources) or '-'}",
                  f"  defines:        {defines}",
                  f"  include dirs:   {' '.join(spec.include_dirs)}",
                  f"  cxx flags:      {' '.join(spec.cxx_flags)}",
                  f"  nvcc flags:     {' '.join(spec.nvcc_flags)}",
                  f"  nvcc dlink:     {' '.join(spec.nvcc_dlink_flags) or '-'}",
                  f"  link flags:     {' '.join(spec.link_flags) or '-'}"]
    lines.append("=" * 63)
    print("\n".join(lines), file=sys.stderr)
    return kwargs


if __name__ == "__main__":
    setup(**extension_setup_kwargs())
