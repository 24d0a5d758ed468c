"""``python -m ttsrl.launch COMMAND``: what run.sh calls between its stages.

    help                              run.sh's --help
    settings --arrays FILE -- ARGV    the run's settings as bash for run.sh to evaluate (ARGV: run.sh's
                                      arguments; with --config, bash that prints them and exits)
    server up [--ours] -- CMD...      this machine's reward server started/adopted/used, every server of
                                      REWARD_URLS ready and serving the run's reward (ttsrl.launch.server)
    server down                       stop the server this run started or adopted
    grpo -- CMD...                    stage 2 on the head: CMD through the console filter (on several
                                      nodes inside the head's Ray cluster)
    join                              stage 2 on a worker: join the head's Ray until it stops
    mark MARKER | await MARKER WHAT   the head's progress markers, a worker's wait for them
    failed RC STAGE                   the head's run failed: workers waiting on a marker stop

Every command but ``help`` and ``settings`` reads the settings run.sh exported (its evaluated
``settings`` output); ``--ray-arg=X`` (repeated) passes RAY_START_ARGS.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import shlex
import sys
from pathlib import Path

from ttsrl.launch import settings


def _grpo_fields(r: settings.Resolved, environ) -> dict:
    """``train_grpo.py``'s resolved configuration for this run's GRPO_ARGS and overrides (raises
    SettingsError for arguments it refuses; ImportError where its packages are missing)."""
    if str(settings.ROOT) not in sys.path:
        sys.path.insert(0, str(settings.ROOT))
    import train_grpo

    argv = [*r.lists["GRPO_ARGS"], "--", *r.lists["EXTRA_OVERRIDES"]]
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            run = train_grpo.build(argv, {**environ, **r.values})
    except SystemExit:  # argparse's message: its last line says why
        why = said.getvalue().strip().splitlines()[-1:] or ["?"]
        raise settings.SettingsError([f"stage 2 (GRPO_ARGS, GRPO_EXTRA): {why[0]}"]) from None
    except ValueError as e:
        raise settings.SettingsError([f"stage 2: {e}"]) from None
    return {"preset": run.preset, **dataclasses.asdict(run.config)}


def cmd_settings(a) -> int:
    try:
        arrays = settings.read_arrays(Path(a.arrays).read_bytes()) if a.arrays else {}
        r = settings.resolve(os.environ, arrays, a.argv, frozenset((a.env_names or "").split()))
        grpo = {}
        if r.show_config or (r.stop >= 2 >= r.start and r.values["TRAINER"] == "grpo"):
            try:  # stage 2's own checks now, not after the stages before it
                grpo = _grpo_fields(r, os.environ)
            except ImportError as e:  # before stage -2: checked when stage 2 starts
                grpo = {"unresolved": f"train_grpo.py needs the venv ({e}): run stage -2 first"}
            except settings.SettingsError as e:
                if not r.show_config:  # --config shows what stage 2 would refuse, among the settings
                    raise
                grpo = {"unresolved": " ".join(e.lines)}
    except settings.SettingsError as e:
        for line in e.lines:
            print(line, file=sys.stderr)
        if e.usage:
            print(settings.USAGE, file=sys.stderr)
        return 2
    if r.show_config:
        print("printf '%s\\n' " + " ".join(shlex.quote(line) for line in settings.config_lines(r, grpo)) + "\nexit 0")
    else:
        print(settings.shell(r), end="")
    return 0


def _cluster(a):
    from ttsrl.launch import roles

    return roles.Cluster.from_env(os.environ, tuple(a.ray_arg or ()))


def server_identity(command: list[str]) -> dict[str, str]:
    """What a server started with ``command`` (``PY token2wav_asr_server.py ARGS``) would publish
    as its identity, read with the server's own parser: reward, backend, model folder, SIM and MOS
    weights, length guard (each changes the reward a run trains on), the family whose codes it
    accepts, and the digest of the prompt ids it knows (a server of another pool answers the run's rows 422)."""
    if str(settings.ROOT) not in sys.path:
        sys.path.insert(0, str(settings.ROOT))
    import token2wav_asr_server
    from ttsrl.data.prompt_pool import pool_sha1

    script = next(i for i, word in enumerate(command) if word.endswith("token2wav_asr_server.py"))
    cfg = token2wav_asr_server.parse_args(command[script + 1:])
    return {"reward": cfg.reward, "backend": cfg.backend.backend, "model_dir": cfg.backend.model_dir,
            "sim_weight": str(cfg.sim_weight), "mos_weight": str(cfg.mos_weight), "length_guard": str(cfg.length_guard),
            "family": cfg.family, "prompt_pool": pool_sha1(cfg.backend.served_prompt_ids())}


def cmd_server(a) -> int:
    from ttsrl.launch import server

    env = os.environ
    pid_file = Path(env["SERVER_PID_FILE"])
    if a.action == "down":
        server.down(pid_file)
        return 0
    expect = server_identity(a.command)
    expect.update(dict(kv.split("=", 1) for kv in a.expect or ()))
    return server.up(env["REWARD_URLS"], env["REWARD_URL"], pid_file, Path(env["LOG_DIR"]) / "reward_server.log",
                     float(env.get("REWARD_START_TIMEOUT_S", "300")), expect, env.get("REWARD_ANY_SERVER") == "1",
                     a.command, int(env["REWARD_MIN_READY"]) if env.get("REWARD_MIN_READY") else None, a.ours)


def cmd_grpo(a) -> int:
    from ttsrl.launch import train

    multi = int(os.environ.get("NNODES", "1")) > 1
    return train.grpo(a.command, Path(os.environ["LOG_DIR"]) / "train_grpo.log", _cluster(a) if multi else None)


def parse(p: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed, the words after its first ``--`` a subcommand's ``argv``/``command``, as they
    are. Split here, not by argparse: an ``argparse.REMAINDER`` positional took every word after the
    one before it, options included (``server up --ours -- CMD`` left ``--ours`` unset, inside CMD)."""
    if "--" not in argv:
        return p.parse_args(argv)
    cut = argv.index("--")
    a = p.parse_args(argv[:cut])
    for name in ("argv", "command"):
        if hasattr(a, name):
            setattr(a, name, argv[cut + 1:])
    return a


def build_parser() -> argparse.ArgumentParser:
    """The launcher's command line (run.sh's calls)."""
    p = argparse.ArgumentParser(prog="python -m ttsrl.launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ray-arg", action="append", help="one word of RAY_START_ARGS (repeated)")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("help", help="run.sh's --help")
    s = sub.add_parser("settings", help="the run's settings as bash")
    s.add_argument("--arrays", help="run.sh's arrays, NUL-separated (NAME COUNT ITEM...)")
    s.add_argument("--env-names", help="the variables of the environment before the preset, space-separated")
    s.add_argument("argv", nargs="*", help="run.sh's arguments, after --")
    sv = sub.add_parser("server", help="the reward servers: up or down")
    sv.add_argument("action", choices=("up", "down"))
    sv.add_argument("--ours", action="store_true", help="this run.sh started the local server in stage 1")
    sv.add_argument("--expect", action="append", metavar="FIELD=VALUE", help="more the servers must serve")
    sv.add_argument("command", nargs="*", help="the local server's command, after --")
    g = sub.add_parser("grpo", help="stage 2 on the head")
    g.add_argument("command", nargs="*", help="train_grpo.py's command, after --")
    sub.add_parser("join", help="stage 2 on a worker")
    m = sub.add_parser("mark", help="the head marks MARKER done for this run")
    m.add_argument("marker")
    w = sub.add_parser("await", help="a worker waits for the head's MARKER")
    w.add_argument("marker")
    w.add_argument("what")
    f = sub.add_parser("failed", help="the head's run failed")
    f.add_argument("rc", type=int)
    f.add_argument("stage")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parse(build_parser(), sys.argv[1:] if argv is None else list(argv))
    if a.cmd == "help":
        print(settings.HELP, end="")
        return 0
    if a.cmd == "settings":
        return cmd_settings(a)
    if a.cmd == "server":
        return cmd_server(a)
    if a.cmd == "grpo":
        return cmd_grpo(a)
    from ttsrl.launch import roles

    c = _cluster(a)
    if a.cmd == "join":
        return roles.worker_join(c)
    if a.cmd == "mark":
        roles.mark_head(c, a.marker)
        return 0
    if a.cmd == "await":
        return roles.await_head(c, a.marker, a.what, float(os.environ.get("HEAD_WAIT_S", "0")))
    roles.mark_failed(c, a.rc, a.stage)
    return 0


if __name__ == "__main__":
    sys.exit(main())
