"""Invariant mode on the GPU: one request through every serving layout of `workbench.serving`
(alone, in a step, order, shuffled pages, page 128, split / unsplit, chunked prefill, decode)
is bitwise attention(q, k, v, invariant=True), at a length past one split-KV piece, and that
contiguous call equals the float64 reference. Run with `pytest -m gpu`."""

import pytest
import torch

from workbench import Mask, make, port, serving, with_score
from workbench.define import prepare
from workbench.run import Inputs, Shape
from workbench.verify import LSE_TOLERANCE, TOLERANCES, compare, reference_attention

pytestmark = pytest.mark.gpu
# a user's per-head windows (32 heads), made on the GPU as a user running there would
W = torch.tensor([64 + 61 * i for i in range(32)], device="cuda" if torch.cuda.is_available() else "cpu")


def head_window(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx < W[h])


TARGETS = {
    "causal": lambda: make("causal"),
    "window_1000": lambda: make("causal_sliding_window", {"window": 1000}),
    "users_head_window": lambda: Mask("users_head_window", mask_mod=head_window),
    "causal+alibi": lambda: with_score(make("causal"), make("alibi", {"num_heads": 32})),
    "prefix_lm": lambda: make("prefix_lm"),
}
# (target, dtype, modes): fast mode only reports, so most cases run invariant mode alone (each
# mode compiles its own kernels: about a minute and a half per case on an H200)
CASES = [("causal", "bfloat16", serving.MODES), ("users_head_window", "bfloat16", ("invariant",)),
         ("causal+alibi", "float16", ("invariant",)), ("causal", "float32", ("invariant",)),
         ("window_1000", "bfloat16", ("invariant",)), ("prefix_lm", "bfloat16", ("invariant",))]


@pytest.mark.parametrize("name, dtype, modes", CASES, ids=[f"{n}-{d}" for n, d, _ in CASES])
def test_invariant_mode_is_bitwise_in_every_serving_layout(cuda, tmp_path, name, dtype, modes):
    L = 4096 + 700  # two split-KV pieces of 4,096 keys
    result = serving.check(TARGETS[name](), q_len=L, heads=32, kv_heads=8, head_dim=128, dtype=dtype, device="cuda",
                           out_dir=tmp_path, modes=modes)
    print(result.line)
    frame = result.to_frame()
    assert result.passed, frame[["bitwise", "same_attention", "max_abs_diff", "why"]].to_string()
    assert len(result.modes["invariant"]) >= 9
    # the contiguous invariant call is right, not only consistent: the float64 reference
    module = port.load(result.port_file)
    q, k, v = serving._inputs(L, 32, 8, 128, dtype, "cuda", 0)
    with torch.no_grad():
        out, lse = module.attention(q, k, v, invariant=True, return_lse=True)
    shape = Shape(batch=1, q_heads=32, kv_heads=8, q_len=L, kv_len=L, head_dim=128)
    mask = prepare(TARGETS[name](), None, L, L, "cuda", heads=32)  # its captured tables on the GPU
    ref = reference_attention(mask, Inputs(q=q, k=k, v=v, shape=shape, dtype=dtype, seed=0), progress=False)
    checks = [compare("out", out, ref.out, TOLERANCES[dtype]), compare("lse", lse, ref.lse, LSE_TOLERANCE[dtype])]
    assert all(c.passed for c in checks), [(c.name, c.max_abs_err, c.bad_count, c.nan_count) for c in checks]


def test_a_packed_training_batch_gives_each_document_the_engines_bits(cuda, tmp_path):
    """A trainer packs documents past one split-KV piece (a document mask with cu_seqlens); the
    engine serves each one as its own request over shuffled pages. In invariant mode the packed
    call, the document alone and the paged call are the same bits, and the float64 reference
    agrees with them."""
    from workbench.port.layout import paged_step

    L1, L2 = 4096 + 333, 1500
    doc = make("document", {"doc_lengths": [L1, L2]}, q_len=L1 + L2, kv_len=L1 + L2)
    packed_port = port.load(port.build(doc, L1 + L2, L1 + L2, out_dir=tmp_path / "doc"))
    causal_port = port.load(port.build(make("causal"), 256, 256, out_dir=tmp_path / "causal"))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 32, L1 + L2, 128, generator=g, device="cuda").bfloat16() for _ in range(3))
    k, v = k[:, :8].contiguous(), v[:, :8].contiguous()
    with torch.no_grad():
        packed = packed_port.attention(q, k, v, cu_seqlens=[0, L1, L1 + L2], invariant=True)
        for s, e in ((0, L1), (L1, L1 + L2)):
            parts = [x[:, :, s:e].contiguous() for x in (q, k, v)]
            alone = causal_port.attention(*parts, invariant=True)
            step = paged_step(*parts, page_size=16, seed=1)
            paged = step.unpack(causal_port.attention_paged(*step.args(), invariant=True, check=True))
            assert torch.equal(packed[:, :, s:e], alone) and torch.equal(paged, alone), (s, e)
            shape = Shape(batch=1, q_heads=32, kv_heads=8, q_len=e - s, kv_len=e - s, head_dim=128)
            ref = reference_attention(prepare(make("causal"), None, e - s, e - s, "cuda", heads=32),
                                      Inputs(q=parts[0], k=parts[1], v=parts[2], shape=shape, dtype="bfloat16",
                                             seed=0), progress=False)
            check = compare("out", alone, ref.out, TOLERANCES["bfloat16"])
            assert check.passed, (check.max_abs_err, check.bad_count, check.nan_count)
