"""verl 0.9.1 GRPO with verl's vLLM rollout in Fun-CosyVoice3's layout for 2 steps on CPU
(``tests/gpu_stack/grpo_run.py``), beside CosyVoice2's run in test_vllm_grpo.py: a file of its
own, so the two runs go to the two pytest-xdist workers side by side.
"""

from __future__ import annotations

import json

import pytest

from gpu_stack.grpo_run import check_run, train_tiny

pytestmark = pytest.mark.slow  # a real verl GRPO run with the vLLM rollout (python -m verl.trainer.main_ppo): minutes


@pytest.fixture(scope="module")
def run_cosyvoice3(tmp_path_factory, sim_server_url):
    return train_tiny(tmp_path_factory.mktemp("grpo_vllm_cv3"), sim_server_url, "cosyvoice3")


def test_grpo_steps_with_vllm_rollout_cosyvoice3(run_cosyvoice3):
    """The run in CosyVoice3's layout: the bias-free head served by vLLM, its 200 stop ids
    (generation_config) ending rollouts, the <|endofprompt|> prompt from the chat template."""
    check_run(run_cosyvoice3)
    ws, _ = run_cosyvoice3
    assert json.loads((ws / "hf_model" / "config.json").read_text())["speech_family"] == "cosyvoice3"
