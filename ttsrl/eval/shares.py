"""Stage 4 over several nodes: each node scores its share of the models, the head
node waits for the others' markers, scores whatever is still unscored and writes the report.

Every node runs its own ``torchrun --standalone`` over the same arguments and the same
``--out-dir`` (a shared filesystem) with ``--node-share R/N``. The share of node R is
index ``i`` of the SORTED model steps with ``i % N == R`` (``share_steps``): every node
computes it alike from the arguments, never from what is on disk, so the shares are
disjoint and no two nodes write the same files (a model's folder belongs to one share).

When its share is done (scored now, or already scored with the same settings), a node
writes the marker ``OUT/shares/R-of-N.json`` (atomically): the steps of its share with
their model fingerprints, the test sets' fingerprints, the settings and schema, which
steps it scored and which it found cached, host name and times.

The head (``--node-share 0/N --wait-shares SECONDS``) then waits until every other
share's marker exists AND matches what that share must cover now (same steps, model
and test-set fingerprints, settings, schema): a marker left by an earlier run with other
checkpoints or settings is stale and does not count (under ``--force``, also one finished
well before the head started). On timeout it names the missing shares and goes on; its
final pass scores every model not scored yet (the fingerprint cache decides), so the
report is right either way. Only then may two nodes write the same files: a node still
scoring after the head gave up on it (each file is still written whole, atomically).
While the head waits, its other torchrun ranks wait in a gloo collective (6 h timeout,
``ttsrl.eval.dist``): ``--wait-shares`` is at most 5 h.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from ttsrl.atomic import atomic_write_text
from ttsrl.eval.dist import COLLECTIVE_TIMEOUT_S, shard

SHARES_DIR = "shares"
MARKER_FORMAT = 1
# --force: a marker counts only when finished after the head started, less this slack (a
# node may start, and finish a small share, a little before the head; clocks differ a little)
FORCE_SLACK_S = 600.0
MAX_WAIT_S = COLLECTIVE_TIMEOUT_S - 3600  # the head's other ranks wait for it in one collective


@dataclass(frozen=True)
class NodeShare:
    """Node ``rank`` of ``nodes`` (``--node-share R/N``)."""

    rank: int
    nodes: int

    def __post_init__(self):
        if self.nodes < 1 or not 0 <= self.rank < self.nodes:
            raise ValueError(f"node share {self.rank}/{self.nodes}: expected R/N with N >= 1 and 0 <= R < N")

    @classmethod
    def parse(cls, text: str) -> "NodeShare":
        parts = text.strip().split("/")
        try:
            if len(parts) != 2:
                raise ValueError
            rank, nodes = int(parts[0]), int(parts[1])
        except ValueError:
            raise ValueError(f"--node-share {text!r}: expected R/N (this node's rank R of N nodes, "
                             f"e.g. 0/2)") from None
        return cls(rank, nodes)

    def __str__(self) -> str:
        return f"{self.rank}/{self.nodes}"


def share_steps(steps: Sequence[int], rank: int, nodes: int) -> list[int]:
    """The steps of share ``rank``: index i of the sorted steps with i % nodes == rank."""
    return shard(sorted(steps), rank, nodes)


def marker_path(out_dir: str | Path, share: NodeShare) -> Path:
    return Path(out_dir) / SHARES_DIR / f"{share.rank}-of-{share.nodes}.json"


def _plain(obj):
    """As it reads back from JSON (tuples become lists, int keys strings)."""
    return json.loads(json.dumps(obj, sort_keys=True))


def coverage(share: NodeShare, model_fps: Mapping[int, str], test_set_fps: Mapping[str, str], settings: dict,
             schema: int) -> dict:
    """What share ``share`` must cover now: its steps with their model fingerprints, the
    test sets' fingerprints, the settings and the schema (``model_fps`` holds every model)."""
    steps = share_steps(list(model_fps), share.rank, share.nodes)
    return _plain({"share": share.rank, "nodes": share.nodes, "steps": steps,
                   "model_fingerprints": {str(s): model_fps[s] for s in steps},
                   "test_set_fingerprints": dict(test_set_fps), "settings": settings, "schema": schema})


def write_marker(out_dir: str | Path, share: NodeShare, covers: dict, *, scored: Sequence[int],
                 cached: Sequence[int], started: float) -> Path:
    """The marker of a finished share (atomic): ``covers`` (from ``coverage``), the steps
    scored by this run and those found already scored, host, pid and times."""
    path = marker_path(out_dir, share)
    marker = {"format": MARKER_FORMAT, **covers, "scored": sorted(scored), "cached": sorted(cached),
              "host": socket.gethostname(), "pid": os.getpid(), "started": started, "finished": time.time(),
              "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    atomic_write_text(path, json.dumps(marker, ensure_ascii=False, indent=2) + "\n")
    return path


def remove_marker(out_dir: str | Path, share: NodeShare) -> None:
    """A node starting its share removes its old marker: until it is done, it has none."""
    marker_path(out_dir, share).unlink(missing_ok=True)


def check_marker(out_dir: str | Path, share: NodeShare, covers: dict, *, not_before: float | None = None) -> str | None:
    """None when share ``share``'s marker exists and covers ``covers``; else why not
    (missing, unreadable, or stale: which field differs). ``not_before``: also refuse a
    marker finished before that time (``--force``: cached results do not count)."""
    path = marker_path(out_dir, share)
    try:
        marker = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return "no marker yet"
    except (OSError, json.JSONDecodeError) as e:
        return f"unreadable marker {path} ({e})"
    if not isinstance(marker, dict):
        return f"unreadable marker {path} (not a JSON object)"
    for key, want in covers.items():
        if marker.get(key) != want:
            if key == "model_fingerprints" and isinstance(marker.get(key), dict):
                diff = sorted(s for s in set(want) | set(marker[key]) if marker[key].get(s) != want.get(s))
                return f"stale marker: model fingerprints of step(s) {', '.join(diff)} differ"
            return f"stale marker: its {key} differ from this run's"
    if not_before is not None and float(marker.get("finished", 0)) < not_before:
        return "stale marker: written before this run started (--force)"
    return None


def wait_for_shares(out_dir: str | Path, wanted: Mapping[int, dict], nodes: int, timeout: float,
                    log: Callable[[str], None], *, not_before: float | None = None, poll: float = 2.0,
                    every: float = 30.0) -> dict[int, str]:
    """Wait up to ``timeout`` seconds until every share in ``wanted`` (rank -> its
    ``coverage``) has a marker that covers it; print one line naming the missing shares
    every ``every`` seconds. Returns the shares still missing (rank -> why)."""
    t0 = time.monotonic()
    last = t0

    def missing() -> dict[int, str]:
        out = {}
        for rank, covers in sorted(wanted.items()):
            why = check_marker(out_dir, NodeShare(rank, nodes), covers, not_before=not_before)
            if why is not None:
                out[rank] = why
        return out

    def named(miss: dict[int, str]) -> str:
        return "; ".join(f"share {r}/{nodes} (steps {', '.join(map(str, wanted[r]['steps'])) or 'none'}): {why}"
                         for r, why in miss.items())

    miss = missing()
    while miss:
        now = time.monotonic()
        if now - t0 >= timeout:
            log(f"waited {now - t0:.0f}s for the other nodes; still missing {named(miss)}. "
                f"Scoring their unscored models on this node")
            return miss
        if now - last >= every:
            log(f"waiting for {named(miss)} ({now - t0:.0f}s of {timeout:.0f}s)")
            last = now
        time.sleep(max(0.05, min(poll, timeout - (now - t0))))
        miss = missing()
    if wanted:
        log(f"every share is done ({', '.join(f'{r}/{nodes}' for r in sorted(wanted))}; "
            f"waited {time.monotonic() - t0:.0f}s)")
    return miss


def start_share(out_dir: str | Path, share: NodeShare, steps: Sequence[int], main: bool,
                log: Callable[[str], None]) -> list[int]:
    """The steps of this node's share (logged); its rank 0 (``main``) removes the share's
    marker of an earlier run: until this share is done, it has none."""
    mine = share_steps(steps, share.rank, share.nodes)
    log(f"node share {share}: step(s) {', '.join(map(str, mine)) or 'none'} of {', '.join(map(str, sorted(steps)))}")
    if main:
        remove_marker(out_dir, share)
    return mine


def finish_share(out_dir: str | Path, share: NodeShare, model_fps: Mapping[int, str], test_set_fps: Mapping[str, str],
                 settings: dict, schema: int, *, scored: Sequence[int], started: float, wait: float | None,
                 force: bool, log: Callable[[str], None]) -> dict[int, str]:
    """After a node's share (its rank 0): write its marker; on the head (``wait`` not
    None) wait for the other shares. Returns the shares still missing (rank -> why)."""
    def covers(rank: int) -> dict:
        return coverage(NodeShare(rank, share.nodes), model_fps, test_set_fps, settings, schema)

    mine = covers(share.rank)
    path = write_marker(out_dir, share, mine, scored=scored, cached=[s for s in mine["steps"] if s not in scored],
                        started=started)
    log(f"node share {share} done ({len(scored)} scored, {len(mine['steps']) - len(scored)} already scored): {path}")
    if wait is None:
        log("no report on this node: the head node (--node-share 0/N --wait-shares) writes it")
        return {}
    return wait_for_shares(out_dir, {r: covers(r) for r in range(1, share.nodes)}, share.nodes, wait, log,
                           not_before=started - FORCE_SLACK_S if force else None)
