"""The fast float64 reference: eager attention that shares none of FlexAttention's code.

It computes scores in float64 (or float32 on request), applies the user's mods directly, and takes
the softmax with FlexAttention's convention for rows with no kept key (output 0, log-sum-exp
-inf). It works one chunk of queries at a time, so memory is O(chunk x kv_len), and per chunk only
over the keys the mask_mod keeps for some row of the chunk (`sparse`); gradients come chunk by
chunk the same way (the loss is a sum over query rows, so per-chunk gradients add up exactly).
`oracle.py` beside it is the plain version of the same algorithm, and a test keeps them equal."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from workbench import compat
from workbench.blocks import device_memory
from workbench.compat import raise_recompile_limit
from workbench.define import Mask, WorkbenchError, broadcast_indices, choose_evaluator, evaluate_mod, index_reads
from workbench.run import Inputs, Shape, learnable_tensors

__all__ = ["Reference", "ReferenceState", "reference_attention", "reference_budget", "reference_bytes_per_row",
           "default_reference_budget", "COMPILED_MASK_ABOVE_PAIRS"]


# ---------------------------------------------------------------- the reference

@dataclass
class Reference:
    out: torch.Tensor
    lse: torch.Tensor
    grads: dict[str, torch.Tensor]
    dtype: str
    seconds: float
    chunk: int
    fully_masked_rows: int
    masked_row_examples: list[tuple[int, int, int]]  # (b, h, q)
    nan_pairs: list[tuple[int, int, int, int]] = field(default_factory=list)  # (b, h, q, kv) whose score is NaN
    nan_outputs: int = 0  # NaN entries in out and lse
    computed_fraction: float = 1.0  # pairs whose score the reference computed, over Lq x Lk
    mask_evaluation: str = "eager"  # how the mask_mod's booleans were computed (see MaskEvaluator)
    workers: list[dict] = field(default_factory=list)  # per Ray worker of a split reference: its busy seconds

    def nan_message(self, mask_name: str) -> str | None:
        """Where a NaN reference comes from, or None when it has none."""
        if not self.nan_outputs and not self.nan_pairs:
            return None
        where = ", ".join(f"(b={b}, h={h}, q={q}, kv={k})" for b, h, q, k in self.nan_pairs[:3])
        cause = (f"the score_mod gives NaN at kept pair(s) {where}" if self.nan_pairs else
                 "the inputs or the mods give NaN")
        return (f"the float64 reference of {mask_name} has {self.nan_outputs} NaN output value(s): {cause}. "
                "NaN never passes: a kernel that returns numbers there is not checked, and one that returns "
                "NaN is wrong. Guard the score_mod (torch.where / clamp) so every kept pair has a number")


def reference_bytes_per_row(shape: Shape, backward: bool, itemsize: int = 8) -> int:
    """Temporaries per query row: the scores and a score_mod's copy, worked on in place (forward),
    or scores, mask, probabilities... kept for the autograd graph of a backward chunk."""
    return shape.batch * shape.q_heads * shape.kv_len * itemsize * (3 if not backward else 20)


def default_reference_budget(device: torch.device) -> int:

    cap = (16 << 30) if device.type == "cuda" else (1 << 30)
    return int(min(cap, device_memory(device) // 4))


def reference_budget(shape: Shape, backward: bool, dtype: torch.dtype, device: torch.device,
                     memory_budget: int | None, name: str | None = None) -> tuple[int, int]:
    """(budget, bytes per query row) of the reference; an error when one row does not fit."""
    budget = memory_budget or default_reference_budget(device)
    per_row = reference_bytes_per_row(shape, backward, torch.finfo(dtype).bits // 8)
    if per_row > budget:
        raise WorkbenchError(
            f"one query row of the reference needs {per_row / 2**20:.0f} MiB (batch {shape.batch} x "
            f"{shape.q_heads} heads x {shape.kv_len} keys), over the {budget / 2**20:.0f} MiB budget",
            "use fewer heads or a smaller batch, or pass a larger memory_budget", name)
    return budget, per_row


# From this many pairs on a GPU, the reference computes the mask_mod's booleans through
# torch.compile of the mod on broadcast indices (one fused kernel writing 1 byte per pair) instead
# of eagerly (about 17 bytes of temporaries per pair for a sliding window: at 1M tokens, 6 of the
# window reference's 7 seconds). Checked bit for bit against the eager evaluation on the first and
# last chunks; a compile error or a difference falls back to eager. Scores and softmax stay eager.
COMPILED_MASK_ABOVE_PAIRS = 1 << 34


def compile_mask_here(device: torch.device, pairs: int) -> bool:
    return device.type == "cuda" and pairs >= COMPILED_MASK_ABOVE_PAIRS


class MaskEvaluator:
    """keep[b, h, q, kv] of a chunk of query rows `q_idx` over every key, eager or compiled."""

    def __init__(self, mod, how: str, b, h, kv, compiled: bool):
        self.mod, self.how, self.b, self.h, self.kv = mod, how, b, h, kv
        self.fused, self.checked, self.note = None, 0, None
        if compiled and how == "broadcast":

            raise_recompile_limit()
            self.fused = torch.compile(lambda q_idx: mod(*broadcast_indices(b, h, q_idx, kv)), dynamic=True)

    def eager(self, q_idx):
        return evaluate_mod(self.mod, self.how, self.b, self.h, q_idx, self.kv).to(torch.bool)

    def __call__(self, q_idx, check: bool = False):
        if self.fused is None:
            return self.eager(q_idx)
        try:
            got = self.fused(q_idx)
        except Exception as exc:  # torch.compile could not build the mod: evaluate it eagerly
            self.fused, self.note = None, f"eager (torch.compile failed: {type(exc).__name__})"
            return self.eager(q_idx)
        shape = (len(self.b), len(self.h), len(q_idx), len(self.kv))
        got = (got if isinstance(got, torch.Tensor) else torch.as_tensor(got, device=q_idx.device)).to(torch.bool)
        got = got.expand(shape) if tuple(got.shape) != shape else got
        if check and self.checked < 2:  # (an evaluator shared by row ranges: its first two checks)
            eager = self.eager(q_idx)
            if not torch.equal(got, eager):
                self.fused, self.note = None, "eager (the compiled mask differed from the eager one on a chunk)"
                return eager
            self.checked += 1
        return got

    @property
    def description(self) -> str:
        if self.note:
            return self.note
        if self.fused is not None:
            return f"torch.compile, equal to eager on {self.checked} checked chunk(s)"
        return "eager"


class ReferenceState:
    """What forward `reference_attention` calls over row ranges of one mask and one set of inputs
    share: k and v in the reference dtype and the mask's evaluator (its probes, compile and eager
    checks). A worker computing many ranges passes one State to each call; hold it only while
    those calls last, since it keeps k and v (at 1M tokens, 8 GiB in float64)."""

    def __init__(self):
        self.key, self.parts = None, {}


def reference_attention(mask: Mask, inputs: Inputs, *, backward: bool = False, dtype: torch.dtype = torch.float64,
                        scale: float | None = None, device: str | torch.device | None = None,
                        memory_budget: int | None = None, progress: bool | None = None,
                        sparse: bool = True, rows: tuple[int, int] | None = None,
                        state: ReferenceState | None = None) -> Reference:
    """Eager attention of `inputs` under `mask`, in `dtype`, a chunk of query rows at a time.
    `sparse`: per chunk, scores only for the keys the mask_mod keeps for some row of the chunk
    (what FlexAttention computes too); `computed_fraction` says how many pairs that was.
    `rows`: only the query rows [start, stop) (out, lse and dq hold those rows; dk, dv their part of
    the sum) -- what one worker of a split reference computes (`workbench.verify.distribute`). `state`: a
    ReferenceState shared by calls over other rows of the same mask and inputs (forward only)."""
    device = torch.device(device) if device is not None else inputs.device
    # the chunks' temporaries change size from chunk to chunk (rows x kept keys): with fixed-size
    # cached blocks the allocator would map new memory for most of them (130 GiB reserved for a
    # 27 GiB peak at 256K tokens on an H200); growable segments reuse what was freed
    with compat.expandable_segments(device):
        return _reference_attention(mask, inputs, backward=backward, dtype=dtype, scale=scale, device=device,
                                    memory_budget=memory_budget, progress=progress, sparse=sparse, rows=rows,
                                    state=state)


def _reference_attention(mask: Mask, inputs: Inputs, *, backward, dtype, scale, device, memory_budget, progress,
                         sparse, rows, state) -> Reference:
    from tqdm.auto import tqdm

    shape = inputs.shape
    device = torch.device(device) if device is not None else inputs.device
    budget, per_row = reference_budget(shape, backward, dtype, device, memory_budget, mask.name)
    chunk = max(1, min(shape.q_len, budget // per_row))
    scale = 1.0 / math.sqrt(shape.head_dim) if scale is None else scale
    group = shape.q_heads // shape.kv_heads

    def how(mod, role):
        if mod is None:
            return None
        try:
            return choose_evaluator(mod, shape.q_len, shape.kv_len, shape.batch, shape.q_heads, device, role=role,
                                    size=16 if role == "score" else 48).how
        except WorkbenchError as exc:
            raise exc.for_mask(mask.name)

    first, stop = rows or (0, shape.q_len)
    if not 0 <= first < stop <= shape.q_len:
        raise WorkbenchError(f"rows {rows} are not a range of the {shape.q_len} query rows", "pass (start, stop)",
                             mask.name)
    key = (id(mask), id(inputs), dtype, str(device))
    if state is not None and not backward and state.key == key:
        parts = state.parts
    else:
        parts = _reference_parts(mask, inputs, dtype, device, backward, how, (stop - first) * shape.kv_len)
        if state is not None and not backward:
            state.key, state.parts = key, parts
    mask_eval, score_eval, b, h, kv, k, v, v_ones, evaluate_keep = (parts[n] for n in (
        "mask_eval", "score_eval", "b", "h", "kv", "k", "v", "v_ones", "evaluate_keep"))
    learn = learnable_tensors(mask) if backward else {}
    out = torch.empty(shape.batch, shape.q_heads, stop - first, shape.head_dim, dtype=dtype, device=device)
    lse = torch.empty(shape.batch, shape.q_heads, stop - first, dtype=dtype, device=device)
    grads = {}
    if backward:
        grads = {"dq": torch.empty_like(out), "dk": torch.zeros_like(k), "dv": torch.zeros_like(v)}
        grads.update({f"d{n}": torch.zeros(t.shape, dtype=dtype, device=t.device) for n, t in learn.items()})
    masked_rows, examples, nan_pairs, pairs_computed = 0, [], [], 0
    show = progress if progress is not None else shape.q_len // chunk > 16
    t0 = time.perf_counter()
    # With a sparse reference the chunk adapts: as many rows as the keys they keep leave room for
    # (scores are rows x kept keys), at most what evaluating the mask over all keys allows.
    score_bytes_per_key = per_row // shape.kv_len  # per row and key: scores, probabilities, ...
    if not backward and mask.score_mod is None:  # only the scores, worked on in place, and the mask's bools
        score_bytes_per_key //= 2
    # the mask's own values are per (b, h) only where it reads them (else one broadcast copy)
    reads = index_reads(mask.mask_mod) if mask.mask_mod is not None else set()
    mask_entries = (shape.batch if "b" in reads else 1) * (shape.q_heads if "h" in reads else 1)
    mask_rows = max(1, budget // (mask_entries * shape.kv_len * 12))  # bool + index temporaries
    bar = tqdm(total=stop - first, desc=f"reference {mask.name}", disable=not show, leave=False, unit="row")
    q0, step = first, chunk
    while q0 < stop:
        q1 = min(stop, q0 + step)
        q_idx = torch.arange(q0, q1, device=device, dtype=torch.int32)
        with torch.set_grad_enabled(backward):
            keep, sel = None, slice(0, shape.kv_len)
            if mask.mask_mod is not None:
                # the mask_mod itself says which keys this chunk keeps (never the block mask under
                # test); scores are computed for those keys only -- a dropped key adds exactly 0
                keep = evaluate_keep(q_idx, check=q0 == first or q1 == stop)
                if sparse:
                    sel = _kept_columns(keep)
                    n_sel = len(range(shape.kv_len)[sel]) if isinstance(sel, slice) else len(sel)
                    fit = _whole_tiles(budget // (score_bytes_per_key * max(1, n_sel)))
                    if q1 - q0 > fit:  # these rows keep more keys than the last ones: take fewer of them
                        q1, q_idx = q0 + fit, q_idx[:fit]
                        if keep.shape[-2] > 1:  # (a mod that ignores q_idx gives one broadcast row)
                            keep = keep.narrow(-2, 0, fit)
                        sel = _kept_columns(keep)  # (fewer rows keep no more keys: it still fits)
                    keep = _take(keep, sel, -1)
            qc = inputs.q[:, :, q0:q1].detach().to(device, dtype).requires_grad_(backward)
            cols = _take(kv, sel, 0)
            # grouped-query attention: each kv head serves `group` query heads (only the kept keys are copied)
            k_use, v_use = _take(k, sel, 2), _take(v_ones if v_ones is not None else v, sel, 2)
            if group > 1:
                k_use, v_use = k_use.repeat_interleave(group, dim=1), v_use.repeat_interleave(group, dim=1)
            pairs_computed += (q1 - q0) * len(cols)

            def chunk_scores():
                if backward:
                    s = torch.matmul(qc, k_use.transpose(-1, -2)) * scale
                else:  # scaling the chunk's queries saves a pass over its scores
                    s = torch.matmul(qc * scale, k_use.transpose(-1, -2))
                if mask.score_mod is not None and len(cols):
                    s = evaluate_mod(mask.score_mod, score_eval, b, h, q_idx, cols, score=s).to(dtype)
                if not backward and not s.is_contiguous():
                    s = s.contiguous()  # a score_mod may return a broadcast view: work on a copy
                if keep is not None:
                    if backward:
                        s = s.masked_fill(~keep, float("-inf"))
                    else:
                        _mask_in_place(s, keep)
                return s

            scores = chunk_scores()
            if len(nan_pairs) < 4 and mask.score_mod is not None:  # from finite inputs only a score_mod makes NaN
                bad = torch.isnan(scores.detach())
                if bad.any():
                    for bb, hh, qq, kk in bad.nonzero()[: 4 - len(nan_pairs)].tolist():
                        nan_pairs.append((bb, hh, q0 + qq, int(cols[kk])))
            if backward:
                row_lse = torch.logsumexp(scores, dim=-1)
                dead = torch.isneginf(row_lse)
                # exp(-inf - -inf) is NaN: rows without a kept key get probability 0 (output 0)
                probs = torch.exp(scores - torch.where(dead, 0.0, row_lse).unsqueeze(-1))
                out_c = torch.matmul(probs, v_use)
            else:
                done = _softmax_times_v(scores, v_use, shape.head_dim, keep)
                if done is None:  # a row's sum left the range where exp needs no shift: scores again, shifted
                    done = _shifted_softmax_times_v(chunk_scores(), v_use[..., :shape.head_dim])
                out_c, row_lse, dead = done
        if backward:
            targets = [qc, k, v, *learn.values()]
            got = torch.autograd.grad(out_c, targets, inputs.grad_out[:, :, q0:q1].to(device, dtype), allow_unused=True)
            grads["dq"][:, :, q0 - first:q1 - first] = got[0]
            grads["dk"] += got[1]
            grads["dv"] += got[2]
            for name, g in zip(learn, got[3:]):
                if g is not None:
                    grads[f"d{name}"] += g.to(dtype)
        out[:, :, q0 - first:q1 - first] = out_c.detach()
        lse[:, :, q0 - first:q1 - first] = row_lse.detach()
        n_dead = int(dead.sum())
        if n_dead:
            masked_rows += n_dead
            if len(examples) < 8:
                for bb, hh, qq in dead.nonzero()[: 8 - len(examples)].tolist():
                    examples.append((bb, hh, q0 + qq))
        bar.update(q1 - q0)
        if sparse and mask.mask_mod is not None:
            step = _whole_tiles(min(mask_rows, budget // (score_bytes_per_key * max(1, len(cols)))))
        q0 = q1
    bar.close()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        # The chunks' temporaries change size from chunk to chunk (rows x kept keys), so the caching
        # allocator rarely reuses a freed block for the next chunk and maps new ones until the GPU
        # is full (135 GiB reserved for a 40 GiB peak at 1M tokens on an H200). Give them back:
        # the reference is the largest temporary user of a session (a worker's row ranges keep them).
        if rows is None:
            torch.cuda.empty_cache()
    return Reference(out=out, lse=lse, grads=grads, dtype=str(dtype).removeprefix("torch."),
                     seconds=time.perf_counter() - t0, chunk=chunk, fully_masked_rows=masked_rows,
                     masked_row_examples=examples, nan_pairs=nan_pairs,
                     nan_outputs=int(torch.isnan(out).sum()) + int(torch.isnan(lse).sum()),
                     computed_fraction=pairs_computed / ((stop - first) * shape.kv_len),
                     mask_evaluation=evaluate_keep.description if evaluate_keep is not None else "none")


def _reference_parts(mask: Mask, inputs: Inputs, dtype: torch.dtype, device: torch.device, backward: bool, how,
                     pairs: int) -> dict:
    """What every chunk of a reference reads (and a ReferenceState keeps for the next row ranges):
    how the mods are evaluated, the index vectors, k and v in `dtype` (forward: v with a column of
    ones) and the mask's evaluator (compiled for `pairs` pairs and more on a GPU). The mask and
    inputs are held too, so that the ids in a ReferenceState's key stay theirs."""
    shape = inputs.shape
    mask_eval, score_eval = how(mask.mask_mod, "mask"), how(mask.score_mod, "score")
    b = torch.arange(shape.batch, device=device, dtype=torch.int32)
    h = torch.arange(shape.q_heads, device=device, dtype=torch.int32)
    kv = torch.arange(shape.kv_len, device=device, dtype=torch.int32)
    k = inputs.k.detach().to(device, dtype).requires_grad_(backward)
    v = inputs.v.detach().to(device, dtype).requires_grad_(backward)
    v_ones = None
    if not backward:  # v and a column of ones: one product gives each row's output and its sum
        width = -(-(shape.head_dim + 1) // 8) * 8  # (padded with zeros to keep rows aligned)
        v_ones = torch.zeros(*v.shape[:-1], width, dtype=dtype, device=device)
        v_ones[..., :shape.head_dim] = v
        v_ones[..., shape.head_dim] = 1
        v = None
    evaluate_keep = None if mask.mask_mod is None else MaskEvaluator(mask.mask_mod, mask_eval, b, h, kv,
                                                                      compile_mask_here(device, pairs))
    return dict(mask_eval=mask_eval, score_eval=score_eval, b=b, h=h, kv=kv, k=k, v=v, v_ones=v_ones,
                evaluate_keep=evaluate_keep, mask=mask, inputs=inputs)


def _whole_tiles(rows: int) -> int:
    """A chunk's row count, down to a multiple of 64 from 64 on: the products' row tiles are then
    whole (178 rows would run as 256, a third of the work wasted)."""
    return max(1, rows if rows < 64 else rows // 64 * 64)


def _mask_in_place(scores: torch.Tensor, keep: torch.Tensor) -> None:
    """scores = -inf where keep is False, in place; keys every row keeps are not touched (only the
    span of keys some row drops is masked: for causal chunks, a narrow band)."""
    if not keep.shape[-1]:
        return
    dropped = ~_one_entry(keep).reshape(-1, keep.shape[-1]).all(0)
    where = dropped.nonzero().squeeze(-1)
    if len(where):
        a, b = int(where[0]), int(where[-1]) + 1
        scores[..., a:b].masked_fill_(~keep[..., a:b], float("-inf"))


def _sum_range(dtype: torch.dtype) -> tuple[float, float]:
    """Row sums of exp(scores) in this range came from no overflowing term and a largest term that
    is a normal number, with room for 2^24 keys: the unshifted softmax is exact to rounding."""
    info = torch.finfo(dtype)
    return info.tiny * 2.0 ** 40, info.max / 2.0 ** 40


def _softmax_times_v(scores: torch.Tensor, v_ones: torch.Tensor, head_dim: int, keep: torch.Tensor | None):
    """(softmax(scores) @ v, logsumexp, rows keeping nothing), or None when some row needs the
    shifted softmax. Works on `scores` in place (forward only) and in two passes over them: exp
    without subtracting the row max (in float64 exp(s) is exact to rounding for |s| < 700; random
    inputs give |s| of a few units), then one product with `v_ones` (v, then a column of ones),
    which gives each row's output and its sum. A sum outside `_sum_range`, or a non-finite output,
    means that row needs the shift, unless the row keeps no key (its sum is then exactly 0)."""
    scores.exp_()
    product = _matmul_long_k(scores, v_ones)
    total, out = product[..., head_dim], product[..., :head_dim]
    low, high = _sum_range(scores.dtype)
    odd = ~((total >= low) & (total <= high)) | ~torch.isfinite(out).all(-1)
    dead = torch.zeros_like(odd)
    if bool(odd.any()):
        if keep is None:
            return None
        keeps_some = _one_entry(keep).any(-1)  # (False for a chunk with no key columns)
        if bool((odd & keeps_some).any()):
            return None
        dead = odd  # rows that keep no key: their product is exactly 0, so out = 0
    out = out / torch.where(dead, 1.0, total).unsqueeze(-1)
    lse = torch.where(dead, float("-inf"), torch.log(total))
    return out, lse, dead


# A product over a long K with few output tiles (a chunk's probabilities times v: a few hundred
# rows, head_dim columns, up to millions of keys) leaves most of a GPU idle; cut K into pieces
# of this many keys, multiplied as one batch and summed.
SPLIT_K_PIECE = 8192


def _matmul_long_k(p: torch.Tensor, v: torch.Tensor, split: bool | None = None) -> torch.Tensor:
    """p @ v for p (..., M, K) and v (..., K, N) broadcast-free, split along K when K is long
    (`split`: None = on CUDA only)."""
    *lead, m, k = p.shape
    n = v.shape[-1]
    pieces = k // SPLIT_K_PIECE
    if split is None:
        split = p.device.type == "cuda"
    if not split or pieces < 4 or not p.is_contiguous() or tuple(v.shape[:-2]) != tuple(lead):
        return torch.matmul(p, v)
    p3, v3 = p.reshape(-1, m, k), v.reshape(-1, k, n)
    out = torch.empty(p3.shape[0], m, n, dtype=p.dtype, device=p.device)
    in_pieces = pieces * SPLIT_K_PIECE  # keys covered by whole pieces; the rest in one product
    for i in range(p3.shape[0]):
        # piece j of every row: columns [j * SPLIT_K_PIECE, (j + 1) * SPLIT_K_PIECE), a strided view
        rows = p3[i].as_strided((pieces, m, SPLIT_K_PIECE), (SPLIT_K_PIECE, k, 1))
        keys = v3[i, :in_pieces].reshape(pieces, SPLIT_K_PIECE, n)
        torch.sum(torch.bmm(rows, keys), dim=0, out=out[i])
        if in_pieces < k:
            out[i] += p3[i, :, in_pieces:] @ v3[i, in_pieces:]
    return out.reshape(*lead, m, n)


def _shifted_softmax_times_v(scores: torch.Tensor, v: torch.Tensor):
    """(softmax(scores) @ v, logsumexp, rows keeping nothing) with the row max subtracted first,
    for rows whose scores are too large or too small for `_softmax_times_v`; in place."""
    row_max = scores.amax(dim=-1, keepdim=True) if scores.shape[-1] else \
        scores.new_full((*scores.shape[:-1], 1), float("-inf"))
    dead = torch.isneginf(row_max.squeeze(-1))
    # rows without a kept key: shift by 0, so exp gives 0 (never NaN) and the output is 0
    scores.sub_(torch.where(torch.isneginf(row_max), 0.0, row_max)).exp_()
    total = scores.sum(dim=-1, keepdim=True)
    out = torch.matmul(scores, v) / torch.where(total == 0, 1.0, total)
    lse = torch.where(dead, float("-inf"), row_max.squeeze(-1) + torch.log(total.squeeze(-1)))
    return out, lse, dead


def _one_entry(keep: torch.Tensor) -> torch.Tensor:
    """A mask that ignores b or h comes expanded along it (stride 0): one entry stands for all."""
    for dim in (0, 1):
        if keep.dim() > 2 and keep.stride(dim) == 0:
            keep = keep.narrow(dim, 0, 1)
    return keep


def _kept_columns(keep: torch.Tensor) -> slice | torch.Tensor:
    """The keys any row of the chunk keeps (for any b, h): a slice when they are one run (so keys,
    values and `keep` are cut as views), else their indices."""
    base = _one_entry(keep)
    cols = base.reshape(-1, base.shape[-1]).any(0).nonzero().squeeze(-1)
    if len(cols) == 0:
        return slice(0, 0)
    start, stop = int(cols[0]), int(cols[-1]) + 1
    return slice(start, stop) if stop - start == len(cols) else cols


def _take(t: torch.Tensor, sel: slice | torch.Tensor, dim: int) -> torch.Tensor:
    """t's keys (along `dim`) chosen by _kept_columns."""
    if isinstance(sel, slice):
        return t.narrow(dim % t.dim(), sel.start, sel.stop - sel.start)
    return t.index_select(dim, sel)
