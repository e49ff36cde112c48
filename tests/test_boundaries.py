"""Import boundaries, checked in fresh interpreters (one subprocess per check) and on the source tree.

* ``deep_ep.config`` / ``deep_ep.layout`` / ``deep_ep.envs`` / ``deep_ep.testing`` /
  ``deep_ep.backends.cuda_tuning`` load nothing outside the standard library;
* no import circle among the modules of ``deep_ep``, ``reference`` and ``simulator`` (imports inside functions
  count);
* ``import simulator`` loads no torch, no ``reference`` and no ``deep_ep.buffer`` / ``deep_ep._C``;
* ``import deep_ep`` works without CUDA and without the compiled extension;
* ``import reference`` loads neither ``deep_ep.buffer`` nor ``deep_ep._C``;
* inside ``deep_ep`` only ``envs.py`` reads ``os.environ``; CUDA kernels include no torch, host files launch no
  kernels of their own;
* ``setup.py`` reads its knobs through ``deep_ep/envs.py`` without importing torch or the package, and picks
  sources and NVSHMEM flags as docs/build.md says.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def run_python(code: str) -> dict:
    """Run ``code`` in a fresh interpreter with no visible GPU; it must print one JSON object last."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def loaded_after(statement: str) -> set[str]:
    """Top-level and deep_ep/reference/simulator modules newly present in sys.modules after ``statement``."""
    result = run_python(f"""
        import json, sys
        before = set(sys.modules)
        {statement}
        print(json.dumps(sorted(set(sys.modules) - before)))
    """)
    return set(result)


def require_package(name: str) -> None:
    if not (REPO_ROOT / name / "__init__.py").exists():
        pytest.skip(f"package {name}/ has not been written yet")


THIRD_PARTY_HEAVY = {"torch", "numpy", "simpy", "matplotlib", "transformers"}


@pytest.mark.parametrize("module", ["deep_ep.config", "deep_ep.layout", "deep_ep.envs", "deep_ep.testing",
                                    "deep_ep.backends.cuda_tuning"])
def test_core_modules_are_stdlib_only(module):
    new = loaded_after(f"import {module}")
    tops = {name.split(".")[0] for name in new}
    assert not tops & THIRD_PARTY_HEAVY, f"import {module} loaded {sorted(tops & THIRD_PARTY_HEAVY)}"
    assert "deep_ep._C" not in new and "deep_ep.buffer" not in new
    assert not {"reference", "simulator"} & tops


def test_simulator_loads_no_torch():
    require_package("simulator")
    new = loaded_after("import simulator, simulator.__main__")  # the package and its command line
    tops = {name.split(".")[0] for name in new}
    assert "torch" not in tops, "import simulator loaded torch"
    assert "reference" not in tops
    assert not {"deep_ep.buffer", "deep_ep._C"} & new


def test_import_deep_ep_needs_no_cuda_or_extension():
    result = run_python("""
        import json, sys
        import deep_ep
        import torch
        names = {}
        for attr in ("Buffer", "EventOverlap", "Config", "topk_idx_t"):
            names[attr] = hasattr(deep_ep, attr)
        print(json.dumps({
            "names": names,
            "config_is_core": getattr(deep_ep, "Config", None) is __import__("deep_ep.config").config.Config,
            "topk_idx_t": str(getattr(deep_ep, "topk_idx_t", None)),
            "ext_loaded": "deep_ep._C" in sys.modules,
            "cuda_initialized": torch.cuda.is_initialized(),
        }))
    """)
    assert result["names"] == {"Buffer": True, "EventOverlap": True, "Config": True, "topk_idx_t": True}, result
    assert result["config_is_core"], "deep_ep.Config must be deep_ep.config.Config"
    assert result["topk_idx_t"] in ("torch.int64", "torch.int32")
    assert not result["ext_loaded"], "import deep_ep must not load deep_ep._C"
    assert not result["cuda_initialized"], "import deep_ep must not initialise CUDA"


def test_import_deep_ep_config_does_not_load_torch_through_package_init():
    # deep_ep/__init__.py runs first; it must resolve torch-dependent names lazily.
    new = loaded_after("import deep_ep.config")
    assert "torch" not in {name.split(".")[0] for name in new}


def test_reference_does_not_load_buffer_or_extension():
    require_package("reference")
    new = loaded_after("import reference")
    assert not {"deep_ep.buffer", "deep_ep._C"} & new, sorted(new & {"deep_ep.buffer", "deep_ep._C"})
    assert "simulator" not in {name.split(".")[0] for name in new}


# ---------------------------------------------------------------------------------------------------------------
# Static checks over the source tree
# ---------------------------------------------------------------------------------------------------------------

PACKAGES = ("deep_ep", "reference", "simulator")


def _modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``packages`` under ``root`` (a package is its __init__)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_names(tree: ast.AST, package: str) -> list[str]:
    """Dotted names every import statement of ``tree`` loads (at module level or inside functions; not the
    ``if TYPE_CHECKING:`` blocks, which never run): ``a.b`` for ``import a.b``, ``a.b.c`` for ``from a.b import c``
    (a submodule or a name of ``a.b``), relative imports resolved against ``package``."""
    names: list[str] = []

    def visit(node: ast.AST) -> None:
        if _is_type_checking(node):
            return
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(parent + ([node.module] if node.module else []))
            names.extend(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


def import_graph(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports: the longest module prefix of every imported name (a package
    imported for a name of its ``__init__`` is that package). Loading a submodule also runs its parents'
    ``__init__``; that implicit step is no edge (a package may import its own submodules)."""
    modules = _modules(root, packages)
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for imported in _imported_names(ast.parse(path.read_text(), filename=str(path)), package):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                edges.add(imported)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of ``graph`` as ``[a, b, ..., a]``, or ``[]``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return []


def test_no_import_circle():
    graph = import_graph(REPO_ROOT)
    assert {"deep_ep.buffer", "deep_ep.backends.base", "reference.normal"} <= set(graph)
    assert "deep_ep.layout" in graph["deep_ep.config"] or "deep_ep.config" in graph["deep_ep.layout"]
    cycle = find_cycle(graph)
    assert not cycle, f"import circle: {' -> '.join(cycle)}"


def test_import_graph_sees_every_kind_of_import(tmp_path):
    """Module-level, function-level, relative and ``from package import submodule`` imports are edges; a circle
    through a function-level import is found; ``if TYPE_CHECKING:`` imports are not edges."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    files = {
        "pkg/__init__.py": "from pkg import a\n",
        "pkg/a.py": "import pkg.b\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\n",
        "pkg/b.py": "def f():\n    from .sub import d\n",
        "pkg/c.py": "from pkg.a import thing\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/d.py": "from .. import b\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).write_text(text)
    graph = import_graph(tmp_path, ("pkg",))
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.sub.d"}, "pkg.c": {"pkg.a"},
                     "pkg.sub": set(), "pkg.sub.d": {"pkg.b"}}
    assert find_cycle(graph) == ["pkg.b", "pkg.sub.d", "pkg.b"]
    assert find_cycle({"x": {"y"}, "y": set()}) == []

def _environ_reads(tree: ast.AST) -> list[int]:
    """Line numbers of ``os.getenv(...)``, ``os.environ.get(...)``, ``os.environ[...]`` (read) and
    ``... in os.environ``."""

    def is_environ(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
            isinstance(node, ast.Name) and node.id == "environ")

    lines = []
    for node in ast.walk(tree):
        is_call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        getenv = is_call and node.func.attr in ("getenv", "getenvb")
        environ_method = is_call and node.func.attr in ("get", "copy", "items", "keys", "values") and is_environ(
            node.func.value)
        subscript = isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and is_environ(node.value)
        membership = isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators)
        if getenv or environ_method or subscript or membership:
            lines.append(node.lineno)
    return lines


def test_only_envs_reads_the_environment_inside_deep_ep():
    offenders = {}
    for path in sorted((REPO_ROOT / "deep_ep").rglob("*.py")):
        if path.name == "envs.py" and path.parent.name == "deep_ep":
            continue
        lines = _environ_reads(ast.parse(path.read_text(), filename=str(path)))
        if lines:
            offenders[str(path.relative_to(REPO_ROOT))] = lines
    assert not offenders, f"read os.environ through deep_ep/envs.py instead: {offenders}"


def test_environ_detector_finds_reads():
    tree = ast.parse("import os\na = os.environ.get('X')\nb = os.getenv('Y')\nc = os.environ['Z']\n"
                     "d = 'W' in os.environ\nos.environ['V'] = '1'\n")
    assert _environ_reads(tree) == [2, 3, 4, 5]


def test_cuda_kernels_are_torch_free():
    offenders = []
    for path in sorted((REPO_ROOT / "csrc" / "kernels").glob("*")):
        if path.suffix not in (".cu", ".cuh", ".h", ".hpp"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            stripped = line.strip()
            if stripped.startswith("#include") and any(word in stripped for word in ("torch", "ATen", "pybind11")):
                offenders.append(f"{path.relative_to(REPO_ROOT)}:{number}: {stripped}")
    assert not offenders, "csrc/kernels must not include torch/pybind:\n" + "\n".join(offenders)


def test_host_files_define_no_kernels():
    offenders = [str(p.relative_to(REPO_ROOT)) for p in sorted((REPO_ROOT / "csrc").glob("*.cpp"))
                 if "__global__" in p.read_text()]
    assert not offenders, f"host files must not define __global__ kernels: {offenders}"


# ---------------------------------------------------------------------------------------------------------------
# setup.py: reads its knobs through deep_ep/envs.py without importing the package or torch
# ---------------------------------------------------------------------------------------------------------------

def load_setup_module():
    """Import setup.py as a module (``setup()`` only runs under ``__main__``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("deep_ep_setup_under_test", REPO_ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_setup_py_loads_without_torch_or_package_init():
    result = run_python("""
        import importlib.util, json, sys
        spec = importlib.util.spec_from_file_location("setup_probe", "setup.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        print(json.dumps({"torch": "torch" in sys.modules, "deep_ep": "deep_ep" in sys.modules,
                          "has_spec": callable(module.cuda_extension_spec)}))
    """)
    assert result == {"torch": False, "deep_ep": False, "has_spec": True}


def test_setup_cpu_only_skips_extension(monkeypatch, capsys):
    monkeypatch.setenv("DEEP_EP_CPU_ONLY", "1")
    module = load_setup_module()
    assert module.extension_setup_kwargs() == {}
    assert "skipped (DEEP_EP_CPU_ONLY=1)" in capsys.readouterr().err


@pytest.fixture
def fake_tree(tmp_path, monkeypatch):
    """A source tree with host, intranode and NVSHMEM-only files, and a fake nvidia-nvshmem wheel on sys.path."""
    for rel in ("csrc/buffer.cpp", "csrc/kernels/intranode.cu", "csrc/kernels/internode.cu",
                "csrc/kernels/internode_ll.cu", "csrc/kernels/barrier_nvshmem.cu"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("// test\n")
    wheel = tmp_path / "site" / "nvidia" / "nvshmem"
    (wheel / "include").mkdir(parents=True)
    (wheel / "lib").mkdir()
    for rel in ("include/nvshmem.h", "lib/libnvshmem_host.so.3", "lib/libnvshmem_device.a"):
        (wheel / rel).write_text("")
    for name in ("DEEP_EP_CPU_ONLY", "DEEP_EP_DISABLE_NVSHMEM", "DEEP_EP_DEBUG_BUILD", "NVSHMEM_DIR",
                 "TORCH_CUDA_ARCH_LIST", "DEEP_EP_TOPK_IDX_BITS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    module = load_setup_module()
    monkeypatch.setattr(module, "ROOT", tmp_path)
    return module, tmp_path


def test_setup_finds_nvshmem_wheel(fake_tree):
    module, root = fake_tree
    spec = module.cuda_extension_spec(str(root / "cuda"))
    assert spec.skip_reason == ""
    assert spec.sources == ["csrc/buffer.cpp", "csrc/kernels/barrier_nvshmem.cu", "csrc/kernels/internode.cu",
                            "csrc/kernels/internode_ll.cu", "csrc/kernels/intranode.cu"]
    lib = str((root / "site" / "nvidia" / "nvshmem" / "lib").resolve())
    assert spec.link_flags == ["-l:libnvshmem_host.so.3", "-l:libnvshmem_device.a", f"-Wl,-rpath,{lib}"]
    assert "-rdc=true" in spec.nvcc_flags and spec.nvcc_dlink_flags[0] == "-dlink"
    assert ("DEEP_EP_DISABLE_NVSHMEM", None) not in spec.define_macros
    assert spec.arch_list == "9.0a"


def test_setup_does_not_link_nvshmem_without_nvshmem_sources(fake_tree):
    module, root = fake_tree
    for rel in ("csrc/kernels/internode.cu", "csrc/kernels/internode_ll.cu", "csrc/kernels/barrier_nvshmem.cu"):
        (root / rel).unlink()
    spec = module.cuda_extension_spec(str(root / "cuda"))
    assert spec.sources == ["csrc/buffer.cpp", "csrc/kernels/intranode.cu"]
    assert spec.nvshmem is None and "not linked" in spec.nvshmem_note
    assert ("DEEP_EP_DISABLE_NVSHMEM", None) in spec.define_macros
    assert spec.link_flags == [] and "-rdc=true" not in spec.nvcc_flags


def test_setup_without_nvshmem_builds_intranode_only(fake_tree, monkeypatch):
    module, root = fake_tree
    monkeypatch.setenv("DEEP_EP_DISABLE_NVSHMEM", "1")
    monkeypatch.setenv("DEEP_EP_DEBUG_BUILD", "1")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a;10.0a")
    spec = module.cuda_extension_spec(str(root / "cuda"))
    assert spec.sources == ["csrc/buffer.cpp", "csrc/kernels/intranode.cu"]
    assert spec.skipped_sources == ["csrc/kernels/barrier_nvshmem.cu", "csrc/kernels/internode.cu",
                                    "csrc/kernels/internode_ll.cu"]
    assert ("DEEP_EP_DISABLE_NVSHMEM", None) in spec.define_macros
    assert ("DEEP_EP_DEBUG", None) in spec.define_macros and "-lineinfo" in spec.nvcc_flags
    assert spec.link_flags == [] and "-rdc=true" not in spec.nvcc_flags
    assert spec.arch_list == "9.0a;10.0a"


def test_setup_nvshmem_dir_overrides_and_is_checked(fake_tree, monkeypatch, tmp_path):
    module, root = fake_tree
    custom = tmp_path / "nvshmem_src_install"
    (custom / "include").mkdir(parents=True)
    (custom / "lib").mkdir()
    (custom / "include" / "nvshmem.h").write_text("")
    (custom / "lib" / "libnvshmem_host.so").write_text("")
    monkeypatch.setenv("NVSHMEM_DIR", str(custom))
    spec = module.cuda_extension_spec(str(root / "cuda"))
    assert spec.nvshmem.root == custom.resolve() and spec.link_flags[0] == "-lnvshmem_host"
    monkeypatch.setenv("NVSHMEM_DIR", str(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match="NVSHMEM_DIR=.*is not an NVSHMEM install"):
        module.cuda_extension_spec(str(root / "cuda"))


def test_setup_skips_without_sources(fake_tree, tmp_path, monkeypatch):
    module, _ = fake_tree
    empty = tmp_path / "empty_repo"
    empty.mkdir()
    monkeypatch.setattr(module, "ROOT", empty)
    assert module.cuda_extension_spec("/nonexistent").skip_reason == "csrc/ has no sources yet"


def test_one_exception_hierarchy_for_every_backend():
    """``except deep_ep.CommTimeoutError`` catches a timeout of any backend: the backends raise deep_ep.errors'
    classes, importable without torch."""
    code = ("import sys, deep_ep; assert 'torch' not in sys.modules; "
            "from deep_ep import CommError, CommTimeoutError, PeerAbortedError, RoutingError; "
            "assert issubclass(CommTimeoutError, (CommError, TimeoutError)) and issubclass(RoutingError, ValueError); "
            "assert issubclass(PeerAbortedError, CommError) and issubclass(CommError, RuntimeError)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT,
                   env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    pytest.importorskip("torch")
    import deep_ep
    from deep_ep.backends import torch_dist
    assert torch_dist.CommTimeoutError is deep_ep.CommTimeoutError
    assert torch_dist.CommError is deep_ep.CommError
