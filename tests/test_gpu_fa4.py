"""The FA4 export on an H200 with flash-attn-4 installed: the generated file's forward (and
backward, through FA4's) against the float64 reference on the corpus, odd lengths, GQA and length
rules; FA4's device scan against the
stored exact scan; and the spec's `flash_attn` section run on FA4 itself. Run with `pytest -m gpu`
(with FA4 importable: the `fa4` extra of pyproject.toml)."""

from __future__ import annotations

import os

import pytest
import torch

from mod_corpus import corpus
from workbench import Mask, fa4, make
from workbench.run import Shape, make_inputs
from workbench.verify import reference_attention, verify


@pytest.fixture
def fa4_cuda(cuda):
    if fa4.installed() is None:
        pytest.fail("flash-attn-4 is not installed on this GPU machine: pip install 'flex-workbench[fa4]'")
    return cuda


# FA4_SHARD=i/n runs every n-th corpus case from the i-th (the FA4 compiles are CPU-bound: shards
# run side by side in separate processes)
_SHARD, _SHARDS = (int(x) for x in os.environ.get("FA4_SHARD", "0/1").split("/"))
_CASES = [i for i in range(len(corpus())) if i % _SHARDS == _SHARD]


@pytest.mark.gpu
@pytest.mark.parametrize("case", _CASES, ids=[corpus()[i][0].name for i in _CASES])
def test_every_corpus_mod_on_fa4_equals_the_reference(fa4_cuda, case):
    # the corpus's tables live on the CPU (as users make them): the file reads its own copies on the
    # GPU, and the float64 reference runs where the tables are
    from workbench.run import Fa4Backend
    from workbench.verify import LSE_TOLERANCE, TOLERANCES, compare

    mask, batch, heads = corpus()[case]
    dtype = "float16" if case % 4 == 3 else "bfloat16"
    shape = Shape(batch=batch, q_heads=heads, kv_heads=heads, q_len=96, kv_len=96, head_dim=64)
    inputs = make_inputs(shape, dtype, fa4_cuda, seed=1)
    run = Fa4Backend().run(mask, inputs)
    ref = reference_attention(mask, inputs, device="cpu")
    checks = [compare("out", run.out.cpu(), ref.out, TOLERANCES[dtype]),
              compare("lse", run.lse.cpu(), ref.lse, LSE_TOLERANCE[dtype])]
    bad = [f"{c.name}: max abs err {c.max_abs_err:.3g}, {c.bad_count} bad, {c.nan_count} NaN" for c in checks
           if not c.passed]
    assert not bad, f"{mask.name} {dtype}: " + "; ".join(bad)


@pytest.mark.gpu
@pytest.mark.parametrize("name,params,q_len,kv_len,q_heads,kv_heads,head_dim", [
    ("causal", {}, 200, 333, 8, 2, 128),                       # Lq != Lk, odd, GQA, a length rule
    ("causal_sliding_window", {"window": 1000}, 4096, 4096, 16, 16, 128),
    ("document", None, 3000, 3000, 4, 4, 96),                  # odd length, D 96
    ("image_spans", None, 2048, 2048, 4, 1, 128),              # .any() over spans, MQA
    ("relative_bias", None, 1024, 1024, 8, 8, 64),             # a T5-style bucket computed with log
    ("neighborhood_2d", None, 1024, 1024, 4, 4, 128),          # clamp
    ("causal", {}, 1, 4096, 8, 8, 128),                        # Lq = 1
])
def test_fa4_file_at_odd_shapes(fa4_cuda, name, params, q_len, kv_len, q_heads, kv_heads, head_dim):
    mask = make(name, params or {}, q_len=q_len, kv_len=kv_len, device=fa4_cuda)
    verdict = verify(mask, Shape(q_heads=q_heads, kv_heads=kv_heads, q_len=q_len, kv_len=kv_len, head_dim=head_dim),
                     dtype="bfloat16", device=fa4_cuda, backend="fa4", seed=2)
    assert verdict.passed, verdict.line


def _classes(blocks, rows: int, cols: int) -> torch.Tensor:
    """[B', H', rows, cols] of 0 (not listed), 1 (partial), 2 (full) from FA4's block-sparse tensors."""
    out = None
    for value, (cnt, idx) in ((1, (blocks.mask_block_cnt, blocks.mask_block_idx)),
                              (2, (blocks.full_block_cnt, blocks.full_block_idx))):
        cnt, idx = cnt.cpu().long(), idx.cpu().long()
        listed = torch.arange(idx.shape[-1]) < cnt[..., None]
        dense = torch.zeros(*idx.shape[:3], cols + 1, dtype=torch.int64)
        dense.scatter_(-1, torch.where(listed, idx, cols), value)
        out = dense[..., :cols] if out is None else torch.maximum(out, dense[..., :cols])
    return out


@pytest.mark.gpu
def test_fa4_device_scan_equals_the_stored_exact_scan(fa4_cuda, tmp_path):
    # FA4's compute_block_sparsity (full evaluation, what the file runs at other sizes) against the
    # workbench's exact scan stored in the file: the same blocks listed; a block cut by the sequence
    # end that keeps all its in-bounds pairs may be full in FA4's and partial in ours (both sound)
    w = torch.tensor([16, 200, 700, 3000])

    def head_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < w[h])

    for mask, heads in ((Mask("head_window", mask_mod=head_window), 4), (make("document", q_len=3000, kv_len=3000), 1)):
        src = fa4.generate(mask, 3000, 3000, heads=heads)
        module = fa4.load(fa4.write(src, tmp_path))
        aux, knobs = module._aux(fa4_cuda), module._scalars(None, 3000, 3000)
        stored = _classes(module._block_sparse(1, heads, 3000, 3000, fa4_cuda, aux, knobs), 24, 24)
        module.SCAN_SHAPE = None  # FA4's compute_block_sparsity at the same sizes
        module._lists.clear()
        scanned = _classes(module._block_sparse(1, heads, 3000, 3000, fa4_cuda, aux, knobs), 24, 24)
        stored = stored.expand_as(scanned)
        differ = stored != scanned
        boundary = torch.zeros_like(differ)
        boundary[..., -1, :] = True
        boundary[..., :, -1] = True
        assert not (differ & ~boundary).any(), torch.nonzero(differ & ~boundary)[:5]
        assert ((stored[differ] == 1) & (scanned[differ] == 2)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("name,params", [("causal", {}), ("causal_sliding_window", {"window": 256}),
                                         ("document", None)])
def test_the_specs_flash_attn_section_runs_on_fa4(fa4_cuda, name, params):
    # the spec's flash_attn arguments (causal, window_size, cu_seqlens) on FA4 itself, against the reference
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    from workbench.export import build_spec

    mask = make(name, params or {}, q_len=2048, kv_len=2048, device=fa4_cuda)
    section = build_spec(mask, 2048, 2048, golden=False, generalize=False).doc["backends"]["flash_attn"]
    shape = Shape(q_heads=4, q_len=2048, kv_len=2048, head_dim=128)
    inputs = make_inputs(shape, "bfloat16", fa4_cuda, seed=3)
    left, right = section["window_size"]
    window = (None if left < 0 else left, None if right < 0 else right)
    q, k, v = (t.transpose(1, 2) for t in (inputs.q, inputs.k, inputs.v))
    if section["cu_seqlens_q"]:
        cu_q = torch.tensor(section["cu_seqlens_q"], dtype=torch.int32, device=fa4_cuda)
        cu_k = torch.tensor(section["cu_seqlens_k"], dtype=torch.int32, device=fa4_cuda)
        out = flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                     max_seqlen_q=section["max_seqlen_q"], max_seqlen_k=section["max_seqlen_k"],
                                     causal=section["causal"], window_size=window)
        out = out[0] if isinstance(out, tuple) else out
        out = out[None]
    else:
        out = flash_attn_func(q, k, v, causal=section["causal"], window_size=window)
        out = out[0] if isinstance(out, tuple) else out
    ref = reference_attention(mask, inputs)
    err = (out.transpose(1, 2).double() - ref.out).abs().max().item()
    assert err < 2e-2, err


@pytest.mark.gpu
@pytest.mark.parametrize("name,params,q_len,heads", [("causal", {}, 2048, 8), ("softcap", None, 1024, 4),
                                                     ("document", None, 3000, 4), ("image_spans", None, 2048, 4)])
def test_fa4_backward_equals_the_reference(fa4_cuda, name, params, q_len, heads):
    # dq, dk, dv through FA4's backward with the generated score_mod derivative and transposed lists
    mask = make(name, params or {}, q_len=q_len, kv_len=q_len, device=fa4_cuda)
    verdict = verify(mask, Shape(q_heads=heads, kv_heads=heads // 2 or 1, q_len=q_len, head_dim=128),
                     dtype="bfloat16", device=fa4_cuda, backend="fa4", backward=True, seed=4)
    assert verdict.passed, verdict.line


@pytest.mark.gpu
@pytest.mark.parametrize("name,params,turned,again", [("causal_sliding_window", {"window": 256}, {"window": 77}, 500),
                                                      ("softcap", {"cap": 30.0}, {"cap": 3.0}, 7.5)])
def test_a_turned_knob_runs_the_other_mask_without_compiling_again(fa4_cuda, tmp_path, name, params, turned, again):
    # the file made at one value of a knob, called with another (scalars=): the reference of the
    # mask made at that other value, forward and backward. The first turned value compiles the
    # knob-reading copies of the mods (one forward kernel); a third value compiles nothing new
    from flash_attn.cute.interface import _flash_attn_fwd

    mask = make(name, params, q_len=1000, kv_len=1000, device=fa4_cuda)
    module = fa4.load(fa4.write(fa4.generate(mask, 1000, 1000, heads=4), tmp_path))
    inputs = make_inputs(Shape(q_heads=4, kv_heads=2, q_len=1000, kv_len=1000, head_dim=128), "bfloat16", fa4_cuda,
                         seed=5, backward=True)
    module.attention(inputs.q, inputs.k, inputs.v)  # at the generated value: compiles
    compiled = len(_flash_attn_fwd.compile_cache.cache)
    (param, value), = turned.items()
    q, k, v = (t.detach().requires_grad_(True) for t in (inputs.q, inputs.k, inputs.v))
    out = module.attention(q, k, v, scalars={f"knob_{param}": value})
    assert len(_flash_attn_fwd.compile_cache.cache) == compiled + 1
    with torch.no_grad():
        third = module.attention(inputs.q, inputs.k, inputs.v, scalars={f"knob_{param}": again})
    assert len(_flash_attn_fwd.compile_cache.cache) == compiled + 1
    want = reference_attention(make(name, {param: again}, q_len=1000, kv_len=1000, device=fa4_cuda), inputs)
    assert (third.double() - want.out).abs().max().item() < 2e-2
    out.backward(inputs.grad_out)
    ref = reference_attention(make(name, turned, q_len=1000, kv_len=1000, device=fa4_cuda), inputs, backward=True)
    assert (out.detach().double() - ref.out).abs().max().item() < 2e-2
    at_generated = reference_attention(mask, inputs)
    assert (out.detach().double() - at_generated.out).abs().max().item() > 5e-2  # the knob did change the answer
    for got, name in ((q.grad, "dq"), (k.grad, "dk"), (v.grad, "dv")):
        err = (got.double() - ref.grads[name]).abs().max().item()
        assert err < 3e-2 * max(1.0, ref.grads[name].abs().max().item()), (name, err)
