from workbench import Mask
from masks._positions import query_offset


def sinks_window(sinks: int = 4, window: int = 256, q_len=None, kv_len=None) -> Mask:
    """Attention sinks + causal sliding window (StreamingLLM, Xiao et al. 2023): a query sees the
    first `sinks` tokens and the `window` most recent ones (itself included), causally."""
    if sinks < 0 or window < 1:
        raise ValueError("sinks must be >= 0 and window >= 1")
    offset = query_offset(q_len, kv_len)

    def sinks_window_mask(b, h, q_idx, kv_idx):
        distance = q_idx + offset - kv_idx
        return (distance >= 0) & ((kv_idx < sinks) | (distance < window))

    return Mask(name=f"sinks{sinks}_window{window}", mask_mod=sinks_window_mask,
                params=dict(sinks=sinks, window=window), description=sinks_window.__doc__,
                q_len=q_len if offset else None, kv_len=kv_len if offset else None)
