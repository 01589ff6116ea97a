"""Turning a knob: a new value of a mod's closure number shares the first value's traces and
translation, and nothing stale is ever shared (a changed global, a table written in place, a
number read back into Python, an inner closure)."""

import pytest
import torch
from torch.fx.experimental import proxy_tensor
from torch.nn.attention.flex_attention import and_masks

from workbench import kernels, make
from workbench.define import (choose_evaluator, data_indices, forget_structures, index_reads, lift_scalars,
                              structure_key)

N = 4096


@pytest.fixture
def traces(monkeypatch):
    """Counts the make_fx traces made while a test runs."""
    calls = []
    real = proxy_tensor.make_fx

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(proxy_tensor, "make_fx", counting)
    forget_structures()
    yield calls
    forget_structures()


def analyse(mod):
    """What a scan asks of a mod on its way to the fused kernel."""
    choice = choose_evaluator(mod, N, N)
    kernel = kernels.scan_kernel(mod, torch.device("cpu"), N, N)
    return choice, index_reads(mod), data_indices(mod), kernel


def lifted_values(kernel) -> list[int]:
    return [int(t) for t in kernel.tables if t.dim() == 0]


@pytest.mark.parametrize("name, param", [("chunked_local", "chunk"), ("causal_sliding_window", "window"),
                                         ("prefix_lm", "prefix_len"), ("sliding_window", "left")])
def test_new_value_of_a_knob_traces_nothing_and_shares_the_kernel(traces, name, param):
    first = analyse(make(name, {param: 100}, q_len=N, kv_len=N).mask_mod)
    assert traces, "the first value is traced"
    for value in (200, 333, 1000):
        before = len(traces)
        choice, reads, indices, kernel = analyse(make(name, {param: value}, q_len=N, kv_len=N).mask_mod)
        assert len(traces) == before, f"{name} {param}={value} traced again"
        assert kernel.source == first[3].source
        assert value in lifted_values(kernel) and 100 not in lifted_values(kernel)
        assert (choice, reads, indices) == first[:3]
    # and what was shared is what a fresh analysis of the last value finds
    forget_structures()
    fresh = analyse(make(name, {param: 1000}, q_len=N, kv_len=N).mask_mod)
    assert fresh[:3] == first[:3] and fresh[3].source == first[3].source


from user_mods import generate_dilated, lengths_window, spans_or_window  # noqa: E402


@pytest.mark.parametrize("factory", [lengths_window, spans_or_window, generate_dilated])
def test_users_knobs_share_what_a_fresh_analysis_finds(traces, factory):
    first = analyse(factory(7))
    for value in (3, 64):
        before = len(traces)
        got = analyse(factory(value))
        assert len(traces) == before, f"{factory.__name__}({value}) traced again"
        assert got[:3] == first[:3] and got[3].source == first[3].source
        assert value in lifted_values(got[3])
        forget_structures()
        fresh = analyse(factory(value))
        assert fresh[:3] == got[:3] and fresh[3].source == got[3].source
        analyse(factory(7))  # the structure known again for the next value
    expected_how = "vmap" if factory is spans_or_window else "broadcast"
    assert first[0].how == expected_how
    if factory is lengths_window:
        assert "b" in first[1] and "b" in first[2]  # the mask reads and indexes with b


def window_factory(window):
    def window_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)
    return window_mask


def test_a_changed_global_is_a_new_structure():
    namespace = {"WINDOW": 64}
    exec("def global_window(b, h, q_idx, kv_idx):\n    return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)\n",
         namespace)
    mod = namespace["global_window"]
    key = structure_key(mod)
    namespace["WINDOW"] = 128
    assert structure_key(mod) != key
    namespace["WINDOW"] = 64
    assert structure_key(mod) == key


def test_a_table_written_in_place_is_a_new_structure():
    table = torch.tensor([3, 5, 9])

    def factory(w):
        def per_head(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx < table[h] + w) & (q_idx >= kv_idx)
        return per_head

    key = structure_key(factory(1))
    assert structure_key(factory(2)) == key  # the knob's number does not count
    table[1] = -4
    assert structure_key(factory(2)) != key


def test_a_list_changed_in_place_is_a_new_structure():
    starts = [10, 20]

    def factory(w):
        def spans(b, h, q_idx, kv_idx):
            keep = q_idx - kv_idx < w
            for s in starts:
                keep = keep | (kv_idx == s)
            return keep
        return spans

    key = structure_key(factory(1))
    assert structure_key(factory(2)) == key
    starts.append(30)
    assert structure_key(factory(2)) != key


def test_numbers_read_back_into_python_are_not_lifted(traces):
    def as_int(w):
        def int_window(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < int(w))
        return int_window

    def branching(w):
        def branch_window(b, h, q_idx, kv_idx):
            if w > 100:
                return q_idx >= kv_idx
            return (q_idx >= kv_idx) & (q_idx - kv_idx < w)
        return branch_window

    for factory in (as_int, branching):
        assert lift_scalars(factory(64), torch.device("cpu"), N, N) == (None, {})
        # each value is translated with its own number written in
        first = kernels.scan_kernel(factory(64), torch.device("cpu"), N, N)
        second = kernels.scan_kernel(factory(200), torch.device("cpu"), N, N)
        assert first.source != second.source


def test_inner_closures_of_combined_masks_are_not_shared(traces):
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    first = kernels.scan_kernel(and_masks(causal, window_factory(64)), torch.device("cpu"), N, N)
    second = kernels.scan_kernel(and_masks(causal, window_factory(200)), torch.device("cpu"), N, N)
    # the window lives in an inner closure, which is not lifted: written into each source
    assert first.source != second.source


def test_probe_grid_still_finds_eager_vs_traced_differences():
    def python_and(b, h, q_idx, kv_idx):  # `and` on tensors: the direct call is not the traced one
        return q_idx >= kv_idx if q_idx.numel() > 1 else (q_idx >= kv_idx) & (kv_idx > 0)

    choice = choose_evaluator(python_and, 300, 300)
    assert choice.how == "vmap"
    q_range, kv_range = choice.differs_at
    assert kv_range[0] == 0 and q_range[1] - q_range[0] == 48
