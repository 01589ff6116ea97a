"""Triton for what a mask_mod can give over a whole block of pairs, without evaluating the pairs:
`mask_mod_bounds(b, h, q_lo, q_hi, kv_lo, kv_hi, *tables, *table_ranges) -> (all, any)`.

Every integer value of the traced mod becomes an interval [lo, hi] over the block (q_idx in
[q_lo, q_hi], kv_idx in [kv_lo, kv_hi], b and h exact), every boolean a pair (all, any): all = 1
when it is True at every pair, any = 0 when it is False at every pair. The block scan skips a block
whose mask the bounds decide (all == any) and evaluates every other block pair by pair. Only sound
rules are used: an op without one, a float, a table read at a varying index gives "unknown" ([no
bound], or all = 0, any = 1), and so does any interval that leaves its dtype's range (eager int32
arithmetic wraps there) -- `ok` turns 0 and the block is evaluated.
"""

from __future__ import annotations

import torch

from workbench.translate.emitter import Emitter, View
from workbench.translate.triton_mask import IDENTITY

__all__ = ["TritonBoundsEmitter", "translate_bounds", "range_pointers", "table_ranges", "Box"]

_WIDTH = {torch.int8: 7, torch.int16: 15, torch.int32: 31, torch.uint8: 8}
_BOUND_LIMIT = 1 << 61  # int64 intervals stay far from wrapping: sums of two stay exact
_MUL_LIMIT = 1 << 30  # factors below this: a product stays below 2**60
_COMPARE = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<", "eq": "==", "ne": "!="}
_ARITH = ("add", "sub", "rsub", "mul", "minimum", "maximum", "max", "min")


class Box:
    """An interval (lo, hi) of Triton int64 scalar expressions, or a boolean (all, any) as int32
    0/1 expressions. `point`: lo and hi are one expression (an exact value); `const`: its Python
    value when known at generation time."""

    def __init__(self, lo: str, hi: str | None = None, boolean: bool = False, const=None):
        self.lo, self.hi, self.boolean, self.const = lo, lo if hi is None else hi, boolean, const
        self.point = hi is None or hi == lo


def range_pointers(pointers: list[str]) -> list[str]:
    """The bounds' extra argument per table pointer: (sorted, min, max) of that table
    (`table_ranges`), so that a table read at a varying index still has bounds."""
    return [f"{p[:-len('_ptr')]}_range_ptr" for p in pointers]


def table_ranges(tables: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per table, int64 (sorted, min, max): sorted = 1 when its entries never decrease (in storage
    order), min and max over all entries. Computed on the table's device, without a sync."""
    ranges = []
    for t in tables:
        flat = t.detach().reshape(-1)
        if flat.numel() == 0 or flat.is_floating_point() or flat.is_complex():
            ranges.append(torch.zeros(3, dtype=torch.int64, device=t.device))
            continue
        flat = flat.to(torch.int64)
        rising = (flat[1:] >= flat[:-1]).all() if flat.numel() > 1 else torch.ones((), dtype=torch.bool,
                                                                                   device=t.device)
        ranges.append(torch.stack([rising.to(torch.int64), flat.min(), flat.max()]).contiguous())
    return ranges


class TritonBoundsEmitter(Emitter):
    """A mask_mod over a box of pairs. Values are Boxes, Views (tables not yet read) or None
    (unknown)."""

    def __init__(self, gm, captured: dict[str, torch.Tensor], lifted: frozenset, pointers: list[str]):
        super().__init__(gm, captured, lifted)
        self.mask_pointers = pointers  # the pair-wise translation's, in its order
        self.lines = ["    zero = q_lo.to(tl.int64) * 0",
                      "    b, h = zero + b, zero + h",
                      "    q_lo, q_hi, kv_lo, kv_hi = zero + q_lo, zero + q_hi, zero + kv_lo, zero + kv_hi",
                      "    zero32 = zero.to(tl.int32)",
                      "    ok = zero32 + 1"]
        self.arguments = iter([Box("b"), Box("h"), Box("q_lo", "q_hi"), Box("kv_lo", "kv_hi")])
        self.unknown_bool = Box("zero32", "(zero32 + 1)", boolean=True)

    # ------------------------------------------------------------ boxes

    def number(self, c: int, boolean: bool = False) -> Box:
        # numbers are written as tensors (zero + c): Triton's tl.minimum / .to want one
        return Box(f"(zero32 + {int(c)})" if boolean else f"(zero + {c})", boolean=boolean, const=int(c))

    def box(self, expr_lo: str, expr_hi: str | None = None, boolean: bool = False) -> Box:
        lo = self.emit(expr_lo, "lo")
        return Box(lo, None if expr_hi is None else self.emit(expr_hi, "hi"), boolean)

    def need(self, cond: str) -> None:
        """The bounds hold only where `cond` does: else `ok` is 0 and the block is evaluated."""
        self.lines.append(f"    ok = ok & ({cond}).to(tl.int32)")

    def value(self, a):
        if hasattr(a, "name"):
            return self.env.get(a.name)
        if isinstance(a, bool):
            return self.number(a, boolean=True)
        if isinstance(a, int):
            return self.number(a)
        return None  # floats, dtypes, lists...

    def as_bool(self, v) -> Box:
        if not isinstance(v, Box):
            return self.unknown_bool
        if v.boolean:
            return v
        if v.point:
            return self.box(f"({v.lo} != 0).to(tl.int32)", boolean=True)
        return self.box(f"((({v.lo}) > 0) | (({v.hi}) < 0)).to(tl.int32)",
                        f"((({v.lo}) != 0) | (({v.hi}) != 0)).to(tl.int32)", boolean=True)

    @staticmethod
    def fold(x: Box, y: Box, fn: str) -> str:
        """tl.minimum / tl.maximum of two expressions (folded when both are numbers: Triton wants a
        tensor among them)."""
        if x.const is not None and y.const is not None:
            return f"(zero + {min(x.const, y.const) if fn == 'minimum' else max(x.const, y.const)})"
        return f"tl.{fn}({x.lo}, {y.lo})"

    def in_range(self, v: Box, dtype) -> Box:
        """The interval of an integer node, with its dtype's range demanded of it."""
        if v.const is not None:
            return v
        width = _WIDTH.get(dtype)
        lo_limit, hi_limit = ((-(1 << width) if dtype != torch.uint8 else 0, (1 << width) - 1) if width
                              else (-_BOUND_LIMIT, _BOUND_LIMIT))
        self.need(f"({v.lo} >= {lo_limit}) & ({v.hi} <= {hi_limit})")
        return v

    # ------------------------------------------------------------ hooks

    def placeholder(self, _node):
        return next(self.arguments)

    def constant(self, _node, tensor):
        name = self.tensor_name(tensor)
        if tensor.dim() == 0 and name not in self.lifted:
            item = tensor.item()
            if isinstance(item, bool):
                return self.number(item, boolean=True)
            if isinstance(item, int):
                return self.number(item)
            return None
        if name is not None and f"{name}_ptr" in self.mask_pointers:
            if tensor.dim() == 0:
                return self.load(View(f"{name}_ptr", "0", (), ()), tensor.dtype)
            return View(f"{name}_ptr", "0", tuple(tensor.shape), torch.empty(tensor.shape).stride())
        return None

    def output(self, node):
        result = self.as_bool(self.value(self.returned(node)))
        self.lines.append(f"    return ({result.lo}) & ok, ({result.hi}) | (1 - ok)")

    def call(self, op, node):
        dtype = getattr(node.meta.get("val"), "dtype", None)
        try:
            result = self.op(op, node, dtype)
        except (IndexError, KeyError, TypeError, ValueError):
            result = None
        if dtype == torch.bool and isinstance(result, Box):
            result.boolean = True
        return result

    # ------------------------------------------------------------ aten ops, by family

    def op(self, op: str, node, dtype):
        args = node.args
        if op in IDENTITY:
            return self.value(args[0])
        if op in _COMPARE:
            x, y = self.value(args[0]), self.value(args[1])
            return self.compare(op, x, y) if isinstance(x, Box) and isinstance(y, Box) else None
        if dtype == torch.bool and op in ("logical_and", "logical_or", "bitwise_and", "bitwise_or", "logical_xor",
                                          "bitwise_xor", "bitwise_not"):
            return self.logic(op, node)
        if op == "logical_not":
            return self.logic(op, node)
        if op == "where":
            return self.where(node, dtype)
        if op in ("_to_copy", "to", "type_as", "convert_element_type"):
            return self.cast(node, dtype)
        if op in ("new_ones", "new_zeros", "new_full", "ones_like", "zeros_like", "full_like", "scalar_tensor",
                  "full"):
            return self.fill(op, node, dtype)
        if op in ("index", "select"):
            return self.index(op, node)
        if dtype is not None and not dtype.is_floating_point and dtype != torch.bool:
            result = self.arith(op, args, node.kwargs)
            return self.in_range(result, dtype) if isinstance(result, Box) else result
        return None

    def compare(self, op: str, x: Box, y: Box) -> Box:
        if x.point and y.point:
            return self.box(f"(({x.lo}) {_COMPARE[op]} ({y.lo})).to(tl.int32)", boolean=True)
        if op in ("le", "lt"):
            x, y, op = y, x, {"le": "ge", "lt": "gt"}[op]
        if op in ("ge", "gt"):
            sym = _COMPARE[op]
            return self.box(f"(({x.lo}) {sym} ({y.hi})).to(tl.int32)", f"(({x.hi}) {sym} ({y.lo})).to(tl.int32)",
                            boolean=True)
        same = f"(({x.lo}) == ({x.hi})) & (({y.lo}) == ({y.hi})) & (({x.lo}) == ({y.lo}))"
        overlap = f"(({x.lo}) <= ({y.hi})) & (({y.lo}) <= ({x.hi}))"
        if op == "eq":
            return self.box(f"({same}).to(tl.int32)", f"({overlap}).to(tl.int32)", boolean=True)
        return self.box(f"(1 - ({overlap}).to(tl.int32))", f"(1 - ({same}).to(tl.int32))", boolean=True)

    def logic(self, op: str, node) -> Box:
        if op in ("logical_not", "bitwise_not"):
            x = self.as_bool(self.value(node.args[0]))
            return self.box(f"(1 - {x.hi})", f"(1 - {x.lo})", boolean=True)
        x, y = self.as_bool(self.value(node.args[0])), self.as_bool(self.value(node.args[1]))
        if op in ("logical_xor", "bitwise_xor"):
            decided = f"({x.lo} == {x.hi}) & ({y.lo} == {y.hi})"
            return self.box(f"(({decided}) & ({x.lo} != {y.lo})).to(tl.int32)",
                            f"(1 - (({decided}) & ({x.lo} == {y.lo})).to(tl.int32))", boolean=True)
        sym = "&" if op.endswith("and") else "|"
        result = self.box(f"({x.lo} {sym} {y.lo})") if x.point and y.point else self.box(
            f"({x.lo} {sym} {y.lo})", f"({x.hi} {sym} {y.hi})", boolean=True)
        result.boolean = True
        return result

    def where(self, node, dtype):
        c, x, y = self.as_bool(self.value(node.args[0])), self.value(node.args[1]), self.value(node.args[2])
        if not (isinstance(x, Box) and isinstance(y, Box)):
            return None
        if dtype == torch.bool:
            x, y = self.as_bool(x), self.as_bool(y)
        pick = "tl.where({c}.to(tl.int1), {x}, tl.where(({h} == 0), {y}, {both}))"
        return self.box(pick.format(c=f"({c.lo} == 1)", x=x.lo, h=c.hi, y=y.lo, both=f"tl.minimum({x.lo}, {y.lo})"),
                        pick.format(c=f"({c.lo} == 1)", x=x.hi, h=c.hi, y=y.hi, both=f"tl.maximum({x.hi}, {y.hi})"),
                        boolean=dtype == torch.bool)

    def cast(self, node, dtype):
        x = self.value(node.args[0])
        if not isinstance(x, Box):
            return None
        if dtype == torch.bool:
            return self.as_bool(x)
        if dtype is not None and not dtype.is_floating_point:
            return self.in_range(Box(x.lo, x.hi, const=x.const), dtype)
        return None

    def fill(self, op: str, node, dtype):
        args = node.args
        fill = {"new_ones": 1, "ones_like": 1, "new_zeros": 0, "zeros_like": 0}.get(op)
        if fill is None:
            fill = args[-1] if op == "scalar_tensor" else args[1]
        if dtype == torch.bool:
            return self.number(bool(fill), boolean=True)
        if dtype is not None and not dtype.is_floating_point and isinstance(fill, (int, bool)):
            return self.number(int(fill))
        return None

    def arith(self, op: str, args, kwargs):
        xs = [self.value(a) for a in args]
        if op in ("add", "sub") and kwargs.get("alpha", 1) != 1:
            return None
        if op in _ARITH:
            if len(xs) < 2 or not all(isinstance(x, Box) for x in xs[:2]):
                return None
            return self.binary(op, xs[0], xs[1])
        x = xs[0] if xs and isinstance(xs[0], Box) else None
        if op == "neg":
            return None if x is None else (self.box(f"(-{x.lo})") if x.point else self.box(f"(-{x.hi})", f"(-{x.lo})"))
        if op == "abs":
            if x is None:
                return None
            if x.point:
                return self.box(f"tl.abs({x.lo})")
            return self.box(f"tl.where({x.lo} >= 0, {x.lo}, tl.where({x.hi} <= 0, -{x.hi}, 0))",
                            f"tl.maximum(-{x.lo}, {x.hi})")
        if op in ("floor_divide", "remainder") or (op == "div" and kwargs.get("rounding_mode") == "floor"):
            if len(xs) < 2 or not isinstance(xs[0], Box) or not isinstance(xs[1], Box) or not xs[1].point:
                return None
            return self.divide(op, xs[0], xs[1])
        if op in ("clamp", "clip", "clamp_min", "clamp_max"):
            return self.clamp(op, x, args, kwargs)
        return None

    def binary(self, op: str, x: Box, y: Box):
        """add, sub, mul, minimum, maximum of two intervals."""
        if op == "rsub":
            x, y, op = y, x, "sub"
        if op in ("max", "min"):
            op = "maximum" if op == "max" else "minimum"
        if x.point and y.point:
            if op == "mul":
                for v in (x, y):
                    if v.const is None:
                        self.need(f"({v.lo} < {_MUL_LIMIT}) & ({v.lo} > -{_MUL_LIMIT})")
                    elif abs(v.const) >= _MUL_LIMIT:
                        return None
            if op in ("minimum", "maximum"):
                return self.box(self.fold(x, y, op))
            return self.box({"add": "({a} + {b})", "sub": "({a} - {b})", "mul": "({a} * {b})"}[op].format(a=x.lo, b=y.lo))
        if op == "add":
            return self.box(f"({x.lo} + {y.lo})", f"({x.hi} + {y.hi})")
        if op == "sub":
            return self.box(f"({x.lo} - {y.hi})", f"({x.hi} - {y.lo})")
        if op in ("minimum", "maximum"):
            return self.box(f"tl.{op}({x.lo}, {y.lo})", f"tl.{op}({x.hi}, {y.hi})")
        # mul: the extremes of the four corner products, factors kept small enough to be exact
        for v in (x, y):
            if v.const is not None:
                if abs(v.const) >= _MUL_LIMIT:
                    return None
            else:
                self.need(f"({v.lo} > -{_MUL_LIMIT}) & ({v.hi} < {_MUL_LIMIT})")
        if y.const is not None:
            x, y = y, x
        if x.const is not None:
            c = x.const
            return self.box(f"({y.lo} * {c})", f"({y.hi} * {c})") if c >= 0 else \
                self.box(f"({y.hi} * {c})", f"({y.lo} * {c})")
        corners = [f"({p} * {q})" for p in (x.lo, x.hi) for q in (y.lo, y.hi)]
        return self.box(f"tl.minimum(tl.minimum({corners[0]}, {corners[1]}), tl.minimum({corners[2]}, {corners[3]}))",
                        f"tl.maximum(tl.maximum({corners[0]}, {corners[1]}), tl.maximum({corners[2]}, {corners[3]}))")

    def divide(self, op: str, x: Box, d: Box):
        """Python's floor division / modulo by a positive exact divisor."""
        if d.const is not None and d.const <= 0:
            return None
        if d.const is None:
            self.need(f"{d.lo} > 0")
            d = self.box(f"tl.maximum({d.lo}, 1)")  # (a divisor <= 0 is refused by ok; no division by 0 meanwhile)
        if op == "remainder":
            if x.point:
                return self.box(f"_py_mod({x.lo}, {d.lo})")
            same = self.emit(f"_py_floordiv({x.lo}, {d.lo}) == _py_floordiv({x.hi}, {d.lo})", "same")
            return self.box(f"tl.where({same}, _py_mod({x.lo}, {d.lo}), 0)",
                            f"tl.where({same}, _py_mod({x.hi}, {d.lo}), {d.lo} - 1)")
        if x.point:
            return self.box(f"_py_floordiv({x.lo}, {d.lo})")
        return self.box(f"_py_floordiv({x.lo}, {d.lo})", f"_py_floordiv({x.hi}, {d.lo})")

    def clamp(self, op: str, v, args, kwargs):
        lo = args[1] if len(args) > 1 else kwargs.get("min")
        hi = args[2] if len(args) > 2 else kwargs.get("max")
        if op == "clamp_max":
            lo, hi = None, lo
        for bound, fn in ((lo, "maximum"), (hi, "minimum")):
            if v is None or bound is None:
                continue
            bound = self.value(bound)
            if not isinstance(bound, Box):
                return None
            v = self.box(self.fold(v, bound, fn)) if v.point and bound.point else self.box(
                f"tl.{fn}({v.lo}, {bound.lo})", f"tl.{fn}({v.hi}, {bound.hi})")
        return v

    # ------------------------------------------------------------ captured tables

    def load(self, view: View, dtype):
        """A table entry at an exact index: its value (a number or a boolean), None for floats."""
        if dtype == torch.bool:
            return self.box(f"(tl.load({view.ptr} + {view.offset}) != 0).to(tl.int32)", boolean=True)
        if dtype.is_floating_point or dtype.is_complex:
            return None
        return self.box(f"tl.load({view.ptr} + {view.offset}).to(tl.int64)")

    def range_read(self, view: View, v: Box, dtype):
        """table[i] for i anywhere in [v.lo, v.hi], a whole 1-d table: [table[lo], table[hi]] when its
        entries never decrease and the interval lies inside it (a document table), else the table's
        [min, max] (whatever valid index is read, it is one of the entries)."""
        if dtype.is_floating_point or dtype.is_complex:
            return None
        size, stride = view.shape[0], view.strides[0]
        rng = f"{view.ptr[:-len('_ptr')]}_range_ptr"
        inside = f"(tl.load({rng}) != 0) & ({v.lo} >= 0) & ({v.hi} < {size})"
        at = "tl.load({ptr} + tl.minimum(tl.maximum({i}, 0), {last}) * {stride}).to(tl.int64)"
        lo = f"tl.where({inside}, {at.format(ptr=view.ptr, i=v.lo, last=size - 1, stride=stride)}, tl.load({rng} + 1))"
        hi = f"tl.where({inside}, {at.format(ptr=view.ptr, i=v.hi, last=size - 1, stride=stride)}, tl.load({rng} + 2))"
        if dtype == torch.bool:
            return self.box(f"(({lo}) != 0).to(tl.int32)", f"(({hi}) != 0).to(tl.int32)", boolean=True)
        return self.box(lo, hi)

    def index(self, op: str, node):
        """`table[i, ...]` / `table.select(d, i)` at exact indices (b, h, numbers): a load, or a
        smaller view. A whole 1-d table at a varying index (q_idx, kv_idx): `range_read`. Otherwise
        unknown: None."""
        base = self.value(node.args[0]) if hasattr(node.args[0], "name") else None
        if not isinstance(base, View):
            return None
        out_dtype = getattr(node.meta.get("val"), "dtype", torch.int32)
        if op == "select":
            dim, i = node.args[1] % len(base.shape), node.args[2]
            if not isinstance(i, int):
                return None
            i = i % base.shape[dim]
            offset = f"{base.offset} + {i * base.strides[dim]}"
            shape = base.shape[:dim] + base.shape[dim + 1:]
            strides = base.strides[:dim] + base.strides[dim + 1:]
        else:
            idx = list(node.args[1])
            if any(i is None for i in idx) or len(idx) > len(base.shape):
                return None
            if len(idx) == 1 and len(base.shape) == 1 and base.offset == "0":
                v = self.value(idx[0])
                if isinstance(v, Box) and not v.point and not v.boolean:
                    return self.range_read(base, v, out_dtype)
            parts = [base.offset]
            for i, size, stride in zip(idx, base.shape, base.strides):
                v = self.value(i)
                if not isinstance(v, Box) or not v.point or v.boolean:
                    return None
                # an index out of range makes the bounds unknown (the eager mod would fail there);
                # the read itself stays inside the table
                self.need(f"({v.lo} >= -{size}) & ({v.lo} < {size})")
                parts.append(f"tl.minimum(tl.maximum(tl.where({v.lo} < 0, {v.lo} + {size}, {v.lo}), 0), "
                             f"{size - 1}) * {stride}")
            offset = " + ".join(parts)
            shape, strides = base.shape[len(idx):], base.strides[len(idx):]
        if shape:
            return View(base.ptr, offset, shape, strides)
        return self.load(View(base.ptr, offset, (), ()), out_dtype)


def translate_bounds(gm, fn_name: str, captured: dict[str, torch.Tensor], lifted: frozenset,
                     pointers: list[str]) -> str:
    """Triton source of `fn_name(b, h, q_lo, q_hi, kv_lo, kv_hi, *pointers, *ranges) -> (all, any)`
    for the traced mask_mod; `pointers` are the pair-wise translation's, in its order."""
    emitter = TritonBoundsEmitter(gm, captured, lifted, pointers)
    emitter.walk()
    return emitter.function(fn_name, ["b", "h", "q_lo", "q_hi", "kv_lo", "kv_hi"] + pointers
                            + range_pointers(pointers))
