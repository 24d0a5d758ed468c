"""A small random-weight CosyVoice3 token2wav folder built with CosyVoice3's own classes.

Fun-CosyVoice3-0.5B-2512's weights cannot be had here; this folder has the token2wav half of
the released layout (cosyvoice3.yaml, flow.pt, hift.pt, campplus.onnx, speech_tokenizer_v3.onnx)
with upstream's cosyvoice3.yaml (FunAudioLLM/CosyVoice examples/libritts/cosyvoice3/conf at
ace7c47) shrunk: the same classes (``CausalMaskedDiffWithDiT`` with a ``PreLookaheadLayer`` and a
``DiT`` estimator in ``CausalConditionalCFM``; ``CausalHiFTGenerator`` with a
``CausalConvRNNF0Predictor``), the same sample rate, token rate, token/mel ratio and mel hop;
fewer DiT blocks, a narrower DiT, lookahead layer and vocoder. Random weights; the campplus and
speech-tokenizer stand-ins of ``cosyvoice2_tiny`` (the real input/output signatures).

The yaml keeps its ``llm:`` entry (``CosyVoice3LM`` over an empty CosyVoice-BlankEN/), the
``hifigan:`` training wrapper and a training-data processor entry: building any of them would fail
or import what token2wav does not need, so a backend that loads this folder proves it builds
only ``flow``, ``hift`` and ``feat_extractor``. It needs CosyVoice's code from a source checkout
(the PyPI package lacks CosyVoice3): ``build_cosyvoice3_token2wav(d, checkout)``.

``size="full"``: the released flow/HiFT shapes (DiT dim 1024, depth 22, 16 heads; HiFT 512
channels), random weights (about 1.4 GB on disk), for timing. The LLM half (llm.pt,
CosyVoice-BlankEN/) is tests/cosyvoice3_tiny.py's.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from cosyvoice2_tiny import _campplus, _speech_tokenizer, write_tone_wav  # noqa: E402

YAML_TEMPLATE = """\
# set random seed, so that you may reproduce your result.
__set_seed1: !apply:random.seed [1986]
__set_seed2: !apply:numpy.random.seed [1986]
__set_seed3: !apply:torch.manual_seed [1986]

sample_rate: 24000
llm_input_size: 896
llm_output_size: 896
spk_embed_dim: 192
qwen_pretrain_path: ''
token_frame_rate: 25
token_mel_ratio: 2
chunk_size: 25
num_decoding_left_chunks: -1

llm: !new:cosyvoice.llm.llm.CosyVoice3LM
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    speech_token_size: 6561
    length_normalized_loss: True
    lsm_weight: 0
    mix_ratio: [5, 15]
    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: !ref <qwen_pretrain_path>
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: 0.8
        top_k: 25
        win_size: 10
        tau_r: 0.1

flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithDiT
    input_size: 80
    output_size: 80
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: 6561
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: 3
    pre_lookahead_layer: !new:cosyvoice.transformer.upsample_encoder.PreLookaheadLayer
        in_channels: 80
        channels: {lookahead_channels}
        pre_lookahead_len: 3
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
        estimator: !new:cosyvoice.flow.DiT.dit.DiT
            dim: {dit_dim}
            depth: {dit_depth}
            heads: {dit_heads}
            dim_head: {dit_head_dim}
            ff_mult: 2
            mel_dim: 80
            mu_dim: 80
            spk_dim: 80
            out_channels: 80
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

hift: !new:cosyvoice.hifigan.generator.CausalHiFTGenerator
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
    conv_pre_look_right: 4
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor
        num_class: 1
        in_channels: 80
        cond_channels: {hift_channels}

hifigan: !new:cosyvoice.hifigan.hifigan.HiFiGan
    generator: !ref <hift>
    discriminator: !new:cosyvoice.hifigan.discriminator.MultipleDiscriminator
        mpd: !new:matcha.hifigan.models.MultiPeriodDiscriminator
        mrd: !new:cosyvoice.hifigan.discriminator.MultiResSpecDiscriminator
    mel_spec_transform: []

get_tokenizer: !name:cosyvoice.tokenizer.tokenizer.get_qwen_tokenizer
    token_path: !ref <qwen_pretrain_path>
    skip_special_tokens: True
    version: cosyvoice3
allowed_special: 'all'
feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1920
    num_mels: 80
    sampling_rate: !ref <sample_rate>
    hop_size: 480
    win_size: 1920
    fmin: 0
    fmax: null
    center: False

parquet_opener: !name:cosyvoice.dataset.processor.parquet_opener
data_pipeline: [ !ref <parquet_opener> ]
"""

# "tiny" for the tests; "full" is upstream's cosyvoice3.yaml (DiT dim 1024, depth 22, 16 heads of
# 64; lookahead 1024 channels; HiFT 512), the released model's shapes (332M flow, 21M HiFT)
COSYVOICE3_T2W_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(lookahead_channels=64, dit_dim=64, dit_depth=2, dit_heads=2, dit_head_dim=32, hift_channels=32),
    "full": dict(lookahead_channels=1024, dit_dim=1024, dit_depth=22, dit_heads=16, dit_head_dim=64,
                 hift_channels=512),
}


def build_cosyvoice3_token2wav(d: Path, checkout: str | None, seed: int = 0, size: str = "tiny") -> Path:
    """Write the folder (always rewrites) with CosyVoice3's classes from ``checkout`` (a CosyVoice
    source checkout with CosyVoice3) and return it."""
    import torch

    from ttsrl.families import family
    from ttsrl.reward.backends.cosyvoice_code import import_cosyvoice, load_yaml_without_llm

    import_cosyvoice(checkout, family("cosyvoice3").token2wav)
    d.mkdir(parents=True, exist_ok=True)
    (d / "cosyvoice3.yaml").write_text(YAML_TEMPLATE.format(**COSYVOICE3_T2W_SIZES[size]), encoding="utf-8")
    (d / "CosyVoice-BlankEN").mkdir(exist_ok=True)
    torch.manual_seed(seed)
    conf = load_yaml_without_llm(d / "cosyvoice3.yaml")
    g = torch.Generator().manual_seed(seed)
    # the DiT's modulations and output projection are zero-initialised upstream (adaLN-zero): such
    # a flow returns its noise whatever the codes and prompt, so those weights are drawn too
    flow = conf["flow"]
    with torch.no_grad():
        for p in flow.parameters():
            if not p.any():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    torch.save(flow.state_dict(), d / "flow.pt")
    # released hift.pt keys carry the training wrapper's "generator." prefix; CosyVoice strips it
    torch.save({f"generator.{k}": v for k, v in conf["hift"].state_dict().items()}, d / "hift.pt")
    _campplus(d / "campplus.onnx")
    _speech_tokenizer(d / "speech_tokenizer_v3.onnx")
    return d


def cosyvoice3_token2wav_with_prompts(root: Path, checkout: str | None) -> tuple[Path, Path]:
    """The tiny CosyVoice3 token2wav folder and a prompt folder of two speakers (spk_a: 1.2 s at
    16 kHz, spk_b: 1.0 s at 22.05 kHz), under ``root``."""
    model = build_cosyvoice3_token2wav(root / "CosyVoice3-t2w-tiny", checkout)
    prompts = root / "prompts"
    prompts.mkdir(exist_ok=True)
    write_tone_wav(prompts / "spk_a.wav", 1.2, 16000, 170.0)
    write_tone_wav(prompts / "spk_b.wav", 1.0, 22050, 230.0)
    return model, prompts
