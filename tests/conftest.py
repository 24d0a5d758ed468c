"""Shared fixtures: tiny checkpoints in CosyVoice2's exact released layout.

CosyVoice2 weights cannot be had on CI machines, so these checkpoints are FAKES of
the real model: random weights, hidden size 64, 2 layers, a byte-level BPE tokenizer
trained on a few sentences. Key names, index math and the speech vocabulary
(6561 + 3) are the real ones.
"""

import os

import pytest

# The embedded preset trains zero-shot by default (PROMPT_POOL=data/corpus/prompt_pool).
# The suite's run.sh tests were written for, and check, the text-only rows (tiny models whose
# tokenizers do not know the pool's characters, hand-started servers without the pool): each
# run.sh they start inherits this empty PROMPT_POOL. A test of the zero-shot mode names the pool
# (tests/test_multinode.py's rehearsal, tests/test_prompted_data.py); the default itself is checked
# with PROMPT_POOL unset (tests/test_run_sh_settings.py).
os.environ["PROMPT_POOL"] = ""

# Under pytest-xdist each worker gets its share of the cores, for itself and the processes it starts
# (OMP_NUM_THREADS, which torch reads). With torch's default of every core in each of two workers on 2
# cores, a worker's threads wait on each other whenever the other worker computes: the quick tier took
# 289 s on a 2-core AMD EPYC, 256 s with one thread a worker (one run each; that machine's runs vary by
# 10-15%). A test that wants more threads sets them.
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    import sys

    from ttsrl.cpus import usable_cores

    os.environ["OMP_NUM_THREADS"] = str(max(1, usable_cores() // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1))))
    if "torch" in sys.modules:  # imported before this file: it read the variable already
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# fixtures only; the tests (and scripts/rehearsal.py) import every plain helper from helpers.py
from helpers import make_grpo_workspace, start_reward_server, stop_process

SENTENCES = [
    "今天天气很好，我们去公园散步吧。", "我用iPhone拍照，Hello world!", "二零二四年三月五日，百分之五十。",
    "银行的行长在行走。", "你好，一个不是很长的句子。", "重庆的重量很重要，还要还钱。",
] * 8


@pytest.fixture(scope="session")
def tiny_cosyvoice2(tmp_path_factory):
    """(dir, Qwen2LM) of a random tiny model saved as DIR/llm.pt + DIR/CosyVoice-BlankEN/."""
    from ttsrl.embedded.tiny_model import make_tiny_cosyvoice2

    d = tmp_path_factory.mktemp("cosyvoice2")
    model = make_tiny_cosyvoice2(d, SENTENCES)
    return d, model.eval()


@pytest.fixture(scope="session")
def tiny_hf(tiny_cosyvoice2, tmp_path_factory):
    """The tiny model converted to the HF layout (fp32)."""
    from ttsrl.model.convert import cosyvoice_to_hf

    out = tmp_path_factory.mktemp("hf") / "hf_model"
    cosyvoice_to_hf(tiny_cosyvoice2[0], out, log=lambda _: None)
    return out


@pytest.fixture(scope="session")
def cosyvoice2_folders(tmp_path_factory):
    """(model folder, prompt folder) of ``cosyvoice2_tiny.tiny_folder_with_prompts``, built once a
    session (about 5 s): the modules that run the tiny CosyVoice2 only read them, and a test that
    changes one works on a copy. Requested only where CosyVoice's code is installed."""
    from cosyvoice2_tiny import tiny_folder_with_prompts

    return tiny_folder_with_prompts(tmp_path_factory.mktemp("cosyvoice2"))


@pytest.fixture
def one_thread():
    """Tiny matmuls: more threads only add waiting."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def lm(tiny_hf):
    """The tiny converted model loaded with its speech head (ttsrl.model.hf_model)."""
    from ttsrl.model.hf_model import load_speech_lm

    return load_speech_lm(tiny_hf)


@pytest.fixture(scope="session")
def sim_server():
    """(process, URL) of the reward server CLI with the ``sim`` backend and every other setting at its
    default, on a free loopback port, shared by the session: a test may read rewards from it or have
    run.sh adopt it, never stop it or depend on its counters (a test that stops its server, or needs
    other settings, starts its own: ``helpers.start_reward_server``)."""
    proc, url = start_reward_server("--backend", "sim", "--log-level", "WARNING")
    yield proc, url
    stop_process(proc)


@pytest.fixture(scope="session")
def sim_server_url(sim_server):
    """The URL of ``sim_server``."""
    return sim_server[1]


@pytest.fixture(scope="session")
def grpo_workspace(tmp_path_factory):
    """One ``make_grpo_workspace`` folder (the briefly pretrained tiny model, train/test Parquet) for
    the real GRPO runs of a session (test_grpo_cpu.py, test_grpo_algorithms.py, test_gdpo.py): the
    same deterministic build each of them made for itself. Each run writes its own checkpoint
    folder in it; the model and the Parquet files are only read."""
    return make_grpo_workspace(tmp_path_factory.mktemp("grpo"))
