"""Sweeps: a grid of masks x parameters x lengths x dtypes x backends x tasks, one Ray task per case.

    python -m workbench sweep examples/sweep_small.toml -o out/sweep [--address ADDR] [--resume]
    workbench.sweep.run("examples/sweep_small.toml", "out/sweep")

A sweep file (TOML):

    [defaults]                       # every case starts from these; a list is a grid axis
    q_len = [256, 512]
    heads = 2
    head_dim = 32
    dtype = "float32"
    device = "cpu"                   # "cuda": each case asks Ray for one GPU
    backend = "flex"                 # flex | port | eager
    task = ["blocks", "verify"]      # blocks | verify | bench | export | invariance

    [[case]]                         # one entry per target; its keys override the defaults
    target = "causal_sliding_window"
    params = { window = [32, 64] }   # parameter grids too

Each case runs as one Ray task (`ray.init()` starts a local Ray; `address` joins a cluster). A case
that raises is recorded with its error; a worker that dies is retried once, then recorded. Every
finished case is written to DIR/cases/KEY.json at once (KEY: a hash of the case and of its mask's
source), so an interrupted sweep resumes with `resume=True`, running nothing twice. At the end:
DIR/results.parquet, DIR/results.csv and DIR/summary.html. This module composes the stages; it
holds no stage logic.
"""

from __future__ import annotations

import hashlib
import html
import inspect
import itertools
import json
import math
import time
import traceback
from pathlib import Path
from typing import Any

import pandas as pd

from workbench import invariance, look, port
from workbench.analyze import mask_stats
from workbench.blocks import scan_blocks
from workbench.cluster import import_ray, init_ray
from workbench.define import WorkbenchError, library, output_folder, prepare
from workbench.export import build_spec, write_spec
from workbench.look import ShownFigure
from workbench.run import Shape, dtype_name
from workbench.verify import TOLERANCES, verify

__all__ = ["run", "load_sweep", "run_case", "case_key", "mask_source", "summary_html", "TASKS", "CASE_KEYS"]

TASKS = ("blocks", "verify", "bench", "export", "invariance")
CASE_KEYS = ("target", "params", "score", "score_params", "q_len", "kv_len", "heads", "kv_heads", "batch", "head_dim",
             "dtype", "device", "backend", "task", "seed")
DEFAULTS = dict(params={}, score=None, score_params={}, kv_len=None, heads=1, kv_heads=None, batch=1, head_dim=64,
                dtype="bfloat16", device="cpu", backend="flex", task="verify", seed=0)
# what each task reads: the other fields are left out of its cases (and of their keys)
TASK_FIELDS = {"blocks": {"dtype", "backend", "head_dim", "kv_heads", "seed"},
               "export": {"backend", "dtype", "kv_heads"}}


# ---------------------------------------------------------------- reading a sweep file

def load_sweep(path: str | Path) -> list[dict]:
    """The cases of a sweep file, expanded and deduplicated, in file order."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise WorkbenchError(f"no sweep file at {path}", "pass the path of a .toml sweep file") from None
    except tomllib.TOMLDecodeError as exc:
        raise WorkbenchError(f"{path.name} is not valid TOML: {exc}", "fix the file (see examples/sweep_small.toml)") \
            from None
    defaults = {**DEFAULTS, **doc.get("defaults", {})}
    entries = doc.get("case") or []
    if not entries:
        raise WorkbenchError(f"{path.name} has no [[case]] entries", "add [[case]] tables with a `target` each")
    cases, seen = [], set()
    for number, entry in enumerate(entries, 1):
        if "target" not in entry:
            raise WorkbenchError(f"{path.name}: [[case]] number {number} has no target",
                                 "give each [[case]] a target = \"name\" or \"file.py:factory\"")
        spec = {**defaults, **entry}
        spec["target"] = _resolve_target(spec["target"], path.parent)
        unknown = sorted(set(spec) - set(CASE_KEYS) - {"tasks"})
        if unknown:
            raise WorkbenchError(f"{path.name}: unknown key(s) {', '.join(unknown)} in case {number}",
                                 f"the keys are {', '.join(CASE_KEYS)}")
        _check_axes(spec, path.name, number)
        for case in _expand(spec):
            _check_case(case, path.name, number)
            frozen = json.dumps(case, sort_keys=True)
            if frozen not in seen:
                seen.add(frozen)
                cases.append(case)
    return cases


SIZE_KEYS = ("q_len", "kv_len", "heads", "kv_heads", "batch", "head_dim")
BACKENDS = ("flex", "port", "eager")


def _require_parquet() -> None:
    """The results table is parquet: say before anything runs when no engine is installed."""
    import importlib.util

    if not any(importlib.util.find_spec(m) for m in ("pyarrow", "fastparquet")):
        raise WorkbenchError("a sweep writes its results as parquet, and neither pyarrow nor fastparquet is installed",
                             "pip install 'flex-workbench[sweep]' (or pip install pyarrow)")


def _check_axes(spec: dict, file: str, number: int) -> None:
    """An empty list would make a grid of nothing: say which key, before anything runs."""
    for key in CASE_KEYS:
        if isinstance(spec.get(key), list) and not spec[key]:
            raise WorkbenchError(f"{file}: case {number} has {key} = [], an empty grid axis (it would run nothing)",
                                 f"give {key} at least one value, e.g. {key} = [{DEFAULTS.get(key) or 256}]")
    for group in ("params", "score_params"):
        for name, value in (spec.get(group) or {}).items():
            if isinstance(value, list) and not value:
                raise WorkbenchError(f"{file}: case {number} has {group}.{name} = [], an empty grid axis",
                                     f"give {name} at least one value")


def _check_case(case: dict, file: str, number: int) -> None:
    """Sizes positive integers, and task / backend / dtype known: a typo fails here, not on Ray."""

    if case["task"] not in TASKS:
        raise WorkbenchError(f"{file}: unknown task {case['task']!r}", f"use one of {', '.join(TASKS)}")
    for key in SIZE_KEYS:
        value = case.get(key)
        if value is None and key in ("kv_len", "kv_heads") or value is None and key in TASK_FIELDS.get(case["task"], ()):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise WorkbenchError(f"{file}: case {number} has {key} = {json.dumps(value)}; sizes are positive "
                                 "integers", f"set {key} to a whole number >= 1 (0 is an error, never a default)")
    if case.get("backend") is not None and case["backend"] not in BACKENDS:
        raise WorkbenchError(f"{file}: case {number} has backend = {case['backend']!r}",
                             f"use one of {', '.join(BACKENDS)}")
    if case.get("dtype") is not None:
        try:
            dtype_name(case["dtype"])
        except (WorkbenchError, TypeError) as exc:
            raise WorkbenchError(f"{file}: case {number} has dtype = {json.dumps(case['dtype'])}",
                                 "use one of float32, bfloat16, float16, float64, tf32") from exc


def _resolve_target(target: str, sweep_folder: Path) -> str:
    """A file target as an absolute path (Ray workers may start elsewhere): relative to the
    current folder if it is there, else to the sweep file's folder."""
    file, sep, rest = target.partition(":")
    if not file.endswith(".py"):
        return target
    for base in (Path.cwd(), sweep_folder):
        if (base / file).is_file():
            return str((base / file).resolve()) + sep + rest
    return target


def _axis(value) -> list:
    return value if isinstance(value, list) else [value]


def _expand(spec: dict) -> list[dict]:
    """Every combination of the list-valued fields (and of list-valued parameters)."""
    grids = {k: _axis(spec[k]) for k in CASE_KEYS if k not in ("params", "score_params")}
    params = _param_grid(spec.get("params") or {})
    score_params = _param_grid(spec.get("score_params") or {})
    out = []
    for combo in itertools.product(*grids.values(), params, score_params):
        case = dict(zip(grids, combo[:len(grids)]))
        case["params"], case["score_params"] = combo[-2], combo[-1]
        for skipped in TASK_FIELDS.get(case["task"], ()):
            case[skipped] = None
        out.append({k: case[k] for k in CASE_KEYS})
    return out


def _param_grid(params: dict) -> list[dict]:
    names = list(params)
    return [dict(zip(names, values)) for values in itertools.product(*(_axis(params[n]) for n in names))] or [{}]


def mask_source(target: str) -> str:
    """The text the mask comes from (a library factory's source, a file's contents): part of a
    case's key, so editing the mask re-runs its cases on resume."""
    try:
        if target in library():
            return inspect.getsource(library()[target])
        file = target.split(":")[0]
        if file.endswith(".py") and Path(file).is_file():
            return Path(file).read_text()
    except (OSError, TypeError):
        pass
    return target


def case_key(case: dict) -> str:
    text = json.dumps(case, sort_keys=True) + mask_source(case["target"])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---------------------------------------------------------------- one case

def run_case(case: dict) -> dict:
    """One case, in whatever process Ray gives it: the outcome and its figures, or its error."""
    start = time.perf_counter()
    record = {**case, "params": json.dumps(case["params"]), "score_params": json.dumps(case["score_params"]),
              "ok": False, "error": ""}
    try:
        record.update(_task(case))
        record["ok"] = True
    except WorkbenchError as exc:
        record["error"] = exc.message
    except Exception as exc:  # user code can fail in any way: recorded, the sweep goes on
        last = traceback.extract_tb(exc.__traceback__)[-1]
        record["error"] = f"{type(exc).__name__}: {exc} (at {Path(last.filename).name}:{last.lineno})"
    record["seconds"] = round(time.perf_counter() - start, 3)
    return record


def _task(case: dict) -> dict[str, Any]:

    q_len, kv_len = case["q_len"], case["kv_len"] or case["q_len"]
    device = case["device"]
    mask = prepare(case["target"], case["params"], q_len, kv_len, device, score=case["score"],
                   score_params=case["score_params"], heads=case["heads"], batch=case["batch"])
    heads = mask.heads or case["heads"]
    out: dict[str, Any] = {"name": mask.name}
    task = case["task"]
    if task == "blocks":

        scan = scan_blocks(mask, q_len, kv_len, heads=heads, batch=case["batch"], device=device)
        stats = mask_stats(scan)
        out.update(density=stats.density, block_sparsity=stats.block_sparsity, kept_pairs=stats.kept_pairs,
                   scan_seconds=scan.seconds, passed=True)
        return out
    shape = Shape(batch=case["batch"], q_heads=heads, kv_heads=case["kv_heads"] or heads, q_len=q_len, kv_len=kv_len,
                  head_dim=case["head_dim"])
    if task == "verify":

        # verify builds the port; FlexAttention is compiled on a GPU, uncompiled on a CPU
        backend = ("port" if case["backend"] == "port" else
                   "flex" if case["backend"] != "eager" and device.startswith("cuda") else "eager")
        verdict = verify(mask, shape, dtype=case["dtype"], device=device, seed=case["seed"], backend=backend,
                         progress=False)
        out.update(passed=verdict.passed, rel_err=max(c.rel_err for c in verdict.checks),
                   max_abs_err=max(c.max_abs_err for c in verdict.checks), reference_seconds=verdict.reference_seconds,
                   reference_fraction=verdict.reference_fraction, line=verdict.line)
    elif task == "bench":
        if not device.startswith("cuda"):
            raise WorkbenchError("the bench task times kernels on a GPU", "run bench cases with device = \"cuda\"")

        checked = port.check(mask, shape, device, dtype=case["dtype"], time_it=True, seed=case["seed"])
        if not checked.passed:
            raise WorkbenchError(f"the port failed verification: {checked.verdict.line if checked.verdict else checked.note}",
                                 "verify it with `python -m workbench verify --backend port` to see where", mask.name)
        timing = checked.timing
        out.update(passed=True, port_ms=timing["port_ms"], flex_ms=timing["flex_ms"],
                   speed_vs_flex=timing["speed_vs_flex"])
    elif task == "export":
        import tempfile


        spec = build_spec(mask, q_len, kv_len, heads=mask.heads, batch=None, head_dim=case["head_dim"], device=device,
                          seed=case["seed"])
        path, _ = write_spec(spec, tempfile.mkdtemp(prefix="workbench_sweep_spec_"))
        out.update(passed=True, exact_backends=" ".join(spec.supported), spec=str(path))
    elif task == "invariance":

        result = invariance.check(mask, q_len=q_len, heads=heads, head_dim=case["head_dim"], dtype=case["dtype"],
                                  device=device, backend=case["backend"], options=invariance.InvarianceOptions(seed=case["seed"]))
        out.update(passed=result.passed, differs_under=" ".join(r.key for r in result.layouts if not r.bitwise),
                   line=result.line)
    return out


# ---------------------------------------------------------------- the sweep

def run(sweep: str | Path | list[dict], out_dir: str | Path = "out/sweep", *, address: str | None = None,
        resume: bool = False, num_cpus: int | None = None, num_gpus: int | None = None,
        progress: bool = True) -> pd.DataFrame:
    """Run every case of `sweep` (a file, or cases as load_sweep gives them) on Ray and return
    one row per case (also written to out_dir). num_cpus / num_gpus: what the local Ray may use
    (default: all the machine has)."""
    from tqdm.auto import tqdm


    ray = import_ray()
    _require_parquet()
    cases = load_sweep(sweep) if isinstance(sweep, (str, Path)) else list(sweep)
    out = output_folder(out_dir)
    done_dir = out / "cases"
    done_dir.mkdir(exist_ok=True)
    keyed = [(case_key(c), c) for c in cases]
    todo = [(k, c) for k, c in keyed if not (resume and (done_dir / f"{k}.json").exists())]
    skipped = len(keyed) - len(todo)
    started_here = bool(todo) and not ray.is_initialized()
    if started_here:
        init_ray(address, num_cpus=num_cpus, num_gpus=num_gpus)
    try:
        remote = ray.remote(max_retries=1, retry_exceptions=False)(run_case) if todo else None
        pending = {}
        for key, case in todo:
            gpu = 1 if str(case["device"]).startswith("cuda") else 0
            pending[remote.options(num_gpus=gpu, num_cpus=1).remote(case)] = (key, case)
        bar = tqdm(total=len(todo), desc=f"sweep ({skipped} done before)" if skipped else "sweep",
                   disable=not progress)
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            key, case = pending.pop(ready[0])
            try:
                record = ray.get(ready[0])
            except Exception as exc:  # the worker died twice (out of memory, a crash): recorded
                record = {**case, "params": json.dumps(case["params"]),
                          "score_params": json.dumps(case["score_params"]), "ok": False,
                          "error": f"worker died twice: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
            record["key"] = key
            (done_dir / f"{key}.json").write_text(json.dumps(record, default=str))
            bar.update(1)
        bar.close()
    except KeyboardInterrupt:  # Ctrl-C: every finished case is on disk already
        saved = sum((done_dir / f"{k}.json").exists() for k, _ in keyed)
        raise WorkbenchError(f"sweep interrupted: {saved} of {len(keyed)} cases are saved in {done_dir}",
                             f"run it again with --resume (resume=True) to run the other {len(keyed) - saved}") from None
    finally:
        if started_here:
            ray.shutdown()
    records = [json.loads((done_dir / f"{k}.json").read_text()) for k, _ in keyed]
    frame = pd.DataFrame(records)
    for col in ("ok", "passed"):  # True / False, or missing where a case raised
        if col in frame:
            frame[col] = frame[col].astype("boolean")
    frame.attrs.update(ran=len(todo), skipped=skipped)
    frame.to_csv(out / "results.csv", index=False)
    frame.astype({c: str for c in frame.columns if frame[c].dtype == object}).to_parquet(out / "results.parquet")
    (out / "summary.html").write_text(summary_html(frame))
    return frame


# ---------------------------------------------------------------- the summary

def _legend_below(ax) -> None:
    """The legend under the axes, in columns, so it never covers a line."""
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, labels, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16),
              ncol=min(3, max(1, len(labels))), frameon=False)


def summary_html(frame: pd.DataFrame) -> str:
    """Counts, plots (verify error by dtype x length; port speed vs Flex by mask x length) and the
    failures with their errors."""
    import base64

    import matplotlib.ticker


    esc = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>sweep</title><style>body{{font-family:"
             f"system-ui,sans-serif;margin:24px;color:#1d2733}}table{{border-collapse:collapse;font-size:13px}}"
             f"td,th{{padding:3px 8px;border-bottom:1px solid #e3e7ec;text-align:left}}"
             f".bad{{color:#a4161a}}</style></head><body><h1>Sweep: {len(frame)} cases</h1>"]
    ok = frame["ok"].fillna(False).astype(bool)
    passed = frame["passed"].fillna(False).astype(bool) if "passed" in frame else ok
    parts.append(f"<p>{int((ok & passed).sum())} passed · {int((ok & ~passed).sum())} failed a check · "
                 f"{int((~ok).sum())} raised</p>")

    def figure(draw) -> str:
        fig = ShownFigure(figsize=(6.8, 4.4), layout="constrained")
        draw(fig.subplots())
        return f"<img src='data:image/png;base64,{base64.b64encode(look.png(fig)).decode()}'>"

    verified = frame[(frame["task"] == "verify") & ok] if "rel_err" in frame else frame.iloc[:0]
    if len(verified):
        def draw_errors(ax):

            for (name, dtype), rows in verified.groupby(["name", "dtype"]):
                rows = rows.sort_values("q_len")
                ax.plot(rows["q_len"], rows["rel_err"], marker="o", label=f"{name} ({dtype})")
            # each dtype's pass limit, so the margin shows (and the log axis spans whole decades)
            for dtype in sorted(set(verified["dtype"]) & set(TOLERANCES)):
                ax.axhline(TOLERANCES[dtype].rel_fro, color="#a4161a", linestyle="--", linewidth=0.9,
                           label=f"{dtype} pass limit")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            errors = verified["rel_err"].astype(float)
            errors = errors[errors > 0]
            if len(errors):  # whole decades, so labelled ticks frame the points
                top = max([errors.max()] + [TOLERANCES[d].rel_fro for d in set(verified["dtype"]) & set(TOLERANCES)])
                ax.set_ylim(10.0 ** math.floor(math.log10(errors.min())), 2 * top)
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_xlabel("tokens")
            ax.set_ylabel("relative error vs float64")
            ax.set_title("verify: error by dtype x length", fontsize=10)
            _legend_below(ax)
        parts.append("<h2>Verification</h2>" + figure(draw_errors))
    benched = frame[(frame["task"] == "bench") & ok] if "speed_vs_flex" in frame else frame.iloc[:0]
    if len(benched):
        def draw_speed(ax):
            for name, rows in benched.groupby("name"):
                rows = rows.sort_values("q_len")
                ax.plot(rows["q_len"], rows["speed_vs_flex"], marker="o", label=name)
            ax.axhline(1.0, color="#8a96a3", linewidth=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tokens")
            ax.set_ylabel("port speed / FlexAttention's")
            ax.set_title("bench: the generated port vs FlexAttention (above 1: the port is faster)", fontsize=10)
            _legend_below(ax)
        parts.append("<h2>Speed</h2>" + figure(draw_speed))
    failures = frame[~ok | (ok & ~passed)]
    if len(failures):
        def text(row, *names):
            return next((row[n] for n in names if isinstance(row.get(n), str) and row[n]), "failed")

        rows = "".join(f"<tr><td>{esc(text(r, 'name', 'target'))}</td><td>{esc(str(r['task']))}</td>"
                       f"<td>{esc(str(r['q_len']))}</td><td>{esc(str(r['dtype']))}</td><td class='bad'>"
                       f"{esc(text(r, 'error', 'line'))}</td></tr>" for _, r in failures.iterrows())
        parts.append("<h2>Failures</h2><table><tr><th>mask</th><th>task</th><th>tokens</th><th>dtype</th>"
                     f"<th>error</th></tr>{rows}</table>")
    shown = [c for c in ("name", "target", "params", "task", "q_len", "dtype", "backend", "ok", "passed", "rel_err",
                         "density", "speed_vs_flex", "seconds") if c in frame]
    parts.append("<h2>All cases</h2>" + frame[shown].to_html(index=False, escape=True, na_rep=""))
    return "".join(parts) + "</body></html>"
