import torch

from workbench import Mask


def softcap(cap: float = 30.0) -> Mask:
    """Logit soft-capping (Gemma 2, Grok-1): score' = cap * tanh(score / cap), which bounds
    scores to (-cap, cap) and is near the identity for |score| << cap. FlashAttention's softcap,
    vLLM's logits_soft_cap."""
    if cap <= 0:
        raise ValueError("cap must be > 0")

    def softcap_score(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return Mask(name=f"softcap_{cap:g}", score_mod=softcap_score, params=dict(cap=cap),
                description=softcap.__doc__)
