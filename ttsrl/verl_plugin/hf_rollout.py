"""A rollout backend named ``hf`` for verl 0.9.1: generation with transformers.

verl registers only vllm/sglang/trtllm rollouts, none of which runs on a plain CPU.
This module adds a fourth through verl's own registries:

* ``HFRolloutServer`` — a Ray actor holding a transformers model. It serves the
  token-in/token-out ``generate`` call verl's agent loop makes on every rollout
  server, batching concurrent requests that share sampling parameters into one
  ``model.generate`` call, and returns the log-probability of each sampled token
  (for verl's rollout-vs-actor metrics).
* ``HFReplica`` — the ``RolloutReplica`` that launches one server per replica
  (registered with ``RolloutReplicaRegistry`` as ``hf``).
* ``HFServerAdapter`` — the ``BaseRollout`` living in the trainer's worker; each
  step it receives the actor's current weights (verl's "naive" checkpoint engine)
  and loads them into the server.

The server loads the checkpoint with the model config's ``trust_remote_code``, so
a checkpoint whose class keeps an ``lm_head`` bias is built with that class, and a
weight the server's model lacks is an error, never silently dropped.

These are verl-internal interfaces: verl is pinned exactly (requirements) and the
e2e test exercises every piece.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Generator, Optional

import ray
import torch

from ttsrl import knobs
from ttsrl.verl_plugin.sampling import RuleDraw, Sampling, eos_ids_of, parse_sampling

logger = logging.getLogger(__name__)

ROLLOUT_NAME = "hf"
#: the key of ``actor_rollout_ref.rollout.custom`` that names the sampling rule rollouts are drawn by
SAMPLING_RULE_KEY = "sampling_rule"
# Concurrent requests arriving within this window are generated as one batch.
BATCH_WINDOW_S = knobs.get("TTSRL_HF_ROLLOUT_BATCH_WINDOW_S")
MAX_BATCH = knobs.get("TTSRL_HF_ROLLOUT_MAX_BATCH")
WEIGHT_CHUNK_BYTES = 256 << 20


async def settle(size: Callable[[], int], window_s: float, cap: int) -> int:
    """Wait until requests stop arriving: one ``window_s`` at least, then another for as long as
    the queue grew during the last one and holds fewer than ``cap``. verl's agent loop submits a
    step's n x batch requests as a burst that, on a loaded machine, takes longer than one window
    to arrive; batching them all into one ``generate`` call halves the decode loop's Python
    overhead against two batches (benchmarks/bench_hf_rollout_batch.py). Returns the size seen."""
    seen = -1
    while (now := size()) != seen and now < cap:
        seen = now
        await asyncio.sleep(window_s)
    return size()


def server_actor_name(replica_rank: int, node_rank: int = 0) -> str:
    return f"{ROLLOUT_NAME}_server_{replica_rank}_{node_rank}"


# ---------------------------------------------------------------------------
# the server (a Ray actor)
# ---------------------------------------------------------------------------
@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: Sampling
    future: asyncio.Future


class HFRolloutServer:
    """Holds a transformers model; generates for verl's agent loop."""

    def __init__(self, config, model_config, replica_rank: int, node_rank: int = 0):
        from transformers import AutoModelForCausalLM
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import HFModelConfig

        self.config = omega_conf_to_dataclass(config)
        self.model_config = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
        self.replica_rank, self.node_rank = replica_rank, node_rank
        threads = knobs.get("TTSRL_HF_ROLLOUT_THREADS") or (os.cpu_count() or 1)
        torch.set_num_threads(threads)
        # sampling draws from torch's global generator: seeded as verl seeds vLLM (rollout.seed + replica rank)
        torch.manual_seed(int(self.config.seed) + int(replica_rank))

        dtype = getattr(torch, str(self.config.dtype)) if self.config.dtype else torch.float32
        override = dict(self.model_config.override_config or {})
        attn = override.get("attn_implementation", "eager")
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_config.local_path,
            trust_remote_code=self.model_config.trust_remote_code,
            dtype=dtype,
            attn_implementation=attn,
        ).eval()
        self.eos_ids = eos_ids_of(self.model_config)
        # GRPOConfig.rollout_rule: draw by CosyVoice's rule instead of plain top-k/top-p
        rule = (self.config.custom or {}).get(SAMPLING_RULE_KEY)
        self.rule_draw = RuleDraw.of(rule, self.model_config.hf_config) if rule else None
        tok = self.model_config.tokenizer
        pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else self.eos_ids[0]
        self.pad_id = int(pad)
        self.max_model_len = int(self.config.max_model_len or
                                 (self.config.prompt_length + self.config.response_length))
        self.global_steps: Optional[int] = None
        self.weight_updates = 0
        self._queue: list[_Request] = []
        self._wakeup: Optional[asyncio.Event] = None
        self._worker: Optional[asyncio.Task] = None
        logger.info("hf rollout server %s: %s (%s), eos %s", server_actor_name(replica_rank, node_rank),
                    type(self.model).__name__, dtype, self.eos_ids)

    # ---- info --------------------------------------------------------------
    def model_class(self) -> str:
        return f"{type(self.model).__module__}.{type(self.model).__name__}"

    def stats(self) -> dict[str, Any]:
        return {"weight_updates": self.weight_updates, "global_steps": self.global_steps,
                "model_class": self.model_class(), "eos_ids": self.eos_ids}

    # ---- generation --------------------------------------------------------
    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       image_data=None, video_data=None, audio_data=None, mm_processor_kwargs=None,
                       priority: int = 0, **_: Any):
        from verl.workers.rollout.replica import TokenOutput

        if image_data is not None or video_data is not None or audio_data is not None:
            raise NotImplementedError("the hf rollout serves text/token prompts only")
        prompt_ids = [int(t) for t in prompt_ids]
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room in {self.max_model_len}")
        default_max = min(self.config.response_length,
                          self.config.prompt_length + self.config.response_length - len(prompt_ids))
        sampling = parse_sampling(sampling_params, default_max, room)
        future = asyncio.get_running_loop().create_future()
        self._queue.append(_Request(prompt_ids, sampling, future))
        self._ensure_worker()
        self._wakeup.set()
        token_ids, log_probs = await future
        extra = {"global_steps": self.global_steps}
        return TokenOutput(token_ids=token_ids, log_probs=log_probs if sampling.want_logprobs else None,
                           stop_reason="completed", extra_fields=extra)

    def _ensure_worker(self) -> None:
        if self._worker is None or self._worker.done():
            self._wakeup = asyncio.Event()
            self._worker = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            await settle(lambda: len(self._queue), BATCH_WINDOW_S, MAX_BATCH)  # the rest of the step's requests
            while self._queue:
                head = self._queue[0].sampling
                batch = [r for r in self._queue if r.sampling == head][:MAX_BATCH]
                self._queue = [r for r in self._queue if all(r is not b for b in batch)]
                try:
                    results = await asyncio.to_thread(self._generate_batch, [r.prompt_ids for r in batch], head)
                except Exception as exc:  # hand the error to every waiting caller
                    for r in batch:
                        if not r.future.done():
                            r.future.set_exception(exc)
                    continue
                for r, res in zip(batch, results):
                    if not r.future.done():
                        r.future.set_result(res)

    @torch.no_grad()
    def _generate_batch(self, prompts: list[list[int]], sampling: Sampling) -> list[tuple[list[int], list[float]]]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        out = self.model.generate(
            input_ids=ids, attention_mask=mask,
            generation_config=sampling.generation_config(self.eos_ids, self.pad_id),
            logits_processor=sampling.logits_processors(self.rule_draw),
        )
        new = out.sequences[:, width:]
        logprobs = None
        if sampling.want_logprobs:
            # log p of each sampled token under logits / temperature: what the actor computes
            t = 1.0 if sampling.greedy else sampling.temperature
            logits = torch.stack(out.logits, dim=1).float() / t
            logprobs = torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        results = []
        eos = set(self.eos_ids) if not sampling.ignore_eos else set()
        for i in range(len(prompts)):
            row = new[i].tolist()
            end = len(row)
            for j, t in enumerate(row):
                if t in eos:
                    end = j + 1  # keep the stop token, as vLLM does
                    break
            lp = logprobs[i, :end].tolist() if logprobs is not None else []
            results.append((row[:end], lp))
        return results

    # ---- weights -----------------------------------------------------------
    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Copy actor weights into the model; unknown names are an error."""
        state = {name: tensor for name, tensor in named_tensors}
        result = self.model.load_state_dict(state, strict=False, assign=False)
        if result.unexpected_keys:
            raise KeyError(f"rollout model {self.model_class()} has no parameters "
                           f"{sorted(result.unexpected_keys)[:8]}: load the checkpoint with "
                           "actor_rollout_ref.model.trust_remote_code=True so both sides use the same class")
        return len(state)

    def finish_weight_update(self, global_steps: Optional[int]) -> None:
        if getattr(self.model.config, "tie_word_embeddings", False):
            self.model.tie_weights()
        self.weight_updates += 1
        if global_steps is not None:
            self.global_steps = global_steps

    # ---- lifecycle calls verl makes on every rollout server (no device memory to manage)
    async def wake_up(self, tags: Optional[list[str]] = None):
        return None

    async def sleep(self):
        return None

    async def clear_kv_cache(self):
        return None

    async def release_kv_cache(self):
        return None

    async def resume_kv_cache(self):
        return None

    async def set_global_steps(self, global_steps: int):
        self.global_steps = global_steps

    async def wait_for_requests_to_drain(self):
        while self._queue:
            await asyncio.sleep(0.05)

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False):
        return {"aborted_count": 0, "request_ids": []}

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True):
        return {"aborted": False, "request_id": request_id}

    async def resume_generation(self):
        return None

    async def start_profile(self, **kwargs):
        return None

    async def stop_profile(self):
        return None


# ---------------------------------------------------------------------------
# the replica (driver side)
# ---------------------------------------------------------------------------
@functools.cache
def _replica_class():
    from verl.workers.rollout.replica import RolloutReplica

    class HFReplica(RolloutReplica):
        """One ``HFRolloutServer`` per replica, on the node of the replica's first worker."""

        async def launch_servers(self):
            name = server_actor_name(self.replica_rank)
            if self.is_reward_model:
                name = f"{ROLLOUT_NAME}_server_reward_{self.replica_rank}_0{self.name_suffix}"
            elif self.is_teacher_model:
                name = f"{ROLLOUT_NAME}_server_teacher_{self.replica_rank}_0{self.name_suffix}"
            options: dict[str, Any] = dict(name=name, max_concurrency=self.max_concurrency, num_cpus=0)
            if self.workers:
                node_id = await self.workers[0].__ray_call__.remote(
                    lambda _self: ray.get_runtime_context().get_node_id())
                options["scheduling_strategy"] = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                    node_id=node_id, soft=False)
            server = ray.remote(HFRolloutServer).options(**options).remote(
                config=self.config, model_config=self.model_config,
                replica_rank=self.replica_rank, node_rank=0)
            await server.stats.remote()  # wait until the model is loaded
            self.servers = [server]
            self._server_handle = server
            self._server_address = name  # no HTTP endpoint: the agent loop uses the actor handle

        def rollout_worker_use_gpu(self) -> bool:
            return False

    return HFReplica


# ---------------------------------------------------------------------------
# the adapter (inside the trainer worker)
# ---------------------------------------------------------------------------
@functools.cache
def _adapter_class():
    from verl.workers.rollout.base import BaseRollout

    class HFServerAdapter(BaseRollout):
        """Sends the actor's weights to this replica's ``HFRolloutServer`` each step."""

        def __init__(self, config, model_config, device_mesh, replica_rank: int = -1):
            super().__init__(config, model_config, device_mesh)
            rank = int(os.environ.get("RANK", "0"))
            world = (self.config.tensor_model_parallel_size * self.config.data_parallel_size
                     * self.config.pipeline_model_parallel_size)
            self.replica_rank = rank // world if replica_rank == -1 else replica_rank
            self._leader = rank % world == 0
            self._server = None

        def _server_handle(self):
            if self._server is None:
                self._server = ray.get_actor(server_actor_name(self.replica_rank))
            return self._server

        async def resume(self, tags: list[str]):
            return None

        async def release(self):
            return None

        @torch.no_grad()
        async def update_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                                 global_steps: int = None, wire_format: str = "named_tensors", **kwargs):
            if wire_format != "named_tensors":
                raise NotImplementedError(f"hf rollout receives full tensors only, not {wire_format!r}")
            if kwargs.get("peft_config") is not None:
                raise NotImplementedError("hf rollout: LoRA adapters must be merged (model.lora.merge=True)")
            chunk, size, sent = [], 0, 0
            server = self._server_handle() if self._leader else None
            for name, tensor in weights:  # every rank iterates: the generator may run collectives
                if hasattr(tensor, "full_tensor"):
                    tensor = tensor.full_tensor()
                if not self._leader:
                    continue
                tensor = tensor.detach().to("cpu", copy=True)
                chunk.append((name, tensor))
                size += tensor.numel() * tensor.element_size()
                if size >= WEIGHT_CHUNK_BYTES:
                    sent += await server.load_weights.remote(chunk)
                    chunk, size = [], 0
            if self._leader:
                if chunk:
                    sent += await server.load_weights.remote(chunk)
                await server.finish_weight_update.remote(global_steps)
                logger.info("hf rollout: synced %d tensors (step %s)", sent, global_steps)

        def generate_sequences(self, prompts):
            raise NotImplementedError("the hf rollout serves verl's agent loop; no sync generate")

    return HFServerAdapter


def register() -> None:
    """Make ``actor_rollout_ref.rollout.name=hf`` resolve to this backend."""
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(ROLLOUT_NAME, _replica_class)
    # verl resolves the adapter as "module.attr" from this table.
    rollout_base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = f"{__name__}.HFServerAdapter"


def __getattr__(name: str):  # HFServerAdapter / HFReplica are built lazily (verl imports)
    if name == "HFServerAdapter":
        return _adapter_class()
    if name == "HFReplica":
        return _replica_class()
    raise AttributeError(name)
