"""The quick tier stays quick: ``bash scripts/test.sh -m "not slow"`` runs no training, install or
torchrun in a subprocess.

The test sources are read (not run): a test that starts one of the ``HEAVY`` commands (in its own
body, through a helper or fixture of its module or of tests/helpers.py, or through another test
module it imports from) must be marked ``slow``, unless ``CHEAP`` lists it with the reason it
stays cheap (the command refuses at once, or is a stand-in). What the tier excludes is written in
pyproject.toml's ``slow`` marker; timing it is left to ``--durations``.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# (what is started, a pattern a string literal in test code matches when it starts it)
HEAVY = [
    ("a training CLI (train_*.py: verl/Ray GRPO, TRL DPO/KTO)", re.compile(r"(^|[/\s\"'])train_\w+\.py\b")),
    ("torchrun", re.compile(r"\btorch\.distributed\.run\b|(^|[/\s\"'])torchrun\b")),
    ("an install (scripts/install.sh)", re.compile(r"(^|[/\s\"'])install\.sh\b")),
    ("pip", re.compile(r"^pip$|\bpip install\b")),
    ("a Ray cluster", re.compile(r"\bray\.init\(|\bray start\b")),
    ("a verl training run (python -m verl.trainer.main_ppo)", re.compile(r"^verl\.trainer\.main_ppo$")),
]
INSTALL_STAGE = "run.sh's stage -2 (the install)"

# unmarked tests that name a HEAVY command but do not run it for real: test id -> why it stays cheap
CHEAP = {
    "test_run_sh.py::test_install_help_does_not_install":
        "install.sh --help and refused arguments: it exits before installing",
    "test_run_sh.py::test_install_refuses_a_python_it_cannot_serve":
        "install.sh with a wrong Python: it exits 2 before creating anything",
    "test_run_sh.py::test_install_stops_before_pip_on_a_disk_too_small":
        "install.sh on a 64 MB disk: it exits 1 before pip runs",
    "test_run_sh_settings.py::test_install_stamp_covers_the_torch_pin_and_the_installer":
        "install.sh --stamp: prints the stamp, installs nothing",
    "test_run_sh_settings.py::test_install_takes_uv_for_the_cpu_stack_and_pip_where_uv_fails":
        "install.sh with a stand-in venv python that records each pip/uv call and installs nothing",
}


@dataclass
class Module:
    name: str  # file name, e.g. test_dpo.py
    tree: ast.Module
    functions: dict[str, ast.FunctionDef] = field(default_factory=dict)
    strings: dict[str, list[str]] = field(default_factory=dict)  # module-level NAME = "..." (a script)
    imports: dict[str, tuple[str, str]] = field(default_factory=dict)  # local name -> (module file, name)
    slow_module: bool = False


def _marks(decorators: list[ast.expr]) -> set[str]:
    """Names X of ``pytest.mark.X`` in decorators or a ``pytestmark`` value."""
    out = set()
    for d in decorators:
        for node in ast.walk(d):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                    and node.value.attr == "mark"):
                out.add(node.attr)
    return out


PROSE_KEYWORDS = {"match", "reason", "msg"}  # pytest.raises(match=...), skip reasons: text, not commands
PROSE_CALLS = {"skip", "fail", "xfail", "importorskip", "print"}  # their arguments are messages


def _strings(node: ast.AST) -> list[str]:
    """The string literals in ``node`` that can be a command's words (``subprocess.run([...])``,
    ``str(ROOT / "x.py")``, ``script = f"..."``; f-strings give their literal parts). Docstrings,
    comparisons (``"x" in out``), assertions, skip/fail messages and ``match=``/``reason=`` texts are
    prose, left out."""
    if isinstance(node, ast.Constant):
        return [node.value] if isinstance(node.value, str) else []
    if isinstance(node, (ast.Compare, ast.Assert)):
        return []
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        return [w for child in [*node.decorator_list, node.args, *body] for w in _strings(child)]
    if isinstance(node, ast.Call):
        if (getattr(node.func, "attr", "") or getattr(node.func, "id", "")) in PROSE_CALLS:
            return []
        parts = [node.func, *node.args, *(k for k in node.keywords if k.arg not in PROSE_KEYWORDS)]
        return [w for child in parts for w in _strings(child)]
    return [w for child in ast.iter_child_nodes(node) for w in _strings(child)]


def _literals(node: ast.AST) -> list[str]:
    """Every string literal in a module-level value (a script run with ``python -c``, a list of paths)."""
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def load(path: Path) -> Module:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    m = Module(path.name, tree)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            m.functions[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    if target.id == "pytestmark":
                        m.slow_module = "slow" in _marks([node.value])
                    elif isinstance(node.value, (ast.Constant, ast.JoinedStr)):  # a script for python -c / bash -c
                        m.strings[target.id] = _literals(node.value)
        elif isinstance(node, ast.ImportFrom) and node.module and (TESTS / f"{node.module}.py").is_file():
            for alias in node.names:
                m.imports[alias.asname or alias.name] = (f"{node.module}.py", alias.name)
    return m


def _install_stage(fn: ast.AST) -> bool:
    """A call of run.sh (or of a ``run_sh`` helper) with stage -2 among its arguments."""
    for call in ast.walk(fn):
        if not isinstance(call, ast.Call):
            continue
        words = [s for a in call.args for s in _literals(a)]
        target = getattr(call.func, "id", "") or getattr(call.func, "attr", "")
        if "-2" in words and ("run_sh" in target or any(w.endswith("run.sh") for w in words)):
            return True
    return False


class Scan:
    """Which functions of the test sources start a HEAVY command, directly or through others."""

    def __init__(self, folder: Path = TESTS):
        paths = [p for p in sorted(folder.glob("test_*.py")) + sorted(folder.glob("gpu_stack/test_*.py"))
                 if p.name != Path(__file__).name]  # this file's literals are the patterns
        self.modules = {p.name: load(p) for p in [folder / "helpers.py", folder / "conftest.py", *paths] if p.is_file()}
        self.memo: dict[tuple[str, str], list[str]] = {}

    def _resolve(self, module: Module, name: str) -> tuple[str, str] | None:
        if name in module.functions:
            return module.name, name
        if name in module.imports:
            return module.imports[name]
        conftest = self.modules["conftest.py"]
        if name in conftest.functions:  # a conftest fixture requested by name
            return "conftest.py", name
        return None

    def _uses(self, module: Module, fn: ast.FunctionDef) -> set[str]:
        return {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)} | {a.arg for a in fn.args.args}

    def heavy(self, module_name: str, fn_name: str) -> set[str]:
        """What heavy commands FN starts, itself or through the functions it uses (empty: none)."""
        key = (module_name, fn_name)
        if key in self.memo:
            return self.memo[key]
        self.memo[key] = set()  # recursion guard
        module = self.modules.get(module_name)
        fn = module.functions.get(fn_name) if module else None
        if fn is None:
            return set()
        uses = self._uses(module, fn)
        words = _strings(fn) + [w for name in uses for w in module.strings.get(name, [])]  # e.g. a python -c script
        why = {what for what, pattern in HEAVY if any(pattern.search(w) for w in words)}
        if _install_stage(fn):
            why.add(INSTALL_STAGE)
        for name in uses - {fn_name}:
            target = self._resolve(module, name)
            if target:
                why |= self.heavy(*target)
        self.memo[key] = why
        return why

    def unmarked_heavy(self) -> dict[str, str]:
        """test id (file::name) -> what it starts, for tests not marked slow that start a heavy command."""
        out = {}
        for m in self.modules.values():
            if not m.name.startswith("test_") or m.slow_module:
                continue
            for name, fn in m.functions.items():
                if name.startswith("test_") and "slow" not in _marks(fn.decorator_list):
                    why = self.heavy(m.name, name)
                    if why:
                        via = sorted(u for u in self._uses(m, fn) - {name} if (t := self._resolve(m, u)) and self.heavy(*t))
                        out[f"{m.name}::{name}"] = "; ".join(sorted(why)) + (f" (via {', '.join(via)})" if via else "")
        return out


def test_no_unmarked_test_starts_training_install_or_torchrun():
    flagged = Scan().unmarked_heavy()
    leaks = {k: v for k, v in flagged.items() if k not in CHEAP}
    assert not leaks, ("tests that start these but are not marked @pytest.mark.slow (mark them, or list them in "
                       "CHEAP with why they stay cheap):\n" + "\n".join(f"  {k}: {v}" for k, v in leaks.items()))
    stale = sorted(set(CHEAP) - set(flagged))
    assert not stale, f"CHEAP lists tests that no longer start a heavy command (or are marked slow now): {stale}"


def test_every_extended_test_is_also_slow():
    """``-m "not slow"`` replaces the addopts' ``-m 'not extended'``: an extended test without
    ``slow`` would run in the quick tier."""
    bad = []
    for m in Scan().modules.values():
        module_marks = set()
        for node in m.tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
                module_marks = _marks([node.value])
        for name, fn in m.functions.items():
            marks = module_marks | _marks(fn.decorator_list)
            if name.startswith("test_") and "extended" in marks and "slow" not in marks:
                bad.append(f"{m.name}::{name}")
    assert not bad


def test_the_scan_sees_a_training_run_through_a_helper_and_a_fixture(tmp_path):
    """The scan itself: heavy through a module helper, a fixture and helpers.py; marks honoured."""
    (tmp_path / "helpers.py").write_text("def grpo_command(ws):\n    return ['python', 'train_grpo.py', ws]\n")
    (tmp_path / "conftest.py").write_text("")
    (tmp_path / "test_x.py").write_text('''
import subprocess
import pytest
from helpers import grpo_command
SCRIPT = "import ray; ray.init(address='auto')"

def train(out):
    """Runs train_dpo.py (a docstring does not count)."""
    return subprocess.run(["python", "/repo/train_dpo.py", "--out", out])

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return train(tmp_path_factory.mktemp("x"))

def test_helper(tmp_path):
    train(tmp_path)

def test_fixture(trained):
    pass

def test_shared_helper(tmp_path):
    subprocess.run(grpo_command(tmp_path))

def test_script():
    subprocess.run(["python", "-c", SCRIPT])

def test_torchrun(tmp_path):
    subprocess.run(f"{tmp_path}/py -m torch.distributed.run --nproc_per_node 2 x.py", shell=True)

def test_install():
    run_sh("-2", "-2")

def test_verl():
    subprocess.run(["python", "-m", "verl.trainer.main_ppo", "trainer.total_training_steps=2"])

def test_docstring_only():
    """train_dpo.py and install.sh named in prose."""
    log = ["[train_grpo] python -m verl.trainer.main_ppo x=1"]  # a log line read back, not run
    assert "train_dpo.py" not in log, "train_grpo.py in a message"

@pytest.mark.slow
def test_marked(tmp_path):
    train(tmp_path)
''')
    found = Scan(tmp_path).unmarked_heavy()
    assert sorted(found) == [f"test_x.py::test_{n}" for n in ("fixture", "helper", "install", "script", "shared_helper",
                                                              "torchrun", "verl")]
    assert found["test_x.py::test_fixture"] == "a training CLI (train_*.py: verl/Ray GRPO, TRL DPO/KTO) (via trained)"
    assert found["test_x.py::test_shared_helper"].endswith("(via grpo_command)")
    assert found["test_x.py::test_install"] == INSTALL_STAGE
