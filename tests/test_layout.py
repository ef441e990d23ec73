"""The project's shape: import names under `skillswarm.`, one-way imports between the parts, no
import cycles, modules of readable size, and libp2p reached through its public modules."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PARTS = {
    "agent": "agent",
    "coordinator": "coordinator",
    "merge": "merge",
    "node": "node",
    "protocol": "protocol",
    "cli": "skillswarm",
    "tracking": "skillswarm",  # skillswarm.tracking: experiment tracking for both daemons
}
# Which parts each part may import (besides itself); the command line may import every part.
ALLOWED = {
    "protocol": set(),
    "merge": {"protocol"},
    "agent": {"protocol"},
    "tracking": set(),
    "node": {"agent", "merge", "protocol", "tracking"},
    "coordinator": {"agent", "merge", "protocol", "tracking"},
    "cli": {"agent", "coordinator", "merge", "node", "protocol", "tracking"},
}
MAX_MODULE_LINES = 800
# The libp2p host (gossip, the blob protocol, redial) is the one module allowed more: under 1,000.
LONGER_MODULES = {"skillswarm.protocol.host": 999}
PATCHES_MODULE = "skillswarm.protocol.patches"


def _module_name(path: Path) -> str:
    folder = path.relative_to(ROOT).parts[0]
    rest = path.relative_to(ROOT / folder).with_suffix("").parts
    prefix = ["skillswarm"] if folder == "skillswarm" else ["skillswarm", folder]
    parts = [*prefix, *rest]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    found = {}
    for folder in PARTS.values():
        for path in sorted((ROOT / folder).rglob("*.py")):
            found[_module_name(path)] = path
    return found


SOURCES = _sources()


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in PARTS and parts[1] != "cli" else "cli"


def _imports(path: Path) -> list[str]:
    """Every module `path` imports, at any depth (lazy imports inside functions count)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
            # `from skillswarm.agent import pyast` imports the module skillswarm.agent.pyast
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def _our_imports(module: str) -> set[str]:
    """The project's modules that `module` imports (names that are not modules are dropped)."""
    return {name for name in _imports(SOURCES[module]) if name in SOURCES and name != module}


def test_every_part_is_found() -> None:
    assert {_part(module) for module in SOURCES} == set(PARTS)
    assert "skillswarm.agent.envs.code" in SOURCES
    assert "skillswarm.node.bootstrap" in SOURCES


@pytest.mark.parametrize("module", sorted(SOURCES))
def test_imports_point_one_way(module: str) -> None:
    part = _part(module)
    wrong = sorted(
        imported
        for imported in _our_imports(module)
        if _part(imported) != part and _part(imported) not in ALLOWED[part]
    )
    assert not wrong, f"{module} ({part}) may import only {sorted(ALLOWED[part])}: {wrong}"


def test_no_old_top_level_import_names() -> None:
    old = {"node", "coordinator", "merge", "protocol", "agent"}
    offenders = []
    for folder in [*PARTS.values(), "tests", "bench"]:
        for path in (ROOT / folder).rglob("*.py"):
            offenders += [
                f"{path.relative_to(ROOT)}: {name}"
                for name in _imports(path)
                if name.split(".")[0] in old
            ]
    assert not offenders


def test_no_import_cycles_between_modules() -> None:
    graph = {module: _our_imports(module) for module in SOURCES}
    # a package's __init__ importing its own submodule is how registries load; not a cycle
    for module, imported in graph.items():
        graph[module] = {name for name in imported if not name.startswith(module + ".")}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for nxt in sorted(graph[module]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_modules_stay_readable_in_size() -> None:
    too_long = {
        module: lines
        for module, path in SOURCES.items()
        if (lines := len(path.read_text().splitlines()))
        > LONGER_MODULES.get(module, MAX_MODULE_LINES)
    }
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines: {too_long}"


def test_libp2p_is_imported_through_its_public_modules_only() -> None:
    private = []
    for module, path in SOURCES.items():
        if module == PATCHES_MODULE:
            continue
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "libp2p" and any(part.startswith("_") for part in parts):
                private.append(f"{module}: {name}")
    assert not private


def test_the_wheel_installs_only_skillswarm(tmp_path: Path) -> None:
    """`pip install .` puts `skillswarm` and its dist-info into site-packages and nothing else."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("skillswarm-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    top = {name.split("/")[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"skillswarm"}
    for module in SOURCES:
        relative = module.replace(".", "/")
        assert f"{relative}.py" in names or f"{relative}/__init__.py" in names, module
    assert "skillswarm/agent/sandbox_child.py" in names
