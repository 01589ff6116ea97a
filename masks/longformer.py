from workbench import Mask
from masks._positions import query_offset


def longformer(global_tokens: int = 16, window: int = 128, q_len=None, kv_len=None) -> Mask:
    """Global tokens + sliding window (Longformer, Beltagy et al. 2020; BigBird's global part):
    the first `global_tokens` positions attend to everything and are attended by everyone; the
    others see keys within `window` tokens on either side."""
    if global_tokens < 0 or window < 0:
        raise ValueError("global_tokens and window must be >= 0")
    offset = query_offset(q_len, kv_len)

    def longformer_mask(b, h, q_idx, kv_idx):
        pos = q_idx + offset
        local = (kv_idx >= pos - window) & (kv_idx <= pos + window)
        return local | (kv_idx < global_tokens) | (pos < global_tokens)

    return Mask(name=f"longformer_g{global_tokens}_w{window}", mask_mod=longformer_mask,
                params=dict(global_tokens=global_tokens, window=window), description=longformer.__doc__,
                q_len=q_len if offset else None, kv_len=kv_len if offset else None)
