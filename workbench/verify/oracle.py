"""The plain oracle: attention under a mask and score, written as directly as it can be. It is what
the fast reference (`reference.py`: sparse key sets, in-place softmax, split products, a compiled
mask at length) must equal, and tests check that it does on users' mods. Dense per chunk of query
rows, float64, mods evaluated exactly as FlexAttention calls them (vmapped over scalars);
differentiable, so its gradients check the reference's too. For small problems only."""

from __future__ import annotations

import math

import torch

from workbench import compat
from workbench.define import Mask

__all__ = ["oracle_attention"]


def oracle_attention(mask: Mask, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                     chunk: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, Hq, Lq, D], lse [B, Hq, Lq]) in float64 of q [B, Hq, Lq, D] over k, v [B, Hkv, Lk, D]
    (Hq a multiple of Hkv). A row that keeps no key gives out 0 and lse -inf (FlexAttention's
    convention). Gradients flow to q, k, v and to tensors the mods capture.

        >>> from workbench import make
        >>> q = k = v = torch.randn(1, 1, 4, 8, dtype=torch.float64)
        >>> out, lse = oracle_attention(make("causal"), q, k, v)
        >>> torch.allclose(out[0, 0, 0], v[0, 0, 0])   # the first query sees only the first key
        True
    """
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    # grouped-query attention: query head h reads kv head h // (Hq / Hkv)
    k, v = (t.double().repeat_interleave(Hq // Hkv, dim=1) for t in (k, v))
    q = q.double()
    b, h, kv = (torch.arange(n, device=q.device) for n in (B, Hq, Lk))
    outs, lses = [], []
    for q0 in range(0, Lq, chunk):
        q_idx = torch.arange(q0, min(Lq, q0 + chunk), device=q.device)
        scores = q[:, :, q_idx] @ k.transpose(-1, -2) * scale                 # [B, Hq, rows, Lk]
        if mask.score_mod is not None:
            scores = compat.vmap_bhqkv(mask.score_mod, b, h, q_idx, kv, score=scores).double()
        if mask.mask_mod is not None:
            keep = compat.vmap_bhqkv(mask.mask_mod, b, h, q_idx, kv).expand_as(scores)
            scores = scores.masked_fill(~keep, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)                                 # -inf where nothing is kept
        dead = torch.isneginf(lse)
        probs = torch.exp(scores - torch.where(dead, 0.0, lse).unsqueeze(-1))   # 0 in dead rows, not NaN
        outs.append(probs @ v)
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)
