"""The backend command-line options for every CLI that builds a pipeline
(``token2wav_asr_server.py``, ``infer_dataset.py``): one option per field of
:class:`ttsrl.reward.backends.BackendConfig`, where each is declared (with its help and
choices) once."""

from __future__ import annotations

import argparse

from ttsrl.cli import add_fields, given
from ttsrl.reward.backends import BackendConfig


def add_backend_args(p: argparse.ArgumentParser | argparse._ArgumentGroup, *, cpu_threads: bool = True) -> None:
    """Add --backend, --asr and the backends' model options. ``cpu_threads=False`` for a
    CLI that sets the thread count its own way."""
    add_fields(p, BackendConfig, skip=() if cpu_threads else ("cpu_threads",))


def backend_config(a: argparse.Namespace, *, want_score: bool = False,
                   cpu_threads: int | None = None) -> BackendConfig:
    """The :class:`BackendConfig` of parsed options (``cpu_threads`` overrides --cpu-threads)."""
    values = given(a, BackendConfig)
    if cpu_threads is not None:
        values["cpu_threads"] = cpu_threads
    return BackendConfig(want_score=want_score, **values)
