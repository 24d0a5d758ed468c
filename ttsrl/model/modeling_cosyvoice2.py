"""Qwen2 with a CosyVoice speech head: an lm_head with CosyVoice2's bias (none for CosyVoice3), and a fixed mask.

This file is self-contained on purpose: the converter copies it into every
Hugging Face checkpoint it writes (``auto_map`` points at it), so the checkpoint
loads with ``trust_remote_code=True`` anywhere, verl's FSDP actor included, while
``model_type`` stays ``qwen2`` (verl's Qwen paths still apply).

The class serves every family (its name is CosyVoice2's, kept so that existing checkpoints
load); the config says which head: ``speech_head_bias`` (absent: true, CosyVoice2) and
``speech_output_range``.

Differences from stock ``Qwen2ForCausalLM``:
- ``lm_head`` has a bias when ``config.speech_head_bias`` (CosyVoice2's ``llm_decoder`` has
  one; stock Qwen2 drops it; CosyVoice3's has none);
- logits outside ``config.speech_output_range`` (text ids, sos, task_id, padding) are
  replaced by ``MASKED_LOGIT``: the model can only ever emit speech and stop tokens.
  The mask is fixed, not a trainable bias, so optimiser weight decay cannot erode it.
  ``MASKED_LOGIT`` is finite so that ``p * logit`` (entropy) stays 0 and never NaN, also
  after division by a sampling temperature; exp(-1e4) is 0 in every float type.
- Only the speech rows are multiplied: the other logits are the constant whatever the weights
  say, so the head computes ``end - start`` columns, not ``vocab_size`` (6,564 of 151,936+ at
  full size; the same values and gradients as masking the full product).
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen2ForCausalLM

MASKED_LOGIT = -1.0e4


class SpeechHead(nn.Linear):
    """Biased output projection whose logits outside [start, end) are masked."""

    def __init__(self, in_features: int, out_features: int, output_range, bias: bool = True):
        super().__init__(in_features, out_features, bias=bias)
        self.output_range = (int(output_range[0]), int(output_range[1]))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        start, end = self.output_range
        speech = F.linear(hidden, self.weight[start:end], None if self.bias is None else self.bias[start:end])
        lead = speech.shape[:-1]
        below = speech.new_full((1,) * len(lead) + (start,), MASKED_LOGIT).expand(*lead, start)
        above = speech.new_full((1,) * len(lead) + (self.out_features - end,), MASKED_LOGIT)
        return torch.cat([below, speech, above.expand(*lead, self.out_features - end)], dim=-1)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", output_range={self.output_range}"


class CosyVoice2Qwen2ForCausalLM(Qwen2ForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        self.lm_head = SpeechHead(config.hidden_size, config.vocab_size, config.speech_output_range,
                                  bias=bool(getattr(config, "speech_head_bias", True)))
        self.post_init()

