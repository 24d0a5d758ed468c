"""The roles of a multi-node run: each node's ``ray start``, the head's training, a worker's wait.

The same ``bash run.sh START STOP`` runs on every node; ``NODE_RANK`` says which it is.

* head (rank 0): stages -1 and 0; stage 2 (:func:`head_train`) writes a new run id, starts Ray
  (unless ``RAY_ADDRESS`` answers: that cluster is used), waits until every node joined with its
  GPUs, trains, marks the run trained (or failed) and stops its Ray; stage 3 merges, then marks
  ``EXP_DIR/nodes/merged``; stage 5.
* worker (rank > 0): stage 2 (:func:`worker_join`) joins the head's Ray and blocks until it stops;
  stage 3 waits for the head's marker of the run it joined (:func:`await_head`).
* every node: stage -2 (its own venv), stage 1 (its reward server when ``REWARD_URLS`` lists it),
  stage 4 (its share of the checkpoints).

Progress crosses nodes through markers in the shared ``EXP_DIR/nodes/`` that hold the run id the
head writes before it starts Ray (``ttsrl.launch.nodes`` mark/await): a worker that joined this
run's Ray never takes an earlier run's marker for this one's. Settings come from the environment
run.sh exported (``ttsrl.launch.settings``), read by :meth:`Cluster.from_env`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ttsrl.launch import nodes


@dataclass
class Cluster:
    """One node's view of the cluster (run.sh's resolved settings)."""

    ips: list[str]
    rank: int
    ray_port: int
    ray_node_port: int
    worker_ports: tuple[int, int]
    gpus_per_node: int
    device: str = "cpu"
    num_cpus: str = "16"
    temp_dir: str = ""
    join_timeout: float = 600.0
    attempts: int = 3
    nodes_dir: Path = Path("exp/nodes")
    log_dir: Path = Path("exp/logs")
    ray_start_args: tuple[str, ...] = ()
    ray_address: str = ""  # RAY_ADDRESS: a cluster to use instead of starting one

    @classmethod
    def from_env(cls, env: Mapping[str, str], ray_start_args: tuple[str, ...] = ()) -> "Cluster":
        ips = [x for x in env.get("NODE_IPS_RESOLVED", "").split(",") if x] or ["127.0.0.1"]
        lo, _, hi = env.get("RAY_WORKER_PORTS", "10002-19999").partition("-")
        return cls(ips=ips, rank=int(env.get("NODE_RANK", "0")), ray_port=int(env.get("RAY_PORT", "6379")),
                   ray_node_port=int(env.get("RAY_NODE_PORT") or int(env.get("RAY_PORT", "6379")) + 1),
                   worker_ports=(int(lo), int(hi)), gpus_per_node=int(env.get("GPUS_PER_NODE", "1")),
                   device=env.get("DEVICE", "cpu"), num_cpus=env.get("RAY_NUM_CPUS", "16"),
                   temp_dir=env.get("RAY_TEMP_DIR", ""), join_timeout=float(env.get("JOIN_TIMEOUT_S", "600")),
                   attempts=int(env.get("RAY_START_ATTEMPTS", "3")),
                   nodes_dir=Path(env.get("NODES_DIR", "exp/nodes")), log_dir=Path(env.get("LOG_DIR", "exp/logs")),
                   ray_start_args=tuple(ray_start_args), ray_address=env.get("RAY_ADDRESS", ""))

    @property
    def head_ip(self) -> str:
        return self.ips[0]

    @property
    def node_ip(self) -> str:
        return self.ips[self.rank]

    @property
    def head_address(self) -> str:
        return f"{self.head_ip}:{self.ray_port}"

    @property
    def is_head(self) -> bool:
        return self.rank == 0


def same_host(a: str, b: str) -> bool:
    return a == b or (a.startswith("127.") and b.startswith("127."))


def ray_node_args(c: Cluster) -> list[str]:
    """This node's ``ray start`` arguments. Ranks on one host (the same IP, or loopback addresses)
    each take their own ports: 10 fixed ones from ``ray_node_port`` on, and an equal slice of the
    worker port range."""
    here = [r for r in range(len(c.ips)) if same_host(c.ips[r], c.node_ip)]
    slot = here.index(c.rank)
    base = c.ray_node_port + 10 * slot
    lo, hi = c.worker_ports
    width = (hi - lo + 1) // len(here)
    out = ["--block", "--node-ip-address", c.node_ip, "--disable-usage-stats",
           "--node-manager-port", str(base), "--object-manager-port", str(base + 1),
           "--dashboard-agent-listen-port", str(base + 2), "--dashboard-agent-grpc-port", str(base + 3),
           "--metrics-export-port", str(base + 4), "--runtime-env-agent-port", str(base + 5),
           "--min-worker-port", str(lo + slot * width), "--max-worker-port", str(lo + (slot + 1) * width - 1)]
    if c.device == "cpu":
        out += ["--num-cpus", c.num_cpus, "--num-gpus", str(c.gpus_per_node)]
    # ranks on one host each keep their own session folder: a node's log monitor forwards every
    # worker log file of its folder, so a shared one sends each line twice, and Ray's driver then
    # merges lines that differ only in numbers (seen: verl's step 2 metrics line lost, step 6 twice)
    if len(here) > 1:
        out += ["--temp-dir", f"{c.temp_dir or '/tmp/ray'}/node{slot}"]
    elif c.temp_dir:
        out += ["--temp-dir", c.temp_dir]
    out += list(c.ray_start_args)
    if c.is_head:
        out += ["--head", "--port", str(c.ray_port), "--include-dashboard=false",
                "--ray-client-server-port", str(base + 6)]
    else:
        out += ["--address", c.head_address]
    return out


class RayNode:
    """This node's ``ray start --block`` in its own process group, stopped by pid (never
    ``ray stop``, which stops every Ray on the machine). Not with the CPU path's
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, which makes ``ray start --address`` abort; a worker's
    raylet gives up 30 s after the head's GCS is gone (its ``ray start`` then returns); a raylet
    waits up to 5 min for its dashboard agent, which a loaded machine starts slowly."""

    def __init__(self, c: Cluster):
        self.c, self.proc = c, None

    def start(self) -> None:
        args = ray_node_args(self.c)
        self.c.log_dir.mkdir(parents=True, exist_ok=True)
        print(f"     ray start {' '.join(args)}  (log {self.c.log_dir / 'ray.log'})", flush=True)
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
        env.update(RAY_gcs_rpc_server_reconnect_timeout_s="30",
                   RAY_agent_register_timeout_ms=os.environ.get("RAY_agent_register_timeout_ms", "300000"))
        ray = Path(sys.executable).parent / "ray"
        with open(self.c.log_dir / "ray.log", "ab") as log:
            self.proc = subprocess.Popen([str(ray), "start", *args], stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, start_new_session=True)

    def wait(self) -> int:
        return self.proc.wait() if self.proc else 0

    def stop(self) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            proc.terminate()  # ray start drains its node, then stops its processes
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of its process group is left
        except OSError:
            pass
        proc.wait()
        print(f"     Ray of this node stopped (pid {proc.pid})", flush=True)

    def log_tail(self, n: int = 8) -> str:
        try:
            return "\n".join((self.c.log_dir / "ray.log").read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def ray_address_answers(address: str) -> bool:
    """A Ray GCS answers at ``address`` (RAY_ADDRESS: that cluster is used)."""
    return bool(address) and nodes.gcs_problem(address) is None


def new_run_id() -> str:
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{socket.gethostname()}-{os.getpid()}"


def head_ray(c: Cluster) -> tuple[str, RayNode | None]:
    """A new run id (before Ray starts: a worker that joins reads this one), then Ray; returns the
    cluster's address once every node joined, and this node's Ray (None: RAY_ADDRESS's cluster).
    Raises RuntimeError with what went wrong."""
    c.nodes_dir.mkdir(parents=True, exist_ok=True)
    for marker in ("trained", "merged", "failed"):
        (c.nodes_dir / marker).unlink(missing_ok=True)
    nodes.mark(c.nodes_dir / "run_id", new_run_id())
    if ray_address_answers(c.ray_address):
        print(f"     using the Ray cluster at RAY_ADDRESS={c.ray_address} (not started here)", flush=True)
        try:
            nodes.wait(c.ray_address, c.ips, c.gpus_per_node, c.join_timeout)
        except TimeoutError as e:
            raise RuntimeError(str(e)) from None
        return c.ray_address, None
    if c.ray_address:
        print(f"     RAY_ADDRESS={c.ray_address} does not answer: starting a Ray head here", flush=True)
    for attempt in range(1, c.attempts + 1):
        ray = RayNode(c)
        ray.start()
        print(f"     waiting up to {c.join_timeout:g}s for {len(c.ips)} nodes ({','.join(c.ips)}) with "
              f"{c.gpus_per_node} GPUs each", flush=True)
        try:
            nodes.wait(c.head_address, c.ips, c.gpus_per_node, c.join_timeout, pid=ray.proc.pid)
            print(f"     all {len(c.ips)} nodes joined", flush=True)
            return c.head_address, ray
        except TimeoutError as e:
            tail = ray.log_tail()
            ray.stop()
            raise RuntimeError(f"{e}\nthe end of {c.log_dir / 'ray.log'}:\n{tail}") from None
        except RuntimeError as e:  # the head's ray start exited: Ray 2.60's raylet can give up on a loaded machine
            print(f"{e}\nthe end of {c.log_dir / 'ray.log'}:\n{ray.log_tail()}", file=sys.stderr, flush=True)
            ray.stop()
            if attempt == c.attempts:
                raise RuntimeError(f"the Ray head did not start in {c.attempts} attempts (RAY_START_ATTEMPTS)") from None
            print(f"     the Ray head did not start (attempt {attempt} of {c.attempts}): starting it again", flush=True)
    raise AssertionError("unreachable")


def run_id(c: Cluster) -> str:
    try:
        return (c.nodes_dir / "run_id").read_text().strip()
    except OSError:
        return ""


def mark_head(c: Cluster, marker: str) -> None:
    """The head says ``marker`` is done for this run (a run id of its own if it has none yet:
    the one workers read)."""
    rid = run_id(c)
    if not rid:
        rid = new_run_id()
        nodes.mark(c.nodes_dir / "run_id", rid)
    nodes.mark(c.nodes_dir / marker, rid)


def mark_failed(c: Cluster, rc: int, stage: str) -> None:
    """On the head's failure: workers waiting for a marker of this run stop with this message."""
    rid = run_id(c)
    if rid:
        nodes.mark(c.nodes_dir / "failed", f"{rid}\nthe head (rank 0) stopped with status {rc} in stage {stage}; "
                                           f"see its logs in {c.log_dir}")


def _holds_run(path: Path, rid: str) -> bool:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return False
    return bool(lines) and lines[0].strip() == rid


def worker_join(c: Cluster, poll: float = 5.0) -> int:
    """Join the head's Ray and block until it stops (stage 2 on a worker); 0 when the head's run
    trained, 1 with a message otherwise."""
    if ray_address_answers(c.ray_address):
        print(f"     this node is part of the Ray cluster at RAY_ADDRESS={c.ray_address} already: nothing to join",
              flush=True)
        return 0
    addr = c.head_address
    print(f"     waiting up to {c.join_timeout:g}s for the head's Ray at {addr}", flush=True)
    if not _wait_for(lambda: ray_address_answers(addr), c.join_timeout, poll):
        print(f"stage 2: no Ray head answered at {addr} within {c.join_timeout:g}s (is rank 0 running stage 2 on "
              f"{c.head_ip}, and can this node reach it?)", file=sys.stderr)
        return 1
    # the head wrote its run id before starting Ray: a node that does not see it does not share EXP_DIR
    if not _wait_for(lambda: (c.nodes_dir / "run_id").is_file(), 30, 2):
        print(f"stage 2: {c.nodes_dir / 'run_id'}, written by the head before it started Ray, is not visible here: "
              "EXP_DIR must be one folder every node mounts at the same path", file=sys.stderr)
        return 1
    rid = run_id(c)
    print(f"     joining run {rid}", flush=True)
    trained, failed = c.nodes_dir / "trained", c.nodes_dir / "failed"
    rc = 0
    for attempt in range(1, c.attempts + 1):
        ray = RayNode(c)
        ray.start()
        rc = ray.wait()
        ray.proc = None
        # the head marks its run trained (or failed) before it stops its Ray: without either, this
        # node's Ray stopped on its own (a start that failed on a loaded machine): once more
        if _holds_run(trained, rid) or _holds_run(failed, rid) or attempt == c.attempts:
            break
        print(f"     this node's Ray stopped (ray start returned {rc}; attempt {attempt} of {c.attempts}) while the "
              "head trains: joining again", flush=True)
        _wait_for(lambda: ray_address_answers(addr), c.join_timeout, poll)
    if _holds_run(trained, rid):
        print(f"     the head's Ray stopped after training (this node's ray start then returns, here with {rc})",
              flush=True)
        return 0
    try:
        nodes.await_marker(trained, rid, failed, timeout=60)
    except (RuntimeError, TimeoutError) as e:
        print(f"stage 2: this node's Ray stopped (ray start returned {rc}) and the head did not finish training "
              f"({e}); see {c.log_dir / 'ray.log'}", file=sys.stderr)
        return 1
    return 0


def await_head(c: Cluster, marker: str, what: str, timeout: float) -> int:
    """A worker waits until the head marks ``marker`` for the run it joined."""
    rid = run_id(c)
    if not rid:
        print(f"no {c.nodes_dir / 'run_id'}: the head has not started a run in this EXP_DIR", file=sys.stderr)
        return 1
    print(f"     waiting for the head: {what} (run {rid}, marker {c.nodes_dir / marker})", flush=True)
    try:
        nodes.await_marker(c.nodes_dir / marker, rid, c.nodes_dir / "failed", timeout)
    except (RuntimeError, TimeoutError) as e:
        print(str(e), file=sys.stderr)
        return 1
    return 0


def _wait_for(ok, timeout: float, poll: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if ok():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll)
