"""Mods written the way users write them, shared by the tests and the interpreter scripts: tables
kept next to the mod (per-head windows, per-sample lengths, spans read with .any()), and_masks /
or_masks, attention-gym-style factories that name their closures."""

import torch

# ---------------------------------------------------------------- the bounds corpus (test_bounds, run_triton_scan)

W = torch.tensor([3, 40, 0, 17])  # per-head windows, the table a user keeps next to the mod
LENS = torch.tensor([120, 300])  # per-sample lengths
STARTS, ENDS = torch.tensor([10, 90, 200]), torch.tensor([40, 150, 260])


def per_head_table(b, h, q_idx, kv_idx):
    return ((q_idx - kv_idx).abs() <= W[h]) & (q_idx >= kv_idx)


def per_sample_lengths(b, h, q_idx, kv_idx):
    return (kv_idx < LENS[b]) & (q_idx < LENS[b])


def spans_any(b, h, q_idx, kv_idx):
    in_span = ((kv_idx >= STARTS) & (kv_idx < ENDS)).any()
    return in_span | (q_idx >= kv_idx)


def wraps_in_int32(b, h, q_idx, kv_idx):  # eager int32 arithmetic wraps past 2**31: so must the bounds
    return q_idx * 10_000_000 - kv_idx * 10_000_000 >= 0


def floors_below_zero(b, h, q_idx, kv_idx):
    return ((q_idx - kv_idx) // 7 >= -2) & ((kv_idx - q_idx) % 5 != 1)


def where_min_max(b, h, q_idx, kv_idx):
    near = torch.minimum(q_idx, kv_idx + 5) >= torch.clamp(kv_idx - 20, min=30)
    return torch.where(q_idx >= 100, near, torch.maximum(q_idx, kv_idx) < 77) & ~(kv_idx == 13)


def chunked(b, h, q_idx, kv_idx):
    return (q_idx // 64 == kv_idx // 64) & (q_idx * 2 >= kv_idx * 2 - 1)


SCRAMBLED = torch.randint(0, 50, (400,), generator=torch.Generator().manual_seed(5))  # a table read at q, kv
IMAGE = torch.zeros(400, dtype=torch.bool)
IMAGE[40:90] = IMAGE[200:230] = True  # Gemma-style image spans: bidirectional inside a span
SEGMENT = torch.repeat_interleave(torch.arange(7), torch.tensor([10, 60, 1, 99, 30, 50, 150]))  # sorted ids


def scrambled_table(b, h, q_idx, kv_idx):
    return (SCRAMBLED[q_idx] >= SCRAMBLED[kv_idx] - 45) & (q_idx >= kv_idx)


def image_spans(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) | (IMAGE[q_idx] & IMAGE[kv_idx] & (SEGMENT[q_idx] == SEGMENT[kv_idx]))


def sorted_segments_offset(b, h, q_idx, kv_idx):  # a sorted table read at shifted indices
    return (SEGMENT[q_idx] == SEGMENT[torch.clamp(kv_idx - 3, min=0)]) & (SEGMENT[kv_idx] <= SEGMENT[q_idx])


def generate_sliding_window(window_size: int):  # attention-gym's way: a factory naming its closure
    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= window_size) & (q_idx >= kv_idx)
    return sliding_window


def prefix(b, h, q_idx, kv_idx):
    return kv_idx < 64


def combined():  # torch's and_masks / or_masks over the above
    from torch.nn.attention.flex_attention import and_masks, or_masks

    return and_masks(or_masks(generate_sliding_window(50), prefix), per_head_table)


USER_MODS = [per_head_table, per_sample_lengths, spans_any, wraps_in_int32, floors_below_zero, where_min_max,
             chunked, scrambled_table, image_spans, sorted_segments_offset, generate_sliding_window(37), combined()]


# ---------------------------------------------------------------- knobs (test_knob, run_triton_scan)

KNOB_LENS = torch.tensor([3000, 4096])  # per-sample lengths, an undeclared table next to the mod
KNOB_STARTS, KNOB_ENDS = torch.tensor([10, 900, 2000]), torch.tensor([400, 1500, 2600])


def lengths_window(window):  # lens[b]: a per-sample table and a knob
    def lengths_window_mask(b, h, q_idx, kv_idx):
        return (kv_idx < KNOB_LENS[b]) & (q_idx >= kv_idx) & (q_idx - kv_idx < window)
    return lengths_window_mask


def spans_or_window(window):  # spans with .any(): evaluated under vmap, whatever the value
    def spans_or_window_mask(b, h, q_idx, kv_idx):
        in_span = ((kv_idx >= KNOB_STARTS) & (kv_idx < KNOB_ENDS)).any()
        return in_span | ((q_idx >= kv_idx) & (q_idx - kv_idx < window))
    return spans_or_window_mask


def generate_dilated(dilation):  # attention-gym style: a factory naming its closure
    def dilated(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & ((q_idx - kv_idx) % dilation == 0)
    dilated.__name__ = f"dilated_{dilation}"
    return dilated
