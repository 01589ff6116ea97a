"""A port is valid at exactly the lengths it claims: generated at one (Lq, Lk), called at random
others (Lq < Lk, Lq > Lk, Lq = 1), it equals the factory rebuilt there (float64 reference) or refuses
with a clear error. The calls run under Triton's interpreter in one fresh process
(tests/run_port_lengths.py); each case is judged here on its own."""

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from run_port_lengths import CASE_NAMES  # noqa: E402


@pytest.fixture(scope="module")
def calls(early_run):
    done = early_run("port_lengths")  # tests/run_port_lengths.py cpu 7, started at collection (conftest)
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert records, done.stdout[-3000:] + done.stderr[-3000:]
    return records


@pytest.mark.slow
@pytest.mark.parametrize("case", CASE_NAMES)
def test_port_equals_the_rebuilt_factory_or_refuses(calls, case):
    mine = [r for r in calls if r["case"] == case]
    assert len(mine) >= 8, f"{case}: only {len(mine)} calls ran"
    wrong = [r for r in mine if r["outcome"] == "wrong"]
    assert not wrong, json.dumps(wrong, indent=1)
    # what a user reads: a refusal names the lengths and the cause
    for r in mine:
        if r["outcome"] == "refused":
            assert f"Lq = {r['q_len']}" in r["detail"] or f"Lk = {r['kv_len']}" in r["detail"], r


def _outcome(calls, case, q_len, kv_len):
    return next(r for r in calls if r["case"] == case and (r["q_len"], r["kv_len"]) == (q_len, kv_len))


@pytest.mark.slow
def test_bottom_right_masks_follow_the_call_lengths(calls):
    """The issue's reproduction: causal, causal_sliding_window and sinks_window generated at 128 x 128
    and called at 64 x 200 compute the bottom-right mask (they computed top-left before)."""
    for case in ("causal", "causal_sliding_window", "sinks_window", "causal@64x200", "users_offset_and"):
        record = _outcome(calls, case, 64, 200)
        assert record["outcome"] == "equal", record
        assert "Lk - Lq computed per call" in record["valid_for"], record
    assert _outcome(calls, "causal", 200, 64)["outcome"] == "equal"  # causal's factory accepts Lq > Lk
    refused = _outcome(calls, "causal_sliding_window", 200, 64)
    assert refused["outcome"] == "refused" and "Lq > Lk" in refused["detail"], refused
    assert _outcome(calls, "causal@64x200", 128, 128)["outcome"] == "equal"
    assert _outcome(calls, "users_prefix_fraction", 1, 200)["outcome"] == "equal"
    assert _outcome(calls, "users_fixed_table", 64, 200)["outcome"] == "refused"


def test_tables_read_inside_their_bounds_bind_the_port_to_no_length():
    # A table read at an index that stays inside it at every position (a relative table at a
    # clamped distance, at a remainder) holds at any length: the port follows the call's lengths
    # (checked against the rebuilt factory by the script above: causal+users_relative_table,
    # relative_bias@64x200). An index that can leave the table (a clamp one past its end, no lower
    # bound, a position itself) keeps the port at the lengths it was made for.
    import torch

    from run_port_lengths import users_relative_table
    from workbench import Mask, make, port, with_score
    from workbench.define import data_indices

    rel = torch.randn(4, 16)
    doc = (torch.arange(256) // 50).to(torch.int32)
    w = torch.tensor([3, 40, 100, 7])
    ok = {"clamped": lambda s, b, h, q, kv: s + rel[h, (q - kv).clamp(0, 15)],
          "shifted": lambda s, b, h, q, kv: s + rel[h, (q - kv).clamp(-8, 7) + 8],
          "remainder": lambda s, b, h, q, kv: s + rel[h, (kv - q) % 16],
          "floor_div": lambda s, b, h, q, kv: s + rel[h, ((q - kv).abs() // 64).clamp(max=15)]}
    tied = {"past_the_end": lambda s, b, h, q, kv: s + rel[h, (q - kv).clamp(0, 16)],
            "no_lower_bound": lambda s, b, h, q, kv: s + rel[h, (q - kv).clamp(max=15)],
            "position": lambda s, b, h, q, kv: s + doc[kv].float()}
    for name, mod in ok.items():
        assert data_indices(mod, "score") == {"h"}, name
    for name, mod in tied.items():
        assert {"q_idx", "kv_idx"} & data_indices(mod, "score"), name
    assert data_indices(lambda b, h, q, kv: (kv <= q) & (q - kv < w[h])) == {"h"}
    assert data_indices(lambda b, h, q, kv: doc[q] == doc[kv]) == {"q_idx", "kv_idx"}
    causal = make("causal")
    for name, mod in ok.items():
        made = port.generate(with_score(causal, Mask(name, score_mod=mod)), 256, 256, heads=4)
        assert made.valid_q_len is None and made.valid_kv_len is None, name
        assert made.valid_for().startswith("any Lq, Lk"), (name, made.valid_for())
    for name, mod in tied.items():
        made = port.generate(with_score(causal, Mask(name, score_mod=mod)), 256, 256, heads=4)
        assert (made.valid_q_len, made.valid_kv_len) == (256, 256), name
    made = port.generate(with_score(causal, make(users_relative_table, q_len=128, kv_len=128)), 128, 128, heads=2)
    assert made.valid_q_len is None
    made = port.generate(with_score(make("causal", q_len=64, kv_len=200),
                                    make("relative_bias", q_len=64, kv_len=200)), 64, 200)
    assert made.valid_q_len is None and "Lk - Lq computed per call" in made.valid_for(), made.valid_for()
