"""Triton source for a mask_mod / score_mod, generated from the traced mod.

The mod is traced with make_fx on 0-d index tensors (the way FlexAttention sees it) into an
aten graph; each aten op becomes one line of Triton. Captured tensors become pointer
arguments read with tl.load. Python semantics are kept where Triton's differ: integer `//`
and `%` round toward minus infinity in Python and toward zero in Triton, so both get helpers.

The generated text is data in the spec. Nothing here runs it; tests compile it with Triton
(on the GPU, and on the CPU through TRITON_INTERPRET=1).
"""

from __future__ import annotations

import operator
import re


import torch

from workbench.define import Mask, captured_tensors, cdiv, op_name, trace_mod

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
_UNARY = {
    "abs": "tl.abs({a})", "neg": "(-{a})", "bitwise_not": "(~{a})", "logical_not": "({a} == 0)",
    "exp": "tl.exp({a})", "log": "tl.log({a})", "sqrt": "tl.sqrt({a})", "sigmoid": "tl.sigmoid({a})",
    "tanh": "(2.0 * tl.sigmoid(2.0 * {a}) - 1.0)",  # portable tanh
    "sin": "tl.sin({a})", "cos": "tl.cos({a})", "floor": "tl.floor({a})", "ceil": "tl.ceil({a})",
    "exp2": "tl.exp2({a})", "log2": "tl.log2({a})", "rsqrt": "tl.rsqrt({a})", "erf": "tl.erf({a})",
    "log1p": "tl.log(1.0 + {a})", "expm1": "(tl.exp({a}) - 1.0)", "reciprocal": "(1.0 / {a})",
    "square": "({a} * {a})",
}
_IDENTITY = {"clone", "alias", "view", "expand", "lift_fresh_copy", "detach", "contiguous", "_unsafe_view",
             "reshape", "squeeze", "unsqueeze"}
_TL_DTYPES = {torch.int32: "tl.int32", torch.int64: "tl.int64", torch.float32: "tl.float32", torch.bool: "tl.int1",
              torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16", torch.float64: "tl.float64",
              torch.int8: "tl.int8", torch.int16: "tl.int16", torch.uint8: "tl.uint8"}

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


class Untranslatable(Exception):
    pass


def _literal(value) -> str:
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, float):
        return repr(value) if value == value and abs(value) != float("inf") else f"float('{value}')"
    return repr(value)


# Reductions over a vector (a captured 1-d table, or a row of a 2-d one): how elements combine.
_REDUCE = {"any": "({a} | {b})", "all": "({a} & {b})", "sum": "({a} + {b})", "amax": "tl.maximum({a}, {b})",
           "amin": "tl.minimum({a}, {b})", "max": "tl.maximum({a}, {b})", "min": "tl.minimum({a}, {b})",
           "prod": "({a} * {b})"}
MAX_UNROLLED = 256  # entries a reduction is unrolled over (spans, documents... are far fewer)
_K = "@K@"  # stands for the element index inside a vector's expression


class _View:
    """A captured tensor, or a slice of one, not yet loaded: pointer, offset, remaining shape
    and strides (row-major, as the tensor is stored in the spec)."""

    def __init__(self, ptr: str, offset: str, shape: tuple, strides: tuple):
        self.ptr, self.offset, self.shape, self.strides = ptr, offset, tuple(shape), tuple(strides)


class _Vec:
    """A vector of n values per lane (e.g. `q_idx >= starts`): an expression in the element index
    _K, written out once per element where a reduction consumes it."""

    def __init__(self, n: int, expr: str):
        self.n, self.expr = n, expr


def _translate(gm, fn_name: str, arg_names: list[str], captured: dict[str, torch.Tensor],
               lifted: frozenset = frozenset()) -> tuple[str, list[str]]:
    """Triton source of one traced mod; returns (source, pointer argument names in order).

    Scalars per lane become one line each. A captured tensor becomes a pointer argument; indexing
    it loads. Values that carry a trailing dimension (a comparison against a whole captured table,
    a row of a 2-d table) stay symbolic until a reduction (`.any()`, `.all()`, `.sum()`, max/min)
    consumes them; the reduction is unrolled over the table's entries."""
    lines, env, pointers = [], {}, []
    placeholders = iter(arg_names)
    by_ptr = {(t.data_ptr(), tuple(t.shape)): n for n, t in captured.items()}
    counter = [0]

    def fresh(prefix="t"):
        counter[0] += 1
        return f"{prefix}{counter[0]}"

    def view_of(tensor, target):
        name = by_ptr.get((tensor.data_ptr(), tuple(tensor.shape)), target.lstrip("_"))
        if not name.isidentifier():  # Mask.data keys such as "score.table" name a pointer argument
            clean = re.sub(r"\W", "_", name)
            captured[clean] = captured.pop(name, tensor)
            name = clean
        if name not in captured:
            captured[name] = tensor
            by_ptr[(tensor.data_ptr(), tuple(tensor.shape))] = name
        ptr = f"{name}_ptr"
        if ptr not in pointers:
            pointers.append(ptr)
        return _View(ptr, "0", tuple(tensor.shape), torch.empty(tensor.shape).stride())

    def value(a):
        """An argument as a scalar expression, a _Vec, or a _View."""
        if hasattr(a, "name") and a.name in env:
            return env[a.name]
        if isinstance(a, (int, float, bool)):
            return _literal(a)
        if isinstance(a, torch.dtype):
            return _TL_DTYPES.get(a, "tl.float32")
        if a is None:
            return "None"
        raise Untranslatable(f"argument {a!r} of type {type(a).__name__}")

    def as_elementwise(v):
        """A scalar expression, or a _Vec; views are loaded (0-d) or become vectors (1-d)."""
        if isinstance(v, _View):
            if len(v.shape) == 0:
                name = fresh("ld")
                lines.append(f"    {name} = tl.load({v.ptr} + {v.offset})")
                return name
            if len(v.shape) == 1:
                if v.shape[0] > MAX_UNROLLED:
                    raise Untranslatable(f"a captured table of {v.shape[0]} entries is used whole "
                                         f"(at most {MAX_UNROLLED} are unrolled)")
                step = f" * {v.strides[0]}" if v.strides[0] != 1 else ""
                return _Vec(v.shape[0], f"tl.load({v.ptr} + {v.offset} + ({_K}){step})")
            raise Untranslatable("a captured tensor with two or more dimensions is used whole")
        return v

    def combine(template: str, *vals):
        vals = [as_elementwise(v) for v in vals]
        sizes = {v.n for v in vals if isinstance(v, _Vec)}
        if len(sizes) > 1:
            raise Untranslatable(f"vectors of different lengths {sorted(sizes)} are combined")
        exprs = [v.expr if isinstance(v, _Vec) else v for v in vals]
        expr = template.format(**dict(zip("abc", exprs)))
        return _Vec(sizes.pop(), expr) if sizes else expr

    # Values known to be >= 0 (index arguments, sums and products of such, tables whose entries are
    # all >= 0): Python's floor division and modulo then equal Triton's plain // and %, which
    # saves the sign fix-ups in the hot loop (a 2-D neighbourhood divides every pair).
    nonneg: set[str] = set()

    def is_nonneg(a) -> bool:
        if isinstance(a, bool):
            return True
        if isinstance(a, (int, float)):
            return a >= 0
        return hasattr(a, "name") and a.name in nonneg

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node.name] = next(placeholders)
            if env[node.name] != "score":
                nonneg.add(node.name)
            continue
        if node.op == "get_attr":
            tensor = getattr(gm, node.target)
            if tensor.dim() == 0 and by_ptr.get((tensor.data_ptr(), ())) in lifted:
                # a lifted parameter: a kernel argument, so its value never enters the source (and
                # nothing is assumed of its sign)
                env[node.name] = view_of(tensor, node.target)
                continue
            env[node.name] = _literal(tensor.item()) if tensor.dim() == 0 else view_of(tensor, node.target)
            if tensor.numel() and not tensor.is_floating_point() and not tensor.is_complex() and int(tensor.min()) >= 0:
                nonneg.add(node.name)
            continue
        if node.op == "output":
            out = node.args[0]
            out = out[0] if isinstance(out, (tuple, list)) else out
            result = as_elementwise(value(out))
            if isinstance(result, _Vec):
                raise Untranslatable("the mod returns a vector, not one value per pair")
            lines.append(f"    return {result}")
            continue
        if node.op != "call_function":
            raise Untranslatable(f"graph node {node.op}")
        if node.target is operator.getitem:
            raise Untranslatable("Python indexing survived tracing")
        op = op_name(node.target)
        kwargs = node.kwargs
        args_nonneg = all(is_nonneg(a) for a in node.args if not isinstance(a, (list, tuple, torch.dtype)))
        if op in ("floor_divide", "remainder") and args_nonneg and not (
                isinstance(node.args[1], (int, float)) and node.args[1] == 0):
            result = combine("({a} // {b})" if op == "floor_divide" else "({a} % {b})", value(node.args[0]),
                             value(node.args[1]))
        else:
            result = _translate_op(op, node, kwargs, value, as_elementwise, combine)
        if (op in ("add", "mul", "floor_divide", "abs", "bitwise_and", "clone", "alias", "view", "expand",
                   "lift_fresh_copy", "detach", "_to_copy", "to", "index", "select", "maximum", "minimum")
                and args_nonneg) or op in ("abs",) or (op == "remainder" and is_nonneg(node.args[1])) or (
                op in ("clamp", "clamp_min") and is_nonneg(node.args[1] if len(node.args) > 1 else node.kwargs.get("min"))):
            nonneg.add(node.name)
        if isinstance(result, (_View, _Vec)):
            env[node.name] = result
        else:
            env[node.name] = f"v_{node.name}"
            lines.append(f"    v_{node.name} = {result}")
    params = ", ".join(arg_names + pointers)
    return f"@triton.jit\ndef {fn_name}({params}):\n" + "\n".join(lines) + "\n", pointers


def _translate_op(op, node, kwargs, value, as_elementwise, combine):
    """One aten op as a scalar expression, a _Vec or a _View."""
    args = node.args
    if op in ("index",):
        base = value(args[0])
        if not isinstance(base, _View):
            raise Untranslatable("indexing something other than a captured tensor")
        idx = list(args[1])
        if any(i is None for i in idx):
            raise Untranslatable("an index that skips a dimension (tensor[:, i])")
        if len(idx) > len(base.shape):
            raise Untranslatable("more indices than the captured tensor has dimensions")
        parts, vec_n = [base.offset], None
        for i, stride in zip(idx, base.strides):
            v = as_elementwise(value(i))
            if isinstance(v, _Vec):
                vec_n = v.n
                v = v.expr
            parts.append(f"({v}) * {stride}" if stride != 1 else f"({v})")
        rest_shape, rest_strides = base.shape[len(idx):], base.strides[len(idx):]
        offset = " + ".join(p for p in parts if p != "0") or "0"
        if vec_n is not None:
            if rest_shape:
                raise Untranslatable("a vector index into a table with dimensions left over")
            return _Vec(vec_n, f"tl.load({base.ptr} + {offset})")
        return _View(base.ptr, offset, rest_shape, rest_strides) if rest_shape else \
            f"tl.load({base.ptr} + {offset})"
    if op == "select":
        base, dim, i = value(args[0]), args[1], args[2]
        if not isinstance(base, _View):
            raise Untranslatable("select on a computed vector")
        dim = dim % len(base.shape)
        i = i % base.shape[dim] if isinstance(i, int) else i
        shape = base.shape[:dim] + base.shape[dim + 1:]
        strides = base.strides[:dim] + base.strides[dim + 1:]
        offset = f"{base.offset} + {_literal(i) if isinstance(i, int) else value(i)} * {base.strides[dim]}"
        return _View(base.ptr, offset, shape, strides)
    if op == "slice":
        base = value(args[0])
        dim = args[1] if len(args) > 1 else 0
        if not isinstance(base, _View):
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
        return _View(base.ptr, f"{base.offset} + {start * base.strides[dim]}", shape, strides)
    if op in _IDENTITY:
        v = value(args[0])
        return v if isinstance(v, (_View, _Vec)) else v
    if op in ("new_ones", "new_zeros", "new_full", "ones_like", "zeros_like", "full_like", "scalar_tensor", "full"):
        dtype = kwargs.get("dtype")
        fill = {"new_ones": 1, "ones_like": 1, "new_zeros": 0, "zeros_like": 0}.get(op)
        if fill is None:
            fill = args[-1] if op in ("scalar_tensor",) else args[1]
        if dtype is torch.bool or isinstance(fill, bool):
            return _literal(bool(fill))
        return _literal(float(fill) if dtype is not None and dtype.is_floating_point else fill)
    if op in ("_to_copy", "to", "type_as", "convert_element_type"):
        dtype = kwargs.get("dtype") or (args[1] if len(args) > 1 and isinstance(args[1], torch.dtype) else None)
        if dtype in _TL_DTYPES:
            return combine("({a}).to(" + _TL_DTYPES[dtype] + ")", value(args[0]))
        return as_elementwise(value(args[0]))
    if op == "where":
        return combine("tl.where({a}, {b}, {c})", value(args[0]), value(args[1]), value(args[2]))
    if op in ("clamp", "clip", "clamp_min", "clamp_max"):
        lo = args[1] if len(args) > 1 else kwargs.get("min")
        hi = args[2] if len(args) > 2 else kwargs.get("max")
        if op == "clamp_max":
            lo, hi = None, lo
        expr, vals = "{a}", [value(args[0])]
        if lo is not None:
            expr, vals = "tl.maximum(" + expr + ", {b})", vals + [value(lo)]
        if hi is not None:
            key = "c" if lo is not None else "b"
            expr, vals = "tl.minimum(" + expr + ", {" + key + "})", vals + [value(hi)]
        return combine(expr, *vals)
    if op == "rsub":
        return combine("({b} - {a})", value(args[0]), value(args[1]))
    if op == "div" and kwargs.get("rounding_mode") == "floor":
        return combine("_py_floordiv({a}, {b})", value(args[0]), value(args[1]))
    if op == "div" and kwargs.get("rounding_mode") == "trunc":
        return combine("({a} // {b})", value(args[0]), value(args[1]))
    if op == "pow" and isinstance(args[1], int) and 0 <= args[1] <= 8:
        if args[1] == 0:
            return combine("({a} * 0 + 1)", value(args[0]))
        return combine("(" + " * ".join(["{a}"] * args[1]) + ")", value(args[0]))
    if op in ("max", "min") and len(args) == 2 and not isinstance(args[1], int):
        return combine(_BINARY["maximum" if op == "max" else "minimum"], value(args[0]), value(args[1]))
    if op in _REDUCE and (len(args) == 1 or (len(args) >= 2 and args[1] in (0, -1, [0], [-1]))):
        v = as_elementwise(value(args[0]))
        if not isinstance(v, _Vec):  # a reduction over a 0-d value is the value
            return f"(({v}) != 0)" if op in ("any", "all") else v
        val = node.meta.get("val")
        src = node.args[0].meta.get("val") if hasattr(node.args[0], "meta") else None
        elem = v.expr
        if op in ("any", "all") and src is not None and src.dtype != torch.bool:
            elem = f"(({elem}) != 0)"
        if op == "sum" and src is not None and src.dtype == torch.bool:
            elem = f"({elem}).to(tl.int64)"
        terms = [elem.replace(_K, str(k)) for k in range(v.n)]
        expr = terms[0]
        for term in terms[1:]:
            expr = _REDUCE[op].format(a=expr, b=term)
        if val is not None and tuple(val.shape) != ():
            raise Untranslatable("a reduction that keeps dimensions")
        return expr
    if op in _BINARY and len(args) >= 2:
        return combine(_BINARY[op], value(args[0]), value(args[1]))
    if op in _UNARY:
        return combine(_UNARY[op], value(args[0]))
    if op == "gelu":
        if kwargs.get("approximate", "none") == "tanh":
            return combine("(0.5 * {a} * (1.0 + (2.0 * tl.sigmoid(2.0 * (0.7978845608028654 * ({a} + 0.044715 * {a} "
                           "* {a} * {a}))) - 1.0)))", value(args[0]))
        return combine("(0.5 * {a} * (1.0 + tl.erf({a} * 0.7071067811865476)))", value(args[0]))
    raise Untranslatable(f"aten op `{op}` has no Triton translation here")


def mod_functions(mask: Mask, lifted: frozenset = frozenset(), bounds: bool = False
                  ) -> tuple[list[str], list[str], list[str], dict[str, torch.Tensor]]:
    """The helpers and the translated mods as Triton source parts (mask_mod_triton,
    score_mod_triton: only those the mask has; with `bounds`, also mask_mod_bounds), their pointer
    arguments and the captured tensors by name. Raises Untranslatable when a mod has no
    translation."""
    captured = dict(captured_tensors(mask))
    parts, mask_ptrs, score_ptrs = [HELPERS], [], []
    if mask.mask_mod is not None:
        gm = trace_mod(mask.mask_mod, "mask")
        src, mask_ptrs = _translate(gm, "mask_mod_triton", ["b", "h", "q_idx", "kv_idx"], captured, lifted)
        parts.append(src)
        if bounds:
            parts.append(_translate_bounds(gm, "mask_mod_bounds", captured, lifted, mask_ptrs))
    if mask.score_mod is not None:
        src, score_ptrs = _translate(trace_mod(mask.score_mod, "score"), "score_mod_triton",
                                     ["score", "b", "h", "q_idx", "kv_idx"], captured, lifted)
        parts.append(src)
    used = {p[:-4] for p in mask_ptrs + score_ptrs}
    return parts, mask_ptrs, score_ptrs, {k: v for k, v in captured.items() if k in used}


def generate(mask: Mask, lifted: frozenset = frozenset(), bounds: bool = False
             ) -> tuple[str, list[str], list[str], dict[str, torch.Tensor]]:
    """(source, mask pointer args, score pointer args, captured tensors by name). `lifted` names
    captured 0-d tensors (see define.lift_scalars) read as kernel arguments, not written in.
    `bounds`: also mask_mod_bounds (what the mask gives over a block) and bounds_grid_kernel."""
    parts, mask_ptrs, score_ptrs, captured = mod_functions(mask, lifted, bounds)
    if mask.mask_mod is not None:
        ptr_params = "".join(f", {p}" for p in mask_ptrs)
        parts.append(f'''@triton.jit
def mask_grid_kernel(out_ptr, b, h, Lq, Lk{ptr_params}, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr):
    # writes the mask of (b, h) as int8 [Lq, Lk]: a test harness and an example call
    q_idx = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)[:, None]
    kv_idx = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
    inside = (q_idx < Lq) & (kv_idx < Lk)
    # indices past the end are clamped so table reads stay in bounds; they are not stored
    keep = mask_mod_triton(b, h, tl.minimum(q_idx, Lq - 1), tl.minimum(kv_idx, Lk - 1){ptr_params})
    tl.store(out_ptr + q_idx * Lk + kv_idx, keep.to(tl.int8), mask=inside)
''')
    if bounds and mask.mask_mod is not None:
        ptr_params = "".join(f", {p}" for p in mask_ptrs + range_pointers(mask_ptrs))
        parts.append(f'''@triton.jit
def bounds_grid_kernel(out_ptr, boxes_ptr, b, h{ptr_params}):
    # mask_mod_bounds of box i = (q_lo, q_hi, kv_lo, kv_hi) as out[i] = (all, any): a test harness
    i = tl.program_id(0)
    q_lo = tl.load(boxes_ptr + 4 * i)
    q_hi = tl.load(boxes_ptr + 4 * i + 1)
    kv_lo = tl.load(boxes_ptr + 4 * i + 2)
    kv_hi = tl.load(boxes_ptr + 4 * i + 3)
    all_kept, any_kept = mask_mod_bounds(b, h, q_lo, q_hi, kv_lo, kv_hi{ptr_params})
    tl.store(out_ptr + 2 * i, all_kept)
    tl.store(out_ptr + 2 * i + 1, any_kept)
''')
    if mask.score_mod is not None:
        ptr_params = "".join(f", {p}" for p in score_ptrs)
        parts.append(f'''@triton.jit
def score_grid_kernel(score_ptr, out_ptr, b, h, Lq, Lk{ptr_params}, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr):
    # applies score_mod_triton to a float32 [Lq, Lk] score matrix of (b, h): a test harness
    q_idx = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)[:, None]
    kv_idx = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
    inside = (q_idx < Lq) & (kv_idx < Lk)
    score = tl.load(score_ptr + q_idx * Lk + kv_idx, mask=inside, other=0.0)
    out = score_mod_triton(score, b, h, tl.minimum(q_idx, Lq - 1), tl.minimum(kv_idx, Lk - 1){ptr_params})
    tl.store(out_ptr + q_idx * Lk + kv_idx, out.to(tl.float32), mask=inside)
''')
    return "import triton\nimport triton.language as tl\n\n\n" + "\n\n".join(parts), mask_ptrs, score_ptrs, captured


def unsupported_reason(mask: Mask) -> str | None:
    try:
        generate(mask)
    except Untranslatable as exc:
        return f"the traced mod cannot be written as Triton: {exc}"
    except Exception as exc:
        return f"the mod could not be traced for Triton: {type(exc).__name__}: {str(exc)[:200]}"
    return None


def triton_section(mask: Mask, tensors: dict | None = None) -> dict:
    """The spec's `backends.triton`: source text, function names and pointer arguments (the
    captured tensors, stored in the tensor file as triton.NAME)."""
    source, mask_ptrs, score_ptrs, captured = generate(mask)
    if tensors is not None:
        for name, t in captured.items():
            tensors[f"triton.{name}"] = t.detach().cpu().numpy()
    return {
        "source": source,
        "mask_fn": "mask_mod_triton" if mask.mask_mod is not None else None,
        "score_fn": "score_mod_triton" if mask.score_mod is not None else None,
        "grid_kernel": "mask_grid_kernel" if mask.mask_mod is not None else None,
        "score_grid_kernel": "score_grid_kernel" if mask.score_mod is not None else None,
        "mask_args": ["b", "h", "q_idx", "kv_idx"] + mask_ptrs,
        "score_args": ["score", "b", "h", "q_idx", "kv_idx"] + score_ptrs if mask.score_mod is not None else None,
        "pointers": {p: {"$tensor": f"triton.{p[:-4]}"} for p in dict.fromkeys(mask_ptrs + score_ptrs)},
    }


def load_source(source: str) -> dict:
    """Compile generated source into a namespace (for tests and harnesses; never on spec load)."""
    import hashlib
    import importlib.util
    import os
    import sys
    import tempfile
    from pathlib import Path

    # triton.jit reads the function's source from a file, so the text must live in one: one file
    # per distinct source (named by its hash), written once, not one per call
    digest = hashlib.sha1(source.encode()).hexdigest()[:20]
    folder = Path(tempfile.gettempdir()) / f"flexwb_triton_{os.getuid() if hasattr(os, 'getuid') else 0}"
    folder.mkdir(exist_ok=True)
    path = folder / f"k{digest}.py"
    if not path.exists() or path.read_text() != source:
        part = path.with_suffix(f".{os.getpid()}.tmp")
        part.write_text(source)
        os.replace(part, path)  # (atomic: a process reading it never sees half a file)
    name = f"flexwb_triton_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return vars(module)


def run_bounds(source: str, b: int, h: int, boxes: torch.Tensor, pointers: list, device="cuda") -> torch.Tensor:
    """mask_mod_bounds of each box [n, 4] = (q_lo, q_hi, kv_lo, kv_hi) (int32) as [n, 2] int32
    (all kept, any kept), with the generated bounds_grid_kernel."""
    ns = load_source(source)
    out = torch.empty(len(boxes), 2, dtype=torch.int32, device=device)
    pointers = [p.contiguous() for p in pointers]
    ns["bounds_grid_kernel"][(len(boxes),)](out, boxes.to(device=device, dtype=torch.int32).contiguous(), b, h,
                                            *pointers, *table_ranges(pointers))
    return out


def run_grid(source: str, b: int, h: int, q_len: int, kv_len: int, pointers: list, device="cuda",
             block: int = 32, score: torch.Tensor | None = None) -> torch.Tensor:
    """Evaluate the generated mask (or, given `score` [q_len, kv_len] float32, the generated
    score_mod) over [q_len, kv_len] with the generated grid kernels."""
    ns = load_source(source)
    grid = (cdiv(q_len, block), cdiv(kv_len, block))
    pointers = [p.contiguous() for p in pointers]
    if score is not None:
        out = torch.empty(q_len, kv_len, dtype=torch.float32, device=device)
        ns["score_grid_kernel"][grid](score.contiguous(), out, b, h, q_len, kv_len, *pointers, BLOCK_Q=block,
                                      BLOCK_K=block)
        return out
    out = torch.zeros(q_len, kv_len, dtype=torch.int8, device=device)
    ns["mask_grid_kernel"][grid](out, b, h, q_len, kv_len, *pointers, BLOCK_Q=block, BLOCK_K=block)
    return out.bool()


# ---------------------------------------------------------------------------------------------
# Bounds: what a mask_mod can give over a whole block of pairs, without evaluating the pairs.
#
# Every integer value of the traced mod becomes an interval [lo, hi] over the block (q_idx in
# [q_lo, q_hi], kv_idx in [kv_lo, kv_hi], b and h exact), every boolean a pair (all, any): all = 1
# when it is True at every pair, any = 0 when it is False at every pair. The block scan skips a
# block whose mask the bounds decide (all == any) and evaluates every other block pair by pair.
# Only sound rules are used: an op without one, a float, a table read at a varying index, gives
# "unknown" ([no bound], or all = 0, any = 1), and so does any interval that leaves its dtype's
# range (eager int32 arithmetic wraps there) -- `ok` turns 0 and the block is evaluated.

_WIDTH = {torch.int8: 7, torch.int16: 15, torch.int32: 31, torch.uint8: 8}
_BOUND_LIMIT = 1 << 61  # int64 intervals stay far from wrapping: sums of two stay exact
_MUL_LIMIT = 1 << 30  # factors below this: a product stays below 2**60


class _Box:
    """An interval (lo, hi) of Triton int64 scalar expressions, or a boolean (all, any) as int32
    0/1 expressions. `point`: lo and hi are one expression (an exact value); `const`: its
    Python value when known at generation time."""

    def __init__(self, lo: str, hi: str | None = None, boolean: bool = False, const=None):
        self.lo, self.hi, self.boolean, self.const = lo, lo if hi is None else hi, boolean, const
        self.point = hi is None or hi == lo


def _translate_bounds(gm, fn_name: str, captured: dict[str, torch.Tensor], lifted: frozenset,
                      pointers: list[str]) -> str:
    """Triton source of `fn_name(b, h, q_lo, q_hi, kv_lo, kv_hi, *pointers) -> (all, any)` for the
    traced mask_mod (see above); `pointers` are the pair-wise translation's, in its order."""
    lines = ["    zero = q_lo.to(tl.int64) * 0",
             "    b, h = zero + b, zero + h",
             "    q_lo, q_hi, kv_lo, kv_hi = zero + q_lo, zero + q_hi, zero + kv_lo, zero + kv_hi",
             "    zero32 = zero.to(tl.int32)",
             "    ok = zero32 + 1"]
    env: dict[str, object] = {}
    by_ptr = {(t.data_ptr(), tuple(t.shape)): n for n, t in captured.items()}
    placeholders = iter([_Box("b"), _Box("h"), _Box("q_lo", "q_hi"), _Box("kv_lo", "kv_hi")])
    counter = [0]
    unknown_bool = _Box("zero32", "(zero32 + 1)", boolean=True)

    def number(c: int, boolean: bool = False) -> _Box:
        # numbers are written as tensors (zero + c): Triton's tl.minimum / .to want one
        return _Box(f"(zero32 + {int(c)})" if boolean else f"(zero + {c})", boolean=boolean, const=int(c))

    def emit(expr: str, prefix: str) -> str:
        counter[0] += 1
        name = f"{prefix}{counter[0]}"
        lines.append(f"    {name} = {expr}")
        return name

    def box(expr_lo: str, expr_hi: str | None = None, boolean: bool = False) -> _Box:
        lo = emit(expr_lo, "lo")
        return _Box(lo, None if expr_hi is None else emit(expr_hi, "hi"), boolean)

    def need(cond: str) -> None:
        lines.append(f"    ok = ok & ({cond}).to(tl.int32)")

    def value(a):
        if hasattr(a, "name"):
            return env.get(a.name)
        if isinstance(a, bool):
            return number(a, boolean=True)
        if isinstance(a, int):
            return number(a)
        return None  # floats, dtypes, lists...

    def as_int(v):
        return v if isinstance(v, _Box) else None  # a boolean is its 0 / 1 values

    def as_bool(v) -> _Box:
        if not isinstance(v, _Box):
            return unknown_bool
        if v.boolean:
            return v
        if v.point:
            return box(f"({v.lo} != 0).to(tl.int32)", boolean=True)
        return box(f"((({v.lo}) > 0) | (({v.hi}) < 0)).to(tl.int32)", f"((({v.lo}) != 0) | (({v.hi}) != 0)).to(tl.int32)",
                   boolean=True)

    def fold(x: _Box, y: _Box, fn: str) -> str:
        """tl.minimum / tl.maximum of two expressions (folded when both are numbers: Triton wants
        a tensor among them)."""
        if x.const is not None and y.const is not None:
            return f"(zero + {min(x.const, y.const) if fn == 'minimum' else max(x.const, y.const)})"
        return f"tl.{fn}({x.lo}, {y.lo})"

    def lohi(a: str, b: str, fn: str) -> str:
        return f"tl.{fn}({a}, {b})"

    def in_range(v: _Box, dtype) -> _Box:
        """The interval of an integer node, with its dtype's range demanded of it."""
        if v.const is not None:
            return v
        width = _WIDTH.get(dtype)
        lo_limit, hi_limit = ((-(1 << width) if dtype != torch.uint8 else 0, (1 << width) - 1) if width
                              else (-_BOUND_LIMIT, _BOUND_LIMIT))
        need(f"({v.lo} >= {lo_limit}) & ({v.hi} <= {hi_limit})")
        return v

    def compare(op: str, x: _Box, y: _Box) -> _Box:
        if x.point and y.point:
            sym = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<", "eq": "==", "ne": "!="}[op]
            return box(f"(({x.lo}) {sym} ({y.lo})).to(tl.int32)", boolean=True)
        if op in ("le", "lt"):
            x, y, op = y, x, {"le": "ge", "lt": "gt"}[op]
        if op == "ge":
            return box(f"(({x.lo}) >= ({y.hi})).to(tl.int32)", f"(({x.hi}) >= ({y.lo})).to(tl.int32)", boolean=True)
        if op == "gt":
            return box(f"(({x.lo}) > ({y.hi})).to(tl.int32)", f"(({x.hi}) > ({y.lo})).to(tl.int32)", boolean=True)
        same = f"(({x.lo}) == ({x.hi})) & (({y.lo}) == ({y.hi})) & (({x.lo}) == ({y.lo}))"
        overlap = f"(({x.lo}) <= ({y.hi})) & (({y.lo}) <= ({x.hi}))"
        if op == "eq":
            return box(f"({same}).to(tl.int32)", f"({overlap}).to(tl.int32)", boolean=True)
        return box(f"(1 - ({overlap}).to(tl.int32))", f"(1 - ({same}).to(tl.int32))", boolean=True)

    def arith(op: str, args, kwargs, dtype):
        xs = [value(a) for a in args]
        if op in ("add", "sub") and kwargs.get("alpha", 1) != 1:
            return None
        if op in ("add", "sub", "rsub", "mul", "minimum", "maximum", "max", "min"):
            if len(xs) < 2 or not all(isinstance(x, _Box) for x in xs[:2]):
                return None
            x, y = xs[0], xs[1]
            if op == "rsub":
                x, y, op = y, x, "sub"
            if op in ("max", "min"):
                op = "maximum" if op == "max" else "minimum"
            if x.point and y.point:
                expr = {"add": "({a} + {b})", "sub": "({a} - {b})", "mul": "({a} * {b})",
                        "minimum": "tl.minimum({a}, {b})", "maximum": "tl.maximum({a}, {b})"}[op]
                if op == "mul":
                    for v in (x, y):
                        if v.const is None:
                            need(f"({v.lo} < {_MUL_LIMIT}) & ({v.lo} > -{_MUL_LIMIT})")
                        elif abs(v.const) >= _MUL_LIMIT:
                            return None
                if op in ("minimum", "maximum"):
                    return box(fold(x, y, op))
                return box(expr.format(a=x.lo, b=y.lo))
            if op == "add":
                return box(f"({x.lo} + {y.lo})", f"({x.hi} + {y.hi})")
            if op == "sub":
                return box(f"({x.lo} - {y.hi})", f"({x.hi} - {y.lo})")
            if op in ("minimum", "maximum"):
                return box(lohi(x.lo, y.lo, op), lohi(x.hi, y.hi, op))
            # mul: the extremes of the four corner products, factors kept small enough to be exact
            for v in (x, y):
                if v.const is not None:
                    if abs(v.const) >= _MUL_LIMIT:
                        return None
                else:
                    need(f"({v.lo} > -{_MUL_LIMIT}) & ({v.hi} < {_MUL_LIMIT})")
            if y.const is not None:
                x, y = y, x
            if x.const is not None:
                c = x.const
                return box(f"({y.lo} * {c})", f"({y.hi} * {c})") if c >= 0 else box(f"({y.hi} * {c})", f"({y.lo} * {c})")
            corners = [f"({p} * {q})" for p in (x.lo, x.hi) for q in (y.lo, y.hi)]
            return box(f"tl.minimum(tl.minimum({corners[0]}, {corners[1]}), tl.minimum({corners[2]}, {corners[3]}))",
                       f"tl.maximum(tl.maximum({corners[0]}, {corners[1]}), tl.maximum({corners[2]}, {corners[3]}))")
        if op == "neg":
            x = xs[0] if xs and isinstance(xs[0], _Box) else None
            return None if x is None else (box(f"(-{x.lo})") if x.point else box(f"(-{x.hi})", f"(-{x.lo})"))
        if op == "abs":
            x = xs[0] if xs and isinstance(xs[0], _Box) else None
            if x is None:
                return None
            if x.point:
                return box(f"tl.abs({x.lo})")
            return box(f"tl.where({x.lo} >= 0, {x.lo}, tl.where({x.hi} <= 0, -{x.hi}, 0))",
                       f"tl.maximum(-{x.lo}, {x.hi})")
        if op in ("floor_divide", "remainder") or (op == "div" and kwargs.get("rounding_mode") == "floor"):
            if len(xs) < 2 or not isinstance(xs[0], _Box) or not isinstance(xs[1], _Box) or not xs[1].point:
                return None
            x, d = xs
            if d.const is not None and d.const <= 0:
                return None
            if d.const is None:
                need(f"{d.lo} > 0")
                d = _Box(f"tl.maximum({d.lo}, 1)")  # (a divisor <= 0 is refused by ok; no division by 0 meanwhile)
                d = box(d.lo)
            if op == "remainder":
                if x.point:
                    return box(f"_py_mod({x.lo}, {d.lo})")
                same = emit(f"_py_floordiv({x.lo}, {d.lo}) == _py_floordiv({x.hi}, {d.lo})", "same")
                return box(f"tl.where({same}, _py_mod({x.lo}, {d.lo}), 0)",
                           f"tl.where({same}, _py_mod({x.hi}, {d.lo}), {d.lo} - 1)")
            if x.point:
                return box(f"_py_floordiv({x.lo}, {d.lo})")
            return box(f"_py_floordiv({x.lo}, {d.lo})", f"_py_floordiv({x.hi}, {d.lo})")
        if op in ("clamp", "clip", "clamp_min", "clamp_max"):
            lo = args[1] if len(args) > 1 else kwargs.get("min")
            hi = args[2] if len(args) > 2 else kwargs.get("max")
            if op == "clamp_max":
                lo, hi = None, lo
            v = xs[0] if isinstance(xs[0], _Box) else None
            for bound, fn in ((lo, "maximum"), (hi, "minimum")):
                if v is None or bound is None:
                    continue
                bound = value(bound)
                if not isinstance(bound, _Box):
                    return None
                v = box(fold(v, bound, fn)) if v.point and bound.point else box(
                    lohi(v.lo, bound.lo, fn), lohi(v.hi, bound.hi, fn))
            return v
        return None

    for node in gm.graph.nodes:
        val = node.meta.get("val")
        dtype = getattr(val, "dtype", None)
        if node.op == "placeholder":
            env[node.name] = next(placeholders)
            continue
        if node.op == "get_attr":
            tensor = getattr(gm, node.target)
            name = by_ptr.get((tensor.data_ptr(), tuple(tensor.shape)))
            env[node.name] = None
            if tensor.dim() == 0 and name not in lifted:
                item = tensor.item()
                if isinstance(item, bool):
                    env[node.name] = number(item, boolean=True)
                elif isinstance(item, int):
                    env[node.name] = number(item)
            elif name is not None and f"{name}_ptr" in pointers:
                env[node.name] = _View(f"{name}_ptr", "0", tuple(tensor.shape), torch.empty(tensor.shape).stride())
                if tensor.dim() == 0:
                    env[node.name] = _load(_View(f"{name}_ptr", "0", (), ()), tensor.dtype, box)
            continue
        if node.op == "output":
            out = node.args[0]
            out = out[0] if isinstance(out, (tuple, list)) else out
            result = as_bool(value(out))
            lines.append(f"    return ({result.lo}) & ok, ({result.hi}) | (1 - ok)")
            continue
        if node.op != "call_function":
            raise Untranslatable(f"graph node {node.op}")
        op = op_name(node.target)
        args = node.args
        result = None
        try:
            if op in _IDENTITY:
                result = value(args[0])
            elif op in ("ge", "gt", "le", "lt", "eq", "ne"):
                x, y = value(args[0]), value(args[1])
                result = compare(op, as_int(x), as_int(y)) if isinstance(x, _Box) and isinstance(y, _Box) else None
            elif op in ("logical_and", "logical_or", "bitwise_and", "bitwise_or") and dtype == torch.bool:
                x, y = as_bool(value(args[0])), as_bool(value(args[1]))
                sym = "&" if op.endswith("and") else "|"
                result = box(f"({x.lo} {sym} {y.lo})") if x.point and y.point else box(
                    f"({x.lo} {sym} {y.lo})", f"({x.hi} {sym} {y.hi})", boolean=True)
                result.boolean = True
            elif op in ("logical_xor", "bitwise_xor") and dtype == torch.bool:
                x, y = as_bool(value(args[0])), as_bool(value(args[1]))
                decided = f"({x.lo} == {x.hi}) & ({y.lo} == {y.hi})"
                result = box(f"(({decided}) & ({x.lo} != {y.lo})).to(tl.int32)",
                             f"(1 - (({decided}) & ({x.lo} == {y.lo})).to(tl.int32))", boolean=True)
            elif op in ("logical_not",) or (op == "bitwise_not" and dtype == torch.bool):
                x = as_bool(value(args[0]))
                result = box(f"(1 - {x.hi})", f"(1 - {x.lo})", boolean=True)
            elif op == "where":
                c, x, y = as_bool(value(args[0])), value(args[1]), value(args[2])
                if isinstance(x, _Box) and isinstance(y, _Box):
                    if dtype == torch.bool:
                        x, y = as_bool(x), as_bool(y)
                    pick = "tl.where({c}.to(tl.int1), {x}, tl.where(({h} == 0), {y}, {both}))"
                    result = box(pick.format(c=f"({c.lo} == 1)", x=x.lo, h=c.hi, y=y.lo, both=lohi(x.lo, y.lo, "minimum")),
                                 pick.format(c=f"({c.lo} == 1)", x=x.hi, h=c.hi, y=y.hi, both=lohi(x.hi, y.hi, "maximum")),
                                 boolean=dtype == torch.bool)
            elif op in ("_to_copy", "to", "type_as", "convert_element_type"):
                x = value(args[0])
                if isinstance(x, _Box):
                    if dtype == torch.bool:
                        result = as_bool(x)
                    elif dtype is not None and not dtype.is_floating_point:
                        result = in_range(_Box(x.lo, x.hi, const=x.const), dtype)
            elif op in ("new_ones", "new_zeros", "new_full", "ones_like", "zeros_like", "full_like", "scalar_tensor",
                        "full"):
                fill = {"new_ones": 1, "ones_like": 1, "new_zeros": 0, "zeros_like": 0}.get(op)
                if fill is None:
                    fill = args[-1] if op == "scalar_tensor" else args[1]
                if dtype == torch.bool:
                    result = number(bool(fill), boolean=True)
                elif dtype is not None and not dtype.is_floating_point and isinstance(fill, (int, bool)):
                    result = number(int(fill))
            elif op in ("index", "select"):
                result = _index(op, node, value, box, need)
            elif dtype is not None and not dtype.is_floating_point and dtype != torch.bool:
                result = arith(op, args, node.kwargs, dtype)
                if isinstance(result, _Box):
                    result = in_range(result, dtype)
        except (IndexError, KeyError, TypeError, ValueError):
            result = None
        if dtype == torch.bool and isinstance(result, _Box):
            result.boolean = True
        env[node.name] = result
    params = ", ".join(["b", "h", "q_lo", "q_hi", "kv_lo", "kv_hi"] + pointers + range_pointers(pointers))
    return f"@triton.jit\ndef {fn_name}({params}):\n" + "\n".join(lines) + "\n"


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


def _range_read(view: "_View", v: "_Box", dtype, box) -> "_Box | None":
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
        return box(f"(({lo}) != 0).to(tl.int32)", f"(({hi}) != 0).to(tl.int32)", boolean=True)
    return box(lo, hi)


def _load(view: "_View", dtype, box) -> "_Box | None":
    """A table entry at an exact index: its value (a number or a boolean), None for floats."""
    if dtype == torch.bool:
        return box(f"(tl.load({view.ptr} + {view.offset}) != 0).to(tl.int32)", boolean=True)
    if dtype.is_floating_point or dtype.is_complex:
        return None
    return box(f"tl.load({view.ptr} + {view.offset}).to(tl.int64)")


def _index(op, node, value, box, need):
    """`table[i, ...]` / `table.select(d, i)` at exact indices (b, h, numbers): a load, or a
    smaller view. A whole 1-d table at a varying index (q_idx, kv_idx): `_range_read`. Otherwise
    unknown: None."""
    base = value(node.args[0]) if hasattr(node.args[0], "name") else None
    if not isinstance(base, _View):
        return None
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
            v = value(idx[0])
            if isinstance(v, _Box) and not v.point and not v.boolean:
                val = node.meta.get("val")
                return _range_read(base, v, getattr(val, "dtype", torch.int32), box)
        parts = [base.offset]
        for i, size, stride in zip(idx, base.shape, base.strides):
            v = value(i)
            if not isinstance(v, _Box) or not v.point or v.boolean:
                return None
            # an index out of range makes the bounds unknown (the eager mod would fail there);
            # the read itself stays inside the table
            need(f"({v.lo} >= -{size}) & ({v.lo} < {size})")
            parts.append(f"tl.minimum(tl.maximum(tl.where({v.lo} < 0, {v.lo} + {size}, {v.lo}), 0), {size - 1}) * {stride}")
        offset = " + ".join(parts)
        shape, strides = base.shape[len(idx):], base.strides[len(idx):]
    if shape:
        return _View(base.ptr, offset, shape, strides)
    val = node.meta.get("val")
    return _load(_View(base.ptr, offset, (), ()), getattr(val, "dtype", torch.int32), box)
