"""The traps a verification explains: block masks that skip kept pairs or mark masked blocks full,
mods that give other values called directly than traced, captured numbers that compile again,
and mods that change between calls."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask

from workbench.blocks import block_classes, scan_blocks
from workbench.define import Mask, captured_scalars, choose_evaluator, evaluate_mod, probe_grid
from workbench.run import Shape

__all__ = ["Finding", "block_mask_findings", "mod_findings", "_mod_snapshot", "_changed_roles"]


# ---------------------------------------------------------------- the traps

@dataclass
class Finding:
    """Something about this mask or run that changes what the numbers mean."""

    kind: str  # fully_masked_rows | block_mask_drops_pairs | block_mask_full_not_full | eager_vs_traced | captured_scalars
    severity: str  # "error" fails the verdict; "warning" and "info" do not
    message: str


def block_mask_findings(mask: Mask, block_mask: BlockMask, shape: Shape) -> list[Finding]:
    """Compare a given block mask with the blocks the mask_mod really needs: blocks it skips
    that hold kept pairs lose them; blocks it marks full that hold masked pairs skip the mask_mod."""

    q_block, kv_block = block_mask.BLOCK_SIZE
    # every head and batch entry: a broadcast block mask must fit all of them
    scan = scan_blocks(mask, shape.q_len, shape.kv_len, heads=shape.q_heads, batch=shape.batch,
                       block_size=(q_block, kv_block),
                       device=block_mask.kv_num_blocks.device, progress=False)
    rows, cols = scan.block_rows, scan.block_cols
    dense = _visited(block_mask, rows, cols)  # 0 skipped, 1 partial, 2 full
    needed = block_classes(scan).to(dense.device, torch.int8)  # same codes as _visited
    dense, needed = torch.broadcast_tensors(dense, needed)
    found = []
    lost = (dense == 0) & (needed > 0)
    if lost.any():
        bb, hh, r, c = (int(x) for x in lost.nonzero()[0])
        found.append(Finding("block_mask_drops_pairs", "error",
                             f"the block mask skips {int(lost.sum())} block(s) holding kept pairs, first at "
                             f"b={bb}, h={hh}, q {r * q_block}..{min(shape.q_len, (r + 1) * q_block) - 1}, "
                             f"kv {c * kv_block}..{min(shape.kv_len, (c + 1) * kv_block) - 1}: FlexAttention "
                             "never visits them, so those pairs are silently dropped (uncompiled FlexAttention applies the mask_mod to "
                             "every pair and hides this). Rebuild it from this mask_mod"))
    wrong_full = (dense == 2) & (needed == 1)
    if wrong_full.any():
        bb, hh, r, c = (int(x) for x in wrong_full.nonzero()[0])
        found.append(Finding("block_mask_full_not_full", "error",
                             f"the block mask marks {int(wrong_full.sum())} block(s) full that hold masked pairs, "
                             f"first at b={bb}, h={hh}, q block {r}, kv block {c}: the mask_mod is not applied "
                             "there, so masked pairs are attended"))
    return found


def _visited(block_mask: BlockMask, rows: int, cols: int) -> torch.Tensor:
    """[B, H, rows, cols] int8: 2 where the block mask lists a block as full, 1 as partial."""
    out = torch.zeros(*block_mask.kv_num_blocks.shape[:2], rows, cols, dtype=torch.int8,
                      device=block_mask.kv_num_blocks.device)
    for num, idx, value in ((block_mask.kv_num_blocks, block_mask.kv_indices, 1),
                            (block_mask.full_kv_num_blocks, block_mask.full_kv_indices, 2)):
        if num is None:
            continue
        num, idx = num[..., :rows], idx[..., :rows, :]
        valid = torch.arange(idx.shape[-1], device=idx.device) < num.unsqueeze(-1)
        idx = torch.where(valid, idx.long(), cols)  # park unused slots past the end
        tmp = torch.zeros(*out.shape[:3], cols + 1, dtype=torch.int8, device=out.device)
        tmp.scatter_(-1, idx.clamp(max=cols), torch.full_like(idx, value, dtype=torch.int8))
        out = torch.maximum(out, tmp[..., :cols])
    return out


def mod_findings(mask: Mask, shape: Shape, device) -> list[Finding]:
    found = []
    scalars = {**captured_scalars(mask.mask_mod), **captured_scalars(mask.score_mod)}
    if scalars:
        shown = ", ".join(f"{k}={v!r}" for k, v in list(scalars.items())[:6])
        found.append(Finding("captured_scalars", "info",
                             f"the mods capture Python numbers ({shown}); torch.compile bakes them into the "
                             "kernel, so each new value compiles again (seconds each). To sweep a value without "
                             "recompiling, capture it as a 0-d tensor instead"))
    if mask.mask_mod is not None:
        choice = choose_evaluator(mask.mask_mod, shape.q_len, shape.kv_len, min(shape.batch, 2),
                                  min(shape.q_heads, 2), device, size=32)
        if choice.differs_at is not None:
            q_range, kv_range = choice.differs_at
            found.append(Finding("eager_vs_traced", "warning",
                                 f"called directly on broadcast index tensors the mask_mod gives other values "
                                 f"than FlexAttention's traced (vmapped) view, e.g. in q {q_range}, kv {kv_range}. "
                                 "FlexAttention uses the traced values, and so does this verifier; code that "
                                 "calls the mod directly (dense masks, other kernels) will disagree. Usual "
                                 "cause: Python `and`/`or`/`not` or in-place ops on index tensors"))
    return found


def _mod_snapshot(mask: Mask, shape: Shape, device) -> dict:
    """The mods' values on a small grid (the first rows and keys, one head and batch entry), to
    see whether a run changed them."""

    q, kv = probe_grid(min(shape.q_len, 64), min(shape.kv_len, 64), 16, device)
    one = torch.zeros(1, dtype=torch.int32, device=device)
    score = torch.randn(1, 1, len(q), len(kv), generator=torch.Generator().manual_seed(0)).to(device)
    out = {}
    for role, mod in (("mask_mod", mask.mask_mod), ("score_mod", mask.score_mod)):
        if mod is None:
            continue
        try:
            with torch.no_grad():  # a few calls: a mod that drifts with its number of calls shows
                values = [evaluate_mod(mod, "vmap", one, one, q, kv, score if role == "score_mod" else None).clone()
                          for _ in range(SNAPSHOT_CALLS)]
        except Exception:  # (the run itself reports a mod that fails)
            continue
        out[role] = values[0]
        if not all(_same_values(v, values[0]) for v in values[1:]):
            out[role] = None  # changed already: reported as changed
    return {"grid": (q, kv, one, score), "values": out}


SNAPSHOT_CALLS = 8


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.nan_to_num(), b.nan_to_num()))


def _changed_roles(mask: Mask, before: dict) -> list[str]:
    q, kv, one, score = before["grid"]
    changed = []
    for role, mod in (("mask_mod", mask.mask_mod), ("score_mod", mask.score_mod)):
        if role not in before["values"]:
            continue
        try:
            with torch.no_grad():
                now = evaluate_mod(mod, "vmap", one, one, q, kv, score if role == "score_mod" else None)
        except Exception:
            changed.append(role)
            continue
        was = before["values"][role]
        if was is None or not _same_values(now, was):
            changed.append(role)
    return changed
