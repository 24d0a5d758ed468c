"""A small random-weight CosyVoice2 model folder built with CosyVoice's own classes.

CosyVoice2-0.5B's weights cannot be had here; this folder has the released layout
(cosyvoice2.yaml, flow.pt, hift.pt, campplus.onnx, speech_tokenizer_v2.onnx) with the
yaml of the real model shrunk (same classes, same sample rate, token rate and mel
hop; fewer blocks, heads and decoder/vocoder channels: the encoder's
lookahead and upsampling layers fix its width at 512), random weights, and ONNX stand-ins with the real input/output
signatures: campplus (1, T, 80) fbank -> (1, 192) embedding (random projection of the
per-bin mean square); speech tokenizer
(1, 128, T) log-mel + (1,) int32 length -> (1, T/4) token ids in 0..6560.
It also keeps the yaml's `llm:` entry (Qwen2LM over an empty CosyVoice-BlankEN/) and a
training-data processor entry: building either would fail, so a backend that loads this
folder proves it never constructs the LLM nor imports the data processors.
Used by tests/test_cosyvoice2.py and benchmarks/bench_token2wav.py.

``write_random_llm`` adds the LLM of CosyVoice2-0.5B's exact shape (``llm.pt`` with the
released key names, Qwen2-0.5B's config and a tokenizer of Qwen2's size in
CosyVoice-BlankEN/), and ``as_before_2025`` turns the yaml into the one a download from
before April 2025 has: with ``size="full"`` that is the released folder with random
weights, used by scripts/rehearsal.py and benchmarks/bench_convert.py.
"""

from __future__ import annotations

from pathlib import Path

YAML_TEMPLATE = """\
__set_seed1: !apply:torch.manual_seed [1986]
sample_rate: 24000
llm_input_size: 896
llm_output_size: 896
spk_embed_dim: 192
qwen_pretrain_path: ''
token_frame_rate: 25
token_mel_ratio: 2
chunk_size: 25
num_decoding_left_chunks: {dec_left_chunks}

llm: !new:cosyvoice.llm.llm.Qwen2LM
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    speech_token_size: 6561
    length_normalized_loss: True
    lsm_weight: 0
    mix_ratio: [5, 15]
    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: !ref <qwen_pretrain_path>

flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithXvec
    input_size: 512
    output_size: 80
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: 6561
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: 3
    encoder: !new:cosyvoice.transformer.upsample_encoder.UpsampleConformerEncoder
        output_size: 512
        attention_heads: {enc_heads}
        linear_units: {enc_units}
        num_blocks: {enc_blocks}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: True
        input_layer: 'linear'
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        input_size: 512
        use_cnn_module: False
        macaron_style: False
        static_chunk_size: !ref <chunk_size>
    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
        in_channels: 240
        n_spks: 1
        spk_emb_dim: 80
        cfm_params: !new:omegaconf.DictConfig
            content:
                sigma_min: 1e-06
                solver: 'euler'
                t_scheduler: 'cosine'
                training_cfg_rate: 0.2
                inference_cfg_rate: 0.7
                reg_loss_type: 'l1'
        estimator: !new:cosyvoice.flow.decoder.CausalConditionalDecoder
            in_channels: 320
            out_channels: 80
            channels: [{dec_channels}]
            dropout: 0.0
            attention_head_dim: {dec_head_dim}
            n_blocks: {dec_blocks}
            num_mid_blocks: {dec_mid}
            num_heads: {dec_heads}
            act_fn: 'gelu'
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

hift: !new:cosyvoice.hifigan.generator.HiFTGenerator
    in_channels: 80
    base_channels: {hift_channels}
    nb_harmonics: 8
    sampling_rate: !ref <sample_rate>
    nsf_alpha: 0.1
    nsf_sigma: 0.003
    nsf_voiced_threshold: 10
    upsample_rates: [8, 5, 3]
    upsample_kernel_sizes: [16, 11, 7]
    istft_params:
        n_fft: 16
        hop_len: 4
    resblock_kernel_sizes: [3, 7, 11]
    resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    source_resblock_kernel_sizes: [7, 7, 11]
    source_resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    lrelu_slope: 0.1
    audio_limit: 0.99
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.ConvRNNF0Predictor
        num_class: 1
        in_channels: 80
        cond_channels: {hift_channels}

feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1920
    num_mels: 80
    sampling_rate: !ref <sample_rate>
    hop_size: 480
    win_size: 1920
    fmin: 0
    fmax: 8000
    center: False

parquet_opener: !name:cosyvoice.dataset.processor.parquet_opener
data_pipeline: [ !ref <parquet_opener> ]
"""


def _campplus(path: Path) -> None:
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((80, 192)).astype(np.float32) * 0.1, "w")
    g = helper.make_graph(
        # the time mean of CosyVoice's mean-normalised fbank is zero: pool its square (per-bin
        # energy spread) so that different audio gets different, non-degenerate embeddings
        [helper.make_node("Mul", ["input", "input"], ["sq"]),
         helper.make_node("ReduceMean", ["sq"], ["m"], axes=[1], keepdims=0),
         helper.make_node("MatMul", ["m", "w"], ["output"])],
        "campplus_standin",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, "T", 80])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 192])], [w])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def _speech_tokenizer(path: Path) -> None:
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(rng.standard_normal((128, 6561)).astype(np.float32), "w"),
             numpy_helper.from_array(np.array([0], np.int64), "start"),
             numpy_helper.from_array(np.array([2 ** 62], np.int64), "end"),
             numpy_helper.from_array(np.array([2], np.int64), "axis"),
             numpy_helper.from_array(np.array([4], np.int64), "step")]
    g = helper.make_graph(
        [helper.make_node("Slice", ["feats", "start", "end", "axis", "step"], ["s"]),  # 100 Hz -> 25 Hz
         helper.make_node("Transpose", ["s"], ["t"], perm=[0, 2, 1]),
         helper.make_node("MatMul", ["t", "w"], ["logits"]),
         helper.make_node("ArgMax", ["logits"], ["tokens"], axis=2, keepdims=0)],
        "speech_tokenizer_v2_standin",
        [helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, "T"]),
         helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1])],
        [helper.make_tensor_value_info("tokens", TensorProto.INT64, [1, "N"])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))


# The flow/HiFT sizes: "tiny" for the tests; "full" is the upstream recipe's cosyvoice2.yaml
# (FunAudioLLM/CosyVoice examples/libritts/cosyvoice2/conf/cosyvoice2.yaml at 1c062ab: 6-block
# encoder with 8 heads and 2,048 units, decoder channels 256 with 4 blocks, 12 mid blocks, 8 heads
# of 64, streaming left chunks 2; HiFT at 512 base channels), which the released model ships.
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(enc_heads=2, enc_units=256, enc_blocks=1, dec_channels=32, dec_head_dim=16, dec_blocks=1,
                 dec_mid=1, dec_heads=2, dec_left_chunks=-1, hift_channels=32),
    "full": dict(enc_heads=8, enc_units=2048, enc_blocks=6, dec_channels=256, dec_head_dim=64, dec_blocks=4,
                 dec_mid=12, dec_heads=8, dec_left_chunks=2, hift_channels=512),
}
YAML = YAML_TEMPLATE.format(**SIZES["tiny"])


def build_tiny_cosyvoice2(d: Path, seed: int = 0, size: str = "tiny") -> Path:
    """Write the folder (idempotent per call site: always rewrites) and return it; ``size``
    "full" gives the released model's flow/HiFT shapes (random weights, about 500 MB on disk)."""
    import torch

    from ttsrl.reward.backends.cosyvoice_code import load_yaml_without_llm

    d.mkdir(parents=True, exist_ok=True)
    (d / "cosyvoice2.yaml").write_text(YAML_TEMPLATE.format(**SIZES[size]), encoding="utf-8")
    (d / "CosyVoice-BlankEN").mkdir(exist_ok=True)
    torch.manual_seed(seed)
    conf = load_yaml_without_llm(d / "cosyvoice2.yaml")
    torch.save(conf["flow"].state_dict(), d / "flow.pt")
    # released hift.pt keys carry the training wrapper's "generator." prefix; CosyVoice strips it
    torch.save({f"generator.{k}": v for k, v in conf["hift"].state_dict().items()}, d / "hift.pt")
    _campplus(d / "campplus.onnx")
    _speech_tokenizer(d / "speech_tokenizer_v2.onnx")
    return d


def as_before_2025(yaml: str) -> str:
    """The flow decoder as a CosyVoice2-0.5B yaml downloaded before CosyVoice's commit 1c062ab
    (April 2025) has it: ConditionalDecoder with `causal: True`, no chunk settings."""
    new = "estimator: !new:cosyvoice.flow.decoder.CausalConditionalDecoder\n"
    assert yaml.count(new) == 1
    yaml = yaml.replace(new, "estimator: !new:cosyvoice.flow.decoder.ConditionalDecoder\n"
                             "            causal: True   # the old key\n")
    for line in ("            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>\n",
                 "            num_decoding_left_chunks: !ref <num_decoding_left_chunks>\n"):
        assert yaml.count(line) == 1
        yaml = yaml.replace(line, "")
    return yaml


def qwen2_05b_config():
    """Qwen2.5-0.5B's config as CosyVoice-BlankEN/config.json has it (24 layers, hidden 896, 14
    heads / 2 KV heads, vocabulary 151,936, tied text head)."""
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                       architectures=["Qwen2ForCausalLM"])


def write_random_llm(d: Path, seed: int = 0) -> Path:
    """``d/llm.pt`` of CosyVoice2-0.5B's shapes and key names (random weights: N(0, 0.02),
    RMSNorm weights 1, the inner text head tied to the embedding as released) and
    ``d/CosyVoice-BlankEN/`` (Qwen2-0.5B's config, a synthetic tokenizer of Qwen2's exact
    size and special-token ids: ``qwen_sized_tokenizer``). About 2 GB; returns ``d/llm.pt``.

    The speech head is made to behave like a trained one in the two ways the pipeline can see:
    peaked (``llm_decoder.weight`` N(0, 0.1): logits of std ~3, so greedy picks are not
    near-ties) and stopping (the end-of-speech bias 10: above the top-25 cut, below the usual
    argmax, so sampled responses end after ~15-30 codes at varied lengths, as real ones do)."""
    import torch

    from ttsrl.atomic import atomic_torch_save
    from ttsrl.embedded.tiny_tokenizer import qwen_sized_tokenizer
    from ttsrl.model import vocab as V
    from ttsrl.model.convert import BLANK_EN
    from ttsrl.model.cosyvoice_lm import Qwen2LM

    cfg = qwen2_05b_config()
    qwen_sized_tokenizer().save_pretrained(d / BLANK_EN)
    cfg.save_pretrained(d / BLANK_EN)
    with torch.device("meta"):
        model = Qwen2LM(cfg)
    g = torch.Generator().manual_seed(seed)
    state = {k: (torch.ones(v.shape) if k.endswith("norm.weight") else torch.randn(v.shape, generator=g) * 0.02)
             for k, v in model.state_dict().items()}
    state["llm.model.lm_head.weight"] = state["llm.model.model.embed_tokens.weight"]  # tied
    state["llm_decoder.weight"] *= 5.0
    state["llm_decoder.bias"][V.family("cosyvoice2").eos_index] = 10.0
    atomic_torch_save(state, d / "llm.pt")
    return d / "llm.pt"


def write_tone_wav(path: Path, seconds: float = 1.5, rate: int = 16000, freq: float = 180.0) -> Path:
    """A voiced-like test prompt (harmonics + noise)."""
    import numpy as np
    import soundfile as sf

    t = np.arange(int(seconds * rate)) / rate
    rng = np.random.default_rng(int(freq))
    x = sum(np.sin(2 * np.pi * freq * k * t) / k for k in range(1, 6)) * 0.2 + 0.01 * rng.standard_normal(len(t))
    sf.write(str(path), x.astype(np.float32), rate)
    return path


def tiny_folder_with_prompts(root: Path, b_seconds: float = 1.0) -> tuple[Path, Path]:
    """The tiny CosyVoice2 folder and a prompt folder of two speakers (spk_a: 1.2 s at 16 kHz,
    spk_b: ``b_seconds`` at 22.05 kHz), under ``root``."""
    model = build_tiny_cosyvoice2(root / "CosyVoice2-tiny")
    prompts = root / "prompts"
    prompts.mkdir()
    write_tone_wav(prompts / "spk_a.wav", 1.2, 16000, 170.0)
    write_tone_wav(prompts / "spk_b.wav", b_seconds, 22050, 230.0)
    return model, prompts
