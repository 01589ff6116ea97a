"""Worker processes (workbench.workers) and the report run in them: a task's value or failure comes
back, a worker that dies is replaced, a follow-up reaches the worker that ran the first task, and
the report analyzed in workers says what the serial one says."""

import csv
import json
import os
import textwrap

import pytest

from helpers import cli
from workbench import port
from workbench.define import WorkbenchError
from workbench.report import run_report
from workbench.workers import Pool, WorkerDied, WorkerFailed


def test_pool_values_failures_deaths_and_follow_ups():
    with Pool(2) as pool:
        done = {key: (worker, value) for key, worker, value in pool.map("os:getpid", {"a": (), "b": (), "c": ()})}
        assert set(done) == {"a", "b", "c"}
        pids = {value for _, value in done.values()}
        assert os.getpid() not in pids and 1 <= len(pids) <= 2  # other processes
        worker, pid = done["a"]
        assert pool.call(worker, "os:getpid") == pid  # the same process, state and all
        failed = pool.call(worker, "math:sqrt", -1.0)
        assert isinstance(failed, WorkerFailed) and "math domain error" in str(failed)
        died = pool.call(worker, "os:_exit", 3)
        assert isinstance(died, WorkerDied) and died.code == 3 and "exited (code 3)" in str(died)
        assert pool.call(worker, "os:getpid") not in (pid, None)  # replaced by a fresh one
        assert isinstance(pool.call(worker, "time:sleep", 5, timeout=0.5), WorkerDied)  # stopped, replaced
        assert pool.call(worker, "math:sqrt", 4.0) == 2.0


# (two minutes: the report serially and in two workers; `make test-slow`)
@pytest.mark.slow
def test_report_in_workers_says_what_the_serial_report_says(tmp_path):
    # a user's own file (an undeclared per-head table read as w[h]) next to library masks, at Lq != Lk
    users = tmp_path / "my_masks.py"
    users.write_text(textwrap.dedent("""
        import torch
        w = torch.tensor([8, 32, 64, 200])

        def head_window(b, h, q_idx, kv_idx):
            return (q_idx + 128 >= kv_idx) & (q_idx + 128 - kv_idx <= w[h])
    """))
    targets = [("causal", {}), ("per_head_window", {}), ("relative_bias", {}), (f"{users}:head_window", {})]
    rows = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        results = run_report(targets, out, q_len=256, kv_len=384, device="cpu", progress=False, workers=workers)
        assert all(r.error is None for r in results), [r.error for r in results]
        assert all(r.mask is not None and (r.mask.mask_mod or r.mask.score_mod) for r in results)  # mods rebuilt
        assert all(r.stage_seconds["verify"] > 0 and r.stage_seconds["port"] > 0 for r in results)
        rows[workers] = list(csv.DictReader((out / "summary.csv").open()))
        summary = json.loads((out / "summary.json").read_text())
        assert summary["workers"] == workers and set(summary["stage_seconds"]) >= {"verify", "invariance", "port"}
        page = (out / "report.html").read_text()
        assert ("by 2 worker processes" in page) == (workers == 2) and "time in stages" in page
    same = ["name", "density", "full_blocks", "verified", "exact_backends", "port_verified", "invariance", "status"]
    assert [{k: r[k] for k in same} for r in rows[1]] == [{k: r[k] for k in same} for r in rows[2]]
    assert [r["name"] for r in rows[2]] == ["causal_bottom_right", "per_head_window_8heads", "relative_bias_m64",
                                            "head_window"]
    assert rows[2][3]["differs_across_heads"] == "True" and rows[2][3]["port_verified"] == "True"


def test_bad_worker_counts_and_port_files_are_named(tmp_path, capsys):
    for bad in (0, -2, 1.5, True, "4"):
        with pytest.raises(WorkbenchError, match="is not a number of processes"):
            run_report([("causal", {})], tmp_path / "r", q_len=64, device="cpu", progress=False, workers=bad)
    assert not (tmp_path / "r").exists()  # refused before anything is written
    rc, text = cli(capsys, "report", "causal", "--q-len", "64", "-o", str(tmp_path / "c"), "--workers", "0")
    assert rc == 2 and "0 is not a positive integer" in text
    with pytest.raises(WorkbenchError, match="no port file at"):
        port.loaded(tmp_path / "missing_attention.py")
