"""The hf rollout's batching window (ttsrl.verl_plugin.hf_rollout.settle): a step's requests
that trickle in over several windows still end up in one batch; a pause longer than the window
ends it; the cap ends it at once. Driven by a real asyncio loop and real sleeps."""

import asyncio
import time

import pytest

from ttsrl.verl_plugin.hf_rollout import settle


def run_arrivals(gaps_s: list[float], window_s: float, cap: int = 1000) -> tuple[int, float]:
    """Requests arrive after each gap in turn; return (queue size when settle returned, seconds)."""
    queue: list[int] = [0]

    async def producer():
        for gap in gaps_s:
            await asyncio.sleep(gap)
            queue.append(len(queue))

    async def main():
        task = asyncio.create_task(producer())
        t0 = time.monotonic()
        got = await settle(lambda: len(queue), window_s, cap)
        took = time.monotonic() - t0
        await task
        return got, took

    return asyncio.run(main())


def test_a_trickling_burst_is_collected_whole():
    # 8 more requests, 40 ms apart: 320 ms in all, far longer than one 100 ms window
    got, took = run_arrivals([0.04] * 8, window_s=0.1)
    assert got == 9 and took >= 0.32


def test_a_pause_longer_than_the_window_ends_the_batch():
    got, took = run_arrivals([0.01, 0.01, 0.6], window_s=0.1)
    assert got == 3 and took < 0.55


def test_the_cap_ends_it_without_waiting_for_the_rest():
    # 20 requests 40 ms apart (0.8 s); a full batch (3) is reached within the first windows
    got, took = run_arrivals([0.04] * 20, window_s=0.1, cap=3)
    assert 3 <= got < 10 and took < 0.45


def _samples(model_dir, seed, replica_rank=0):
    """Token ids a fresh hf rollout server samples for two prompts (temperature 1, no top-p/k)."""
    from omegaconf import OmegaConf

    from ttsrl.verl_plugin.hf_rollout import HFRolloutServer
    from ttsrl.verl_plugin.sampling import Sampling

    rollout = OmegaConf.create({"_target_": "verl.workers.config.RolloutConfig", "name": "hf", "dtype": "float32",
                                "prompt_length": 16, "response_length": 12, "seed": seed})
    model = OmegaConf.create({"path": str(model_dir), "trust_remote_code": True})
    server = HFRolloutServer(rollout, model, replica_rank=replica_rank)
    sampling = Sampling(temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, max_tokens=12,
                        want_logprobs=False, ignore_eos=True)
    return [ids for ids, _ in server._generate_batch([[1, 2, 3], [4, 5, 6, 7]], sampling)]


@pytest.mark.slow  # four sampled rollouts on the tiny model: ~5 s
def test_rollout_sampling_follows_the_seed_as_verl_seeds_vllm(tiny_hf):
    """rollout.seed (train_grpo --seed, run.sh SEED) seeds the hf rollout's sampling, plus the replica
    rank as verl seeds its vLLM servers: the same seed samples the same tokens, another seed or
    another replica other ones."""
    first = _samples(tiny_hf, seed=3)
    assert _samples(tiny_hf, seed=3) == first
    assert _samples(tiny_hf, seed=4) != first
    assert _samples(tiny_hf, seed=3, replica_rank=1) == _samples(tiny_hf, seed=4)
