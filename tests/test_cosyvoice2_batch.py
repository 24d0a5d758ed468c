"""Batched CosyVoice2 token2wav: the flow over a padded, masked batch gives
each utterance the audio the one-by-one path gives it, up to float error. CosyVoice's own
flow/HiFT code on the tiny random CosyVoice2 folder of tests/cosyvoice2_tiny.py, on CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

for mod, why in (("cosyvoice.cli.model", "CosyVoice's runtime (cosyvoice-minicpmo)"), ("hyperpyyaml", "hyperpyyaml"),
                 ("onnx", "onnx"), ("matcha.utils.audio", "Matcha-TTS (cosyvoice-minicpmo)")):
    pytest.importorskip(mod, reason=f"{why} is not installed (bash scripts/install.sh installs it)")

sys.path.insert(0, str(Path(__file__).parent))
from cosyvoice2_tiny import tiny_folder_with_prompts  # noqa: E402

from ttsrl.reward.backends.cosyvoice import CosyVoiceConfig, CosyVoiceToken2Wav  # noqa: E402
from ttsrl.reward.backends.cosyvoice2_batch import MAX_PADDING, length_groups  # noqa: E402

#: batched vs serial waveform samples (in [-1, 1]): the same float32 math in another order, off by a
#: few hundred eps at most; 1e-4 is about three steps of 16-bit PCM, inaudible, while a wrong mask or
#: padding moves samples by O(0.1)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def t2w(tmp_path_factory):
    model, prompts = tiny_folder_with_prompts(tmp_path_factory.mktemp("cosyvoice2"), b_seconds=0.7)  # 2 lengths
    return CosyVoiceToken2Wav(CosyVoiceConfig(model_dir=str(model), family="cosyvoice2", prompt_dir=str(prompts), device="cpu"))


def codes(n, start=0):
    return [(start + 37 * i) % 6561 for i in range(n)]


def test_length_groups_bound_the_padding():
    lengths = [100, 51, 80, 125, 99, 50, 60, 126, 300, 1]
    groups = length_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))  # each index once
    for g in groups:
        longest = lengths[g[0]]
        assert longest == max(lengths[i] for i in g)
        assert all(lengths[i] * (1 + MAX_PADDING) >= longest for i in g)
    # 100 x 1.25 < 126 starts a group; 80 x 1.25 = 100 joins it
    assert [sorted(lengths[i] for i in g) for g in groups] == [[300], [125, 126], [80, 99, 100], [50, 51, 60], [1]]
    assert length_groups([7] * 5) == [[0, 1, 2, 3, 4]] and length_groups([]) == []


def test_batched_audio_equals_serial_audio(t2w):
    batch = [codes(25, 5), codes(3), codes(12, 9), codes(40, 2), codes(7, 1), codes(12, 9)]
    prompts = [t2w.prompts[i % 2] for i in range(len(batch))]
    sizes = [len(c) + p.data["prompt_token"].shape[-1] for c, p in zip(batch, prompts)]
    assert any(len(g) > 1 for g in length_groups(sizes)) and len(length_groups(sizes)) > 1  # padded groups, several
    assert t2w.prompts[0].data["prompt_token"].shape != t2w.prompts[1].data["prompt_token"].shape
    t2w.cfg.batch_flow = False
    serial = t2w.synthesize(batch, prompts)
    t2w.cfg.batch_flow = True
    try:
        batched = t2w.synthesize(batch, prompts)
    finally:
        t2w.cfg.batch_flow = False
    worst = 0.0
    for s, b, c in zip(serial, batched, batch):
        assert b.waveform.shape == s.waveform.shape == (len(c) * 960,)
        assert b.sample_rate == s.sample_rate and b.codes == s.codes
        worst = max(worst, float(np.abs(b.waveform - s.waveform).max()))
        assert np.abs(s.waveform).max() > 0.01  # audio, not silence
    print(f"largest |batched - serial| sample: {worst:.3g}")
    assert worst < TOLERANCE
    t2w.cfg.batch_flow = True
    try:
        one = t2w.synthesize([batch[0]], [prompts[0]])[0]
    finally:
        t2w.cfg.batch_flow = False
    assert np.array_equal(one.waveform, serial[0].waveform)  # a batch of one takes the serial path
