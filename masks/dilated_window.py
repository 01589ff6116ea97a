from workbench import Mask
from masks._positions import query_offset


def dilated_window(window: int = 64, dilation: int = 4, q_len=None, kv_len=None) -> Mask:
    """Dilated causal sliding window (Longformer's dilated heads; LongNet-style sparsity): a query
    sees `window` earlier keys spaced `dilation` apart, itself included -- keep iff
    d = p - kv_idx satisfies 0 <= d < window * dilation and d % dilation == 0. No dense
    FlashAttention window can express it."""
    if window < 1 or dilation < 1:
        raise ValueError("window and dilation must be >= 1")
    offset = query_offset(q_len, kv_len)

    def dilated_window_mask(b, h, q_idx, kv_idx):
        distance = q_idx + offset - kv_idx
        return (distance >= 0) & (distance < window * dilation) & (distance % dilation == 0)

    return Mask(name=f"dilated_window_{window}x{dilation}", mask_mod=dilated_window_mask,
                params=dict(window=window, dilation=dilation), description=dilated_window.__doc__,
                q_len=q_len if offset else None, kv_len=kv_len if offset else None)
