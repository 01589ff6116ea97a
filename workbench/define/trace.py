"""What a mod reads, read off its traced graph: the tensors and numbers it captures, its aten graph
(make_fx, as FlexAttention's tracer sees it), which indices flow into its result and into table
reads, and whether it stays elementwise. Facts are kept per mod, and per *structure* (the same code
with other numbers: a knob being turned) once its numbers were lifted."""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from workbench import compat
from workbench.define.mask import Mask

__all__ = ["captured_scalars", "captured_tensors", "structure_key", "structure_fact", "forget_structures",
           "trace_mod", "op_name", "index_reads", "data_indices", "elementwise", "value_spans", "MASK_ARGS",
           "SCORE_ARGS"]


# ---------------------------------------------------------------- what a mod captures and reads

def _closure(fn: Callable | None) -> dict[str, object]:
    """The values a function reads from outside: its closure cells, and the module globals it
    names that hold data (tensors, arrays, numbers), by name."""
    code = getattr(fn, "__code__", None)
    out = {}
    for name, cell in zip(getattr(code, "co_freevars", ()), getattr(fn, "__closure__", None) or ()):
        try:
            out[name] = cell.cell_contents
        except ValueError:  # an empty cell
            continue
    module_globals = getattr(fn, "__globals__", {})
    for name in getattr(code, "co_names", ()):
        value = module_globals.get(name)
        if isinstance(value, torch.Tensor) or (hasattr(value, "shape") and hasattr(value, "dtype")):
            out.setdefault(name, value)
    return out


def captured_scalars(fn: Callable | None) -> dict[str, object]:
    """Python numbers a mod captures from its enclosing scope. Dynamo bakes them into the
    compiled kernel, so each new value compiles a new graph."""
    return {k: v for k, v in _closure(fn).items() if isinstance(v, (bool, int, float))}


class _NoScalarReads(torch.overrides.TorchFunctionMode):
    """Refuses every read of a tensor's value back into Python (item, bool, int, float, index,
    tolist) while a lifted mod is traced: such a read bakes the value of the number it came from
    into the graph (`int(window)`, `if window > 0`), so the graph would not serve other values."""

    READS = {torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
             torch.Tensor.__index__, torch.Tensor.tolist}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            raise ValueError("the mod reads a tensor's value back into Python")
        return func(*args, **(kwargs or {}))


def _trace_without_scalar_reads(twin: Callable) -> None:
    """Trace the lifted mod as FlexAttention traces it (a number in an `if` fails here), refusing
    reads of values into Python; the graph is kept as the twin's trace."""
    def guarded(*args):
        with _NoScalarReads():
            return twin(*args)

    graph = trace_mod(guarded, "mask")
    _traces.setdefault(twin, {})["mask"] = graph


def _closure_tensors(fns, found: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`found` plus every tensor in the closures of `fns`, and in the closures of the mods they
    wrap (torch's and_masks / or_masks, attention-gym's factories), by name."""
    seen: set[int] = set()

    def walk(fn, depth=0):
        if fn is None or id(fn) in seen or depth > 8:
            return
        seen.add(id(fn))
        for name, value in _closure(fn).items():
            if isinstance(value, torch.Tensor):
                if not any(value is t for t in found.values()):
                    found.setdefault(name if name not in found else f"{name}_{len(found)}", value)
            elif callable(value):
                walk(value, depth + 1)
            elif isinstance(value, (tuple, list)):
                for item in value:
                    if isinstance(item, torch.Tensor) and not any(item is t for t in found.values()):
                        found.setdefault(f"{name}_{len(found)}", item)
                    elif callable(item):
                        walk(item, depth + 1)

    for fn in fns:
        walk(fn)
    return found


def captured_tensors(mask: Mask) -> dict[str, torch.Tensor]:
    """Tensors the mods read: `Mask.data` plus any tensor in the mods' closures, and in the
    closures of mods they wrap (torch's and_masks / or_masks, attention-gym's factories)."""
    return _closure_tensors([mask.mask_mod, mask.score_mod],
                            {k: t for k, t in mask.data.items() if isinstance(t, torch.Tensor)})


def _trace_device(fn: Callable) -> torch.device:
    """Where a mod's index tensors are made when it is traced: the device of the tensors it
    captures when they all lie on one accelerator (a span table on the GPU is compared with
    `q_idx[..., None]`, a 1-element tensor that must share its device), else the CPU."""
    devices = {t.device for t in _closure_tensors([fn], {}).values() if t.device.type != "cpu"}
    return devices.pop() if len(devices) == 1 else torch.device("cpu")


MASK_ARGS = ("b", "h", "q_idx", "kv_idx")
SCORE_ARGS = ("score", "b", "h", "q_idx", "kv_idx")


# ops that read only the dtype, device or shape of their tensor argument, never its value
_SHAPE_ONLY_OPS = {"new_ones", "new_zeros", "new_full", "new_empty", "empty_like", "zeros_like", "ones_like",
                   "full_like", "sym_size", "size", "new_empty_strided"}


# ---------------------------------------------------------------- facts shared by every value of a knob

# A researcher turning a knob makes a new mod per value: the same code, other numbers in its
# closure. Once that code's numbers have been lifted into tensors (lift_scalars) and it still
# traced, its graph, and every fact read off it, cannot depend on them: facts are then kept per
# *structure* (structure_key) and a new value skips the traces. Entries hold the objects their
# key names by id, so an id cannot be reused while its entry lives.
_STRUCTURES_KEPT = 16
_structures: dict = {}  # key -> {"keep": [...], "liftable": bool, "facts": {...}}


def _structure_parts(fn: Callable | None) -> tuple[tuple, list] | None:
    """(key, the objects it names by id). The key is what a mod's traced graph can depend on, with
    the Python numbers of its own closure (those lift_scalars lifts) by type only: code objects,
    closure cells, defaults and the module globals they name (numbers, strings, lists by value;
    tensors by identity, in-place version, shape, dtype and device; functions walked the same
    way; other objects by identity). None: not a plain function, or something unhashable."""
    if getattr(fn, "__code__", None) is None:
        return None
    keep: list = []
    seen: set = set()

    def names_of(code) -> set:
        names = set(code.co_names)
        for const in code.co_consts:
            if hasattr(const, "co_names"):
                names |= names_of(const)
        return names

    def classify(value, depth: int, top_number: bool = False):
        if isinstance(value, bool) or value is None or isinstance(value, str):
            return ("val", value)
        if isinstance(value, (int, float)):
            if top_number and abs(value) < 2 ** 31:  # lifted: any value shares the structure
                return ("num", type(value).__name__)
            return ("val", type(value).__name__, value)
        if isinstance(value, torch.Tensor):
            keep.append(value)
            return ("tensor", id(value), compat.tensor_version(value), tuple(value.shape), value.dtype,
                    str(value.device))
        if isinstance(value, (tuple, list)) and len(value) <= 256:  # a list by value: it can change in place
            return (type(value).__name__,) + tuple(classify(v, depth) for v in value)
        if isinstance(value, dict) and len(value) <= 256:
            return ("dict",) + tuple((k, classify(v, depth)) for k, v in sorted(value.items(), key=repr))
        if hasattr(value, "tobytes") and getattr(value, "nbytes", 1 << 30) <= 1 << 20:  # a numpy array
            keep.append(value)
            return ("array", id(value), hash(value.tobytes()))
        if type(value).__name__ == "module":
            return ("module", value.__name__)
        if getattr(value, "__code__", None) is not None and depth < 4:
            return walk(value, depth + 1)
        keep.append(value)
        return ("obj", id(value))

    def walk(f, depth: int):
        if id(f) in seen:
            return ("seen", id(f))
        seen.add(id(f))
        keep.append(f)
        code = f.__code__
        cells = []
        for cell in f.__closure__ or ():
            try:
                cells.append(classify(cell.cell_contents, depth, top_number=depth == 0))
            except ValueError:  # an empty cell
                cells.append(("empty",))
        module_globals = getattr(f, "__globals__", {})
        named = tuple((n, classify(module_globals[n], depth)) for n in sorted(names_of(code)) if n in module_globals)
        defaults = tuple(classify(v, depth) for v in (f.__defaults__ or ()))
        return ("fn", code, tuple(cells), named, defaults)

    try:
        key = walk(fn, 0)
        hash(key)
    except Exception:  # something unhashable on the way: no sharing
        return None
    return key, keep


def structure_key(fn: Callable | None) -> tuple | None:
    """What a mod's traced graph can depend on (see _structure_parts); None: nothing to share."""
    parts = _structure_parts(fn)
    return None if parts is None else parts[0]


def _structure(fn: Callable | None) -> dict | None:
    """The entry of fn's structure (made on first sight; the least recently used one goes)."""
    parts = _structure_parts(fn)
    if parts is None:
        return None
    key, keep = parts
    entry = _structures.pop(key, None) or {"keep": keep, "liftable": False, "facts": {}}
    _structures[key] = entry  # (the most recently used last)
    while len(_structures) > _STRUCTURES_KEPT:
        _structures.pop(next(iter(_structures)))
    return entry


def structure_fact(fn: Callable | None, fact: tuple, compute: Callable[[], Any]):
    """compute(), or the value it gave for another mod of the same structure whose numbers were
    lifted (see structure_key); kept for the next value of the knob either way."""
    entry = _structure(fn)
    if entry is not None and entry["liftable"] and fact in entry["facts"]:
        return entry["facts"][fact]
    value = compute()
    if entry is not None:
        entry["facts"][fact] = value
    return value


def forget_structures() -> None:
    _structures.clear()


_traces: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # mod -> {role: graph, or the exception tracing raised}


def trace_mod(fn: Callable, role: str = "mask"):
    """The mod traced with make_fx on 0-d int32 index tensors (float32 score), the way
    FlexAttention's tracer sees it: an aten graph (tensor[idx] becomes aten.index). Traced once
    per mod object (the stages ask for it often); a mod that cannot be traced raises each time."""
    try:
        cached = _traces.setdefault(fn, {})
    except TypeError:  # not weak-referenceable (a builtin): trace every time
        cached = {}
    if role not in cached:
        device = _trace_device(fn)
        args = [torch.tensor(0, dtype=torch.int32, device=device) for _ in range(4)]
        if role == "score":
            args = [torch.tensor(0.0, dtype=torch.float32, device=device)] + args
        try:
            with compat.getitem_as_index():
                cached[role] = compat.make_fx_trace(fn, *args)
        except Exception as exc:
            cached[role] = exc
    if isinstance(cached[role], Exception):
        raise cached[role]
    return cached[role]


def op_name(target) -> str:
    """`aten.add.Tensor` -> 'add'."""
    return compat.aten_op_name(target)


def _data_flow(mod: Callable, role: str) -> tuple[frozenset, frozenset]:
    """(arguments the result depends on, arguments that index a captured tensor), by data flow
    over the traced graph. A mod that cannot be traced reads (and indexes with) everything."""
    return structure_fact(mod, ("data_flow", role), lambda: _traced_data_flow(mod, role))


def _inputs_of(deps: dict, args) -> frozenset:
    """The mod's arguments that the graph nodes among `args` (nested lists too) depend on."""
    out: frozenset = frozenset()
    for a in args:
        if isinstance(a, (list, tuple)):
            out |= _inputs_of(deps, a)
        elif hasattr(a, "name") and a.name in deps:
            out |= deps[a.name]
    return out


def _traced_data_flow(mod: Callable, role: str) -> tuple[frozenset, frozenset]:
    names = MASK_ARGS if role == "mask" else SCORE_ARGS
    try:
        gm = trace_mod(mod, role)
    except Exception:
        return frozenset(names), frozenset(names)
    deps, spans = value_spans(gm, role)
    result: frozenset = frozenset()
    indexing: frozenset = frozenset()

    for node in gm.graph.nodes:
        if node.op == "call_function":
            op = op_name(node.target)
            if op in ("index", "select") and not node.kwargs:
                # an index inside the table's bounds at every position (a relative table at a
                # clamped distance) binds the mod to no length: only its b / h count
                table = node.args[0].meta.get("val") if hasattr(node.args[0], "meta") else None
                places = (list(enumerate(node.args[1])) if op == "index" else [(node.args[1], node.args[2])])
                for dim, idx in places:
                    if idx is None:  # (a dimension taken whole)
                        continue
                    used = _inputs_of(deps, [idx])
                    kind = idx.meta.get("val") if hasattr(idx, "meta") else None
                    lo, hi = spans.get(idx.name, _UNKNOWN) if hasattr(idx, "name") else (idx, idx)
                    if (isinstance(table, torch.Tensor) and isinstance(dim, int) and 0 <= dim < table.dim()
                            and (not isinstance(kind, torch.Tensor) or kind.dtype not in (torch.bool, torch.uint8))
                            and 0 <= lo and hi < table.shape[dim]):
                        used -= {"q_idx", "kv_idx"}
                    indexing |= used
            elif op in ("index", "select", "slice", "gather", "index_select", "take"):
                indexing |= _inputs_of(deps, list(node.args[1:]) + list(node.kwargs.values()))
        elif node.op == "output":
            result = _inputs_of(deps, node.args)
    return result, indexing


def value_spans(gm, role: str = "mask") -> tuple[dict, dict]:
    """({node: the mod's arguments it depends on}, {node: (lo, hi) of its values}) over a traced
    mod's graph: the span over every b, h, q_idx, kv_idx >= 0 whatever the lengths (_span), or
    (-inf, inf) where no bound is known."""
    names = iter(MASK_ARGS if role == "mask" else SCORE_ARGS)
    deps: dict[str, frozenset] = {}
    spans: dict[str, tuple] = {}

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            deps[node.name] = frozenset([next(names, node.name)])
        elif node.op == "call_function":
            op = op_name(node.target)
            deps[node.name] = frozenset() if op in _SHAPE_ONLY_OPS else \
                _inputs_of(deps, list(node.args) + list(node.kwargs.values()))
            spans[node.name] = _span(op, node, spans, deps)
        elif node.op != "output":
            deps[node.name] = frozenset()
    return deps, spans


_INF = float("inf")
_UNKNOWN = (-_INF, _INF)  # no bound known (and, for a float, possibly NaN): compared by identity
_POSITIONS = (0, 2 ** 31 - 1)  # b, h, q_idx, kv_idx: any int32 position, whatever the lengths
_FLIP = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt"}
_MIRROR = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}
_INCREASING = {"log": (0.0, "log"), "log2": (0.0, "log2"), "log10": (0.0, "log10"), "log1p": (-1.0, "log1p"),
               "sqrt": (0.0, "sqrt"), "exp": (None, "exp"), "exp2": (None, "exp2")}


def _span(op: str, node, spans: dict, deps: dict, fixed: dict | None = None) -> tuple:
    """_span_of_op, with an integer span that leaves its dtype's range unknown (eager integer
    arithmetic wraps there)."""
    span = _span_of_op(op, node, spans, deps, fixed)
    val = node.meta.get("val")
    if span is not _UNKNOWN and isinstance(val, torch.Tensor) and not val.dtype.is_floating_point \
            and val.dtype != torch.bool:
        info = torch.iinfo(val.dtype)
        if span[0] < info.min or span[1] > info.max:
            return _UNKNOWN
    return span


def _span_of_op(op: str, node, spans: dict, deps: dict, fixed: dict | None = None) -> tuple:
    """(lo, hi) of a node's values over every b, h, q_idx, kv_idx >= 0 (the lengths unknown),
    from its arguments' spans, or _UNKNOWN where no sound rule applies (a table's values, the
    score, ops not listed; a float that may be NaN, which a clamp does not bound). Only what a
    table index needs: sums, differences, negation, abs, products and divisions, floor division
    and remainders by positive literals, clamps, increasing functions (log, exp, sqrt), casts,
    comparisons (0 or 1), and where, whose branches are taken under their condition when it
    compares a node with a number (`torch.where(d < 8, d, 8 + log-bucket(d))`: T5's bucket).
    `fixed`: spans a where's branch puts on nodes; the nodes after them are recomputed (and
    remembered there)."""
    def of(a):
        if isinstance(a, bool):
            return (int(a), int(a))
        if isinstance(a, (int, float)):
            return _UNKNOWN if a != a else (a, a)
        if not hasattr(a, "name"):
            return _UNKNOWN
        if fixed is not None:
            if a.name not in fixed and a.op == "call_function":
                fixed[a.name] = _span(op_name(a.target), a, spans, deps, fixed)
            if a.name in fixed:
                return fixed[a.name]
        if a.op == "placeholder":
            return _UNKNOWN if deps[a.name] == {"score"} else _POSITIONS
        return spans.get(a.name, _UNKNOWN)

    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype.is_complex:
        return _UNKNOWN
    args, kwargs = node.args, node.kwargs
    floating = val.dtype.is_floating_point
    if op == "where" and len(args) == 3:
        sides = _branches(node, spans, deps, fixed, of)
        return _UNKNOWN if any(x is _UNKNOWN for x in sides) else _hull(sides)
    if val.dtype == torch.bool:
        return (0, 1)
    given = [of(a) for a in list(args) + list(kwargs.values()) if hasattr(a, "name") or isinstance(a, (int, float))]
    if floating and any(x is _UNKNOWN for x in given):
        return _UNKNOWN  # (NaN may be among its values)
    if op in ("add", "sub", "rsub") and len(args) == 2 and kwargs.get("alpha", 1) == 1:
        (a0, a1), (b0, b1) = of(args[0]), of(args[1])
        if op == "rsub":
            (a0, a1), (b0, b1) = (b0, b1), (a0, a1)
        return _finite((a0 + b0, a1 + b1) if op == "add" else (a0 - b1, a1 - b0))
    if op == "neg":
        lo, hi = of(args[0])
        return (-hi, -lo)
    if op == "abs":
        lo, hi = of(args[0])
        if not floating and lo <= torch.iinfo(val.dtype).min:
            return _UNKNOWN  # (abs of the most negative integer is itself)
        return (0 if lo <= 0 <= hi else min(abs(lo), abs(hi)), max(abs(lo), abs(hi)))
    if op in ("clamp", "clamp_min", "clamp_max", "minimum", "maximum"):
        lo, hi = of(args[0])
        rest = list(args[1:])
        if op == "clamp":
            low, high = (rest + [None, None])[:2]
            low, high = kwargs.get("min", low), kwargs.get("max", high)
        else:
            low = rest[0] if op in ("clamp_min", "maximum") and rest else None
            high = rest[0] if op in ("clamp_max", "minimum") and rest else None
        if low is not None:
            lo, hi = max(lo, of(low)[0]), max(hi, of(low)[1])
        if high is not None:
            lo, hi = min(lo, of(high)[0]), min(hi, of(high)[1])
        return (lo, hi) if lo <= hi else _UNKNOWN
    mode = kwargs.get("rounding_mode") if op == "div" else None
    if op == "div" and mode in ("floor", "trunc") and isinstance(args[1], int) and not isinstance(args[1], bool) \
            and args[1] > 0 and not floating:
        lo, hi = of(args[0])  # (integers: exact floor / trunc division)
        f = (lambda x: x // args[1]) if mode == "floor" else (lambda x: int(x / args[1]) if abs(x) < 2 ** 52
                                                                 else x // args[1])
        return (f(lo) if lo > -_INF else lo, f(hi) if hi < _INF else hi)
    if op in ("mul", "div") and len(args) == 2 and (mode is None or floating):
        (a0, a1), (b0, b1) = of(args[0]), of(args[1])
        if op == "div":
            if not (b0 > 0 or b1 < 0) or not all(abs(x) < _INF for x in (b0, b1)):
                return _UNKNOWN  # (a divisor that can be 0 or infinite)
            b0, b1 = 1 / b1, 1 / b0
        if not all(abs(x) < _INF for x in (a0, a1, b0, b1)):
            if not b0 > 0:  # (an unbounded side times a positive number keeps its order)
                return _UNKNOWN
            corners = [a0 * b0, a0 * b1, a1 * b0, a1 * b1]
        else:
            corners = [x * y for x in (a0, a1) for y in (b0, b1)]
        if any(c != c for c in corners):
            return _UNKNOWN  # (0 times infinity)
        if mode is not None:  # (a float divided and rounded: float64's rounding kept out of the bound)
            lo, hi = min(corners), max(corners)
            return _rounded((lo - 1e-9 * max(1.0, abs(lo)), hi + 1e-9 * max(1.0, abs(hi))), mode)
        return (min(corners), max(corners))
    if op == "floor_divide" and len(args) == 2 and isinstance(args[1], int) and args[1] > 0:
        lo, hi = of(args[0])
        return (lo // args[1] if lo > -_INF else lo, hi // args[1] if hi < _INF else hi)
    if op in ("remainder", "fmod") and len(args) == 2 and isinstance(args[1], int) and args[1] > 0:
        lo, _ = of(args[0])
        return (0 if op == "remainder" or lo >= 0 else -(args[1] - 1), args[1] - 1)
    if op in _INCREASING and len(args) == 1:
        import math

        edge, name = _INCREASING[op]
        lo, hi = of(args[0])
        if edge is not None and lo < edge:
            return _UNKNOWN  # (NaN below the domain)
        fn = getattr(math, name) if name != "exp2" else (lambda x: 2.0 ** x)

        def at(x):
            if x == edge and name.startswith("log"):
                return -_INF
            if abs(x) == _INF:
                return fn(x) if name != "exp2" else (_INF if x > 0 else 0.0)
            try:
                return fn(x)
            except OverflowError:
                return _INF
        return (at(lo), at(hi))
    if op in ("_to_copy", "to", "clone", "alias", "lift_fresh_copy", "type_as", "contiguous") and args:
        lo, hi = of(args[0])
        source = args[0].meta.get("val") if hasattr(args[0], "meta") else None
        if not floating and isinstance(source, torch.Tensor) and source.dtype.is_floating_point:
            # a float to an integer truncates (increasing; float32's rounding along the way
            # widens the bounds by far less than 1e-5 of them); infinite or NaN: no bound
            if not (abs(lo) < _INF and abs(hi) < _INF):
                return _UNKNOWN
            return (int(lo - 1e-5 * max(1.0, abs(lo))), int(hi + 1e-5 * max(1.0, abs(hi))))
        return (lo, hi)
    if op in ("full_like", "new_full", "scalar_tensor", "full") and args:
        fill = args[0] if op == "scalar_tensor" else args[1] if len(args) > 1 else None
        return (fill, fill) if isinstance(fill, (int, float)) and not isinstance(fill, bool) else _UNKNOWN
    return _UNKNOWN


def _finite(span: tuple) -> tuple:
    lo, hi = span
    return _UNKNOWN if lo != lo or hi != hi else span  # (inf - inf)


def _rounded(span: tuple, mode) -> tuple:
    import math

    lo, hi = _finite(span)
    if mode in ("floor", "trunc"):
        f = math.floor if mode == "floor" else math.trunc
        return (f(lo) if abs(lo) < _INF else lo, f(hi) if abs(hi) < _INF else hi)
    return (lo, hi)


def _hull(spans: list) -> tuple:
    return (min(s[0] for s in spans), max(s[1] for s in spans))


def _branches(node, spans: dict, deps: dict, fixed, of) -> list:
    """The spans of where(cond, a, b)'s two branches, each under its side of cond where cond
    compares a node with a number (refined on that node, the nodes after it recomputed)."""
    cond, a, b = node.args
    op = op_name(cond.target) if hasattr(cond, "target") and cond.op == "call_function" else None
    if op not in _MIRROR or len(cond.args) != 2:
        return [of(a), of(b)]
    x, c = cond.args
    if hasattr(c, "name") and not hasattr(x, "name"):
        x, c, op = c, x, _MIRROR[op]
    if not hasattr(x, "name") or not isinstance(c, (int, float)) or isinstance(c, bool) or c != c:
        return [of(a), of(b)]
    lo, hi = of(x)
    whole = not x.meta["val"].dtype.is_floating_point if isinstance(x.meta.get("val"), torch.Tensor) else False
    if not whole and (lo, hi) is _UNKNOWN:
        return [of(a), of(b)]  # (a NaN takes neither side of a compare: where takes b)
    out = []
    for rel, value in ((op, a), (_FLIP[op], b)):
        if rel == "lt":
            span = (lo, min(hi, c - 1 if whole else c))
        elif rel == "le":
            span = (lo, min(hi, c))
        elif rel == "gt":
            span = (max(lo, c + 1 if whole else c), hi)
        else:
            span = (max(lo, c), hi)
        if span[0] > span[1]:
            continue  # (a branch never taken)
        if not hasattr(value, "name"):
            out.append(of(value))
            continue
        inner = {**(fixed or {}), x.name: span}
        try:  # (the branch recomputed from the refined node: a recursion as deep as the graph)
            out.append(inner[value.name] if value.name in inner else
                       _span(op_name(value.target), value, spans, deps, inner) if value.op == "call_function"
                       else of(value))
        except RecursionError:
            return [of(a), of(b)]
    return out or [of(a), of(b)]


def index_reads(mod: Callable | None, role: str = "mask") -> frozenset[str]:
    """Which of the mod's arguments (b, h, q_idx, kv_idx; score) its result depends on, read off
    its traced graph by data flow. An argument used only for its dtype or device (torch's
    `and_masks` calls b.new_ones) does not count. A mod that cannot be traced reads them all."""
    return frozenset() if mod is None else _data_flow(mod, role)[0]


def data_indices(mod: Callable | None, role: str = "mask") -> frozenset[str]:
    """Which arguments index a captured tensor (w[h], lens[b], doc_id[q_idx]...): the mask is then
    bound to the sizes of that data (heads, batch entries, tokens)."""
    return frozenset() if mod is None else _data_flow(mod, role)[1]


def elementwise(mod: Callable, role: str = "mask") -> bool:
    """Does every value in the mod's traced graph stay one value per pair? A mod that builds a
    vector per pair (`q_idx >= starts` against a captured table) and reduces it (`.any()`) means
    something else when called once on broadcast index tensors: the reduction would run over the
    whole tile. Such mods are evaluated under vmap, whatever a probe region shows."""
    return structure_fact(mod, ("elementwise", role), lambda: _elementwise(mod, role))


def _elementwise(mod: Callable, role: str) -> bool:
    try:
        gm = trace_mod(mod, role)
    except Exception:
        return False
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() > 0:
            return False
    return True
