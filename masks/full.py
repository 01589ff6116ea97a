from workbench import Mask


def full() -> Mask:
    """Full (bidirectional) attention: every query sees every key. Encoders, cross-attention."""

    def full_mask(b, h, q_idx, kv_idx):
        return q_idx >= 0

    return Mask(name="full", mask_mod=full_mask, description=full.__doc__)
