"""How a mask follows the lengths it is used at: the numbers its factory captures, as functions of
(Lq, Lk), so a generated kernel can compute them per call instead of baking one length's value in.

A factory that declares `q_len` / `kv_len` keywords may capture numbers that depend on them: the
library's bottom-right offset `Lk - Lq`, a prefix given as a fraction of the sequence. A kernel
generated at one length with such a number written in computes *another mask* at other lengths
(top-left causal where bottom-right was meant). `follow(mask, q_len, kv_len)` rebuilds the factory
at sample lengths, compares the rebuilt mods part by part (their code, closures, tables) and fits
every captured integer that changes as

    value = floor((a * Lq + b * Lk + c) / d)          (a, b, c, d integers, d >= 1)

checked exactly at every sample, odd lengths, Lq = 1, Lq < Lk and Lq > Lk included. The result is
a `LengthPlan`:

- kind "any": nothing the mods capture depends on the lengths (or the factory takes none);
- kind "rules": the integers in `rules` follow the lengths; `mask` is a twin whose mods read them
  from 0-d int32 tensors (a kernel's arguments) and `relations` the Lq-vs-Lk cases the factory
  accepts (the library refuses Lk < Lq for bottom-right masks);
- kind "fixed": the mask holds only at the lengths it was built for (`reason` says why: a table
  sized by the sequence, a float that changes, a number no rule fits).

Only the lengths' *sample* values are ever shown to hold; a rule is trusted at other lengths
because the same rule held at every sample, and the rebuilt mods were the same code with the same
tables there. Masks without a factory follow nothing: a mod sees only its indices.
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass, field
from fractions import Fraction
from math import lcm
from typing import Callable

import torch

from workbench.define.evaluate import evaluate_mod, probe_grid
from workbench.define.mask import Mask, WorkbenchError, with_score
from workbench.define.targets import make
from workbench.define.trace import _NoScalarReads, trace_mod

__all__ = ["LengthRule", "LengthPlan", "follow", "rebuild", "rebuildable", "relation", "relations_text", "RELATION_TEXT"]

# The three ways Lq can stand to Lk; a plan accepts those at which the factory built every sample.
RELATION_TEXT = {"lt": "Lq < Lk", "eq": "Lq = Lk", "gt": "Lq > Lk"}
# Three non-collinear points in (Lq, Lk), multiples of 1024 so a rule whose divisor divides 1024
# (a prefix of Lk // 4) is fitted exactly; every other sample checks the fit.
_FIT = [(1024, 1024), (1024, 3072), (3072, 4096)]
_CHECK = [(1, 1), (1, 37), (1, 4096), (5, 6), (37, 37), (64, 200), (127, 129), (200, 200), (333, 1000),
          (999, 1000), (1000, 1000), (129, 127), (200, 64), (1000, 333), (4096, 1), (2048, 1024), (3, 2)]
_INT32 = 2 ** 31


def relations_text(relations) -> str:
    """("lt", "eq") -> 'Lq <= Lk'."""
    rels = set(relations)
    return {frozenset({"lt", "eq", "gt"}): "any Lq, Lk", frozenset({"lt", "eq"}): "Lq <= Lk",
            frozenset({"eq", "gt"}): "Lq >= Lk", frozenset({"lt", "gt"}): "Lq != Lk"}.get(
        frozenset(rels), " or ".join(RELATION_TEXT[r] for r in ("lt", "eq", "gt") if r in rels) or "no lengths")


def relation(q_len: int, kv_len: int) -> str:
    return "lt" if q_len < kv_len else "eq" if q_len == kv_len else "gt"


@dataclass(frozen=True)
class LengthRule:
    """value = floor((a * Lq + b * Lk + c) / d)."""

    a: int
    b: int
    c: int
    d: int = 1

    def __call__(self, q_len: int, kv_len: int) -> int:
        return (self.a * q_len + self.b * kv_len + self.c) // self.d

    def as_tuple(self) -> tuple[int, int, int, int]:
        return (self.a, self.b, self.c, self.d)

    def text(self) -> str:
        """As Python: `Lk - Lq`, `(Lk + 3) // 4`."""
        terms = [(coef, name if abs(coef) == 1 else f"{abs(coef)} * {name}")
                 for coef, name in ((self.a, "Lq"), (self.b, "Lk")) if coef]
        if self.c or not terms:
            terms.append((self.c, str(abs(self.c))))
        terms.sort(key=lambda t: t[0] < 0)  # positive terms first: Lk - Lq
        expr = ("-" if terms[0][0] < 0 else "") + terms[0][1]
        for coef, text in terms[1:]:
            expr += (" - " if coef < 0 else " + ") + text
        if self.d == 1:
            return expr
        return f"{expr} // {self.d}" if len(terms) == 1 and terms[0][0] > 0 else f"({expr}) // {self.d}"


@dataclass
class LengthPlan:
    """What `follow` found; see the module docstring."""

    kind: str                                    # "any" | "rules" | "fixed"
    mask: Mask                                   # the mask to translate (a twin when kind == "rules")
    rules: dict[str, LengthRule] = field(default_factory=dict)      # captured tensor name -> rule
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> the twin's 0-d tensor
    relations: tuple[str, ...] = ("lt", "eq", "gt")
    refused: dict[str, str] = field(default_factory=dict)  # relation -> what the factory said there
    reason: str = ""
    checked: list[tuple[int, int]] = field(default_factory=list)

    def describe(self) -> str:
        """One line: how the lengths enter (for a generated file's docstring and the CLI)."""
        if self.kind == "fixed":
            return "fixed lengths: " + self.reason
        parts = [f"{name} = {rule.text()}" for name, rule in self.rules.items()]
        text = ("computed per call: " + ", ".join(parts)) if parts else "nothing captured depends on the lengths"
        if len(self.relations) < 3:
            text += "; only " + relations_text(self.relations)
        return text


# ---------------------------------------------------------------- the parts of a mod

def _parts(value, path: tuple, out: dict, depth: int = 0) -> None:
    """Every part of a mod that its traced graph can depend on, by path: code objects, the numbers,
    strings, tensors and nested functions of its closure cells and defaults."""
    if depth > 8:
        out[path] = ("deep",)
        return
    if isinstance(value, bool) or value is None or isinstance(value, str):
        out[path] = ("val", value)
    elif isinstance(value, int):
        out[path] = ("int", value)
    elif isinstance(value, float):
        out[path] = ("float", value)
    elif isinstance(value, torch.Tensor):
        out[path] = ("tensor", value)
    elif isinstance(value, (tuple, list)) and len(value) <= 64:
        out[path] = ("seq", type(value).__name__, len(value))
        for i, item in enumerate(value):
            _parts(item, path + (i,), out, depth + 1)
    elif isinstance(value, types.FunctionType):
        code = value.__code__
        out[path] = ("fn", code)
        for name, cell in zip(code.co_freevars, value.__closure__ or ()):
            try:
                _parts(cell.cell_contents, path + ("cell", name), out, depth + 1)
            except ValueError:  # an empty cell
                out[path + ("cell", name)] = ("empty",)
        for i, default in enumerate(value.__defaults__ or ()):
            _parts(default, path + ("default", i), out, depth + 1)
    elif isinstance(value, types.ModuleType):
        out[path] = ("module", value.__name__)
    else:
        out[path] = ("object", value)


def _mod_parts(mask: Mask) -> dict:
    out: dict = {}
    _parts(mask.mask_mod, ("mask_mod",), out)
    _parts(mask.score_mod, ("score_mod",), out)
    return out


def _same(a: tuple, b: tuple) -> bool:
    """Two parts that are the same except, possibly, for an integer's value."""
    if a[0] != b[0]:
        return False
    if a[0] == "tensor":
        x, y = a[1], b[1]
        return (x.shape == y.shape and x.dtype == y.dtype
                and torch.equal(x.detach().cpu(), y.detach().cpu()))
    if a[0] == "object":
        return a[1] is b[1]
    if a[0] == "int":
        return True
    return a == b


def _twin(value, path: tuple, replace: dict):
    """`value` with the parts at the paths in `replace` swapped for their replacements (functions
    rebuilt around new closure cells and defaults; tuples and lists rebuilt)."""
    if path in replace:
        return replace[path]
    if not any(p[: len(path)] == path for p in replace):
        return value
    if isinstance(value, (tuple, list)):
        items = [_twin(item, path + (i,), replace) for i, item in enumerate(value)]
        return type(value)(items)
    if isinstance(value, types.FunctionType):
        code = value.__code__
        cells = []
        for name, cell in zip(code.co_freevars, value.__closure__ or ()):
            try:
                contents = cell.cell_contents
            except ValueError:
                cells.append(cell)
                continue
            new = _twin(contents, path + ("cell", name), replace)
            cells.append(cell if new is contents else types.CellType(new))
        defaults = tuple(_twin(d, path + ("default", i), replace) for i, d in enumerate(value.__defaults__ or ()))
        twin = types.FunctionType(code, value.__globals__, value.__name__, defaults or value.__defaults__,
                                  tuple(cells) if value.__closure__ else None)
        twin.__kwdefaults__ = getattr(value, "__kwdefaults__", None)
        twin.__qualname__ = value.__qualname__
        twin.__module__ = value.__module__
        return twin
    return value


# ---------------------------------------------------------------- rebuilding and fitting

def _declares_lengths(factory: Callable | None) -> bool:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    return "q_len" in params or "kv_len" in params


def rebuildable(mask: Mask) -> bool:
    """Can `mask` be rebuilt at other lengths (its factory, or each part of a mask + score, takes
    q_len / kv_len)?"""
    if mask.parts:
        return any(rebuildable(p) for p in mask.parts)
    return mask.factory is not None and _declares_lengths(mask.factory)


def rebuild(mask: Mask, q_len: int, kv_len: int) -> Mask:
    """The mask's factory called again at these lengths (on the CPU); a mask + score is rebuilt part
    by part. Raises what the factory raises."""

    if mask.parts:
        base, score = (rebuild(p, q_len, kv_len) for p in mask.parts)
        return with_score(base, score)
    if mask.factory is None or not _declares_lengths(mask.factory):
        return mask
    return make(mask.factory, mask.params, q_len=q_len, kv_len=kv_len, device="cpu")


def _fit(points: list[tuple[int, int, int]]) -> LengthRule | None:
    """The rule through three (Lq, Lk, value) points, or None (collinear points)."""
    (x1, y1, v1), (x2, y2, v2), (x3, y3, v3) = [tuple(map(Fraction, p)) for p in points]
    det = (x2 - x1) * (y3 - y1) - (x3 - x1) * (y2 - y1)
    if det == 0:
        return None
    a = ((v2 - v1) * (y3 - y1) - (v3 - v1) * (y2 - y1)) / det
    b = ((x2 - x1) * (v3 - v1) - (x3 - x1) * (v2 - v1)) / det
    c = v1 - a * x1 - b * y1
    d = lcm(a.denominator, b.denominator, c.denominator)
    return LengthRule(int(a * d), int(b * d), int(c * d), d)


def follow(mask: Mask, q_len: int, kv_len: int) -> LengthPlan:
    """How `mask` (built at q_len x kv_len) follows other lengths; see the module docstring."""
    if not rebuildable(mask):
        return LengthPlan("any", mask)
    base = _mod_parts(mask)
    samples: dict[tuple[int, int], dict] = {}
    refused: dict[str, str] = {}
    failed_at: dict[str, list] = {}
    for lq, lk in list(dict.fromkeys(_FIT + _CHECK + [(q_len, kv_len)])):
        try:
            other = rebuild(mask, lq, lk)
        except (WorkbenchError, ValueError, TypeError, IndexError, RuntimeError) as exc:
            text = exc.cause if isinstance(exc, WorkbenchError) else f"{type(exc).__name__}: {exc}"
            failed_at.setdefault(relation(lq, lk), []).append((lq, lk))
            refused.setdefault(relation(lq, lk), text.split(". Fix")[0][:300])
            continue
        samples[(lq, lk)] = _mod_parts(other)
    relations = tuple(r for r in ("lt", "eq", "gt") if r not in failed_at)
    if relation(q_len, kv_len) not in relations:
        return LengthPlan("fixed", mask, reason="its factory refuses other lengths: "
                                                  + refused.get(relation(q_len, kv_len), ""))
    changing: dict[tuple, dict] = {}
    for point, parts in samples.items():
        if set(parts) != set(base):
            return LengthPlan("fixed", mask, reason=f"its factory makes other mods at Lq = {point[0]}, "
                                                      f"Lk = {point[1]}")
        for path, part in parts.items():
            mine = base[path]
            if not _same(mine, part):
                what = "a captured table" if mine[0] == "tensor" else f"a captured {mine[0]}"
                return LengthPlan("fixed", mask, reason=f"{what}, `{_path_text(path)}`, changes with the lengths")
            if mine[0] == "int" and part[1] != mine[1]:
                changing.setdefault(path, {})
    for path in changing:
        values = {point: parts[path][1] for point, parts in samples.items()}
        values[(q_len, kv_len)] = base[path][1]
        fit_points = [(lq, lk, values[(lq, lk)]) for lq, lk in _FIT if (lq, lk) in values]
        rule = _fit(fit_points) if len(fit_points) == 3 else None
        bad = None if rule is not None else "no three samples to fit"
        if rule is not None:
            for (lq, lk), value in values.items():
                if rule(lq, lk) != value or abs(value) >= _INT32:
                    bad = f"{value} at Lq = {lq}, Lk = {lk} against {rule.text()} = {rule(lq, lk)}"
                    break
        if bad is not None:
            return LengthPlan("fixed", mask, reason=f"the captured number `{_path_text(path)}` changes with the "
                                                      f"lengths by no rule found ({bad})")
        changing[path] = rule
    if not changing:
        return LengthPlan("any", mask, relations=relations, refused=refused, checked=sorted(samples))
    names, replace, rules, tensors = set(), {}, {}, {}
    for path, rule in changing.items():
        name = _unique(f"len_{path[-1] if isinstance(path[-1], str) else 'n'}", names)
        tensor = torch.tensor(rule(q_len, kv_len), dtype=torch.int32)
        replace[path] = tensor
        rules[name], tensors[name] = rule, tensor
    twin = mask.replace(mask_mod=_twin(mask.mask_mod, ("mask_mod",), replace),
                        score_mod=_twin(mask.score_mod, ("score_mod",), replace),
                        data={**mask.data, **tensors})
    if not _twin_agrees(mask, twin, q_len, kv_len):
        return LengthPlan("fixed", mask, reason="its length-dependent numbers steer Python code, so they cannot be "
                                                  "computed per call")
    return LengthPlan("rules", twin, rules=rules, tensors=tensors, relations=relations, refused=refused,
                      checked=sorted(samples))


def _unique(name: str, taken: set) -> str:
    out, n = name, 1
    while out in taken:
        n += 1
        out = f"{name}_{n}"
    taken.add(out)
    return out


def _path_text(path: tuple) -> str:
    text = path[0]
    for step in path[1:]:
        text += f"[{step}]" if isinstance(step, int) else ("" if step in ("cell", "default") else f".{step}")
    return text


def _twin_agrees(mask: Mask, twin: Mask, q_len: int, kv_len: int) -> bool:
    """The twin gives the mask's values on probe regions (evaluated as FlexAttention does, under
    vmap), and traces without reading its numbers back into Python (a number in an `if` would be
    baked in again)."""

    one = torch.zeros(1, dtype=torch.int32)
    q, kv = probe_grid(min(q_len, 300), min(kv_len, 300), 24, "cpu")
    for role, mine, theirs in (("mask", mask.mask_mod, twin.mask_mod), ("score", mask.score_mod, twin.score_mod)):
        if mine is None or mine is theirs:
            continue
        score = (torch.randn(1, 1, len(q), len(kv), generator=torch.Generator().manual_seed(0))
                 if role == "score" else None)

        def guarded(*args, _mod=theirs):
            with _NoScalarReads():
                return _mod(*args)

        try:
            with torch.no_grad():
                same = torch.equal(evaluate_mod(mine, "vmap", one, one, q, kv, score),
                                   evaluate_mod(theirs, "vmap", one, one, q, kv, score))
            trace_mod(guarded, role)
        except Exception:
            return False
        if not same:
            return False
    return True
