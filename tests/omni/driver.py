"""vllm-omni 0.30.0's CosyVoice3 as an independent reference, run inside .venv-omni/.

Run with ``.venv-omni/bin/python tests/omni/driver.py SUBCOMMAND ...`` (scripts/install.sh
--vllm-omni builds that venv). Imports vllm_omni, torch, transformers and numpy only: never
ttsrl (the point is a second implementation). Files in, .json/.npy out:

  tokenize     --tokenizer-dir DIR --texts JSON --out JSON
      JSON: [{"prompt_text": str, "text": str}, ...]. For each, the text ids of a zero-shot
      request as vllm-omni builds them: the reference transcript, prefixed with
      "You are a helpful assistant.<|endofprompt|>" unless it holds <|endofprompt|> (its TTS
      adapter, entrypoints/openai/tts_adapters/cosyvoice3.py), tokenized by its CosyVoice3
      tokenizer, then the text's ids (utils.concat_text_with_prompt_ids). Out:
      {"ids": [[...], ...], "tokenizer_size": int, "specials": [its special-token list]}.
  llm-logprobs --model-dir DIR --inputs JSON --out NPY
      DIR: llm.pt (upstream CosyVoice3LM keys) + CosyVoice-BlankEN/ (Qwen2 config). JSON:
      [{"text_ids": [...], "prompt_speech": [...], "continuation": [...]}, ...]. vllm-omni's
      CosyVoice3Model (talker stage) with its own CosyVoice3LM heads, load_weights,
      embed_input_ids (the multimodal prompt path: [sos, text, task_id, prompt speech]) and
      compute_logits, around Hugging Face's Qwen2Model as the body (vLLM's Qwen2Model needs an
      engine's forward context; no engine here). Out: float32 [N, T+1, 6761], row t the
      log-softmax of compute_logits' first 6761 columns after the prompt and t continuation
      codes (T = the longest continuation; shorter ones padded with NaN). compute_logits merges
      the 200 stop logits into one at 6562 (logsumexp): the normaliser is unchanged, so columns
      0..6560 are the exact speech log-probs, column 6562 is log(stop mass), the other stop
      columns -inf.
  code2wav-mel --model-dir DIR --codes JSON --prompt NPZ --noise NPY --out NPY
      vllm-omni's CosyVoice3Code2Wav flow (DiT + CFM, 10 Euler steps, cfg 0.7) from DIR/flow.pt
      for the speech codes in JSON (a list of ints); NPZ holds prompt_token [1, Tp] int,
      prompt_feat [1, 2*Tp, 80] float and embedding [1, 192] float; NOISE [1, 80, >= mel frames]
      float is the flow's initial noise (upstream draws one fixed noise, seed 0; vllm-omni calls
      torch.randn each time: this injects it). Optional --flow-config JSON overrides the
      estimator's dims (a smaller flow of the same classes). Out: the mel of the codes only,
      float32 [1, 80, 2*len(codes)]. Attention: vllm-omni's SDPA backend picked by hand
      (vllm-omni has no CPU platform).

Common: --threads N (torch threads, default 2). Timings go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

T0 = time.time()
SPEECH_TOKEN_SIZE = 6561
NUM_OUTPUTS = SPEECH_TOKEN_SIZE + 200
PROMPT_DELIMITER = "<|endofprompt|>"


def log(msg: str) -> None:
    print(f"[omni-driver {time.time() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def _omni_tokenizer(tokenizer_dir: str):
    from vllm_omni.model_executor.models.cosyvoice3.tokenizer import get_qwen_tokenizer

    return get_qwen_tokenizer(token_path=str(tokenizer_dir), skip_special_tokens=True, version="cosyvoice3")


def _adapter_prompt_rule() -> tuple[str, str]:
    """(_PROMPT_DELIMITER, _PROMPT_PREFIX) of vllm-omni's CosyVoice3 TTS adapter, read from its
    source: importing it imports the whole OpenAI server (and vLLM's vision models, which need
    torchvision, absent here)."""
    import ast

    import vllm_omni

    src = Path(vllm_omni.__file__).parent / "entrypoints/openai/tts_adapters/cosyvoice3.py"
    tree = ast.parse(src.read_text(encoding="utf-8"))
    keep = [n for n in tree.body if isinstance(n, ast.Assign) and len(n.targets) == 1
            and getattr(n.targets[0], "id", None) in ("_PROMPT_DELIMITER", "_PROMPT_PREFIX")]
    ns: dict = {}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(src), "exec"), ns)
    return ns["_PROMPT_DELIMITER"], ns["_PROMPT_PREFIX"]


def cmd_tokenize(a) -> None:
    from vllm_omni.model_executor.models.cosyvoice3.utils import concat_text_with_prompt_ids, extract_text_token

    delimiter, prefix = _adapter_prompt_rule()
    assert (delimiter, prefix) == (PROMPT_DELIMITER, "You are a helpful assistant." + PROMPT_DELIMITER), prefix
    tok = _omni_tokenizer(a.tokenizer_dir)
    log("tokenizer loaded")
    items = json.loads(Path(a.texts).read_text(encoding="utf-8"))
    out = []
    for it in items:
        ref = it["prompt_text"]
        if delimiter not in ref:  # the adapter's rule, as it applies it
            ref = f"{prefix}{ref}"
        text_token, text_len = extract_text_token(it["text"], tok, "all")
        p_token, p_len = extract_text_token(ref, tok, "all")
        ids, _ = concat_text_with_prompt_ids(text_token, text_len, p_token, p_len)
        out.append([int(x) for x in ids.reshape(-1).tolist()])
    Path(a.out).write_text(json.dumps({"ids": out, "tokenizer_size": len(tok.tokenizer),
                                       "specials": tok.special_tokens["additional_special_tokens"]},
                                      ensure_ascii=False), encoding="utf-8")
    log(f"{len(out)} texts tokenized")


def _talker(model_dir: str):
    """vllm-omni's CosyVoice3Model in its talker stage, built without a vLLM engine."""
    import torch
    from transformers import Qwen2Config, Qwen2Model
    from vllm_omni.model_executor.models.cosyvoice3.cosyvoice3 import CosyVoice3Model
    from vllm_omni.model_executor.models.cosyvoice3.cosyvoice3_talker import CosyVoice3LM
    from vllm_omni.transformers_utils.configs.cosyvoice3 import CosyVoice3Config

    config = CosyVoice3Config()
    qcfg = Qwen2Config.from_pretrained(os.path.join(model_dir, config.llm["llm"]["pretrain_path"]))
    # the config class hard-codes the released sizes (896); a smaller random body sets its own
    config.llm["llm_input_size"] = config.llm["llm_output_size"] = qcfg.hidden_size
    qcfg._attn_implementation = "eager"  # plain fp32 math on CPU

    class Body(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Qwen2Model(qcfg)
            self.model.load_weights = self._load_weights  # what CosyVoice3Model.load_weights calls

        def _load_weights(self, weights):
            self.model.load_state_dict(dict(weights), strict=True)

        def forward(self, inputs_embeds, positions):  # VLLMQwen2Encoder's signature, flat tokens
            out = self.model(inputs_embeds=inputs_embeds.reshape(1, -1, qcfg.hidden_size),
                             position_ids=positions.reshape(1, -1))
            return out.last_hidden_state[0]

    m = CosyVoice3Model.__new__(CosyVoice3Model)
    torch.nn.Module.__init__(m)
    m.config, m.model_stage, m.model_dir, m.have_multimodal_outputs = config, "cosyvoice3_talker", model_dir, True
    c = config.llm
    m.talker = CosyVoice3LM(llm_input_size=c["llm_input_size"], llm_output_size=c["llm_output_size"],
                            speech_token_size=c["speech_token_size"], llm=Body(),
                            length_normalized_loss=c["length_normalized_loss"], lsm_weight=c["lsm_weight"],
                            mix_ratio=c["mix_ratio"])
    m.model = m.talker
    m.load_weights(iter(()))  # reads model_dir/llm.pt itself
    m.eval()
    return m


def cmd_llm_logprobs(a) -> None:
    import numpy as np
    import torch

    m = _talker(a.model_dir)
    log("talker loaded")
    items = json.loads(Path(a.inputs).read_text())
    T = max(len(it["continuation"]) for it in items)
    out = np.full((len(items), T + 1, NUM_OUTPUTS), np.nan, dtype=np.float32)
    with torch.inference_mode():
        for i, it in enumerate(items):
            text = torch.tensor(it["text_ids"], dtype=torch.long)
            prompt = torch.tensor(it["prompt_speech"], dtype=torch.long)
            cont = torch.tensor(it["continuation"], dtype=torch.long)
            # the prefill as vLLM hands it over: [SOS_ph, TASK_ID_ph, AUDIO_ph * Tp, text ids], the
            # placeholder block flagged multimodal, the prompt's speech embedded by embed_multimodal
            ph = torch.ones(2 + len(prompt), dtype=torch.long)
            ids = torch.cat([ph, text])
            is_mm = torch.cat([torch.ones(len(ph), dtype=torch.bool), torch.zeros(len(text), dtype=torch.bool)])
            mm = m.embed_multimodal(speech_token=prompt.reshape(1, -1)).reshape(len(prompt), -1)
            pre = m.embed_input_ids(ids, multimodal_embeddings=[mm], is_multimodal=is_mm)
            # then each decode step's input: a speech code, embedded by the text-free path
            dec = m.embed_input_ids(cont) if len(cont) else pre[:0]
            emb = torch.cat([pre, dec])
            pos = torch.arange(emb.shape[0])
            hidden = m.forward(input_ids=torch.zeros(emb.shape[0], dtype=torch.long), positions=pos,
                               inputs_embeds=emb).text_hidden_states
            logits = m.compute_logits(hidden[len(pre) - 1:])[:, :NUM_OUTPUTS]
            out[i, : len(cont) + 1] = logits.float().log_softmax(-1).numpy()
    np.save(a.out, out)
    log(f"{len(items)} inputs, {T + 1} steps")


def _sdpa_backend() -> None:
    """vllm-omni's SDPA attention backend, picked by hand: vllm-omni has no CPU platform, so its
    backend selector (the platform default) and the backends' platform dispatch both fail on
    CPU. SDPAImpl.forward_cuda is plain torch scaled_dot_product_attention."""
    from vllm_omni.diffusion.attention import layer
    from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend, SDPAImpl

    layer.get_attn_backend_for_role = lambda *a, **k: (SDPABackend, None)
    SDPAImpl.forward = SDPAImpl.forward_cuda


class _InjectedNoise:
    """Stands in for the ``torch`` module inside vllm-omni's cfm.py: ``torch.randn`` (called
    once per flow call, for the initial noise z) returns the injected noise's first frames, as
    upstream slices its fixed noise (``rand_noise[:, :, :mu.size(2)]``); everything else is torch."""

    def __init__(self, torch_mod, noise):
        self._torch, self._noise, self.calls = torch_mod, noise, 0

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def randn(self, size, device=None, dtype=None, **kw):
        self.calls += 1
        b, c, t = size
        if b != 1 or c != self._noise.shape[1] or t > self._noise.shape[2]:
            raise ValueError(f"injected noise {tuple(self._noise.shape)} cannot serve randn{tuple(size)}")
        return self._noise[:, :, :t].to(device=device, dtype=dtype).clone()


def _deep_update(d: dict, u: dict) -> None:
    for k, v in u.items():
        if isinstance(v, dict) and isinstance(d.get(k), dict):
            _deep_update(d[k], v)
        else:
            d[k] = v


def cmd_code2wav_mel(a) -> None:
    import numpy as np
    import torch

    _sdpa_backend()
    from vllm_omni.model_executor.models.cosyvoice3.code2wav_core import cfm
    from vllm_omni.model_executor.models.cosyvoice3.cosyvoice3_code2wav import CosyVoice3Code2Wav
    from vllm_omni.transformers_utils.configs.cosyvoice3 import CosyVoice3Config

    config = CosyVoice3Config()
    if a.flow_config:  # e.g. {"pre_lookahead_layer": {"channels": 64}, "decoder": {"estimator": {"dim": 64}}}
        _deep_update(config.flow, json.loads(Path(a.flow_config).read_text()))
    c2w = CosyVoice3Code2Wav(config)
    c2w.flow_model.load_state_dict(torch.load(os.path.join(a.model_dir, "flow.pt"), map_location="cpu"),
                                   strict=True)
    c2w.flow_model.eval()
    log("flow loaded")
    codes = torch.tensor(json.loads(Path(a.codes).read_text()), dtype=torch.long).reshape(1, -1)
    p = np.load(a.prompt)
    noise = torch.from_numpy(np.load(a.noise)).float()
    fake = _InjectedNoise(torch, noise)
    real, cfm.torch = cfm.torch, fake
    try:
        # what CosyVoice3Code2Wav.forward (the offline, non-streaming path) runs before HiFT
        mel = c2w._forward_mel(token=codes, prompt_token=torch.from_numpy(p["prompt_token"]).long(),
                               prompt_feat=torch.from_numpy(p["prompt_feat"]).float(),
                               embedding=torch.from_numpy(p["embedding"]).float(), n_timesteps=10,
                               token_offset_tokens=0, streaming=False, finalize=True)
    finally:
        cfm.torch = real
    if fake.calls != 1:
        raise RuntimeError(f"the flow drew its noise {fake.calls} times, expected once")
    np.save(a.out, mel.float().numpy())
    log(f"mel {tuple(mel.shape)} for {codes.shape[1]} codes")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tokenize")
    t.add_argument("--tokenizer-dir", required=True)
    t.add_argument("--texts", required=True)
    t.add_argument("--out", required=True)
    lp = sub.add_parser("llm-logprobs")
    lp.add_argument("--model-dir", required=True)
    lp.add_argument("--inputs", required=True)
    lp.add_argument("--out", required=True)
    c = sub.add_parser("code2wav-mel")
    c.add_argument("--model-dir", required=True)
    c.add_argument("--codes", required=True)
    c.add_argument("--prompt", required=True)
    c.add_argument("--noise", required=True)
    c.add_argument("--flow-config", default=None)
    c.add_argument("--out", required=True)
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    {"tokenize": cmd_tokenize, "llm-logprobs": cmd_llm_logprobs, "code2wav-mel": cmd_code2wav_mel}[a.cmd](a)


if __name__ == "__main__":
    main()
