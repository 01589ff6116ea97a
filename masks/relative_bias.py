import torch

from workbench import Mask
from masks._positions import query_offset


def relative_bias(max_distance: int = 64, seed: int = 0, q_len=None, kv_len=None, device=None) -> Mask:
    """Learned relative-position bias from a table (T5, Swin, Shaw et al. 2018): score' = score +
    table[clamp(p - kv_idx, -M, M) + M] with M = max_distance. The table here is random
    (N(0, 1), `seed`) so every entry is visible in the score view."""
    if max_distance < 0:
        raise ValueError("max_distance must be >= 0")
    generator = torch.Generator().manual_seed(seed)
    bias_table = torch.randn(2 * max_distance + 1, generator=generator).to(device or "cpu")
    offset = query_offset(q_len, kv_len)

    def relative_bias_score(score, b, h, q_idx, kv_idx):
        distance = (q_idx + offset - kv_idx).clamp(-max_distance, max_distance)
        return score + bias_table[distance + max_distance]

    return Mask(name=f"relative_bias_m{max_distance}", score_mod=relative_bias_score,
                params=dict(max_distance=max_distance, seed=seed), description=relative_bias.__doc__,
                data=dict(bias_table=bias_table), q_len=q_len if offset else None,
                kv_len=kv_len if offset else None)
