"""The notebook app without a browser: the same calls the widgets make."""

import pytest

from workbench import Workbench
from workbench.app import CUSTOM, TABS, mask_from_cell
from workbench.define import WorkbenchError


def image_bytes(app):
    png = app.shown["Block map"]
    assert png[:4] == b"\x89PNG"
    return png


def test_changing_a_parameter_redraws_within_budget():
    app = Workbench("causal_sliding_window", q_len=2048)
    assert app.mask.name == "causal_sliding_window_256" and app.message.value == ""
    first = image_bytes(app)
    app.param_widgets["window"].value = 64
    assert app.mask.name == "causal_sliding_window_64"
    assert image_bytes(app) != first
    assert app.last_redraw_seconds < 2.0      # the CPU target at 4K is 2 s; this is 2K
    assert "redrawn in" in app.status.value


def test_user_errors_show_and_the_app_recovers():
    app = Workbench("document", q_len=1024)
    app.param_widgets["doc_lengths"].value = "[10, 20]"
    assert app.mask is None and "doc_lengths sum to 30" in app.message.value and "Fix:" in app.message.value
    app.param_widgets["doc_lengths"].value = "[1000, 24]"
    assert app.mask is not None and app.message.value == ""


def test_lengths_block_size_and_tabs():
    app = Workbench("prefix_lm", q_len=1024)
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
    assert (tmp_path / "causal_bottom_right.spec.json").exists()
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
