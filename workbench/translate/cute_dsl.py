"""CuTe DSL for a mask_mod / score_mod, in FlashAttention-4's calling convention:

    mask_mod(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors) -> Boolean TensorSSA [1]
    score_mod(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors) -> Float32 TensorSSA [1]

FA4 hands the indices over as TensorSSA values (one element in the forward, where the file sets
`__vec_size__ = 1`; up to 4 in the Hopper backward). Each hook runs a scalar function per element:
one line per aten op of the traced mod with the DSL's scalar types (Int32, Float32, Boolean).

It is the Triton pair-by-pair walk (`triton_mask.TritonMaskEmitter`) with the DSL's spelling; what
differs, and why:
- integer `//` is already Python's floor division in the DSL (arith.floordivsi), but `%` is C's
  remainder (arith.remsi / remf), so only `%` gets the sign fix-up (`_py_mod`); `div(...,
  rounding_mode="trunc")` needs its own helper;
- `torch.where` is a Python conditional expression, which the DSL lowers to a select;
- a captured tensor is one of FA4's `aux_tensors`, passed flattened to 1-d (int32 / float32 / int8
  for bool), so the walk's offset arithmetic indexes it directly; the file converts them;
- `.any()` over a captured table (Gemma-style spans) and `clamp` unroll / nest as in Triton, and
  float math inside an index (a T5 log bucket) is plain scalar math here: the constructs inductor's
  CuTe DSL lowering refuses.
"""

from __future__ import annotations

import re

import torch

from workbench.translate.emitter import Untranslatable
from workbench.translate.triton_mask import (_BINARY, _REDUCE, _UNARY, TritonMaskEmitter, Vec, is_integer, same_value,
                                             window_of)

__all__ = ["CuteMaskEmitter", "translate_cute", "cute_mods", "CUTE_HELPERS", "AUX_DTYPES"]

_CUTE_BINARY = dict(_BINARY)
_CUTE_BINARY.update({
    "minimum": "cutlass.min({a}, {b})", "maximum": "cutlass.max({a}, {b})",
    "floor_divide": "({a} // {b})",  # floor in the DSL, as in Python
    "remainder": "_py_mod({a}, {b})",
    "pow": "cute.math.exp(cute.math.log({a}) * {b})",
    "logical_xor": "({a} != {b})",
})
_CUTE_UNARY = dict(_UNARY)
_CUTE_UNARY.update({
    "abs": "_abs({a})", "bitwise_not": "_not({a})", "logical_not": "_not({a})",
    "exp": "cute.math.exp({a})", "log": "cute.math.log({a})", "sqrt": "cute.math.sqrt({a})",
    "sigmoid": "(1.0 / (1.0 + cute.math.exp(-({a}))))", "tanh": "cute.math.tanh({a})",
    "sin": "cute.math.sin({a})", "cos": "cute.math.cos({a})", "floor": "cute.math.floor({a})",
    "ceil": "(-cute.math.floor(-({a})))", "exp2": "cute.math.exp2({a})", "log2": "cute.math.log2({a})",
    "rsqrt": "cute.math.rsqrt({a})", "erf": "cute.math.erf({a})", "log1p": "cute.math.log(1.0 + {a})",
    "expm1": "(cute.math.exp({a}) - 1.0)",
})
_CUTE_REDUCE = dict(_REDUCE)
_CUTE_REDUCE.update({"amax": "cutlass.max({a}, {b})", "amin": "cutlass.min({a}, {b})",
                     "max": "cutlass.max({a}, {b})", "min": "cutlass.min({a}, {b})"})
CUTE_DTYPES = {torch.int32: "cutlass.Int32", torch.int64: "cutlass.Int32", torch.float32: "cutlass.Float32",
               torch.bool: "cutlass.Boolean", torch.float16: "cutlass.Float32", torch.bfloat16: "cutlass.Float32",
               torch.float64: "cutlass.Float32", torch.int8: "cutlass.Int32", torch.int16: "cutlass.Int32",
               torch.uint8: "cutlass.Int32"}
# what a captured tensor becomes as an aux tensor (the file converts it once): integers fit int32
# (checked when the file is generated), bool is int8, floats are float32
AUX_DTYPES = {"int": torch.int32, "bool": torch.int8, "float": torch.float32}

CUTE_HELPERS = '''@cute.jit
def _py_mod(a, b):
    # Python's modulo (the sign of b); the DSL's % is C's remainder (the sign of a)
    r = a % b
    return r + b if (r != 0) & ((r < 0) != (b < 0)) else r


@cute.jit
def _trunc_div(a, b):
    # integer division toward zero (torch.div(..., rounding_mode="trunc")); the DSL's // floors
    q = a // b
    return q + 1 if ((a - q * b) != 0) & ((a < 0) != (b < 0)) else q


@cute.jit
def _abs(a):
    return -a if a < 0 else a


@cute.jit
def _not(a):
    return a == 0


@cute.jit
def _ssa(value, dtype: cutlass.Constexpr):
    # one scalar as the one-element TensorSSA FA4 expects back from a mod
    out = cute.make_rmem_tensor(1, dtype)
    out[0] = dtype(value)
    return out.load()
'''


_FIXED = re.compile(r"^(-?[0-9][0-9.e+-]*|\(-?[0-9][0-9.e+-]*\)|cutlass\.(Float32|Int32)\(aux_scalars\[\d+\]\))$")
_ROUNDING = {"floor", "ceil", "round", "trunc", "frac", "floor_divide", "remainder", "fmod", "sign"}


def _stays_a_score(node) -> bool:
    """Every use of `node`, transitively, is float arithmetic: nothing rounds it, casts it to an
    integer or a bool (a comparison), or indexes a table with it."""
    from workbench.define.trace import op_name

    todo, seen = list(node.users), set()
    while todo:
        user = todo.pop()
        if user in seen or user.op == "output":
            continue
        seen.add(user)
        if user.op != "call_function":
            return False
        dtype = getattr(user.meta.get("val"), "dtype", None)
        name = op_name(user.target)
        if dtype is None or not dtype.is_floating_point or name in _ROUNDING or name == "index":
            return False
        todo.extend(user.users)
    return True


class CuteMaskEmitter(TritonMaskEmitter):
    """The pair-by-pair walk in CuTe DSL (scalar values; Vecs unrolled by reductions; captured
    tensors as flattened aux tensors)."""

    BINARY, UNARY, REDUCE, DTYPES = _CUTE_BINARY, _CUTE_UNARY, _CUTE_REDUCE, CUTE_DTYPES
    WHERE = "({b} if {a} else {c})"
    TRUNC_DIV = "_trunc_div({a}, {b})"
    GELU_TANH = ("(0.5 * {a} * (1.0 + cute.math.tanh(0.7978845608028654 * ({a} + 0.044715 * {a} * {a} * {a}))))")
    GELU = "(0.5 * {a} * (1.0 + cute.math.erf({a} * 0.7071067811865476)))"
    DEFAULT_DTYPE = "cutlass.Float32"
    scalars: list[str] = []  # captured 0-d tensors read as aux_scalars (knobs), in FA4's order
    nonneg_scalars: frozenset = frozenset()  # those the file keeps >= 0 (its `%`, `//` rely on it)

    def load(self, ptr: str, offset: str) -> str:
        name = ptr[:-4]
        tensor = self.captured.get(name)
        read = f"{ptr}[{offset}]"
        return f"({read} != 0)" if tensor is not None and tensor.dtype == torch.bool else read

    def cast_text(self, expr: str, dtype: torch.dtype) -> str:
        if dtype == torch.bool:
            return f"(({expr}) != 0)"
        return f"{self.DTYPES[dtype]}({expr})"

    score_graph = False  # the walk is a score_mod's (or its derivative's): its values are scores

    def call(self, op, node):
        """The forms inductor's CuTe DSL (or LLVM, given its literals) reaches and the shared walk
        does not: range checks as unsigned compares, a score times a reciprocal (see _fast); each
        exact, or a score off by at most an ulp. Everything else is the shared walk (which writes
        `%` / `//` by a power of two as a mask / a shift)."""
        fast = self._fast(op, node)
        if fast is None:
            return super().call(op, node)
        if isinstance(fast, Vec):
            return fast
        if op == "remainder":
            self.nonneg.add(node.name)
        self.lines.append(f"    v_{node.name} = {fast}")
        return f"v_{node.name}"

    def _fast(self, op, node):
        args, kwargs = node.args, node.kwargs
        dtype = getattr(node.meta.get("val"), "dtype", None)
        if op in ("bitwise_and", "logical_and") and len(args) == 2 and dtype == torch.bool:
            inside = self._range_check(node)
            if inside is not None:
                return inside
        divisor = args[1] if len(args) > 1 else None
        # (an integer `%` / `//` by a positive power of two: the shared walk's _pow2_divmod)
        # a score divided by a number fixed for the call (a literal, a knob): times its reciprocal,
        # computed once per kernel; an IEEE division per pair made a softcap 1.9x slower than
        # inductor's, which multiplies. Only where the quotient stays a score (never rounded, cast to
        # an integer, compared or used as an index): there one ulp is within every tolerance
        if op == "div" and kwargs.get("rounding_mode") is None and self.score_graph and dtype is not None and \
                dtype.is_floating_point and divisor is not None:
            b = self.value(divisor)
            if isinstance(b, str) and _FIXED.match(b) and _stays_a_score(node):
                return self.combine("({a} * (1.0 / {b}))", self.value(args[0]), b)
        return None

    def _range_check(self, node):
        """Range checks in an and of comparisons, each as one unsigned compare, exact for every value:
        `(x >= 0) & (x < w)` (or `x <= w`) as `Uint32(x) < Uint32(max(w, 0))` (`max(w, -1) + 1` for
        <=), what LLVM folds a literal w to by itself but not a run-time knob; and, for non-negative
        x and lo, `(x >= lo) & (x < lo + k)` (a NATTEN window) as `Uint32(x - lo) < k`. The and's
        operands are gathered through nested ands (`a & b & c & d`), so a pair split across them
        still meets. A window's partial blocks then pay one compare per pair, as a literal's do."""

        def pair(lower, upper):
            (lo_op, x, lo), (hi_op, x2, hi) = lower, upper
            if lo_op != "ge" or hi_op not in ("lt", "le") or not same_value(x, x2) or not isinstance(x, torch.fx.Node):
                return None
            if not (is_integer(x) and is_integer(lo) and is_integer(hi)):
                return None
            x_text = self.value(x)
            if not isinstance(x_text, str):
                return None
            if isinstance(lo, int) and lo == 0:
                if isinstance(hi, int):
                    bound = max(hi, 0) if hi_op == "lt" else max(hi, -1) + 1
                    return f"(cutlass.Uint32({x_text}) < cutlass.Uint32({bound}))" if bound < 2 ** 31 else None
                w_text = self.value(hi)
                if not isinstance(w_text, str):
                    return None
                bound = f"cutlass.max({w_text}, 0)" if hi_op == "lt" else f"(cutlass.max({w_text}, -1) + 1)"
                return f"(cutlass.Uint32({x_text}) < cutlass.Uint32({bound}))"
            # x >= lo and x < lo + k, with x, lo >= 0 (x - lo cannot overflow) and a literal k >= 0
            window = window_of(lower, upper)
            if window is None:
                return None
            _, _, k = window
            lo_text = self.value(lo)
            if not (self.is_nonneg(x) and self.is_nonneg(lo)) or not isinstance(lo_text, str) or k >= 2 ** 31:
                return None
            return f"(cutlass.Uint32({x_text} - {lo_text}) < cutlass.Uint32({k}))"

        return self.fold_and(node, pair)

    def constant(self, node, tensor):
        name = self.tensor_name(tensor)
        if tensor.dim() == 0 and name in self.scalars:
            # a knob: one of FA4's aux_scalars, a run-time value (a new value compiles nothing)
            kind = "cutlass.Float32" if tensor.is_floating_point() else "cutlass.Int32"
            if name in self.nonneg_scalars:
                self.nonneg.add(node.name)
            return f"{kind}(aux_scalars[{self.scalars.index(name)}])"
        return super().constant(node, tensor)

    def view_of(self, tensor, target):
        view = super().view_of(tensor, target)
        if tensor.is_complex():
            raise Untranslatable("a complex captured tensor")
        return view


def _shared(lines: list[str]) -> list[str]:
    """The walk's lines with repeated expressions computed once (a table read twice at one index
    is one load): a later `name = expr` whose expr was already bound becomes an alias. Every line is
    a pure assignment of a fresh name, so reusing the first one is exact."""
    seen: dict[str, str] = {}
    alias: dict[str, str] = {}
    out = []
    for line in lines:
        if alias:
            line = re.sub(r"\b[A-Za-z_]\w*\b", lambda m: alias.get(m.group(0), m.group(0)), line)
        bound = re.match(r"^    ([A-Za-z_]\w*) = (.+)$", line)
        if bound and bound.group(2) in seen:
            alias[bound.group(1)] = seen[bound.group(2)]
            continue
        if bound:
            seen[bound.group(2)] = bound.group(1)
        out.append(line)
    return out


def _emitter(gm, arg_names: list[str], captured: dict[str, torch.Tensor], lifted: frozenset,
             scalars: list[str], nonneg: frozenset = frozenset()) -> CuteMaskEmitter:
    emitter = CuteMaskEmitter(gm, arg_names, captured, lifted | frozenset(scalars))
    emitter.scalars = list(scalars)
    emitter.nonneg_scalars = frozenset(nonneg)
    emitter.score_graph = arg_names[0] == "score"
    return emitter


def translate_cute(gm, fn_name: str, arg_names: list[str], captured: dict[str, torch.Tensor],
                   lifted: frozenset = frozenset(), aux_order: list[str] | None = None,
                   scalars: list[str] = (), nonneg: frozenset = frozenset()) -> tuple[str, list[str]]:
    """CuTe DSL source of one traced mod in FA4's convention; returns (source, captured tensor
    names it reads). `aux_order` is the list the file passes as aux_tensors (both mods share it);
    `scalars` names the captured 0-d tensors read from FA4's aux_scalars, in order (the hooks then
    take `aux_scalars` too).

    Two functions: `{fn_name}_one` computes one pair on scalars, and `{fn_name}` is FA4's hook, which
    takes TensorSSA values of any width (FA4's Hopper backward hands its score hooks 4 pairs at a
    time when there are no aux tensors, whatever `__vec_size__` says) and runs `_one` per element."""
    # FA4 passes score, b, h by position and q_idx, kv_idx, seqlen_info, aux_tensors by keyword
    scalar = {"score": "score", "b": "b", "h": "h", "q_idx": "q", "kv_idx": "kv"}
    param = {"score": "score_ssa", "b": "b_idx", "h": "h_idx", "q_idx": "q_idx", "kv_idx": "kv_idx"}
    emitter = _emitter(gm, [scalar[a] for a in arg_names], captured, lifted, scalars, nonneg)
    emitter.walk()
    used = [p[:-4] for p in emitter.pointers]
    order = aux_order if aux_order is not None else used
    kind = "cutlass.Float32" if arg_names[0] == "score" else "cutlass.Boolean"
    body = [f"    {name}_ptr = aux_tensors[{order.index(name)}]" for name in used]
    extra = ", aux_scalars" if scalars else ""
    one = (f"@cute.jit\ndef {fn_name}_one({', '.join(scalar[a] for a in arg_names)}, aux_tensors{extra}):\n"
           + "\n".join(body + _shared(emitter.lines)) + "\n")
    params = [param[a] for a in arg_names] + ["seqlen_info", "aux_tensors"] + (["aux_scalars=None"] if scalars else [])
    first = param[arg_names[0]]
    hook = (f"@cute.jit\ndef {fn_name}({', '.join(params)}):\n"
            f"    out = cute.make_rmem_tensor(cute.size({first}.shape), {kind})\n"
            f"    for i in cutlass.range_constexpr(cute.size({first}.shape)):\n"
            f"        out[i] = {kind}({fn_name}_one({', '.join(param[a] + '[i]' for a in arg_names)}, "
            f"aux_tensors{extra}))\n"
            "    return out.load()\n")
    return one + "\n\n" + hook, used


def cute_mods(mask, captured: dict[str, torch.Tensor], lifted: frozenset = frozenset(), backward: bool = True,
              scalars: list[str] = (), nonneg: frozenset = frozenset()) -> tuple[str, list[str], str | None]:
    """The helpers and the translated mods (only those the mask has) as CuTe DSL source, the aux
    tensors' names in the order the file passes them, and why there is no backward (None: there
    is one). With a score_mod and `backward`, also `score_grad_cute` (d score_mod / d score,
    generated from the traced score_mod by `derivative.derivative_mod`) and FA4's
    `score_mod_bwd_cute` over it. Raises Untranslatable when a forward mod has no translation."""
    from workbench.define import trace_mod

    parts, used = [CUTE_HELPERS], []
    graphs = []
    if mask.mask_mod is not None:
        graphs.append(("mask_mod_cute", ["b", "h", "q_idx", "kv_idx"], trace_mod(mask.mask_mod, "mask")))
    if mask.score_mod is not None:
        graphs.append(("score_mod_cute", ["score", "b", "h", "q_idx", "kv_idx"], trace_mod(mask.score_mod, "score")))
    no_grad = None
    if mask.score_mod is not None and backward:
        try:
            from workbench.translate.derivative import derivative_mod

            grad_graph = trace_mod(derivative_mod(mask.score_mod), "score")
            probe = _emitter(grad_graph, ["score", "b", "h", "q", "kv"], dict(captured), lifted, scalars, nonneg)
            probe.walk()
            graphs.append(("score_grad_cute", ["score", "b", "h", "q_idx", "kv_idx"], grad_graph))
        except Exception as exc:  # Untranslatable, or a derivative that does not trace: forward only
            no_grad = f"the score_mod's derivative could not be generated: {exc}"
    # first pass: which tables each mod reads (the shared aux list is their union, in order)
    for _, names, gm in graphs:
        probe = _emitter(gm, names, dict(captured), lifted, scalars, nonneg)
        probe.walk()
        used += [p[:-4] for p in probe.pointers if p[:-4] not in used]
    for fn, names, gm in graphs:
        src, _ = translate_cute(gm, fn, names, captured, lifted, aux_order=used, scalars=scalars, nonneg=nonneg)
        parts.append(src)
    if any(fn == "score_grad_cute" for fn, _, _ in graphs):
        parts.append(SCORE_MOD_BWD.replace("@@PARAM@@", ", aux_scalars=None" if scalars else "")
                     .replace("@@ARG@@", ", aux_scalars=aux_scalars" if scalars else ""))
    return "\n\n".join(parts), used, no_grad


SCORE_MOD_BWD = '''@cute.jit
def score_mod_bwd_cute(grad_ssa, score_ssa, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors@@PARAM@@):
    # FA4's backward hook: the gradient into the score_mod's input, dO/dscore_out * d score_mod / d score
    slope = score_grad_cute(score_ssa, b_idx, h_idx, q_idx=q_idx, kv_idx=kv_idx, seqlen_info=seqlen_info,
                            aux_tensors=aux_tensors@@ARG@@)
    return grad_ssa * slope
'''
