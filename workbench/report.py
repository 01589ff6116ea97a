"""The main job: run the stages over masks and write an HTML report plus a JSON/CSV summary.

This module only composes stages (define -> blocks -> look -> run -> verify -> analyze -> export,
the port and the invariance check); it holds no analysis."""

from __future__ import annotations

import base64
import html
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from workbench import invariance, look, port
from workbench.analyze import mask_stats
from workbench.blocks import scan_blocks
from workbench.define import (
    Mask,
    TimedOut,
    WorkbenchError,
    bind,
    call_with_timeout,
    index_reads,
    library,
    library_variants,
    make,
    output_folder,
    prepare,
)
from workbench.export import build_spec, write_spec
from workbench.run import Shape, defaults_for
from workbench.verify import verify
from workbench.workers import Pool, WorkerDied, WorkerFailed, default_workers

__all__ = ["run_report", "MaskResult", "MaskInfo", "analyze_target", "verify_target", "invariance_target", "port_target",
           "export_target", "library_targets", "summary_frame", "render_html", "default_device", "DEFAULT_LEN",
           "DEFAULT_HEADS"]

DEFAULT_LEN = 4096
DEFAULT_HEADS = 4
# The CPU verifies with uncompiled FlexAttention (its unfused path) at a short length; a GPU
# verifies compiled FlexAttention at the report's length.
CPU_VERIFY_LEN = 512
# Porting specs in the report: long enough for the library's spans and documents, small enough
# that 23 specs with golden vectors stay a few MB each (export larger ones with `export`).
SPEC_LEN = 1024
SPEC_HEAD_DIM = 32
# The generated Triton port is verified at the report's length on a GPU; on a CPU it runs under
# Triton's interpreter, in a fresh process, at this length.
PORT_CPU_LEN = 256
# Layout invariance in the report: the request alone vs run again, batched and packed at a
# block-aligned and an unaligned offset (the full set: `python -m workbench invariance`).
INVARIANCE_LAYOUTS = ["run", "batch", "packed_aligned", "packed_unaligned"]
INVARIANCE_LEN = {"cpu": 200, "cuda": 1000}  # on a GPU, for masks with Lq != Lk (others: the report length)


@dataclass
class MaskResult:
    """What the report knows of one mask: the mask, its statistics and figures, or its error."""

    target: str
    params: dict
    mask: Mask | None = None
    stats: object = None
    figures: dict = field(default_factory=dict)   # title -> PNG bytes
    captions: dict = field(default_factory=dict)  # title -> what it shows, at which length, and why there
    error: str | None = None
    seconds: float = 0.0
    verdict: object = None  # verify.Verdict
    verify_note: str = ""   # why there is no verdict
    spec: object = None     # export.PortingSpec
    spec_path: str = ""
    spec_note: str = ""
    port_verdict: object = None  # verify.Verdict of the generated Triton port
    port_timing: dict | None = None  # on a GPU: port vs compiled FlexAttention
    port_note: str = ""
    invariance: object = None  # invariance.InvarianceResult
    invariance_note: str = ""
    stage_seconds: dict = field(default_factory=dict)  # stage -> seconds spent in it (where the time goes)
    port_job: tuple | None = field(default=None, repr=False)  # (mask, shape, path, dtype, device): timing to do


@dataclass
class MaskInfo:
    """What the report shows of a mask analyzed in a worker process (the mods stay there): the
    stand-in for a Mask when the mask cannot be rebuilt here."""

    name: str
    params: dict
    description: str
    source: str
    heads: int | None = None

    @classmethod
    def of(cls, mask: Mask) -> MaskInfo:
        return cls(mask.name, dict(mask.params or {}), mask.description, mask.source, mask.heads)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _png(fig) -> bytes:
    return look.png(fig, close=True)


def analyze_target(target: str, params: dict, q_len: int, kv_len: int, heads: int | None, batch: int | None,
                   block_size, device: str, factory=None, spec_dir: Path | None = None, time_port: bool = True,
                   on_stage=None) -> MaskResult:
    """All stages for one mask; any user error is caught and kept on the result. Each stage's time
    is kept in `stage_seconds` (`on_stage(target, stage)` is called as one starts). `time_port=False`
    leaves the port's timing for later (`result.port_job`: the report's worker processes time one
    mask at a time, with the GPU to themselves)."""
    result = MaskResult(target=target, params=params)
    start = time.perf_counter()

    @contextmanager
    def stage(name):
        if on_stage is not None:
            on_stage(target, name)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            result.stage_seconds[name] = result.stage_seconds.get(name, 0.0) + time.perf_counter() - t0

    try:
        with stage("define"):
            mask = prepare(factory or target, params, q_len, kv_len, device)
        result.mask = mask
        n_heads = mask.heads or heads  # a mask defined per head is shown with all its heads
        at = f"Lq={q_len:,} Lk={kv_len:,}"
        if mask.mask_mod is not None:
            with stage("blocks and pictures"):
                scan = scan_blocks(mask, q_len, kv_len, heads=n_heads, batch=batch, block_size=block_size,
                                   device=device)
                result.stats = mask_stats(scan)
                result.figures["block map"] = _png(look.block_map(scan, title=mask.name))
                result.captions["block map"] = f"block map at {at}, {scan.batch} x {scan.heads} (batch x heads)"
                where = look.focus(scan, 512, mask=mask, device=device)
                result.figures["token view"] = _png(look.token_view(mask, where.q_range, where.kv_range,
                                                                    device=device, why=where.reason))
                result.captions["token view"] = f"token view at {at}; where: {where.reason}"
        if mask.score_mod is not None:
            with stage("blocks and pictures"):
                h = 1 if (mask.heads or n_heads or 1) > 1 else 0
                if mask.mask_mod is not None:
                    where = look.focus(scan, 256, h=h, mask=mask, device=device)
                    q_zoom, kv_zoom, why = where.q_range, where.kv_range, where.reason
                else:  # a score_mod alone: the start of the diagonal
                    n = min(q_len, kv_len, 256)
                    q_zoom, kv_zoom = (0, n), (kv_len - q_len, kv_len - q_len + n) if kv_len > q_len else (0, n)
                    why = "the start of the diagonal"
                result.figures["score view"] = _png(look.score_view(mask, q_zoom, kv_zoom, h=h, device=device))
                result.captions["score view"] = f"score view at {at}, head {h}; where: {why}"
        with stage("verify"):
            verify_target(result, n_heads or 1, device)
        with stage("invariance"):
            invariance_target(result, device, n_heads or 1, q_len, kv_len)
        if spec_dir is not None:
            with stage("spec"):
                export_target(result, n_heads, batch, device, spec_dir)
            with stage("port"):
                port_target(result, n_heads or 1, device, spec_dir.parent / "ports", time_it=time_port)
    except WorkbenchError as exc:
        result.error = exc.message
    except Exception as exc:  # user code can fail in any way; keep going with the others
        result.error = f"{target}: {type(exc).__name__}: {exc}"
    result.seconds = time.perf_counter() - start
    return result


def _at_length(result: MaskResult, q_len: int, kv_len: int, device: str) -> Mask:
    """The target rebuilt at another length from the parameters the user gave (so defaults
    that scale with the length, such as the library's spans, scale too)."""
    try:
        return bind(make(result.mask.factory or result.target, result.params, q_len=q_len, kv_len=kv_len,
                         device=device), q_len, kv_len, device)
    except WorkbenchError:
        return bind(result.mask, q_len, kv_len, device)


def _at_most(result: MaskResult, limit: int | None, device: str) -> tuple[Mask, int, int]:
    """The mask with both lengths scaled down to at most `limit` (None: as it is)."""
    mask = result.mask
    q_len, kv_len = mask.q_len or DEFAULT_LEN, mask.kv_len or DEFAULT_LEN
    scale = 1.0 if limit is None else min(1.0, limit / max(q_len, kv_len))
    if scale == 1.0:
        return mask, q_len, kv_len
    q_len, kv_len = max(1, int(q_len * scale)), max(1, int(kv_len * scale))
    return _at_length(result, q_len, kv_len, device), q_len, kv_len


def verify_target(result: MaskResult, heads: int, device: str) -> None:
    """FlexAttention vs the float64 reference for this mask: compiled bf16 at the report's
    length on a GPU, uncompiled float32 at CPU_VERIFY_LEN on the CPU."""

    on_gpu = device.startswith("cuda")
    try:
        mask, q_len, kv_len = _at_most(result, None if on_gpu else CPU_VERIFY_LEN, device)
    except WorkbenchError as exc:
        result.verify_note = f"not verified at a CPU-sized length: {exc.message}"
        return
    defaults = defaults_for(device)
    shape = Shape(batch=1, q_heads=mask.heads or heads, q_len=q_len, kv_len=kv_len, head_dim=defaults.head_dim)
    result.verdict = verify(mask, shape, dtype=defaults.dtype, device=device, progress=False, backend="flex" if on_gpu else "eager")


def invariance_target(result: MaskResult, device: str, heads: int = 4, q_len: int | None = None,
                      kv_len: int | None = None) -> None:
    """Does the mask's request get the same bits batched and packed? A short check (see
    INVARIANCE_LAYOUTS); FlexAttention compiled on a GPU, uncompiled on the CPU. On a GPU a
    self-attention mask is checked at the report's length and heads: the request alone is then
    the very call the port's timing makes, so FlexAttention compiles it once for both."""

    on_gpu = device.startswith("cuda")
    mask = result.mask
    q_len, kv_len = q_len or mask.q_len, kv_len or mask.kv_len  # the report's lengths (the mask is bound there)
    same = on_gpu and q_len is not None and q_len == kv_len and q_len >= 4
    n = q_len if same else INVARIANCE_LEN["cuda" if on_gpu else "cpu"]
    try:
        mask = mask if same else _at_length(result, n, n, device)
        result.invariance = invariance.check(mask, q_len=n, heads=mask.heads or (heads if same else 4),
                                             head_dim=defaults_for(device).head_dim, dtype=defaults_for(device).dtype,
                                             device=device, layouts=INVARIANCE_LAYOUTS, options=invariance.InvarianceOptions(batch=4))
    except WorkbenchError as exc:
        result.invariance_note = f"not checked at {n} tokens: {exc.message}"


def _invariance_cell(r: MaskResult) -> str:
    """E.g. "2/4 bitwise; differs: packed_aligned, packed_unaligned" (layout keys; the section has the details)."""
    inv = r.invariance
    if inv is None:
        return "—"
    broken = list(dict.fromkeys(x.key for x in inv.layouts if not x.bitwise))
    same = sum(x.bitwise for x in inv.layouts)
    expected = " (expected: uncompiled FlexAttention)" if inv.note and broken else ""
    return f"{same}/{len(inv.layouts)} bitwise" + (f"; differs: {', '.join(broken)}{expected}" if broken else "")


def port_target(result: MaskResult, heads: int, device: str, port_dir: Path, time_it: bool = True) -> None:
    """The generated Triton port of this mask, verified against the float64 reference (and on a
    GPU timed beside compiled FlexAttention, now or, with time_it=False, later: `result.port_job`
    holds what `run.prepare_timing` needs): `port.check`."""

    on_gpu = device.startswith("cuda")
    try:
        mask, q_len, kv_len = _at_most(result, None if on_gpu else PORT_CPU_LEN, device)
        heads = mask.heads or heads
        shape = Shape(batch=1, q_heads=heads, q_len=q_len, kv_len=kv_len, head_dim=defaults_for(device).head_dim)
        checked = port.check(mask, shape, device, out_dir=port_dir, time_it=on_gpu and time_it)
    except WorkbenchError as exc:
        result.port_note = f"no port: {exc.message}"
        return
    result.port_verdict, result.port_timing = checked.verdict, checked.timing
    result.port_note = str(checked.path) + (f" ({checked.note})" if checked.note else "")
    if on_gpu and not time_it and checked.passed:
        result.port_job = (mask, shape, checked.path, checked.verdict.dtype, device)


def export_target(result: MaskResult, heads: int | None, batch: int | None, device: str, spec_dir: Path) -> None:
    """The porting spec (with golden vectors) of this mask, written to spec_dir."""

    try:
        mask, q_len, kv_len = _at_most(result, SPEC_LEN, device)
    except WorkbenchError as exc:
        result.spec_note = f"no spec at {SPEC_LEN} tokens: {exc.message}"
        return
    # heads only where a mod reads h: golden vectors of a head-independent mask stay one head
    reads_h = "h" in index_reads(mask.mask_mod) | index_reads(mask.score_mod, "score")
    spec = build_spec(mask, q_len, kv_len, heads=mask.heads or (heads if reads_h else None),
                      batch=batch, head_dim=SPEC_HEAD_DIM, device=device, seed=0)
    json_path, _ = write_spec(spec, spec_dir)
    result.spec, result.spec_path = spec, str(json_path)


def library_targets() -> list[tuple[str, dict]]:
    return [(name, variant) for name in library() for variant in library_variants(name)]


def run_report(targets: list[tuple[str, dict]] | None = None, out_dir: str | Path = "out", q_len: int = DEFAULT_LEN,
               kv_len: int | None = None, heads: int | None = DEFAULT_HEADS, batch: int | None = None,
               block_size=128, device: str | None = None, progress: bool = True,
               timeout: float | None = None, workers: int | None = None) -> list[MaskResult]:
    """Analyze each target and write out_dir/report.html, summary.json and summary.csv. A mask that
    takes longer than `timeout` seconds is recorded as an error and the report goes on.

    `workers`: processes that analyze masks side by side (None: `default_workers`, several on a
    GPU, where a mask's time is mostly compiling; 1: all in this process). With workers, the ports'
    timings beside FlexAttention run afterwards, one mask at a time, so no other work shares the
    GPU while one is timed."""
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise WorkbenchError(f"workers = {workers!r} is not a number of processes",
                             "pass a whole number >= 1 (1: all in this process), or None for the default")
    device = device or default_device()
    kv_len = kv_len or q_len
    targets = targets if targets is not None else library_targets()
    out = output_folder(out_dir)
    workers = default_workers(len(targets), device) if workers is None else workers
    started = time.perf_counter()
    bar = tqdm(total=len(targets), desc="report", disable=not progress)
    args = (q_len, kv_len, heads, batch, block_size, device, out / "specs", timeout)
    if workers == 1:
        results = []
        for t, p in targets:
            results.append(_analyze_job(t, p, *args, time_port=True,
                                        on_stage=lambda name, stage: bar.set_postfix_str(f"{name}: {stage}")))
            bar.update()
            bar.set_postfix_str(_time_line(results))
    else:
        results = _run_in_workers(targets, args, workers, bar)
    bar.close()
    wall = time.perf_counter() - started
    summary = summary_frame(results)
    summary.to_csv(out / "summary.csv", index=False)
    settings = dict(q_len=q_len, kv_len=kv_len, heads=heads, batch=batch, block_size=block_size, device=device,
                    workers=workers, wall_seconds=round(wall, 1))
    (out / "summary.json").write_text(json.dumps(
        dict(**settings, torch=torch.__version__, stage_seconds=_stage_totals(results),
             masks=[_result_record(r) for r in results]), indent=2))
    (out / "report.html").write_text(render_html(results, settings))
    return results


def _analyze_job(target, params, q_len, kv_len, heads, batch, block_size, device, spec_dir, timeout,
                 time_port=True, on_stage=None) -> MaskResult:
    """analyze_target within `timeout` seconds (a mask that takes longer becomes an error)."""
    try:
        return call_with_timeout(lambda: analyze_target(target, params, q_len, kv_len, heads, batch, block_size,
                                                        device, spec_dir=spec_dir, time_port=time_port,
                                                        on_stage=on_stage), timeout)
    except TimedOut:
        return MaskResult(target=target, params=params, seconds=timeout,
                          error=f"{target}: timed out after {timeout:g} s (the factory or a stage did not "
                                "return). Fix: look for an endless loop in it, or raise --timeout")


# in a worker process: the port timings left to do, by job key
_TIMING_JOBS: dict = {}


def _worker_analyze(key, target, params, *args) -> MaskResult:
    """One mask in a worker: everything but the port's timing (kept here for `_worker_time`);
    the mask goes back as a MaskInfo (its mods stay in this process)."""
    from workbench.run import prepare_timing

    result = _analyze_job(target, params, *args, time_port=False)
    if result.port_job is not None:  # compile and tune now, beside the other workers; time later, alone
        start = time.perf_counter()
        try:
            _TIMING_JOBS[key] = prepare_timing(*result.port_job)
            result.port_job = ()  # "a timing is waiting in the worker"
        except WorkbenchError as exc:
            result.port_job = None
            result.port_note += f" (not timed: {exc.message})"
        except Exception as exc:  # noqa: BLE001 -- the port is verified; say why it has no timing
            result.port_job = None
            result.port_note += f" (not timed: {type(exc).__name__}: {str(exc)[:300]})"
        result.stage_seconds["port timing"] = time.perf_counter() - start
        result.seconds += result.stage_seconds["port timing"]
    if result.mask is not None:
        result.mask = MaskInfo.of(result.mask)
    return result


def _worker_time(key) -> dict:
    return _TIMING_JOBS.pop(key).measure()


def _run_in_workers(targets, args, workers: int, bar) -> list[MaskResult]:
    q_len, kv_len, heads, batch = args[:4]
    timeout = args[-1]
    threads = max(1, (os.cpu_count() or 2) // workers)
    env = {"TORCHINDUCTOR_COMPILE_THREADS": str(threads), "OMP_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false"}
    results: list[MaskResult | None] = [None] * len(targets)
    owner: dict[int, int] = {}
    with Pool(workers, env=env) as pool:
        bar.set_postfix_str(f"{workers} worker processes compiling")
        jobs = {i: (i, t, p, *args) for i, (t, p) in enumerate(targets)}
        for i, worker, value in pool.map("workbench.report:_worker_analyze", jobs):
            t, p = targets[i]
            if isinstance(value, (WorkerDied, WorkerFailed)):
                value = MaskResult(target=t, params=p, error=f"{t}: {value}")
            results[i], owner[i] = value, worker
            bar.update()
            bar.set_postfix_str(_time_line([r for r in results if r is not None]))
        # the timings, one at a time: nothing else runs on the GPU meanwhile
        for i, r in enumerate(results):
            if r.port_job is None:
                continue
            r.port_job = None
            bar.set_postfix_str(f"timing {r.target}'s port beside FlexAttention")
            t0 = time.perf_counter()
            timing = pool.call(owner[i], "workbench.report:_worker_time", i, timeout=timeout)
            spent = time.perf_counter() - t0
            r.stage_seconds["port timing"] = r.stage_seconds.get("port timing", 0.0) + spent
            r.seconds += spent
            if isinstance(timing, (WorkerDied, WorkerFailed)):
                r.port_note += f" (not timed: {timing})"
            else:
                r.port_timing = timing
    for r in results:  # the mods again, here, for whoever reads the results
        if isinstance(r.mask, MaskInfo):
            try:
                r.mask = prepare(r.target, r.params, q_len, kv_len, "cpu", heads=heads, batch=batch)
            except Exception:  # noqa: BLE001 -- the stand-in says all the report shows
                pass
    return results


def _stage_totals(results: list[MaskResult]) -> dict:
    totals: dict[str, float] = {}
    for r in results:
        for name, sec in r.stage_seconds.items():
            totals[name] = totals.get(name, 0.0) + sec
    return {k: round(v, 2) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def _time_line(results: list[MaskResult]) -> str:
    """Where the time went so far, e.g. "port 41%, verify 30%, invariance 17%, ..." (of the
    seconds spent in stages, summed over masks)."""
    totals = _stage_totals(results)
    whole = sum(totals.values()) or 1.0
    return ", ".join(f"{k} {v / whole:.0%}" for k, v in list(totals.items())[:4])


def _result_record(r: MaskResult) -> dict:
    rec = dict(target=r.target, params=_params(r), given_params=r.params, name=r.mask.name if r.mask else None,
               status=status(r), error=r.error, seconds=round(r.seconds, 3),
               stage_seconds={k: round(v, 3) for k, v in r.stage_seconds.items()})
    if r.stats is not None:
        rec["stats"] = r.stats.to_dict()
    if r.verdict is not None:
        rec["verify"] = r.verdict.to_dict()
    elif r.verify_note:
        rec["verify"] = {"note": r.verify_note}
    if r.spec is not None:
        rec["porting"] = {"spec": r.spec_path, "shape": r.spec.doc["shape"], "pattern": r.spec.doc["pattern"],
                          "score": r.spec.doc["score"]["kind"], "exact": r.spec.supported,
                          "unsupported": r.spec.unsupported}
    elif r.spec_note:
        rec["porting"] = {"note": r.spec_note}
    if r.invariance is not None:
        rec["invariance"] = r.invariance.to_dict()
    elif r.invariance_note:
        rec["invariance"] = {"note": r.invariance_note}
    if r.port_verdict is not None:
        rec["triton_port"] = {"file": r.port_note, "verify": r.port_verdict.to_dict(), "timing": r.port_timing}
    elif r.port_note:
        rec["triton_port"] = {"note": r.port_note}
    return rec


def summary_frame(results: list[MaskResult]) -> pd.DataFrame:
    rows = []
    for r in results:
        s = r.stats
        rows.append(dict(
            name=r.mask.name if r.mask else r.target, target=r.target, params=json.dumps(_params(r)),
            ok=r.error is None, error=r.error or "",
            density=getattr(s, "density", None), block_sparsity=getattr(s, "block_sparsity", None),
            full_blocks=getattr(s, "full_blocks", None), partial_blocks=getattr(s, "partial_blocks", None),
            empty_blocks=getattr(s, "empty_blocks", None), kept_pairs=getattr(s, "kept_pairs", None),
            partial_waste=getattr(s, "partial_waste", None), fully_masked_rows=getattr(s, "fully_masked_rows", None),
            differs_across_heads=getattr(s, "differs_across_heads", None),
            verified=None if r.verdict is None else r.verdict.passed,
            verify_rel_err=None if r.verdict is None else max(c.rel_err for c in r.verdict.checks),
            exact_backends=None if r.spec is None else " ".join(r.spec.supported),
            port_verified=None if r.port_verdict is None else r.port_verdict.passed,
            port_rel_err=None if r.port_verdict is None else max(c.rel_err for c in r.port_verdict.checks),
            port_speed_vs_flex=None if not r.port_timing else r.port_timing["speed_vs_flex"],
            invariant=None if r.invariance is None else r.invariance.passed,
            invariance=_invariance_cell(r) if r.invariance is not None else r.invariance_note,
            status=status(r), seconds=round(r.seconds, 3)))
    frame = pd.DataFrame(rows)
    # counts stay integers where some masks have none (pandas would make the column float)
    for col in ("full_blocks", "partial_blocks", "empty_blocks", "kept_pairs", "fully_masked_rows"):
        frame[col] = frame[col].astype("Int64")
    return frame


def _params(r: MaskResult) -> dict:
    """The parameters the mask was built with, defaults included (what the user gave otherwise)."""
    return r.mask.params if r.mask is not None and r.mask.params else r.params


def status(r: MaskResult) -> str:
    """One word per mask for the overview: the worst of what happened to it."""
    if r.error is not None:
        return "error"
    if r.verdict is not None and not r.verdict.passed:
        return "verify failed"
    if r.port_verdict is not None and not r.port_verdict.passed:
        return "port failed"
    if r.verdict is None:
        return "not verified"
    return "ok"


SHARED_FINDINGS = ("captured_scalars",)  # said once above the sections, with the masks they concern


def _at(v) -> str:
    return f"at Lq={v.shape.q_len:,} Lk={v.shape.kv_len:,}, {v.shape.batch} x {v.shape.q_heads} (batch x heads)"


def _plain_table(frame: pd.DataFrame) -> str:
    """A table with one header row (pandas adds an empty one for a named index)."""
    frame = frame.copy()
    frame.index.name = None
    return frame.to_html(escape=True, header=len(frame.columns) > 1)


def _verdict_html(r: MaskResult) -> str:
    esc = html.escape
    v = r.verdict
    if v is None:
        return f"<h3>Verification</h3><p class='na'>{esc(r.verify_note or 'not run')}</p>"
    table = _plain_table(v.to_frame()[["max_abs_err", "rel_err", "worst", "bad_count", "nan_count", "passed"]]
                         .rename_axis(None).reset_index().rename(columns={"index": "tensor"}).set_index("tensor"))
    notes = "".join(f"<li><b>{esc(f.kind)}</b> ({f.severity}): {esc(f.message)}</li>" for f in v.findings
                    if f.kind not in SHARED_FINDINGS)
    compiled = "compiled" if v.compiled else "uncompiled (CPU)"
    return (f"<h3>Verification {_at(v)}</h3><p><span class='pill {'ok' if v.passed else 'bad'}'>"
            f"{'pass' if v.passed else 'FAIL'}</span> {esc(v.line)}</p>"
            f"<p class='na'>FlexAttention {compiled} vs an eager {v.reference_dtype} reference on random inputs.</p>"
            f"{table}{'<ul>' + notes + '</ul>' if notes else ''}")


def _lengths_html(results: list[MaskResult], settings: dict) -> str:
    """Which length each part of a section is at: the report's, and the shorter ones verification,
    specs and ports use (read from the results, not assumed)."""
    esc = html.escape

    def lengths(items):
        return ", ".join(sorted({f"{q:,} x {k:,}" for q, k in items})) or "—"

    verified = [(r.verdict.shape.q_len, r.verdict.shape.kv_len) for r in results if r.verdict is not None]
    specs = [(r.spec.doc["shape"]["q_len"], r.spec.doc["shape"]["kv_len"]) for r in results if r.spec is not None]
    ports = [(r.port_verdict.shape.q_len, r.port_verdict.shape.kv_len) for r in results if r.port_verdict is not None]
    layouts = [(r.invariance.shape.q_len, r.invariance.shape.q_len) for r in results if r.invariance is not None]
    return (f"<p class='na'>Lengths (Lq x Lk): statistics and pictures {settings['q_len']:,} x {settings['kv_len']:,}; "
            f"verification {esc(lengths(verified))}; porting specs {esc(lengths(specs))}; Triton ports "
            f"{esc(lengths(ports))}; layout invariance {esc(lengths(layouts))}. Each section heading names its own.</p>")


def _shared_findings_html(results: list[MaskResult]) -> str:
    """Findings that say the same thing of many masks, stated once with the masks they concern."""
    esc = html.escape
    by_kind: dict[str, list[tuple[str, str]]] = {}
    for r in results:
        for f in (r.verdict.findings if r.verdict is not None else []):
            if f.kind in SHARED_FINDINGS:
                by_kind.setdefault(f.kind, []).append((r.mask.name, f.message))
    items = []
    for kind, hits in by_kind.items():
        message = hits[0][1]
        general = message.split("; ", 1)[1] if "; " in message else message
        names = ", ".join(name for name, _ in hits)
        items.append(f"<li><b>{esc(kind)}</b> (info, {len(hits)} masks: {esc(names)}): {esc(general)}. Each "
                     f"mask's values are in its parameters.</li>")
    return f"<h3>Notes that apply to several masks</h3><ul>{''.join(items)}</ul>" if items else ""


def _invariance_html(r: MaskResult) -> str:
    esc = html.escape
    inv = r.invariance
    if inv is None:
        return f"<h3>Layout invariance</h3><p class='na'>{esc(r.invariance_note or 'not checked')}</p>"
    frame = inv.to_frame()[["bitwise", "max_abs_diff", "max_ulp", "why"]].copy()
    frame["max_abs_diff"] = frame["max_abs_diff"].map(lambda x: f"{x:.3g}")  # last-bit differences, not 0.000000
    table = _plain_table(frame)
    return (f"<h3>Layout invariance at L={inv.shape.q_len:,}, {inv.shape.q_heads} heads, {inv.dtype}</h3>"
            f"<p>{esc(inv.line)}</p>{table}<p class='na'>All layouts: <code>python -m workbench invariance "
            f"{esc(r.target)} --q-len N</code></p>")


def _port_html(r: MaskResult) -> str:
    esc = html.escape
    v = r.port_verdict
    if v is None:
        return f"<h3>Triton port</h3><p class='na'>{esc(r.port_note or 'not generated')}</p>"
    timing = ("" if not r.port_timing else
              f"<p>forward {r.port_timing['dtype']}: port {r.port_timing['port_ms']:.3f} ms, compiled FlexAttention "
              f"{r.port_timing['flex_ms']:.3f} ms ({r.port_timing['speed_vs_flex']:.2f}x Flex's speed)</p>")
    return (f"<h3>Triton port {_at(v)}</h3><p><code>{esc(r.port_note)}</code>: one file, torch and triton only.</p>"
            f"<p><span class='pill {'ok' if v.passed else 'bad'}'>{'pass' if v.passed else 'FAIL'}</span> "
            f"{esc(v.line)}</p>{timing}")


def _porting_html(r: MaskResult) -> str:
    esc = html.escape
    spec = r.spec
    if spec is None:
        return f"<h3>Porting</h3><p class='na'>{esc(r.spec_note or 'not exported')}</p>"
    shape = spec.doc["shape"]
    rows = []
    for target, row in spec.backends_frame().iterrows():
        args = row["arguments"]
        if len(args) > 240:  # long sections fold; every argument is still there
            args_html = (f"<details><summary><code>{esc(args[:120])} ...</code></summary>"
                         f"<code class='args'>{esc(args)}</code></details>")
        else:
            args_html = f"<code class='args'>{esc(args)}</code>"
        mark = "<span class='pill ok'>exact</span>" if row["exact"] else "<span class='pill bad'>no</span>"
        rows.append(f"<tr><td>{esc(target)}</td><td>{mark}</td><td>{args_html}{esc(row['reason'])}</td></tr>")
    return (f"<h3>Porting spec at Lq={shape['q_len']:,} Lk={shape['kv_len']:,}</h3><p>Pattern <b>{esc(spec.doc['pattern']['kind'])}</b> "
            f"<code>{esc(json.dumps(spec.doc['pattern']['params'])[:200])}</code>, score <b>{esc(spec.doc['score']['kind'])}</b>; "
            f"spec at Lq={shape['q_len']} Lk={shape['kv_len']}: <code>{esc(Path(r.spec_path).name)}</code> "
            f"(+ golden vectors)</p><table><tr><th>backend</th><th>exact</th><th>arguments / why not</th></tr>"
            + "".join(rows) + "</table>")


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:0;color:#1d2733;background:#fafbfc}
header{background:#1d3557;color:#fff;padding:18px 28px}header h1{margin:0 0 4px;font-size:22px}
header p{margin:0;opacity:.85;font-size:14px}main{padding:16px 28px;max-width:1400px}
table{border-collapse:collapse;font-size:13px}td,th{padding:4px 10px;border-bottom:1px solid #e3e7ec;text-align:left}
th{background:#eef2f6}section{background:#fff;border:1px solid #e3e7ec;border-radius:8px;padding:14px 18px;margin:18px 0}
section h2{margin:0 0 6px;font-size:18px}.desc{white-space:pre-wrap;font-size:13px;color:#3a4756}
.err{background:#fdecea;border-left:4px solid #d62828;padding:8px 12px;font-size:13px;white-space:pre-wrap}
.figs{display:flex;flex-wrap:wrap;gap:12px;align-items:flex-start}.figs figure{margin:0}
.figs img{max-width:640px;border:1px solid #e3e7ec}figcaption{font-size:12px;color:#5a6776;max-width:640px}
details pre{background:#f4f6f8;padding:10px;font-size:12px;overflow:auto}
.pill{display:inline-block;padding:1px 8px;border-radius:10px;font-size:12px;margin-left:6px}
.ok{background:#e6f4ea;color:#1e6b34}.bad{background:#fdecea;color:#a4161a}
.na{color:#8a96a3;font-size:13px}a{color:#1d70b8}.nw{white-space:nowrap}
.figs img.wide{max-width:100%}code.args{white-space:pre-wrap;word-break:break-all}
"""


def _time_html(results: list[MaskResult], settings: dict) -> str:
    """E.g. "made in 98 s by 8 worker processes; time in stages: port 41%, verify 30%, ..."."""
    if "wall_seconds" not in settings:
        return ""
    workers = settings.get("workers", 1)
    by = f" by {workers} worker processes" if workers > 1 else ""
    return (f"<p>made in {settings['wall_seconds']:.0f} s{by}; time in stages (summed over masks): "
            f"{html.escape(_time_line(results)) or '—'}</p>")


def render_html(results: list[MaskResult], settings: dict) -> str:
    esc = html.escape
    n_err = sum(r.error is not None for r in results)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>flex-workbench report</title>"
             f"<style>{_CSS}</style></head><body><header><h1>flex-workbench report</h1>"
             f"<p>{len(results)} masks · Lq={settings['q_len']:,} Lk={settings['kv_len']:,} · heads={settings['heads']} · "
             f"block {settings['block_size']} · device {esc(str(settings['device']))} · torch {esc(torch.__version__)}"
             f"{' · ' + str(n_err) + ' failed' if n_err else ''}</p>{_time_html(results, settings)}</header><main>"]
    parts.append("<h2>Overview</h2><table><tr><th>mask</th><th>density</th><th>block sparsity</th>"
                 "<th>full / partial / empty blocks</th><th>wasted in partial blocks</th><th>fully masked rows</th>"
                 "<th>varies by head</th><th>verified (largest relative error)</th><th>exact backends</th>"
                 "<th>Triton port: verified, speed vs Flex</th><th>same bits batched / packed</th><th>status</th></tr>")
    for i, r in enumerate(results):
        s = r.stats
        name = r.mask.name if r.mask else r.target
        word = status(r)
        pill = "<span class='pill {}'>{}</span>".format("ok" if word == "ok" else "na" if word == "not verified"
                                                       else "bad", esc(word))
        if s is None:
            cells = "<td colspan=6 class='na'>" + ("score_mod only: see its score view" if r.error is None else "—") + "</td>"
        else:
            cells = (f"<td>{s.density:.2%}</td><td>{s.block_sparsity:.2%}</td>"
                     f"<td>{s.full_blocks:,} / {s.partial_blocks:,} / {s.empty_blocks:,}</td><td>{s.partial_waste:.1%}</td>"
                     f"<td>{s.fully_masked_rows:,}</td><td>{'yes' if s.differs_across_heads else 'no'}</td>")
        v = r.verdict
        verified = ("—" if v is None else f"<span class='pill {'ok' if v.passed else 'bad'}'>"
                    f"{'pass' if v.passed else 'FAIL'}</span> rel err {max(c.rel_err for c in v.checks):.1e}")
        backends = "—" if r.spec is None else esc(", ".join(r.spec.supported) or "none")
        pv = r.port_verdict
        ported = ("—" if pv is None else f"<span class='pill {'ok' if pv.passed else 'bad'}'>"
                  f"{'pass' if pv.passed else 'FAIL'}</span> rel err {max(c.rel_err for c in pv.checks):.1e}"
                  + (f", {r.port_timing['speed_vs_flex']:.2f}x" if r.port_timing else
                     ", not timed (see its section)" if "not timed" in r.port_note else ", speed: GPU only"))
        parts.append(f"<tr><td><a href='#m{i}'>{esc(name)}</a></td>{cells}<td class='nw'>{verified}</td>"
                     f"<td>{backends}</td><td class='nw'>{ported}</td><td>{esc(_invariance_cell(r))}</td><td>{pill}</td></tr>")
    parts.append("</table>")
    parts.append(_lengths_html(results, settings))
    parts.append(_shared_findings_html(results))
    for i, r in enumerate(results):
        name = r.mask.name if r.mask else r.target
        parts.append(f"<section id='m{i}'><h2>{esc(name)}</h2>")
        parts.append(f"<div class='na'>target <code>{esc(r.target)}</code> · params <code>"
                     f"{esc(json.dumps(r.mask.params if r.mask else r.params))}</code> · {r.seconds:.2f} s</div>")
        if r.error:
            parts.append(f"<div class='err'>{esc(r.error)}</div></section>")
            continue
        parts.append(f"<p class='desc'>{esc(r.mask.description.strip())}</p>")
        if r.figures:
            parts.append("<div class='figs'>")
            for title, png in r.figures.items():
                data = base64.b64encode(png).decode()
                wide = " class='wide'" if title == "block map" and r.stats is not None and r.stats.heads > 4 else ""
                parts.append(f"<figure><img{wide} alt='{esc(title)}' src='data:image/png;base64,{data}'>"
                             f"<figcaption>{esc(r.captions.get(title, title))}</figcaption></figure>")
            parts.append("</div>")
        if r.stats is not None:
            st = r.stats
            parts.append(f"<h3>Statistics at Lq={st.q_len:,} Lk={st.kv_len:,}, {st.batch} x {st.heads} (batch x heads)</h3>"
                         + _plain_table(st.to_frame()))
        parts.append(_verdict_html(r))
        parts.append(_invariance_html(r))
        parts.append(_porting_html(r))
        parts.append(_port_html(r))
        parts.append(f"<details><summary>source</summary><pre>{esc(r.mask.source)}</pre></details></section>")
    parts.append("</main></body></html>")
    return "".join(parts)
