"""Every notebook runs top to bottom (nbclient, the venv's kernel, CPU sizes)."""

from pathlib import Path

import pytest

# dev dependencies (installed by `make test`); a GPU machine running `-m gpu` may lack them
nbformat = pytest.importorskip("nbformat")
NotebookClient = pytest.importorskip("nbclient").NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def run_notebook(path: Path, workdir: Path):
    book = nbformat.read(path, as_version=4)
    NotebookClient(book, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}).execute()
    return book


def test_there_are_four_notebooks():
    assert [p.stem for p in NOTEBOOKS] == ["01_tour", "02_gallery", "03_porting_gemma3_spans", "04_debugging"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("MPLBACKEND", "Agg")  # no inline backend: figures must show by themselves
    book = run_notebook(path, tmp_path)
    errors = [o for c in book.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    text = "\n".join(str(o.get("text", "")) + str(o.get("data", {}).get("text/plain", ""))
                     for c in book.cells if c.cell_type == "code" for o in c.get("outputs", []))
    # every figure a notebook makes shows as a picture, not as "<Figure size ... with 1 Axes>"
    images = sum("image/png" in o.get("data", {}) for c in book.cells if c.cell_type == "code"
                 for o in c.get("outputs", []))
    assert "<Figure size" not in text
    assert images >= {"01_tour": 2, "02_gallery": 16, "03_porting_gemma3_spans": 0, "04_debugging": 2}[path.stem], images
    if path.stem == "01_tour":
        assert "PASS window_with_globals" in text
        assert book.metadata.get("widgets"), "the app's widget state is recorded"
    if path.stem == "03_porting_gemma3_spans":
        assert "PASS sdpa_dense_port" in text and "PASS vllm_triton_port" in text and "FAIL fa_causal_port" in text
    if path.stem == "04_debugging":
        assert "FAIL draft_window vs causal_sliding_window_64" in text
        assert "FAIL softmax_port" in text and "PASS softmax_port_fixed" in text
