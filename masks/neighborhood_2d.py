import math

from workbench import Mask
from masks._positions import query_offset, sequence_length


def neighborhood_2d(width: int | None = None, kernel: int = 7, q_len=None, kv_len=None) -> Mask:
    """2-D neighborhood attention (NATTEN, Hassani et al. 2023) over tokens laid out row-major
    on a grid `width` tokens wide: a token sees the kernel x kernel neighbourhood around it,
    shifted inward at the borders so every window is full (NATTEN's rule). Rows:
    height = ceil(length / width); by default the grid is as square as the length allows.
    """
    length = sequence_length(q_len, kv_len, 1024)
    width = width or math.isqrt(length - 1) + 1
    height = -(-length // width)
    if kernel < 1 or kernel > min(height, width):
        raise ValueError(f"kernel ({kernel}) must be between 1 and the grid's smaller side "
                         f"({height} rows x {width} columns)")
    half = kernel // 2
    offset = query_offset(q_len, kv_len)

    def neighborhood_2d_mask(b, h, q_idx, kv_idx):
        pos = q_idx + offset
        q_row, q_col = pos // width, pos % width
        kv_row, kv_col = kv_idx // width, kv_idx % width
        row_start = (q_row - half).clamp(0, height - kernel)
        col_start = (q_col - half).clamp(0, width - kernel)
        return ((kv_row >= row_start) & (kv_row < row_start + kernel)
                & (kv_col >= col_start) & (kv_col < col_start + kernel))

    return Mask(name=f"neighborhood_2d_{height}x{width}_k{kernel}", mask_mod=neighborhood_2d_mask,
                params=dict(width=width, kernel=kernel), description=neighborhood_2d.__doc__,
                q_len=q_len, kv_len=kv_len)
