"""run.sh's settings: the preset's values (the environment wins), run.sh's defaults, the
values derived from ``EXP_DIR`` and from the node list, checked in one pass.

``run.sh`` sources the preset (``set -a``: every value it sets reaches this module through the
environment; argument lists are bash arrays, which cannot be exported, so run.sh hands them over
in a NUL-separated stream, :func:`read_arrays`) and evaluates what :func:`shell` prints: one
``export NAME=VALUE`` per setting and ``NAME=(...)`` per list, quoted for bash. ``--config``
prints the same settings one a line, GRPO's resolved fields included (``GRPO.lr=...``: what
``train_grpo.py`` will train with, read from its own parser). Nothing here imports more than the
standard library (stage -2 has not made the venv yet) except the GRPO lines of ``--config``.

The contract (``bash run.sh --help`` prints :data:`HELP`):

* every value a preset sets is written ``: "${VAR:=value}"``, so the environment wins; run.sh's
  own defaults (:func:`resolve`) yield the same way;
* a preset sets ``REQUIRED`` and the arrays ``REQUIRED_ARRAYS``; every missing one is named in
  one message, and every list given as a string;
* ``REWARD_EXTRA``, ``GRPO_EXTRA``, ``EVAL_EXTRA``, ``PREF_EXTRA``: words added to ``REWARD_ARGS``,
  ``GRPO_ARGS``, ``EVAL_ARGS`` and ``PREF_ARGS`` (a bash array in a preset, or a string in the
  environment split as the shell splits words: ``GRPO_EXTRA="--lr 5e-7"`` sets any ``GRPOConfig``
  field of ``train_grpo.py``, ``PREF_EXTRA="--loss-type ipo"`` any option of ``train_dpo.py``).
"""

from __future__ import annotations

import math
import os
import re
import shlex
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

ROOT = Path(__file__).resolve().parents[2]
STAGES = (-2, -1, 0, 1, 2, 3, 4, 5)
TRAINERS = ("grpo", "dpo", "kto")
REQUIRED = ("DEVICE", "EXP_DIR", "COSYVOICE2_DIR", "TRAIN_FILE", "TEST_FILE", "MAX_PROMPT_LENGTH",
            "REWARD_BACKEND", "EVAL_NPROC")
REQUIRED_ARRAYS = ("REWARD_ARGS", "GRPO_ARGS", "EVAL_ARGS")
#: every argument list run.sh reads, with the default of the optional ones
LISTS = {"REWARD_ARGS": None, "GRPO_ARGS": None, "EVAL_ARGS": None,
         "MINE_ARGS": ["--k", "4", "--min-margin", "0.1"],
         "PREF_ARGS": ["--lr", "1e-5", "--batch-size", "8", "--epochs", "1"],
         "PREF_LAUNCH": [],  # e.g. (-m accelerate.commands.launch --num_processes 8 ...)
         "CHECK_INPUTS_ARGS": None,  # presets with user-provided files (gpu8): checked up front
         "FETCH_ARGS": None,  # presets whose inputs have public sources (gpu8): python -m ttsrl.fetch, stage -1
         "RAY_START_ARGS": [],
         "BASE_MODEL_ARGS": []}  # stage -1's build_base_model.py options (the embedded world)
#: words a user adds to a list: NAME_EXTRA -> the list it extends
EXTRAS = {"REWARD_EXTRA": "REWARD_ARGS", "GRPO_EXTRA": "GRPO_ARGS", "EVAL_EXTRA": "EVAL_ARGS", "PREF_EXTRA": "PREF_ARGS"}

USAGE = ("usage: bash run.sh [START [STOP]] [-- HYDRA_OVERRIDE...] | --config   "
         f"(stages {' '.join(map(str, STAGES))}; bash run.sh --help)")

HELP = f"""\
ttsrl: RL post-training of a CosyVoice speech-token LLM, stage by stage.

  bash run.sh                      all stages (-2 .. 5) of the preset (presets/embedded.sh: CPU)
  bash run.sh START STOP           a contiguous range of stages, e.g. `bash run.sh 1 3`
  bash run.sh 2 2 -- KEY=VALUE...  extra Hydra overrides for verl's main_ppo (stage 2); a key a
                                   GRPOConfig field owns is refused: set the field (GRPO_EXTRA)
  bash run.sh --config             print every setting a run would use, GRPO's resolved fields
                                   included (GRPO.lr=...), and run nothing
  PRESET=presets/gpu8.sh bash run.sh -1 5     the 8-GPU recipe
  TRAINER=dpo bash run.sh          offline DPO (or TRAINER=kto) instead of GRPO, under EXP_DIR/dpo/

Stages: -2 install .venv | -1 fetch or build, convert llm.pt -> HF | 0 dev set, JSONL -> Parquet
         1 reward server | 2 GRPO (verl) | 3 merge FSDP checkpoints | 4 CER sweep
         5 export the step chosen on the dev set (or EXPORT_STEP) to llm.pt

Settings: the preset sets what differs between runs, each value as a default, `: "${{VAR:=value}}"`;
  a setting given in the environment wins, and so it does over run.sh's defaults: `EXP_DIR=/data/run1
  DEV_SIZE=100 bash run.sh`. A preset must set {' '.join(REQUIRED)}
  and the arrays {' '.join(REQUIRED_ARRAYS)}.
  Argument lists are bash arrays; from the environment one grows by words, split as the shell
  splits them: {', '.join(EXTRAS)}
  extend {', '.join(EXTRAS.values())} (GRPO_EXTRA="--lr 5e-7": any train_grpo.py field).
  Derived from EXP_DIR when unset: HF_MODEL_DIR DATA_DIR CKPT_DIR MERGED_DIR EVAL_DIR EXPORT_PATH
  TENSORBOARD_DIR. Named variants: MODEL_FAMILY, REWARD, REWARD_WEIGHTS, ALGORITHM, SAMPLING.
  REWARD_WEIGHTS is a named weighting (cer, glm_tts) or the SIM weight itself (REWARD_WEIGHTS=0.2: CER 1 +
  SIM 0.2), passed to the reward server and to train_grpo.py alike.
  Several nodes (GRPO): NODE_IPS, NODE_RANK, GPUS_PER_NODE, JOIN_TIMEOUT_S, RAY_PORT, RAY_ADDRESS;
  a rehearsal on one machine: presets/multinode_sim.sh.

What each setting means, its default and where it lives: README.md (Configuration), docs/operations.md
(the reward servers), docs/evaluation.md (dev set, stage 4 and 5), docs/multinode.md (several nodes).
"""


#: ASCII digits only: Python's ``isdigit`` and ``\\d`` take '٠' or '３', which bash arithmetic and
#: the programs run.sh calls then refuse (or read as 0) after a stage has started
ASCII_INT = re.compile(r"[0-9]+")
ASCII_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]+)?")
#: every numeric setting: (kind, low, high); "int" and "number" are ASCII, checked in one pass
NUMERIC = {"DEV_SIZE": ("int", 0, None), "NODE_RANK": ("int", 0, None), "MAX_PROMPT_LENGTH": ("int", 1, None),
           "EVAL_NPROC": ("int", 1, None), "REWARD_PORT": ("int", 1, 65535), "RAY_PORT": ("int", 1, 65535),
           "RAY_NODE_PORT": ("int", 1, 65535), "RAY_NUM_CPUS": ("int", 1, None),
           "RAY_START_ATTEMPTS": ("int", 1, None), "GPUS_PER_NODE": ("int", 0, None),
           "REWARD_MIN_READY": ("int", 1, None), "EXPORT_STEP": ("int", 0, None),
           "REWARD_START_TIMEOUT_S": ("number", 0, None), "JOIN_TIMEOUT_S": ("number", 0, None),
           "HEAD_WAIT_S": ("number", 0, None), "SHARE_WAIT_S": ("number", 0, None),
           "BUILD_BASE_MODEL": ("flag", 0, 1), "ALLOW_LEAK": ("flag", 0, 1), "REWARD_ANY_SERVER": ("flag", 0, 1)}


def numeric_problems(values: Mapping[str, str]) -> list[str]:
    """One line per numeric setting that is not an ASCII number in its range (an empty optional
    one, e.g. EXPORT_STEP, is fine)."""
    out = []
    for name, (kind, low, high) in NUMERIC.items():
        if name not in values:  # not resolved yet (checked again once it is)
            continue
        value = values[name]
        if value == "" and name in ("EXPORT_STEP", "REWARD_MIN_READY", "RAY_NODE_PORT"):
            continue
        pattern = ASCII_NUMBER if kind == "number" else ASCII_INT
        ok = pattern.fullmatch(value) is not None and (low is None or float(value) >= low) \
            and (high is None or float(value) <= high)
        if not ok:
            want = {"int": "a whole number in ASCII digits", "number": "a number in ASCII digits (seconds)",
                    "flag": "0 or 1"}[kind]
            span = "" if kind == "flag" else f" from {low}" + (f" to {high}" if high is not None else "")
            out.append(f"{name}={value!r}: expected {want}{span}")
    return out


class SettingsError(Exception):
    """Settings a run cannot start with: one line each; ``usage``: also print the usage line."""

    def __init__(self, lines: list[str], usage: bool = False):
        super().__init__("\n".join(lines))
        self.lines, self.usage = lines, usage


@dataclass
class Resolved:
    """A run's settings: ``values`` (one string each, in the order they were resolved) and
    ``lists`` (argument lists), the stage range and stage 2's Hydra overrides."""

    start: int
    stop: int
    show_config: bool = False
    values: dict[str, str] = field(default_factory=dict)
    lists: dict[str, list[str]] = field(default_factory=dict)

    def __getitem__(self, name: str) -> str:
        return self.values[name]

    @property
    def multi_node(self) -> bool:
        return int(self.values["NNODES"]) > 1


# ---------------------------------------------------------------------------- reading run.sh's input


def read_arrays(data: bytes) -> dict[str, list[str]]:
    """The arrays run.sh hands over: ``NAME\\0COUNT\\0ITEM\\0...`` per array."""
    parts = data.split(b"\0")
    out, i = {}, 0
    while i + 1 < len(parts) and parts[i]:
        name, count = parts[i].decode(), int(parts[i + 1])
        out[name] = [p.decode("utf-8", "surrogateescape") for p in parts[i + 2:i + 2 + count]]
        i += 2 + count
    return out


def parse_argv(argv: list[str]) -> tuple[int, int, list[str], bool]:
    """``[--config] [START [STOP]] [-- OVERRIDE...]`` -> (start, stop, overrides, config)."""
    show = bool(argv) and argv[0] == "--config"
    if show:
        if len(argv) > 1:
            raise SettingsError([f"run.sh: --config takes no other argument (got: {' '.join(argv[1:])})"], usage=True)
        argv = []
    cut = argv.index("--") if "--" in argv else len(argv)
    positional, overrides = argv[:cut], argv[cut + 1:]
    if len(positional) > 2:
        raise SettingsError([f"run.sh: unexpected argument '{positional[2]}' (Hydra overrides for stage 2 go after "
                             "'--')"], usage=True)
    names = [str(s) for s in STAGES]
    start = positional[0] if positional else names[0]  # default: every stage
    stop = positional[1] if len(positional) > 1 else names[-1]
    for s in (start, stop):
        if s not in names:
            raise SettingsError([f"run.sh: stage '{s}' is not one of: {' '.join(names)}"], usage=True)
    if int(start) > int(stop):
        raise SettingsError([f"run.sh: START ({start}) is after STOP ({stop})"], usage=True)
    if overrides and not int(start) <= 2 <= int(stop):
        raise SettingsError([f"run.sh: overrides after '--' are for stage 2, which is not in {start}..{stop}"],
                            usage=True)
    return int(start), int(stop), overrides, show


def words(text: str, what: str) -> list[str]:
    """``text`` split as the shell splits words (nothing in it runs)."""
    try:
        out = shlex.split(text)
    except ValueError as e:
        raise SettingsError([f"{what} ({text}): not words as the shell splits them (ValueError: {e}); quote a "
                             "value with a space, e.g. --flag 'a value'"]) from None
    if any("\n" in w for w in out):
        raise SettingsError([f"{what} ({text}): a word with a line break"])
    return out


# ---------------------------------------------------------------------------- resolution


def resolve(env: Mapping[str, str], arrays: Mapping[str, list[str]], argv: list[str],
            env_names: frozenset[str] = frozenset()) -> Resolved:
    """The run's settings from the environment (the preset's values exported into it) and the
    preset's arrays; raises :class:`SettingsError` with every problem found. ``env_names``: the
    variables the environment held before the preset was sourced (a list given there as a string
    is refused: the preset's array would silently win over it)."""
    start, stop, overrides, show = parse_argv(argv)
    r = Resolved(start, stop, show)
    v = r.values
    preset = env.get("PRESET", "presets/embedded.sh")

    def get(name: str, default: str = "") -> str:
        value = env.get(name, "")
        v[name] = value if value != "" else default
        return v[name]

    get("PRESET", "presets/embedded.sh")
    get("PRESET_NAME", Path(preset).name.removesuffix(".sh"))
    trainer = get("TRAINER", "grpo")
    # the preset's required settings and lists, all problems in one message
    missing = [n for n in REQUIRED if not env.get(n)] + [n for n in REQUIRED_ARRAYS if n not in arrays and n not in env]
    problems = []
    if missing:
        problems.append(f"{preset}: it does not set {' '.join(missing)} (every preset sets {' '.join(REQUIRED)} "
                        f"and the arrays {' '.join(REQUIRED_ARRAYS)}; a value may also come from the environment)")
    extra_of = {target: extra for extra, target in EXTRAS.items()}
    for name in LISTS:
        how = (f"{extra_of[name]}=\"--flag value\" adds words to it" if name in extra_of else
               "a preset of your own sets it")
        if name in env_names:  # the environment cannot carry an array; the preset's would win silently
            problems.append(f"{name} is given in the environment as a string, which cannot set a list "
                            f"(an array of the preset): {how}")
        elif name not in arrays and env.get(name):
            problems.append(f'{preset}: {name} must be a bash array, e.g. {name}=(--flag "a value")')
    if problems:
        raise SettingsError(problems)
    for name, default in LISTS.items():
        if name in arrays:
            r.lists[name] = list(arrays[name])
        elif default is not None:
            r.lists[name] = list(default)
    extras = {extra: list(arrays[extra]) if extra in arrays else words(env.get(extra, ""), extra)
              for extra in EXTRAS}
    for extra, target in EXTRAS.items():
        if extra != "GRPO_EXTRA":  # GRPO_EXTRA goes after the run's own arguments (grpo_args), so it wins
            r.lists[target] += extras[extra]
    r.lists["EXTRA_OVERRIDES"] = overrides
    # one road for the reward's identity: REWARD, REWARD_BACKEND, REWARD_PORT, never also a flag
    owned = {"--reward": "REWARD", "--backend": "REWARD_BACKEND", "--port": "REWARD_PORT",
             "--weights": "REWARD_WEIGHTS", "--sim-weight": "REWARD_WEIGHTS"}
    for word in r.lists["REWARD_ARGS"]:
        flag = word.split("=", 1)[0]
        # an abbreviation (--rew) is the flag too: the server's parser takes none, refused here first
        flag = next((f for f in owned if flag.startswith("--") and len(flag) > 2 and f.startswith(flag)), flag)
        if flag in owned:
            raise SettingsError([f"REWARD_ARGS/REWARD_EXTRA hold {flag}: set {owned[flag]} instead (run.sh passes it "
                                 "to the server, records it and checks that an adopted server serves it)"])

    for name in REQUIRED:
        get(name)
    from ttsrl.families import DEFAULT_FAMILY  # standard library only, as this module

    resolve_family(r, get("MODEL_FAMILY", DEFAULT_FAMILY.name))
    exp = v["EXP_DIR"]
    for name, default in (("REWARD", "tanh"), ("ALGORITHM", "grpo"), ("SAMPLING", ""), ("SEED", ""),
                          ("LOGGERS", "console"), ("BUILD_BASE_MODEL", "0"),
                          ("HF_MODEL_DIR", f"{exp}/hf_model"), ("DATA_DIR", f"{exp}/data"),
                          ("CKPT_DIR", f"{exp}/checkpoints"), ("REWARD_PORT", "8000"),
                          ("REWARD_START_TIMEOUT_S", "300"), ("REWARD_ANY_SERVER", "0"), ("DEV_FILE", ""),
                          ("DEV_SIZE", "0"), ("USER_PAIRS", ""), ("ALLOW_LEAK", "0"), ("EXPORT_STEP", ""),
                          ("LLM_FILE", "llm.pt"), ("PROMPT_POOL", ""), ("PROMPT_SEED", "0"),
                          ("REWARD_WEIGHTS", "cer")):
        get(name, default)
    exp_abs = exp if exp.startswith("/") else str(ROOT / exp)
    get("TENSORBOARD_DIR", f"{exp_abs}/tensorboard")
    if trainer == "grpo":
        get("MERGED_DIR", f"{exp}/merged"), get("EVAL_DIR", f"{exp}/eval"), get("EXPORT_PATH", f"{exp}/llm-new.pt")
    elif trainer in ("dpo", "kto"):
        get("MERGED_DIR", f"{exp}/{trainer}/merged"), get("EVAL_DIR", f"{exp}/{trainer}/eval")
        get("EXPORT_PATH", f"{exp}/llm-{trainer}.pt")
        # USER_PAIRS: your own pairs, converted into a file of their own (never over mined pairs)
        get("PAIRS_FILE", f"{exp}/pairs/{'user-pairs' if v['USER_PAIRS'] else 'pairs'}.parquet")
        user = v["USER_PAIRS"]
        if user and v["PROMPT_POOL"] and start <= 2 <= stop:
            raise SettingsError([f"USER_PAIRS={user} with PROMPT_POOL={v['PROMPT_POOL']}: user pairs carry no speaker "
                                 "prompt (text-only), the run is zero-shot; PROMPT_POOL= (empty) trains and evaluates "
                                 "them text-only"])
        if user and start <= 2 <= stop and not (os.path.isfile(user) and os.access(user, os.R_OK)):
            raise SettingsError([f"USER_PAIRS={user}: no such readable file (expected a JSONL of pairs, one "
                                 '{"text", "chosen", "rejected"} a line)'])
    else:
        raise SettingsError([f"TRAINER must be grpo, dpo or kto (got {trainer}): grpo trains online with verl, dpo "
                             "and kto offline with TRL on mined pairs"])
    # the dev set: stage 5 chooses the step on it (never on a test set)
    v["SPLIT_DIR"] = f"{v['DATA_DIR']}/split"
    if not ASCII_INT.fullmatch(v["DEV_SIZE"]):
        raise SettingsError([f"DEV_SIZE={v['DEV_SIZE']}: expected a count of training texts (0: none held out)"])
    if v["DEV_FILE"]:
        v["DEV_SET"], v["TRAIN_TEXTS"] = v["DEV_FILE"], v["TRAIN_FILE"]
    elif int(v["DEV_SIZE"]) > 0:  # stage 0 holds DEV_SIZE training texts out (ttsrl/data/devsplit.py)
        v["DEV_SET"], v["TRAIN_TEXTS"] = f"{v['SPLIT_DIR']}/dev.jsonl", f"{v['SPLIT_DIR']}/train.jsonl"
    else:
        v["DEV_SET"], v["TRAIN_TEXTS"] = "", v["TRAIN_FILE"]
    numbers = numeric_problems(v)  # before anything does arithmetic with them
    if numbers:
        raise SettingsError([f"run.sh: {p}" for p in numbers])
    resolve_nodes(r, env)
    resolve_pool(r)
    resolve_reward(r, env)
    numbers = numeric_problems(v)  # NODE_RANK, Ray's and REWARD_MIN_READY, as resolved
    if numbers:
        raise SettingsError([f"run.sh: {p}" for p in numbers])
    resolve_paths(r)
    r.lists["WEIGHT_ARGS"] = weight_args(v["REWARD_WEIGHTS"])
    r.lists["GRPO_ARGS"] = grpo_args(r) + extras["GRPO_EXTRA"]
    return r


def weight_args(weights: str, named: str = "--weights") -> list[str]:
    """The words for REWARD_WEIGHTS: ``named`` NAME for a named weighting (the reward server's ``--weights``,
    train_grpo.py's ``--reward-weights``; each checks the name), ``--sim-weight W`` for a number (a SIM
    weight of one's own, as a sweep over weights needs; both take that flag)."""
    try:
        w = float(weights)
    except ValueError:
        return [named, weights]
    if not (math.isfinite(w) and w >= 0):
        raise SettingsError([f"REWARD_WEIGHTS={weights}: expected a named weighting (the reward server's "
                             "--weights choices) or a SIM weight, a finite number >= 0"])
    return ["--sim-weight", weights]


def resolve_family(r: Resolved, name: str) -> None:
    """MODEL_FAMILY names a registered family (ttsrl.families, stdlib only); a sampling rule in
    EVAL_ARGS must be one of that family's."""
    from ttsrl.families import FAMILIES

    if name not in FAMILIES:
        raise SettingsError([f"MODEL_FAMILY={name}: expected one of {', '.join(FAMILIES)}"])
    fam = FAMILIES[name]
    rules = [rule for rule, _ in fam.rules]
    args = r.lists.get("EVAL_ARGS", [])
    for i, word in enumerate(args):
        rule = word.split("=", 1)[1] if word.startswith("--sampling-rule=") else (
            args[i + 1] if word == "--sampling-rule" and i + 1 < len(args) else None)
        if rule is not None and rule not in rules:
            raise SettingsError([f"EVAL_ARGS samples with --sampling-rule {rule}, a rule of another family than "
                                 f"MODEL_FAMILY={name}: use {fam.default_rule}"])


def _ipv4(name: str) -> str | None:
    try:
        return socket.getaddrinfo(name, None, socket.AF_INET)[0][4][0]
    except (OSError, IndexError):
        return None


def slurm_nodes(env: Mapping[str, str]) -> str:
    nodelist = env.get("SLURM_JOB_NODELIST", "")
    if not nodelist:
        return ""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return ",".join(out.stdout.split())


def resolve_nodes(r: Resolved, env: Mapping[str, str]) -> None:
    """NODE_IPS (host names resolved), NNODES, HEAD_IP, NODE_IP, GPUS_PER_NODE and Ray's settings,
    with their checks."""
    v, problems = r.values, []
    v["NODE_IPS"] = env["NODE_IPS"] if "NODE_IPS" in env else slurm_nodes(env)
    ips = []
    for name in (x.strip() for x in v["NODE_IPS"].split(",")):
        if not name:
            continue
        ip = name if re.fullmatch(r"[0-9.]+", name) else _ipv4(name)
        if ip is None:
            problems.append(f"NODE_IPS: cannot resolve host name '{name}' to an IPv4 address")
            continue
        ips.append(ip)
    v["NODE_IPS_RESOLVED"] = ",".join(ips)  # the IPs, host names resolved: what ttsrl.launch.roles reads
    nnodes = max(1, len(ips))
    rank = env.get("NODE_RANK") or env.get("SLURM_NODEID") or "0"
    v["NODE_RANK"], v["NNODES"] = rank, str(nnodes)
    if not ASCII_INT.fullmatch(rank) or int(rank) >= nnodes:
        problems.append(f"NODE_RANK={rank}: expected 0..{nnodes - 1} (NODE_IPS={v['NODE_IPS']} lists {nnodes} nodes, "
                        "head first)" if ips else
                        f"NODE_RANK={rank}: expected 0 (NODE_IPS is empty: one node; set NODE_IPS=HEAD_IP,IP2,... for "
                        "several)")
    v["HEAD_IP"] = ips[0] if ips else "127.0.0.1"
    v["NODE_IP"] = ips[int(rank)] if ips and not problems else v["HEAD_IP"]
    get = lambda name, default: v.__setitem__(name, env.get(name) or default)  # noqa: E731
    get("RAY_PORT", "6379")
    get("RAY_NODE_PORT", str(int(v["RAY_PORT"]) + 1) if ASCII_INT.fullmatch(v["RAY_PORT"]) else "")
    for name, default in (("RAY_WORKER_PORTS", "10002-19999"), ("RAY_TEMP_DIR", ""), ("RAY_NUM_CPUS", "16"),
                          ("JOIN_TIMEOUT_S", "600"), ("HEAD_WAIT_S", "0"), ("RAY_START_ATTEMPTS", "3"),
                          ("SHARE_WAIT_S", "7200")):
        get(name, default)
    if not env.get("GPUS_PER_NODE"):
        v["GPUS_PER_NODE"] = "1" if v["DEVICE"] == "cpu" else str(_count_gpus())  # cpu: one logical GPU, one rank
    else:
        v["GPUS_PER_NODE"] = env["GPUS_PER_NODE"]
    if nnodes > 1:
        for name in ("EXP_DIR", "HF_MODEL_DIR", "DATA_DIR", "CKPT_DIR", "MERGED_DIR", "EVAL_DIR"):
            if not v[name].startswith("/"):
                problems.append(f"{name}={v[name]}: a multi-node run needs an absolute path on a filesystem every "
                                "node mounts (the same path on each)")
                if name == "EXP_DIR":  # its folders: said once
                    break
        if v["TRAINER"] != "grpo":
            problems.append(f"TRAINER={v['TRAINER']} runs on one node; NODE_IPS lists {nnodes} (multi-node is GRPO's)")
        if not re.fullmatch(r"[0-9]+-[0-9]+", v["RAY_WORKER_PORTS"]):
            problems.append(f"RAY_WORKER_PORTS={v['RAY_WORKER_PORTS']}: expected LOW-HIGH")
        if not re.fullmatch(r"[1-9][0-9]*", v["GPUS_PER_NODE"]):
            problems.append(f"GPUS_PER_NODE={v['GPUS_PER_NODE']}: expected a count >= 1 (DEVICE={v['DEVICE']})")
    if problems:
        raise SettingsError([f"run.sh: {p}" for p in problems])


def _count_gpus() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU") for line in out.splitlines())


def _flag_values(words_: list[str], flag: str) -> list[str]:
    """Every value of ``flag`` in an argument list (``--flag V`` and ``--flag=V``)."""
    out = []
    for i, w in enumerate(words_):
        if w == flag and i + 1 < len(words_):
            out.append(words_[i + 1])
        elif w.startswith(flag + "="):
            out.append(w.split("=", 1)[1])
    return out


def resolve_pool(r: Resolved) -> None:
    """PROMPT_POOL (zero-shot rows; empty: text-only): stage 0 gives every row a prompt of it, and
    the reward server voices each rollout with the row's prompt from the same folder, so the
    folder reaches the server as its ``--prompt-dir`` (added to REWARD_ARGS; a preset's
    ``--prompt-dir`` must name the same folder). A run that starts at stage 0, 1 or 2 needs the
    folder and its prompt_speech_tokens.jsonl to exist (stage -1 may build the embedded world's)."""
    v = r.values
    pool = v["PROMPT_POOL"]
    if not re.fullmatch(r"-?[0-9]+", v["PROMPT_SEED"]):
        raise SettingsError([f"PROMPT_SEED={v['PROMPT_SEED']}: expected an integer (the prompt assignment's seed)"])
    if not pool:
        return
    given = _flag_values(r.lists["REWARD_ARGS"], "--prompt-dir")
    other = [d for d in given if os.path.normpath(d) != os.path.normpath(pool)]
    if other:
        raise SettingsError([f"PROMPT_POOL={pool} but REWARD_ARGS voice from --prompt-dir {other[0]}: the server must "
                             "voice every rollout with its row's prompt, so both name one folder (a preset's --prompt-dir "
                             "must be the pool when PROMPT_POOL is set, as presets/gpu8.sh does)"])
    if not given:
        r.lists["REWARD_ARGS"] += ["--prompt-dir", pool]
    if 0 <= r.start <= 2:
        if not os.path.isdir(pool):
            raise SettingsError([f"PROMPT_POOL={pool}: no such folder (a prompt pool: prompt_speech_tokens.jsonl made "
                                 "by scripts/prompt_tokens.py, and the wavs it names; docs/gpu.md)"])
        if not os.path.isfile(os.path.join(pool, "prompt_speech_tokens.jsonl")):
            raise SettingsError([f"PROMPT_POOL={pool}: no prompt_speech_tokens.jsonl in it (make it with "
                                 "scripts/prompt_tokens.py; docs/gpu.md)"])


def resolve_reward(r: Resolved, env: Mapping[str, str]) -> None:
    """REWARD_URL (this machine's server), REWARD_URLS (every server the clients use) and the
    reward server's arguments (``--host`` on several nodes)."""
    v = r.values
    port = v["REWARD_PORT"]
    v["REWARD_URL"] = f"http://{v['NODE_IP']}:{port}" if r.multi_node else f"http://127.0.0.1:{port}"
    if r.multi_node:  # other nodes reach it at this node's address
        r.lists["REWARD_ARGS"] += ["--host", v["NODE_IP"]]
    v["REWARD_URLS"] = env.get("REWARD_URLS") or v["REWARD_URL"]
    from ttsrl.reward.protocol import split_urls  # standard library only, as this module (host python3)

    try:  # the one rule the clients apply, here before any stage (it raised in the launcher mid-run)
        split_urls(v["REWARD_URLS"])
    except ValueError as e:
        raise SettingsError([f"REWARD_URLS={v['REWARD_URLS']!r}: {e}"]) from None
    v["REWARD_MIN_READY"] = env.get("REWARD_MIN_READY", "")
    v["TTSRL_REWARD_URL"] = v["REWARD_URLS"]  # the reward client's default list (mining, reward_tts.py by hand)


def resolve_paths(r: Resolved) -> None:
    """Logs, pid, lock and marker paths (each node its own on several nodes)."""
    v = r.values
    v["NODES_DIR"] = f"{v['EXP_DIR']}/nodes"
    if r.multi_node:
        rank = v["NODE_RANK"]
        v["LOG_DIR"] = f"{v['EXP_DIR']}/logs/node{rank}"
        v["SERVER_PID_FILE"] = f"{v['NODES_DIR']}/reward_server.{rank}.pid"
        v["LOCK_FILE"] = f"{v['NODES_DIR']}/run.{rank}.lock"
        v["RAY_AUTH_MODE"] = "token"  # as `ray start --head` sets it up; the driver and the launcher need it too
    else:
        v["LOG_DIR"] = f"{v['EXP_DIR']}/logs"
        v["SERVER_PID_FILE"] = f"{v['EXP_DIR']}/reward_server.pid"
        v["LOCK_FILE"] = f"{v['EXP_DIR']}/run.lock"


def grpo_args(r: Resolved) -> list[str]:
    """``train_grpo.py``'s arguments: the preset's GRPO_ARGS, the named variants, the run's paths,
    the reward it asks for (GRPO_EXTRA's words follow, so they win)."""
    v = r.values
    out = list(r.lists["GRPO_ARGS"])
    out += ["--algorithm", v["ALGORITHM"]]
    out += ["--sampling", v["SAMPLING"]] if v["SAMPLING"] else []
    out += ["--seed", v["SEED"]] if v["SEED"] else []
    out += ["--model-path", v["HF_MODEL_DIR"], "--train-files", f"{v['DATA_DIR']}/train.parquet",
            "--val-files", f"{v['DATA_DIR']}/test.parquet", "--checkpoint-dir", v["CKPT_DIR"],
            "--max-prompt-length", v["MAX_PROMPT_LENGTH"],
            "--reward", v["REWARD"],
            *weight_args(v["REWARD_WEIGHTS"], named="--reward-weights"),
            "--reward-backend", v["REWARD_BACKEND"], "--reward-urls", v["REWARD_URLS"]]
    if r.multi_node:
        out += ["--nnodes", v["NNODES"], "--n-gpus-per-node", v["GPUS_PER_NODE"]]
    return out


# ---------------------------------------------------------------------------- output


def shell(r: Resolved) -> str:
    """Bash that sets every setting (exported) and list, for run.sh to evaluate."""
    lines = [f"export {name}={shlex.quote(value)}" for name, value in r.values.items()]
    lines += [f"{name}=({' '.join(shlex.quote(w) for w in words_)})" for name, words_ in r.lists.items()]
    lines += [f"START={r.start}", f"STOP={r.stop}"]
    return "\n".join(lines) + "\n"


def config_lines(r: Resolved, grpo: Mapping[str, object] | None = None) -> list[str]:
    """``--config``: every setting, one a line as the shell reads it back, then GRPO's fields."""
    out = [f"{name}={shlex.quote(value)}" for name, value in r.values.items()]
    out += [f"{name}=({' '.join(shlex.quote(w) for w in ws)})" for name, ws in r.lists.items()]
    out += [f"GRPO.{name}={shlex.quote(str(value))}" for name, value in (grpo or {}).items()]
    return out
