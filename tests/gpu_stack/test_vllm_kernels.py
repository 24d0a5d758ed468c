"""vLLM's own kernel selection (CpuPlatform.import_kernels) run for real with the CPU's
answers faked, so each branch runs on any x86 machine: the AVX2 library loads for real
everywhere (every AVX-512 CPU also has AVX2); asked for an AVX-512 library, a CPU without
AVX-512 dies of SIGILL in vLLM's import and the probe says so in one line, while an
AVX-512 CPU loads it. Each case runs in its own child process (a loaded library cannot be
unloaded, and a SIGILL must not take pytest with it)."""

import platform
import sys

import pytest

from ttsrl import vllm_kernels as vk

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                                reason="vLLM's three CPU kernel builds are x86 only")

CHILD = """import sys, torch
torch.cpu._is_avx512_supported = lambda: {avx512}
torch.cpu._is_avx512_bf16_supported = lambda: {bf16}
from ttsrl.vllm_kernels import main
sys.exit(main([]))
"""


def _probe_with(tmp_path, avx512: bool, bf16: bool) -> vk.Probe:
    child = tmp_path / "fake_cpu.py"
    child.write_text(CHILD.format(avx512=avx512, bf16=bf16))
    return vk.probe([sys.executable, str(child)], timeout=300)


def test_avx2_branch_loads_the_avx2_library_for_real(tmp_path):
    result = _probe_with(tmp_path, avx512=False, bf16=False)
    assert result.ok, result.line
    assert result.kernels == ["_C_AVX2"], result.line
    assert "AVX2 build" in result.line and "ops registered" in result.line


@pytest.mark.parametrize("bf16,library,flag", [(False, "_C_AVX512", "avx512f"), (True, "_C", "avx512_bf16")])
def test_avx512_branches_load_or_fail_in_one_line(tmp_path, bf16, library, flag):
    result = _probe_with(tmp_path, avx512=True, bf16=bf16)
    if vk.cpu_flags()[flag] and (flag == "avx512f" or vk.cpu_flags()["avx512f"]):
        assert result.ok and result.kernels == [library], result.line
    else:
        # this CPU lacks the instructions: vLLM's import dies, the probe survives and says why
        assert not result.ok and result.unsupported, result.line
        assert "SIGILL" in result.line and "\n" not in result.line


def test_the_real_choice_matches_this_cpu():
    result = vk.probe(timeout=300)
    assert result.ok, result.line
    flags = vk.cpu_flags()
    expected = "_C" if flags["avx512_bf16"] else "_C_AVX512" if flags["avx512f"] else "_C_AVX2"
    assert result.kernels == [expected], result.line
