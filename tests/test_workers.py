"""Worker processes (workbench.workers) and the report run in them: a task's value or failure comes
back, a worker that dies is replaced, a follow-up reaches the worker that ran the first task, and
the report analyzed in workers says what the serial one says."""

import csv
import json
import os

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


def test_report_in_workers_says_what_the_serial_report_says(tmp_path):
    targets = [("causal", {}), ("per_head_window", {}), ("relative_bias", {})]
    rows = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        results = run_report(targets, out, q_len=256, device="cpu", progress=False, workers=workers)
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
    assert [r["name"] for r in rows[2]] == ["causal_bottom_right", "per_head_window_8heads", "relative_bias_m64"]
