"""Stage 3: merge every saved FSDP step into a Hugging Face checkpoint.

For each ``CKPT/global_step_N/actor`` this runs verl 0.9.1's FSDP merger
(``verl.model_merger``) in a subprocess (``python -m ttsrl.train.merge worker``, one for all the
steps to merge) and leaves
``OUT/step_N`` in the layout the converter writes: weights, config, tokenizer,
generation_config, our modeling file (the class keeping the lm_head bias, named by
``auto_map``) and the converter's side file, so stages 4 and 5 load it exactly like
the converted base model.

Precision: verl's ``FSDPModelMerger`` casts every shard to bf16 (no option). The FSDP
checkpoint holds fp32 master weights, and at a real learning rate (1e-6) bf16
rounding erases most of a run's update (``update_survival`` counts it; tests/test_grpo_cpu.py). So
:class:`KeepPrecisionFSDPMerger` subclasses verl's merger and replaces only its
shard gathering, which keeps each tensor's own dtype (or casts to ``--dtype``):
by default the merged tensors are the gathered master tensors bit for bit. World
size, device mesh, placement merge, saving, tokenizer and output validation are
verl's code.

Code from the checkpoint folder: the model class is built with remote code
(``auto_map``). By default the merge uses the project's own modeling file
(ttsrl/model/modeling_cosyvoice2.py), or ``--base-model``'s for other module names, never
the ``.py`` files found in the checkpoint folder; ``use_checkpoint_code`` opts into
those. The checkpoint folder is never written to (the merger reads a staged copy of
its config and tokenizer files). Note that verl's merger reads the shards with
``torch.load(weights_only=False)``: merging (or resuming from) a checkpoint folder you
did not produce unpickles it, which can run arbitrary code. Only merge your own.

Idempotent and checked: a finished step carries ``MERGED.json`` (written last) listing
every file with its size and sha256, and the size and sha256 of the checkpoint files it was
merged from (``source_files``: the FSDP model shards and the model config). A step is skipped
only when every listed file is present with its recorded size and sha256, every weights file
opens as safetensors, it was merged at the requested dtype, and from the checkpoint files that
are there now (a ``checkpoints/`` replaced by another run's is merged again); otherwise it is
merged again.
Stages 4 and 5 trust a step on the same check (hashing costs about 1 s per GB, a few
seconds for a 0.5B fp32 step). The layout, the marker and the atomic writing of a
step (temporary folder, synced, renamed into place: an interrupted merge leaves no
``step_N``) belong to ``ttsrl.model.checkpoint``, which DPO's saves use too.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from ttsrl.atomic import sha256_file
from ttsrl.cli import add_fields, given, option
from ttsrl.model.checkpoint import MODELING_FILE, TOKENIZER_FILES, check_merged, read_marker, step_path, writing_step
from ttsrl.train.verl_ckpt import HF_SUBDIR, saved_steps, shard_files

DTYPES = {"auto": None, "fp32": "float32", "bf16": "bfloat16"}  # --dtype -> torch dtype name (None: keep)


class MergeError(RuntimeError):
    pass


@dataclass
class MergeConfig:
    """Stage 3's settings; each field is also an option of ``merge_checkpoints.py``."""
    ckpt_dir: Path = option(parse=Path, metavar="DIR", help="stage-2 checkpoint folder (trainer.default_local_dir)")
    out_dir: Path = option(parse=Path, metavar="DIR", help="where step_N folders are written")
    base_model: Optional[Path] = option(None, parse=Path, metavar="DIR",
                                        help="the converted HF model trained from: source of the modeling file and "
                                             "side files (none: the modeling file shipped in ttsrl)")
    steps: Optional[list[int]] = option(None, parse=int, nargs="*", metavar="N",
                                        help="merge only these steps (none: every saved step)")
    python: str = option(sys.executable, cli=False, help="the Python that runs verl's merger")
    extra_env: dict[str, str] = option({}, cli=False, help="environment of the merger's process")
    dtype: str = option("auto", choices=DTYPES,
                        help="weights dtype: auto = the checkpoint's own (fp32 master weights, exact), fp32, or bf16 "
                             "(what verl's merger writes: half the size, loses small updates)")
    use_checkpoint_code: bool = option(False, help="build the model with the modeling_*.py found in the checkpoint "
                                                   "folder instead of the project's own (runs that code: only for "
                                                   "checkpoints you trust)")

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise MergeError(f"dtype {self.dtype!r}: choose one of {', '.join(DTYPES)}")


@dataclass
class StepResult:
    step: int
    path: Path
    merged: bool  # False: already merged, skipped
    seconds: float = 0.0


def source_fingerprint(actor: Path) -> dict[str, dict]:
    """Size and sha256 of every file of ``actor`` the merged weights come from (the FSDP model
    shards and the model config), keyed by path inside ``actor``: recorded in the step's marker,
    so a step merged from other shards (checkpoints replaced by another run's) is merged again."""
    files = shard_files(actor) + [actor / HF_SUBDIR / "config.json"]
    return {f.relative_to(actor).as_posix(): {"size": f.stat().st_size, "sha256": sha256_file(f)}
            for f in files if f.is_file()}


def _source_problem(target: Path, source: dict[str, dict]) -> str | None:
    """Why the complete step ``target`` was not merged from ``source`` (None: it was)."""
    recorded = (read_marker(target) or {}).get("source_files")
    if not isinstance(recorded, dict):
        return "its marker records no source shards (merged by an older ttsrl)"
    if recorded != source:
        changed = sorted(k for k in set(recorded) | set(source) if recorded.get(k) != source.get(k))
        return f"merged from other checkpoint files than the ones there now ({', '.join(changed[:3])} differ)"
    return None


def _remote_code_modules(hf_config: dict) -> list[str]:
    """File names of the modules ``auto_map`` points at (``modeling_x.Class`` -> ``modeling_x.py``)."""
    names = []
    for ref in (hf_config.get("auto_map") or {}).values():
        ref = ref[-1] if isinstance(ref, list) else ref
        if "--" in ref:  # "repo--module.Class": remote repo reference, not a local file
            ref = ref.split("--", 1)[1]
        names.append(ref.rsplit(".", 1)[0] + ".py")
    return sorted(set(names))


def _find_module(name: str, hf: Path, base_model: Optional[Path], use_checkpoint_code: bool) -> Path:
    """Where the code for module ``name`` comes from: the checkpoint folder only when
    asked; else the project's own modeling file, else ``--base-model``'s."""
    if use_checkpoint_code and (hf / name).is_file():
        return hf / name
    if MODELING_FILE.name == name:
        return MODELING_FILE
    if base_model is not None and (base_model / name).is_file():
        return base_model / name
    where = f"the ttsrl package{' nor in ' + str(base_model) if base_model else ''}"
    hint = (f" The checkpoint folder has its own {name}: --use-checkpoint-code runs it (only for a checkpoint "
            "you trust)." if (hf / name).is_file() and not use_checkpoint_code else "")
    raise MergeError(f"config.json auto_map names {name}, not found in {where}.{hint}")


def stage_config_dir(actor: Path, base_model: Optional[Path], use_checkpoint_code: bool,
                     staging: Path) -> list[Path]:
    """Copy ``actor/huggingface``'s config, generation config and tokenizer files into
    ``staging`` with the remote-code modules chosen by :func:`_find_module`; the merger
    reads this folder, never the checkpoint's ``.py`` files. Returns the modules."""
    hf = actor / HF_SUBDIR
    cfg_path = hf / "config.json"
    if not cfg_path.is_file():
        raise MergeError(f"{cfg_path} missing: is {actor} a verl FSDP actor checkpoint?")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (UnicodeError, json.JSONDecodeError) as e:
        raise MergeError(f"{cfg_path}: not JSON ({e})") from e
    modules = [_find_module(n, hf, base_model, use_checkpoint_code) for n in _remote_code_modules(cfg)]
    staging.mkdir(parents=True, exist_ok=True)
    for name in ("config.json",) + TOKENIZER_FILES:
        if (hf / name).is_file():
            shutil.copy2(hf / name, staging / name)
    for src in modules:
        shutil.copy2(src, staging / src.name)
    return modules


def source_to_merge(step: int, actor: Path, out_dir: Path, dtype: str,
                    log: Callable[[str], None] = print) -> dict[str, dict] | None:
    """None when ``OUT/step_N`` is a complete merge at ``dtype`` of the checkpoint files in ``actor``
    now; else those files' fingerprint (:func:`source_fingerprint`), having logged why an existing
    ``step_N`` is merged again."""
    target = step_path(out_dir, step)
    source = source_fingerprint(actor)
    why = check_merged(target, dtype) if target.exists() else "absent"
    if why is None:
        why = _source_problem(target, source)
        if why is None:
            return None
    if target.exists():
        log(f"[merge] step {step}: existing {target} is not a complete merge ({why}): merging again")
    return source


def merge_all(cfg: MergeConfig, log: Callable[[str], None] = print) -> list[StepResult]:
    """Merge every saved step (or ``cfg.steps``) that is not merged already, all in one worker process:
    importing verl costs each process 5-10 s on 2 cores, more than merging a small model."""
    if not Path(cfg.ckpt_dir).is_dir():
        raise MergeError(f"checkpoint folder {cfg.ckpt_dir} does not exist")
    steps = saved_steps(cfg.ckpt_dir, warn=log)  # partial and untracked folders: named, left out
    if cfg.steps is not None:
        missing = sorted(set(cfg.steps) - set(steps))
        if missing:
            raise MergeError(f"steps {missing} not saved in {cfg.ckpt_dir} (saved: {sorted(steps)})")
        steps = {s: steps[s] for s in cfg.steps}
    if not steps:
        raise MergeError(f"no global_step_N/actor checkpoints in {cfg.ckpt_dir}")
    out_dir = Path(cfg.out_dir)
    results, todo = {}, {}
    for step, actor in steps.items():
        source = source_to_merge(step, actor, out_dir, cfg.dtype, log)
        if source is None:
            results[step] = StepResult(step, step_path(out_dir, step), merged=False)
            log(f"[merge] step {step}: already merged (checked), skipped -> {results[step].path}")
        else:
            todo[step] = (actor, source)
    if todo:
        results.update(_merge_steps(todo, out_dir, cfg, log))
    return [results[s] for s in steps]


def _merge_steps(todo: dict[int, tuple[Path, dict]], out_dir: Path, cfg: MergeConfig,
                 log: Callable[[str], None]) -> dict[int, StepResult]:
    """Merge the steps ``todo`` ({step: (actor folder, source fingerprint)}) in one worker process.
    Each step is written into its own temporary folder (``writing_step``) and published once the
    worker reports it done; a step it did not finish leaves nothing, and the error names it after
    the steps before it are in place."""
    out_dir.mkdir(parents=True, exist_ok=True)
    writers, jobs, results = {}, {}, {}
    with ExitStack() as staged:
        try:
            for step, (actor, source) in todo.items():
                # named like the atomic writers' temps, so that writing_step deletes one a killed merge left
                staging = Path(tempfile.mkdtemp(prefix=f".step_{step}.cfg.tmp-{os.getpid()}-", dir=out_dir))
                staged.callback(shutil.rmtree, staging, ignore_errors=True)
                modules = stage_config_dir(actor, cfg.base_model, cfg.use_checkpoint_code, staging)
                info = {"step": step, "source": str(actor.resolve()), "source_files": source,
                        "dtype_option": cfg.dtype,
                        "code_from": "checkpoint" if cfg.use_checkpoint_code else "ttsrl/base model"}
                # the staged tokenizer files where the merger left them out, the base model's side file
                writer = writing_step(step_path(out_dir, step), info, modules, tokenizer_from=staging,
                                      extra_from=cfg.base_model)
                jobs[step] = {"local_dir": str(actor), "target_dir": str(writer.__enter__()),
                              "config_dir": str(staging), "trust_remote_code": bool(modules)}
                writers[step] = writer
            cmd = [cfg.python, "-m", "ttsrl.train.merge", "worker", "--dtype", cfg.dtype,
                   "--jobs", json.dumps(list(jobs.values()))]
            # the command without its job list, which grows by a few hundred characters a step
            log(f"[merge] step{'s' if len(todo) > 1 else ''} {', '.join(map(str, todo))}: {shlex.join(cmd[:-2])} "
                f"--jobs <{len(jobs)} job(s): {', '.join(str(todo[s][0]) for s in jobs)}>")
            t0 = time.time()
            proc = subprocess.run(cmd, env={**os.environ, **cfg.extra_env}, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
            done = {}  # target_dir -> seconds since the worker started, from its "done" lines
            for line in proc.stdout.splitlines():
                if line.startswith(WORKER_DONE):
                    seconds, target = line[len(WORKER_DONE):].split(" ", 1)
                    done[target] = float(seconds)
            for step, job in jobs.items():
                if job["target_dir"] not in done:
                    break
                writers.pop(step).__exit__(None, None, None)  # publishes step_N
                results[step] = StepResult(step, step_path(out_dir, step), merged=True,
                                           seconds=done[job["target_dir"]])
                log(f"[merge] step {step}: merged ({results[step].seconds:.1f} s into the merger) -> "
                    f"{results[step].path}")
            if proc.returncode != 0 or writers:
                failed = [todo[s][0] for s in writers]
                raise MergeError(f"verl's FSDP merger failed (exit {proc.returncode})"
                                 + (f" for {', '.join(map(str, failed))}" if failed else "") + ":\n"
                                 + proc.stdout[-4000:])
            log(f"[merge] {len(todo)} step(s) merged in {time.time() - t0:.1f} s by one merger process")
        finally:
            for writer in writers.values():  # not finished: its temporary folder is deleted
                writer.__exit__(MergeError, MergeError("merge not finished"), None)
    return results


# ---- the merger (runs in the worker subprocess) -------------------------------------

def make_merger(local_dir: str, target_dir: str, config_dir: str, dtype: Optional[str],
                trust_remote_code: bool):
    """verl's FSDP merger with the shard gathering replaced by one that keeps each
    tensor's dtype (``dtype`` None) or casts to ``dtype`` (a torch dtype name)."""
    import torch
    from verl.model_merger.base_model_merger import ModelMergerConfig
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger, merge_non_dtensor_shards

    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import DTensor

    cast = getattr(torch, dtype) if dtype else None

    class KeepPrecisionFSDPMerger(FSDPModelMerger):
        """verl's FSDPModelMerger without its unconditional ``.bfloat16()`` on every shard."""

        def _load_and_merge_state_dicts(self, world_size, total_shards, mesh_shape, mesh_dim_names):
            if len(mesh_shape) != 1:
                raise NotImplementedError("FSDP + TP checkpoints are not supported (as in verl's merger)")
            ranks = []
            for rank in range(total_shards):
                path = Path(self.config.local_dir) / f"model_world_size_{world_size}_rank_{rank}.pt"
                ranks.append(torch.load(path, map_location="cpu", weights_only=False))  # as verl does
            merged = {}
            for key in sorted(ranks[0]):
                parts = [r.pop(key) for r in ranks]
                if isinstance(parts[0], DTensor):
                    placements = tuple(parts[0].placements)
                    if mesh_dim_names[0] in ("dp", "ddp"):
                        placements = placements[1:]  # replicated over data parallel
                    if len(placements) != 1:
                        raise NotImplementedError(f"{key}: placements {placements}")
                    t = self._merge_by_placement([p._local_tensor for p in parts], placements[0])
                else:
                    t = merge_non_dtensor_shards(key, parts)
                merged[key] = t.to(cast) if cast is not None else t
            return merged

        def save_hf_model_and_tokenizer(self, state_dict):
            dtypes = {t.dtype for t in state_dict.values() if t.is_floating_point()}
            super().save_hf_model_and_tokenizer(state_dict)
            # verl builds the model skeleton in bf16, so config.json says bfloat16; record
            # the dtype actually written (loaders with dtype="auto" read it)
            if len(dtypes) == 1:
                cfg_path = Path(self.config.target_dir) / "config.json"
                cfg = json.loads(cfg_path.read_text())
                name = str(dtypes.pop()).removeprefix("torch.")
                for k in ("dtype", "torch_dtype"):
                    if k in cfg:
                        cfg[k] = name
                cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    config = ModelMergerConfig(operation="merge", backend="fsdp", local_dir=local_dir, target_dir=target_dir,
                               hf_model_config_path=config_dir, trust_remote_code=trust_remote_code)
    return KeepPrecisionFSDPMerger(config)


WORKER_DONE = "[merge worker] done "  # + seconds since start + " " + target_dir: one line per finished job


@dataclass
class MergeWorker:
    """The steps' merges (``python -m ttsrl.train.merge worker``, run by :func:`merge_all`)."""
    jobs: str = option(help="JSON list of {local_dir: CKPT/global_step_N/actor, target_dir: where the merged HF "
                            "checkpoint goes, config_dir: config + tokenizer files (+ modeling file), "
                            "trust_remote_code: let transformers run the config folder's modeling file}")
    dtype: str = option("auto", choices=DTYPES, help="weights dtype (a key of DTYPES)")


def _worker(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m ttsrl.train.merge worker",
                                description="merge FSDP actor checkpoints, in order (used by merge_checkpoints.py)")
    add_fields(p, MergeWorker)
    a = MergeWorker(**given(p.parse_args(argv), MergeWorker))
    t0 = time.time()
    for job in json.loads(a.jobs):
        Path(job["target_dir"]).mkdir(parents=True, exist_ok=True)
        merger = make_merger(job["local_dir"], job["target_dir"], job["config_dir"], DTYPES[a.dtype],
                             job["trust_remote_code"])
        merger.merge_and_save()
        merger.cleanup()
        print(f"{WORKER_DONE}{time.time() - t0:.1f} {job['target_dir']}", flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["worker"]:
        sys.exit("usage: python -m ttsrl.train.merge worker --local-dir ... (see merge_checkpoints.py for the CLI)")
    sys.exit(_worker(sys.argv[2:]))


def update_survival(base: dict, master: dict, merged: dict) -> dict:
    """How much of a training update (``master - base``, fp32) a merged model keeps.

    The start model is rounded to each merged tensor's dtype, as the merge rounds the
    trained one, so that a lossless merge scores 1.0 and 0.0 whatever the dtype.

    ``survives``: of the weights the update changed, the fraction whose merged value
    differs from the (equally rounded) start value; ``delta_error``: |(merged -
    rounded start) - update| / |update| (0: the merged model carries the update
    exactly; >= 1: what it carries is mostly rounding noise); ``error_vs_update``:
    |merged - master| / |update|; ``changed``: fraction of all weights the update
    changed. (Rounding is unbiased in aggregate, so a projection on the update is
    about 1 for bf16 too; per weight it is noise, which these numbers show.)"""
    upd2 = err2 = derr2 = 0.0
    n = n_changed = n_kept = 0
    for k, m in master.items():
        if k not in base or base[k].shape != m.shape:
            continue
        g = merged[k]
        b_r = base[k].to(g.dtype)
        u = m.double() - base[k].double()
        upd2 += float((u * u).sum())
        err2 += float(((g.double() - m.double()) ** 2).sum())
        derr2 += float(((g.double() - b_r.double() - u) ** 2).sum())
        changed = u != 0
        n += u.numel()
        n_changed += int(changed.sum())
        n_kept += int((changed & (g != b_r)).sum())
    nan = float("nan")
    return {"survives": n_kept / n_changed if n_changed else nan,
            "delta_error": (derr2 / upd2) ** 0.5 if upd2 else nan,
            "error_vs_update": (err2 / upd2) ** 0.5 if upd2 else nan,
            "update_norm": upd2 ** 0.5, "changed": n_changed / max(n, 1), "n_weights": n}
