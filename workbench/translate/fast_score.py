"""The score_mod's fast copy for the port's Hopper kernels: the pair-by-pair Triton walk
(`triton_mask.TritonMaskEmitter`), except that an integer distance turned into a float,

    slope[h] * (q_idx + offset - kv_idx).abs()        (q_idx - kv_idx).float()

is converted per row and per column, not per pair, and a bias added to the score joins the base-2
scaling in one fused multiply-add (score_log2_function, at the end). In the kernel q_idx is a
column of the tile ([BLOCK_M, 1]) and kv_idx a row of it ([1, BLOCK_N]); `float(q - kv)` is an
integer subtraction, an abs and a conversion per pair. At D 64 the H200 ran causal + ALiBi slower
on the Hopper kernel than on the portable one (docs/benchmarks.md). Compiled for sm_90a (ALiBi,
ping-pong, D 64, read with nvdisasm), the per-pair IABS and most I2FP conversions and two of three
FMULs go: 4,960 instructions (256 I2FP, 260 IABS, 776 FMUL, 528 FADD) become 4,688 (148 I2FP, 4
IABS, 270 FMUL, 1,048 FADD); the bias form alone gives 4,760 (256 I2FP, 260 IABS, 270 FMUL). A
thread holds half as many columns of a tile as pairs, so the split below converts about as often
per column as the plain form does per pair: the conversions saved are the abs and the rows', and
a tile's columns are held twice (high and low part): with both
forms a user's ALiBi plus a relative table spills 128 bytes in the Hopper paged forward at page 128
(none with the bias form alone or without these forms). Only the forward takes these forms; the
backward keeps the plain score_mod. The bias form alone is the default (port.generate.FAST_SCORE_FORMS:
"off", "bias" or "all"): on an H100, causal + ALiBi at 32K took 9.35 ms in it against 9.95 plain
(bf16, D 128, ping-pong), and 10.98 with both forms (docs/benchmarks.md).

What is converted: an int32 value made by adding and subtracting (`+`, `-`, unary minus) terms of
which each reads q_idx or kv_idx but not both (b, h and tables read at them may enter either), and
int literals, then optionally `abs`, `neg`, or clamped to int literals, where it meets float math
(a cast to float32, or `*`, `+`, `-`, `/` with a float32 result). The terms are gathered into a
row part R (no kv_idx) and a column part C (no q_idx), and float(R + C) is written as
`_sub_as_float_gluon(R, -C)`: R and -C are split at 2^12 into a high part (a multiple of 4096, held
exactly by float32) and a low part (0 .. 4095), converted once per row / per column, and

    float(a - b) = ((hi(a) - hi(b)) + (lo(a) - lo(b)))

in three float additions per pair: both differences are exact (|hi(a) - hi(b)| < 2^32 is a multiple
of 2^12, at most 20 significant bits), so the last addition rounds a - b once, as the int32
conversion does: the same bits for every int32 a and b whose difference (and R, -C) does not
overflow int32, as for positions below 2^30 with literals below 2^30. `abs` and `neg` of a
correctly rounded value are the rounded abs and neg, and rounding is monotone, so a clamp to
literals float32 holds exactly (|c| <= 2^24) commutes with it.

Everything else (values that read both indices in one term, products of indices, int64 values) is
written as the plain walk writes it. The text is Triton-spelled like the rest of the walk; the port
turns it into Gluon and adds INDEX_HELPERS (`workbench.port.generate`).
"""

from __future__ import annotations

import torch
import torch.fx

from workbench.define import captured_tensors, trace_mod
from workbench.define.trace import op_name
from workbench.translate.triton_mask import CASTS, TritonMaskEmitter

__all__ = ["FastScoreEmitter", "translate_fast_score", "score_log2_function", "INDEX_HELPERS"]

# Gluon. The int32 test is decided when the kernel is compiled; other dtypes convert as written.
INDEX_HELPERS = '''@gluon.jit
def _sub_as_float_gluon(a, b):
    # float32(a - b), a and b each a row or a column of the tile, converted there: each split at
    # 2^12 into a multiple of 4096 and a rest 0 .. 4095 (both exact in float32), the two differences
    # exact, one rounding in the last addition (as float32(a - b) rounds)
    if a.dtype == gl.int32 and b.dtype == gl.int32:
        a_hi = a & -4096
        b_hi = b & -4096
        return ((a_hi.to(gl.float32) - b_hi.to(gl.float32))
                + ((a - a_hi).to(gl.float32) - (b - b_hi).to(gl.float32)))
    else:
        return (a - b).to(gl.float32)
'''

_LINEAR = ("add", "sub", "neg", "rsub")
_EXACT_LITERAL = 2 ** 24  # float32 holds every integer up to this exactly
_FLOAT_MATH = ("mul", "add", "sub", "div", "true_divide", "rsub")


class FastScoreEmitter(TritonMaskEmitter):
    """TritonMaskEmitter with integer distances converted per row and per column (module
    docstring). Its arguments are (score, b, h, q_idx, kv_idx)."""

    def __init__(self, gm, arg_names, captured, lifted=frozenset(), convert: bool = True):
        super().__init__(gm, arg_names, captured, lifted)
        self.convert = convert  # (False: the plain walk's conversions, for the bias form alone)
        self.roles: dict[str, str] = {}
        self._reads: dict[str, frozenset] = {}
        self.converted = 0  # conversions written per row / column (0: the plain walk's text)

    def placeholder(self, node):
        name = super().placeholder(node)
        self.roles[node.name] = name
        return name

    def reads(self, v) -> frozenset:
        """The arguments (score, b, h, q_idx, kv_idx) a value depends on."""
        if isinstance(v, (list, tuple)):
            return frozenset().union(*(self.reads(x) for x in v)) if v else frozenset()
        if not isinstance(v, torch.fx.Node):
            return frozenset()
        if v.name not in self._reads:
            if v.op == "placeholder":
                self._reads[v.name] = frozenset({self.roles.get(v.name, v.name)})
            else:
                self._reads[v.name] = self.reads(list(v.args)) | self.reads(list(v.kwargs.values()))
        return self._reads[v.name]

    def call(self, op, node):
        if _dtype(node) == torch.float32:
            text = self._float_math(op, node)
            if text is not None:
                self.lines.append(f"    v_{node.name} = {text}")
                return f"v_{node.name}"
        return super().call(op, node)

    # ------------------------------------------------------------ where an int meets float math

    def _float_math(self, op, node) -> str | None:
        args = node.args
        if op in CASTS and args and _dtype(args[0]) == torch.int32:
            return self._as_float(args[0])
        if op not in _FLOAT_MATH or len(args) != 2 or node.kwargs:
            return None
        converted = []
        for a in args:
            if _dtype(a) == torch.int32:
                f = self._as_float(a)
                if f is None:
                    return None
                converted.append(f)
            elif _exact_int(a):  # (an int literal in float math: `d / 8`)
                converted.append(repr(float(a)))
            elif _dtype(a) == torch.float32 or (isinstance(a, float) and not isinstance(a, bool)):
                value = self.as_elementwise(self.value(a))
                if not isinstance(value, str):
                    return None
                converted.append(value)
            else:
                return None
        if not any(_dtype(a) == torch.int32 for a in args):
            return None
        template = "({b} - {a})" if op == "rsub" else self.BINARY["div" if op == "true_divide" else op]
        return template.format(a=converted[0], b=converted[1])

    def _as_float(self, v) -> str | None:
        """float32(v) for an int32 node v, converted per row and per column; None where v is not
        of the form the module docstring names (or conversions are off)."""
        if not self.convert or not isinstance(v, torch.fx.Node) or v.op != "call_function":
            return None
        op, args = op_name(v.target), v.args
        if op == "neg" and len(args) == 1 and _dtype(args[0]) == torch.int32:
            inner = self._as_float(args[0])
            if inner is not None:
                return f"(-{inner})"
        if op == "abs" and len(args) == 1:
            inner = self._as_float(args[0]) if _dtype(args[0]) == torch.int32 else None
            return None if inner is None else f"tl.abs({inner})"
        if op in ("clamp", "clamp_min", "clamp_max", "maximum", "minimum") and args and \
                _dtype(args[0]) == torch.int32:
            if op == "clamp":
                lo = args[1] if len(args) > 1 else v.kwargs.get("min")
                hi = args[2] if len(args) > 2 else v.kwargs.get("max")
            elif len(args) != 2:
                return None
            else:
                lo, hi = (args[1], None) if op in ("clamp_min", "maximum") else (None, args[1])
            inner = self._as_float(args[0])
            if inner is None or not all(x is None or _exact_int(x) for x in (lo, hi)):
                return None
            if lo is not None:  # (maximum then minimum, as the plain walk writes a clamp)
                inner = f"tl.maximum({inner}, {float(lo)!r})"
            if hi is not None:
                inner = f"tl.minimum({inner}, {float(hi)!r})"
            return inner
        terms = self._terms(v)
        if terms is None:
            return None
        rows, cols = [], []
        for sign, term in terms:
            reads = self.reads(term) if isinstance(term, torch.fx.Node) else frozenset()
            if "score" in reads or {"q_idx", "kv_idx"} <= reads:
                return None
            (cols if "kv_idx" in reads else rows).append((sign, term))
        if not rows or not cols or not any("q_idx" in self.reads(t) for _, t in rows if isinstance(t, torch.fx.Node)):
            return None
        # R + C = R - (-C), or C - (-R) where that negates fewer terms (kv_idx - q_idx)
        if sum(sign for sign, _ in rows) < sum(sign for sign, _ in cols):
            first, second = self._sum(cols), self._sum([(-sign, term) for sign, term in rows])
        else:
            first, second = self._sum(rows), self._sum([(-sign, term) for sign, term in cols])
        if first is None or second is None:
            return None
        self.converted += 1
        return f"_sub_as_float_gluon({first}, {second})"

    def _terms(self, v, sign: int = 1) -> list | None:
        """v as signed terms [(+1 / -1, node or int literal)] through +, -, unary minus of int32."""
        if isinstance(v, bool):
            return None
        if isinstance(v, int):
            return [(sign, v)]
        if not isinstance(v, torch.fx.Node) or _dtype(v) != torch.int32:
            return None
        op = op_name(v.target) if v.op == "call_function" else None
        if op in _LINEAR and v.kwargs.get("alpha", 1) == 1:
            if op == "neg":
                return self._terms(v.args[0], -sign)
            if len(v.args) != 2:
                return None
            first, second = v.args
            if op == "rsub":
                first, second = second, first
            a, b = self._terms(first, sign), self._terms(second, -sign if op in ("sub", "rsub") else sign)
            return None if a is None or b is None else a + b
        return [(sign, v)]

    def _sum(self, terms: list) -> str | None:
        """The int32 sum of signed terms as text (computed per row or per column)."""
        text = None
        for sign, term in terms:
            value = str(term) if isinstance(term, int) else self.as_elementwise(self.value(term))
            if not isinstance(value, str):
                return None
            if text is None:
                text = value if sign > 0 else f"(-{value})"
            else:
                text = f"({text} {'+' if sign > 0 else '-'} {value})"
        return text


def _dtype(v):
    if isinstance(v, torch.fx.Node):
        return getattr(v.meta.get("val"), "dtype", None)
    return None


def _exact_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and abs(v) <= _EXACT_LITERAL


def translate_fast_score(mod, role_name: str, mask, lifted: frozenset = frozenset()) -> tuple[str, list[str], int]:
    """`role_name` (e.g. score_mod_triton) written by FastScoreEmitter: (source, pointer argument
    names, conversions moved to rows / columns): the walk score_log2_function makes, as a plain
    score function, which checks compare bit for bit with the mod. Raises Untranslatable as
    translate_mod does."""
    gm = trace_mod(mod, "score")
    args = ["score", "b", "h", "q_idx", "kv_idx"]
    emitter = FastScoreEmitter(gm, args, dict(captured_tensors(mask)), lifted)
    emitter.walk()
    return emitter.function(role_name, args + emitter.pointers), emitter.pointers, emitter.converted


# The Hopper kernels take a tile's scores in base 2: score_mod(qk * scale) * log2(e), which costs a
# pair two multiplications around the mod. A score_mod that adds a bias to the score (score + X,
# X + score, score - X; X not reading the score: ALiBi, T5 and relative-position tables, per-head
# biases) is written as qk * (scale * log2(e)) + X * log2(e), one fused multiply-add with the bias,
# and where X is a product whose one factor is the same for the whole tile (slope[h], a literal)
# log2(e) joins that factor: FlashAttention-3's ALiBi does the same. Other mods call score_mod.
_LOG2E = "1.4426950408889634"


def score_log2_function(mod, mask, lifted: frozenset, pointers: list[str], convert: bool = True) -> tuple[str, bool]:
    """`score_log2_triton(qk, sm_scale, b, h, q_idx, kv_idx, *pointers)`, score_mod(qk * sm_scale)
    * log2(e) for the Hopper forward (Triton-spelled, turned into Gluon by the port): (source, True)
    with the bias form above where the mod adds a bias to the score, and with `convert` its integer
    distances converted per row and column (FastScoreEmitter), where its walk reads exactly
    `pointers`; else (a call of score_mod_triton, False). The backward keeps score_mod_triton's
    plain copy (the forms cost its keys-down kernel registers: compiled for sm_90a, a user's ALiBi
    plus a relative table spilled 584 bytes at D 128 with them, 60 without)."""
    params = ["qk", "sm_scale", "b", "h", "q_idx", "kv_idx"] + pointers
    head = f"@triton.jit\ndef score_log2_triton({', '.join(params)}):\n"
    plain = head + ("    # score_mod(qk * scale) in base 2\n"
                    f"    return score_mod_triton(qk * sm_scale, b, h, q_idx, kv_idx{''.join(', ' + p for p in pointers)})"
                    f" * {_LOG2E}\n")
    if mod is None:
        return plain, False
    try:
        gm = trace_mod(mod, "score")
        emitter = _BiasEmitter(gm, ["score", "b", "h", "q_idx", "kv_idx"], dict(captured_tensors(mask)), lifted,
                               convert)
        emitter.walk()
    except Exception:
        return plain, False
    if emitter.pointers != pointers or (emitter.bias is None and not emitter.converted):
        return plain, False
    lines = [ln for ln in emitter.lines if not ln.lstrip().startswith("return ")]
    result = next(ln for ln in reversed(emitter.lines) if ln.lstrip().startswith("return ")).split("return ", 1)[1]
    body = head + "    score = qk * sm_scale\n" + "\n".join(lines) + "\n"
    if emitter.bias is None:  # (distances converted per row and column; the mod's value times log2(e))
        return body + f"    return ({result}) * {_LOG2E}\n", True
    return body + f"    return tl.fma(qk, sm_scale * {_LOG2E}, {emitter.bias})  # (score + bias in base 2)\n", True


class _BiasEmitter(FastScoreEmitter):
    """The walk of a score_mod that, at its output, finds the score plus or minus terms that do not
    read it (score + X, X + score, score - X + Y, ...): `bias` is then their sum times log2(e)
    (log2(e) folded into a factor that is the same for the whole tile where a term is such a
    product); else None."""

    bias = None

    def output(self, node):
        super().output(node)
        terms = self._bias_terms(self.returned(node))
        if not terms:
            return
        texts = []
        for sign, term in terms:
            text = self._times_log2e(term)
            if text is None:
                return
            texts.append((sign, text))
        bias = ""
        for sign, text in texts:
            bias = (f"{bias} + {text}" if sign > 0 else f"{bias} - {text}") if bias else (text if sign > 0 else f"-{text}")
        self.bias = f"({bias})" if len(texts) > 1 else bias

    def _bias_terms(self, v) -> list | None:
        """[(+1 / -1, term)] such that v = score + the signed terms, none reading the score; [] for
        the score itself; None where v is not of that form."""
        if not isinstance(v, torch.fx.Node):
            return None
        if v.op == "placeholder":
            return [] if self.roles.get(v.name) == "score" else None
        if v.op != "call_function" or v.kwargs or len(v.args) != 2 or _dtype(v) != torch.float32:
            return None
        op, (first, second) = op_name(v.target), v.args
        reads = [self.reads(x) if isinstance(x, torch.fx.Node) else frozenset() for x in (first, second)]
        if op in ("add", "sub") and "score" in reads[0] and "score" not in reads[1]:
            rest = self._bias_terms(first)
            return None if rest is None else rest + [(1 if op == "add" else -1, second)]
        if op == "add" and "score" in reads[1] and "score" not in reads[0]:
            rest = self._bias_terms(second)
            return None if rest is None else rest + [(1, first)]
        return None

    def _times_log2e(self, x) -> str | None:
        if isinstance(x, bool) or not isinstance(x, (int, float, torch.fx.Node)):
            return None
        if not isinstance(x, torch.fx.Node):
            return f"({float(x)!r} * {_LOG2E})"
        if x.op == "call_function" and op_name(x.target) == "mul" and len(x.args) == 2 and not x.kwargs:
            for one, other in (x.args, x.args[::-1]):
                whole_tile = isinstance(one, (int, float)) and not isinstance(one, bool) or (
                    isinstance(one, torch.fx.Node) and not self.reads(one) & {"q_idx", "kv_idx", "score"}
                    and _dtype(one) == torch.float32)
                if whole_tile and isinstance(other, torch.fx.Node) and _dtype(other) in (torch.float32, torch.int32):
                    a = self.as_elementwise(self.value(one))
                    b = self._as_float(other) if _dtype(other) == torch.int32 else None
                    if b is None:  # (an int32 factor the walk wrote: Triton converts it in the product)
                        b = self.as_elementwise(self.value(other))
                    if isinstance(a, str) and isinstance(b, str):
                        return f"(({a} * {_LOG2E}) * {b})"
        value = self.as_elementwise(self.value(x))
        if not isinstance(value, str) or _dtype(x) != torch.float32:
            return None
        return f"({value} * {_LOG2E})"
