"""The main job on a GPU: worker processes analyze masks side by side, then each port is timed
alone, and every column of the report is still filled. Run with `pytest -m gpu`."""

import json

import pytest

from workbench.report import run_report


@pytest.mark.gpu
def test_report_in_workers_fills_every_column(cuda, tmp_path):
    targets = [("causal", {}), ("per_head_window", {}), ("sliding_window", {"left": 100})]
    results = run_report(targets, tmp_path, q_len=1024, device="cuda", workers=2, progress=False)
    for r in results:
        assert r.error is None, r.error
        assert r.verdict.passed and r.verdict.compiled, r.verdict.line
        assert r.port_verdict.passed, r.port_verdict.line
        assert r.invariance is not None and r.spec is not None
        # timed in the worker that compiled it, with the GPU to itself
        assert r.port_timing["port_ms"] > 0 and r.port_timing["flex_ms"] > 0, r.port_note
        assert "H200" in r.port_timing["device"] or "NVIDIA" in r.port_timing["device"]
        assert r.stage_seconds["port timing"] > 0 and r.stage_seconds["verify"] > 0
        assert r.mask is not None and r.mask.mask_mod is not None  # rebuilt here, mods and all
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["wall_seconds"] > 0
    assert set(summary["stage_seconds"]) >= {"verify", "invariance", "spec", "port", "port timing"}
    page = (tmp_path / "report.html").read_text()
    assert "by 2 worker processes" in page and "x Flex's speed" in page
    print("report in workers:", summary["wall_seconds"], "s;", summary["stage_seconds"])
