"""The embedded base model records a hash of the weights it built (ttsrl.embedded.pretrain)."""

import json

import torch

from ttsrl.embedded.pretrain import INFO_FILE, PretrainConfig, build_base_model, weights_sha256
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
    # one changed bit changes the hash
    k = sorted(sd)[0]
    sd[k].view(-1)[0] = torch.nextafter(sd[k].view(-1)[0], torch.tensor(float("inf")))
    assert weights_sha256(sd) != info["weights_sha256"]
