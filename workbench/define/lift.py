"""Lifting a mod's numbers: the Python numbers its closure holds become 0-d tensors, so a generated
kernel takes them as arguments and every value of a knob shares one compile and one trace."""

from __future__ import annotations

from typing import Callable

import torch

from workbench.define.evaluate import evaluate_mod, probe_grid
from workbench.define.trace import _structure, _trace_without_scalar_reads, elementwise

__all__ = ["lift_scalars", "lift_knobs"]


def lift_scalars(fn: Callable | None, device, q_len: int = 300, kv_len: int = 300
                 ) -> tuple[Callable | None, dict[str, torch.Tensor]]:
    """The mod with the Python numbers its closure holds (ints and floats, not bools) replaced by
    0-d tensors on `device`, so a generated kernel can take them as arguments and every value of
    a parameter shares one compile. (None, {}) when there is nothing to lift, and when the lifted
    mod does not give the same values as the mod on probe regions of the q_len x kv_len problem
    (a number used in Python control flow, say). The probes stay inside those lengths: on a GPU a
    captured table read out of range is a device-side assert, not an exception to catch."""
    import types

    code = getattr(fn, "__code__", None)
    if code is None or not getattr(fn, "__closure__", None):
        return None, {}
    cells, lifted = [], {}
    for name, cell in zip(code.co_freevars, fn.__closure__):
        try:
            value = cell.cell_contents
        except ValueError:
            cells.append(cell)
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < 2 ** 31:
            lifted[name] = torch.tensor(value, dtype=torch.int32 if isinstance(value, int) else torch.float32,
                                        device=device)
            cells.append(types.CellType(lifted[name]))
        else:
            cells.append(cell)
    if not lifted:
        return None, {}
    twin = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, tuple(cells))
    twin.__kwdefaults__ = getattr(fn, "__kwdefaults__", None)
    try:
        one = torch.zeros(1, dtype=torch.int32, device=device)
        q, kv = probe_grid(q_len, kv_len, 24, device)
        how = "broadcast" if elementwise(fn) else "vmap"  # a span's .any() is per pair only under vmap
        with torch.no_grad():
            if not torch.equal(evaluate_mod(fn, how, one, one, q, kv), evaluate_mod(twin, how, one, one, q, kv)):
                return None, {}
        structure = _structure(fn)
        if structure is None or not structure["liftable"]:  # else another value of this knob traced already
            _trace_without_scalar_reads(twin)
    except Exception:  # the number steers Python code: it stays a constant
        return None, {}
    if structure is not None:
        structure["liftable"] = True
    return twin, lifted


def lift_knobs(mask, q_len: int, kv_len: int, limit: int = 16, literal: frozenset = frozenset()):
    """The mask's knobs lifted: every int / float the mods capture (in their closures and defaults,
    at any depth: and_masks' parts, a factory's inner closure), bools and numbers past int32
    excepted, replaced by a 0-d tensor (int32 / float32) named after the variable that held it,
    so a generated kernel can read them at run time (FA4's `aux_scalars`) and a turned knob does not
    compile again for each value. Returns (twin mask, {name: (python value, "mask" | "score": the mod that reads it)}), or
    (mask, {}) when nothing can be lifted. Numbers the twin cannot take as tensors (one that
    steers Python code, sizes a view) are tried one by one and stay literals; at most `limit`
    are lifted (a long captured list of spans is data, not a knob); the names in `literal` stay
    literals."""
    from workbench.define.lengths import _mod_parts, _twin, _twin_agrees

    parts = _mod_parts(mask)
    found = [(path, part[1]) for path, part in parts.items()
             if part[0] in ("int", "float") and (part[0] == "float" or abs(part[1]) < 2 ** 31)]
    if not found or len(found) > limit:
        return mask, {}

    def named(paths):
        taken, out = set(), {}
        for path, value in paths:
            steps = [str(s) for s in path[1:] if s not in ("cell", "default")]
            base = "_".join(steps[-1:] if isinstance(path[-1], str) else steps[-2:]) or "n"
            base = "".join(c if c.isalnum() or c == "_" else "_" for c in base).strip("_") or "n"
            name, n = f"knob_{base}", 1
            while name in taken:
                n += 1
                name = f"knob_{base}_{n}"
            taken.add(name)
            out[path] = (name, value)
        return out

    def twin_of(chosen):
        replace = {path: torch.tensor(value, dtype=torch.float32 if isinstance(value, float) else torch.int32)
                   for path, (name, value) in chosen.items()}
        twin = mask.replace(mask_mod=_twin(mask.mask_mod, ("mask_mod",), replace),
                            score_mod=_twin(mask.score_mod, ("score_mod",), replace),
                            data={**mask.data, **{chosen[p][0]: t for p, t in replace.items()}})
        return twin if _twin_agrees(mask, twin, q_len, kv_len) else None

    chosen = {path: nv for path, nv in named(found).items() if nv[0] not in literal}
    if not chosen:
        return mask, {}
    twin = twin_of(chosen)
    if twin is None:  # one by one: keep the numbers that lift alone, then all of them together
        chosen = {path: nv for path, nv in chosen.items() if twin_of({path: nv}) is not None}
        twin = twin_of(chosen) if chosen else None
        if twin is None:
            return mask, {}
    roles = {}
    for path, (name, value) in chosen.items():
        roles[name] = (value, "mask" if path[0] == "mask_mod" else "score")
    return twin, roles
