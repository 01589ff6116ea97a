"""Stage 5, verify: FlexAttention against an eager reference that shares none of its code.

The reference computes scores in float64 (or float32 on request), applies the user's mods
directly to them, and takes the softmax with FlexAttention's documented convention for rows
with no kept key (output 0, log-sum-exp -inf). It works one chunk of queries at a time, so
memory is O(chunk x kv_len), and gets gradients chunk by chunk the same way (the loss is a sum
over query rows, so per-chunk gradients add up exactly).

Tolerances (TOLERANCES) are per run dtype; see the reasoning next to each.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import pandas as pd
import torch
from torch.nn.attention.flex_attention import BlockMask

from workbench import compat
from workbench.define import Mask, WorkbenchError, captured_scalars, choose_evaluator, evaluate_mod, index_reads
from workbench.run import FlexRun, Inputs, Shape, learnable_tensors, make_inputs, run_flex


# ---------------------------------------------------------------- tolerances

@dataclass(frozen=True)
class Tolerance:
    """An element passes when |got - ref| <= atol + rtol * |ref|; the tensor also needs
    ||got - ref||_F / ||ref||_F <= rel_fro."""

    atol: float
    rtol: float
    rel_fro: float
    why: str


TOLERANCES = {
    # Inputs are drawn in the run dtype and the reference upcasts those same values, so the
    # only error is the kernel's arithmetic and the final rounding of its output.
    "float64": Tolerance(1e-9, 1e-9, 1e-10, "float64 kernel vs float64 reference: summation order only"),
    "float32": Tolerance(2e-5, 2e-5, 1e-5,
                         "fp32 unit roundoff 6e-8; online softmax over up to 1e6 keys loses a few "
                         "hundred ulps in the worst row"),
    "tf32": Tolerance(5e-3, 5e-3, 2e-3, "TF32 matmuls keep 10 mantissa bits (roundoff 4.9e-4) on q.k and p.v; "
                      "errors average out over the head dim"),
    "float16": Tolerance(5e-3, 5e-3, 2e-3, "fp16 output rounding 4.9e-4 plus p cast to fp16 before p.v; "
                         "measured rel error ~3e-4"),
    "bfloat16": Tolerance(3e-2, 3e-2, 1e-2,
                          "bf16 output rounding 3.9e-3 plus p cast to bf16 before p.v; measured rel error "
                          "2.1e-3 on the H200 (same as SDPA flash), so 1e-2 leaves 5x room"),
}
# The log-sum-exp comes back in float32 whatever the dtype; scores are O(sqrt(D)) so it gets an
# absolute tolerance of its own.
LSE_TOLERANCE = {"float64": Tolerance(1e-9, 1e-9, 1e-10, "float64"),
                 "float32": Tolerance(1e-4, 1e-5, 1e-5, "fp32 log-sum-exp"),
                 "tf32": Tolerance(2e-2, 2e-3, 2e-3, "tf32 q.k"),
                 "float16": Tolerance(1e-2, 2e-3, 2e-3, "lse from fp16-rounded scores"),
                 "bfloat16": Tolerance(2e-2, 4e-3, 4e-3, "lse from the kernel's fp32 scores of bf16 inputs")}


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
    from workbench.blocks import device_memory

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
            from workbench.compat import raise_recompile_limit
            from workbench.define import broadcast_indices

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
    the sum) -- what one worker of a split reference computes (`workbench.distribute`). `state`: a
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


# ---------------------------------------------------------------- comparing

AXES = {"out": ("b", "h", "q", "d"), "lse": ("b", "h", "q"), "dq": ("b", "h", "q", "d"),
        "dk": ("b", "h_kv", "kv", "d"), "dv": ("b", "h_kv", "kv", "d")}


@dataclass
class TensorCheck:
    """One tensor compared with the reference."""

    name: str
    max_abs_err: float
    rel_err: float  # ||got - ref||_F / ||ref||_F (finite entries)
    worst: dict[str, int]  # index of the largest error, by axis name
    worst_got: float
    worst_ref: float
    bad_count: int  # elements outside atol + rtol * |ref| (NaN counts as bad)
    nan_count: int
    inf_count: int  # infinities where the reference is finite (or of the other sign)
    numel: int
    atol: float
    rtol: float
    rel_tol: float
    passed: bool
    ref_norm: float = 0.0  # ||ref||_F and ||got - ref||_F over finite entries (checks of row ranges merge with them)
    err_norm: float = 0.0


def compare(name: str, got: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> TensorCheck:
    got = got.to(ref.device, torch.float64)
    ref = ref.to(torch.float64)
    nan = torch.isnan(got) | torch.isnan(ref)  # NaN on either side never passes
    same_inf = torch.isinf(got) & torch.isinf(ref) & (torch.sign(got) == torch.sign(ref))
    bad_inf = torch.isinf(got) & ~same_inf
    ref_inf = torch.isinf(ref) & ~same_inf  # reference says -inf (dead row) and the kernel does not
    finite = torch.isfinite(got) & torch.isfinite(ref)
    diff = torch.where(finite, (got - ref).abs(), torch.zeros((), dtype=torch.float64, device=ref.device))
    diff = torch.where(nan | bad_inf | ref_inf, torch.full((), float("inf"), dtype=torch.float64, device=ref.device), diff)
    limit = tol.atol + tol.rtol * torch.where(finite, ref.abs(), torch.zeros((), dtype=torch.float64, device=ref.device))
    bad = diff > limit
    ref_f = torch.where(finite, ref, 0.0)
    norm = float(torch.linalg.vector_norm(ref_f))
    err_f = float(torch.linalg.vector_norm(torch.where(finite, got - ref, 0.0)))
    rel = err_f / norm if norm > 0 else err_f
    flat = int(torch.argmax(diff))
    index = list(torch.unravel_index(torch.tensor(flat), diff.shape)) if diff.dim() else []
    axes = AXES.get(name, tuple(f"dim{i}" for i in range(diff.dim())))
    worst = {axis: int(i) for axis, i in zip(axes, index)}
    max_abs = float(diff.max()) if diff.numel() else 0.0
    n_nan, n_inf, n_bad = int(nan.sum()), int((bad_inf | ref_inf).sum()), int(bad.sum())
    passed = n_nan == 0 and n_inf == 0 and n_bad == 0 and rel <= tol.rel_fro
    return TensorCheck(name=name, max_abs_err=max_abs, rel_err=rel, worst=worst,
                       worst_got=float(got.reshape(-1)[flat]) if got.numel() else 0.0,
                       worst_ref=float(ref.reshape(-1)[flat]) if ref.numel() else 0.0,
                       bad_count=n_bad, nan_count=n_nan, inf_count=n_inf, numel=got.numel(), atol=tol.atol,
                       rtol=tol.rtol, rel_tol=tol.rel_fro, passed=passed, ref_norm=norm, err_norm=err_f)


def merge_checks(parts: list[tuple[TensorCheck, int]]) -> TensorCheck:
    """One check from checks of consecutive query-row ranges: (check, first row of its range)."""
    import dataclasses

    first = parts[0][0]
    worst_part, offset = max(parts, key=lambda p: p[0].max_abs_err)
    worst = dict(worst_part.worst)
    if "q" in worst:
        worst["q"] += offset
    norm = math.sqrt(sum(c.ref_norm ** 2 for c, _ in parts))
    err = math.sqrt(sum(c.err_norm ** 2 for c, _ in parts))
    rel = err / norm if norm > 0 else err
    n_nan, n_inf, n_bad = (sum(getattr(c, f) for c, _ in parts) for f in ("nan_count", "inf_count", "bad_count"))
    return dataclasses.replace(
        first, max_abs_err=worst_part.max_abs_err, rel_err=rel, worst=worst, worst_got=worst_part.worst_got,
        worst_ref=worst_part.worst_ref, bad_count=n_bad, nan_count=n_nan, inf_count=n_inf,
        numel=sum(c.numel for c, _ in parts), ref_norm=norm, err_norm=err,
        passed=n_nan == 0 and n_inf == 0 and n_bad == 0 and rel <= first.rel_tol)


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
    from workbench.blocks import block_classes, scan_blocks

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


# ---------------------------------------------------------------- the verdict

@dataclass
class Verdict:
    """FlexAttention vs the reference for one mask and one set of random inputs."""

    name: str
    shape: Shape
    dtype: str
    device: str
    seed: int
    compiled: bool
    checks: list[TensorCheck]
    findings: list[Finding]
    fully_masked_rows: int
    masked_row_examples: list[tuple[int, int, int]]
    compile_seconds: float | None
    run_seconds: float
    reference_seconds: float
    reference_dtype: str
    torch_version: str = torch.__version__
    backend: str = "flex"
    reference_fraction: float = 1.0  # the share of the Lq x Lk pairs whose scores the reference computed
    reference_mask_evaluation: str = "eager"  # how the reference computed the mask (Reference.mask_evaluation)
    reference_workers: list[dict] = field(default_factory=list)  # Reference.workers: each Ray worker's seconds

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks) and not any(f.severity == "error" for f in self.findings)

    @property
    def line(self) -> str:
        """The verdict in one line."""
        worst = max(self.checks, key=lambda c: (not c.passed, c.rel_err))
        state = "PASS" if self.passed else "FAIL"
        s = self.shape
        head = (f"{state} {self.name}: {self.dtype} on {self.device}, B={s.batch} Hq={s.q_heads} Hkv={s.kv_heads} "
                f"Lq={s.q_len} Lk={s.kv_len} D={s.head_dim}, seed {self.seed}")
        if not self.passed:
            failing = [c for c in self.checks if not c.passed]
            if failing:
                c = failing[0]
                where = ", ".join(f"{k}={v}" for k, v in c.worst.items())
                head += (f"; {c.name} off: max abs err {c.max_abs_err:.3g} at ({where}), rel err {c.rel_err:.3g}, "
                         f"{c.bad_count} bad, {c.nan_count} NaN")
            errors = [f for f in self.findings if f.severity == "error"]
            if errors:
                head += f"; {errors[0].message}"
            return head
        return head + f"; worst rel err {worst.rel_err:.2e} ({worst.name}), max abs err {max(c.max_abs_err for c in self.checks):.2e}"

    def __str__(self) -> str:
        return self.line

    def to_frame(self) -> pd.DataFrame:
        rows = []
        for c in self.checks:
            row = asdict(c)
            row["worst"] = ", ".join(f"{k}={v}" for k, v in c.worst.items())
            rows.append(row)
        return pd.DataFrame(rows).set_index("name")

    def to_dict(self) -> dict:
        out = {"name": self.name, "passed": self.passed, "dtype": self.dtype, "device": self.device,
               "seed": self.seed, "compiled": self.compiled, "backend": self.backend, **asdict(self.shape),
               "max_abs_err": max(c.max_abs_err for c in self.checks),
               "rel_err": max(c.rel_err for c in self.checks),
               "nan_count": sum(c.nan_count for c in self.checks),
               "fully_masked_rows": self.fully_masked_rows,
               "masked_row_examples": [list(x) for x in self.masked_row_examples],
               "compile_seconds": self.compile_seconds, "run_seconds": self.run_seconds,
               "reference_fraction": self.reference_fraction,
               "reference_mask_evaluation": self.reference_mask_evaluation,
               "reference_seconds": self.reference_seconds, "reference_dtype": self.reference_dtype,
               "torch": self.torch_version,
               "checks": {c.name: {k: v for k, v in asdict(c).items() if k != "name"} for c in self.checks},
               "findings": [asdict(f) for f in self.findings], "line": self.line}
        return _json_safe(out)


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def verify(mask: Mask, shape: Shape, *, dtype: str = "bfloat16", device: str | torch.device = "cpu",
           backward: bool = False, seed: int | None = None, compile: bool = True,
           block_mask: BlockMask | None = None, block_size: int | tuple[int, int] = 128,
           expected: Mask | None = None, reference_dtype: torch.dtype | None = None,
           memory_budget: int | None = None, progress: bool | None = None, backend: str = "flex",
           port_path=None, workers: int | None = None, address: str | None = None) -> Verdict:
    """Run `mask` through FlexAttention (backend="flex") or through its generated Triton port
    (backend="port": `workbench.port`, written to a temporary folder unless `port_path` names the
    file) and compare with the eager reference of `expected` (default: the same mask) on fresh
    random inputs.

    `block_mask`: use this block mask instead of building one (it is checked against the mask).
    `expected`: the attention the run should equal -- e.g. the intended mask when `mask` is a
    port or a draft. reference_dtype: float64 by default. `workers`: split the reference by query
    rows across that many Ray workers (one GPU each on a GPU; `address` joins a Ray cluster)."""
    from workbench.run import check_backward_device, check_device_dtype, dtype_name

    device = torch.device(device)
    dtype = dtype_name(dtype)
    check_device_dtype(device, dtype)
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise WorkbenchError(f"workers = {workers!r} must be a whole number of at least 1",
                             "pass workers >= 1 to split the reference, or None to compute it here", mask.name)
    expected = expected or mask
    reference_dtype = reference_dtype or torch.float64
    # fail before drawing inputs or compiling
    if backend not in ("flex", "port"):
        raise WorkbenchError(f"unknown backend {backend!r}", "use backend='flex' or 'port'", mask.name)
    if backend == "port":
        from workbench import port

        port.check_supported(shape.head_dim, dtype, mask.name)
    budget, _ = reference_budget(shape, backward, reference_dtype, device, memory_budget, mask.name)
    check_backward_device(backward, device, mask.name)
    inputs = make_inputs(shape, dtype, device, seed=seed, backward=backward)
    findings = mod_findings(mask, shape, device)
    before = _mod_snapshot(mask, shape, device)
    if block_mask is not None:
        from workbench.run import check_block_mask

        check_block_mask(block_mask, shape, mask.name)
        findings += block_mask_findings(mask, block_mask, shape)
    pool = None
    if workers and not backward:
        # each worker compares its rows of the kernel's output with its rows of the reference and
        # sends back only the statistics (dk / dv sum over every row, so a backward check gathers);
        # the workers start now and compute their rows while the kernel under test compiles and runs
        from workbench.distribute import compare_on_ray, start_rows_workers

        pool = start_rows_workers(expected, inputs, workers, dtype=reference_dtype, memory_budget=budget,
                                  address=address)
    try:
        if backend == "port":
            run = _run_port(mask, inputs, backward, port_path)
        else:
            run = run_flex(mask, inputs, block_mask=block_mask, block_size=block_size, backward=backward,
                           compile=compile)
    except BaseException:
        if pool is not None:
            pool.close()
        raise
    checks = None
    if pool is not None:
        checks, ref = compare_on_ray(expected, inputs, run.out, run.lse, workers, TOLERANCES[dtype],
                                     LSE_TOLERANCE[dtype], dtype=reference_dtype, memory_budget=budget,
                                     address=address, progress=progress is not False, pool=pool)
    elif workers:
        from workbench.distribute import reference_on_ray

        ref = reference_on_ray(expected, inputs, workers, backward=backward, dtype=reference_dtype,
                               memory_budget=budget, address=address, progress=progress is not False)
    else:
        ref = reference_attention(expected, inputs, backward=backward, dtype=reference_dtype,
                                  memory_budget=budget, progress=progress)
    if run.compile_error:
        findings.append(Finding("compile_failed", "warning",
                                f"torch.compile could not build this mask ({run.compile_error}); the mods are valid "
                                "and ran uncompiled, so the verdict judges uncompiled FlexAttention (same "
                                "semantics, dense memory). A serving path that compiles FlexAttention would fail "
                                "here: report the error to PyTorch, or port the mask (workbench port)"))
    nan_why = ref.nan_message(expected.name)
    if nan_why:
        findings.append(Finding("reference_nan", "error", nan_why))
    changed = _changed_roles(mask, shape, device, before)
    if changed:
        findings.append(Finding("stateful_mod", "error",
                                f"the {' and the '.join(changed)} gave other values after the run than before it, on "
                                "the same indices: it reads something that changes between calls (a global counter, "
                                "the clock, random numbers), so the kernel and the reference saw different masks and "
                                "no comparison can hold. Make it a pure function of its arguments and of tensors "
                                "captured once"))
    if checks is None:
        checks = [compare("out", run.out, ref.out, TOLERANCES[dtype])]
        if run.lse is not None:
            checks.append(compare("lse", run.lse, ref.lse, LSE_TOLERANCE[dtype]))
    if run.lse is None:
        findings.append(Finding("lse_not_checked", "info", "compiled FlexAttention on the CPU does not return the "
                                "log-sum-exp, so only the output was compared (run with --eager to check lse too)"))
    for name, g in ref.grads.items():
        got = run.grads.get(name)
        if got is None:
            got = torch.zeros_like(g)  # FlexAttention gave no gradient where the reference has one
        checks.append(compare(name, got, g, _grad_tolerance(dtype, name, g, shape)))
    if ref.fully_masked_rows:
        ex = ", ".join(f"(b={b}, h={h}, q={q})" for b, h, q in ref.masked_row_examples[:3])
        findings.append(Finding("fully_masked_rows", "warning",
                                f"{ref.fully_masked_rows} query row(s) keep no key, e.g. {ex}. FlexAttention returns 0 "
                                "there with lse = -inf; a softmax kernel (SDPA, FA with a dense mask) gives NaN or "
                                "uniform weights instead. Any port must special-case these rows"))
    name = mask.name if expected is mask else f"{mask.name} vs {expected.name}"
    return Verdict(name=name + (" (Triton port)" if backend == "port" else ""), shape=shape, dtype=dtype,
                   device=str(device), seed=inputs.seed, compiled=run.compiled, checks=checks, findings=findings,
                   fully_masked_rows=ref.fully_masked_rows, masked_row_examples=ref.masked_row_examples,
                   compile_seconds=run.compile_seconds, run_seconds=run.run_seconds, reference_seconds=ref.seconds,
                   reference_dtype=ref.dtype, backend=backend, reference_fraction=ref.computed_fraction,
                   reference_mask_evaluation=ref.mask_evaluation, reference_workers=ref.workers)


def _mod_snapshot(mask: Mask, shape: Shape, device) -> dict:
    """The mods' values on a small grid (the first rows and keys, one head and batch entry), to
    see whether a run changed them."""
    from workbench.define import probe_grid

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


def _changed_roles(mask: Mask, shape: Shape, device, before: dict) -> list[str]:
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


def _run_port(mask: Mask, inputs: Inputs, backward: bool, port_path=None) -> FlexRun:
    """The generated Triton port on `inputs`, timed (forward only)."""
    from workbench import port

    if backward:
        raise WorkbenchError("the Triton port is forward only", "drop --backward, or verify FlexAttention's backward "
                             "(--backend flex)", mask.name)
    shape = inputs.shape
    path = port_path or port.build(mask, shape.q_len, shape.kv_len, heads=shape.q_heads, batch=shape.batch)
    start = time.perf_counter()
    out, lse = port.run_file(path, inputs.q, inputs.k, inputs.v)
    if inputs.device.type == "cuda":
        torch.cuda.synchronize(inputs.device)
    return FlexRun(out=out, lse=lse, compiled=False, compile_seconds=None,
                   run_seconds=time.perf_counter() - start)


def _grad_tolerance(dtype: str, name: str, ref: torch.Tensor, shape: Shape | None = None) -> Tolerance:
    base = TOLERANCES[dtype]
    if name in ("dq", "dk", "dv"):
        # dk and dv sum over every query row: their size grows with the length, so the
        # elementwise check is looser and the Frobenius check carries the weight
        factor = 1 if name == "dq" else 4
        return Tolerance(base.atol * factor, base.rtol * factor, base.rel_fro * 2,
                         f"{base.why}; x{factor} for a gradient summed over rows")
    # a captured tensor's gradient sums over up to B x H x Lq x Lk pairs per entry (a bias table
    # entry collects every pair at its distance; the clamped last one most of them): its rounding
    # error scales with the largest entry, and for the Frobenius check with sqrt(pairs) roundoffs
    # of the kernel's float32 (float64) accumulation -- measured on an H200: 4.1e-5 for a
    # 65-entry table over 2 x 1024 x 1024 pairs in float32, 4x the plain float32 limit
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    pairs = shape.batch * shape.q_heads * shape.q_len * shape.kv_len if shape is not None else 1
    roundoff = 1.1e-16 if dtype == "float64" else 6e-8
    rel_fro = max(base.rel_fro * 2, 4 * math.sqrt(pairs) * roundoff)
    return Tolerance(base.atol * 4 + base.rtol * 4 * scale, base.rtol * 4, rel_fro,
                     f"{base.why}; entries are sums over many pairs, so errors scale with the largest "
                     f"(and with sqrt({pairs}) accumulation roundoffs)")
