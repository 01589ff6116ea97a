"""The derivative of a traced score_mod with respect to its score, as another aten graph: what a
backward kernel needs (ds_raw = ds * d score_mod / d score) and what the Triton emitter translates
like any mod. Forward-mode, op by op over the traced graph (the score's tangent is 1, the indices'
are 0), so it is generated from the mod, never written per mod.

    >>> import torch
    >>> from workbench.define import trace_mod
    >>> softcap = lambda score, b, h, q_idx, kv_idx: 30.0 * torch.tanh(score / 30.0)
    >>> d = score_derivative(trace_mod(softcap, "score"))
    >>> s = torch.tensor(12.0)
    >>> round(float(d(s, *[torch.tensor(0, dtype=torch.int32)] * 4)), 6) == round(1 - float(torch.tanh(s / 30)) ** 2, 6)
    True

Piecewise-constant parts (comparisons, table reads at an index, integer arithmetic) have a zero
tangent; an op with a tangent and no rule raises Untranslatable naming it.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from workbench.compat import aten_op_name
from workbench.translate.emitter import Untranslatable

__all__ = ["score_derivative", "derivative_mod", "table_gradient_graph", "table_scatter", "DIFFERENTIABLE"]

aten = torch.ops.aten
# ops that pass their first argument's tangent through unchanged
_PASS = {"clone", "alias", "view", "expand", "lift_fresh_copy", "detach", "contiguous", "_unsafe_view", "reshape",
         "squeeze", "unsqueeze", "_to_copy", "to", "type_as", "convert_element_type", "positive"}
# ops whose result does not change with small changes of a float input (a zero tangent)
_CONSTANT = {"ge", "gt", "le", "lt", "eq", "ne", "logical_and", "logical_or", "logical_not", "logical_xor",
             "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "floor", "ceil", "round", "trunc", "sign",
             "floor_divide", "remainder", "index", "ones_like", "zeros_like", "full_like", "new_ones",
             "new_zeros", "new_full", "scalar_tensor", "full", "__rshift__", "__lshift__", "bitwise_right_shift",
             "bitwise_left_shift", "any", "all", "argmax", "argmin", "_efficientzerotensor"}
DIFFERENTIABLE = sorted({"add", "sub", "mul", "div", "true_divide", "neg", "exp", "exp2", "log", "log2", "log1p",
                         "expm1", "tanh", "sigmoid", "gelu", "sqrt", "rsqrt", "reciprocal", "square", "abs", "pow", "where",
                         "clamp", "clip", "clamp_min", "clamp_max", "minimum", "maximum", "sin", "cos", "erf"}
                        | _PASS)


def score_derivative(gm: fx.GraphModule) -> fx.GraphModule:
    """d score_mod / d score for a score_mod traced as (score, b, h, q_idx, kv_idx) -> score'."""
    graph = fx.Graph()
    env: dict = {}  # forward node -> its copy
    tangent: dict = {}  # forward node -> tangent node (absent: zero)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not placeholders:
        raise Untranslatable("the score_mod takes no arguments")
    for node in gm.graph.nodes:
        if node.op == "output":
            result = node.args[0]
            result = result[0] if isinstance(result, (tuple, list)) else result
            out = tangent.get(result)
            if out is None:  # the score does not reach the result: a zero derivative
                out = graph.call_function(aten.mul.Tensor, (env[placeholders[0]], 0.0))
            graph.output(out)
            break
        copy = graph.node_copy(node, lambda n: env[n])
        env[node] = copy
        if node.op == "placeholder":
            if node is placeholders[0]:
                tangent[node] = graph.call_function(aten.add.Tensor, (graph.call_function(aten.mul.Tensor, (copy, 0.0)),
                                                                      1.0))
            continue
        if node.op == "get_attr":
            continue
        if node.op != "call_function":
            raise Untranslatable(f"node {node.op} {node.target} in a score_mod's graph")
        _rule(graph, node, copy, env, tangent)
    return fx.GraphModule(gm, graph)


def table_scatter(*table_indices_weight):  # noqa: ARG001 (a marker)
    """A marker in table_gradient_graph's output: d loss / d table[indices] += ds * weight, for
    every pair (written by the Triton emitter as an atomic add into the table's gradient)."""
    raise RuntimeError("table_scatter is a graph marker, written as kernel source; it is never called")


def table_gradient_graph(gm: fx.GraphModule, learnable: set[str]) -> tuple[fx.GraphModule, list[str]]:
    """For a score_mod traced as (score, b, h, q_idx, kv_idx) -> score': a graph of the forward's
    nodes, then per read of a learnable table (`table[i, j, ...]` with every dimension indexed, or
    a 0-d tensor used whole) the read's weight d score' / d (the value read), forward-mode like
    score_derivative, ending in `table_scatter(table, indices, weight)`. `learnable` names the
    get_attr targets of the tables; returns the graph and those it reads, in order of first read."""
    graph = fx.Graph()
    env: dict = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    for node in nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    seeds = []  # (forward node whose value is a learnable table's entry, the table's get_attr, the indices)
    for node in nodes:
        if node.op == "get_attr" and node.target in learnable and getattr(gm, node.target).dim() == 0:
            seeds.append((node, node, []))
        elif (node.op == "call_function" and aten_op_name(node.target) == "index" and isinstance(node.args[0], fx.Node)
              and node.args[0].op == "get_attr" and node.args[0].target in learnable):
            table = getattr(gm, node.args[0].target)
            if len(node.args[1]) != table.dim() or any(i is None for i in node.args[1]):
                raise Untranslatable(f"the learnable table `{node.args[0].target}` is read other than as "
                                     "table[i, j, ...] with every dimension indexed")
            seeds.append((node, node.args[0], list(node.args[1])))
    seed_nodes = {seed for seed, _, _ in seeds}
    for node in nodes:  # every use of a learnable table must be one of those reads
        if node.op == "get_attr" and node.target in learnable and getattr(gm, node.target).dim() > 0:
            if any(user not in seed_nodes for user in node.users):
                raise Untranslatable(f"the learnable table `{node.target}` is used whole or sliced, not read entry "
                                     "by entry (table[i, j, ...])")
    output = next(n for n in gm.graph.nodes if n.op == "output")
    result = output.args[0]
    result = result[0] if isinstance(result, (tuple, list)) else result
    read = []
    for seed, table, indices in seeds:
        ones = graph.call_function(aten.add.Tensor, (graph.call_function(aten.mul.Tensor, (env[placeholders[0]], 0.0)),
                                                     1.0))
        tangent = {seed: ones}
        for node in nodes[nodes.index(seed) + 1:]:
            if node.op == "call_function":
                _rule(graph, node, env[node], env, tangent)
        weight = tangent.get(result)
        if weight is None:
            continue  # the read does not reach the score (or only through a comparison)
        graph.call_function(table_scatter, (env[table], [env[i] if isinstance(i, fx.Node) else i for i in indices],
                                            weight))
        if table.target not in read:
            read.append(table.target)
    graph.output(None)
    return fx.GraphModule(gm, graph), read


def derivative_mod(score_mod):
    """d score_mod / d score as a score_mod itself, (score, b, h, q_idx, kv_idx) -> derivative: what
    the Triton emitter translates (its closure holds the original mod, so the tables it captures
    are found and passed as the original's are)."""
    from workbench.define import trace_mod

    graph = score_derivative(trace_mod(score_mod, "score"))
    original = score_mod

    def d_score_mod(score, b, h, q_idx, kv_idx):
        assert original is not None  # (keeps the original's tables reachable)
        return graph(score, b, h, q_idx, kv_idx)

    return d_score_mod


def _rule(graph: fx.Graph, node, y, env: dict, tangent: dict) -> None:
    """tangent[node] from its inputs' tangents (the chain rule for this op)."""
    name = aten_op_name(node.target)
    args = node.args
    tans = [tangent.get(a) if isinstance(a, fx.Node) else None for a in args]
    if all(t is None for t in tans):
        return  # nothing here depends on the score
    if name in _CONSTANT:
        return

    def v(a):  # the forward value of an argument (a node's copy, or a Python number)
        return env[a] if isinstance(a, fx.Node) else a

    def call(op, *xs):
        return graph.call_function(op, tuple(xs))

    def mul(a, b):
        return call(aten.mul.Tensor, a, b)

    def add(a, b):
        return b if a is None else a if b is None else call(aten.add.Tensor, a, b)

    def neg(a):
        return None if a is None else call(aten.neg.default, a)

    ta = tans[0]
    tb = tans[1] if len(tans) > 1 else None
    if name in _PASS:
        out = ta
    elif name == "add":
        alpha = node.kwargs.get("alpha", 1)
        out = add(ta, None if tb is None else (tb if alpha == 1 else mul(tb, alpha)))
    elif name == "sub":
        alpha = node.kwargs.get("alpha", 1)
        out = add(ta, neg(None if tb is None else (tb if alpha == 1 else mul(tb, alpha))))
    elif name == "mul":
        out = add(None if ta is None else mul(ta, v(args[1])), None if tb is None else mul(v(args[0]), tb))
    elif name in ("div", "true_divide"):
        a, b = v(args[0]), v(args[1])
        out = add(None if ta is None else call(aten.div.Tensor, ta, b),
                  None if tb is None else neg(call(aten.div.Tensor, mul(tb, y), b)))
    elif name == "neg":
        out = neg(ta)
    elif name == "exp":
        out = mul(ta, y)
    elif name == "exp2":
        out = mul(ta, mul(y, 0.6931471805599453))
    elif name == "expm1":
        out = mul(ta, call(aten.add.Tensor, y, 1.0))
    elif name == "log":
        out = call(aten.div.Tensor, ta, v(args[0]))
    elif name == "log2":
        out = call(aten.div.Tensor, ta, mul(v(args[0]), 0.6931471805599453))
    elif name == "log1p":
        out = call(aten.div.Tensor, ta, call(aten.add.Tensor, v(args[0]), 1.0))
    elif name == "tanh":
        out = mul(ta, call(aten.add.Tensor, neg(mul(y, y)), 1.0))
    elif name == "sigmoid":
        out = mul(ta, mul(y, call(aten.add.Tensor, neg(y), 1.0)))
    elif name == "sqrt":
        out = call(aten.div.Tensor, ta, mul(y, 2.0))
    elif name == "rsqrt":
        out = mul(ta, mul(mul(y, mul(y, y)), -0.5))
    elif name == "reciprocal":
        out = neg(mul(ta, mul(y, y)))
    elif name == "square":
        out = mul(ta, mul(v(args[0]), 2.0))
    elif name == "sin":
        out = mul(ta, call(aten.cos.default, v(args[0])))
    elif name == "cos":
        out = neg(mul(ta, call(aten.sin.default, v(args[0]))))
    elif name == "erf":
        a = v(args[0])
        out = mul(ta, mul(call(aten.exp.default, neg(mul(a, a))), 1.1283791670955126))
    elif name == "gelu":
        x = v(args[0])
        if node.kwargs.get("approximate", "none") == "tanh":  # 0.5 x (1 + tanh(k (x + c x^3)))
            k, c = 0.7978845608028654, 0.044715
            inner = mul(call(aten.add.Tensor, mul(mul(mul(x, x), x), c), x), k)
            t = call(aten.tanh.default, inner)
            d_inner = mul(call(aten.add.Tensor, mul(mul(x, x), 3 * c), 1.0), k)
            part = mul(mul(mul(x, 0.5), call(aten.add.Tensor, neg(mul(t, t)), 1.0)), d_inner)
            out = mul(ta, call(aten.add.Tensor, mul(call(aten.add.Tensor, t, 1.0), 0.5), part))
        else:  # 0.5 (1 + erf(x / sqrt 2)) + x exp(-x^2 / 2) / sqrt(2 pi)
            cdf = mul(call(aten.add.Tensor, call(aten.erf.default, mul(x, 0.7071067811865476)), 1.0), 0.5)
            pdf = mul(call(aten.exp.default, mul(mul(x, x), -0.5)), 0.3989422804014327)
            out = mul(ta, call(aten.add.Tensor, cdf, mul(x, pdf)))
    elif name == "abs":
        a = v(args[0])
        sign = call(aten.sub.Tensor, call(aten.gt.Scalar, a, 0), call(aten.lt.Scalar, a, 0))
        out = mul(ta, sign)
    elif name == "pow":
        if tb is not None:
            raise Untranslatable("a score_mod raising to a power that depends on the score has no derivative here")
        a, c = v(args[0]), v(args[1])
        out = mul(ta, mul(call(aten.div.Tensor, y, a), c))
    elif name == "where":
        cond, a, b = (v(x) for x in args[:3])
        t1, t2 = tans[1], tans[2] if len(tans) > 2 else None
        zero = mul(env[node.args[1]] if isinstance(node.args[1], fx.Node) else y, 0.0)
        out = call(aten.where.self, cond, t1 if t1 is not None else zero, t2 if t2 is not None else zero)
    elif name in ("clamp", "clip", "clamp_min", "clamp_max"):
        a = v(args[0])
        lo = args[1] if name != "clamp_max" and len(args) > 1 else node.kwargs.get("min")
        hi = args[2] if name == "clamp" and len(args) > 2 else (args[1] if name == "clamp_max" else node.kwargs.get("max"))
        inside = None
        if lo is not None:
            inside = call(aten.ge.Tensor if isinstance(lo, fx.Node) else aten.ge.Scalar, a, v(lo))
        if hi is not None:
            below = call(aten.le.Tensor if isinstance(hi, fx.Node) else aten.le.Scalar, a, v(hi))
            inside = below if inside is None else call(aten.logical_and.default, inside, below)
        out = ta if inside is None else mul(ta, inside)
    elif name in ("minimum", "maximum"):
        a, b = v(args[0]), v(args[1])
        first = call(aten.le.Tensor if name == "minimum" else aten.ge.Tensor, a, b)
        zero = mul(y, 0.0)
        out = call(aten.where.self, first, ta if ta is not None else zero, tb if tb is not None else zero)
    else:
        raise Untranslatable(f"aten op `{name}` of the score_mod has no derivative rule here (add one to "
                             "workbench.translate.derivative)")
    if out is not None:
        tangent[node] = out
