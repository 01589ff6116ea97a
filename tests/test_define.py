"""Masks as values, targets, parameters, and the errors a user gets for bad input."""

import pytest
import torch

from workbench import Mask, WorkbenchError, make, parse_params, probe, with_score
from workbench.blocks import scan_blocks


def test_parse_params_json_else_string():
    assert parse_params(["width=64", "name=abc", "spans=[[0, 9]]", "flag=true", "x=1.5"]) == \
        {"width": 64, "name": "abc", "spans": [[0, 9]], "flag": True, "x": 1.5}
    with pytest.raises(WorkbenchError, match="key=value"):
        parse_params(["oops"])


def test_mask_value_has_source_and_params():
    mask = make("sliding_window", {"left": 3, "right": 4})
    assert mask.name == "sliding_window_l3_r4"
    assert mask.params == {"left": 3, "right": 4}
    assert "def sliding_window_mask(b, h, q_idx, kv_idx)" in mask.source
    assert mask.summary.startswith("Sliding window")


def test_user_file_target(tmp_path):
    f = tmp_path / "my_masks.py"
    f.write_text("def banded(width=8):\n    def banded_mask(b, h, q_idx, kv_idx):\n"
                 "        return (q_idx - kv_idx).abs() <= width\n    return banded_mask\n")
    mask = make(f"{f}:banded", {"width": 2})
    assert mask.name == "banded" and mask.params == {"width": 2} and mask.mask_mod is not None
    assert scan_blocks(mask, 10, 10, block_size=2).kept_pairs == 10 + 2 * 9 + 2 * 8


@pytest.mark.parametrize("text,target,match", [
    ("import nonexistent_module_xyz\n", "f", "importing .* failed: ModuleNotFoundError"),
    ("def f():\n    raise RuntimeError('boom')\n", "f", "factory raised RuntimeError: boom"),
    ("def f():\n    return 3\n", "f", "factory returned int"),
    ("def g():\n    pass\n", "f", "has no function 'f'.*use one of: g"),
    ("def f():\n    def m(b, h, q):\n        return q > 0\n    return m\n", "f", "takes 3 positional arguments"),
])
def test_bad_user_files_name_cause_and_fix(tmp_path, text, target, match):
    f = tmp_path / "user.py"
    f.write_text(text)
    with pytest.raises(WorkbenchError, match=match) as err:
        make(f"{f}:{target}")
    assert "Fix:" in str(err.value)


def test_unknown_param_lists_known_ones():
    with pytest.raises(WorkbenchError, match="unknown parameter 'widht'.*takes: window"):
        make("causal_sliding_window", {"widht": 3})


def test_missing_file_and_unknown_library_name():
    with pytest.raises(WorkbenchError, match="does not exist"):
        make("nope/missing.py:f")
    with pytest.raises(WorkbenchError, match="no library mask named 'causall'"):
        make("causall")


def test_wrong_arity_in_mask_value():
    with pytest.raises(WorkbenchError, match="score_mod 'sm' takes 4 positional arguments.*5"):
        def sm(score, b, h, q):
            return score
        Mask(name="x", score_mod=sm)


def _mask(fn):
    return Mask(name="user", mask_mod=fn)


def test_python_if_on_tensor_is_explained():
    def branchy(b, h, q_idx, kv_idx):
        if q_idx >= kv_idx:
            return q_idx >= 0
        return q_idx < 0

    with pytest.raises(WorkbenchError, match="Python `if`.*Fix: .*torch.where"):
        probe(_mask(branchy))
    with pytest.raises(WorkbenchError, match="torch.where"):
        scan_blocks(_mask(branchy), 64, 64)


def test_item_is_explained():
    def itemy(b, h, q_idx, kv_idx):
        return torch.tensor(q_idx.item() >= kv_idx.item())

    with pytest.raises(WorkbenchError, match=r"\.item\(\)"):
        probe(_mask(itemy))


def test_non_bool_return_is_explained():
    def inty(b, h, q_idx, kv_idx):
        return q_idx - kv_idx

    with pytest.raises(WorkbenchError, match="returned torch.int32.*bool"):
        probe(_mask(inty))
    with pytest.raises(WorkbenchError, match="bool"):
        scan_blocks(_mask(inty), 64, 64)


def test_out_of_range_table_is_reported():
    table = torch.zeros(10, dtype=torch.bool)

    def short_table(b, h, q_idx, kv_idx):
        return table[q_idx] | (kv_idx <= q_idx)

    with pytest.raises(WorkbenchError, match=r"captured tensor 'table' \(10 entries\) at index 10.*too short"):
        scan_blocks(_mask(short_table), 64, 64)


def test_document_lengths_that_do_not_cover_the_sequence():
    with pytest.raises(WorkbenchError, match="sum to 30 but the sequence has 100 tokens"):
        make("document", {"doc_lengths": [10, 20]}, q_len=100, kv_len=100)


def test_with_score_combines_and_rejects_non_scores():
    combined = with_score(make("causal"), make("softcap", {"cap": 10}))
    assert combined.mask_mod is not None and combined.score_mod is not None
    assert combined.name == "causal_bottom_right+softcap_10"
    with pytest.raises(WorkbenchError, match="has no score_mod"):
        with_score(make("causal"), make("full"))


def test_a_span_table_off_the_cpu_is_traced_on_its_own_device():
    # a user's Gemma-style span mask with its table on an accelerator: `q_idx[..., None]` is a
    # 1-element tensor, which must share the table's device, so the mod is traced on that device
    # (here "meta" stands in for a GPU); tracing on the CPU failed with "Expected all tensors to
    # be on the same device"
    from workbench.define.trace import trace_mod

    spans = torch.tensor([[100, 300], [600, 700]], device="meta")

    def image_spans(b, h, q_idx, kv_idx):
        inside = ((q_idx[..., None] >= spans[:, 0]) & (q_idx[..., None] < spans[:, 1])
                  & (kv_idx[..., None] >= spans[:, 0]) & (kv_idx[..., None] < spans[:, 1]))
        return (kv_idx <= q_idx) | inside.any(-1)

    graph = trace_mod(image_spans, "mask")
    ops = {str(n.target) for n in graph.graph.nodes if n.op == "call_function"}
    assert any("any" in op for op in ops) and any("le" in op for op in ops), ops
    cpu_spans = torch.tensor([[100, 300], [600, 700]])

    def image_spans_cpu(b, h, q_idx, kv_idx):
        inside = ((q_idx[..., None] >= cpu_spans[:, 0]) & (q_idx[..., None] < cpu_spans[:, 1])
                  & (kv_idx[..., None] >= cpu_spans[:, 0]) & (kv_idx[..., None] < cpu_spans[:, 1]))
        return (kv_idx <= q_idx) | inside.any(-1)

    assert {str(n.target) for n in trace_mod(image_spans_cpu, "mask").graph.nodes if n.op == "call_function"} == ops
