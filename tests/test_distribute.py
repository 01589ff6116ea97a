"""The reference split by query rows across Ray workers (2 CPUs here; GPUs on a GPU machine)
equals the reference computed in one piece, and still fails a wrong block mask."""

import json

import pytest
import torch

from workbench.cli import main
from workbench.define import prepare
from workbench.verify.distribute import reference_on_ray, row_ranges
from workbench.run import Shape, make_inputs
from workbench.verify import reference_attention, verify
from workbench.verify import ReferenceOptions

USER_FILE = '''import torch

def windows_and_lengths(q_len=None, kv_len=None):
    widths = torch.tensor([5, 40])   # per head, undeclared
    lens = torch.tensor([0, 90])     # per batch entry: entry 0 keeps nothing

    def user_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + 34) & (q_idx + 34 - kv_idx < widths[h]) & (kv_idx < lens[b])
    return user_mask
'''


def test_row_ranges_cover_every_row_once():
    for q_len, pieces in [(1, 8), (97, 8), (1000, 3)]:
        ranges = row_ranges(q_len, pieces)
        assert ranges[0][0] == 0 and ranges[-1][1] == q_len
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])) and len(ranges) == min(q_len, pieces)


def test_two_workers_give_the_one_piece_reference_with_gradients(tmp_path):
    path = tmp_path / "user_masks.py"
    path.write_text(USER_FILE)  # a user's file: its mods travel to the workers by value
    mask = prepare(f"{path}:windows_and_lengths", None, 97, 131, "cpu", heads=2, batch=2)
    shape = Shape(batch=2, q_heads=2, q_len=97, kv_len=131, head_dim=8)
    inputs = make_inputs(shape, "float32", seed=1, backward=True)
    one = reference_attention(mask, inputs, backward=True)
    split = reference_on_ray(mask, inputs, 2, backward=True, progress=False)
    torch.testing.assert_close(split.out, one.out, rtol=1e-12, atol=1e-13)
    assert torch.equal(torch.isneginf(split.lse), torch.isneginf(one.lse))
    for name in ("dq", "dk", "dv"):
        torch.testing.assert_close(split.grads[name], one.grads[name], rtol=1e-11, atol=1e-12)
    assert split.fully_masked_rows == one.fully_masked_rows >= 97 * 2
    assert 0 < split.computed_fraction < 1


@pytest.mark.slow  # (a minute or more here; make test-slow, which CI runs)
def test_verify_with_workers_passes_and_still_fails_a_dropped_block(capsys):
    from helpers import drop_one_full_block
    from workbench import make
    from workbench.blocks import build_block_mask

    assert main(["verify", "causal_sliding_window", "--param", "window=150", "--q-len", "700", "--heads", "2",
                 "--head-dim", "16", "--dtype", "float32", "--device", "cpu", "--eager", "--workers", "2",
                 "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["passed"] and record["q_len"] == 700 and record["reference_fraction"] < 1
    mask = make("causal_sliding_window", {"window": 150})
    broken = drop_one_full_block(build_block_mask(mask, 1024, 1024, block_size=64), 10, 1024, 1024)
    verdict = verify(mask, Shape(q_heads=2, q_len=1024, head_dim=16), dtype="float32", block_mask=broken,
                     seed=0, backend="eager", reference=ReferenceOptions(workers=2))
    assert not verdict.passed


@pytest.mark.slow  # (Ray's start dominates: make test-slow, which CI runs; the default suite keeps the two-worker check above)
def test_rows_compared_on_workers_merge_to_the_one_piece_check(tmp_path):
    """Forward verification with workers: each worker compares its rows and sends statistics back;
    merged, they equal the check of the whole output against the whole reference."""
    from workbench.verify.distribute import compare_on_ray
    from workbench.verify import LSE_TOLERANCE, TOLERANCES, compare

    path = tmp_path / "user_masks.py"
    path.write_text(USER_FILE)
    mask = prepare(f"{path}:windows_and_lengths", None, 97, 131, "cpu", heads=2, batch=2)
    shape = Shape(batch=2, q_heads=2, q_len=97, kv_len=131, head_dim=8)
    inputs = make_inputs(shape, "float32", seed=1)
    one = reference_attention(mask, inputs)
    got = one.out.float() + 1e-6 * torch.randn(one.out.shape, generator=torch.Generator().manual_seed(0))
    got[1, 0, 60, 3] += 0.5  # one wrong element, far from row 0: its position must come back right
    lse = one.lse.float()
    checks, ref = compare_on_ray(mask, inputs, got, lse, 2, TOLERANCES["float32"], LSE_TOLERANCE["float32"],
                                 progress=False)
    whole = [compare("out", got, one.out, TOLERANCES["float32"]), compare("lse", lse, one.lse, LSE_TOLERANCE["float32"])]
    for split, full in zip(checks, whole):
        assert split.name == full.name and split.passed == full.passed
        assert split.worst == full.worst and split.bad_count == full.bad_count and split.numel == full.numel
        assert abs(split.rel_err - full.rel_err) <= 1e-12 * max(1.0, full.rel_err)
        assert split.max_abs_err == full.max_abs_err
    assert not checks[0].passed and checks[0].worst == {"b": 1, "h": 0, "q": 60, "d": 3}
    assert checks[1].passed
    assert ref.out is None and ref.fully_masked_rows == one.fully_masked_rows >= 97 * 2


def test_a_worker_count_below_one_is_refused():
    import pytest

    from workbench import make
    from workbench.define import WorkbenchError
    from workbench.verify.distribute import compare_on_ray
    from workbench.verify import LSE_TOLERANCE, TOLERANCES

    mask, shape = make("causal"), Shape(q_len=64, head_dim=8)
    with pytest.raises(WorkbenchError, match="workers = 0 must be a whole number of at least 1.*Fix: pass workers >= 1"):
        verify(mask, shape, dtype="float32", backend="eager", reference=ReferenceOptions(workers=0))  # not silently computed here
    inputs = make_inputs(shape, "float32", seed=0)
    with pytest.raises(WorkbenchError, match="workers = -1 must be at least 1"):
        compare_on_ray(mask, inputs, inputs.q, None, -1, TOLERANCES["float32"], LSE_TOLERANCE["float32"])


@pytest.mark.slow  # (Ray's start dominates: make test-slow, which CI runs; the default suite keeps the two-worker check above)
def test_actors_draw_inputs_from_the_seed_and_stay_in_a_ray_session():
    """In a Ray session the caller started, verify's actors stay for the next verification and
    draw each one's inputs from its seed (nothing sent); a wrong kernel still fails on them."""
    import ray

    from helpers import drop_one_full_block
    from workbench import make
    from workbench.verify import distribute
    from workbench.blocks import build_block_mask

    mask = make("causal_sliding_window", {"window": 150})
    shape = Shape(q_heads=2, q_len=700, head_dim=16)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        first = verify(mask, shape, dtype="float32", seed=0, progress=False, backend="eager", reference=ReferenceOptions(workers=2))
        pool = distribute._kept[(2, False, None)]
        actors = [a._actor_id for a in pool.actors]
        broken = drop_one_full_block(build_block_mask(mask, 1024, 1024, block_size=64), 10, 1024, 1024)
        second = verify(mask, Shape(q_heads=2, q_len=1024, head_dim=16), dtype="float32", seed=1,
                        block_mask=broken, progress=False, backend="eager", reference=ReferenceOptions(workers=2))
        again = distribute._kept[(2, False, None)]
        assert first.passed and not second.passed
        # every range was computed once, on some actor, and each says where its time went
        from workbench.verify.distribute import RANGES_PER_WORKER

        assert sum(w["ranges"] for w in second.reference_workers) == 2 * RANGES_PER_WORKER
        assert all(w["rows_s"] > 0 and w["device"] == "cpu" for w in second.reference_workers)
        assert again is pool and again.reused and again.sent_inputs == 0
        assert [a._actor_id for a in again.actors] == actors
    finally:
        ray.shutdown()
        distribute._kept.clear()


@pytest.mark.slow  # (Ray's start dominates: make test-slow, which CI runs; the default suite keeps the two-worker check above)
def test_inputs_that_the_seed_does_not_give_are_sent(tmp_path):
    """Inputs whose bits the actors cannot draw from the seed (a caller's own tensors) are sent
    through Ray's object store, and the split check still equals the one-piece one."""
    from workbench.verify.distribute import compare_on_ray, start_rows_workers
    from workbench.verify import LSE_TOLERANCE, TOLERANCES

    path = tmp_path / "user_masks.py"
    path.write_text(USER_FILE)
    mask = prepare(f"{path}:windows_and_lengths", None, 97, 131, "cpu", heads=2, batch=2)
    shape = Shape(batch=2, q_heads=2, q_len=97, kv_len=131, head_dim=8)
    inputs = make_inputs(shape, "float32", seed=1)
    inputs.q.mul_(1.5)  # no longer what seed 1 draws
    one = reference_attention(mask, inputs)
    pool = start_rows_workers(mask, inputs, 2)
    checks, _ = compare_on_ray(mask, inputs, one.out.float(), one.lse.float(), 2, TOLERANCES["float32"],
                               LSE_TOLERANCE["float32"], progress=False, pool=pool)
    assert pool.sent_inputs == 2 and not pool.reused
    # the float32 rounding of out only (inputs drawn from the seed instead would be off by O(1))
    assert all(c.passed for c in checks) and checks[0].max_abs_err < 1e-6


@pytest.mark.slow  # (Ray's start dominates: make test-slow, which CI runs; the default suite keeps the two-worker check above)
def test_more_workers_than_the_ray_session_can_place_is_refused_not_a_hang():
    """A Ray session with one CPU cannot place two workers: Ray would wait for ever; the workbench
    says so at once, naming the cause and the fix."""
    import time

    import pytest
    import ray

    from workbench import make
    from workbench.define import WorkbenchError

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        t0 = time.perf_counter()
        with pytest.raises(WorkbenchError, match=r"2 workers need one CPU each; the Ray cluster has 1.*workers <= 1"):
            verify(make("causal"), Shape(q_len=64, head_dim=8), dtype="float32", backend="eager", reference=ReferenceOptions(workers=2))
        assert time.perf_counter() - t0 < 30
    finally:
        ray.shutdown()


def test_ranges_sharing_a_reference_state_equal_ranges_without():
    """Row ranges computed with one ReferenceState (k, v and the mask's evaluator prepared once, as
    a worker does) give the same bits as the same ranges computed afresh; other inputs or another
    mask do not pick up the shared parts."""
    from workbench import make
    from workbench.verify import ReferenceState

    mask = make("causal_sliding_window", {"window": 40})
    shape = Shape(q_heads=2, q_len=300, kv_len=300, head_dim=16)
    inputs = make_inputs(shape, "float32", seed=3)
    ranges = ((200, 300), (0, 70), (70, 200))
    state = ReferenceState()
    for r in ranges:
        shared = reference_attention(mask, inputs, rows=r, state=state)
        assert torch.equal(shared.out, reference_attention(mask, inputs, rows=r).out)
        assert torch.equal(shared.lse, reference_attention(mask, inputs, rows=r).lse)
    assert state.parts["inputs"] is inputs
    other = make_inputs(shape, "float32", seed=4)
    again = reference_attention(mask, other, rows=(0, 300), state=state)
    assert torch.equal(again.out, reference_attention(mask, other).out) and state.parts["inputs"] is other
    causal = make("causal")
    assert torch.equal(reference_attention(causal, inputs, state=state).out, reference_attention(causal, inputs).out)
