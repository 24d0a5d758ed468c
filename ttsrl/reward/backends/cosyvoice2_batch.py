"""CosyVoice2's flow (token -> mel) for a whole batch at once: padded, masked.

CosyVoice's own ``CausalMaskedDiffWithXvec.inference`` takes one utterance
(``assert token.shape[0] == 1``) and its Euler solver allocates a CFG batch of exactly 2.
This module runs the same modules, with the same weights and the same fixed flow noise
(``CausalConditionalCFM.rand_noise``), over B utterances padded to the longest:

* encoder: each item is ``[prompt tokens, codes]`` padded on the right; the token
  embeddings of padding are zero (as in CosyVoice), and so are the frames after the
  input layer, which is what the one-utterance path's pre-lookahead convolution sees
  past its end (``F.pad`` zeros); attention masks padded keys; every other layer is
  causal or per frame, so padding never reaches a real frame;
* flow matching: 10 Euler steps with classifier-free guidance over a 2B batch
  (B conditioned, B unconditioned), the estimator masked per item.

What one utterance would get is returned per item: its mel frames after its own prompt.
The backend runs a server batch as ``length_groups`` (longest first, padding at most
``MAX_PADDING`` of each item), each group one padded batch.
``tests/test_cosyvoice2_batch.py`` checks the batched audio equals the one-utterance
audio up to float error. HiFT stays per utterance (see ``CosyVoiceToken2Wav``): its
source excitation draws noise shaped like the batch and its convolutions look ahead,
so a padded HiFT batch cannot give each utterance its one-utterance waveform.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

#: the most padding a length group may carry: its shortest item is at least 1 / (1 + this) of its
#: longest (prompt + codes), so padded frames stay under this share of the group's real frames
MAX_PADDING = 0.25


def length_groups(lengths: Sequence[int], max_padding: float = MAX_PADDING) -> list[list[int]]:
    """Indices of ``lengths`` in groups to run as one padded batch each: longest first, a
    group takes the next item while it is at least 1 / (1 + ``max_padding``) of the group's
    longest. Every index is in exactly one group."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[i] * (1 + max_padding) >= lengths[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _length_mask(lengths: torch.Tensor, total: int) -> torch.Tensor:
    """(B, 1, total) bool: True on each item's first ``lengths[i]`` frames."""
    return (torch.arange(total, device=lengths.device)[None, :] < lengths[:, None]).unsqueeze(1)


def encode(encoder, xs: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``UpsampleConformerEncoder.forward`` (non-streaming, finalize) over a padded batch;
    returns (frames (B, 2T, D), frame counts)."""
    from cosyvoice.utils.mask import add_optional_chunk_mask

    masks = _length_mask(lengths, xs.size(1))
    if encoder.global_cmvn is not None:
        xs = encoder.global_cmvn(xs)
    xs, pos_emb, masks = encoder.embed(xs, masks)
    xs = xs * masks.transpose(1, 2).to(xs.dtype)  # past its end, the lookahead must see zeros
    chunk = add_optional_chunk_mask(xs, masks, False, False, 0, 0, -1)
    xs = encoder.pre_lookahead_layer(xs)
    xs = encoder.forward_layers(xs, chunk, pos_emb, masks)
    xs, lengths = encoder.up_layer(xs.transpose(1, 2).contiguous(), lengths)
    xs = xs.transpose(1, 2).contiguous()
    masks = _length_mask(lengths, xs.size(1))
    xs, pos_emb, masks = encoder.up_embed(xs, masks)
    chunk = add_optional_chunk_mask(xs, masks, False, False, 0, 0, -1)
    xs = encoder.forward_up_layers(xs, chunk, pos_emb, masks)
    if encoder.normalize_before:
        xs = encoder.after_norm(xs)
    return xs, lengths


def flow_match(cfm, mu: torch.Tensor, mask: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
               n_timesteps: int = 10, temperature: float = 1.0) -> torch.Tensor:
    """``CausalConditionalCFM.forward`` + ``solve_euler`` (classifier-free guidance) for B items."""
    b, _, t_len = mu.shape
    x = cfm.rand_noise[:, :, :t_len].to(mu.device).to(mu.dtype).expand(b, -1, -1) * temperature
    t_span = torch.linspace(0, 1, n_timesteps + 1, device=mu.device, dtype=mu.dtype)
    if cfm.t_scheduler == "cosine":
        t_span = 1 - torch.cos(t_span * 0.5 * torch.pi)
    t, dt = t_span[0], t_span[1] - t_span[0]
    mask_in = torch.cat([mask, mask]).to(mu.dtype)
    mu_in = torch.cat([mu, torch.zeros_like(mu)])
    spks_in = torch.cat([spks, torch.zeros_like(spks)])
    cond_in = torch.cat([cond, torch.zeros_like(cond)])
    rate = cfm.inference_cfg_rate
    for step in range(1, len(t_span)):
        t_in = t.reshape(1).expand(2 * b).contiguous()
        out = cfm.forward_estimator(torch.cat([x, x]), mask_in, mu_in, t_in, spks_in, cond_in, False)
        guided, free = out[:b], out[b:]
        x = x + dt * ((1.0 + rate) * guided - rate * free)
        t = t + dt
        if step < len(t_span) - 1:
            dt = t_span[step + 1] - t
    return x.float()


@torch.inference_mode()
def flow_mels(flow, codes: Sequence[Sequence[int]], prompts: Sequence[dict], device) -> list[torch.Tensor]:
    """Mel (1, 80, frames) of each code sequence voiced by its prompt (``prompt_token``,
    ``prompt_feat``, ``embedding``: CosyVoice's ``frontend_zero_shot`` outputs)."""
    seqs = [torch.cat([p["prompt_token"].reshape(-1).to(device, torch.int32),
                       torch.as_tensor(list(c), dtype=torch.int32, device=device)]) for c, p in zip(codes, prompts)]
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int32, device=device)
    token = torch.zeros(len(seqs), int(lengths.max()), dtype=torch.int32, device=device)
    for i, s in enumerate(seqs):
        token[i, :len(s)] = s
    emb = torch.cat([p["embedding"].to(device).reshape(1, -1) for p in prompts])
    emb = flow.spk_embed_affine_layer(F.normalize(emb, dim=1))
    valid = _length_mask(lengths, token.size(1)).transpose(1, 2).to(emb.dtype)  # (B, T, 1)
    xs = flow.input_embedding(torch.clamp(token, min=0)) * valid
    h, frames = encode(flow.encoder, xs, lengths)
    h = flow.encoder_proj(h)
    cond = torch.zeros(h.shape[0], h.shape[1], flow.output_size, device=device, dtype=h.dtype)
    starts = []
    for i, p in enumerate(prompts):
        feat = p["prompt_feat"].to(device).reshape(-1, flow.output_size)
        cond[i, :feat.shape[0]] = feat
        starts.append(feat.shape[0])
    mask = _length_mask(frames, h.shape[1])
    feat = flow_match(flow.decoder, h.transpose(1, 2).contiguous(), mask, emb, cond.transpose(1, 2).contiguous())
    return [feat[i:i + 1, :, start:n] for i, (start, n) in enumerate(zip(starts, frames.tolist()))]
