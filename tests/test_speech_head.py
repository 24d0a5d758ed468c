"""The speech head multiplies only the speech rows: same logits and gradients as the full
biased product with every non-speech logit replaced by MASKED_LOGIT (the definition)."""

import torch

from ttsrl.model.modeling_cosyvoice2 import MASKED_LOGIT, SpeechHead


def reference(head: SpeechHead, hidden: torch.Tensor) -> torch.Tensor:
    logits = hidden @ head.weight.T + head.bias
    start, end = head.output_range
    ids = torch.arange(logits.shape[-1])
    return logits.masked_fill((ids < start) | (ids >= end), MASKED_LOGIT)


def test_speech_head_equals_the_masked_full_product_in_values_and_gradients():
    torch.manual_seed(0)
    head = SpeechHead(16, 50, (20, 43))
    with torch.no_grad():
        head.bias.normal_()
    hidden = torch.randn(3, 5, 16, requires_grad=True)
    target = torch.randint(20, 43, (3, 5))

    grads = []
    for fn in (reference, SpeechHead.forward):
        head.zero_grad()
        hidden.grad = None
        out = fn(head, hidden)
        assert out.shape == (3, 5, 50)
        # the loss verl takes: log-softmax over the whole row, gathered at the sampled ids
        loss = -out.log_softmax(-1).gather(-1, target[..., None]).mean() + 0.1 * out.softmax(-1).pow(2).sum()
        loss.backward()
        grads.append((out.detach(), head.weight.grad.clone(), head.bias.grad.clone(), hidden.grad.clone()))
    (ref, gw_ref, gb_ref, gh_ref), (got, gw, gb, gh) = grads
    # the same rows of the same matmul, computed over a slice instead of the whole head: float32
    # sums of 16 products, equal to a few eps; gradients sum over 15 positions (rtol 1e-5)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    assert (got[..., :20] == MASKED_LOGIT).all() and (got[..., 43:] == MASKED_LOGIT).all()
    torch.testing.assert_close(gw, gw_ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gb, gb_ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gh, gh_ref, rtol=1e-5, atol=1e-7)
    assert gw[:20].abs().sum() == 0 and gw[43:].abs().sum() == 0 and gw[20:43].abs().sum() > 0


def test_speech_head_on_a_single_vector_and_at_the_vocabulary_edges():
    torch.manual_seed(1)
    for rng in ((0, 50), (0, 7), (44, 50)):
        head = SpeechHead(8, 50, rng)
        h = torch.randn(8)
        torch.testing.assert_close(head(h), reference(head, h[None])[0], rtol=1e-6, atol=1e-6)
