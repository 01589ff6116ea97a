import torch

from workbench import Mask
from masks._positions import query_offset


def per_head_window(windows: list[int] | None = None, q_len=None, kv_len=None, device=None) -> Mask:
    """A causal sliding window of a different width per head (multi-scale heads, as in
    Mixture-of-Sparse-Attention or MoA): head h sees the windows[h] most recent tokens.
    The mask is defined for len(windows) heads."""
    windows = list(windows or [32, 64, 128, 256, 512, 1024, 2048, 4096])
    if any(w < 1 for w in windows):
        raise ValueError("every window must be >= 1")
    window_of_head = torch.tensor(windows, dtype=torch.int32, device=device or "cpu")
    offset = query_offset(q_len, kv_len)

    def per_head_window_mask(b, h, q_idx, kv_idx):
        distance = q_idx + offset - kv_idx
        return (distance >= 0) & (distance < window_of_head[h])

    return Mask(name=f"per_head_window_{len(windows)}heads", mask_mod=per_head_window_mask,
                params=dict(windows=windows), description=per_head_window.__doc__,
                data=dict(window_of_head=window_of_head), heads=len(windows),
                q_len=q_len if offset else None, kv_len=kv_len if offset else None)
