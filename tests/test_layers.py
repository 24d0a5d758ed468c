"""The package's architecture holds: every import of ttsrl code goes to the same layer or
a lower one (module level or inside a function), and module-level imports have no cycle.
Read from the source with ``ast``, so a new upward import fails here before review."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "ttsrl"
SHARED = {"atomic", "cli", "console", "cpus", "jsonl", "knobs", "lifeline", "text", "limits", "stats", "wheel_parts"}
LAYER = {"families": 1, "model": 1, "verl_plugin": 2, "embedded": 2, "data": 2, "fetch": 3, "reward": 3, "train": 4, "eval": 5, "launch": 6}


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(mod: str) -> int:
    parts = mod.split(".")
    if len(parts) == 1:
        return 0  # the package root
    top = parts[1]
    if top in SHARED:
        return 0
    assert top in LAYER, f"{mod}: ttsrl/{top} is in no layer; add it to LAYER here and to ttsrl/__init__.py"
    return LAYER[top]


def imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, imported ttsrl module, at module level) for every import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    top_level = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ttsrl"):
            assert node.level == 0, f"{path}:{node.lineno}: relative import (write ttsrl.PKG.MODULE)"
            names = [f"{node.module}.{a.name}" for a in node.names]
            out += [(node.lineno, n if (PKG.parent / (n.replace(".", "/") + ".py")).exists()
                     or (PKG.parent / n.replace(".", "/")).is_dir() else node.module, id(node) in top_level)
                    for n in names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name, id(node) in top_level) for a in node.names if a.name.startswith("ttsrl")]
    return out


MODULES = sorted(PKG.rglob("*.py"))


def test_every_module_is_in_a_layer():
    assert len(MODULES) > 40
    for path in MODULES:
        layer_of(module_name(path))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_no_import_goes_up(path):
    me = module_name(path)
    up = [f"{path.relative_to(PKG.parent)}:{line}: {me} (layer {layer_of(me)}) imports {mod} (layer {layer_of(mod)})"
          for line, mod, _ in imports(path) if layer_of(mod) > layer_of(me)]
    assert not up, "\n".join(up)


def test_module_level_imports_have_no_cycle():
    graph = {module_name(p): {m for _, m, top in imports(p) if top} for p in MODULES}
    state: dict[str, int] = {}

    def visit(mod: str, trail: list[str]) -> None:
        state[mod] = 1
        for dep in graph.get(mod, ()):
            if state.get(dep) == 1:
                pytest.fail("import cycle: " + " -> ".join(trail[trail.index(dep):] + [dep]))
            if dep in graph and not state.get(dep):
                visit(dep, trail + [dep])
        state[mod] = 2

    for mod in graph:
        if not state.get(mod):
            visit(mod, [mod])


def test_each_package_says_what_it_owns_and_may_import():
    for init in PKG.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "import" in doc and len(doc) > 120, f"{init}: the docstring must say what the package owns and may import"
