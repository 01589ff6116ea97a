"""The notebook and the report, round three: your own mask gets the same care as the library's.
Each test reproduces a reported case (`%%flexmask` mods, the app's fields) and fails on the code
before the fix."""

import json

import torch

from workbench import Mask, invariance
from workbench.app import Workbench, mask_from_cell
from workbench.export import build_spec, write_spec

HEAD_WINDOW = """
import torch
w = torch.tensor([16, 64, 128, 256])
def mask_mod(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < w[h])
"""


def test_your_per_head_mask_opens_with_its_heads_and_exports(tmp_path):
    """%%flexmask head_window with w[h]: the app opens it with 4 heads, says the heads differ, and
    Export writes a per-head spec (it said "no heads count was given")."""
    app = Workbench(mask_from_cell("head_window", HEAD_WINDOW, {}), q_len=1024)
    assert app.heads.value == 4 and app.heads.disabled
    assert "4 heads differ" in app.status.value and "same for every head" not in app.status.value
    app.export_dir.value = str(tmp_path)
    app.run_export()
    assert app.last_spec.doc["shape"]["H"] == 4 and app.last_spec.doc["pattern"]["kind"] == "per_head"


def test_a_mod_that_reads_h_is_never_called_the_same_for_every_head():
    """h % 4 reads h but implies no count: one head is shown, and the status says so."""
    cell = "def mask_mod(b, h, q_idx, kv_idx):\n    return q_idx + h % 4 >= kv_idx\n"
    app = Workbench(mask_from_cell("mod_heads", cell, {}), q_len=256)
    assert app.heads.value == 1 and "same for every head" not in app.status.value
    assert "reads h: 1 head shown, set heads to see more" in app.status.value
    app.heads.value = 4
    assert "4 heads differ" in app.status.value


def test_a_per_sample_table_opens_with_its_batch_entries():
    cell = "import torch\nlens = torch.tensor([100, 200, 300])\ndef mask_mod(b, h, q_idx, kv_idx):\n    return kv_idx < lens[b]\n"
    app = Workbench(mask_from_cell("lengths", cell, {}), q_len=512)
    assert app.batch.value == 3 and app.batch.disabled and "3 batch entries differ" in app.status.value


def _spans_mask(spans):
    starts, ends = torch.tensor([s for s, _ in spans]), torch.tensor([e for _, e in spans])

    def gemma_images(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) | (((q_idx >= starts) & (q_idx <= ends) & (kv_idx >= starts) & (kv_idx <= ends)).any())

    return Mask("gemma_images", mask_mod=gemma_images)


def test_spec_files_of_different_masks_never_share_a_name(tmp_path):
    """Two span masks of one name and lengths but other spans wrote one file; now each has its own,
    and the same mask exported twice still has one."""
    a = write_spec(build_spec(_spans_mask([(10, 40)]), 256, 256, golden=False), tmp_path)[0]
    b = write_spec(build_spec(_spans_mask([(100, 140)]), 256, 256, golden=False), tmp_path)[0]
    again = write_spec(build_spec(_spans_mask([(10, 40)]), 256, 256, golden=False), tmp_path)[0]
    assert a != b and a == again
    assert json.loads(a.read_text())["backends"] != json.loads(b.read_text())["backends"]


def test_a_layout_that_computes_another_attention_is_said_so():
    """Bidirectional spans cut by a chunk boundary: chunked prefill and decode see only the keys so
    far, so they compute another attention -- the why says that, not tiling or split-KV, and the
    verdict does not count them as tiling differences."""
    result = invariance.check("image_spans", {"spans": [[100, 160], [230, 255]]}, q_len=256, heads=1, head_dim=16,
                              dtype="float32", device="cpu", layouts=["run", "chunked_aligned", "decode"])
    by_key = {r.key: r for r in result.layouts}
    for key in ("chunked_aligned", "decode"):
        r = by_key[key]
        assert not r.same_attention and not r.bitwise and "does not compute the same attention" in r.why
        assert "split" not in r.why and "tiling" in r.why  # ("the difference is the mask, not tiling")
    assert by_key["run"].same_attention and result.passed
    assert "not the same attention (the mask keeps later keys): chunked_aligned, decode" in result.line
    causal = invariance.check("causal", q_len=256, heads=1, head_dim=16, dtype="float32", device="cpu",
                              layouts=["run", "chunked_aligned"])
    assert all(r.same_attention for r in causal.layouts)


def test_last_bit_differences_do_not_print_as_zero(capsys):
    from workbench.cli import main

    main(["invariance", "causal", "--q-len", "256", "--heads", "1", "--head-dim", "16", "--dtype", "float32",
          "--device", "cpu", "--layouts", "run", "decode"])
    out = capsys.readouterr().out
    decode = next(line for line in out.splitlines() if line.startswith("decode"))
    assert "False" in decode and "0.000000" not in decode and "e-0" in decode, decode


def test_results_belong_to_their_mask_and_settings():
    """Verify's PASS does not stay on screen for another mask; an error leaves no picture or status of
    the previous state; the Export banner goes with the next action; Verify port keeps the spec."""
    from workbench.app import TABS

    app = Workbench("causal", q_len=512)
    app.verify_len.value = 128
    app.run_verify()
    assert app.last_verdict.passed
    app.picker.value = "sliding_window"
    assert app.last_verdict is None and app.outputs["Verify"].outputs == ()
    app.same_len.value = False
    app.q_len.value = 4096  # above Lk: the library refuses it
    assert app.mask is None and "no mask at these settings" in app.status.value
    assert app.block_widget.rows == 0 and app.block_widget.classes == b""
    assert "tick Lk = Lq" in app.message.value
    app.same_len.value = True  # Lk follows Lq again
    assert app.kv_len.value == 4096 and app.mask is not None and app.message.value == ""
    assert "Port" in app.outputs and app.outputs["Port"] is not app.outputs["Export"]
    assert app.settings_text().startswith("sliding_window_l128_r128 (") and "Lq 4,096 x Lk 4,096" in app.settings_text()
    app.tabs.selected_index = TABS.index("Verify")


def test_lk_follows_lq_until_set_on_its_own():
    app = Workbench("causal", q_len=256)
    app.q_len.value = 1024
    assert app.kv_len.value == 1024
    app.kv_len.value = 2048  # set on purpose: the toggle turns off
    assert not app.same_len.value
    app.q_len.value = 512
    assert app.kv_len.value == 2048 and app.scan.q_len == 512 and app.scan.kv_len == 2048


def test_token_zoom_size_comes_back_after_a_close_view():
    from workbench.app import TABS

    app = Workbench("tree", q_len=1024)
    app.tabs.selected_index = TABS.index("Token zoom")
    assert app.zoom_size.value == 64  # the tree's few tokens: a closer view
    app.picker.value = "causal_sliding_window"
    assert app.zoom_size.value == 256  # the size the user had, not the last close view


def test_token_zoom_shows_where_an_image_span_starts():
    """image_spans at 16K: the view used to centre on the block (1568..1631) and miss the span's first
    token (1638)."""
    app = Workbench("image_spans", q_len=16384)
    start = app.mask.params["spans"][0][0]
    assert app.focus.q_range[0] <= start < app.focus.q_range[1]
    assert app.focus.kv_range[0] <= start < app.focus.kv_range[1]


def test_spec_views_summarise_and_show_source_as_code():
    from workbench import make

    spec = build_spec(make("document"), 1024, 1024, golden=False)
    frame = spec.backends_frame()
    assert frame["arguments"].str.len().max() < 2000  # was 15,426 characters of row intervals
    assert "1,024 entries in all" in frame.loc["row_intervals", "arguments"]
    assert "lines of source" in frame.loc["triton", "arguments"] and "\\n" not in frame.loc["triton", "arguments"]
    assert spec.source("triton").startswith("import triton\n") and "def mask_mod_triton" in spec.source("triton")


def test_uncompiled_flex_says_its_differences_are_expected():
    # which layouts differ in the last bits depends on the CPU's matmul kernels (packed on one
    # machine, decode on another): every one that differs must say why, and none "unexpected"
    result = invariance.check("causal", q_len=200, heads=1, head_dim=16, dtype="float32", device="cpu",
                              layouts=["run", "packed_aligned", "decode"])
    differing = [r for r in result.layouts if not r.bitwise]
    assert differing, result.line  # uncompiled FlexAttention differs somewhere among these
    assert all(r.why.startswith("expected for uncompiled FlexAttention") for r in differing), \
        [(r.key, r.why) for r in differing]
    assert "(unexpected)" not in result.line and "expected there" in result.line
