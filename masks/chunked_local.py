from workbench import Mask
from masks._positions import query_offset


def chunked_local(chunk: int = 256, q_len=None, kv_len=None) -> Mask:
    """Chunked local attention (Llama 4's iRoPE local layers; FlashAttention's attention_chunk):
    the sequence is cut into chunks of `chunk` tokens and a query sees earlier tokens of its own
    chunk only."""
    if chunk < 1:
        raise ValueError("chunk must be >= 1")
    offset = query_offset(q_len, kv_len)

    def chunked_local_mask(b, h, q_idx, kv_idx):
        pos = q_idx + offset
        return (pos // chunk == kv_idx // chunk) & (pos >= kv_idx)

    return Mask(name=f"chunked_local_{chunk}", mask_mod=chunked_local_mask, params=dict(chunk=chunk),
                description=chunked_local.__doc__, q_len=q_len if offset else None,
                kv_len=kv_len if offset else None)
