"""CosyVoice3's own token2wav (DiT flow matching + causal HiFT vocoder), run with CosyVoice's code.

Code: a CosyVoice source checkout (``checkout``, ``--cosyvoice-checkout DIR``) at or after
upstream's dd2d926 (2025-08-20), where ``CosyVoice3Model``, ``CausalMaskedDiffWithDiT``,
``cosyvoice.flow.DiT`` and ``CausalHiFTGenerator`` first appear together; tested at ace7c47
(2026-03-16). The PyPI package cosyvoice-minicpmo (upstream 46dfe043, June 2025) predates
CosyVoice3: without a checkout, or with an older one, the backend says so before it builds
anything. CosyVoice3's DiT imports ``x_transformers`` (requirements-cpu.txt pins it).
Weights: a CosyVoice3 model folder (Fun-CosyVoice3-0.5B-2512): cosyvoice3.yaml, flow.pt,
hift.pt, campplus.onnx, speech_tokenizer_v3.onnx (llm.pt and CosyVoice-BlankEN/ are the LLM's).

Everything else is the cosyvoice2 backend's (:class:`CosyVoice2Token2Wav` with CosyVoice3's
family ``cosyvoice3``'s ``token2wav``): the yaml built without the LLM (only ``flow``, ``hift`` and
``feat_extractor``), CosyVoice's own ``CosyVoice3Model.token2wav`` (non-streaming, finalize) and
``CosyVoiceFrontEnd.frontend_zero_shot`` (its mel at 24 kHz, hop 480, trimmed to 2 frames per
25 Hz speech token; speech_tokenizer_v3; campplus), explicit devices, prompt features extracted
once per process and shared by the replicas, SIM as the cosine of campplus embeddings of the
audio at 16 kHz and of the prompt. The audio is 24 kHz, 960 samples per code (token_mel_ratio 2,
hop 480); the ASR resamples it to its own rate as for CosyVoice2.

Randomness is upstream's: ``CausalConditionalCFM`` draws its flow noise once when it is built
(``set_all_random_seed(0)``), and ``CausalHiFTGenerator``'s sine source draws its phases and
noise once when built, right after (from that seed's stream): the same codes and prompt give
the same waveform in any process. Each synthesis also seeds the replica's generator from the
codes, as the cosyvoice2 backend does, so nothing else drawn could differ between runs.

The cosyvoice2 backend's batched flow (``cosyvoice2_batch``) is CosyVoice2's encoder; CosyVoice3
voices one utterance at a time (``--cosyvoice-batch-flow`` is refused).
"""

from __future__ import annotations

from dataclasses import dataclass

from ttsrl.families import Token2WavSpec, family
from ttsrl.reward.backends.cosyvoice2 import CosyVoice2Config, CosyVoice2Token2Wav


@dataclass
class CosyVoice3Config(CosyVoice2Config):
    """``model_dir``: a CosyVoice3 model folder; ``checkout``: a CosyVoice source checkout with
    CosyVoice3 (None: the installed ``cosyvoice``, which must then have it)."""


class CosyVoice3Token2Wav(CosyVoice2Token2Wav):
    name = "cosyvoice3"
    family: Token2WavSpec = family("cosyvoice3").token2wav  # type: ignore[assignment]
    has_speaker_model = True  # campplus.onnx of the model folder

    def __init__(self, cfg: CosyVoice3Config):
        if cfg.batch_flow:
            raise ValueError("--cosyvoice-batch-flow batches CosyVoice2's flow encoder; backend cosyvoice3 "
                             "voices one utterance at a time (start without it)")
        super().__init__(cfg)
