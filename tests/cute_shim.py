"""A numpy model of the CuTe DSL's scalar semantics, to run generated CuTe DSL mods on a CPU over a
whole grid of pairs at once (no GPU, no cutlass): the test of what the translation computes. The
compile test (`run_fa4_compile.py`) checks that the same text is valid DSL for FA4's kernel.

What the model keeps of the DSL (read from cutlass's arith lowering): integer `//` floors
(arith.floordivsi), `%` is C's remainder (arith.remsi / remf: the sign of the dividend), a
conditional expression is a select, Float32 is float32. The source is rewritten with `ast` so
that `%` calls `_c_mod` and `a if c else b` calls `_select`.
"""

from __future__ import annotations

import ast
import types

import numpy as np


def _c_mod(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return np.fmod(a, b)  # C's remainder for integers and floats


def _select(cond, a, b):
    return np.where(np.asarray(cond, dtype=bool), a, b)


class _SSA(list):
    """A TensorSSA: its elements (each a numpy array over the whole grid here), elementwise `*`."""

    @property
    def shape(self):
        return (len(self),)

    def __mul__(self, other):
        return _SSA(a * b for a, b in zip(self, other))


class _Reg:
    """cute.make_rmem_tensor(1, dtype): one register, `.load()` as a one-element sequence."""

    def __init__(self, n, dtype):
        self.v = [None] * n

    def __setitem__(self, i, value):
        self.v[i] = value

    def __getitem__(self, i):
        return self.v[i]

    def load(self):
        return _SSA(self.v)


def _int32(x):
    return np.asarray(x).astype(np.int64)  # int32 in the DSL; int64 here (no test overflows int32)


def _uint32(x):
    return np.asarray(x).astype(np.int64) & 0xFFFFFFFF  # the bits of an Int32, read unsigned


def _float32(x):
    return np.asarray(x, dtype=np.float32)


def _boolean(x):
    return np.asarray(x, dtype=bool)


def _math():
    m = types.SimpleNamespace()
    for name in ("exp", "log", "sqrt", "tanh", "sin", "cos", "floor", "exp2", "log2"):
        fn = getattr(np, name)
        setattr(m, name, lambda x, fn=fn, **_: fn(np.asarray(x, dtype=np.float32)).astype(np.float32))
    m.rsqrt = lambda x, **_: (1 / np.sqrt(np.asarray(x, dtype=np.float32))).astype(np.float32)

    def erf(x, **_):
        import math
        return np.vectorize(math.erf, otypes=[np.float32])(np.asarray(x, dtype=np.float32))

    m.erf = erf
    return m


def namespace() -> dict:
    cutlass = types.SimpleNamespace(Int32=_int32, Uint32=_uint32, Float32=_float32, Boolean=_boolean, Int8=_int32,
                                    Constexpr=object, min=np.minimum, max=np.maximum, range_constexpr=range)
    cute = types.SimpleNamespace(jit=lambda f=None, **_: f if f is not None else (lambda g: g),
                                 make_rmem_tensor=lambda n, dtype: _Reg(n, dtype), math=_math(),
                                 size=lambda shape: int(np.prod(shape)))
    return {"cutlass": cutlass, "cute": cute, "_c_mod": _c_mod, "_select": _select, "np": np}


class _Rewrite(ast.NodeTransformer):
    def visit_BinOp(self, node):
        self.generic_visit(node)
        if isinstance(node.op, ast.Mod):
            return ast.copy_location(ast.Call(ast.Name("_c_mod", ast.Load()), [node.left, node.right], []), node)
        return node

    def visit_IfExp(self, node):
        self.generic_visit(node)
        return ast.copy_location(ast.Call(ast.Name("_select", ast.Load()), [node.test, node.body, node.orelse], []),
                                 node)

    def visit_UnaryOp(self, node):
        self.generic_visit(node)
        if isinstance(node.op, ast.Not):  # `not x` on arrays
            return ast.copy_location(ast.Call(ast.Attribute(ast.Name("np", ast.Load()), "logical_not", ast.Load()),
                                              [node.operand], []), node)
        return node


def load(source: str) -> dict:
    """Exec generated CuTe DSL mods (helpers + functions, no imports) under the model."""
    tree = ast.fix_missing_locations(_Rewrite().visit(ast.parse(source)))
    ns = namespace()
    exec(compile(tree, "<cute>", "exec"), ns)
    return ns


def _knobs(scalars) -> dict:
    return {"aux_scalars": tuple(scalars)} if scalars else {}


def run_mask(ns: dict, b: int, h: int, q_len: int, kv_len: int, aux: list, q_off: int = 0,
             scalars=()) -> np.ndarray:
    """mask_mod_cute over [q_len, kv_len] (bool); `scalars`: the file's aux_scalars (knobs)."""
    q = np.arange(q_len, dtype=np.int64)[:, None] + q_off
    k = np.arange(kv_len, dtype=np.int64)[None, :]
    out = ns["mask_mod_cute"](_SSA([np.int64(b)]), _SSA([np.int64(h)]), _SSA([q]), _SSA([k]), None, aux,
                              **_knobs(scalars))[0]
    return np.broadcast_to(np.asarray(out, dtype=bool), (q_len, kv_len))


def run_score(ns: dict, score: np.ndarray, b: int, h: int, aux: list, scalars=()) -> np.ndarray:
    """score_mod_cute over score [q_len, kv_len] (float32)."""
    q_len, kv_len = score.shape
    q = np.arange(q_len, dtype=np.int64)[:, None]
    k = np.arange(kv_len, dtype=np.int64)[None, :]
    out = ns["score_mod_cute"](_SSA([score.astype(np.float32)]), _SSA([np.int64(b)]), _SSA([np.int64(h)]), _SSA([q]),
                               _SSA([k]), None, aux, **_knobs(scalars))[0]
    return np.broadcast_to(np.asarray(out, dtype=np.float32), score.shape)


def run_score_bwd(ns: dict, grad: np.ndarray, score: np.ndarray, b: int, h: int, aux: list, scalars=()) -> np.ndarray:
    """score_mod_bwd_cute (the gradient into the score_mod's input) over [q_len, kv_len]."""
    q_len, kv_len = score.shape
    q = np.arange(q_len, dtype=np.int64)[:, None]
    k = np.arange(kv_len, dtype=np.int64)[None, :]
    out = ns["score_mod_bwd_cute"](_SSA([grad.astype(np.float32)]), _SSA([score.astype(np.float32)]),
                                   _SSA([np.int64(b)]), _SSA([np.int64(h)]), q_idx=_SSA([q]), kv_idx=_SSA([k]),
                                   seqlen_info=None, aux_tensors=aux, **_knobs(scalars))[0]
    return np.broadcast_to(np.asarray(out, dtype=np.float32), score.shape)
