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
share of rollouts that hit the response limit), ``reward/sim_measured/mean``, ``reward/mos/mean`` and
``reward/mos_measured/mean`` (DNSMOS OVRL, from a server with a MOS weight) and
``reward/reward_failed/mean``. The patches are applied when verl's trainer modules are
imported (an import hook: importing them here would cost every verl process seconds).

**A step never trains on a silently broken reward.** A reward request that fails is scored 0
and flagged ``reward_failed`` (``ttsrl.reward.client``) until too many of a process's recent
requests failed; then the reward function raises, and verl 0.9.1 marks that rollout's group
"failure" and trains the step without the lost rollouts (``agent_loop_tq.py:137``, the
replay buffer pads them). Neither shows in verl's metrics. So, as each training batch is
sampled (before any update), :func:`step_health` counts the step's rollouts without a reward
(flagged, or lost) against ``train_batch_size x rollout.n`` and the groups that came back short:
``reward/no_reward/share`` and ``reward/groups_dropped/share`` join the step's metrics (console
line, TensorBoard), with ``reward/groups_flat/share``, the groups whose rollouts all scored the same (they
teach nothing), each step with a loss is written to the run record
(``<checkpoint dir>/ttsrl_run.json``, ``reward_health``), and a step whose share exceeds
``TTSRL_REWARD_MAX_FAIL_FRACTION`` (default 10%: the share the client's window allows, so a
brief server hiccup passes and a server that refuses a class of rows does not) stops the run
with :class:`RewardHealthError` naming the step, the counts and where the client's errors are,
before that step updates the policy.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from ttsrl import knobs
from ttsrl.atomic import atomic_write_text

log = logging.getLogger("ttsrl.verl_plugin")

#: the reward function's numeric keys logged per step (ttsrl.reward.client's compute_score)
LOGGED_KEYS = ("cer", "sim", "length", "unfinished", "sim_measured", "mos", "mos_measured", "reward_failed")
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


NO_REWARD = "reward/no_reward/share"  # rollouts of the step without a reward (flagged or lost)
GROUPS_DROPPED = "reward/groups_dropped/share"  # groups that came back with fewer than rollout.n rollouts
# groups whose rollouts all scored the same: zero reward variance, so zero advantage (GRPO, RLOO, DAPO alike)
# and nothing learnt from them; in the real regime (CER of a few %) most groups of a small n are so
GROUPS_FLAT = "reward/groups_flat/share"
FLAT_SPREAD = 1e-6  # verl's GRPO normalises by (std + 1e-6): a smaller spread is no signal
LIMIT_KNOB = "TTSRL_REWARD_MAX_FAIL_FRACTION"
RUN_RECORD = "ttsrl_run.json"  # train_grpo.py's record in the checkpoint folder
HEALTH_KEY = "reward_health"


class RewardHealthError(RuntimeError):
    """A training step lost more of its rewards than the run allows: the run stops before it trains."""


def step_health(keys: Sequence[str], tags: Sequence[Mapping], infos: Sequence[Mapping], prompts: int,
                n: int) -> dict[str, int]:
    """What a sampled training batch lacks. ``keys``: verl's ``{uid}_{session}_{index}`` per
    trajectory, ``tags`` their tags (padding excluded), ``infos`` their reward extra info;
    ``prompts`` groups of ``n`` rollouts were asked for. ``failed``: rollouts scored 0 after a failed
    request (``reward_failed``); ``missing``: rollouts verl lost (the reward function raised);
    ``groups_dropped``: groups with fewer than ``n`` rollouts (a group absent altogether included);
    ``groups_flat``: groups of two or more scored rollouts whose scores (the reward function's ``score``)
    all lie within ``FLAT_SPREAD``."""
    sessions: dict[str, set[str]] = {}
    failed: set[tuple[str, str]] = set()
    scores: dict[str, list[float]] = {}
    for key, tag, info in zip(keys, tags, infos):
        if tag.get("is_padding", False):
            continue
        uid, _, rest = key.partition("_")
        session = rest.split("_", 1)[0]
        sessions.setdefault(uid, set()).add(session)
        if isinstance(info, Mapping) and info.get("reward_failed") == 1.0:
            failed.add((uid, session))
        elif isinstance(info, Mapping) and isinstance(info.get("score"), (int, float)):
            scores.setdefault(uid, []).append(float(info["score"]))
    flat = sum(len(v) >= 2 and max(v) - min(v) <= FLAT_SPREAD for v in scores.values())
    present = sum(len(s) for s in sessions.values())
    full = sum(len(s) >= n for s in sessions.values())
    missing = max(0, prompts * n - present)
    return {"rollouts": prompts * n, "without_reward": len(failed) + missing, "failed": len(failed),
            "missing": missing, "groups": prompts, "groups_dropped": max(0, prompts - full), "groups_flat": flat}


def health_metrics(h: Mapping[str, int]) -> dict[str, float]:
    return {NO_REWARD: h["without_reward"] / max(1, h["rollouts"]),
            GROUPS_DROPPED: h["groups_dropped"] / max(1, h["groups"]),
            GROUPS_FLAT: h.get("groups_flat", 0) / max(1, h["groups"])}


def health_problem(step: int, h: Mapping[str, int], limit: float) -> str | None:
    """The sentence that stops the run, or None while the step is within ``limit``."""
    share = h["without_reward"] / max(1, h["rollouts"])
    if share <= limit:
        return None
    return (f"step {step}: {h['without_reward']} of {h['rollouts']} rollouts have no reward ({share:.0%}: "
            f"{h['failed']} scored 0 after a failed reward request, {h['missing']} lost by verl; "
            f"{h['groups_dropped']} of {h['groups']} groups short), more than {LIMIT_KNOB}={limit:g} allows: the "
            "run stops before this step trains. The reward client's errors (RewardServiceError, the server's "
            "HTTP status and reason) are in the training log above; check the servers with "
            "`python -m ttsrl.reward.health URL` and their log (EXP_DIR/logs/reward_server.log)")


def record_health(checkpoint_dir: str | None, step: int, h: Mapping[str, int], limit: float,
                  stopped: str | None = None) -> None:
    """Add the step to the run record's ``reward_health`` (steps with a loss only, the worst share,
    and the stop, if any); a record that is missing or unreadable is left alone (a metric never
    stops training)."""
    if not checkpoint_dir:
        return
    path = Path(checkpoint_dir) / RUN_RECORD
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if not isinstance(record, dict):
        return
    health = record.get(HEALTH_KEY) if isinstance(record.get(HEALTH_KEY), dict) else {}
    share = h["without_reward"] / max(1, h["rollouts"])
    health.update({"limit": limit, "knob": LIMIT_KNOB, "last_step": step,
                   "steps_checked": int(health.get("steps_checked", 0)) + 1,
                   "worst_share": max(float(health.get("worst_share", 0.0)), share)})
    if h["without_reward"] or h["groups_dropped"]:
        health.setdefault("steps_with_loss", {})[str(step)] = dict(h)
    if stopped:
        health["stopped"] = {"step": step, "why": stopped, "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    record[HEALTH_KEY] = health
    try:
        atomic_write_text(path, json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    except OSError as e:
        _warn_once("run record", e)


def check_step(trainer, tq, batch, global_steps: int, batch_size: int, metrics: dict) -> None:
    """The rule of the module doc for one sampled training batch of ``trainer`` (verl's v1 trainer)."""
    n = int(trainer.config.actor_rollout_ref.rollout.n)
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["extra_fields"])
    fields = data.pop("extra_fields").tolist()
    infos = [(f.get("reward_extra_info") or {}) if isinstance(f, dict) else {} for f in fields]
    h = step_health(batch.keys, batch.tags, infos, batch_size, n)
    metrics.update(health_metrics(h))
    limit = float(knobs.get(LIMIT_KNOB))
    why = health_problem(global_steps, h, limit)
    record_health(trainer.config.trainer.get("default_local_dir"), global_steps, h, limit, why)
    if why:
        raise RewardHealthError(why)


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

    build = cls._build_replay_buffer

    def _build_replay_buffer(self):
        buffer = build(self)
        sample = buffer.sample

        def checked_sample(global_steps, partition_id, batch_size):
            batch, extra = sample(global_steps=global_steps, partition_id=partition_id, batch_size=batch_size)
            if partition_id == "train":  # validation scores, it does not train
                extra = dict(extra or {})
                try:
                    check_step(self, module.tq, batch, global_steps, batch_size, extra)
                except RewardHealthError:
                    raise
                except Exception as e:  # a count that cannot be taken is said in the log, never a stop
                    _warn_once("the step's reward count", e)
            return batch, extra

        buffer.sample = checked_sample
        return buffer

    cls._build_replay_buffer = _build_replay_buffer


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
