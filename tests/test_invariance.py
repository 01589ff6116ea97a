"""Layout invariance on the CPU: the comparison counts bits, the layouts compute the same request
(the wrappers are right), and the port's absolute kv tiling shows at an unaligned packing offset."""

import json

import pytest
import torch

from workbench import Mask, invariance
from workbench.cli import main
from workbench.define import WorkbenchError


def test_compare_counts_ulps_and_never_passes_nan():
    a = torch.randn(2, 5, 4, dtype=torch.bfloat16)
    b = a.clone()
    assert invariance.compare(a, b) == (True, 0.0, 0, None)
    bits = b.view(torch.int16)
    bits[1, 3, 2] += 1  # one unit in the last place
    same, max_abs, max_ulp, first = invariance.compare(a, b, q_offset=10)
    assert not same and max_ulp == 1 and max_abs > 0
    assert (first["h"], first["q"], first["d"]) == (1, 13, 2)
    c = a.clone()
    c[0, 0, 0] = float("nan")
    assert invariance.compare(c, c)[0] is False  # NaN is never bitwise, even against itself


def test_every_layout_computes_the_same_request_for_user_mods():
    # an undeclared per-head table, a per-sample table and a score: each layout wraps them
    windows = torch.tensor([8, 32])
    lens = torch.tensor([50, 90])

    def per_head_padded(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < windows[h]) & (kv_idx < lens[b])

    def tilt(score, b, h, q_idx, kv_idx):
        return score - 0.01 * (q_idx - kv_idx).float()

    mask = Mask("user_mod", mask_mod=per_head_padded, score_mod=tilt)
    result = invariance.check(mask, q_len=150, heads=2, head_dim=16, dtype="float32", device="cpu", options=invariance.InvarianceOptions(batch=3))
    frame = result.to_frame()
    assert len(frame) == 9 and set(frame["key"]) == set(invariance.LAYOUT_KEYS)
    # every layout computes the same request (a wrong wrapper would be off by O(1)) ...
    assert (frame["max_abs_diff"] < 1e-5).all(), frame[["max_abs_diff", "first_diff"]]
    # ... and the same call, or the request at another batch position, is bit for bit the same
    assert frame.loc[frame["key"].isin(["run", "batch"]), "bitwise"].all()
    # uncompiled FlexAttention reduces whole rows, so a longer (packed) row sums in another order
    assert result.line.startswith(("INVARIANT user_mod", "NOT INVARIANT user_mod"))


def test_a_data_bound_mask_sees_its_own_positions_when_packed():
    # a draft tree in the last tokens of its request: packed after another request, chunked or
    # decoded, the tree is still at the request's own positions
    result = invariance.check("tree", q_len=200, heads=1, head_dim=8, dtype="float32", device="cpu",
                              layouts=["packed_aligned", "packed_unaligned", "chunked_unaligned", "decode"])
    assert result.name == "tree_15nodes"
    assert all(r.max_abs_diff < 1e-5 for r in result.layouts), [(r.key, r.max_abs_diff) for r in result.layouts]


@pytest.mark.slow  # (a minute or more here; make test-slow, which CI runs)
def test_the_port_differs_only_when_packed_off_a_tile_edge(capsys):
    # the generated kernel cuts kv tiles at absolute positions, like FlexAttention on the GPU
    result = invariance.check("causal", q_len=300, heads=2, head_dim=32, dtype="float32", device="cpu",
                              backend="port", layouts=["run", "packed_aligned", "packed_unaligned"])
    by_key = {r.key: r for r in result.layouts}
    assert by_key["run"].bitwise and by_key["packed_aligned"].bitwise
    unaligned = by_key["packed_unaligned"]
    assert not unaligned.bitwise and 0 < unaligned.max_abs_diff < 1e-5 and unaligned.max_ulp >= 1
    assert "not a multiple of the kv block 128" in unaligned.why and unaligned.first_diff is not None
    assert not result.passed
    held = invariance.check("causal", q_len=300, heads=2, head_dim=32, dtype="float32", device="cpu",
                            backend="port", layouts=["run", "packed_unaligned"], hold=["run"])
    assert held.passed  # the unaligned packing was not asked to hold


def test_cli_json_and_exit_code(capsys):
    code = main(["invariance", "causal_sliding_window", "--param", "window=32", "--q-len", "160", "--heads", "2",
                 "--head-dim", "16", "--dtype", "float32", "--device", "cpu", "--batch", "2", "--json",
                 "--layouts", "run", "batch", "chunked_unaligned", "decode", "--hold", "run", "batch"])
    record = json.loads(capsys.readouterr().out)
    assert code == 0 and record["passed"] is True and record["backend"] == "flex" and record["device"] == "cpu"
    assert [l["held"] for l in record["layouts"]] == [True, True, True, False, False]
    assert {l["layout"].split(" ")[0] for l in record["layouts"]} >= {"run", "position", "chunked", "decode"}
    assert set(record["layouts"][0]) == {"key", "layout", "bitwise", "max_abs_diff", "max_ulp", "first_diff", "why",
                                         "same_attention",
                                         "held"}


@pytest.mark.parametrize("kwargs,match", [
    (dict(dtype="float64"), "cannot"),
    (dict(q_len=2), "too short"),
    (dict(backend="cudnn"), "unknown backend"),
    (dict(hold=["packing"]), "unknown layout packing"),
])
def test_bad_input_is_named(kwargs, match):
    args = dict(q_len=64, heads=1, head_dim=8, dtype="float32", device="cpu")
    args.update(kwargs)
    with pytest.raises(WorkbenchError, match=match):
        invariance.check("causal", **args)


def test_segment_relative_tiles_make_the_port_invariant_to_packing():
    # with cu_seqlens the port starts each request's tiles at its own start: packed at an
    # unaligned offset, the request's bits are the ones it gets alone
    result = invariance.check("causal", q_len=300, heads=2, head_dim=32, dtype="float32", device="cpu",
                              backend="port", layouts=["packed_aligned", "packed_unaligned"], options=invariance.InvarianceOptions(segments=True))
    assert result.passed, [(r.key, r.max_abs_diff) for r in result.layouts]
    assert all("cu_seqlens" in r.layout and "each request's start" in r.why for r in result.layouts)
    with pytest.raises(WorkbenchError, match="tiling of the generated port"):
        invariance.check("causal", q_len=64, heads=1, head_dim=8, dtype="float32", device="cpu", options=invariance.InvarianceOptions(segments=True))


def test_a_mask_compiled_flex_cannot_build_says_its_bits_are_the_uncompiled_ones():
    # what happens on a GPU when torch.compile fails for a mod (relative_bias on an H200, torch 2.11):
    # run_flex falls back to the uncompiled path, and the check must not call those the kernel's bits
    from dataclasses import dataclass

    from workbench.run import FlexBackend, run_flex

    @dataclass(frozen=True)
    class CompileFails(FlexBackend):
        def run(self, mask, inputs, **kwargs):
            done = run_flex(mask, inputs, compile=False)
            done.compile_error = "InductorError: No valid triton configs (out of resource)"
            return done

    result = invariance.check("causal", q_len=64, heads=1, head_dim=16, dtype="float32", device="cpu",
                              backend=CompileFails(), layouts=["run", "packed_unaligned"])
    assert result.note.startswith("torch.compile could not build this mask's FlexAttention (InductorError")
    assert "uncompiled path" in result.note
    plain = invariance.check("causal", q_len=64, heads=1, head_dim=16, dtype="float32", device="cpu",
                             backend=FlexBackend(compile=False), layouts=["run"])
    assert "torch.compile could not" not in (plain.note or "")
