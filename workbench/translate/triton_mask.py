"""Triton for a mask_mod / score_mod, pair by pair: `mask_mod_triton(b, h, q_idx, kv_idx, *tables)`
and `score_mod_triton(score, b, h, q_idx, kv_idx, *tables)`, one line per aten op of the traced mod.

Captured tensors become pointer arguments read with tl.load where they are indexed. Python
semantics are kept where Triton's differ: integer `//` and `%` round toward minus infinity in
Python and toward zero in Triton, so both get helpers (skipped where both operands are known to be
>= 0). Values that carry a trailing dimension (a comparison against a whole captured table, a row
of a 2-d table) stay symbolic until a reduction (`.any()`, `.all()`, `.sum()`, max / min)
consumes them; the reduction is unrolled over the table's entries.
"""

from __future__ import annotations

import torch
import torch.fx

from workbench.define import cdiv
from workbench.translate.emitter import K, Emitter, Untranslatable, Vec, View, literal

__all__ = ["TritonMaskEmitter", "translate_mod", "HELPERS", "MAX_UNROLLED", "and_leaves", "range_pairs"]

_BINARY = {
    "__rshift__": "({a} >> {b})", "__lshift__": "({a} << {b})", "bitwise_right_shift": "({a} >> {b})",
    "bitwise_left_shift": "({a} << {b})", "true_divide": "({a} / {b})", "logical_xor": "({a} ^ {b})",
    "add": "({a} + {b})", "sub": "({a} - {b})", "mul": "({a} * {b})", "div": "({a} / {b})",
    "ge": "({a} >= {b})", "gt": "({a} > {b})", "le": "({a} <= {b})", "lt": "({a} < {b})",
    "eq": "({a} == {b})", "ne": "({a} != {b})",
    "bitwise_and": "({a} & {b})", "bitwise_or": "({a} | {b})", "bitwise_xor": "({a} ^ {b})",
    "logical_and": "({a} & {b})", "logical_or": "({a} | {b})",
    "minimum": "tl.minimum({a}, {b})", "maximum": "tl.maximum({a}, {b})",
    "floor_divide": "_py_floordiv({a}, {b})", "remainder": "_py_mod({a}, {b})",
    "pow": "tl.exp(tl.log({a}) * {b})",
}
# tanh as Triton's portable ops write it (the port's Hopper copies rewrite this very text: generate.py)
PORTABLE_TANH = "(2.0 * tl.sigmoid(2.0 * {a}) - 1.0)"
_UNARY = {
    "abs": "tl.abs({a})", "neg": "(-{a})", "bitwise_not": "(~{a})", "logical_not": "({a} == 0)",
    "exp": "tl.exp({a})", "log": "tl.log({a})", "sqrt": "tl.sqrt({a})", "sigmoid": "tl.sigmoid({a})",
    "tanh": PORTABLE_TANH,
    "sin": "tl.sin({a})", "cos": "tl.cos({a})", "floor": "tl.floor({a})", "ceil": "tl.ceil({a})",
    "exp2": "tl.exp2({a})", "log2": "tl.log2({a})", "rsqrt": "tl.rsqrt({a})", "erf": "tl.erf({a})",
    "log1p": "tl.log(1.0 + {a})", "expm1": "(tl.exp({a}) - 1.0)", "reciprocal": "(1.0 / {a})",
    "square": "({a} * {a})",
}
IDENTITY = {"clone", "alias", "view", "expand", "lift_fresh_copy", "detach", "contiguous", "_unsafe_view",
            "reshape", "squeeze", "unsqueeze"}
FILLS = ("new_ones", "new_zeros", "new_full", "ones_like", "zeros_like", "full_like", "scalar_tensor", "full")
CASTS = ("_to_copy", "to", "type_as", "convert_element_type")
CLAMPS = ("clamp", "clip", "clamp_min", "clamp_max")
TL_DTYPES = {torch.int32: "tl.int32", torch.int64: "tl.int64", torch.float32: "tl.float32", torch.bool: "tl.int1",
             torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16", torch.float64: "tl.float64",
             torch.int8: "tl.int8", torch.int16: "tl.int16", torch.uint8: "tl.uint8"}
# Reductions over a vector (a captured 1-d table, or a row of a 2-d one): how elements combine.
_REDUCE = {"any": "({a} | {b})", "all": "({a} & {b})", "sum": "({a} + {b})", "amax": "tl.maximum({a}, {b})",
           "amin": "tl.minimum({a}, {b})", "max": "tl.maximum({a}, {b})", "min": "tl.minimum({a}, {b})",
           "prod": "({a} * {b})"}
MAX_UNROLLED = 256  # entries a reduction is unrolled over (spans, documents... are far fewer)
# ops whose result is >= 0 when their arguments are
_KEEPS_NONNEG = {"add", "mul", "floor_divide", "abs", "bitwise_and", "clone", "alias", "view", "expand",
                 "lift_fresh_copy", "detach", "_to_copy", "to", "index", "select", "maximum", "minimum"}

HELPERS = '''@triton.jit
def _py_floordiv(a, b):
    # Python floor division (Triton's // truncates toward zero)
    q = a // b
    return q - ((a % b != 0) & ((a < 0) != (b < 0))).to(q.dtype)


@triton.jit
def _py_mod(a, b):
    # Python modulo: the result takes the sign of b (Triton's % takes the sign of a)
    r = a % b
    return r + b * ((r != 0) & ((r < 0) != (b < 0))).to(r.dtype)
'''


# ------------------------------------------------------------ range checks in an and (fast forms)
# `(x >= lo) & (x < hi)` is two compares and, in a kernel, two selects per pair; the fast copies of a
# mask (the FA4 export's CuTe DSL, the port's Gluon copy) write such a pair as one unsigned compare.
# These find the pairs in the traced graph; each translator decides which it can spell exactly.

def _is_bool_and(n) -> bool:
    from workbench.define.trace import op_name

    return (isinstance(n, torch.fx.Node) and n.op == "call_function" and len(n.args) == 2 and
            op_name(n.target) in ("bitwise_and", "logical_and") and getattr(n.meta.get("val"), "dtype", None) == torch.bool)


def and_leaves(node) -> list:
    """The operands of an and of booleans, gathered through the nested ands that nothing else uses
    (`a & b & c & d` -> [a, b, c, d]), so a pair split across them still meets."""
    if _is_bool_and(node) and len(node.users) == 1:
        return and_leaves(node.args[0]) + and_leaves(node.args[1])
    return [node]


def comparison(n):
    """(op, left, right) for a node `left >= / < / <= right`, else None."""
    from workbench.define.trace import op_name

    if not isinstance(n, torch.fx.Node) or n.op != "call_function" or len(n.args) != 2:
        return None
    name = op_name(n.target)
    return (name, n.args[0], n.args[1]) if name in ("ge", "lt", "le") else None


def same_value(a, b) -> bool:
    """One value, or one computed twice by the same op on the same arguments (`kv - q` in both)."""
    return a is b or (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node) and
                      a.op == b.op == "call_function" and a.target == b.target and a.args == b.args and
                      a.kwargs == b.kwargs)


def is_integer(v) -> bool:
    """An int literal, or a node whose value is int32 / int64 (not a bool)."""
    if isinstance(v, bool):
        return False
    if isinstance(v, int):
        return True
    return isinstance(v, torch.fx.Node) and getattr(v.meta.get("val"), "dtype", None) in (torch.int32, torch.int64)


def window_of(lower, upper):
    """(x, lo, k) when `lower & upper` reads lo <= x < lo + k: `x >= lo` with `x < lo + k` (or
    `x <= lo + (k - 1)`), k a literal >= 0, x and lo integer nodes; else None."""
    from workbench.define.trace import op_name

    (lo_op, x, lo), (hi_op, x2, hi) = lower, upper
    if lo_op != "ge" or hi_op not in ("lt", "le") or not same_value(x, x2) or not isinstance(x, torch.fx.Node):
        return None
    if not (is_integer(x) and isinstance(lo, torch.fx.Node) and is_integer(lo) and isinstance(hi, torch.fx.Node)
            and hi.op == "call_function" and op_name(hi.target) == "add" and len(hi.args) == 2):
        return None
    base, k = hi.args
    if not same_value(base, lo) or isinstance(k, bool) or not isinstance(k, int) or k < 0:
        return None
    return x, lo, k if hi_op == "lt" else k + 1


def range_pairs(parts: list, spell) -> tuple[list, set]:
    """Pairs of `parts` (the leaves of an and) that `spell(lower, upper)` writes as one check, each
    comparison in at most one pair: ([what spell returned, ...], the indices used)."""
    spelled, used = [], set()
    for i, lower in enumerate(parts):
        for j, upper in enumerate(parts):
            if i in used or j in used or i == j:
                continue
            a, b = comparison(lower), comparison(upper)
            found = spell(a, b) if a is not None and b is not None else None
            if found is not None:
                spelled.append(found)
                used |= {i, j}
    return spelled, used


class TritonMaskEmitter(Emitter):
    """A mod pair by pair. Values are scalar expressions (one per lane), Vecs or Views.

    The target language's spelling lives in the class attributes and `load` / `cast_text`; the CuTe
    DSL translator (`cute_dsl.CuteMaskEmitter`) is this walk with its own spelling."""

    BINARY, UNARY, REDUCE, DTYPES = _BINARY, _UNARY, _REDUCE, TL_DTYPES
    WHERE = "tl.where({a}, {b}, {c})"
    TRUNC_DIV = "({a} // {b})"  # Triton's integer // truncates toward zero
    GELU_TANH = ("(0.5 * {a} * (1.0 + (2.0 * tl.sigmoid(2.0 * (0.7978845608028654 * ({a} + "
                 "0.044715 * {a} * {a} * {a}))) - 1.0)))")
    GELU = "(0.5 * {a} * (1.0 + tl.erf({a} * 0.7071067811865476)))"
    DEFAULT_DTYPE = "tl.float32"

    def load(self, ptr: str, offset: str) -> str:
        """The source that reads one entry of a captured tensor."""
        return f"tl.load({ptr} + {offset})"

    def cast_text(self, expr: str, dtype: torch.dtype) -> str:
        return f"({expr}).to({self.DTYPES[dtype]})"

    def __init__(self, gm, arg_names: list[str], captured: dict[str, torch.Tensor],
                 lifted: frozenset = frozenset()):
        super().__init__(gm, captured, lifted)
        self.arg_names = iter(arg_names)
        # values known to be >= 0 (index arguments, sums and products of such, tables whose entries
        # are all >= 0): Python's floor division and modulo then equal Triton's plain // and %,
        # which saves the sign fix-ups in the hot loop (a 2-D neighbourhood divides every pair)
        self.nonneg: set[str] = set()

    # ------------------------------------------------------------ values

    def value(self, a):
        """An argument as a scalar expression, a Vec, or a View."""
        if hasattr(a, "name") and a.name in self.env:
            return self.env[a.name]
        if isinstance(a, (int, float, bool)):
            return literal(a)
        if isinstance(a, torch.dtype):
            return self.DTYPES.get(a, self.DEFAULT_DTYPE)
        if a is None:
            return "None"
        raise Untranslatable(f"argument {a!r} of type {type(a).__name__}")

    def as_elementwise(self, v):
        """A scalar expression, or a Vec; views are loaded (0-d) or become vectors (1-d)."""
        if isinstance(v, View):
            if len(v.shape) == 0:
                name = self.fresh("ld")
                self.lines.append(f"    {name} = {self.load(v.ptr, v.offset)}")
                return name
            if len(v.shape) == 1:
                if v.shape[0] > MAX_UNROLLED:
                    raise Untranslatable(f"a captured table of {v.shape[0]} entries is used whole "
                                         f"(at most {MAX_UNROLLED} are unrolled)")
                step = f" * {v.strides[0]}" if v.strides[0] != 1 else ""
                return Vec(v.shape[0], self.load(v.ptr, f"{v.offset} + ({K}){step}"))
            raise Untranslatable("a captured tensor with two or more dimensions is used whole")
        return v

    def combine(self, template: str, *vals):
        """`template` ({a}, {b}, {c}) filled with the values, elementwise or per vector element."""
        vals = [self.as_elementwise(v) for v in vals]
        sizes = {v.n for v in vals if isinstance(v, Vec)}
        if len(sizes) > 1:
            raise Untranslatable(f"vectors of different lengths {sorted(sizes)} are combined")
        exprs = [v.expr if isinstance(v, Vec) else v for v in vals]
        expr = template.format(**dict(zip("abc", exprs)))
        return Vec(sizes.pop(), expr) if sizes else expr

    def is_nonneg(self, a) -> bool:
        if isinstance(a, bool):
            return True
        if isinstance(a, (int, float)):
            return a >= 0
        return hasattr(a, "name") and a.name in self.nonneg

    def fold_and(self, node, spell, combine=None) -> str | None:
        """The and at `node` with its range checks written as `spell(lower, upper)` writes them
        (range_pairs; `combine` may merge the spelled checks), the other operands as they are;
        None when no pair is spelled or an operand is not a plain value (a vector over a table,
        which the walk reduces itself)."""
        parts = and_leaves(node.args[0]) + and_leaves(node.args[1])
        spelled, used = range_pairs(parts, spell)
        if not spelled:
            return None
        exprs = list(combine(spelled) if combine is not None else spelled)
        for i, leaf in enumerate(parts):
            if i not in used:
                value = self.value(leaf)
                if not isinstance(value, str):
                    return None
                exprs.append(value)
        return "(" + " & ".join(exprs) + ")"

    # ------------------------------------------------------------ hooks

    def placeholder(self, node):
        name = next(self.arg_names)
        if name != "score":
            self.nonneg.add(node.name)
        return name

    def constant(self, node, tensor):
        if self.is_lifted(tensor):
            # a lifted parameter: a kernel argument, so its value never enters the source (and
            # nothing is assumed of its sign)
            return self.view_of(tensor, node.target)
        if tensor.numel() and not tensor.is_floating_point() and not tensor.is_complex() and int(tensor.min()) >= 0:
            self.nonneg.add(node.name)
        return literal(tensor.item()) if tensor.dim() == 0 else self.view_of(tensor, node.target)

    def output(self, node):
        result = self.as_elementwise(self.value(self.returned(node)))
        if isinstance(result, Vec):
            raise Untranslatable("the mod returns a vector, not one value per pair")
        self.lines.append(f"    return {result}")

    def call(self, op, node):
        args = node.args
        args_nonneg = all(self.is_nonneg(a) for a in args if not isinstance(a, (list, tuple, torch.dtype)))
        shifted = self._pow2_divmod(op, node)
        if shifted is not None:
            if op == "remainder" or args_nonneg:
                self.nonneg.add(node.name)
            self.lines.append(f"    v_{node.name} = {shifted}")
            return f"v_{node.name}"
        if op in ("floor_divide", "remainder") and args_nonneg and not (
                isinstance(args[1], (int, float)) and args[1] == 0):
            result = self.combine("({a} // {b})" if op == "floor_divide" else "({a} % {b})", self.value(args[0]),
                                  self.value(args[1]))
        else:
            result = self.op(op, node)
        min_arg = args[1] if len(args) > 1 else node.kwargs.get("min")
        if (op in _KEEPS_NONNEG and args_nonneg) or op == "abs" or (op == "remainder" and self.is_nonneg(args[1])) or (
                op in ("clamp", "clamp_min") and self.is_nonneg(min_arg)):
            self.nonneg.add(node.name)
        if isinstance(result, (View, Vec)):
            return result
        self.lines.append(f"    v_{node.name} = {result}")
        return f"v_{node.name}"

    def _pow2_divmod(self, op, node):
        """An integer `%` / `//` by a positive power of two as a mask / an arithmetic shift: exact for
        any sign in two's complement (Python's floor semantics), where the generic form needs a sign
        fix-up per pair (a dilated window's `(q - kv) % 4`: one op instead of about ten). None for
        anything else."""
        args, kwargs = node.args, node.kwargs
        dtype = getattr(node.meta.get("val"), "dtype", None)
        divisor = args[1] if len(args) > 1 else None
        if (op in ("remainder", "floor_divide") or (op == "div" and kwargs.get("rounding_mode") == "floor")) and \
                isinstance(divisor, int) and not isinstance(divisor, bool) and divisor > 0 and \
                divisor & (divisor - 1) == 0 and dtype is not None and not dtype.is_floating_point and \
                dtype != torch.bool:
            template = f"({{a}} & {divisor - 1})" if op == "remainder" else f"({{a}} >> {divisor.bit_length() - 1})"
            return self.combine(template, self.value(args[0]))
        return None

    # ------------------------------------------------------------ aten ops, by family

    def op(self, op: str, node):
        """One aten op as a scalar expression, a Vec or a View."""
        args, kwargs = node.args, node.kwargs
        if op == "index":
            return self.index(node)
        if op == "select":
            return self.select(node)
        if op == "slice":
            return self.slice(node)
        if op in IDENTITY:
            return self.value(args[0])
        if op in FILLS:
            return self.fill(op, node)
        if op in CASTS:
            return self.cast(node)
        if op == "where":
            return self.combine(self.WHERE, *(self.value(a) for a in args[:3]))
        if op in CLAMPS:
            return self.clamp(op, node)
        if op == "rsub":
            return self.combine("({b} - {a})", self.value(args[0]), self.value(args[1]))
        if op == "div" and kwargs.get("rounding_mode") in ("floor", "trunc"):
            template = self.BINARY["floor_divide"] if kwargs["rounding_mode"] == "floor" else self.TRUNC_DIV
            return self.combine(template, self.value(args[0]), self.value(args[1]))
        if op == "pow" and isinstance(args[1], int) and 0 <= args[1] <= 8:
            if args[1] == 0:
                return self.combine("({a} * 0 + 1)", self.value(args[0]))
            return self.combine("(" + " * ".join(["{a}"] * args[1]) + ")", self.value(args[0]))
        if op in ("max", "min") and len(args) == 2 and not isinstance(args[1], int):
            return self.combine(self.BINARY["maximum" if op == "max" else "minimum"], self.value(args[0]),
                                self.value(args[1]))
        if op in self.REDUCE and (len(args) == 1 or (len(args) >= 2 and args[1] in (0, -1, [0], [-1]))):
            return self.reduce(op, node)
        if op in self.BINARY and len(args) >= 2:
            return self.combine(self.BINARY[op], self.value(args[0]), self.value(args[1]))
        if op in self.UNARY:
            return self.combine(self.UNARY[op], self.value(args[0]))
        if op == "gelu":
            if kwargs.get("approximate", "none") == "tanh":
                return self.combine(self.GELU_TANH, self.value(args[0]))
            return self.combine(self.GELU, self.value(args[0]))
        raise Untranslatable(f"aten op `{op}` has no Triton translation here")

    def index(self, node):
        """table[i, j, ...]: a load, a smaller View, or (a vector index) a Vec of loads."""
        base = self.value(node.args[0])
        if not isinstance(base, View):
            raise Untranslatable("indexing something other than a captured tensor")
        idx = list(node.args[1])
        if any(i is None for i in idx):
            raise Untranslatable("an index that skips a dimension (tensor[:, i])")
        if len(idx) > len(base.shape):
            raise Untranslatable("more indices than the captured tensor has dimensions")
        parts, vec_n = [base.offset], None
        for i, stride in zip(idx, base.strides):
            v = self.as_elementwise(self.value(i))
            if isinstance(v, Vec):
                vec_n = v.n
                v = v.expr
            parts.append(f"({v}) * {stride}" if stride != 1 else f"({v})")
        rest_shape, rest_strides = base.shape[len(idx):], base.strides[len(idx):]
        offset = " + ".join(p for p in parts if p != "0") or "0"
        if vec_n is not None:
            if rest_shape:
                raise Untranslatable("a vector index into a table with dimensions left over")
            return Vec(vec_n, self.load(base.ptr, offset))
        return View(base.ptr, offset, rest_shape, rest_strides) if rest_shape else self.load(base.ptr, offset)

    def select(self, node):
        base, dim, i = self.value(node.args[0]), node.args[1], node.args[2]
        if not isinstance(base, View):
            raise Untranslatable("select on a computed vector")
        dim = dim % len(base.shape)
        i = i % base.shape[dim] if isinstance(i, int) else i
        shape = base.shape[:dim] + base.shape[dim + 1:]
        strides = base.strides[:dim] + base.strides[dim + 1:]
        offset = f"{base.offset} + {literal(i) if isinstance(i, int) else self.value(i)} * {base.strides[dim]}"
        return View(base.ptr, offset, shape, strides)

    def slice(self, node):
        args = node.args
        base = self.value(args[0])
        dim = args[1] if len(args) > 1 else 0
        if not isinstance(base, View):
            raise Untranslatable("slice of a computed vector")
        dim = dim % len(base.shape)
        size = base.shape[dim]
        start = args[2] if len(args) > 2 and args[2] is not None else 0
        end = args[3] if len(args) > 3 and args[3] is not None else size
        step = args[4] if len(args) > 4 else 1
        start, end = (x + size if x < 0 else x for x in (start, min(end, size)))
        n = max(0, cdiv(end - start, step))
        shape = base.shape[:dim] + (n,) + base.shape[dim + 1:]
        strides = base.strides[:dim] + (base.strides[dim] * step,) + base.strides[dim + 1:]
        return View(base.ptr, f"{base.offset} + {start * base.strides[dim]}", shape, strides)

    def fill(self, op: str, node):
        args, dtype = node.args, node.kwargs.get("dtype")
        fill = {"new_ones": 1, "ones_like": 1, "new_zeros": 0, "zeros_like": 0}.get(op)
        if fill is None:
            fill = args[-1] if op == "scalar_tensor" else args[1]
        if dtype is torch.bool or isinstance(fill, bool):
            return literal(bool(fill))
        return literal(float(fill) if dtype is not None and dtype.is_floating_point else fill)

    def cast(self, node):
        args = node.args
        dtype = node.kwargs.get("dtype") or (args[1] if len(args) > 1 and isinstance(args[1], torch.dtype) else None)
        if dtype in self.DTYPES:
            return self.combine(self.cast_text("{a}", dtype), self.value(args[0]))
        return self.as_elementwise(self.value(args[0]))

    def clamp(self, op: str, node):
        args, kwargs = node.args, node.kwargs
        lo = args[1] if len(args) > 1 else kwargs.get("min")
        hi = args[2] if len(args) > 2 else kwargs.get("max")
        if op == "clamp_max":
            lo, hi = None, lo
        expr, vals = "{a}", [self.value(args[0])]
        if lo is not None:
            expr, vals = self.BINARY["maximum"].format(a=expr, b="{b}"), vals + [self.value(lo)]
        if hi is not None:
            key = "c" if lo is not None else "b"
            expr, vals = self.BINARY["minimum"].format(a=expr, b="{" + key + "}"), vals + [self.value(hi)]
        return self.combine(expr, *vals)

    def reduce(self, op: str, node):
        """.any() / .all() / .sum() / max / min over a vector, unrolled over its entries."""
        v = self.as_elementwise(self.value(node.args[0]))
        if not isinstance(v, Vec):  # a reduction over a 0-d value is the value
            return f"(({v}) != 0)" if op in ("any", "all") else v
        val = node.meta.get("val")
        src = node.args[0].meta.get("val") if hasattr(node.args[0], "meta") else None
        elem = v.expr
        if op in ("any", "all") and src is not None and src.dtype != torch.bool:
            elem = f"(({elem}) != 0)"
        if op == "sum" and src is not None and src.dtype == torch.bool:
            elem = self.cast_text(elem, torch.int64)
        terms = [elem.replace(K, str(k)) for k in range(v.n)]
        expr = terms[0]
        for term in terms[1:]:
            expr = self.REDUCE[op].format(a=expr, b=term)
        if val is not None and tuple(val.shape) != ():
            raise Untranslatable("a reduction that keeps dimensions")
        return expr


def translate_mod(gm, fn_name: str, arg_names: list[str], captured: dict[str, torch.Tensor],
                  lifted: frozenset = frozenset()) -> tuple[str, list[str]]:
    """Triton source of one traced mod; returns (source, pointer argument names in order)."""
    emitter = TritonMaskEmitter(gm, arg_names, captured, lifted)
    emitter.walk()
    return emitter.function(fn_name, arg_names + emitter.pointers), emitter.pointers
