from workbench import Mask
from masks._positions import query_offset


def prefix_lm(prefix_len: int = 256, q_len=None, kv_len=None) -> Mask:
    """Prefix-LM (T5 / UniLM / PaliGemma): the first `prefix_len` tokens are visible to every
    query (bidirectional inside the prefix), the rest is causal."""
    if prefix_len < 0:
        raise ValueError("prefix_len must be >= 0")
    offset = query_offset(q_len, kv_len)

    def prefix_lm_mask(b, h, q_idx, kv_idx):
        return (kv_idx < prefix_len) | (q_idx + offset >= kv_idx)

    return Mask(name=f"prefix_lm_{prefix_len}", mask_mod=prefix_lm_mask, params=dict(prefix_len=prefix_len),
                description=prefix_lm.__doc__, q_len=q_len if offset else None,
                kv_len=kv_len if offset else None)
