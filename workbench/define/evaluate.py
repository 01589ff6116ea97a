"""Evaluating a mod on index tensors (broadcast or vmapped exactly as FlexAttention does), the
probe regions where off-by-ones and data edges live, and `probe`: a tiny run that turns common
mistakes into WorkbenchErrors naming the cause and the fix."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

from workbench import compat
from workbench.define.mask import Mask, WorkbenchError
from workbench.define.trace import _closure, elementwise

__all__ = ["explain_mod_error", "probe", "broadcast_indices", "evaluate_mod", "probe_grid", "probe_regions",
           "EvaluatorChoice", "choose_evaluator", "implied_size"]


# ---------------------------------------------------------------- probing a mod

_HINTS = [
    ("data-dependent control flow", "a Python `if`/`and`/`or` or bool() on a tensor",
     "compute both branches and select with torch.where(cond, a, b); combine conditions with & and |"),
    ("Boolean value of Tensor", "a Python `if`/`and`/`or` or bool() on a tensor",
     "compute both branches and select with torch.where(cond, a, b); combine conditions with & and |"),
    (".item()", "a `.item()` call on a tensor", "keep values as tensors; index captured tensors directly"),
    ("item()", "a `.item()` call on a tensor", "keep values as tensors; index captured tensors directly"),
    ("int()", "int()/float() on a tensor", "keep values as tensors (torch ops only)"),
]


def explain_mod_error(exc: BaseException, role: str, mod: Callable | None = None) -> WorkbenchError:
    """Turn an exception raised while evaluating a mod into a WorkbenchError that names the cause
    (the captured tensor, its size or device, the construct FlexAttention cannot trace)."""
    text = f"{type(exc).__name__}: {exc}"
    first = text.splitlines()[0][:200]
    closure = _closure(mod) if mod is not None else {}
    arrays = [n for n, v in closure.items() if type(v).__module__.startswith("numpy") and hasattr(v, "shape")]
    if arrays:
        return WorkbenchError(f"{role} captures the numpy array {arrays[0]!r}; FlexAttention's mods index torch "
                              f"tensors only ({first})",
                              f"capture torch.as_tensor({arrays[0]}) instead, on the device the run uses")
    if "random" in text.lower() and "vmap" in text.lower():
        return WorkbenchError(f"{role} draws random numbers (torch.rand / randn / randint...); a mask or score "
                              f"must give the same value every time it is evaluated ({first})",
                              "draw the random values once, outside the mod, and capture the tensor")
    bound = re.search(r"index (-?\d+) is out of bounds for dimension (\d+) with size (\d+)", text)
    if bound:
        index, size = int(bound.group(1)), int(bound.group(3))
        tensors = {n: t for n, t in closure.items() if isinstance(t, torch.Tensor) and t.dim() > 0}
        named = [n for n, t in tensors.items() if size in t.shape] or list(tensors)
        who = f"the captured tensor {named[0]!r} ({size} entries)" if named else f"a captured tensor ({size} entries)"
        return WorkbenchError(f"{role} reads {who} at index {index}: it is too short for the sizes asked",
                              "give the table one entry per head / batch entry / token asked for, or ask for "
                              f"fewer (at most {size}); a factory that takes q_len/kv_len/device keywords is "
                              "rebuilt for each size")
    if "device" in text and ("same device" in text or "Expected all tensors" in text or "cuda" in text
                             or "expected device" in text):
        tensors = [f"{n!r} on {t.device}" for n, t in closure.items() if isinstance(t, torch.Tensor)]
        return WorkbenchError(f"{role} mixes devices: it captures {', '.join(tensors) or 'a tensor'} ({first})",
                              "create the captured tensors on the run's device (a factory with a `device` "
                              "keyword gets it filled in), or move them with .to(device)")
    for needle, cause, fix in _HINTS:
        if needle in text:
            return WorkbenchError(f"{role} uses {cause}, which FlexAttention cannot trace ({first})", fix)
    return WorkbenchError(f"{role} failed on probe inputs: {text.splitlines()[0][:300]}",
                          "make it a function of tensors using torch ops only; captured tensors must "
                          "be indexable by every q_idx/kv_idx in range")


def _check_result(out, shape: tuple, role: str, name: str) -> None:
    if not isinstance(out, torch.Tensor):
        raise WorkbenchError(f"{role} returned {type(out).__name__}, not a tensor",
                             "return a tensor expression of the index arguments", name)
    if tuple(out.shape) != tuple(shape):
        raise WorkbenchError(f"{role} returned a tensor of shape {tuple(out.shape)[len(shape):] or '()'} per pair; "
                             "FlexAttention needs one value per (b, h, q_idx, kv_idx)",
                             "reduce with .any() / .all() / .sum(), or index captured tables with one index per "
                             "dimension", name)


def probe(mask: Mask, q_len: int = 37, kv_len: int = 45, heads: int = 2, batch: int = 2,
          device: str | torch.device = "cpu") -> None:
    """Run the mods as FlexAttention would (vmapped over scalars) on a tiny problem and turn
    common mistakes into WorkbenchErrors: Python control flow or .item() on tensors, wrong
    return types or shapes, tables too short, numpy arrays, random numbers, and mods that give
    other values when called again (a changing global). Lengths are clipped to what the mask
    was built for; heads / batch to what it is defined for."""
    q_len = min(q_len, mask.q_len or q_len)
    kv_len = min(kv_len, mask.kv_len or kv_len)
    heads = min(heads, mask.heads or heads)
    batch = min(batch, mask.batch or batch)
    idx = [torch.arange(n, device=device, dtype=torch.int32) for n in (batch, heads, q_len, kv_len)]
    shape = (batch, heads, q_len, kv_len)
    for role, mod in (("mask_mod", mask.mask_mod), ("score_mod", mask.score_mod)):
        if mod is None:
            continue
        score = torch.randn(shape, device=device) if role == "score_mod" else None
        results = []
        for _ in range(2):  # twice: a mask must not change between calls
            try:
                with torch.no_grad():
                    results.append(compat.vmap_bhqkv(mod, *idx, score=score))
            except Exception as exc:
                raise explain_mod_error(exc, role, mod).for_mask(mask.name) from exc
        out = results[0]
        _check_result(out, shape, role, mask.name)
        if role == "mask_mod" and out.dtype != torch.bool:
            raise WorkbenchError(f"mask_mod returned {out.dtype}, FlexAttention needs a bool tensor",
                                 "return a comparison such as `q_idx >= kv_idx` (combine with & and |)", mask.name)
        if role == "score_mod" and not out.is_floating_point():
            raise WorkbenchError(f"score_mod returned {out.dtype}, FlexAttention needs a float score",
                                 "return an expression of `score`, e.g. score + bias", mask.name)
        if not torch.equal(results[0], results[1]) and not (
                out.is_floating_point() and torch.equal(results[0].isnan(), results[1].isnan())
                and torch.equal(results[0].nan_to_num(), results[1].nan_to_num())):
            raise WorkbenchError(f"{role} gives different values when called twice on the same indices: it reads "
                                 "something that changes between calls (a global counter, the clock, random numbers)",
                                 "make it a pure function of its arguments and of tensors captured once", mask.name)


# ---------------------------------------------------------------- evaluating a mod on index tensors

def broadcast_indices(b, h, q, kv):
    """1-d index tensors as b [B,1,1,1], h [1,H,1,1], q [1,1,Q,1], kv [1,1,1,K]."""
    return b.view(-1, 1, 1, 1), h.view(1, -1, 1, 1), q.view(1, 1, -1, 1), kv.view(1, 1, 1, -1)


def evaluate_mod(mod: Callable, how: str, b, h, q, kv, score=None) -> torch.Tensor:
    """A mod over the grid b x h x q x kv (1-d index tensors), as a [B, H, Q, KV] tensor:
    'broadcast' calls it once on broadcast index tensors (fast), 'vmap' exactly as
    FlexAttention's tracer does (nested vmap over scalars)."""
    shape = (len(b), len(h), len(q), len(kv))
    if how == "vmap":
        return compat.vmap_bhqkv(mod, b, h, q, kv, score=score)
    args = broadcast_indices(b, h, q, kv)
    out = mod(*args) if score is None else mod(score, *args)
    if not isinstance(out, torch.Tensor):
        out = torch.as_tensor(out, device=q.device)
    return out.expand(shape) if tuple(out.shape) != shape else out


def probe_grid(q_len: int, kv_len: int, size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, kv) int32 index tensors: the rows and the columns of every probe region, so that one
    evaluation over q x kv covers them all (and nothing else)."""
    qs, ks = set(), set()
    for q_range, kv_range in probe_regions(q_len, kv_len, size):
        qs.update(range(*q_range))
        ks.update(range(*kv_range))
    # built in int64 and cast, as torch.arange(..., dtype=torch.int32) would
    return (torch.tensor(sorted(qs), dtype=torch.int64).to(device=device, dtype=torch.int32),
            torch.tensor(sorted(ks), dtype=torch.int64).to(device=device, dtype=torch.int32))


def _region_of(q: int, kv: int, q_len: int, kv_len: int, size: int) -> tuple:
    """The probe region (q_range, kv_range) that holds the pair (q, kv)."""
    for q_range, kv_range in probe_regions(q_len, kv_len, size):
        if q_range[0] <= q < q_range[1] and kv_range[0] <= kv < kv_range[1]:
            return q_range, kv_range
    return next(iter(probe_regions(q_len, kv_len, size)))


def probe_regions(q_len: int, kv_len: int, size: int = 48):
    """Corners and the middle of the pair space: where off-by-ones and data edges live."""
    qs = sorted({0, max(0, q_len // 2 - size // 2), max(0, q_len - size)})
    ks = sorted({0, max(0, kv_len // 2 - size // 2), max(0, kv_len - size)})
    for q0 in qs:
        for k0 in ks:
            yield (q0, min(q_len, q0 + size)), (k0, min(kv_len, k0 + size))


@dataclass(frozen=True)
class EvaluatorChoice:
    """How to evaluate a mod on index tensors. `how` is 'broadcast' when calling the mod on
    broadcast index tensors gives exactly FlexAttention's vmapped values on probe regions, else
    'vmap'. `differs_at` is set when the direct call ran but gave other values (the
    eager-vs-traced trap: Python `and`/`or`, in-place ops); None when it agreed or raised."""

    how: str
    differs_at: tuple | None = None


def choose_evaluator(mod: Callable, q_len: int, kv_len: int, batch: int = 1, heads: int = 1, device="cpu",
                     role: str = "mask", size: int = 48) -> EvaluatorChoice:
    """The one broadcast-vs-vmap rule, for mask_mods and score_mods alike: broadcast only for
    mods whose traced graph is elementwise and whose broadcast call matches vmap on probe
    regions. Raises a WorkbenchError naming the mistake when the mod does not run under vmap."""
    b = torch.unique(torch.tensor([0, batch - 1], dtype=torch.int32)).to(device)
    h = torch.unique(torch.tensor([0, heads - 1], dtype=torch.int32)).to(device)
    how, differs_at = ("broadcast" if elementwise(mod, role) else "vmap"), None
    # every probe region at once: their rows x their columns is exactly their union
    q, kv = probe_grid(q_len, kv_len, size, device)
    shape = (len(b), len(h), len(q), len(kv))
    score = torch.randn(shape, device=device, dtype=torch.float64) if role == "score" else None
    try:
        with torch.no_grad():
            ref = evaluate_mod(mod, "vmap", b, h, q, kv, score=score)
    except Exception as exc:
        raise explain_mod_error(exc, f"{role}_mod", mod) from exc
    _check_result(ref, shape, f"{role}_mod", None)
    if role == "mask" and (not isinstance(ref, torch.Tensor) or ref.dtype != torch.bool):
        got = ref.dtype if isinstance(ref, torch.Tensor) else type(ref).__name__
        raise WorkbenchError(f"mask_mod returned {got}, FlexAttention needs a bool tensor",
                             "return a comparison such as `q_idx >= kv_idx` (combine with & and |)")
    if how == "vmap":
        return EvaluatorChoice(how)
    try:
        with torch.no_grad():
            got = evaluate_mod(mod, "broadcast", b, h, q, kv, score=score)
    except Exception:
        return EvaluatorChoice("vmap")
    if tuple(got.shape) != shape or (role == "mask" and got.dtype != torch.bool):
        return EvaluatorChoice("vmap", _region_of(0, 0, q_len, kv_len, size))
    if role == "mask":
        differ = got != ref
    else:
        differ = ~torch.isclose(got.double(), ref.double(), rtol=1e-12, atol=1e-12, equal_nan=True)
    if bool(differ.any()):
        _, _, i, j = (int(x) for x in differ.nonzero()[0])
        how, differs_at = "vmap", _region_of(int(q[i]), int(kv[j]), q_len, kv_len, size)
    return EvaluatorChoice(how, differs_at)


def implied_size(mask: Mask, axis: str, limit: int = 4096, device="cpu") -> int | None:
    """How many heads (axis "h") or batch entries ("b") a mask's tables define, for a mod that
    reads that index: the largest n for which the mods evaluate at index n - 1 (a per-head table
    `w[h]` of 4 entries gives 4). None when the mods do not read the index, or evaluate at every
    index up to `limit` (`h % 4`: any number)."""
    from workbench.define.trace import index_reads

    mods = [(m, role) for m, role in ((mask.mask_mod, "mask"), (mask.score_mod, "score")) if m is not None]
    if not any(axis in index_reads(m, role) for m, role in mods):
        return None
    zero = torch.zeros(1, dtype=torch.int32, device=device)

    def works(n: int) -> bool:
        i = torch.tensor([n - 1], dtype=torch.int32, device=device)
        b, h = (i, zero) if axis == "b" else (zero, i)
        try:
            with torch.no_grad():
                for mod, role in mods:
                    score = torch.zeros(1, 1, 1, 1, device=device) if role == "score" else None
                    evaluate_mod(mod, "vmap", b, h, zero, zero, score)
        except Exception:
            return False
        return True

    if works(limit):
        return None
    lo, hi = 0, limit  # works(lo) or lo == 0; not works(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if works(mid) else (lo, mid)
    return lo or None

