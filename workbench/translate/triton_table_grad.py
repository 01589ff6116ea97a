"""The gradient of a score_mod's learnable tables as Triton: `score_table_grad_triton`, which adds
each pair's d loss / d table[i, ...] into the table's gradient where the score_mod reads it. The
weights come from `derivative.table_gradient_graph` (forward-mode from each read); the reads'
offsets are the ones the pair-wise translation computes. Each table's adds are compiled in only
when bit t of the constexpr LEARN is set (t = the table's place in the returned names), so a call
pays only for the tables that require grad. The adds are atomic: in float32 their order, and so
the last bits, vary run to run; with the constexpr DETERMINISTIC they are integer adds of the value
in units of 2^-32 (rounded to nearest), whose sum is the same in any order.
"""

from __future__ import annotations

import torch

from workbench.translate.derivative import table_gradient_graph
from workbench.translate.emitter import Untranslatable, View
from workbench.translate.triton_mask import TritonMaskEmitter

__all__ = ["translate_table_grad", "score_tables"]

# a learnable table whose entries read by a tile's pairs number at most this many (over the dims
# that follow q_idx / kv_idx) has its adds summed per entry in the tile, then added once each
SMALL_TABLE = 64


def score_tables(gm, captured: dict[str, torch.Tensor], lifted: frozenset) -> dict[str, str]:
    """{get_attr target: captured name} of the float tables the traced score_mod reads that can
    learn: tables of one or more dimensions, and 0-d ones passed as kernel arguments (`lifted`)."""
    by_ptr = {(t.data_ptr(), tuple(t.shape)): n for n, t in captured.items()}
    out = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            t = getattr(gm, node.target)
            name = by_ptr.get((t.data_ptr(), tuple(t.shape)))
            if name is not None and t.is_floating_point() and (t.dim() > 0 or name in lifted):
                out[node.target] = name
    return out


def _reaches(node, sources: set, seen: dict | None = None) -> bool:
    """Does graph node `node` depend on any node of `sources`?"""
    seen = {} if seen is None else seen
    if node in sources:
        return True
    if node not in seen:
        seen[node] = False
        seen[node] = any(_reaches(n, sources, seen) for n in node.all_input_nodes)
    return seen[node]


class _TableGradEmitter(TritonMaskEmitter):
    def __init__(self, gm, arg_names, captured, lifted, order: list[str]):
        super().__init__(gm, arg_names, captured, lifted)
        self.order = order  # the tables' captured names: bit t of LEARN is order[t]
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.pair_args = set(placeholders[3:5])  # q_idx, kv_idx: what varies across a tile's pairs

    def call(self, op, node):
        if op != "table_scatter":
            return super().call(op, node)
        table, indices, weight = node.args
        base = self.value(table)
        if not isinstance(base, View):  # a 0-d table passed as an argument is a View too
            raise Untranslatable("a learnable table that is not a captured tensor")
        parts = [base.offset]
        for i, stride in zip(indices, base.strides):
            v = self.as_elementwise(self.value(i))
            if not isinstance(v, str):
                raise Untranslatable("a learnable table read at a vector of indices")
            parts.append(f"({v}) * {stride}" if stride != 1 else f"({v})")
        offset = " + ".join(p for p in parts if p != "0") or "0"
        w = self.as_elementwise(self.value(weight))
        if not isinstance(w, str):
            raise Untranslatable("a learnable table's weight that is a vector")
        name = base.ptr[: -len("_ptr")]
        bit = 1 << self.order.index(name)
        # ds is 0 where the pair is dropped or p = 0: no add there (and no 0 * inf)
        add = self.fresh("add")
        self.lines += [f"    if (LEARN // {bit}) % 2 == 1:",
                       f"        {add} = tl.where(ds == 0.0, 0.0, ds * ({w}))"]
        if not any(_reaches(i, self.pair_args) for i in indices if hasattr(i, "op")):
            # the entry does not depend on q_idx or kv_idx (a per-head slope, a 0-d temperature): the
            # tile's pairs all add to it, so they are summed first and added once (in DETERMINISTIC,
            # the sum of the pairs' rounded integers: the same bits as adding them one by one)
            self.lines += ["        if DETERMINISTIC:",
                           f"            tl.atomic_add(d_{name}_ptr + ({offset}), tl.sum(tl.sum(tl.floor({add} * "
                           "4294967296.0 + 0.5).to(tl.int64), 1), 0))",
                           "        else:",
                           f"            tl.atomic_add(d_{name}_ptr + ({offset}), tl.sum(tl.sum({add}, 1), 0))"]
            return "0"
        pair_dims = [(self.as_elementwise(self.value(i)), stride, n) for i, stride, n in
                     zip(indices, base.strides, base.shape) if hasattr(i, "op") and _reaches(i, self.pair_args)]
        extent = 1
        for _, _, n in pair_dims:
            extent *= n
        if extent <= SMALL_TABLE:
            # the pairs read few entries (a T5 bucket, a clamped distance): the tile's adds are
            # summed per entry first, one atomic add per entry and tile instead of one per pair
            # (a [H, 32] table at 8K tokens took 0.5 G adds on 32 addresses per head: 0.3 s). The
            # entry of the dims that follow the pair is `rel`; a pair whose rel is no entry's (an
            # index out of the table) adds nothing
            rel = " + ".join(f"({v}) * {stride}" if stride != 1 else f"({v})" for v, stride, _ in pair_dims)
            fixed = " + ".join(p for p in [base.offset] + [
                f"({self.as_elementwise(self.value(i))}) * {stride}" if stride != 1 else
                f"({self.as_elementwise(self.value(i))})"
                for i, stride in zip(indices, base.strides)
                if not (hasattr(i, "op") and _reaches(i, self.pair_args))] if p != "0") or "0"
            if len(pair_dims) == 1:
                # one dim follows the pair (a T5 bucket, a clamped distance): only the entries the
                # tile's adding pairs read are visited, from the least to the greatest (a tile far
                # from the diagonal reads one or two buckets, not all of them), each an add over
                # the tile and one atomic add
                (v, stride, n), = pair_dims
                idx_v, lo_v, hi_v = self.fresh("idx"), self.fresh("lo"), self.fresh("hi")
                at = f"e_ * {stride}" if stride != 1 else "e_"
                self.lines += [f"        {idx_v} = ({v}) + zero_",
                               f"        {lo_v} = tl.maximum(tl.min(tl.min(tl.where(ds != 0.0, {idx_v}, {n}), 1), 0), 0)",
                               f"        {hi_v} = tl.minimum(tl.max(tl.max(tl.where(ds != 0.0, {idx_v}, -1), 1), 0), "
                               f"{n - 1})",
                               "        if DETERMINISTIC:",
                               f"            {add}_units = tl.floor({add} * 4294967296.0 + 0.5).to(tl.int64)"]
                for deterministic in (True, False):
                    value, zero = (f"{add}_units", "0") if deterministic else (add, "0.0")
                    step = (f"tl.atomic_add(d_{name}_ptr + ({fixed}) + {at}, tl.sum(tl.sum(tl.where({idx_v} == e_, "
                            f"{value}, {zero}), 1), 0))")
                    if not deterministic:
                        self.lines.append("        else:")
                    # (_WHILE_LOOPS: the interpreter, which runs `range` to Python numbers only)
                    self.lines += ["            if _WHILE_LOOPS:",
                                   f"                e_ = {lo_v}",
                                   f"                while e_ <= {hi_v}:",
                                   f"                    {step}",
                                   "                    e_ += 1",
                                   "            else:",
                                   f"                for e_ in range({lo_v}, {hi_v} + 1):",
                                   f"                    {step}"]
                return "0"
            loops = [f"e{d}_" for d in range(len(pair_dims))]
            entry = " + ".join(f"{e} * {stride}" for e, (_, stride, _) in zip(loops, pair_dims))
            rel_v = self.fresh("rel")
            self.lines.append(f"        {rel_v} = ({rel}) + zero_")
            for deterministic, value, zero in ((True, f"{add}_units", "0"), (False, add, "0.0")):
                pad = "            "
                self.lines.append("        if DETERMINISTIC:" if deterministic else "        else:")
                if deterministic:
                    self.lines.append(f"{pad}{add}_units = tl.floor({add} * 4294967296.0 + 0.5).to(tl.int64)")
                for e, (_, _, n) in zip(loops, pair_dims):
                    self.lines.append(f"{pad}for {e} in tl.static_range({n}):")
                    pad += "    "
                self.lines.append(f"{pad}tl.atomic_add(d_{name}_ptr + ({fixed}) + {entry}, tl.sum(tl.sum(tl.where("
                                  f"{rel_v} == {entry}, {value}, {zero}), 1), 0))")
            return "0"
        self.lines += ["        if DETERMINISTIC:  # integer adds in units of 2^-32: the same sum in any order",
                       f"            tl.atomic_add(d_{name}_ptr + ({offset}) + zero_, "
                       f"tl.floor({add} * 4294967296.0 + 0.5).to(tl.int64), mask=ds != 0.0)",
                       "        else:",
                       f"            tl.atomic_add(d_{name}_ptr + ({offset}) + zero_, {add}, mask=ds != 0.0)"]
        return "0"

    def output(self, node):  # noqa: ARG002 (the adds are the result)
        self.lines.append("    return 0")


def translate_table_grad(gm, captured: dict[str, torch.Tensor], lifted: frozenset = frozenset()
                         ) -> tuple[str, list[str], list[str]] | None:
    """(source of score_table_grad_triton, the table pointers it reads, the learnable tables'
    names in LEARN's bit order), or None when the score_mod reads no table that can learn.
    Signature: (score, b, h, q_idx, kv_idx, ds, <table pointers>, <d_NAME_ptr per table>, LEARN,
    DETERMINISTIC): float32 gradients, or with DETERMINISTIC int64 ones in units of 2^-32 (integer
    adds give the same sum in any order)."""
    targets = score_tables(gm, captured, lifted)
    if not targets:
        return None
    graph, read = table_gradient_graph(gm, set(targets))
    if not read:
        return None
    order = [targets[t] for t in read]
    emitter = _TableGradEmitter(graph, ["score", "b", "h", "q_idx", "kv_idx"], dict(captured), lifted, order)
    emitter.walk()
    emitter.lines.insert(0, "    zero_ = (ds * 0.0).to(tl.int32)  # the pair grid's shape, for the pointers")
    params = ["score", "b", "h", "q_idx", "kv_idx", "ds"] + emitter.pointers + [f"d_{n}_ptr" for n in order]
    return (emitter.function("score_table_grad_triton", params + ["LEARN: tl.constexpr", "DETERMINISTIC: tl.constexpr"]),
            emitter.pointers, order)
