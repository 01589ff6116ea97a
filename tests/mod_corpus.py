"""Mods written the way people write them: the library, and user- and attention-gym-style
mods (undeclared per-head and per-sample tables, spans with `.any()`, torch's and_masks /
or_masks, score mods with exp2 and gelu, shifts, integer powers). Shared by the Triton coverage
test and the property tests. `corpus()` gives (Mask, batch, heads) at a small size."""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import and_masks, noop_mask, or_masks

from workbench import Mask, library, make

LENGTH = 96  # small: the interpreter evaluates every pair


def _user_mods() -> list[tuple[Mask, int, int]]:
    windows = torch.tensor([8, 16, 32, 64])
    lens = torch.tensor([10, 50])
    starts, ends = torch.tensor([10, 40, 70]), torch.tensor([19, 52, 80])
    spans = torch.tensor([[12, 30], [55, 70]])
    doc_id = torch.repeat_interleave(torch.arange(4), torch.tensor([20, 30, 16, 30]))
    bounds = torch.tensor([[0, 40], [20, 60], [30, 96], [0, 96]])
    offsets = torch.tensor([0, 5, 11])
    slopes = torch.exp2(-torch.arange(1, 5, dtype=torch.float32))
    bias = torch.randn(2 * LENGTH, generator=torch.Generator().manual_seed(0))
    head_bias = torch.tensor([0.5, -1.0, 2.0, 0.0])
    ids = torch.tensor([0, 2])
    lengths = torch.tensor([5, 9, 13])

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def window_16(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < 16

    def prefix_20(b, h, q_idx, kv_idx):
        return kv_idx < 20

    def per_head_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < windows[h])

    def per_sample_padding(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx >= q_idx - lens[b])

    def image_spans_any(b, h, q_idx, kv_idx):
        inside = (q_idx >= starts) & (q_idx <= ends) & (kv_idx >= starts) & (kv_idx <= ends)
        return inside.any() | (kv_idx <= q_idx)

    def spans_table_columns(b, h, q_idx, kv_idx):
        lo, hi = spans[:, 0], spans[:, 1]
        return ((q_idx >= lo) & (q_idx <= hi) & (kv_idx >= lo) & (kv_idx <= hi)).any() | (kv_idx <= q_idx)

    def document_causal(b, h, q_idx, kv_idx):
        return (doc_id[q_idx] == doc_id[kv_idx]) & (q_idx >= kv_idx)

    def per_head_bounds(b, h, q_idx, kv_idx):
        return (kv_idx >= bounds[h, 0]) & (kv_idx < bounds[h, 1]) & (kv_idx <= q_idx)

    def batch_and_head_shift(b, h, q_idx, kv_idx):
        return q_idx + offsets[b] + h >= kv_idx

    def block_causal_shift(b, h, q_idx, kv_idx):
        return (q_idx >> 4) >= (kv_idx >> 4)

    def chunked_floordiv(b, h, q_idx, kv_idx):
        return (q_idx // 24 == kv_idx // 24) & (kv_idx <= q_idx)

    def dilated_even(b, h, q_idx, kv_idx):
        return ((q_idx - kv_idx) % 2 == 0) & (kv_idx <= q_idx)

    def signed_pow2(b, h, q_idx, kv_idx):  # % and // by powers of two of negative numbers (a mask, a shift)
        return ((q_idx - kv_idx) % 4 == 1) | ((q_idx - kv_idx) // 8 == -2)

    def sinks_and_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((kv_idx < 4) | (q_idx - kv_idx < 24))

    def squared_distance(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx) ** 2 < 100

    def where_band(b, h, q_idx, kv_idx):
        return torch.where(q_idx < 48, kv_idx <= q_idx, (q_idx - kv_idx).abs() < 8)

    def clamped_window(b, h, q_idx, kv_idx):
        return kv_idx >= (q_idx - 12).clamp(min=0)

    def not_future(b, h, q_idx, kv_idx):
        return ~(kv_idx > q_idx)

    def logical_band(b, h, q_idx, kv_idx):
        return torch.logical_and(kv_idx <= q_idx, torch.logical_or(kv_idx < 8, q_idx - kv_idx < 8))

    def neighborhood_grid(b, h, q_idx, kv_idx):
        qr, qc, kr, kc = q_idx // 12, q_idx % 12, kv_idx // 12, kv_idx % 12
        return ((qr - kr).abs() <= 1) & ((qc - kc).abs() <= 1)

    def vector_of_lengths(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx < lengths[ids]).all() & (kv_idx <= q_idx)

    def alibi_gym_style(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def softcap_tanh(score, b, h, q_idx, kv_idx):
        return 20.0 * torch.tanh(score / 20.0)

    def gelu_score(score, b, h, q_idx, kv_idx):
        return torch.nn.functional.gelu(score)

    def exp2_decay(score, b, h, q_idx, kv_idx):
        return score + torch.exp2(-(q_idx - kv_idx).abs().float() / 16)

    def relative_bias_table(score, b, h, q_idx, kv_idx):
        return score + bias[q_idx - kv_idx + LENGTH]

    def head_bias_table(score, b, h, q_idx, kv_idx):
        return score + head_bias[h]

    def masked_region_bonus(score, b, h, q_idx, kv_idx):
        return torch.where(kv_idx < 8, score + 1.0, score)

    def mask(fn, heads=1, batch=1, score=None):
        if score is not None:
            return Mask(f"{fn.__name__}+{score.__name__}", mask_mod=fn, score_mod=score), batch, heads
        role = "score_mod" if fn.__code__.co_argcount == 5 else "mask_mod"
        return Mask(fn.__name__, **{role: fn}), batch, heads

    return [
        mask(per_head_window, heads=4), mask(per_sample_padding, batch=2), mask(image_spans_any),
        mask(spans_table_columns), mask(document_causal), mask(per_head_bounds, heads=4),
        mask(batch_and_head_shift, heads=2, batch=3), mask(block_causal_shift), mask(chunked_floordiv),
        mask(dilated_even), mask(signed_pow2), mask(sinks_and_window), mask(squared_distance), mask(where_band),
        mask(clamped_window), mask(not_future), mask(logical_band), mask(neighborhood_grid),
        mask(vector_of_lengths),
        (Mask("and_masks(causal, window_16)", mask_mod=and_masks(causal, window_16)), 1, 1),
        (Mask("or_masks(prefix_20, causal)", mask_mod=or_masks(prefix_20, causal)), 1, 1),
        (Mask("noop_mask", mask_mod=noop_mask), 1, 1),
        mask(causal, heads=4, score=alibi_gym_style), mask(softcap_tanh), mask(gelu_score),
        mask(exp2_decay), mask(causal, score=relative_bias_table), mask(head_bias_table, heads=4),
        mask(image_spans_any, score=softcap_tanh), mask(masked_region_bonus),
    ]


def _library() -> list[tuple[Mask, int, int]]:
    out = []
    for name in library():
        mask = make(name, q_len=LENGTH, kv_len=LENGTH)
        out.append((mask, 1, mask.heads or 1))
    return out


def corpus() -> list[tuple[Mask, int, int]]:
    """(mask, batch, heads) for every mod of the corpus, at LENGTH x LENGTH."""
    return _library() + _user_mods()
