from workbench import Mask
from masks._positions import query_offset


def causal_sliding_window(window: int = 256, q_len=None, kv_len=None) -> Mask:
    """Causal sliding window (Mistral, Gemma local layers): a query sees the `window` most recent
    tokens, itself included -- keep iff 0 <= p - kv_idx < window (vLLM's sliding_window=window,
    FlashAttention's window_size=(window - 1, 0))."""
    if window < 1:
        raise ValueError("window counts tokens including the query itself; it must be >= 1")
    offset = query_offset(q_len, kv_len)

    def causal_sliding_window_mask(b, h, q_idx, kv_idx):
        distance = q_idx + offset - kv_idx
        return (distance >= 0) & (distance < window)

    return Mask(name=f"causal_sliding_window_{window}", mask_mod=causal_sliding_window_mask,
                params=dict(window=window), description=causal_sliding_window.__doc__,
                q_len=q_len if offset else None, kv_len=kv_len if offset else None)
