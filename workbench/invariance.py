"""Stage: invariance -- does one request get the same bits alone, batched, packed, padded, chunked?

A request is one sequence of L tokens with its mask (and score). `check` computes it alone, then
under other layouts a serving engine or an RL trainer uses -- other positions in a batch, packed
after another request (a document mask), kv padding, chunked prefill, decode of its last rows, and
simply again -- and compares the request's rows bit for bit. Each layout says why it can differ:
which tiling changed relative to the request.

    from workbench import invariance
    result = invariance.check("causal", q_len=3000, heads=8, head_dim=128, dtype="bfloat16", device="cuda")
    result.to_frame()

This module composes run (FlexAttention, eager) and port (the generated Triton kernel); it holds no
kernel of its own.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

import pandas as pd
import torch

from workbench import port
from workbench.blocks import dense_mask
from workbench.define import Mask, WorkbenchError, prepare
from workbench.run import FlexBackend, Inputs, PortBackend, Shape, backend_for, check_device_dtype, dtype_name

__all__ = ["check", "InvarianceOptions", "InvarianceResult", "LayoutResult", "compare", "LAYOUT_KEYS", "BACKENDS"]

BACKENDS = ("flex", "eager", "port")
LAYOUT_KEYS = ("run", "batch", "packed_aligned", "packed_unaligned", "padded", "chunked_aligned",
               "chunked_unaligned", "decode")
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class LayoutResult:
    """One layout of the request against the request alone."""

    key: str      # one of LAYOUT_KEYS (what --hold names)
    layout: str   # what was run, in words
    bitwise: bool
    max_abs_diff: float
    max_ulp: int
    first_diff: dict | None  # {"h", "q", "d", "alone", "here"} of the first differing element
    why: str
    held: bool = True  # the user asked this layout to hold
    # False: the layout does not compute the same attention (a chunk sees only the keys so far, but
    # the mask keeps later ones), so a difference says nothing of the kernel's bits
    same_attention: bool = True


@dataclass
class InvarianceResult:
    name: str
    backend: str
    dtype: str
    device: str
    shape: Shape
    block_size: tuple[int, int]
    layouts: list[LayoutResult] = field(default_factory=list)
    unrun: list[str] = field(default_factory=list)  # layouts that had to hold but did not run

    explicit_hold: bool = False  # the user named the layouts that must hold
    note: str = ""  # what the verdict means for this backend (uncompiled FlexAttention: differences expected)

    def _counted(self) -> list[LayoutResult]:
        """The held layouts a verdict counts: those computing the same attention as alone (all
        held ones when the user named them)."""
        return [r for r in self.layouts if r.held and (r.same_attention or self.explicit_hold)]

    @property
    def passed(self) -> bool:
        """Every held layout ran and was bitwise; a check of nothing does not pass."""
        held = self._counted()
        return bool(held) and not self.unrun and all(r.bitwise for r in held)

    @property
    def line(self) -> str:
        held = self._counted()
        broken = [r.key for r in held if not r.bitwise]
        other = sorted({r.key for r in self.layouts if not r.same_attention})
        verdict = "INVARIANT" if self.passed else "NOT CHECKED" if not held else "NOT INVARIANT"
        return (f"{verdict} {self.name} ({self.backend}, {self.dtype} on {self.device}, L={self.shape.q_len} "
                f"H={self.shape.q_heads} D={self.shape.head_dim}): {len(held) - len(broken)}/{len(held)} layouts "
                f"bitwise" + (f"; differs under {', '.join(broken)}" if broken else "")
                + (f"; not the same attention (the mask keeps later keys): {', '.join(other)}" if other else "")
                + (f"; held but not run: {', '.join(self.unrun)}" if self.unrun else "")
                + ("; no layout that must hold ran" if not held else "")
                + (f" ({self.note})" if self.note and broken else ""))

    def to_frame(self) -> pd.DataFrame:
        rows = [{k: v for k, v in asdict(r).items()} for r in self.layouts]
        return pd.DataFrame(rows).set_index("layout")

    def to_dict(self) -> dict:
        return {"passed": self.passed, "name": self.name, "backend": self.backend, "dtype": self.dtype,
                "device": self.device, "q_len": self.shape.q_len, "heads": self.shape.q_heads,
                "kv_heads": self.shape.kv_heads, "head_dim": self.shape.head_dim,
                "block_size": list(self.block_size), "layouts": [asdict(r) for r in self.layouts]}


# ---------------------------------------------------------------- the request under other layouts

def _shifted(mod: Callable | None, dq: int, dk: int, score: bool = False) -> Callable | None:
    """The mod seen from a layout whose query / key indices are the request's plus dq / dk."""
    if mod is None:
        return None
    if score:
        def shifted_score(s, b, h, q_idx, kv_idx):
            return mod(s, b, h, q_idx + dq, kv_idx + dk)
        return shifted_score

    def shifted_mask(b, h, q_idx, kv_idx):
        return mod(b, h, q_idx + dq, kv_idx + dk)
    return shifted_mask


def _request_only(mod: Callable | None, score: bool = False) -> Callable | None:
    """Every batch entry sees the request's own mask (b = 0): a mask that reads b stays the request's."""
    if mod is None:
        return None
    if score:
        def score_of_request(s, b, h, q_idx, kv_idx):
            return mod(s, b * 0, h, q_idx, kv_idx)
        return score_of_request

    def mask_of_request(b, h, q_idx, kv_idx):
        return mod(b * 0, h, q_idx, kv_idx)
    return mask_of_request


def _packed(mask: Mask, start: int) -> Mask:
    """Another request of `start` tokens (causal), then this one, in one sequence: a document mask.
    The request's mods see their own positions (index - start)."""
    mod, score = mask.mask_mod, mask.score_mod

    def packed_mask(b, h, q_idx, kv_idx):
        mine_q, mine_kv = q_idx >= start, kv_idx >= start
        own = (q_idx - start).clamp(min=0), (kv_idx - start).clamp(min=0)
        request = mine_kv & (mod(b, h, own[0], own[1]) if mod is not None else mine_kv)
        other = (~mine_kv) & (kv_idx <= q_idx)
        return torch.where(mine_q, request, other)

    def packed_score(s, b, h, q_idx, kv_idx):
        own = (q_idx - start).clamp(min=0), (kv_idx - start).clamp(min=0)
        return torch.where(q_idx >= start, score(s, b, h, own[0], own[1]), s)
    return Mask(f"{mask.name}_packed_after_{start}", mask_mod=packed_mask,
                score_mod=packed_score if score is not None else None, heads=mask.heads)


def _padded(mask: Mask, kv_len: int) -> Mask:
    mod = mask.mask_mod

    def padded_mask(b, h, q_idx, kv_idx):
        inside = kv_idx < kv_len
        return inside & mod(b, h, q_idx, kv_idx) if mod is not None else inside
    return Mask(f"{mask.name}_padded", mask_mod=padded_mask, score_mod=mask.score_mod, heads=mask.heads)


@dataclass
class _Plan:
    """One layout: the calls it makes (mask, q, k, v) and how to read the request's rows back."""

    key: str
    layout: str
    calls: list[tuple]  # (mask, q, k, v) or (mask, q, k, v, segment starts)
    rows: Callable[[list[torch.Tensor]], torch.Tensor]  # outputs of the calls -> [Hq, rows, D]
    q_rows: tuple[int, int]  # which of the request's rows the layout computes
    same: str   # why it can hold
    differs: str  # why it may not
    not_same: str = ""  # why this layout computes another attention than alone ("" when it does not)


def _plans(mask: Mask, q, k, v, others, block: tuple[int, int], batch: int, chunks: tuple[int, int],
           packs: tuple[int, int], padded_len: int, decode_rows: int) -> list[_Plan]:
    L = q.shape[2]
    qb, kb = block
    plans = [_Plan("run", "run again", [(mask, q, k, v)], lambda o: o[0][0], (0, L),
                   "the same call", "the kernel is not deterministic run to run (atomics or a split reduction)")]
    position = batch // 2 + 1 if batch > 1 else 0
    mine = Mask(mask.name, mask_mod=_request_only(mask.mask_mod), score_mod=_request_only(mask.score_mod, True),
                heads=mask.heads)
    for pos in sorted({0, min(position, batch - 1)}):
        def put(t, other, pos=pos):
            parts = [other[i:i + 1, :, :L] for i in range(batch - 1)]
            return torch.cat(parts[:pos] + [t] + parts[pos:], dim=0)
        plans.append(_Plan("batch", f"position {pos} of a batch of {batch}",
                           [(mine, put(q, others["q"]), put(k, others["k"]), put(v, others["v"]))],
                           lambda o, pos=pos: o[0][pos], (0, L),
                           "each (batch, head) is its own set of tiles; a bigger batch only adds programs",
                           "the kernel splits work by the batch size (e.g. a split-KV choice that depends on it)"))
    for start, key in zip(packs, ("packed_aligned", "packed_unaligned")):
        aligned = start % kb == 0
        pq = torch.cat([others["q"][:1, :, :start], q], dim=2)
        pk = torch.cat([others["k"][:1, :, :start], k], dim=2)
        pv = torch.cat([others["v"][:1, :, :start], v], dim=2)
        plans.append(_Plan(key, f"packed after a {start:,}-token request (document mask)",
                           [(_packed(mask, start), pq, pk, pv, [0, start, start + L])],
                           lambda o, s=start: o[0][0, :, s:], (0, L),
                           f"offset {start} is a multiple of the kv block {kb}: the request's keys fall into tiles of "
                           "the same composition as alone" if aligned else
                           f"offset {start} is not a multiple of the kv block {kb}, yet the sums agree",
                           f"kv tiles are cut at absolute positions: at offset {start} (not a multiple of the kv block "
                           f"{kb}) the request's keys are grouped into other tiles, so the online softmax adds them in "
                           "another order" if not aligned else
                           "the other request's empty tiles change the order of the request's own (unexpected)"))
    pad = padded_len - L
    plans.append(_Plan("padded", f"kv padded from {L:,} to {padded_len:,}, the tail masked",
                       [(_padded(mask, L), q, torch.cat([k, others["k"][:1, :, :pad]], 2),
                         torch.cat([v, others["v"][:1, :, :pad]], 2))], lambda o: o[0][0], (0, L),
                       "the request's keys keep their tiles; the padded tail only adds masked (skipped or "
                       "partial) tiles after them",
                       "the masked tail changes the tiles the request's keys are reduced in, or the kernel's "
                       "split of the keys"))
    later = _later_keys(mask, L, q.shape[1], q.device)
    for size, key in zip(chunks, ("chunked_aligned", "chunked_unaligned")):
        starts = list(range(0, L, size))
        calls = [(Mask(mask.name, mask_mod=_shifted(mask.mask_mod, s, 0), score_mod=_shifted(mask.score_mod, s, 0, True),
                       heads=mask.heads), q[:, :, s:s + size], k[:, :, :s + size], v[:, :, :s + size]) for s in starts]
        plans.append(_Plan(key, f"chunked prefill, chunks of {size:,} queries against the kv so far",
                           calls, lambda o: torch.cat([x[0] for x in o], dim=1), (0, L),
                           "a query row's keys are tiled from key 0 in every chunk, as alone; only the query tiles "
                           "move" + ("" if size % qb == 0 else f" (chunks of {size} are not a multiple of the q block {qb})"),
                           "the kernel picks its tiling or key split by the query count or the kv length of each call",
                           _not_same(later, [(st, min(L, st + size)) for st in starts])))
    first = L - decode_rows
    calls = [(Mask(mask.name, mask_mod=_shifted(mask.mask_mod, t, 0), score_mod=_shifted(mask.score_mod, t, 0, True),
                   heads=mask.heads), q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1]) for t in range(first, L)]
    plans.append(_Plan("decode", f"decode of the last {decode_rows} rows, one query per call", calls,
                       lambda o: torch.cat([x[0] for x in o], dim=1), (first, L),
                       "one query against the same keys, tiled from key 0",
                       "one query per call takes a decode path that splits the keys (split-KV) and adds the parts "
                       "in another order", _not_same(later, [(t, t + 1) for t in range(first, L)])))
    return plans


def _later_keys(mask: Mask, L: int, heads: int, device) -> torch.Tensor:
    """last[q]: the last key any head of the request keeps for row q (-1: none), from the mask_mod
    itself, a block of rows at a time."""
    last = torch.full((L,), -1, dtype=torch.int64)
    if mask.mask_mod is None:
        return torch.full((L,), L - 1, dtype=torch.int64)
    kv = torch.arange(L, device=device)
    step = max(1, (1 << 24) // max(1, L * heads))
    for q0 in range(0, L, step):
        keep = dense_mask(mask, (q0, min(L, q0 + step)), (0, L), heads=heads, device=device)[0].any(0)
        kept_at = torch.where(keep, kv, -1)
        last[q0:q0 + keep.shape[0]] = kept_at.max(-1).values.cpu()
    return last


def _not_same(last: torch.Tensor, calls: list[tuple[int, int]]) -> str:
    """Why calls over these row ranges (each seeing the keys before its range's end) compute another
    attention than alone, or ""."""
    for start, stop in calls:
        rows = last[start:stop]
        beyond = (rows >= stop).nonzero()
        if len(beyond):
            q = start + int(beyond[0])
            return (f"this layout does not compute the same attention: query {q} keeps key {int(last[q])}, after the "
                    f"last key its call sees ({stop - 1}); a chunk or decode step sees only the keys so far, while the "
                    "mask keeps later ones (bidirectional spans, prefixes). The difference is the mask, not tiling")
    return ""


# ---------------------------------------------------------------- comparing bits

def _ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """Float bits as integers in the floats' order, so a difference counts units in the last place."""
    width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    bits = t.contiguous().view(width).to(torch.int64)
    magnitude = bits & ((1 << (8 * t.element_size() - 1)) - 1)
    return torch.where(bits < 0, -magnitude, magnitude)


def compare(alone: torch.Tensor, here: torch.Tensor, q_offset: int = 0) -> tuple[bool, float, int, dict | None]:
    """(bitwise, max abs diff, max ulp, first differing element) of two [H, rows, D] outputs. NaN
    anywhere is never bitwise."""
    nan = torch.isnan(alone) | torch.isnan(here)
    same = (alone.contiguous().view(torch.uint8) == here.contiguous().view(torch.uint8)).view(
        *alone.shape, alone.element_size()).all(-1) & ~nan
    if bool(same.all()):
        return True, 0.0, 0, None
    diff = (alone.double() - here.double()).abs()
    ulp = (_ordered_bits(alone) - _ordered_bits(here)).abs()
    h, q, d = (int(i) for i in (~same).nonzero()[0])
    first = {"h": h, "q": q + q_offset, "d": d, "alone": float(alone[h, q, d]), "here": float(here[h, q, d])}
    return (False, float("nan") if bool(nan.any()) else float(diff.max()), int(ulp.max()), first)


# ---------------------------------------------------------------- the check

def _runner(backend, segments: bool = False):
    """call(mask, q, k, v, bounds=None) -> out through `backend`. `bounds`: where packed requests
    start and end; only the port with `segments` uses them (FlexAttention has no such argument)."""
    def run(mask, q, k, v, bounds=None):
        shape = Shape(batch=q.shape[0], q_heads=q.shape[1], kv_heads=k.shape[1], q_len=q.shape[2],
                      kv_len=k.shape[2], head_dim=q.shape[3])
        inputs = Inputs(q=q, k=k, v=v, shape=shape, dtype=dtype_name(q.dtype), seed=0)
        if not isinstance(backend, PortBackend):
            done = backend.run(mask, inputs)
            if getattr(done, "compile_error", None):  # torch.compile failed: run_flex ran it uncompiled
                run.compile_errors.append(done.compile_error)
            return done.out
        cu = torch.tensor(bounds) if (segments and bounds is not None) else None
        # one tile configuration for every layout: autotuning each shape on its own would pick
        # tiles by timing noise, and tiles set the order of the sums
        return backend.run(mask, inputs, cu_seqlens=cu, config=port.pinned_config(q.dtype, q.shape[-1])).out
    run.compile_errors = []  # calls where compiled FlexAttention fell back to its uncompiled path
    return run


@dataclass(frozen=True)
class InvarianceOptions:
    """The layouts' settings: `batch` requests in a batch (the request is one of them), kv tiles of
    `block_size`, the random inputs' `seed`, and `segments`: the port runs packed layouts with
    `cu_seqlens` (its tiles start at each request's start)."""

    batch: int = 8
    block_size: int = 128
    seed: int = 0
    segments: bool = False


def check(target: str | Mask | Callable, params: dict | None = None, *, q_len: int, heads: int = 8,
          kv_heads: int | None = None, head_dim: int = 128, dtype: str = "bfloat16", device: str | None = None,
          backend="flex", hold: list[str] | None = None, layouts: list[str] | None = None,
          options: InvarianceOptions | None = None, progress: bool = False) -> InvarianceResult:
    """The request (L = q_len tokens, the mask's own positions) alone and under every layout of
    LAYOUT_KEYS (or only those in `layouts`); `hold` names the layouts that must be bitwise
    (default: all).

    target:   a library name, "file.py:factory", a mod or a Mask (a mask + score: `with_score`)
    q [1, heads, q_len, head_dim], k / v [1, kv_heads, q_len, head_dim] in `dtype`, drawn from options.seed
    backend:  "flex" (compiled on a GPU, uncompiled on a CPU), "eager", "port" (one pinned tile
              configuration in every layout, `port.pinned_config`, as an engine that wants
              invariance would), or a backend object of workbench.run

        >>> result = check("causal", q_len=64, heads=1, head_dim=16, dtype="float32", device="cpu",
        ...                layouts=["run", "batch"], options=InvarianceOptions(batch=2))
        >>> result.passed
        True
    """
    options = options or InvarianceOptions()
    block_size, batch, seed, segments = options.block_size, options.batch, options.seed, options.segments
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    asked = backend if isinstance(backend, str) else None  # the result is named as asked
    if isinstance(backend, str) and backend == "flex" and device.type != "cuda":
        backend = "eager"  # FlexAttention compiles on a GPU; on a CPU its uncompiled path is the one to check
    backend = backend_for(backend)
    if dtype not in TORCH_DTYPES:
        raise WorkbenchError(f"invariance compares {dtype!r} bits, which it cannot",
                             f"use one of {', '.join(TORCH_DTYPES)}")
    unknown = sorted((set(hold or []) | set(layouts or [])) - set(LAYOUT_KEYS))
    if unknown:
        raise WorkbenchError(f"unknown layout {', '.join(unknown)}", f"name some of {', '.join(LAYOUT_KEYS)}")
    not_run = sorted(set(hold or []) - set(layouts)) if layouts is not None else []
    if not_run:
        raise WorkbenchError(f"--hold names {', '.join(not_run)}, which --layouts does not run",
                             f"add {' '.join(not_run)} to --layouts, or drop it from --hold")
    if hold is not None and not hold:
        raise WorkbenchError("hold names no layout, so nothing would be checked",
                             f"name some of {', '.join(LAYOUT_KEYS)}, or leave hold out (all must hold)")
    if q_len < 4:
        raise WorkbenchError(f"q_len = {q_len} is too short to chunk or pack", "use q_len >= 4")
    check_device_dtype(device, dtype)
    kv_heads = kv_heads or heads
    shape = Shape(batch=1, q_heads=heads, kv_heads=kv_heads, q_len=q_len, head_dim=head_dim)
    mask = prepare(target, params, q_len, q_len, device, heads=heads)
    qb = kb = block_size
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tdt = TORCH_DTYPES[dtype]

    def rand(*size):
        return torch.randn(*size, generator=gen).to(device=device, dtype=tdt)

    q, k, v = rand(1, heads, q_len, head_dim), rand(1, kv_heads, q_len, head_dim), rand(1, kv_heads, q_len, head_dim)
    aligned = kb * max(1, round(q_len / 3 / kb))
    packs = (aligned, max(1, aligned - 24))
    padded_len = 1 << q_len.bit_length()  # the next power of two above L (3,000 -> 4,096), as a cache would
    longest = max(batch - 1, 1)
    span = max(packs[0], padded_len - q_len, q_len)
    # the other requests of a batch, the request packed before this one and the padding's keys
    others = {"q": rand(longest, heads, span, head_dim), "k": rand(longest, kv_heads, span, head_dim),
              "v": rand(longest, kv_heads, span, head_dim)}
    chunk_aligned = qb * max(1, q_len // (6 * qb)) if q_len > qb else max(1, q_len // 3)
    chunks = (chunk_aligned, max(1, chunk_aligned - 12 if chunk_aligned > 12 else chunk_aligned // 2 + 1))
    if segments and not isinstance(backend, PortBackend):
        raise WorkbenchError("segments=True is a tiling of the generated port", "use backend='port' with segments")
    run = _runner(backend, segments)
    alone = run(mask, q, k, v)[0]
    result = InvarianceResult(mask.name, asked or backend.name, dtype, str(device), shape, (qb, kb),
                              explicit_hold=hold is not None)
    plans = _plans(mask, q, k, v, others, (qb, kb), batch, chunks, packs, padded_len, min(4, q_len))
    plans = [p for p in plans if layouts is None or p.key in layouts]
    from tqdm.auto import tqdm

    for plan in tqdm(plans, desc="layouts", disable=not progress):
        outs = [run(*call) for call in plan.calls]
        here = plan.rows(outs)
        mine = alone[:, plan.q_rows[0]:plan.q_rows[1]]
        bitwise, max_abs, max_ulp, first = compare(mine, here, plan.q_rows[0])
        layout, why = plan.layout, plan.not_same or (plan.same if bitwise else plan.differs)
        if segments and plan.key.startswith("packed"):
            layout += ", cu_seqlens"
            why = ("kv tiles start at each request's start (cu_seqlens), so the request's keys fall into the same "
                   "tiles as alone" if bitwise else "the segment-relative tiles still changed the order (unexpected)")
        result.layouts.append(LayoutResult(plan.key, layout, bitwise, max_abs, max_ulp, first, why,
                                           held=hold is None or plan.key in hold, same_attention=not plan.not_same))
    result.unrun = sorted(set(hold or []) - {r.key for r in result.layouts})
    if isinstance(backend, FlexBackend) and (not backend.compile or run.compile_errors):
        result.note = (UNCOMPILED_NOTE if not backend.compile else
                       f"torch.compile could not build this mask's FlexAttention ({run.compile_errors[0][:200]}), so "
                       f"these are the bits of its uncompiled path: " + UNCOMPILED_NOTE.split(": ", 1)[1])
        for r in result.layouts:
            if not r.bitwise and r.same_attention:
                r.why = UNCOMPILED_WHY
    return result


# FlexAttention without torch.compile (its math path: what a CPU runs) is no kernel an engine uses
UNCOMPILED_NOTE = ("uncompiled FlexAttention: last-bit differences between layouts are expected there; check the "
                   "compiled kernel on a GPU")
UNCOMPILED_WHY = ("expected for uncompiled FlexAttention (the math path a CPU runs): it computes each call's scores "
                  "and softmax over all of the call's keys at once, so a call of another shape (a bigger batch, "
                  "packing, padding, chunks) adds in another order; the compiled kernel on a GPU is what an engine "
                  "runs, and what this check is for")
