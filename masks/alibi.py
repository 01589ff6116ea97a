import torch

from workbench import Mask
from masks._positions import query_offset


def alibi(num_heads: int = 8, q_len=None, kv_len=None, device=None) -> Mask:
    """ALiBi (Press et al. 2022; BLOOM, MPT): a linear distance penalty per head,
    score' = score - slope[h] * |p - kv_idx| with slopes 2^(-8(h+1)/H) (H a power of two, as in
    the paper). FlashAttention's alibi_slopes use the same |distance| form."""
    if num_heads < 1:
        raise ValueError("num_heads must be >= 1")
    slope = torch.tensor([2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)],
                         dtype=torch.float32, device=device or "cpu")
    offset = query_offset(q_len, kv_len)

    def alibi_score(score, b, h, q_idx, kv_idx):
        distance = (q_idx + offset - kv_idx).abs()
        return score - slope[h] * distance

    return Mask(name=f"alibi_{num_heads}heads", score_mod=alibi_score, params=dict(num_heads=num_heads),
                description=alibi.__doc__, data=dict(slope=slope), heads=num_heads,
                q_len=q_len if offset else None, kv_len=kv_len if offset else None)
