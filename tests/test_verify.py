"""Runner, reference and verdict on the CPU (eager FlexAttention, plus one compiled case)."""

import json
import math

import numpy as np
import pytest
import torch

from helpers import drop_one_full_block
from workbench import Mask
from workbench.blocks import build_block_mask
from workbench.cli import main
from workbench.define import WorkbenchError, make, with_score
from workbench.run import Shape, make_inputs, run_flex
from workbench.verify import Tolerance, compare, reference_attention, verify
from workbench.verify import ReferenceOptions  # noqa: E402


def dense_attention_numpy(q, k, v, keep, bias=None):
    """Textbook attention in float64 numpy over the whole matrix. keep: [B, H, Lq, Lk] bool."""
    q, k, v = (t.double().numpy() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1])
    if bias is not None:
        s = bias(s)
    s = np.where(keep, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    z = e.sum(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(z > 0, e / z, 0.0)
        lse = np.where(z[..., 0] > 0, np.log(z[..., 0]) + m[..., 0], -np.inf)
    return p @ v, lse


def test_reference_matches_dense_numpy_with_gqa_score_and_dead_rows():
    # prefix of 3 dead rows (keep nothing), then causal with an offset; softcap score
    lq, lk = 37, 53
    def mod(b, h, q_idx, kv_idx):
        return (q_idx >= 3) & (kv_idx <= q_idx + (lk - lq)) & ((kv_idx + h) % 5 != 0)
    def softcap(score, b, h, q_idx, kv_idx):
        return 7.0 * torch.tanh(score / 7.0)
    mask = Mask("m", mask_mod=mod, score_mod=softcap)
    shape = Shape(batch=2, q_heads=4, kv_heads=2, q_len=lq, kv_len=lk, head_dim=16)
    inputs = make_inputs(shape, "float32", seed=3)
    ref = reference_attention(mask, inputs, memory_budget=4096 * 8 * 8)  # forces several chunks
    assert ref.chunk < lq
    i = np.arange(lq)[:, None]
    j = np.arange(lk)[None, :]
    h = np.arange(4)[:, None, None]
    keep = np.broadcast_to((i >= 3) & (j <= i + lk - lq) & ((j + h) % 5 != 0), (2, 4, lq, lk))
    out, lse = dense_attention_numpy(inputs.q, inputs.k, inputs.v, keep, bias=lambda s: 7.0 * np.tanh(s / 7.0))
    np.testing.assert_allclose(ref.out.numpy(), out, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(ref.lse.numpy()), np.isneginf(lse))
    finite = np.isfinite(lse)
    np.testing.assert_allclose(ref.lse.numpy()[finite], lse[finite], rtol=1e-12)
    assert ref.fully_masked_rows == 2 * 4 * 3
    assert ref.masked_row_examples[0] == (0, 0, 0)
    assert (ref.out[:, :, :3] == 0).all()


def test_reference_gradients_match_dense_autograd_including_captured_table():
    lq = lk = 40
    table = torch.randn(2 * lk, dtype=torch.float64).requires_grad_()
    def window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < 9)
    def bias(score, b, h, q_idx, kv_idx):
        return score + table[q_idx - kv_idx + lk]
    mask = Mask("w", mask_mod=window, score_mod=bias, data={"table": table})
    shape = Shape(batch=1, q_heads=2, kv_heads=1, q_len=lq, kv_len=lk, head_dim=8)
    inputs = make_inputs(shape, "float64", seed=5, backward=True)
    ref = reference_attention(mask, inputs, backward=True, memory_budget=2 * 40 * 8 * 20 * 7)
    assert ref.chunk < lq
    # independent: one dense float64 graph, torch autograd
    q, k, v = (t.detach().clone().requires_grad_() for t in (inputs.q, inputs.k, inputs.v))
    t2 = table.detach().clone().requires_grad_()
    i = torch.arange(lq)[:, None]
    j = torch.arange(lk)[None, :]
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = q @ kk.transpose(-1, -2) / math.sqrt(8) + t2[i - j + lk]
    s = s.masked_fill(~((j <= i) & (i - j < 9)), float("-inf"))
    out = torch.softmax(s, -1) @ vv
    dq, dk, dv, dt = torch.autograd.grad(out, [q, k, v, t2], inputs.grad_out)
    for name, want in (("dq", dq), ("dk", dk), ("dv", dv), ("dtable", dt)):
        torch.testing.assert_close(ref.grads[name], want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "float16"])
def test_verify_passes_library_masks_eager(dtype):
    shape = Shape(batch=2, q_heads=4, kv_heads=2, q_len=200, kv_len=200, head_dim=32)
    for name, params in (("document", {"doc_lengths": [70, 50, 80]}), ("prefix_lm", {"prefix_len": 33})):
        mask = make(name, params, q_len=200, kv_len=200)
        if name == "prefix_lm":
            mask = with_score(mask, make("alibi", {"num_heads": 4}, q_len=200, kv_len=200))
        verdict = verify(mask, shape, dtype=dtype, seed=11, backend="eager")
        assert verdict.passed, verdict.line
        assert verdict.seed == 11 and {c.name for c in verdict.checks} == {"out", "lse"}
        assert verdict.to_frame().loc["out", "rel_err"] < {"float64": 1e-12, "float32": 1e-6}.get(dtype, 1e-2)


def test_verify_fresh_seed_each_run_and_inputs_never_zero():
    shape = Shape(q_len=16, head_dim=8)
    a, b = make_inputs(shape, "float32"), make_inputs(shape, "float32")
    assert a.seed != b.seed and not torch.equal(a.q, b.q)
    assert (a.q != 0).float().mean() > 0.99


def test_bug_dropped_kv_block_fails_with_location():
    mask = make("causal")
    shape = Shape(batch=1, q_heads=2, q_len=256, head_dim=16)
    good = build_block_mask(mask, 256, 256, block_size=64)
    assert int(good.full_kv_num_blocks[0, 0, 3]) == 3
    broken = drop_one_full_block(good, 3, 256, 256)  # q block 3 loses kv block 2
    verdict = verify(mask, shape, dtype="float32", block_mask=broken, seed=1, backend="eager")
    assert not verdict.passed
    drops = [f for f in verdict.findings if f.kind == "block_mask_drops_pairs"]
    assert drops and "q 192..255, kv 128..191" in drops[0].message
    # uncompiled FlexAttention applies mask_mod to every pair, so only the block check sees it
    # (tests/test_gpu.py checks that the compiled kernel's output fails at these rows)
    assert "FAIL" in verdict.line and "skips 1 block" in verdict.line


def test_bug_window_off_by_one_fails_against_intended():
    intended = make("causal_sliding_window", {"window": 16})
    draft = make("causal_sliding_window", {"window": 17})
    shape = Shape(q_heads=2, q_len=128, head_dim=16)
    verdict = verify(draft, shape, dtype="float32", expected=intended, seed=2, backend="eager")
    assert not verdict.passed
    out = verdict.checks[0]
    assert out.worst["q"] >= 16  # the first rows agree: the window does not reach past the start
    assert out.bad_count > 0 and "vs causal_sliding_window_16" in verdict.name
    assert verify(intended, shape, dtype="float32", expected=intended, backend="eager").passed


def test_bug_score_mod_wrong_sign_fails():
    alibi = make("alibi", {"num_heads": 2})
    def alibi_wrong_sign(score, b, h, q_idx, kv_idx):  # adds the distance penalty instead of subtracting it
        return 2 * score - alibi.score_mod(score, b, h, q_idx, kv_idx)
    intended = with_score(make("causal"), alibi)
    verdict = verify(intended.replace(score_mod=alibi_wrong_sign), Shape(q_heads=2, q_len=64, head_dim=16),
                     dtype="float32", expected=intended, seed=4, backend="eager")
    assert not verdict.passed and verdict.checks[0].bad_count > 0


def test_nan_never_passes_and_inf_mismatch_counts():
    ref = torch.randn(3, 4, dtype=torch.float64)
    got = ref.clone()
    got[1, 2] = float("nan")
    check = compare("out", got, ref, Tolerance(1, 1, 1, "loose"))
    assert not check.passed and check.nan_count == 1 and check.worst == {"b": 1, "h": 2}
    lse_ref = torch.tensor([0.5, float("-inf")], dtype=torch.float64)
    assert compare("lse", lse_ref.clone(), lse_ref, Tolerance(0, 0, 0, "")).passed
    assert not compare("lse", torch.tensor([0.5, 0.0], dtype=torch.float64), lse_ref, Tolerance(1, 1, 1, "")).passed


def test_fully_masked_rows_are_explained():
    def dead_rows(b, h, q_idx, kv_idx):
        return (q_idx >= 8) & (kv_idx <= q_idx)
    verdict = verify(Mask("dead_rows", mask_mod=dead_rows), Shape(q_heads=2, q_len=64, head_dim=16),
                     dtype="float32", backend="eager")
    assert verdict.passed and verdict.fully_masked_rows == 2 * 8
    text = " ".join(f.message for f in verdict.findings if f.kind == "fully_masked_rows")
    assert "returns 0" in text and "NaN" in text


def test_captured_scalars_and_eager_vs_traced_findings():
    def reduces_over_queries(b, h, q_idx, kv_idx):  # amax sees one query traced, all of them called directly
        return kv_idx <= q_idx.amax()
    def returns_int(b, h, q_idx, kv_idx):
        return q_idx - kv_idx
    limit = 5
    def tensor_bool(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx < limit) & (kv_idx <= q_idx)
    verdict = verify(Mask("tb", mask_mod=tensor_bool), Shape(q_len=32, head_dim=8), dtype="float32", backend="eager")
    assert any(f.kind == "captured_scalars" and "limit=5" in f.message for f in verdict.findings)
    verdict = verify(Mask("r", mask_mod=reduces_over_queries), Shape(q_len=64, head_dim=8), dtype="float32", backend="eager")
    assert verdict.passed and any(f.kind == "eager_vs_traced" for f in verdict.findings)
    with pytest.raises(WorkbenchError, match="bool"):
        verify(Mask("ri", mask_mod=returns_int), Shape(q_len=32, head_dim=8), dtype="float32", backend="eager")


def test_stale_block_mask_and_bad_inputs_fail_before_work():
    mask = make("causal")
    old = build_block_mask(mask, 128, 128)
    with pytest.raises(WorkbenchError, match="built for q_len=128.*rebuild"):
        verify(mask, Shape(q_len=256, head_dim=8), dtype="float32", block_mask=old, backend="eager")
    with pytest.raises(WorkbenchError, match="not a multiple of kv_heads"):
        Shape(q_heads=6, kv_heads=4)
    with pytest.raises(WorkbenchError, match="tf32"):
        verify(mask, Shape(q_len=16), dtype="tf32", device="cpu")
    with pytest.raises(WorkbenchError, match="unknown dtype"):
        verify(mask, Shape(q_len=16), dtype="float8")
    with pytest.raises(WorkbenchError, match="no backward on the CPU"):
        verify(mask, Shape(q_len=16), dtype="float32", backward=True)
    with pytest.raises(WorkbenchError, match="defined for 3 heads"):
        verify(make("per_head_window", {"windows": [1, 2, 3]}), Shape(q_heads=2, q_len=16), dtype="float32", backend="eager")
    with pytest.raises(WorkbenchError, match="one query row of the reference needs"):
        verify(mask, Shape(q_heads=64, q_len=16, kv_len=1 << 20), dtype="float32", reference=ReferenceOptions(memory_budget=1 << 20))
    table = torch.zeros(4, device="meta")
    on_meta = Mask("meta", score_mod=lambda score, b, h, q_idx, kv_idx: score + table[h])
    with pytest.raises(WorkbenchError, match=r"captured tensor 'table' \(\(4,\), float32\) is on meta.*Fix: create 'table' on cpu"):
        verify(on_meta, Shape(q_len=16), dtype="float32", backend="eager")
    with pytest.raises(WorkbenchError, match="need about"):
        make_inputs(Shape(batch=1 << 12, q_heads=1 << 10, q_len=1 << 20, head_dim=128), "float32")


def test_run_flex_reports_compile_state_eager():
    mask = make("causal")
    inputs = make_inputs(Shape(q_len=64, head_dim=8), "float32", seed=0)
    run = run_flex(mask, inputs, compile=False)
    assert run.compile_seconds is None and not run.new_graph and run.run_seconds > 0 and run.lse is not None


def test_cli_verify_compiled_cpu_json(capsys):
    # the one compiled FlexAttention case of the CPU suite (~20 s)
    code = main(["verify", "causal_sliding_window", "--param", "window=32", "--q-len", "128", "--heads", "2",
                 "--device", "cpu", "--dtype", "float32", "--head-dim", "16", "--json"])
    record = json.loads(capsys.readouterr().out)
    assert code == 0 and record["passed"] is True and record["compiled"] is True
    assert record["compile_seconds"] > 0 and record["nan_count"] == 0 and record["fully_masked_rows"] == 0
    assert record["max_abs_err"] < 1e-4 and any(f["kind"] == "lse_not_checked" for f in record["findings"])


def test_cli_verify_eager_table_and_bad_input(capsys):
    assert main(["verify", "prefix_lm", "--q-len", "96", "--device", "cpu", "--dtype", "float32", "--eager",
                 "--head-dim", "8", "--score", "softcap"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("PASS prefix_lm") and "not compiled" in text and "rel_err" in text
    assert main(["verify", "causal", "--q-len", "64", "--heads", "6", "--kv-heads", "4", "--device", "cpu"]) == 2
    assert "multiple of kv_heads" in capsys.readouterr().err


def _sparse_vs_dense(mask, shape, budget, backward=False, seed=0):
    inputs = make_inputs(shape, "float32", seed=seed, backward=backward)
    sparse = reference_attention(mask, inputs, memory_budget=budget, backward=backward)
    dense = reference_attention(mask, inputs, memory_budget=budget, backward=backward, sparse=False)
    assert dense.computed_fraction == 1.0
    torch.testing.assert_close(sparse.out, dense.out, rtol=1e-12, atol=1e-13)
    assert torch.equal(torch.isneginf(sparse.lse), torch.isneginf(dense.lse))
    finite = torch.isfinite(dense.lse)
    torch.testing.assert_close(sparse.lse[finite], dense.lse[finite], rtol=1e-12, atol=1e-13)
    for name in dense.grads:
        torch.testing.assert_close(sparse.grads[name], dense.grads[name], rtol=1e-11, atol=1e-12)
    assert sparse.fully_masked_rows == dense.fully_masked_rows
    return sparse


@pytest.mark.parametrize("name", ["causal", "causal_sliding_window", "document", "tree", "image_spans", "per_head_window",
                                  "dilated_window", "chunked_local", "sinks_window", "neighborhood_2d"])
def test_sparse_reference_equals_dense_on_the_library(name):
    from workbench import make

    mask = make(name, q_len=333, kv_len=401)
    heads = mask.heads or 2
    ref = _sparse_vs_dense(mask, Shape(batch=1, q_heads=heads, q_len=333, kv_len=401, head_dim=8),
                           budget=heads * 401 * 8 * 8 * 40)  # chunks of 40 rows
    assert ref.computed_fraction < 1.0  # every one of these skips keys somewhere


def test_sparse_reference_equals_dense_on_user_mods_with_gradients():
    # an undeclared per-head table, a per-sample length with rows that keep nothing, a score
    widths = torch.tensor([3, 17, 60])
    lens = torch.tensor([0, 29])  # batch entry 0 keeps nothing at all

    def per_head_and_sample(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + 6) & (q_idx + 6 - kv_idx < widths[h]) & (kv_idx < lens[b])

    def tilt(score, b, h, q_idx, kv_idx):
        return score + 0.03 * (kv_idx - q_idx).float()

    mask = Mask("user", mask_mod=per_head_and_sample, score_mod=tilt)
    shape = Shape(batch=2, q_heads=3, q_len=41, kv_len=47, head_dim=8)
    ref = _sparse_vs_dense(mask, shape, budget=2 * 3 * 47 * 8 * 20 * 9, backward=True, seed=5)
    assert ref.fully_masked_rows >= 41 * 3 and ref.computed_fraction < 0.6


def test_a_dropped_block_still_fails_with_the_sparse_reference(monkeypatch):
    # the reference takes its keys from the mask_mod, never from the block mask under test
    from workbench import make
    from workbench.verify import reference as verify_module

    monkeypatch.setattr(verify_module, "default_reference_budget", lambda device: 2 * 1024 * 8 * 8 * 32)
    mask = make("causal_sliding_window", {"window": 150})
    good = build_block_mask(mask, 1024, 1024, block_size=64)
    assert int(good.full_kv_num_blocks[0, 0, 10]) == 1  # q block 10: kv block 9 is full
    broken = drop_one_full_block(good, 10, 1024, 1024)
    verdict = verify(mask, Shape(q_heads=2, q_len=1024, head_dim=16), dtype="float32", block_mask=broken,
                     seed=0, backend="eager")
    assert not verdict.passed and verdict.reference_fraction < 0.5  # chunks of 64 rows: a few hundred keys each
    assert verify(mask, Shape(q_heads=2, q_len=1024, head_dim=16), dtype="float32", block_mask=good,
                  seed=0, backend="eager").passed


def test_sparse_reference_equals_dense_on_combined_masks_and_spans():
    # torch's and_masks / or_masks and a vLLM-style spans mod with .any(), as users write them
    from torch.nn.attention.flex_attention import and_masks, or_masks

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def near(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < 24

    starts, ends = torch.tensor([40, 150]), torch.tensor([79, 201])

    def in_span(b, h, q_idx, kv_idx):
        return ((q_idx >= starts) & (q_idx <= ends) & (kv_idx >= starts) & (kv_idx <= ends)).any()

    mask = Mask("spans", mask_mod=or_masks(and_masks(causal, near), in_span))
    ref = _sparse_vs_dense(mask, Shape(q_heads=2, q_len=233, head_dim=8), budget=2 * 233 * 8 * 8 * 15)
    assert ref.computed_fraction < 0.6


def test_in_place_forward_softmax_equals_the_plain_one():
    """The forward reference masks and normalises its chunk in place, without the row-max shift
    when the row sums allow; it must equal the plain masked softmax, with rows that keep nothing
    giving 0 and lse -inf (never NaN), and hand back rows whose scores need the shift."""
    from workbench.verify.reference import _mask_in_place, _shifted_softmax_times_v, _softmax_times_v

    g = torch.Generator().manual_seed(3)
    scores = torch.randn(2, 3, 9, 40, dtype=torch.float64, generator=g)
    v = torch.randn(2, 3, 40, 8, dtype=torch.float64, generator=g)
    v_ones = torch.cat([v, torch.ones(2, 3, 40, 1, dtype=torch.float64), torch.zeros(2, 3, 40, 7, dtype=torch.float64)], -1)
    q = torch.arange(9)[:, None] + 20
    kv = torch.arange(40)[None, :]
    keep = ((kv <= q) & (kv > q - 12)).expand(2, 3, 9, 40).clone()
    keep[1, 2, 4] = False  # a row that keeps nothing
    plain = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(plain, -1)
    expected = torch.nan_to_num(torch.softmax(plain, -1), nan=0.0) @ v
    for softmax in ("unshifted", "shifted"):
        work = scores.clone()
        _mask_in_place(work, keep)
        if softmax == "unshifted":
            out, got_lse, dead = _softmax_times_v(work, v_ones, 8, keep)
        else:
            out, got_lse, dead = _shifted_softmax_times_v(work, v)
        assert torch.allclose(out, expected, rtol=1e-12, atol=1e-12)
        assert torch.equal(dead, torch.isneginf(lse)) and bool(dead[1, 2, 4]) and int(dead.sum()) == 1
        assert torch.allclose(got_lse[~dead], lse[~dead], rtol=1e-12) and not torch.isnan(out).any()
    # a row whose scores overflow exp, or all underflow it, is handed back for the shifted path
    for shift in (800.0, -800.0):
        work = scores.clone()
        work[0, 1, 3] += shift
        _mask_in_place(work, keep)
        assert _softmax_times_v(work, v_ones, 8, keep) is None


def test_reference_with_scores_beyond_exp_range_equals_the_plain_softmax():
    """Inputs large enough that scores leave exp's range (|s| in the thousands): the reference
    must notice and take the shifted path, still equal to a plain float64 softmax, never inf/NaN."""
    shape = Shape(batch=1, q_heads=2, q_len=70, kv_len=90, head_dim=8)
    inputs = make_inputs(shape, "float32", seed=1)
    inputs.q.mul_(40.0)
    inputs.k.mul_(40.0)
    mask = Mask("causal_offset", mask_mod=lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + 20)
    ref = reference_attention(mask, inputs, memory_budget=2 * 90 * 8 * 8 * 3 * 5)
    s = (inputs.q.double() @ inputs.k.double().transpose(-1, -2)) / math.sqrt(8)
    assert s.abs().max() > 1000
    keep = torch.arange(90)[None, :] <= torch.arange(70)[:, None] + 20
    s = s.masked_fill(~keep, float("-inf"))
    torch.testing.assert_close(ref.out, torch.softmax(s, -1) @ inputs.v.double(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ref.lse, torch.logsumexp(s, -1), rtol=1e-12, atol=1e-12)


def test_a_shrinking_chunk_reuses_its_mask_and_gqa_copies_only_kept_keys(monkeypatch):
    """Causal rows keep more keys as they go, so the reference's chunks shrink: it must evaluate
    the mask_mod once per chunk it computes (not again for the smaller chunk), and still equal the
    dense reference -- here with grouped-query heads and a mod that ignores q_idx."""
    import workbench.verify.reference as V

    evaluations, chunks = [], []
    real_eval, real_softmax = V.evaluate_mod, V._softmax_times_v
    monkeypatch.setattr(V, "evaluate_mod", lambda *a, **k: (evaluations.append(1) if k.get("score") is None
                                                             else None, real_eval(*a, **k))[1])
    monkeypatch.setattr(V, "_softmax_times_v", lambda *a: (chunks.append(1), real_softmax(*a))[1])

    def first_keys(b, h, q_idx, kv_idx):
        return kv_idx < 300

    for mod in (first_keys, lambda b, h, q_idx, kv_idx: q_idx >= kv_idx):
        mask = Mask("m", mask_mod=mod)
        shape = Shape(batch=2, q_heads=4, kv_heads=2, q_len=700, kv_len=900, head_dim=8)
        inputs = make_inputs(shape, "float32", seed=0)
        evaluations.clear(), chunks.clear()
        sparse = reference_attention(mask, inputs, memory_budget=4 << 20)
        assert len(evaluations) == len(chunks) >= 5  # several chunks, one evaluation each
        dense = reference_attention(mask, inputs, memory_budget=1 << 30, sparse=False)
        torch.testing.assert_close(sparse.out, dense.out, rtol=1e-12, atol=1e-12)
        assert torch.equal(torch.isneginf(sparse.lse), torch.isneginf(dense.lse))


def test_long_k_product_split_into_pieces_equals_the_plain_one(monkeypatch):
    """The forward reference's probabilities-times-v product over a long key axis runs as pieces
    summed (on CUDA); the split form must equal the plain product, with a remainder piece."""
    import workbench.verify.reference as V

    g = torch.Generator().manual_seed(5)
    p = torch.rand(1, 3, 7, 8 * 37 + 5, dtype=torch.float64, generator=g)
    v = torch.randn(1, 3, 8 * 37 + 5, 16, dtype=torch.float64, generator=g)
    monkeypatch.setattr(V, "SPLIT_K_PIECE", 8)
    got = V._matmul_long_k(p, v, split=True)  # (by default on CUDA only)
    torch.testing.assert_close(got, p @ v, rtol=1e-13, atol=1e-13)
    gqa = V._matmul_long_k(p, v[:, :1].expand(1, 3, *v.shape[2:]), split=True)  # broadcast v: the plain product
    torch.testing.assert_close(gqa, p @ v[:, :1], rtol=1e-13, atol=1e-13)


def _per_head_user_mod():
    widths = torch.tensor([3, 40, 7])  # undeclared per-head table, as users write it

    def user_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + 20) & (q_idx + 20 - kv_idx < widths[h])
    return user_window


def test_compiled_mask_evaluation_equals_eager_and_says_so(monkeypatch):
    """At length on a GPU the reference computes the mask's booleans through torch.compile; forced
    here on the CPU (one compile), it must give the eager reference and report its checks."""
    import workbench.verify.reference as V

    mask = Mask("user_window", mask_mod=_per_head_user_mod())
    shape = Shape(q_heads=3, q_len=301, kv_len=333, head_dim=8)
    inputs = make_inputs(shape, "float32", seed=2)
    eager = reference_attention(mask, inputs, memory_budget=3 * 333 * 8 * 3 * 40)
    monkeypatch.setattr(V, "compile_mask_here", lambda device, pairs: True)
    fused = reference_attention(mask, inputs, memory_budget=3 * 333 * 8 * 3 * 40)
    assert eager.mask_evaluation == "eager"
    assert fused.mask_evaluation == "torch.compile, equal to eager on 2 checked chunk(s)"
    torch.testing.assert_close(fused.out, eager.out, rtol=0, atol=0)
    torch.testing.assert_close(fused.lse, eager.lse, rtol=0, atol=0)


def test_a_compiled_mask_that_differs_falls_back_to_eager(monkeypatch):
    import workbench.verify.reference as V

    mask = Mask("user_window", mask_mod=_per_head_user_mod())
    inputs = make_inputs(Shape(q_heads=3, q_len=301, kv_len=333, head_dim=8), "float32", seed=2)
    eager = reference_attention(mask, inputs)

    class Wrong(V.MaskEvaluator):  # a miscompiled mask: one pair flipped
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.fused = lambda q_idx: self.eager(q_idx).clone().index_fill_(-1, torch.tensor([5]), True)
    monkeypatch.setattr(V, "MaskEvaluator", Wrong)
    got = reference_attention(mask, inputs)
    assert got.mask_evaluation.startswith("eager (the compiled mask differed")
    torch.testing.assert_close(got.out, eager.out, rtol=0, atol=0)


def test_learned_table_gradient_tolerance_follows_the_pairs_it_sums():
    """A bias table's gradient sums up to B x H x Lq x Lk pairs per entry: the H200 measured 4.1e-5
    Frobenius error in float32 for 2 x 1024 x 1024 pairs, which must pass; a 1% error in the entry
    that collects most pairs must still fail."""
    from workbench.verify.compare import _grad_tolerance

    g = torch.Generator().manual_seed(0)
    ref = torch.randn(65, dtype=torch.float64, generator=g)
    ref[64] = 2000.0  # the clamped bucket: most pairs land here
    tol = _grad_tolerance("float32", "dbias_table", ref, Shape(q_heads=2, q_len=1024, head_dim=64))
    measured = ref.clone()
    measured[64] += 4.1e-5 * ref.norm()  # the measured Frobenius error, all in the big entry
    assert compare("dbias_table", measured.float(), ref, tol).passed
    wrong = ref.clone()
    wrong[64] *= 1.01
    assert not compare("dbias_table", wrong.float(), ref, tol).passed
    small = _grad_tolerance("float32", "dbias_table", ref, Shape(q_heads=1, q_len=8, head_dim=8))
    assert small.rel_fro == 2e-5  # a small problem keeps the plain float32 limit


def test_an_lse_near_zero_is_judged_by_its_terms_not_its_size():
    # one key: lse = q.k * scale, a sum of O(1) terms that can cancel to 9e-4; float32 rounds it
    # by about 1e-8, 1.2e-5 of its value. Seen as a FAIL of a correct kernel at Lq = Lk = 1
    # (`verify causal --q-len 1 --kv-len 1 --eager --dtype float32 --seed 2085182340`)
    from workbench.verify import LSE_TOLERANCE, TOLERANCES, compare

    ref = torch.tensor([[[9.0e-4]]], dtype=torch.float64)
    assert compare("lse", ref + 1.1e-8, ref, LSE_TOLERANCE["float32"]).passed
    # the Frobenius check still catches a bias every element hides under its own tolerance: at lse
    # ~ 5 (6e-5 each, within 1e-4 + 5e-5) and at lse ~ 0 (5e-5 each)
    g = torch.Generator().manual_seed(0)
    big = 5 + torch.randn(1, 4, 256, generator=g, dtype=torch.float64)
    assert not compare("lse", big + 6e-5, big, LSE_TOLERANCE["float32"]).passed
    small = 1e-3 * torch.randn(1, 4, 256, generator=g, dtype=torch.float64)
    check = compare("lse", small + 5e-5, small, LSE_TOLERANCE["float32"])
    assert check.bad_count == 0 and not check.passed
    # and outputs keep the plain relative check
    out = 1e-3 * torch.randn(1, 1, 4, 8, generator=g, dtype=torch.float64)
    check = compare("out", out * (1 + 2e-5), out, TOLERANCES["float32"])
    assert check.bad_count == 0 and not check.passed
