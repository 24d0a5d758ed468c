"""The reward's terms as training metrics, one value each per step.

verl 0.9.1 logs what the reward function returns beside ``score`` (its "reward extra info")
only for validation (``val-aux/<data_source>/<key>/mean@N``, ``trainer/ppo/ray_trainer.py:721``)
and, with ``--algorithm gdpo``, the estimator's components (``gdpo/<key>/mean``,
``ray_trainer.py:1774-1782``). A training step's metrics (``_compute_metrics`` of the v1
trainer, ``trainer/ppo/v1/trainer_base.py:1868``; ``compute_data_metrics`` of the legacy one,
``ray_trainer.py:1772``) hold ``critic/score/mean`` but none of the terms: in the v1 trainer
they stay in the TransferQueue's ``extra_fields`` (``trainer/ppo/v1/agent_loop_tq.py:175``).

This module adds, for every key of ``LOGGED_KEYS`` that the step's rollouts carry,
``reward/<key>/mean`` (the mean over the step's rollouts, padding excluded) to the step's
metrics, so they reach every logger verl drives (console line, TensorBoard, wandb):
``reward/cer/mean``, ``reward/sim/mean``, ``reward/length/mean``, ``reward/unfinished/mean`` (the
share of rollouts that hit the response limit), ``reward/sim_measured/mean`` and
``reward/reward_failed/mean``. The patches are applied when verl's trainer modules are
imported (an import hook: importing them here would cost every verl process seconds).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import math
import sys
from typing import Callable, Iterable, Mapping

log = logging.getLogger("ttsrl.verl_plugin")

#: the reward function's numeric keys logged per step (ttsrl.reward.client's compute_score)
LOGGED_KEYS = ("cer", "sim", "length", "unfinished", "sim_measured", "reward_failed")
METRIC = "reward/{key}/mean"
_MARK = "_ttsrl_reward_metrics"
_warned: set[str] = set()


def term_metrics(infos: Iterable[Mapping]) -> dict[str, float]:
    """``reward/<key>/mean`` over the rollouts' reward extra info (one mapping per rollout), for
    each key of ``LOGGED_KEYS`` that every rollout holds as a finite number."""
    rows = list(infos)
    out: dict[str, float] = {}
    for key in LOGGED_KEYS:
        values = [r.get(key) for r in rows]
        if not rows or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                                for v in values):
            continue
        out[METRIC.format(key=key)] = float(sum(values) / len(values))
    return out


def _warn_once(what: str, e: BaseException) -> None:
    if what not in _warned:
        _warned.add(what)
        log.warning("ttsrl: the reward terms are not logged (%s): %s: %s", what, type(e).__name__, e)


def _patch_v1(module) -> None:
    """The v1 trainer: after its own metrics, read the step's reward extra info from the TransferQueue."""
    cls = module.PPOTrainer
    original = cls._compute_metrics
    if getattr(original, _MARK, False):
        return

    def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
        result = original(self, batch, metrics, timing_raw, global_steps=global_steps, epoch=epoch)
        try:
            data = module.tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                                          select_fields=["extra_fields"])
            fields = data.pop("extra_fields").tolist()
            keep = [not tag.get("is_padding", False) for tag in batch.tags]
            infos = [(f.get("reward_extra_info") or {}) if isinstance(f, dict) else {}
                     for f, k in zip(fields, keep) if k]
            metrics.update(term_metrics(infos))
        except Exception as e:  # a metric must never stop training; said once in the log
            _warn_once("v1 trainer", e)
        return result

    setattr(_compute_metrics, _MARK, True)
    cls._compute_metrics = _compute_metrics


def _patch_legacy(module) -> None:
    """The legacy trainer (``--algorithm gdpo``): the extra info is in the batch's non-tensor data."""
    original = module.compute_data_metrics
    if getattr(original, _MARK, False):
        return

    def compute_data_metrics(batch, use_critic: bool = True):
        out = original(batch=batch, use_critic=use_critic)
        try:
            extra = batch.non_tensor_batch
            keys = [k for k in LOGGED_KEYS if k in extra]
            n = len(extra[keys[0]]) if keys else 0
            out.update(term_metrics([{k: float(extra[k][i]) for k in keys} for i in range(n)]))
        except Exception as e:
            _warn_once("legacy trainer", e)
        return out

    setattr(compute_data_metrics, _MARK, True)
    module.compute_data_metrics = compute_data_metrics


PATCHES: dict[str, Callable] = {"verl.trainer.ppo.v1.trainer_base": _patch_v1,
                                "verl.trainer.ppo.ray_trainer": _patch_legacy}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds the modules of ``PATCHES`` as the normal path finder does and patches each once executed."""

    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            PATCHES[name](module)

        spec.loader.exec_module = exec_and_patch
        return spec


def install() -> None:
    """Patch the trainer modules already imported; hook the import of the others. Idempotent."""
    for name, patch in PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
