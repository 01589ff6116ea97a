from workbench import Mask
from masks._positions import query_offset


def block_diffusion(block: int = 128, q_len=None, kv_len=None) -> Mask:
    """Block diffusion / semi-autoregressive decoding (BD3-LM, Arriola et al. 2025; SSD-LM):
    tokens see every token of their own block (bidirectional) and all earlier blocks."""
    if block < 1:
        raise ValueError("block must be >= 1")
    offset = query_offset(q_len, kv_len)

    def block_diffusion_mask(b, h, q_idx, kv_idx):
        return kv_idx // block <= (q_idx + offset) // block

    return Mask(name=f"block_diffusion_{block}", mask_mod=block_diffusion_mask, params=dict(block=block),
                description=block_diffusion.__doc__, q_len=q_len if offset else None,
                kv_len=kv_len if offset else None)
