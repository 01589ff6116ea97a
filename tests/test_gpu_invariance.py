"""Layout invariance on the GPU: compiled FlexAttention reproduces the measured pattern (bitwise
when batched, padded or packed at a block-aligned offset; not at an unaligned one), and so does the
generated port. Run with `pytest -m gpu -s` to see the tables."""

import pandas as pd
import pytest

from workbench import invariance


def _by_key(result):
    out = {}
    for r in result.layouts:
        out.setdefault(r.key, []).append(r)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flex", "port"])
def test_measured_pattern_on_the_h200(cuda, backend):
    result = invariance.check("causal", q_len=3000, heads=8, head_dim=128, dtype="bfloat16", device=cuda,
                              backend=backend, options=invariance.InvarianceOptions(batch=8))
    with pd.option_context("display.width", 250, "display.max_colwidth", 70):
        print(f"\n{result.line}\n{result.to_frame()[['bitwise', 'max_abs_diff', 'max_ulp', 'first_diff']]}")
    by_key = _by_key(result)
    for key in ("run", "batch", "packed_aligned", "padded"):  # zeros where zeros were measured
        assert all(r.bitwise for r in by_key[key]), (key, [r.max_abs_diff for r in by_key[key]])
    unaligned = by_key["packed_unaligned"][0]
    assert not unaligned.bitwise and 0 < unaligned.max_abs_diff < 0.05  # a few bf16 ulps, never a wrong answer


@pytest.mark.gpu
def test_segment_relative_port_is_invariant_to_packing(cuda):
    result = invariance.check("causal", q_len=3000, heads=8, head_dim=128, dtype="bfloat16", device=cuda,
                              backend="port", layouts=["run", "packed_aligned", "packed_unaligned"], options=invariance.InvarianceOptions(segments=True))
    print(f"\n{result.line}")
    assert result.passed, [(r.key, r.max_abs_diff) for r in result.layouts]
