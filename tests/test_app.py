"""The notebook app without a browser: the same calls the widgets make."""

import pytest

from workbench import Workbench
from workbench.app import CUSTOM, TABS, mask_from_cell
from workbench.define import WorkbenchError


def image_bytes(app):
    """What the interactive block map draws: its class grid."""
    grid = app.shown["Block map"]
    assert app.block_widget.classes == grid.classes.tobytes() and len(app.block_widget.classes) > 0
    return app.block_widget.classes


def test_changing_a_parameter_redraws_within_budget():
    app = Workbench("causal_sliding_window", q_len=2048)
    assert app.mask.name == "causal_sliding_window_256" and app.message.value == ""
    first = image_bytes(app)
    app.param_widgets["window"].value = 64
    assert app.mask.name == "causal_sliding_window_64"
    assert image_bytes(app) != first
    assert app.last_redraw_seconds < 2.0      # the CPU target at 4K is 2 s; this is 2K
    assert "redrawn in" in app.status.value
    assert list(app.timings) == ["build", "scan", "focus", "draw"]  # where the redraw's time went
    assert abs(sum(app.timings.values()) - app.last_redraw_seconds) < 0.05


def test_user_errors_show_and_the_app_recovers():
    app = Workbench("document", q_len=1024)
    app.param_widgets["doc_lengths"].value = "[10, 20]"
    assert app.mask is None and "doc_lengths sum to 30" in app.message.value and "Fix:" in app.message.value
    app.param_widgets["doc_lengths"].value = "[1000, 24]"
    assert app.mask is not None and app.message.value == ""


def test_lengths_block_size_and_tabs():
    app = Workbench("prefix_lm", q_len=1024)
    app.same_len.value = False  # (Lk follows Lq by default)
    app.q_len.value = 700
    app.block.value = 64
    assert (app.scan.q_len, app.scan.q_block) == (700, 64)
    app.tabs.selected_index = TABS.index("Stats")
    assert app.shown["Stats"].loc["size (Lq x Lk)", "value"] == "700 x 1,024"  # drawn when opened
    app.tabs.selected_index = TABS.index("Token zoom")
    app.zoom_q.value = 600
    assert app.shown["Token zoom"][:4] == b"\x89PNG"


def test_verify_and_export_tabs(tmp_path):
    app = Workbench("causal", q_len=512)
    app.verify_len.value = 256
    app.run_verify()
    assert app.last_verdict.passed
    app.export_dir.value = str(tmp_path)
    app.run_export()
    assert len(list(tmp_path.glob("causal_bottom_right-*.spec.json"))) == 1
    assert "flash_attn" in app.last_spec.supported
    app.run_benchmark()  # on a CPU: says it needs a GPU instead of faking numbers
    assert "need a CUDA GPU" in app.shown["Benchmark"]


def test_flexmask_cell_and_magic():
    ns = {}
    mask = mask_from_cell("band", "def mask_mod(b, h, q_idx, kv_idx):\n    return (q_idx - kv_idx).abs() < 8\n", ns)
    app = Workbench(mask, q_len=256)
    assert app.picker.value == CUSTOM and app.mask.name == "band"
    with pytest.raises(WorkbenchError, match="neither `mask_mod` nor `score_mod`"):
        mask_from_cell("empty", "x = 1\n", {})
    bad = mask_from_cell("bad", "def mask_mod(b, h, q_idx, kv_idx):\n    if q_idx > kv_idx:\n        return True\n"
                         "    return False\n", {})
    app = Workbench(bad, q_len=128)
    assert app.mask is None and "torch.where" in app.message.value

    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython()
    ip.run_line_magic("load_ext", "workbench")
    ip.run_cell_magic("flexmask", "banded --q-len 256", "def mask_mod(b, h, q_idx, kv_idx):\n"
                      "    return (q_idx - kv_idx).abs() <= 4\n")
    bench = ip.user_ns["banded_workbench"]
    assert bench.mask.name == "banded" and bench.scan.q_len == 256


def test_a_failing_action_shows_its_error(tmp_path):
    app = Workbench("causal", q_len=256)
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    app.export_dir.value = str(blocker / "specs")
    app.run_export()  # cannot create a folder under a file
    assert "cannot write to" in app.message.value and "Fix:" in app.message.value
    app.q_len.value = 300  # and the app keeps working
    assert app.mask is not None and app.message.value == ""


def test_export_tab_shows_the_port_and_verifies_it(tmp_path):
    app = Workbench("causal_sliding_window", q_len=256)
    app.export_dir.value = str(tmp_path)
    app.run_export()
    assert app.last_port is not None and app.last_port.exists() and app.message.value == ""
    app.run_port_verify()  # Triton's interpreter in a fresh process on a CPU
    assert app.last_verdict.passed and "(Triton port)" in app.shown["Port"], app.message.value


def test_clicking_a_block_opens_token_zoom_on_it():
    app = Workbench("document", q_len=2048)
    app.block_widget.clicked = {"q_block": 12, "kv_block": 9, "n": 1}  # what the canvas sends on a click
    assert TABS[app.tabs.selected_index] == "Token zoom"
    size = app.zoom_size.value
    assert app.zoom_q.value <= 12 * 128 + 64 < app.zoom_q.value + size  # the clicked block is in view
    assert app.zoom_kv.value <= 9 * 128 + 64 < app.zoom_kv.value + size
    assert "clicked" in app.zoom_why.value and app.shown["Token zoom"][:4] == b"\x89PNG"


def test_token_zoom_starts_where_the_structure_is():
    # a 15-token tree at the end of 4,096 tokens: the zoom starts on it, not at token 0, and says why
    app = Workbench("tree", q_len=4096)
    assert app.zoom_q.value >= 4096 - 256 and app.zoom_kv.value >= 4096 - 256
    assert "differs from plain causal" in app.zoom_why.value
    window = Workbench("causal_sliding_window", {"window": 512}, q_len=4096)
    assert window.mask.name == "causal_sliding_window_512"  # the params given are the ones used
    assert window.zoom_q.value > 0  # the window's lower edge, not the causal-looking corner


def test_unknown_params_are_named():
    with pytest.raises(WorkbenchError, match="has no parameter windw"):
        Workbench("causal_sliding_window", {"windw": 3})


def test_fields_show_the_masks_real_heads_and_parameters():
    app = Workbench("per_head_window", q_len=1024)
    assert app.heads.value == 8 and app.heads.disabled  # the mask is defined for 8 heads
    assert app.param_widgets["windows"].placeholder == "[32, 64, 128, 256, 512, 1024, 2048, 4096]"
    assert "8 heads differ" in app.status.value and "broadcast" not in app.status.value
    app.wait()  # drawn on a background thread
    assert app.shown["Block map (all panels)"][:4] == b"\x89PNG"  # every head, side by side
    assert app.panels_image.value[:4] == b"\x89PNG" and app.panels_image.layout.display == ""
    app.param_widgets["windows"].value = "[0, 2]"  # a window of 0: an error, shown
    assert app.mask is None and app.panels_image.layout.display == "none"  # no stale picture under it
    app.param_widgets["windows"].value = ""
    app.wait()
    assert app.panels_image.layout.display == ""
    app.picker.value = "causal"
    assert not app.heads.disabled and "same for every head" in app.status.value
    app.wait()
    assert app.panels_image.layout.display == "none"  # one panel: no grid under the map


def test_invariance_tab_checks_the_request_under_layouts():
    app = Workbench("causal_sliding_window", q_len=512)
    app.inv_len.value = 96
    app.run_invariance()
    result = app.last_invariance
    assert app.message.value == "" and result.name == "causal_sliding_window_256"
    assert {r.key for r in result.layouts} == {"run", "batch", "packed_aligned", "packed_unaligned", "padded",
                                              "chunked_aligned", "chunked_unaligned", "decode"}
    assert all(r.max_abs_diff < 1e-5 for r in result.layouts) and app.shown["Invariance"] == result.line
