"""The fast reference (sparse key sets, in-place softmax, split products) equals the plain oracle
(verify/oracle.py: dense per chunk, written as directly as it can be) on the mod corpus -- the
library and users' mods -- forward and backward, in float64; and the oracle itself is checked
against a hand-made dense softmax on a few cases."""

import math

import pytest
import torch

from mod_corpus import LENGTH, corpus
from workbench import Mask, make
from workbench.run import Shape, make_inputs
from workbench.verify import oracle_attention, reference_attention

CASES = corpus()


@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[0].name for c in CASES])
def test_fast_reference_equals_the_oracle(case):
    mask, batch, heads = CASES[case]
    kv_heads = heads // 2 if heads % 2 == 0 else heads  # GQA where the heads allow it
    shape = Shape(batch=batch, q_heads=heads, kv_heads=kv_heads, q_len=mask.q_len or LENGTH,
                  kv_len=mask.kv_len or LENGTH, head_dim=8)
    inputs = make_inputs(shape, "float64", "cpu", seed=case, backward=True)
    ref = reference_attention(mask, inputs, backward=True, progress=False)
    q, k, v = (t.detach().clone().requires_grad_() for t in (inputs.q, inputs.k, inputs.v))
    out, lse = oracle_attention(mask, q, k, v)
    assert not torch.isnan(ref.out).any() and not torch.isnan(out).any()
    assert torch.allclose(ref.out, out, rtol=1e-10, atol=1e-12), (ref.out - out).abs().max()
    assert torch.equal(torch.isneginf(ref.lse), torch.isneginf(lse))
    finite = torch.isfinite(lse)
    assert torch.allclose(ref.lse[finite], lse[finite], rtol=1e-10, atol=1e-12)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), inputs.grad_out)
    for name, mine in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.allclose(ref.grads[name], mine, rtol=1e-8, atol=1e-10), (name, (ref.grads[name] - mine).abs().max())


def test_the_oracle_is_a_masked_softmax():
    """Against the definition, by hand: causal, a score mod, and rows that keep nothing."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    scores = q @ k.transpose(-1, -2) / math.sqrt(4)
    keep = torch.tril(torch.ones(5, 5, dtype=torch.bool))
    want = torch.softmax(scores.masked_fill(~keep, float("-inf")), -1) @ v
    out, lse = oracle_attention(make("causal"), q, k, v)
    assert torch.allclose(out, want) and torch.allclose(lse, torch.logsumexp(scores.masked_fill(~keep, -torch.inf), -1))

    def late(b, h, q_idx, kv_idx):  # rows 0 and 1 keep nothing
        return (kv_idx <= q_idx) & (kv_idx >= 2)

    def tanh_cap(score, b, h, q_idx, kv_idx):
        return 3.0 * torch.tanh(score / 3.0)

    out, lse = oracle_attention(Mask("late", mask_mod=late, score_mod=tanh_cap), q, k, v)
    assert torch.equal(out[:, :, :2], torch.zeros(1, 2, 2, 4, dtype=torch.float64))
    assert torch.isneginf(lse[:, :, :2]).all() and torch.isfinite(lse[:, :, 2:]).all()
    keep = (torch.arange(5)[None] <= torch.arange(5)[:, None]) & (torch.arange(5)[None] >= 2)
    capped = (3.0 * torch.tanh(scores / 3.0)).masked_fill(~keep, float("-inf"))
    assert torch.allclose(out[:, :, 2:], (torch.softmax(capped, -1) @ v)[:, :, 2:])
