from workbench import Mask

VARIANTS = [dict(align="top_left")]


def causal(align: str = "bottom_right", q_len=None, kv_len=None) -> Mask:
    """Causal (decoder) attention: a query sees itself and earlier keys.

    align="bottom_right" (FlashAttention >= 2.1, decoding / chunked prefill): query i is token
    i + Lk - Lq, keep iff kv_idx <= q_idx + Lk - Lq. align="top_left" (PyTorch SDPA's is_causal,
    the plain `q_idx >= kv_idx` mod): keep iff kv_idx <= q_idx. They agree when Lq == Lk.
    """
    if align not in ("bottom_right", "top_left"):
        raise ValueError(f"align must be 'bottom_right' or 'top_left', got {align!r}")
    offset = (kv_len - q_len) if (align == "bottom_right" and q_len and kv_len) else 0

    def causal_mask(b, h, q_idx, kv_idx):
        return q_idx + offset >= kv_idx

    return Mask(name=f"causal_{align}", mask_mod=causal_mask, params=dict(align=align),
                description=causal.__doc__, q_len=q_len if offset else None,
                kv_len=kv_len if offset else None)
