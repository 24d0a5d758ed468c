"""The distributed helper of stage 4: torchrun ranks, sharding, gathering on rank 0.

Under ``torchrun`` every rank takes items ``rank::world`` (no padding: each
utterance is decoded exactly once), and rank 0 gathers the rows
(``gather_object`` over a gloo group). One process without torchrun is world 1.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

from ttsrl.cpus import usable_cores

COLLECTIVE_TIMEOUT_S = 6 * 3600  # how long a rank waits in one gloo collective for the others


def shard(items: Sequence, rank: int, world: int) -> list:
    """Items ``rank::world``: every item on exactly one rank, none repeated."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside 0..{world - 1}")
    return list(items[rank::world])


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def gather(self, obj) -> list | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere)."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world if self.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def broadcast(self, obj):
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def rank_threads(requested: int, local_world: int, cores: int | None = None) -> int:
    """torch CPU threads for one rank: ``requested`` when given (> 0), else the cores shared
    among the ranks on this machine (at least 1). On GPU ranks too: each still does CPU work
    (resampling, fbank, a CPU ASR, sampling bookkeeping), and torch's default of every core in
    every rank oversubscribes an 8-GPU node 8 times."""
    if requested > 0:
        return requested
    return max(1, (usable_cores() if cores is None else cores) // max(1, local_world))


def init_distributed() -> Dist:
    """Join torchrun's process group (gloo: only small Python objects travel between
    ranks, and gloo keeps that traffic off the GPU the generation engine owns)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    d = Dist(rank=int(os.environ.get("RANK", "0")), world=world,
             local_rank=int(os.environ.get("LOCAL_RANK", "0")),
             local_world=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))
    if world > 1:
        import datetime

        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return d


def pin_local_gpu(d: Dist) -> None:
    """Give each local rank its own GPU as cuda:0 (before CUDA is initialised), so
    both engines and vLLM's engine process use one GPU per rank."""
    if d.local_world <= 1:
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x for x in visible.split(",") if x.strip()] if visible else None
    if ids is not None and d.local_rank >= len(ids):
        return  # fewer GPUs than ranks: leave as is (CPU ranks)
    os.environ["CUDA_VISIBLE_DEVICES"] = ids[d.local_rank] if ids else str(d.local_rank)
