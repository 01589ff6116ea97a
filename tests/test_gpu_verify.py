"""Runner and verifier on the GPU: compiled FlexAttention, backward, long sequences, the
recompile limit. Run on a CUDA machine: `pytest -m gpu`."""

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask

from workbench import make
from workbench.blocks import build_block_mask
from workbench.cli import main
from workbench.define import with_score
from workbench.run import Shape, make_inputs, run_flex
from workbench.verify import verify

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "tf32"])
def test_forward_backward_library_masks(cuda, dtype):
    shape = Shape(batch=2, q_heads=4, kv_heads=2, q_len=2048, kv_len=2048, head_dim=64)
    for mask in (make("document", {"doc_lengths": [700, 300, 1048]}, q_len=2048, kv_len=2048, device=cuda),
                 with_score(make("causal_sliding_window", {"window": 256}), make("alibi", {"num_heads": 4}, device=cuda)),
                 make("image_spans", q_len=2048, kv_len=2048, device=cuda)):
        v = verify(mask, shape, dtype=dtype, device=cuda, backward=True)
        assert v.passed, v.line
        assert {c.name for c in v.checks} == {"out", "lse", "dq", "dk", "dv"}


def test_bf16_error_in_expected_band(cuda):
    v = verify(make("causal"), Shape(q_heads=16, q_len=8192, head_dim=128), dtype="bfloat16", device=cuda)
    assert v.passed and 5e-4 < v.checks[0].rel_err < 5e-3, v.line


def test_learnable_captured_table_gets_checked_gradient(cuda):
    mask = make("relative_bias", {"max_distance": 32}, q_len=1024, kv_len=1024, device=cuda)
    table = mask.data["bias_table"].clone().requires_grad_()
    def relative_bias_learned(score, b, h, q_idx, kv_idx):
        return score + table[(q_idx - kv_idx).clamp(-32, 32) + 32]
    learned = mask.replace(score_mod=relative_bias_learned, data={"bias_table": table})
    learned = with_score(make("causal"), learned)
    v = verify(learned.replace(data={"bias_table": table}), Shape(q_heads=2, q_len=1024, head_dim=64),
               dtype="float32", device=cuda, backward=True)
    names = {c.name for c in v.checks}
    assert "dbias_table" in names and v.passed, v.line


def test_dropped_block_fails_in_compiled_output_at_its_rows(cuda):
    mask = make("causal")
    good = build_block_mask(mask, 1024, 1024, block_size=128, device=cuda)
    full_num = good.full_kv_num_blocks.clone()
    full_num[..., 5] -= 1  # q block 5 (rows 640..767) loses kv block 4
    broken = BlockMask.from_kv_blocks(good.kv_num_blocks, good.kv_indices, full_num, good.full_kv_indices,
                                      BLOCK_SIZE=good.BLOCK_SIZE, mask_mod=good.mask_mod, seq_lengths=(1024, 1024))
    v = verify(mask, Shape(q_heads=2, q_len=1024, head_dim=64), dtype="bfloat16", device=cuda, block_mask=broken)
    out = v.checks[0]
    assert not v.passed and not out.passed and 640 <= out.worst["q"] <= 767, v.line


def test_reference_at_131072_tokens(cuda):
    # FlexAttention's own uncompiled path needs 64 GiB here; the chunked reference does not
    torch.cuda.reset_peak_memory_stats()
    v = verify(make("causal_sliding_window", {"window": 4096}), Shape(q_heads=1, q_len=131072, head_dim=64),
               dtype="bfloat16", device=cuda)
    peak = torch.cuda.max_memory_allocated() / 2**30
    print(f"131072 tokens: {v.line}; reference {v.reference_seconds:.1f} s, peak {peak:.1f} GiB")
    assert v.passed and peak < 40, v.line


def test_many_masks_do_not_hit_the_recompile_limit(cuda):
    # 12 distinct mods (> dynamo's default limit of 8) at 32K x 16 heads: a fallback to the
    # unfused path would need 64 GiB and seconds per call
    shape = Shape(q_heads=16, q_len=32768, head_dim=128)
    inputs = make_inputs(shape, "bfloat16", cuda, seed=0)
    for window in range(100, 1300, 100):
        run = run_flex(make("causal_sliding_window", {"window": window}), inputs)
        assert run.new_graph and run.compile_seconds > 0.1 and run.run_seconds < 0.05, (window, run.run_seconds)
    again = run_flex(make("causal_sliding_window", {"window": 100}), inputs)
    assert not again.new_graph and again.compile_seconds == 0.0 and again.run_seconds < 0.05


def test_cli_verify_cuda_json(cuda, capsys):
    import json

    code = main(["verify", "document", "--param", "doc_lengths=[3000,1096]", "--q-len", "4096", "--heads", "8",
                 "--kv-heads", "2", "--head-dim", "128", "--device", "cuda", "--backward", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    record = json.loads(captured.out)
    assert record["passed"] and set(record["checks"]) == {"out", "lse", "dq", "dk", "dv"}
