import torch

from workbench import Mask
from masks._positions import query_offset, sequence_length

VARIANTS = [dict(causal=False)]

# Uneven split used when no lengths are given: documents of 10%, 30%, 15%, 25% and 20%.
DEFAULT_FRACTIONS = (0.10, 0.30, 0.15, 0.25, 0.20)


def document(doc_lengths: list[int] | None = None, causal: bool = True, q_len=None, kv_len=None,
             device=None) -> Mask:
    """Document masking for packed sequences: tokens attend only inside their own document,
    causally (causal=True, packed pre-training) or bidirectionally (causal=False, packed
    encoders). `doc_lengths` lists the documents in order and must cover the sequence; when
    omitted the sequence is split into five uneven documents."""
    length = sequence_length(q_len, kv_len, sum(doc_lengths) if doc_lengths else 1024)
    if doc_lengths is None:
        cuts = [round(length * sum(DEFAULT_FRACTIONS[:k])) for k in range(len(DEFAULT_FRACTIONS) + 1)]
        doc_lengths = [b - a for a, b in zip(cuts, cuts[1:]) if b > a]
    if any(n <= 0 for n in doc_lengths):
        raise ValueError(f"doc_lengths must be positive, got {doc_lengths}")
    if sum(doc_lengths) < length:
        raise ValueError(f"doc_lengths sum to {sum(doc_lengths)} but the sequence has {length} tokens; "
                         "give lengths that cover it, or omit doc_lengths to split it automatically")
    offset = query_offset(q_len, kv_len)
    document_id = torch.repeat_interleave(torch.arange(len(doc_lengths), dtype=torch.int32),
                                          torch.tensor(doc_lengths)).to(device or "cpu")

    def document_mask(b, h, q_idx, kv_idx):
        pos = q_idx + offset
        same_document = document_id[pos] == document_id[kv_idx]
        return same_document & (pos >= kv_idx) if causal else same_document

    kind = "causal" if causal else "bidirectional"
    return Mask(name=f"document_{kind}_{len(doc_lengths)}docs", mask_mod=document_mask,
                params=dict(doc_lengths=list(doc_lengths), causal=causal), description=document.__doc__,
                data=dict(document_id=document_id), q_len=q_len, kv_len=kv_len)
