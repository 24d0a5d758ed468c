"""The vLLM kernel check (ttsrl/model/vllm_kernels.py) on any machine, without vLLM: reading CPU
flags and mapped libraries from files of the real formats, and surviving a child process
that dies of SIGILL the way vLLM's AVX-512 library dies on an AVX2-only CPU (a real
signal, raised by the child itself). tests/gpu_stack/test_vllm_kernels.py runs vLLM's own
selection with the CPU's answers faked."""

import signal
import sys

from ttsrl.model import vllm_kernels as vk

# /proc/cpuinfo of an AVX2-only AMD EPYC (abridged: the flags line is what is read)
CPUINFO_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu vme sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2 sha_ni vaes
bugs\t\t: sysret_ss_attrs
"""
CPUINFO_SPR = CPUINFO_AVX2.replace("avx2 bmi2", "avx2 bmi2 avx512f avx512bw avx512_bf16 amx_tile amx_bf16")


def test_cpu_flags_read_from_cpuinfo(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text(CPUINFO_AVX2)
    assert vk.cpu_flags(str(f)) == {"avx2": True, "avx512f": False, "avx512_bf16": False, "amx_tile": False}
    f.write_text(CPUINFO_SPR)
    assert vk.cpu_flags(str(f)) == {"avx2": True, "avx512f": True, "avx512_bf16": True, "amx_tile": True}
    assert vk.describe_flags(vk.cpu_flags(str(f))) == "avx2, avx512f, avx512_bf16, amx_tile"
    assert vk.cpu_flags(str(tmp_path / "missing")) == dict.fromkeys(vk.CPU_FLAGS, False)


def test_mapped_kernel_libraries_from_proc_maps(tmp_path):
    site = "/venv/lib/python3.11/site-packages"
    maps = tmp_path / "maps"
    maps.write_text(
        f"7f00-7f10 r--p 00000000 fd:01 11 {site}/vllm/_C_AVX2.abi3.so\n"
        f"7f10-7f20 r-xp 00010000 fd:01 11 {site}/vllm/_C_AVX2.abi3.so\n"
        f"7f20-7f30 r--p 00000000 fd:01 12 {site}/torch/lib/libtorch_cpu.so\n"
        f"7f30-7f40 r--p 00000000 fd:01 13 {site}/other/_C.so\n"
        "7f40-7f50 rw-p 00000000 00:00 0 \n")
    assert vk.mapped_kernel_libraries(str(maps)) == ["_C_AVX2"]
    assert vk.mapped_kernel_libraries(str(tmp_path / "none")) == []


def test_probe_survives_sigill_and_says_why_in_one_line(tmp_path):
    child = tmp_path / "dies.py"
    child.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGILL)\n")
    result = vk.probe([sys.executable, str(child)], timeout=60)
    assert not result.ok and result.unsupported
    assert "\n" not in result.line and "SIGILL" in result.line and "CPU" in result.line
    # a child killed by SIGILL under a shell reports 128 + 4: read the same way
    assert "SIGILL" in vk.failure_line(128 + signal.SIGILL, {"avx2": False}, "")
    assert "at least AVX2" in vk.failure_line(-signal.SIGILL, {"avx2": False}, "")


def test_probe_tells_a_broken_install_from_an_unsupported_cpu(tmp_path):
    child = tmp_path / "broken.py"
    child.write_text("raise ImportError('libgomp.so.1: cannot open shared object file')\n")
    result = vk.probe([sys.executable, str(child)], timeout=60)
    assert not result.ok and not result.unsupported
    assert "libgomp.so.1" in result.line


def test_probe_reads_the_loaded_libraries_from_the_childs_line(tmp_path):
    child = tmp_path / "ok.py"
    child.write_text("print('[vllm-kernels] vllm 0.24.0+cpu: loaded _C_AVX512 (AVX-512 build), 39 ops "
                     "registered; CPU: avx2, avx512f')\n")
    result = vk.probe([sys.executable, str(child)], timeout=60)
    assert result.ok and result.kernels == ["_C_AVX512"]


def test_cli_without_vllm_is_a_clear_failure_not_unsupported():
    # the main venv has no vLLM: --probe must exit 1 (broken install), never 4 (unsupported CPU)
    import subprocess

    res = subprocess.run([sys.executable, "-m", "ttsrl.model.vllm_kernels", "--probe"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "vllm" in res.stdout.lower()
