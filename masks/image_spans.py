import torch

from workbench import Mask
from masks._positions import query_offset, sequence_length


def image_spans(spans: list[list[int]] | None = None, q_len=None, kv_len=None, device=None) -> Mask:
    """Bidirectional image spans inside causal text (Gemma 3, PaliGemma 2; vLLM's mm_prefix
    ranges): text is causal, and the tokens of one image attend to each other in both
    directions. `spans` are inclusive [start, end] token positions; when omitted, two images
    cover 10%-35% and 55%-70% of the sequence."""
    length = sequence_length(q_len, kv_len, 1024)
    if spans is None:
        spans = [[int(length * 0.10), int(length * 0.35) - 1], [int(length * 0.55), int(length * 0.70) - 1]]
    spans = [list(map(int, s)) for s in spans]
    for start, end in spans:
        if not 0 <= start <= end < length:
            raise ValueError(f"span [{start}, {end}] must satisfy 0 <= start <= end < {length} "
                             "(inclusive token positions inside the sequence)")
    span_id = torch.full((length,), -1, dtype=torch.int32)
    for k, (start, end) in enumerate(spans):
        if (span_id[start:end + 1] >= 0).any():
            raise ValueError(f"span [{start}, {end}] overlaps an earlier span; spans must be disjoint")
        span_id[start:end + 1] = k
    span_id = span_id.to(device or "cpu")
    offset = query_offset(q_len, kv_len)

    def image_spans_mask(b, h, q_idx, kv_idx):
        pos = q_idx + offset
        same_image = (span_id[pos] >= 0) & (span_id[pos] == span_id[kv_idx])
        return (pos >= kv_idx) | same_image

    return Mask(name=f"image_spans_{len(spans)}", mask_mod=image_spans_mask, params=dict(spans=spans),
                description=image_spans.__doc__, data=dict(span_id=span_id), q_len=q_len, kv_len=kv_len)
