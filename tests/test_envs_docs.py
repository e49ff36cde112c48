"""Docs stay true: docs/build.md documents exactly the knobs declared in deep_ep.envs.ALL, the top-level docs
(README.md, docs/index.md, docs/build.md) name no undeclared DEEP_EP_* variable, and the README example runs."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from deep_ep import envs

REPO_ROOT = Path(__file__).resolve().parent.parent
BUILD_MD = REPO_ROOT / "docs" / "build.md"
TABLE_HEADING = "## Environment variables"
ROW = re.compile(r"^\|\s*`([A-Z][A-Z0-9_]*)`\s*\|(.*)\|\s*$")


def documented_rows() -> dict[str, str]:
    """Rows of the table under TABLE_HEADING in docs/build.md: variable name -> rest of the row."""
    text = BUILD_MD.read_text()
    assert TABLE_HEADING in text, f"{BUILD_MD} needs a '{TABLE_HEADING}' section"
    section = text.split(TABLE_HEADING, 1)[1]
    section = re.split(r"^## ", section, maxsplit=1, flags=re.MULTILINE)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        match = ROW.match(line.strip())
        if match:
            assert match.group(1) not in rows, f"{match.group(1)} is listed twice"
            rows[match.group(1)] = match.group(2)
    return rows


def test_build_md_lists_exactly_the_declared_variables():
    documented = set(documented_rows())
    declared = {var.name for var in envs.ALL}
    assert documented == declared, (f"missing from docs/build.md: {sorted(declared - documented)}; "
                                    f"documented but not in deep_ep.envs.ALL: {sorted(documented - declared)}")


@pytest.mark.parametrize("var", envs.ALL, ids=lambda v: v.name)
def test_build_md_states_each_default(var):
    row = documented_rows()[var.name]
    default = var.default if not isinstance(var.default, bool) else int(var.default)
    shown = "(unset)" if default == "" else str(default)
    assert f"`{shown}`" in row, f"docs/build.md row of {var.name} should show its default `{shown}`: {row}"


def test_envs_all_has_unique_names_and_docs():
    names = [var.name for var in envs.ALL]
    assert len(names) == len(set(names))
    assert all(var.doc.strip() for var in envs.ALL)
    # Every EnvVar defined in the module is registered in ALL.
    defined = {value.name for value in vars(envs).values() if isinstance(value, envs.EnvVar)}
    assert defined == set(names)


# Compiler macros (not environment variables) that the build docs name.
COMPILE_MACROS = {"DEEP_EP_DEBUG"}


def test_docs_mention_no_undeclared_deep_ep_variable():
    declared = {var.name for var in envs.ALL} | COMPILE_MACROS
    unknown = {}
    for path in (REPO_ROOT / "README.md", REPO_ROOT / "docs" / "build.md", REPO_ROOT / "docs" / "index.md"):
        if not path.exists():
            continue
        names = set(re.findall(r"\bDEEP_EP_[A-Z0-9_]*[A-Z0-9]\b", path.read_text())) - declared
        if names:
            unknown[path.name] = sorted(names)
    assert not unknown, f"docs name DEEP_EP_* variables that deep_ep.envs does not declare: {unknown}"


def test_readme_example_runs(tmp_path):
    """The README's Python example runs as written (2 gloo processes), on a free port."""
    text = (REPO_ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    assert blocks, "README.md has no python example"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = blocks[0].replace("127.0.0.1:29511", f"127.0.0.1:{port}")
    script = tmp_path / "readme_example.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEP_EP_")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, f"README example failed:\n{proc.stdout}\n{proc.stderr}"


@pytest.mark.parametrize("doc", ["README.md", "docs/index.md", "docs/build.md", "examples/README.md"])
def test_relative_links_resolve(doc):
    path = REPO_ROOT / doc
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text())
    missing = [t for t in targets if "://" not in t and not (path.parent / t).exists()]
    assert not missing, f"{doc} links to files that do not exist: {missing}"
