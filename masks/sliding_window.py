from workbench import Mask
from masks._positions import query_offset

VARIANTS = [dict(left=64, right=192)]


def sliding_window(left: int = 128, right: int = 128, q_len=None, kv_len=None) -> Mask:
    """Sliding window with left/right extents (Longformer local attention; FlashAttention's
    window_size=(left, right)): query at position p keeps keys p - left ... p + right."""
    if left < 0 or right < 0:
        raise ValueError("left and right are extents in tokens and must be >= 0")
    offset = query_offset(q_len, kv_len)

    def sliding_window_mask(b, h, q_idx, kv_idx):
        pos = q_idx + offset
        return (kv_idx >= pos - left) & (kv_idx <= pos + right)

    return Mask(name=f"sliding_window_l{left}_r{right}", mask_mod=sliding_window_mask,
                params=dict(left=left, right=right), description=sliding_window.__doc__,
                q_len=q_len if offset else None, kv_len=kv_len if offset else None)
