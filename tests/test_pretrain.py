"""The embedded base model (ttsrl.embedded.pretrain): the hash of the weights it built, its
progress lines off a terminal, and its thread count on a shared machine."""

import dataclasses
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from ttsrl.embedded.pretrain import INFO_FILE, PretrainConfig, build_base_model, free_threads, weights_sha256
from ttsrl.embedded.tiny_model import TinyConfig

TEXTS = ["今天天气很好。", "我们去公园散步吧。", "你吃过早饭了吗？"]
CFG = PretrainConfig(model=TinyConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, tokenizer_vocab=256),
                     steps=2, batch_size=2, threads=1)


def test_weights_hash_is_recorded_matches_the_file_and_the_cache(tmp_path):
    corpus = tmp_path / "train.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in TEXTS), encoding="utf-8")
    logs = []
    info = build_base_model(corpus, tmp_path / "a", CFG, log=logs.append)
    sd = torch.load(tmp_path / "a" / "llm.pt", map_location="cpu", weights_only=True)
    assert info["weights_sha256"] == weights_sha256(sd) and len(info["weights_sha256"]) == 64
    assert json.loads((tmp_path / "a" / INFO_FILE).read_text())["weights_sha256"] == info["weights_sha256"]
    assert info["weights_sha256"][:16] in logs[-1]
    # the same inputs on the same machine: the same weights (and a cached second call says so)
    assert build_base_model(corpus, tmp_path / "b", CFG, log=logs.append)["weights_sha256"] == info["weights_sha256"]
    assert build_base_model(corpus, tmp_path / "a", CFG, log=logs.append)["weights_sha256"] == info["weights_sha256"]
    assert "skipping the build" in logs[-1] and info["weights_sha256"][:16] in logs[-1]
    # the thread count only sets the speed: it is no input of the cache
    two = dataclasses.replace(CFG, threads=2)
    assert build_base_model(corpus, tmp_path / "a", two, log=logs.append)["weights_sha256"] == info["weights_sha256"]
    assert "skipping the build" in logs[-1]
    # one changed bit changes the hash
    k = sorted(sd)[0]
    sd[k].view(-1)[0] = torch.nextafter(sd[k].view(-1)[0], torch.tensor(float("inf")))
    assert weights_sha256(sd) != info["weights_sha256"]


def test_off_a_terminal_the_build_prints_progress_lines(tmp_path, capsys):
    corpus = tmp_path / "train.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in TEXTS), encoding="utf-8")
    cfg = dataclasses.replace(CFG, steps=3)
    info = build_base_model(corpus, tmp_path / "a", cfg, log=print)  # capsys: stdout and stderr are no terminal
    out = capsys.readouterr()
    assert "\r" not in out.out + out.err and "step/s" not in out.err  # no tqdm bar
    lines = [x for x in out.out.splitlines() if x.startswith("pretrain base model:")]
    # the first step, then every 30 s (not reached here), and the last step
    assert [re.fullmatch(r"pretrain base model: step (\d)/3  loss \d+\.\d{3}  elapsed \d+s(  ETA \d+s)?", x)[1]
            for x in lines] == ["1", "3"], out.out
    assert "ETA" in lines[0] and "ETA" not in lines[1]
    assert float(re.search(r"loss (\S+)", lines[1])[1]) == pytest.approx(info["final_loss"], abs=1e-3)
    assert info["threads"] == 1 and "3 steps on 1 torch thread(s)" in out.out


@pytest.mark.parametrize("cores,load,threads", [(2, 0.0, 2), (2, 0.4, 2), (2, 1.0, 1), (2, 1.6, 1), (2, 9.0, 1),
                                                (8, 2.6, 5), (1, 0.0, 1)])
def test_free_threads_leaves_the_busy_cores_alone(cores, load, threads):
    assert free_threads(cores, load) == threads


def test_busy_cores_sees_a_spinning_process():
    """Measured, not the lagging load average: one process spinning for the whole window is
    at least ~one busy core (other work on the machine only adds to it)."""
    from ttsrl.embedded.pretrain import busy_cores

    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        busy = busy_cores(1.0)
    finally:
        spin.kill()
        spin.wait()
    assert busy is not None and 0.8 <= busy <= os.cpu_count() + 0.01, busy
    assert busy_cores(0.1, stat="/nonexistent") is None


def test_auto_threads_follow_the_busy_cores(tmp_path, monkeypatch):
    import ttsrl.embedded.pretrain as pretrain

    corpus = tmp_path / "train.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in TEXTS), encoding="utf-8")
    monkeypatch.setattr(pretrain, "busy_cores", lambda: 1.2)
    monkeypatch.setattr(pretrain.os, "getloadavg", lambda: (3.0, 0.0, 0.0))  # not read: busy_cores answers
    monkeypatch.setattr(pretrain.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    threads = torch.get_num_threads()
    try:
        info = build_base_model(corpus, tmp_path / "a", dataclasses.replace(CFG, threads=0), log=lambda m: None)
        assert info["threads"] == 3 and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("steps", [2, 3, 20, 39])
def test_short_builds_train_every_step_count(tmp_path, steps):
    """A short build used to stop with ZeroDivisionError in OneCycleLR at exactly 20 steps
    (5% warm-up = one step); every count trains, and the preset's 2,000 keep their 5%."""
    from ttsrl.embedded.pretrain import warmup_share

    corpus = tmp_path / "train.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in TEXTS), encoding="utf-8")
    info = build_base_model(corpus, tmp_path / "m", dataclasses.replace(CFG, steps=steps))
    assert info["config"]["steps"] == steps and info["final_loss"] > 0
    assert warmup_share(2000) == 0.05
