"""Masks as values, targets, parameters, and the errors a user gets for bad input."""

import pytest
import torch

from workbench import Mask, WorkbenchError, make, parse_params, probe, with_score
from workbench.blocks import scan_blocks


def test_parse_params_json_else_string():
    assert parse_params(["width=64", "name=abc", "spans=[[0, 9]]", "flag=true", "x=1.5"]) == \
        {"width": 64, "name": "abc", "spans": [[0, 9]], "flag": True, "x": 1.5}
    with pytest.raises(WorkbenchError, match="key=value"):
        parse_params(["oops"])


def test_mask_value_has_source_and_params():
    mask = make("sliding_window", {"left": 3, "right": 4})
    assert mask.name == "sliding_window_l3_r4"
    assert mask.params == {"left": 3, "right": 4}
    assert "def sliding_window_mask(b, h, q_idx, kv_idx)" in mask.source
    assert mask.summary.startswith("Sliding window")


def test_user_file_target(tmp_path):
    f = tmp_path / "my_masks.py"
    f.write_text("def banded(width=8):\n    def banded_mask(b, h, q_idx, kv_idx):\n"
                 "        return (q_idx - kv_idx).abs() <= width\n    return banded_mask\n")
    mask = make(f"{f}:banded", {"width": 2})
    assert mask.name == "banded" and mask.params == {"width": 2} and mask.mask_mod is not None
    assert scan_blocks(mask, 10, 10, block_size=2).kept_pairs == 10 + 2 * 9 + 2 * 8


@pytest.mark.parametrize("text,target,match", [
    ("import nonexistent_module_xyz\n", "f", "importing .* failed: ModuleNotFoundError"),
    ("def f():\n    raise RuntimeError('boom')\n", "f", "factory raised RuntimeError: boom"),
    ("def f():\n    return 3\n", "f", "factory returned int"),
    ("def g():\n    pass\n", "f", "has no function 'f'.*use one of: g"),
    ("def f():\n    def m(b, h, q):\n        return q > 0\n    return m\n", "f", "takes 3 positional arguments"),
])
def test_bad_user_files_name_cause_and_fix(tmp_path, text, target, match):
    f = tmp_path / "user.py"
    f.write_text(text)
    with pytest.raises(WorkbenchError, match=match) as err:
        make(f"{f}:{target}")
    assert "Fix:" in str(err.value)


def test_unknown_param_lists_known_ones():
    with pytest.raises(WorkbenchError, match="unknown parameter 'widht'.*takes: window"):
        make("causal_sliding_window", {"widht": 3})


def test_missing_file_and_unknown_library_name():
    with pytest.raises(WorkbenchError, match="does not exist"):
        make("nope/missing.py:f")
    with pytest.raises(WorkbenchError, match="no library mask named 'causall'"):
        make("causall")


def test_wrong_arity_in_mask_value():
    with pytest.raises(WorkbenchError, match="score_mod 'sm' takes 4 positional arguments.*5"):
        def sm(score, b, h, q):
            return score
        Mask(name="x", score_mod=sm)


def _mask(fn):
    return Mask(name="user", mask_mod=fn)


def test_python_if_on_tensor_is_explained():
    def branchy(b, h, q_idx, kv_idx):
        if q_idx >= kv_idx:
            return q_idx >= 0
        return q_idx < 0

    with pytest.raises(WorkbenchError, match="Python `if`.*Fix: .*torch.where"):
        probe(_mask(branchy))
    with pytest.raises(WorkbenchError, match="torch.where"):
        scan_blocks(_mask(branchy), 64, 64)


def test_item_is_explained():
    def itemy(b, h, q_idx, kv_idx):
        return torch.tensor(q_idx.item() >= kv_idx.item())

    with pytest.raises(WorkbenchError, match=r"\.item\(\)"):
        probe(_mask(itemy))


def test_non_bool_return_is_explained():
    def inty(b, h, q_idx, kv_idx):
        return q_idx - kv_idx

    with pytest.raises(WorkbenchError, match="returned torch.int32.*bool"):
        probe(_mask(inty))
    with pytest.raises(WorkbenchError, match="bool"):
        scan_blocks(_mask(inty), 64, 64)


def test_out_of_range_table_is_reported():
    table = torch.zeros(10, dtype=torch.bool)

    def short_table(b, h, q_idx, kv_idx):
        return table[q_idx] | (kv_idx <= q_idx)

    with pytest.raises(WorkbenchError, match=r"captured tensor 'table' \(10 entries\) at index 10.*too short"):
        scan_blocks(_mask(short_table), 64, 64)


def test_document_lengths_that_do_not_cover_the_sequence():
    with pytest.raises(WorkbenchError, match="sum to 30 but the sequence has 100 tokens"):
        make("document", {"doc_lengths": [10, 20]}, q_len=100, kv_len=100)


def test_with_score_combines_and_rejects_non_scores():
    combined = with_score(make("causal"), make("softcap", {"cap": 10}))
    assert combined.mask_mod is not None and combined.score_mod is not None
    assert combined.name == "causal_bottom_right+softcap_10"
    with pytest.raises(WorkbenchError, match="has no score_mod"):
        with_score(make("causal"), make("full"))


def test_a_span_table_off_the_cpu_is_traced_on_its_own_device():
    # a user's Gemma-style span mask with its table on an accelerator: `q_idx[..., None]` is a
    # 1-element tensor, which must share the table's device, so the mod is traced on that device
    # (here "meta" stands in for a GPU); tracing on the CPU failed with "Expected all tensors to
    # be on the same device"
    from workbench.define.trace import trace_mod

    spans = torch.tensor([[100, 300], [600, 700]], device="meta")

    def image_spans(b, h, q_idx, kv_idx):
        inside = ((q_idx[..., None] >= spans[:, 0]) & (q_idx[..., None] < spans[:, 1])
                  & (kv_idx[..., None] >= spans[:, 0]) & (kv_idx[..., None] < spans[:, 1]))
        return (kv_idx <= q_idx) | inside.any(-1)

    graph = trace_mod(image_spans, "mask")
    ops = {str(n.target) for n in graph.graph.nodes if n.op == "call_function"}
    assert any("any" in op for op in ops) and any("le" in op for op in ops), ops
    cpu_spans = torch.tensor([[100, 300], [600, 700]])

    def image_spans_cpu(b, h, q_idx, kv_idx):
        inside = ((q_idx[..., None] >= cpu_spans[:, 0]) & (q_idx[..., None] < cpu_spans[:, 1])
                  & (kv_idx[..., None] >= cpu_spans[:, 0]) & (kv_idx[..., None] < cpu_spans[:, 1]))
        return (kv_idx <= q_idx) | inside.any(-1)

    assert {str(n.target) for n in trace_mod(image_spans_cpu, "mask").graph.nodes if n.op == "call_function"} == ops


def test_value_spans_hold_at_every_position_drawn():
    # define.value_spans gives each value of a traced mod an interval over every b, h, q_idx,
    # kv_idx >= 0, whatever the lengths; the port trusts it to let a table read at an index
    # proved inside the table follow the call's lengths (test_port_lengths). Each interval must
    # hold: the mods evaluated node by node at small, bucket-edge, 2^24-edge and int32-edge positions
    # and random ones; no value outside its interval, no NaN inside a known one.
    import math
    import random

    import torch
    from torch.fx import Interpreter

    from workbench.define import trace_mod, value_spans

    rel = torch.randn(4, 32)
    nb, max_exact = 16, 8

    def hf_t5(score, b, h, q_idx, kv_idx):  # (Hugging Face's bidirectional bucket)
        rp = kv_idx - q_idx
        ret = (rp > 0).to(torch.int64) * nb
        n = rp.abs()
        large = max_exact + (torch.log(n.float() / max_exact) / math.log(128 / max_exact)
                             * (nb - max_exact)).to(torch.int64)
        large = torch.minimum(large, torch.full_like(large, nb - 1))
        return score + rel[h, ret + torch.where(n < max_exact, n, large)]

    def mirrored(score, b, h, q_idx, kv_idx):  # (the number on the left of the compare)
        d = (q_idx - kv_idx).clamp(min=0)
        return score + rel[h, torch.where(8 > d, d, (8 + torch.log1p(d.float() - 8) * 3).clamp(max=31).int())]

    def arithmetic(score, b, h, q_idx, kv_idx):
        a = (q_idx - kv_idx) // 7 + torch.div(kv_idx - q_idx, 5, rounding_mode="trunc")
        c = ((kv_idx * 3) % 32 + (-q_idx).abs().clamp(max=2) - torch.div(q_idx, 3, rounding_mode="floor").clamp(0, 4))
        f = torch.sqrt((q_idx - kv_idx).abs().float()).clamp(0, 31).int() + (q_idx.float() / 1e9).exp2().int()
        return score + a.float() + rel[h, c.clamp(0, 31)] + rel[h, f.clamp(max=31)] + (c * c).float()

    def both_sides(score, b, h, q_idx, kv_idx):
        d = q_idx - kv_idx
        return score + rel[h, torch.where(d >= 0, d.clamp(max=15), (-d).clamp(max=15) + 16)]

    class Recorder(Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            self.seen[n.name] = out
            return out

    edges = [0, 1, 2, 7, 8, 9, 15, 16, 17, 120, 128, 129, 2 ** 24 - 1, 2 ** 24, 2 ** 24 + 1, 2 ** 30, 2 ** 31 - 1]
    rng = random.Random(0)
    pairs = [(q, kv) for q in edges for kv in edges] + [(rng.randrange(2 ** 31), rng.randrange(2 ** 31))
                                                         for _ in range(200)]
    for mod in (hf_t5, mirrored, arithmetic, both_sides):
        gm = trace_mod(mod, "score")
        _, spans = value_spans(gm, "score")
        known = {n: s for n, s in spans.items() if s[0] > -math.inf or s[1] < math.inf}
        assert known, mod.__name__
        for q, kv in pairs:
            run = Recorder(gm)
            run.seen = {}
            run.run(torch.tensor(0.5), torch.tensor(0, dtype=torch.int32), torch.tensor(q % 4, dtype=torch.int32),
                    torch.tensor(q, dtype=torch.int32), torch.tensor(kv, dtype=torch.int32))
            for name, (lo, hi) in known.items():
                value = run.seen[name]
                if not isinstance(value, torch.Tensor):
                    continue
                x = float(value)
                slack = 1e-5 * max(1.0, abs(x)) if value.is_floating_point() else 0
                assert x == x and lo - slack <= x <= hi + slack, (mod.__name__, name, q, kv, x, (lo, hi))
    # and what the port reads off them: these tables are read inside their bounds at every position
    from workbench.define import data_indices
    for mod in (hf_t5, mirrored, both_sides, arithmetic):
        assert data_indices(mod, "score") == {"h"}, mod.__name__
    # and where no bound is proved, the positions count: below 0, past the end, a NaN clamped
    tied = [lambda s, b, h, q, kv: s + rel[h, (q - kv).clamp(max=31)],
            lambda s, b, h, q, kv: s + rel[h, (q - kv).clamp(0, 32)],
            lambda s, b, h, q, kv: s + rel[h, torch.log((q - kv).float()).clamp(0, 31).int()],
            lambda s, b, h, q, kv: s + rel[h, torch.where(q - kv < 8, q - kv, 8)]]
    for i, mod in enumerate(tied):
        assert {"q_idx", "kv_idx"} <= data_indices(mod, "score"), i


def test_value_spans_hold_on_the_library_and_the_mod_corpus():
    # value_spans' soundness on every mod people write (the library, users' and attention-gym's
    # tables, spans with .any(), and_masks, score mods): each node that got an interval, evaluated
    # at positions inside and far past the corpus's lengths, every element within it
    import math
    import random
    import sys
    from pathlib import Path

    import torch
    from torch.fx import Interpreter

    from workbench.define import trace_mod, value_spans

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from mod_corpus import corpus

    class Recorder(Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            self.seen[n.name] = out
            return out

    rng = random.Random(1)
    positions = [0, 1, 5, 19, 20, 95, 96, 97, 191, 192, 1000, 2 ** 24 + 1, 2 ** 31 - 1]
    checked = 0
    for mask, batch, heads in corpus():
        for role, mod in (("mask", mask.mask_mod), ("score", mask.score_mod)):
            if mod is None:
                continue
            try:
                gm = trace_mod(mod, role)
            except Exception:
                continue  # (a mod that does not trace gets no spans at all)
            _, spans = value_spans(gm, role)
            known = {n: s for n, s in spans.items() if s[0] > -math.inf or s[1] < math.inf}
            pairs = [(rng.choice(positions), rng.choice(positions)) for _ in range(30)]
            for q, kv in pairs:
                run = Recorder(gm)
                run.seen = {}
                args = [torch.tensor(rng.randrange(batch), dtype=torch.int32),
                        torch.tensor(rng.randrange(heads), dtype=torch.int32),
                        torch.tensor(q, dtype=torch.int32), torch.tensor(kv, dtype=torch.int32)]
                try:
                    run.run(*([torch.tensor(0.25)] if role == "score" else []), *args)
                except (IndexError, RuntimeError):
                    continue  # (a per-token table read past its end: the mod's own limit, not a span's)
                for name, (lo, hi) in known.items():
                    value = run.seen.get(name)
                    if not isinstance(value, torch.Tensor) or value.numel() == 0:
                        continue
                    v = value.double()
                    slack = 1e-5 * max(1.0, float(v.abs().max())) if value.is_floating_point() else 0
                    assert not v.isnan().any() and lo - slack <= float(v.min()) and float(v.max()) <= hi + slack, (
                        mask.name, role, name, q, kv, float(v.min()), float(v.max()), (lo, hi))
                    checked += 1
    assert checked > 1000, checked


def test_tables_index_as_flexattentions_tracer_indexes_them_without_its_private_module():
    # compat.getitem_as_index (a public TorchFunctionMode) must trace every mod of the corpus and the
    # Hopper compile script's users' mods into the graph torch's own switch (torch._dynamo's
    # TransformGetItemToIndex, where this torch has it) gives, and give the same values and table
    # gradients through vmap over b, h, q, kv: per-head tables w[h], a table read at an int (b[0, 3]),
    # slices left as they are
    import sys
    from pathlib import Path

    from torch.fx.experimental.proxy_tensor import make_fx

    from workbench import compat

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import run_hopper_compile
    from mod_corpus import corpus

    theirs = pytest.importorskip("torch._dynamo._trace_wrapped_higher_order_op").TransformGetItemToIndex
    masks = [m for m, _, _ in corpus()] + run_hopper_compile.masks("cpu")
    traced = 0
    for mask in masks:
        for role, fn in (("mask", mask.mask_mod), ("score", mask.score_mod)):
            if fn is None:
                continue
            args = [torch.tensor(0, dtype=torch.int32) for _ in range(4)]
            args = [torch.tensor(0.0)] + args if role == "score" else args
            codes = []
            for mode in (compat.getitem_as_index, theirs):
                with mode():
                    codes.append(make_fx(fn)(*args).code)
            assert codes[0] == codes[1], (mask.name, role, codes)
            traced += 1
    assert traced >= 60, traced
    bias = torch.randn(4, 64, dtype=torch.float64, requires_grad=True)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[h, (q_idx - kv_idx).clamp(-31, 32) + 31] + bias[0, 3] + bias[1:3].sum()

    b, h, q, kv = torch.arange(2), torch.arange(4), torch.arange(40), torch.arange(50)
    scores = torch.randn(2, 4, 40, 50, dtype=torch.float64)
    results = []
    fn = biased  # (vmapped as FlexAttention does, over 0-d index tensors)
    for dims in [(None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)]:
        fn = torch.vmap(fn, in_dims=(0, ) + dims)
    for mode in (compat.getitem_as_index, theirs):
        with mode():
            out = fn(scores, b, h, q, kv)
        out.square().sum().backward()
        results.append((out.detach(), bias.grad.clone()))
        bias.grad = None
    want = scores + bias[h[:, None, None], (q[:, None] - kv).clamp(-31, 32) + 31] + bias[0, 3] + bias[1:3].sum()
    assert torch.allclose(results[0][0], want.detach()) and torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1]) and results[0][1].abs().sum() > 0
    # and outside a mod, plain Python indexing keeps its meaning under the switch
    t = torch.arange(24).reshape(4, 6)
    with compat.getitem_as_index():
        picked = (t[1:3], t[[0, 2]], t[..., 1], t[None, 1], t[2], t[1, torch.tensor(4)], t[t > 20])
    assert [x.tolist() for x in picked] == [t[1:3].tolist(), t[[0, 2]].tolist(), t[..., 1].tolist(),
                                            t[None, 1].tolist(), t[2].tolist(), 10, [21, 22, 23]]
