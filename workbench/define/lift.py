"""Lifting a mod's numbers: the Python numbers its closure holds become 0-d tensors, so a generated
kernel takes them as arguments and every value of a knob shares one compile and one trace."""

from __future__ import annotations

from typing import Callable

import torch

from workbench.define.evaluate import evaluate_mod, probe_grid
from workbench.define.trace import _structure, _trace_without_scalar_reads, elementwise

__all__ = ["lift_scalars"]


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
