"""Sweeps on a local Ray (2 CPUs): the small example runs, records its failing case, resumes
without running anything twice, and survives a worker that dies."""

import json
from pathlib import Path

import pandas as pd
import pytest

from workbench import sweep
from workbench.cli import main
from workbench.define import WorkbenchError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "sweep_small.toml"


def test_the_file_expands_into_cases():
    cases = sweep.load_sweep(EXAMPLE)
    assert len(cases) == 18 and len({sweep.case_key(c) for c in cases}) == 18
    blocks = [c for c in cases if c["task"] == "blocks"]
    assert blocks and all(c["dtype"] is None and c["backend"] is None for c in blocks)  # not part of their key
    windows = {c["params"]["window"] for c in cases if c["target"] == "causal_sliding_window"}
    assert windows == {32, 64}
    broken = [c for c in cases if "broken_mask.py" in c["target"]]
    assert len(broken) == 1 and Path(broken[0]["target"].split(":")[0]).is_absolute()


def test_a_missing_sweep_file_is_named(tmp_path):
    with pytest.raises(WorkbenchError, match="no sweep file at .*Fix: pass the path of a .toml"):
        sweep.load_sweep(tmp_path / "nope.toml")


def test_a_negative_gpu_count_is_refused_before_ray_starts(capsys):
    from workbench.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["sweep", "examples/sweep_small.toml", "--gpus", "-1"])
    assert stop.value.code == 2 and "-1 is negative" in capsys.readouterr().err


def test_the_gpu_example_has_sixteen_gpu_cases():
    cases = sweep.load_sweep("examples/sweep_gpu.toml")
    assert len(cases) == 16 and {c["device"] for c in cases} == {"cuda"}
    assert {c["task"] for c in cases} == {"verify", "bench"} and {c["q_len"] for c in cases} == {4096, 16384}


@pytest.mark.parametrize("text,match", [
    ("[defaults]\nq_len = 128\n", "no \\[\\[case\\]\\] entries"),
    ("[[case]]\nq_len = 128\n", "has no target"),
    ("[[case]]\ntarget = 'causal'\nqlen = 128\n", "unknown key\\(s\\) qlen"),
    ("[[case]]\ntarget = 'causal'\nq_len = 64\ntask = 'fly'\n", "unknown task 'fly'"),
    ("[[case]\ntarget = 'causal'\n", "not valid TOML"),
])
def test_bad_sweep_files_are_named(tmp_path, text, match):
    path = tmp_path / "s.toml"
    path.write_text(text)
    with pytest.raises(WorkbenchError, match=match):
        sweep.load_sweep(path)


def test_small_sweep_runs_records_failures_and_resumes(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(["sweep", str(EXAMPLE), "-o", str(out), "--cpus", "2"]) == 1  # a case fails on purpose
    printed = capsys.readouterr()
    assert "18 cases (18 run now, 0 from before)" in printed.out
    frame = pd.read_parquet(out / "results.parquet")
    assert len(frame) == 18 and len(pd.read_csv(out / "results.csv")) == 18
    broken = frame[frame["target"].str.contains("broken_mask")].iloc[0]
    assert not broken["ok"] and "Python `if`" in broken["error"] and "torch.where" in broken["error"]
    verified = frame[(frame["task"] == "verify") & frame["ok"]]
    assert len(verified) == 8 and verified["passed"].all()  # 4 windows x lengths, 2 documents, 2 trees
    assert (verified["rel_err"].astype(float) < 1e-5).all()
    inv = frame[frame["task"] == "invariance"].iloc[0]
    # the check ran every layout; where uncompiled FlexAttention differs in the last bits (which
    # layouts do depends on the CPU's matmul kernels), its line says that this is expected there
    assert inv["ok"] and "layouts bitwise" in inv["line"] and "(unexpected)" not in inv["line"]
    assert inv["line"].startswith("INVARIANT") or "expected there" in inv["line"], inv["line"]
    page = (out / "summary.html").read_text()
    assert "<img" in page and "Failures" in page and "branchy_window" in page
    stamps = {p.name: p.stat().st_mtime_ns for p in (out / "cases").iterdir()}

    # again with --resume: nothing runs twice, the results are the same
    assert main(["sweep", str(EXAMPLE), "-o", str(out), "--cpus", "2", "--resume"]) == 1
    assert "18 cases (0 run now, 18 from before)" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in (out / "cases").iterdir()} == stamps


@pytest.mark.slow  # (a Ray sweep with a worker killed: make test-slow, which CI runs)
def test_a_dying_worker_is_recorded_and_the_sweep_goes_on(tmp_path):
    dies = f"{ROOT / 'tests' / 'bad_inputs' / 'dies.py'}:dies"
    cases = [{**sweep.DEFAULTS, "target": dies, "q_len": 64, "device": "cpu", "task": "blocks"},
             {**sweep.DEFAULTS, "target": "causal", "q_len": 64, "device": "cpu", "task": "blocks"}]
    frame = sweep.run(cases, tmp_path, num_cpus=2, progress=False)
    by_target = {row["target"]: row for _, row in frame.iterrows()}
    assert "worker died twice" in by_target[dies]["error"] and not by_target[dies]["ok"]
    assert by_target["causal"]["ok"] and by_target["causal"]["name"] == "causal_bottom_right"
    saved = json.loads(next(p for p in (tmp_path / "cases").iterdir()).read_text())
    assert "key" in saved


def test_a_port_case_verifies_the_generated_kernel():
    case = {**sweep.DEFAULTS, "target": "causal_sliding_window", "params": {"window": 20}, "q_len": 64, "heads": 1,
            "head_dim": 16, "dtype": "float32", "device": "cpu", "backend": "port", "task": "verify"}
    record = sweep.run_case(case)
    assert record["ok"] and record["passed"] and "(Triton port)" in record["line"]


# (a minute: a sweep interrupted and resumed end to end; `make test-slow`)
@pytest.mark.slow
def test_ctrl_c_leaves_a_resumable_folder(tmp_path, monkeypatch):
    """Interrupted after the first finished case: the error says what is saved and how to go on,
    and --resume then runs only the rest."""
    import ray

    cases = sweep.load_sweep(EXAMPLE)[:3]
    real_get, calls = ray.get, []

    def get_then_interrupt(ref, *args, **kwargs):
        calls.append(ref)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_get(ref, *args, **kwargs)

    monkeypatch.setattr(ray, "get", get_then_interrupt)
    with pytest.raises(WorkbenchError, match="sweep interrupted: 1 of 3 cases are saved.*--resume"):
        sweep.run(cases, tmp_path, num_cpus=2, progress=False)
    monkeypatch.setattr(ray, "get", real_get)
    frame = sweep.run(cases, tmp_path, num_cpus=2, progress=False, resume=True)
    assert len(frame) == 3 and frame.attrs["ran"] == 2 and frame.attrs["skipped"] == 1
