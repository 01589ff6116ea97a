from workbench import Mask
from masks._positions import query_offset


def rswa(prefix_len: int = 128, window: int = 256, q_len=None, kv_len=None) -> Mask:
    """R-SWA, sliding window with a pinned prefix (vLLM's TritonAttention `rswa`): causal, and a
    query sees the first `prefix_len` tokens (a system prompt, an image) plus the `window` most
    recent tokens. Same structure as sinks_window, at prompt-sized prefixes."""
    if prefix_len < 0 or window < 1:
        raise ValueError("prefix_len must be >= 0 and window >= 1")
    offset = query_offset(q_len, kv_len)

    def rswa_mask(b, h, q_idx, kv_idx):
        distance = q_idx + offset - kv_idx
        return (distance >= 0) & ((kv_idx < prefix_len) | (distance < window))

    return Mask(name=f"rswa_p{prefix_len}_w{window}", mask_mod=rswa_mask,
                params=dict(prefix_len=prefix_len, window=window), description=rswa.__doc__,
                q_len=q_len if offset else None, kv_len=kv_len if offset else None)
