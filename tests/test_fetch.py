"""The fetch step (python -m ttsrl.fetch, stage -1 of the gpu8 presets) against a stand-in hub.

No hub is reachable here, so a real HTTP server on 127.0.0.1 serves tiny repositories in the
Hugging Face Hub's HTTP API (``/api/{models,datasets}/REPO/revision/REV`` with file metadata,
``[datasets/]REPO/resolve/REV/PATH`` with X-Repo-Commit, ETag = the LFS sha256, Content-Length and
byte ranges), HF_ENDPOINT points at it, and huggingface_hub's own ``hf_hub_download`` does the
downloading. The repositories have the real layouts: a model folder, a sherpa-onnx folder,
voxbox's metadata JSONL, and Parquet datasets whose audio column is the ``datasets`` Audio struct.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from test_run_sh import ROOT, run_sh

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def wav(seconds: float, sr: int = 16000, f0: float = 220.0) -> bytes:
    import soundfile as sf

    t = np.arange(int(seconds * sr)) / sr
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * f0 * t)).astype("float32"), sr, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def parquet(rows: list[dict]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


def audio(data: bytes, name: str) -> dict:
    return {"bytes": data, "path": name}  # the datasets Audio feature as Parquet stores it


def repositories() -> dict[tuple[str, str], dict[str, bytes]]:
    tts_rows = [{"id": f"utt{i}", "prompt_text": f"提示{i}", "target_text": f"目标文本{i}",
                 "prompt_audio": audio(wav(2.0 + i, f0=200 + 50 * i), f"utt{i}.wav")} for i in range(3)]
    aishell = [{"audio": audio(wav(3.5, f0=180 + 10 * k), f"BAC009S07{s}W01{k:02d}.wav"),
                "text": f"甲 乙 丙 {s}{k}", "id": f"BAC009S07{s}W01{k:02d}"} for s in (64, 65) for k in range(6)]
    aishell.insert(0, {"audio": audio(wav(1.0), "BAC009S0764W0199.wav"), "text": "太短", "id": "BAC009S0764W0199"})
    return {
        ("model", "FunAudioLLM/CosyVoice2-0.5B"): {
            "llm.pt": os.urandom(300_000), "cosyvoice2.yaml": b"sample_rate: 24000\n", "flow.pt": os.urandom(5000),
            "hift.pt": os.urandom(4000), "campplus.onnx": os.urandom(3000), "speech_tokenizer_v2.onnx": os.urandom(3000),
            "CosyVoice-BlankEN/config.json": b"{}", "CosyVoice-BlankEN/vocab.json": b"{}",
            "flow.decoder.estimator.fp32.onnx": os.urandom(2000), "README.md": b"# CosyVoice2\n"},
        ("model", "csukuangfj/sherpa-onnx-paraformer-zh-2023-09-14"): {
            "model.int8.onnx": os.urandom(4000), "tokens.txt": b"a 0\nb 1\n", "model.onnx": os.urandom(9000)},
        ("dataset", "SparkAudio/voxbox"): {
            "metadata/aishell-3.jsonl": "".join(json.dumps({"index": f"SSB{i:04d}", "text": f"第{i}句话"},
                                                           ensure_ascii=False) + "\n" for i in range(5)).encode(),
            "metadata/vctk.jsonl": b'{"text": "not this one"}\n'},
        ("dataset", "yuekai/seed_tts_cosy2"): {
            "data/test_zh-00000-of-00001.parquet": parquet(tts_rows),
            "data/test_en-00000-of-00001.parquet": parquet(tts_rows[:1])},
        ("dataset", "yuekai/CV3-Eval"): {"data/zero_shot_zh-00000-of-00001.parquet": parquet(tts_rows[:2])},
        ("dataset", "yuekai/aishell"): {"test/test-00000-of-00001.parquet": parquet(aishell)},
    }


class StandInHub:
    """A real HTTP server speaking the parts of the Hugging Face Hub API huggingface_hub downloads with."""

    def __init__(self, repos):
        self.repos = repos
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.cut: set[str] = set()  # file paths whose next GET is cut after half the bytes
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_HEAD(self):
                self.serve(body=False)

            def do_GET(self):
                self.serve(body=True)

            def serve(self, body: bool):
                path = self.path.split("?")[0]
                hub.requests.append((self.command, path, self.headers.get("Range")))
                from urllib.parse import unquote

                path = unquote(path)
                if path.startswith(("/api/models/", "/api/datasets/")) and "/revision/" in path:
                    kind = "model" if path.startswith("/api/models/") else "dataset"
                    repo = path.split("/", 3)[3].split("/revision/")[0]
                    return self.info(kind, repo)
                if "/resolve/" in path:
                    head, _, rest = path[1:].partition("/resolve/")
                    kind, repo = ("dataset", head[len("datasets/"):]) if head.startswith("datasets/") else ("model", head)
                    return self.file(kind, repo, rest.split("/", 1)[1], body)
                self.send_error(404)

            def commit(self, files):
                return hashlib.sha1(b"".join(p.encode() + files[p] for p in sorted(files))).hexdigest()

            def info(self, kind, repo):
                files = hub.repos.get((kind, repo))
                if files is None:
                    return self.send_error(404)
                siblings = [{"rfilename": p, "size": len(d), "blobId": hashlib.sha1(d).hexdigest(),
                             "lfs": {"sha256": hashlib.sha256(d).hexdigest(), "size": len(d), "pointerSize": 134}}
                            for p, d in sorted(files.items())]
                data = json.dumps({"id": repo, "sha": self.commit(files), "siblings": siblings}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def file(self, kind, repo, fpath, body):
                files = hub.repos.get((kind, repo))
                if files is None or fpath not in files:
                    return self.send_error(404)
                data = files[fpath]
                start = 0
                rng = self.headers.get("Range")
                if rng and rng.startswith("bytes="):
                    start = int(rng[6:].split("-")[0])
                part = data[start:]
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", self.commit(files))
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(len(part)))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if not body:
                    return
                if fpath in hub.cut and not start:  # the connection drops mid-file
                    hub.cut.discard(fpath)
                    self.wfile.write(part[: len(part) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.wfile.write(part)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def downloads(self) -> list[str]:
        return [p for m, p, _ in self.requests if m == "GET" and "/resolve/" in p]


@pytest.fixture
def hub(monkeypatch, tmp_path):
    h = StandInHub(repositories())
    monkeypatch.setenv("HF_ENDPOINT", h.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for proxy in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    yield h
    h.server.shutdown()


def paths(tmp_path: Path) -> dict:
    return {"model_dir": tmp_path / "pretrained_models/CosyVoice2-0.5B",
            "sherpa_model_dir": tmp_path / "pretrained_models/sherpa-onnx-paraformer-zh",
            "train_file": tmp_path / "data/aishell3_train.jsonl", "seedtts_dir": tmp_path / "data/seedtts_testset/zh",
            "cv3_dir": tmp_path / "data/cv3_eval/zero_shot/zh", "prompt_dir": tmp_path / "data/speaker_prompts",
            "prompt_pool": tmp_path / "data/prompt_pool"}


def fake_tokens(cmd: list[str]) -> None:
    """Stands in for scripts/prompt_tokens.py's tokenizer (no CosyVoice weights here): reads the
    same input with the script's own reader and writes the same JSONL, with made-up codes."""
    spec = importlib.util.spec_from_file_location("prompt_tokens", ROOT / "scripts" / "prompt_tokens.py")
    pt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pt)
    assert cmd[1].endswith("scripts/prompt_tokens.py") and "--model-dir" in cmd
    items, base, texts = pt.read_wav_list(Path(cmd[2]))
    if "--texts" in cmd:
        texts.update(pt.read_texts(Path(cmd[cmd.index("--texts") + 1])))
    out = Path(cmd[cmd.index("--copy-wavs-to") + 1]) if "--copy-wavs-to" in cmd else base
    (out / "prompt_speech_tokens.jsonl").write_text("".join(
        json.dumps({"id": u, "prompt_text": texts[u], "prompt_speech_tokens": [1, 2, 3]}, ensure_ascii=False) + "\n"
        for u, _ in items), encoding="utf-8")


def do_fetch(tmp_path, tokens=fake_tokens):
    from ttsrl.fetch.inputs import catalogue, fetch

    p = paths(tmp_path)
    lines: list[str] = []
    rc, msg = fetch(catalogue(**p), model_dir=p["model_dir"], make_tokens=tokens, log=lines.append)
    return rc, msg, "\n".join(lines)


def check_inputs(tmp_path) -> subprocess.CompletedProcess:
    p = paths(tmp_path)
    args = ["--model-dir", p["model_dir"], "--prompt-dir", p["prompt_dir"], "--sherpa-model-dir", p["sherpa_model_dir"],
            "--train-file", p["train_file"], "--test-file", ROOT / "data/corpus/test.jsonl",
            "--seedtts-dir", p["seedtts_dir"], "--prompt-pool", p["prompt_pool"]]
    return subprocess.run([sys.executable, str(ROOT / "scripts/check_inputs.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=60)


def test_a_fetch_lays_out_every_input_check_inputs_passes_and_a_rerun_fetches_nothing(hub, tmp_path):
    from ttsrl.data.prompt_pool import read_pool
    from ttsrl.data.testsets import read_test_set

    rc, msg, log = do_fetch(tmp_path)
    assert rc == 0, msg + log
    p = paths(tmp_path)
    # the model folder: exactly the release's files the recipe needs, byte for byte
    repo = hub.repos[("model", "FunAudioLLM/CosyVoice2-0.5B")]
    for name in ("llm.pt", "flow.pt", "CosyVoice-BlankEN/vocab.json"):
        assert (p["model_dir"] / name).read_bytes() == repo[name]
    assert not (p["model_dir"] / "flow.decoder.estimator.fp32.onnx").exists()
    assert not (p["sherpa_model_dir"] / "model.onnx").exists() and (p["sherpa_model_dir"] / "model.int8.onnx").is_file()
    assert [json.loads(x)["text"] for x in p["train_file"].read_text().splitlines()] == [f"第{i}句话" for i in range(5)]
    # the test sets, read by stage 4's own reader
    seed = read_test_set("seedtts_zh", p["seedtts_dir"])
    assert [(u.id, u.text, u.prompt_text) for u in seed.utterances] == [(f"utt{i}", f"目标文本{i}", f"提示{i}")
                                                                       for i in range(3)]
    assert all(Path(u.prompt_wav).is_file() and u.prompt_speech for u in seed.utterances)
    cv3 = read_test_set("cv3_zh", p["cv3_dir"])
    assert cv3.layout == "cv3" and [u.text for u in cv3.utterances] == ["目标文本0", "目标文本1"]
    # prompts: one per aishell speaker, the pool five, 3..10 s only, transcripts without spaces
    assert sorted(x.name for x in p["prompt_dir"].glob("*.wav")) == ["BAC009S0764W0100.wav", "BAC009S0765W0100.wav"]
    pool = read_pool(p["prompt_pool"], need_wavs=True)
    assert len(pool) == 10 and pool.prompts[0].prompt_text == "甲乙丙640"
    # every input has its manifest: source, commit, size and sha256 of each file
    m = json.loads((p["model_dir"] / "fetch_manifest.json").read_text())
    assert m["source"]["repo"] == "FunAudioLLM/CosyVoice2-0.5B" and m["source"]["endpoint"] == hub.url
    assert m["files"]["llm.pt"]["sha256"] == hashlib.sha256(repo["llm.pt"]).hexdigest()
    assert (tmp_path / "data/aishell3_train.jsonl.fetch.json").is_file()
    seed_m = json.loads((p["seedtts_dir"] / "fetch_manifest.json").read_text())
    assert seed_m["source"]["repo"] == "yuekai/seed_tts_cosy2" and "meta.lst" in seed_m["files"]
    assert list(seed_m["source"]["files"]) == ["data/test_zh-00000-of-00001.parquet"]

    r = check_inputs(tmp_path)
    assert r.returncode == 0, r.stderr

    hub.requests.clear()
    rc, msg, log = do_fetch(tmp_path)
    assert rc == 0 and hub.requests == [], hub.requests
    assert log.count("[ok]") == 7, log


def test_a_corrupted_file_is_named_and_fetched_again(hub, tmp_path):
    assert do_fetch(tmp_path)[0] == 0
    p = paths(tmp_path)
    flow, meta = p["model_dir"] / "flow.pt", p["seedtts_dir"] / "meta.lst"
    good_flow, good_meta = flow.read_bytes(), meta.read_bytes()
    flow.write_bytes(b"x" * len(good_flow))  # same size, other bytes
    meta.write_text("utt0|a|prompt-wavs/utt0.wav|b\n")
    hub.requests.clear()
    rc, msg, log = do_fetch(tmp_path)
    assert rc == 0, msg
    assert f"{flow}: sha256 differs" in log and f"{meta}: " in log, log
    assert flow.read_bytes() == good_flow and meta.read_bytes() == good_meta
    # the model folder fetched only the file that differed
    assert [d for d in hub.downloads() if "CosyVoice2" in d] == ["/FunAudioLLM/CosyVoice2-0.5B/resolve/"
                                                               + hub.downloads()[0].split("/resolve/")[1].split("/")[0]
                                                               + "/flow.pt"]
    assert check_inputs(tmp_path).returncode == 0


def test_an_interrupted_download_resumes_and_is_never_used_half(hub, tmp_path):
    # huggingface_hub writes in 10 MiB chunks: a 24 MiB file cut after 12 MiB has one chunk to resume from
    hub.repos[("model", "FunAudioLLM/CosyVoice2-0.5B")]["llm.pt"] = bytes(range(256)) * (24 * 4096)
    hub.cut.add("llm.pt")
    rc, msg, log = do_fetch(tmp_path)
    assert rc == 0, msg
    got = [r for m, p, r in hub.requests if m == "GET" and p.endswith("/llm.pt")]
    assert got == [None, f"bytes={10 * 1024 * 1024}-"], got  # resumed from its .incomplete file, not redone
    llm = paths(tmp_path)["model_dir"] / "llm.pt"
    assert llm.read_bytes() == hub.repos[("model", "FunAudioLLM/CosyVoice2-0.5B")]["llm.pt"]


def offline_run(tmp_path, env_extra: dict) -> tuple[subprocess.CompletedProcess, float]:
    p = paths(tmp_path)
    args = [a for k, v in p.items() for a in ("--" + k.replace("_", "-"), str(v))]
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_ENDPOINT")}
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "ttsrl.fetch", *args], cwd=ROOT, capture_output=True, text=True,
                       env={**env, "PYTHONPATH": str(ROOT), **env_extra}, timeout=60)
    return r, time.monotonic() - t


@pytest.mark.parametrize("how", ["HF_HUB_OFFLINE", "refused"])
def test_offline_one_message_names_every_missing_input_within_seconds(tmp_path, how):
    asr = paths(tmp_path)["sherpa_model_dir"]  # placed by hand: left alone, not listed
    asr.mkdir(parents=True)
    (asr / "model.onnx").write_bytes(b"onnx")
    (asr / "tokens.txt").write_text("a 0\n")
    if how == "HF_HUB_OFFLINE":
        env = {"HF_HUB_OFFLINE": "1"}
    else:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()  # nothing listens there: connections are refused
        env = {"HF_ENDPOINT": f"http://127.0.0.1:{port}"}
    r, took = offline_run(tmp_path, env)
    assert r.returncode == 1 and took < 10, (took, r.stderr)
    err = r.stderr
    assert err.count("ttsrl.fetch:") == 1 and "6 input(s) to fetch" in err, err
    for src in ("FunAudioLLM/CosyVoice2-0.5B", "SparkAudio/voxbox", "yuekai/seed_tts_cosy2", "yuekai/CV3-Eval",
                "yuekai/aishell"):
        assert src in err
    for var in ("COSYVOICE2_DIR", "TRAIN_FILE", "SEEDTTS_ZH_DIR", "CV3_ZH_DIR", "PROMPT_DIR", "PROMPT_POOL"):
        assert f"({var})" in err
    assert "ASR_MODEL_DIR" not in err and err.count("elsewhere:") == 6 and err.count("by hand:") == 6
    assert "hf download FunAudioLLM/CosyVoice2-0.5B" in err and "check_inputs.py" in err


def test_run_sh_gpu8_offline_stops_at_the_fetch_step_before_any_model_is_loaded(tmp_path):
    p = paths(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "HF_ENDPOINT"}
    env.update(PRESET="presets/gpu8.sh", EXP_DIR=str(tmp_path / "exp"), HF_HUB_OFFLINE="1",
               COSYVOICE2_DIR=str(p["model_dir"]), ASR_MODEL_DIR=str(p["sherpa_model_dir"]),
               TRAIN_FILE=str(p["train_file"]), SEEDTTS_ZH_DIR=str(p["seedtts_dir"]), CV3_ZH_DIR=str(p["cv3_dir"]),
               PROMPT_DIR=str(p["prompt_dir"]))
    t = time.monotonic()
    r = run_sh("-1", "5", env=env, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "fetch the inputs" in r.stdout and "convert llm.pt" not in r.stdout and "stage 0" not in r.stdout
    assert r.stderr.count("ttsrl.fetch:") == 1 and "6 input(s) to fetch" in r.stderr, r.stderr
    assert "HF_HUB_OFFLINE=1" in r.stderr
    assert time.monotonic() - t < 60
