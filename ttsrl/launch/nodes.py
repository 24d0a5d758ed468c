"""The nodes of a multi-node run (run.sh's roles): who joined Ray, where actors run, markers.

    python -m ttsrl.launch.nodes probe HOST:PORT             exit 0 when a Ray GCS answers there
    python -m ttsrl.launch.nodes wait HOST:PORT --ips IP,IP --gpus N [--timeout S] [--pid PID]
    python -m ttsrl.launch.nodes actors HOST:PORT            JSON: actor class -> node ids it ran on
    python -m ttsrl.launch.nodes mark FILE TEXT              FILE holds TEXT (atomic write)
    python -m ttsrl.launch.nodes await FILE TEXT [--fail FILE2] [--timeout S]

``wait`` polls the cluster's node table until, for every IP of ``--ips`` (one entry per node:
run.sh's NODE_IPS, head first; an IP listed twice needs two nodes with that IP), an alive Ray
node with that address and at least ``N`` GPUs (logical ones on the CPU path) has joined. It
prints each node as it joins; when ``--timeout`` passes first it exits 1 naming the ranks and
IPs still missing (or joined with too few GPUs); with ``--pid``, exit 3 at once when that
process (the head's ``ray start``) exits. Ray's node and actor tables are read straight from the GCS
(``ray._raylet.GcsClient``, as ``ray status`` and the state API's aggregator read them), so no
driver job is started and no dashboard is needed.

``mark``/``await`` carry the head's progress to the other nodes through the shared EXP_DIR:
the head writes its run id into a marker (``mark``); a node waits until the marker holds the
run id it joined (``await``), so a marker left by an earlier run is never taken for this one's,
or until ``--fail`` holds it (the head's run failed: exit 1).
A cluster with token authentication (what ``ray start --head`` enables) needs
``RAY_AUTH_MODE=token`` and the cluster's token (``~/.ray/auth_token``) in this process too.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ttsrl.reward.health import alive

EXIT_HEAD_GONE = 3  # `wait --pid`: that process exited before every node joined


@dataclass(frozen=True)
class Node:
    node_id: str
    ip: str
    gpus: float
    cpus: float
    is_head: bool


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"Ray address {address!r}: expected HOST:PORT, e.g. 10.0.0.1:6379")
    return host, int(port)


def answers(address: str, timeout: float = 3.0) -> bool:
    """Does something accept TCP connections at ``address`` (HOST:PORT)? Fast, unlike a GCS
    client, which waits ~40 s for an address where nothing listens."""
    try:
        with socket.create_connection(split_address(address), timeout=timeout):
            return True
    except OSError:
        return False


def gcs_problem(address: str) -> str | None:
    """None when a Ray GCS answers at ``address``, else why not (one line)."""
    if not answers(address):
        return f"no Ray cluster answers at {address}"
    try:
        alive_nodes(address)
    except Exception as e:
        return f"{address} answers, but not as a Ray GCS: {type(e).__name__}: {e}"
    return None


def alive_nodes(address: str, timeout: float = 10.0) -> list[Node]:
    """The alive nodes of the Ray cluster whose GCS is at ``address``."""
    from ray._raylet import GcsClient
    from ray.core.generated import gcs_pb2

    client = GcsClient(address=address)
    out = []
    for node_id, info in client.get_all_node_info(timeout=timeout).items():
        if info.state != gcs_pb2.GcsNodeInfo.GcsNodeState.ALIVE:
            continue
        res = dict(info.resources_total)
        out.append(Node(node_id.hex(), info.node_manager_address, res.get("GPU", 0.0), res.get("CPU", 0.0),
                        info.is_head_node))
    return sorted(out, key=lambda n: (not n.is_head, n.ip, n.node_id))


def missing(ips: list[str], nodes: list[Node], gpus: float) -> list[str]:
    """One line per expected node (rank r has IP ``ips[r]``) that no alive node with enough GPUs
    accounts for; nodes with an IP are matched to that IP's ranks in order."""
    pool = {ip: [n for n in nodes if n.ip == ip] for ip in set(ips)}
    out = []
    for rank, ip in enumerate(ips):
        here = pool[ip]
        if not here:
            out.append(f"rank {rank} ({ip}): no Ray node with this address has joined")
            continue
        node = here.pop(0)
        if node.gpus < gpus:
            out.append(f"rank {rank} ({ip}): node {node.node_id[:12]} joined with {node.gpus:g} GPUs, "
                       f"expected {gpus:g}")
    return out


def actor_nodes(address: str) -> dict[str, list[str]]:
    """Actor class name -> the node ids (hex) its actors were placed on, dead actors included
    (the GCS actor table, which Ray's state API lists), read as ``ray.init`` reads Ray's global
    state, without starting a driver. (``GcsClient.async_get_all_actor_info`` was tried first:
    it timed out on a live cluster more often than not.)"""
    from ray._private.state import GlobalState
    from ray._raylet import GcsClientOptions

    state = GlobalState()
    state._initialize_global_state(GcsClientOptions.create(address, None, allow_cluster_id_nil=True,
                                                           fetch_cluster_id_if_nil=False))
    try:
        table = state.actor_table(None)
    finally:
        state.disconnect()
    return placed_nodes(table.values())


def placed_nodes(actors) -> dict[str, list[str]]:
    """Actor class name -> node ids, from actor-table entries; an actor not yet placed (pending
    creation) carries a nil node id and is left out: Ray's ``NodeID.nil()`` is all f's (seen in
    CI), all zeros the protobuf default."""
    out: dict[str, set[str]] = {}
    for info in actors:
        node = (info.get("Address") or {}).get("NodeID") or ""
        if node.strip("0") and node.strip("f"):
            out.setdefault(info["ActorClassName"], set()).add(node)
    return {k: sorted(v) for k, v in sorted(out.items())}


def wait(address: str, ips: list[str], gpus: float, timeout: float, poll: float = 2.0,
         log=print, pid: int | None = None) -> list[Node]:
    """Poll until every rank of ``ips`` has its node (see :func:`missing`); the nodes, or
    TimeoutError naming the missing ranks (RuntimeError at once if process ``pid`` exits)."""
    deadline = time.monotonic() + timeout
    seen: set[str] = set()
    while True:
        if pid is not None and not alive(pid):
            raise RuntimeError(f"the Ray head (process {pid}) exited before every node joined")
        nodes, error = [], ""
        if not answers(address):
            error = f"nothing answers at {address} yet"
        else:
            try:
                nodes = alive_nodes(address)
            except Exception as e:  # the head's GCS starting, or an auth problem: said at the end
                error = f"{type(e).__name__}: {e}"
        for n in nodes:
            if n.node_id not in seen:
                seen.add(n.node_id)
                log(f"     node joined: {n.ip} (id {n.node_id[:12]}, {n.gpus:g} GPUs, {n.cpus:g} CPUs"
                    f"{', head' if n.is_head else ''})")
        gaps = missing(ips, nodes, gpus)
        if not gaps and not error:
            return nodes
        if time.monotonic() >= deadline:
            lines = gaps if not error else [f"the node table could not be read: {error}"]
            raise TimeoutError(f"after {timeout:g} s, {len(ips)} nodes with {gpus:g} GPUs each were expected "
                               f"in the Ray cluster at {address}; missing:\n  " + "\n  ".join(lines)
                               + "\n(is `bash run.sh` running there with its NODE_RANK, and can that node "
                                 f"reach {address}? see its stage 2 log)")
        time.sleep(poll)


def mark(path: Path, text: str) -> None:
    from ttsrl.atomic import atomic_write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, text + "\n")


def _holds(path: Path, text: str) -> bool:
    try:
        return path.read_text().strip() == text
    except OSError:
        return False


def await_marker(path: Path, text: str, fail: Path | None = None, timeout: float = 0.0, poll: float = 2.0,
                 log=print, every: float = 300.0) -> None:
    """Return once ``path`` holds ``text``; RuntimeError when ``fail`` holds it first (the message
    is the rest of ``fail``'s lines), TimeoutError after ``timeout`` seconds (0: no limit)."""
    start = time.monotonic()
    said = start
    while not _holds(path, text):
        if fail is not None and fail.is_file():
            lines = fail.read_text().splitlines()
            if lines and lines[0].strip() == text:
                raise RuntimeError(f"the head's run {text} failed: " + (" ".join(lines[1:]) or "(no message)"))
        waited = time.monotonic() - start
        if timeout and waited >= timeout:
            raise TimeoutError(f"after {timeout:g} s, {path} does not hold this run's id {text}")
        if time.monotonic() - said >= every:
            said = time.monotonic()
            log(f"     still waiting for {path} ({waited / 60:.0f} min)")
        time.sleep(poll)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    probe = sub.add_parser("probe", help="exit 0 when a Ray GCS answers at HOST:PORT")
    probe.add_argument("address")
    w = sub.add_parser("wait", help="wait until every node of --ips has joined with --gpus GPUs")
    w.add_argument("address")
    w.add_argument("--ips", required=True, help="comma-separated node IPs, one per rank, head first")
    w.add_argument("--gpus", type=float, required=True, help="GPUs each node must bring (logical on CPU)")
    w.add_argument("--timeout", type=float, default=600.0, help="seconds (default %(default)s)")
    w.add_argument("--pid", type=int, help="stop waiting when this process (the head's ray start) exits")
    a = sub.add_parser("actors", help="JSON: actor class -> the node ids its actors ran on")
    a.add_argument("address")
    m = sub.add_parser("mark", help="write TEXT into FILE (atomic)")
    m.add_argument("file", type=Path)
    m.add_argument("text")
    aw = sub.add_parser("await", help="wait until FILE holds TEXT; exit 1 when --fail holds it first")
    aw.add_argument("file", type=Path)
    aw.add_argument("text")
    aw.add_argument("--fail", type=Path, help="a marker whose first line is TEXT when the head's run failed")
    aw.add_argument("--timeout", type=float, default=0.0, help="seconds (default 0: no limit)")
    args = p.parse_args(argv)
    if args.cmd == "mark":
        mark(args.file, args.text)
        return 0
    if args.cmd == "await":
        try:
            await_marker(args.file, args.text, args.fail, args.timeout)
        except (RuntimeError, TimeoutError) as e:
            print(str(e), file=sys.stderr)
            return 1
        return 0
    try:
        split_address(args.address)
    except ValueError as e:
        p.error(str(e))
    if args.cmd == "actors":
        print(json.dumps(actor_nodes(args.address), indent=1))
        return 0
    if args.cmd == "probe":
        problem = gcs_problem(args.address)
        if problem:
            print(problem, file=sys.stderr)
        return 1 if problem else 0
    ips = [x.strip() for x in args.ips.split(",") if x.strip()]
    if not ips:
        p.error("--ips: expected at least one IP")
    try:
        nodes = wait(args.address, ips, args.gpus, args.timeout, pid=args.pid)
    except TimeoutError as e:
        print(str(e), file=sys.stderr)
        return 1
    except RuntimeError as e:  # the head's ray start exited: run.sh may start it again
        print(str(e), file=sys.stderr)
        return EXIT_HEAD_GONE
    print(f"     all {len(ips)} nodes joined ({sum(n.gpus for n in nodes):g} GPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
