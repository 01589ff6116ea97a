"""Trust: verdicts and specs follow a mask's true structure for mods written the way people
write them -- undeclared per-head tables (w[h]), per-sample tables (lens[b]), spans with .any(),
torch's and_masks / or_masks, attention-gym's alibi -- and NaN never passes. Each test
reproduces a case that once gave a wrong verdict or a false claim; the property test at the end
draws mods from a grammar."""

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import and_masks, create_block_mask, or_masks

import decoders
from helpers import FIELDS, resolve, same_block_mask, variants  # noqa: F401
from workbench import Mask, make
from workbench.blocks import build_block_mask, dense_mask
from workbench.define import WorkbenchError, index_reads, with_score
from workbench.export import build_spec, conformance, load_spec, write_spec
from workbench.run import Shape, make_inputs, run_flex
from workbench.verify import verify
from workbench.run import FlexBackend

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

# ---------------------------------------------------------------- per-head and per-sample mods

windows = torch.tensor([64, 128, 256, 512])
lens = torch.tensor([100, 500])


def per_head_window(b, h, q, kv):  # an undeclared per-head table, as a user writes it
    return (kv <= q) & (q - kv < windows[h])


def per_sample_padding(b, h, q, kv):  # a padding mask: per-sample lengths
    return (kv <= q) & (kv >= q - lens[b])


def alibi_gym(score, b, h, q, kv):  # attention-gym's alibi: kv - q, not |q - kv|
    return score + torch.exp2(-(h + 1).float()) * (kv - q)


def test_index_reads_are_read_off_the_traced_mod():
    assert index_reads(per_head_window) == {"h", "q_idx", "kv_idx"}
    assert index_reads(per_sample_padding) == {"b", "q_idx", "kv_idx"}
    # and_masks calls b.new_ones(): that reads b's dtype, not its value
    assert "b" not in index_reads(and_masks(lambda b, h, q, kv: q >= kv, lambda b, h, q, kv: q - kv < 9))


def test_run_flex_builds_the_block_mask_of_every_head_and_batch_entry():
    """run_flex once built head 0's block mask for every head of an undeclared per-head mod."""
    mask = Mask("per_head", mask_mod=per_head_window)
    inputs = make_inputs(Shape(batch=1, q_heads=4, q_len=600, head_dim=16), "float32", seed=0)
    run = run_flex(mask, inputs, compile=False)
    same_block_mask(run.block_mask, create_block_mask(per_head_window, 1, 4, 600, 600, device="cpu"))
    assert run.block_mask.kv_num_blocks.shape[:2] == (1, 4)
    mask = Mask("padding", mask_mod=per_sample_padding)
    inputs = make_inputs(Shape(batch=2, q_heads=3, q_len=600, head_dim=16), "float32", seed=0)
    run = run_flex(mask, inputs, compile=False)
    # batch-dependent, head-independent: heads stay broadcast (size 1), batch entries do not
    assert run.block_mask.kv_num_blocks.shape[:2] == (2, 1)
    same_block_mask(run.block_mask, create_block_mask(per_sample_padding, 2, 1, 600, 600, device="cpu"))


def test_broadcast_block_mask_of_a_per_head_mod_is_refused():
    with pytest.raises(WorkbenchError, match=r"reads `h`.*Fix: pass heads=N"):
        build_block_mask(per_head_window, 256, 256)
    with pytest.raises(WorkbenchError, match=r"reads `b`.*Fix: pass batch=N"):
        build_block_mask(per_sample_padding, 256, 256)


def test_compiled_verify_of_per_head_and_per_sample_mods_passes():
    """The reported case: verify ... --heads 4 --q-len 600 said FAIL (rel err 0.08) for a correct
    per-head mod + alibi, and FAIL (0.28) for a padding mask at batch 2. One compile each."""
    shape = Shape(batch=1, q_heads=4, q_len=600, head_dim=32)
    mask = Mask("per_head+alibi", mask_mod=per_head_window, score_mod=alibi_gym)
    verdict = verify(mask, shape, dtype="float32", seed=1)
    assert verdict.passed, verdict.line
    verdict = verify(Mask("padding", mask_mod=per_sample_padding), Shape(batch=2, q_heads=1, q_len=600, head_dim=32),
                     dtype="float32", seed=1)
    assert verdict.passed, verdict.line


# ---------------------------------------------------------------- NaN never passes

def nan_score(score, b, h, q, kv):
    return torch.where((q - kv) % 7 == 3, score * float("nan"), score)


def test_nan_in_the_reference_fails_and_names_its_source():
    mask = Mask("nan", mask_mod=lambda b, h, q, kv: kv <= q, score_mod=nan_score)
    verdict = verify(mask, Shape(q_len=64, head_dim=16), dtype="float32", seed=0, backend="eager")
    assert not verdict.passed
    finding = [f for f in verdict.findings if f.kind == "reference_nan"][0]
    assert finding.severity == "error" and "score_mod gives NaN at kept pair" in finding.message
    assert "q=3, kv=0" in finding.message


def test_nan_goldens_are_never_written():
    mask = Mask("nan", mask_mod=lambda b, h, q, kv: kv <= q, score_mod=nan_score)
    with pytest.raises(WorkbenchError, match="no golden vectors can be written.*NaN"):
        build_spec(mask, 64, 64)


def test_edited_goldens_are_refused(tmp_path):
    """A golden file whose `out` was zeroed or set to NaN once let a port returning zeros pass."""
    from safetensors.numpy import load_file, save_file

    spec = build_spec(make("causal"), 64, 64, head_dim=16, seed=0, generalize=False)
    json_path, st_path = write_spec(spec, tmp_path)

    def zeros_port(q, k, v, spec):
        return torch.zeros_like(q)

    assert not conformance(json_path, zeros_port).passed
    for poison in (0.0, float("nan")):
        tensors = load_file(str(st_path))
        tensors["golden.0.out"] = np.full_like(tensors["golden.0.out"], poison)
        save_file(tensors, str(st_path))
        with pytest.raises(WorkbenchError, match="does not match the digest recorded at export"):
            conformance(json_path, zeros_port)
    with pytest.raises(WorkbenchError, match="does not match the digest"):
        load_spec(json_path)


def test_conformance_of_a_spec_without_goldens_is_a_clear_error(tmp_path):
    spec = build_spec(make("causal"), 64, 64, golden=False, generalize=False)
    json_path, _ = write_spec(spec, tmp_path)
    with pytest.raises(WorkbenchError, match="has no golden vectors"):
        conformance(json_path, lambda q, k, v, s: q)


# ---------------------------------------------------------------- compile failures

def test_a_compile_failure_falls_back_to_uncompiled_flex(monkeypatch):
    """A valid mod that torch.compile cannot build (the vLLM spans mod + softcap raised an
    InductorError on the CPU) is judged uncompiled, with a finding naming the error."""
    from workbench import run

    class InductorError(Exception):
        pass

    def broken_compile(*args, **kwargs):
        raise InductorError("LoweringException: Buffers cannot be created while lowering a pointwise subgraph")

    monkeypatch.setattr(run, "compiled_flex_attention", lambda: broken_compile)
    starts, ends = torch.tensor([10, 40]), torch.tensor([19, 52])

    def spans(b, h, q, kv):
        return ((q >= starts) & (q <= ends) & (kv >= starts) & (kv <= ends)).any() | (kv <= q)

    mask = with_score(Mask("spans", mask_mod=spans), make("softcap", {"cap": 20.0}))
    verdict = verify(mask, Shape(q_len=100, head_dim=16), dtype="float32", seed=0)
    assert verdict.passed, verdict.line
    finding = [f for f in verdict.findings if f.kind == "compile_failed"][0]
    assert "InductorError" in finding.message and not verdict.compiled or verdict.compile_seconds is None


# ---------------------------------------------------------------- specs claim only what is true

def test_spec_of_a_batch_dependent_mod_needs_the_batch():
    mask = Mask("padding", mask_mod=per_sample_padding)
    with pytest.raises(WorkbenchError, match=r"reads `b`.*pass batch=N"):
        build_spec(mask, 600, 600, golden=False)
    spec = build_spec(mask, 600, 600, batch=2, golden=False, generalize=False)
    assert spec.doc["shape"]["B"] == 2 and "by_batch" in spec.doc["backends"]["row_intervals"]


def test_parametric_claim_is_checked_at_other_offsets():
    """A top-left causal mod exported at Lq=600, Lk=1000 once got a 'parametric' window that was
    wrong at 700 x 1000 on 64,950 pairs."""
    top_left = Mask("top_left", mask_mod=lambda b, h, q, kv: kv <= q)
    spec = build_spec(top_left, 600, 1000, golden=False)
    fa = spec.doc["backends"].get("flash_attn")
    if fa is not None:
        assert fa["generalizes"]["parametric"] is False and "differs_at" in fa["generalizes"]
    spec = build_spec(make("causal_sliding_window", {"window": 64}), 300, 500, golden=False)
    gen = spec.doc["backends"]["flash_attn"]["generalizes"]
    assert gen["parametric"] is True and "any q_len, kv_len" in gen["holds_for"]
    assert len({lk - lq for lq, lk in gen["checked_sizes"]}) >= 2  # other offsets were checked


def test_score_is_probed_on_kept_pairs_only():
    """attention-gym's alibi under a causal mask is FlashAttention's alibi; probed on all pairs it
    came out opaque and the flash_attn section was lost."""
    mask = Mask("causal+alibi_gym", mask_mod=lambda b, h, q, kv: kv <= q, score_mod=alibi_gym)
    spec = build_spec(mask, 128, 128, heads=4, golden=False, generalize=False)
    assert spec.doc["score"]["kind"] == "alibi"
    np.testing.assert_allclose(spec.doc["score"]["slopes"], [2.0 ** -(h + 1) for h in range(4)], rtol=1e-6)
    assert spec.doc["backends"]["flash_attn"]["alibi_slopes"] == spec.doc["score"]["slopes"]


def test_data_bound_mask_is_not_generalizable_and_does_not_crash():
    """A captured sequence-sized table once let an IndexError escape build_spec."""
    window_of_token = torch.full((200,), 32)  # a window per query, sized for 200 tokens

    def table_window(b, h, q, kv):
        return (kv <= q) & (q - kv < window_of_token[q])

    spec = build_spec(Mask("table_window", mask_mod=table_window), 200, 200, golden=False)
    gen = spec.doc["backends"]["flash_attn"]["generalizes"]
    assert gen["parametric"] is False and "data-bound" in gen["note"], gen


def test_identical_heads_are_not_labelled_per_head():
    """A cross-attention mask that reads h but gives every head the same mask."""
    valid = torch.tensor([1, 1, 1, 1])

    def cross(b, h, q, kv):
        return (kv < 90) & (valid[h] > 0)

    spec = build_spec(Mask("cross", mask_mod=cross), 64, 128, heads=4, golden=False, generalize=False)
    assert spec.doc["shape"]["H"] is None and spec.doc["pattern"]["kind"] != "per_head"
    assert "by_head" not in spec.doc["backends"]["row_intervals"]


# ---------------------------------------------------------------- property: a grammar of mods

@st.composite
def grammar_mods(draw):
    """(Mask, q_len, kv_len, batch, heads): per-head and per-batch tables, windows, documents,
    .any() spans, prefixes, and_masks / or_masks, and a score mod, at odd sizes with Lq != Lk."""
    q_len = draw(st.integers(1, 150))
    kv_len = q_len + draw(st.integers(0, 60))
    batch, heads = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    d = kv_len - q_len

    def window():
        w = draw(st.integers(1, kv_len + 1))
        return lambda b, h, q, kv: (q + d - kv < w) & (kv <= q + d)

    def per_head_window():
        w = torch.tensor([draw(st.integers(1, kv_len + 1)) for _ in range(heads)])
        return lambda b, h, q, kv: (q + d - kv < w[h]) & (kv <= q + d)

    def per_batch_length():
        n = torch.tensor([draw(st.integers(0, kv_len)) for _ in range(batch)])
        return lambda b, h, q, kv: kv < n[b]

    def document():
        cuts = sorted(set(draw(st.lists(st.integers(1, max(1, kv_len - 1)), max_size=3))))
        ids = torch.zeros(kv_len, dtype=torch.int64)
        for c in cuts:
            ids[c:] += 1
        return lambda b, h, q, kv: ids[q + d] == ids[kv]

    def spans():
        n = draw(st.integers(1, 3))
        s = torch.tensor(sorted(draw(st.integers(0, kv_len - 1)) for _ in range(n)))
        e = torch.minimum(s + torch.tensor([draw(st.integers(0, 20)) for _ in range(n)]), torch.tensor(kv_len - 1))
        return lambda b, h, q, kv: ((q + d >= s) & (q + d <= e) & (kv >= s) & (kv <= e)).any()

    def prefix():
        p = draw(st.integers(0, kv_len))
        return lambda b, h, q, kv: kv < p

    makers = [window, per_head_window, per_batch_length, document, spans, prefix]
    parts = [draw(st.sampled_from(makers))() for _ in range(draw(st.integers(1, 3)))]
    mod = parts[0]
    for p in parts[1:]:
        mod = (and_masks if draw(st.booleans()) else or_masks)(mod, p)
    score = None
    if draw(st.booleans()):
        slopes = torch.tensor([draw(st.floats(0.01, 1.0)) for _ in range(heads)])
        score = draw(st.sampled_from([
            lambda s, b, h, q, kv: s - slopes[h] * (q + d - kv).abs(),
            lambda s, b, h, q, kv: 15.0 * torch.tanh(s / 15.0),
        ]))
    return Mask("drawn", mask_mod=mod, score_mod=score), q_len, kv_len, batch, heads


def decode(target, s, q_len, kv_len, want):
    return {"flash_attn": lambda: decoders.flash_attn(s, q_len, kv_len),
            "vllm_triton": lambda: decoders.vllm_triton(s, q_len, kv_len),
            "magi": lambda: decoders.magi(s, q_len, kv_len),
            "flashmask": lambda: decoders.flashmask(s, s["startend_row_indices"], q_len, kv_len),
            "row_intervals": lambda: decoders.row_intervals(s["rows"], q_len, kv_len),
            "block_sparse": lambda: decoders.block_sparse(s, q_len, kv_len, want)}[target]()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(grammar_mods())
def test_property_drawn_mods_verify_match_torch_and_export_truthfully(case):
    mask, q_len, kv_len, batch, heads = case
    # the BlockMask equals torch's, tensor for tensor
    ours = build_block_mask(mask, q_len, kv_len, heads=heads, batch=batch, block_size=32)
    same_block_mask(ours, create_block_mask(mask.mask_mod, batch, heads, q_len, kv_len, device="cpu", BLOCK_SIZE=32))
    # FlexAttention (uncompiled here; compiled on the GPU) agrees with the reference
    shape = Shape(batch=batch, q_heads=heads, q_len=q_len, kv_len=kv_len, head_dim=16)
    verdict = verify(mask, shape, dtype="float32", seed=0, backend=FlexBackend(compile=False, block_size=32))
    assert verdict.passed, verdict.line
    # every section decodes, for every (b, h) it claims to cover, to exactly the mask
    spec = build_spec(mask, q_len, kv_len, heads=heads, batch=batch, golden=False, block_size=32)
    B, H = spec.doc["shape"]["B"], spec.doc["shape"]["H"]
    for target, section in spec.doc["backends"].items():
        if target in ("triton", "triton_attention", "flash_attn_cute"):  # run by test_port.py, test_fa4.py
            continue
        decoded = {(b, h): resolve(s, spec.tensors) for b, h, s in variants(section, B, H)}
        for b in range(batch):
            for h in range(heads):
                s = decoded[(b if B else 0, h if H else 0)]
                want = dense_mask(mask, (0, q_len), (0, kv_len), batch=[b], heads=[h])[0, 0]
                assert torch.equal(decode(target, s, q_len, kv_len, want), want), (target, b, h)
        gen = section.get("generalizes") if isinstance(section, dict) else None
        if gen and gen["parametric"]:  # the claim: the same arguments hold at every size
            for lq, lk in [(q_len + 13, kv_len + 29), (q_len + 40, kv_len + 40)]:
                want = dense_mask(mask, (0, lq), (0, lk))[0, 0]
                args = dict(section, cu_seqlens_q=None, cu_seqlens_k=None, mm_prefix_ranges=None)
                assert torch.equal(decode(target, args, lq, lk, want), want), (target, lq, lk)
    # a corrupted block mask and a corrupted mod both FAIL (the check can fail)
    kept = dense_mask(mask, (0, q_len), (0, kv_len), batch=batch, heads=heads)
    if kept.any():
        bb, hh, qq, kk = (int(x) for x in kept.nonzero()[0])
        inner = mask.mask_mod

        def mutant(b, h, q, kv):  # drops every pair of one kept row: never lost in rounding
            return inner(b, h, q, kv) & ~((b == bb) & (h == hh) & (q == qq))

        wrong = verify(Mask("mutant", mask_mod=mutant, score_mod=mask.score_mod), shape, dtype="float32",
                       seed=0, expected=mask, backend=FlexBackend(compile=False, block_size=32))
        assert not wrong.passed
        dropped = ours
        n = dropped.kv_num_blocks.clone()
        full = dropped.full_kv_num_blocks.clone()
        r = qq // 32
        n[:, :, r] = 0
        full[:, :, r] = 0
        from torch.nn.attention.flex_attention import BlockMask
        broken = BlockMask.from_kv_blocks(n, dropped.kv_indices, full, dropped.full_kv_indices,
                                          BLOCK_SIZE=32, mask_mod=mask.mask_mod, seq_lengths=(q_len, kv_len))
        bad = verify(mask, shape, dtype="float32", seed=0, block_mask=broken, backend="eager")
        assert not bad.passed and any(f.kind == "block_mask_drops_pairs" for f in bad.findings)


def test_a_reducing_mod_is_never_evaluated_on_broadcast_tiles():
    """`(... spans ...).any()` called once on broadcast index tensors reduces over the whole tile;
    when no probe region touched a span, the scan once took that path and marked whole tiles kept
    (seen at 32K on the GPU, rows 44+ of a drawn mod)."""
    from workbench.blocks import scan_blocks
    from workbench.define import elementwise

    s, e = torch.tensor([1000]), torch.tensor([1040])  # one span: broadcasts without an error

    def spans(b, h, q, kv):
        return ((q >= s) & (q <= e) & (kv >= s) & (kv <= e)).any()

    mod = or_masks(spans, lambda b, h, q, kv: kv <= q - 3000)
    assert not elementwise(mod) and elementwise(lambda b, h, q, kv: kv <= q)
    assert scan_blocks(mod, 6000, 6000).evaluator == "vmap"
    same_block_mask(build_block_mask(mod, 6000, 6000), create_block_mask(mod, None, None, 6000, 6000, device="cpu"))
