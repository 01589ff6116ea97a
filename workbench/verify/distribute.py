"""The float64 reference split by query rows across Ray workers (one GPU each on a GPU machine).

    verify(mask, shape, dtype="bfloat16", device="cuda", workers=2)     # through verify
    compare_on_ray(mask, inputs, out, lse, workers=2, ...)              # forward: checks only
    reference_on_ray(mask, inputs, workers=2)                          # the Reference itself

The kernel under test runs once, where `verify` runs; the reference's rows go out as ranges (more
ranges than workers, so a causal mask's heavier last rows balance out) and each worker computes its
rows exactly as `reference_attention` does. Forward (`compare_on_ray`): one actor per worker draws
q, k, v again from the inputs' seed on its device (checked bit for bit against the caller's; sent
through Ray's object store only where they differ) and computes the reference of its row ranges
while the kernel under test compiles and runs; it then gets those rows of the kernel's output,
compares them there and sends back only the statistics, merged into one check per tensor. (Until
compared, each actor holds its share of the float64 output: B x H x Lq x D x 8 bytes / workers.)
In a Ray session the caller started, the actors stay for the next verification. With gradients
(`reference_on_ray`) the pieces are joined into one Reference: out, lse and dq by rows, dk, dv
(and gradients of captured tensors) summed.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch

from workbench.cluster import import_ray, init_ray
from workbench.define import Mask, WorkbenchError, bind
from workbench.run import Inputs, make_inputs
from workbench.verify.compare import TensorCheck, Tolerance, compare, merge_checks
from workbench.verify.reference import Reference, ReferenceState, reference_attention

__all__ = ["compare_on_ray", "reference_on_ray", "start_rows_workers", "RowsPool", "RowsWorker", "row_ranges",
           "fingerprint", "RANGES_PER_WORKER"]

RANGES_PER_WORKER = 8  # more ranges than workers: a causal mask's heavier last rows balance out
AHEAD_PER_WORKER = 2  # ranges each actor computes before the kernel's output arrives


def row_ranges(q_len: int, pieces: int) -> list[tuple[int, int]]:
    """`pieces` contiguous ranges of [0, q_len) (fewer when there are fewer rows)."""
    pieces = max(1, min(pieces, q_len))
    bounds = [round(i * q_len / pieces) for i in range(pieces + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def _send_by_value(mask: Mask) -> None:
    """Mods defined in a user's file live in a module the workers cannot import: pickle them by
    value (library masks and installed packages go by reference, as usual)."""
    from ray import cloudpickle

    for fn in (mask.mask_mod, mask.score_mod, mask.factory):
        module = sys.modules.get(getattr(fn, "__module__", None) or "")
        name = getattr(module, "__name__", "")
        if module is None or name.split(".")[0] in ("torch", "workbench", "masks", "builtins"):
            continue
        # the workbench loads a target file as `_workbench_user_...` (see define._module_from_file)
        if name.startswith("_workbench_user_") or name == "__main__" or getattr(module, "__spec__", None) is None:
            try:
                cloudpickle.register_pickle_by_value(module)
            except ValueError:  # already registered, or not a module cloudpickle can take by value
                pass


def _moved(inputs: Inputs, device: str, grad_out: bool = True) -> Inputs:
    """The inputs on `device` (with grad_out unless grad_out=False)."""
    g = inputs.grad_out if grad_out else None
    return Inputs(q=inputs.q.to(device), k=inputs.k.to(device), v=inputs.v.to(device), shape=inputs.shape,
                  dtype=inputs.dtype, seed=inputs.seed, grad_out=None if g is None else g.to(device))


def _bound(mask: Mask, shape, device: str) -> Mask:
    """The mask with its captured tables on this worker's device."""
    if device == "cpu":
        return mask

    return bind(mask, shape.q_len, shape.kv_len, device)


def _rows_on_worker(mask: Mask, inputs: Inputs, rows: tuple[int, int], backward: bool, dtype, memory_budget,
                    device: str) -> Reference:
    ref = reference_attention(_bound(mask, inputs.shape, device), _moved(inputs, device), backward=backward,
                              dtype=dtype, memory_budget=memory_budget, progress=False, rows=rows)
    ref.out, ref.lse = ref.out.cpu(), ref.lse.cpu()
    ref.grads = {k: v.cpu() for k, v in ref.grads.items()}
    return ref


def _start_ray(workers: int, gpu: bool, address: str | None):
    """Ray, checked and started (locally unless `address`); returns (ray, started_here)."""
    ray = import_ray()
    if workers < 1:
        raise WorkbenchError(f"workers = {workers} must be at least 1", "pass workers >= 1")
    if gpu and torch.cuda.device_count() < workers and address is None:
        raise WorkbenchError(f"{workers} workers need {workers} GPUs, this machine has {torch.cuda.device_count()}",
                             "pass fewer workers, or --address of a Ray cluster with more GPUs")
    started = not ray.is_initialized()
    if started:
        init_ray(address, num_cpus=None if gpu else workers)
    # each worker asks for one GPU (one CPU without GPUs): a cluster with fewer would leave some
    # workers waiting for ever, so say so now
    need = "GPU" if gpu else "CPU"
    have = ray.cluster_resources().get(need, 0)
    if have < workers:
        if started:
            ray.shutdown()
        raise WorkbenchError(f"{workers} workers need one {need} each; the Ray cluster has {have:g}",
                             f"pass workers <= {int(have)}, or start Ray with more (ray.init(num_cpus=...) / a "
                             "larger cluster)")
    return ray, started


def _put_mask(ray, mask: Mask):
    """The mask in Ray's object store once, for every worker (mods from a user's file by value)."""
    _send_by_value(mask)
    return ray.put(mask)


def _share(ray, mask: Mask, inputs: Inputs, grad_out: bool):
    """The mask and the inputs (on the host) put in Ray's object store once, for every worker."""
    return _put_mask(ray, mask), ray.put(_moved(inputs, "cpu", grad_out))


def _joined(pieces: list[Reference], ranges: list[tuple[int, int]], q_len: int, seconds: float, **rows) -> Reference:
    """One Reference from the pieces of consecutive row ranges; `rows`: its out, lse and grads."""
    return Reference(
        **rows, dtype=pieces[0].dtype, seconds=seconds, chunk=min(p.chunk for p in pieces),
        fully_masked_rows=sum(p.fully_masked_rows for p in pieces),
        masked_row_examples=[e for p in pieces for e in p.masked_row_examples][:8],
        nan_pairs=[e for p in pieces for e in p.nan_pairs][:4], nan_outputs=sum(p.nan_outputs for p in pieces),
        computed_fraction=sum(p.computed_fraction * (b - a) for p, (a, b) in zip(pieces, ranges)) / q_len,
        mask_evaluation="; ".join(sorted({p.mask_evaluation for p in pieces})))


def fingerprint(t: torch.Tensor) -> int:
    """An exact fingerprint of a tensor's bits: the int64 sum of its raw words (order-free, so the
    same on any device, unlike a float sum)."""
    words = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return int(t.detach().contiguous().view(words).sum(dtype=torch.int64))


def _fingerprints(inputs: Inputs) -> tuple[int, int, int]:
    return fingerprint(inputs.q), fingerprint(inputs.k), fingerprint(inputs.v)


class RowsWorker:
    """A Ray actor on one device: per verification `load` (the mask, and q, k, v drawn again from
    the inputs' seed, checked bit for bit), `reference_rows` for the ranges it computes ahead, then
    `compare_rows` for each range the caller hands it. It outlives one verification when Ray was
    already running (see `start_rows_workers`)."""

    def __init__(self, device: str):
        self.device, self.mask = device, None
        self._forget()

    def _forget(self) -> None:
        self.inputs, self.state = None, ReferenceState()
        self.kept: dict[tuple[int, int], Reference] = {}
        self.busy = {"load_s": 0.0, "rows_s": 0.0, "ranges": 0}

    def warm_up(self) -> float:
        """Once per actor: torch.compile's imports and the device's libraries, which the reference
        needs at length (seconds in a new process) -- done while the caller still prepares."""
        t0 = time.perf_counter()
        x = torch.ones(64, device=self.device, dtype=torch.float64)
        torch.compile(lambda t: (t * 2 > 1) & (t < 3), dynamic=True)(x)
        (x[:8, None] @ x[None, :8]).sum().item()
        return time.perf_counter() - t0

    def load(self, mask: Mask, shape, dtype_name: str, seed: int | None, prints, dtype, memory_budget) -> bool:
        """This verification's mask and inputs. The inputs are drawn here from their seed instead
        of crossing Ray's object store (3 GiB at 1M tokens); False when they do not match the
        caller's bits (then the caller sends them: `load_inputs`)."""

        t0 = time.perf_counter()
        self._forget()  # (the last verification's k, v and kept rows go)
        if self.device != "cpu":
            torch.cuda.empty_cache()  # (the last verification's tensors)
        self.mask, self.dtype, self.memory_budget = _bound(mask, shape, self.device), dtype, memory_budget
        if seed is None:
            return False
        drawn = make_inputs(shape, dtype_name, self.device, seed=seed)
        if _fingerprints(drawn) != tuple(prints):
            return False
        self.inputs = drawn
        self.busy["load_s"] = time.perf_counter() - t0
        return True

    def load_inputs(self, inputs: Inputs) -> None:
        self.inputs, self.state = _moved(inputs, self.device, grad_out=False), ReferenceState()

    def _reference(self, rows: tuple[int, int]) -> Reference:
        t0 = time.perf_counter()
        ref = reference_attention(self.mask, self.inputs, dtype=self.dtype, memory_budget=self.memory_budget,
                                  progress=False, rows=rows, state=self.state)
        if self.device != "cpu":
            torch.cuda.synchronize()
        self.busy["rows_s"] += time.perf_counter() - t0
        self.busy["ranges"] += 1
        return ref

    def reference_rows(self, ranges: list[tuple[int, int]]) -> bool:
        """The reference of these row ranges, kept here for `compare_rows` (queued right after
        `load`, so it runs while the caller's kernel under test compiles and runs). False, doing
        nothing, when the inputs are still to be sent."""
        if self.inputs is None:
            return False
        for rows in ranges:
            self.kept[rows] = self._reference(rows)
        return True

    def compare_rows(self, rows: tuple[int, int], out: torch.Tensor, lse: torch.Tensor | None, out_tol: Tolerance,
                     lse_tol: Tolerance) -> tuple[tuple[int, int], list[TensorCheck], Reference, dict]:
        """These rows of the kernel's output against the reference (computed now unless kept);
        the statistics go back, with this actor's busy seconds so far."""
        ref = self.kept.pop(rows, None) or self._reference(rows)
        checks = [compare("out", out, ref.out, out_tol)]
        if lse is not None:
            checks.append(compare("lse", lse, ref.lse, lse_tol))
        ref.out = ref.lse = None  # the statistics travel back, not the rows
        return rows, checks, ref, dict(self.busy, device=self.device)


@dataclass
class RowsPool:
    """Ray and one RowsWorker actor per worker (`start_rows_workers`), loading one verification."""

    ray: object
    actors: list
    started: bool  # Ray was started for this pool: shut it down when the pool is closed
    gpu: bool
    t0: float
    loads: list = field(default_factory=list)  # the actors' `load` futures for this verification
    ahead: list = field(default_factory=list)  # per actor, the ranges it computes before the output comes
    queued: list = field(default_factory=list)  # the other ranges, heaviest first, dealt as actors free up
    computing: list = field(default_factory=list)  # the actors' `reference_rows` futures
    sent_inputs: int = 0  # actors that needed the inputs sent (their seed drew other bits)
    reused: bool = False  # the actors served an earlier verification of this session
    warm_up_s: list = field(default_factory=list)  # per actor, its one-time warm-up (new actors only)

    def close(self, failed: bool = False) -> None:
        if self.started:
            self.ray.shutdown()
        elif failed:  # a pool that failed is not handed to the next verification
            _kept.pop(next((k for k, p in _kept.items() if p is self), None), None)
            for actor in self.actors:
                self.ray.kill(actor)


# Pools kept across verifications while a Ray session the caller started is running: a new
# process per actor (imports, CUDA context, compiles) costs tens of seconds on a GPU machine.
_kept: dict[tuple, RowsPool] = {}


def start_rows_workers(mask: Mask, inputs: Inputs, workers: int, *, dtype: torch.dtype = torch.float64,
                       memory_budget: int | None = None, address: str | None = None) -> RowsPool:
    """The actors for one verification: they load its mask and inputs and compute their first
    rows of the reference while the caller goes on (verify compiles and runs the kernel under test
    meanwhile); `compare_on_ray(pool=...)` then hands out the rest and compares. Ray started here
    stops with the pool; in a Ray session already running (ray.init by the caller) the actors stay
    for the next verification with the same workers."""
    gpu = inputs.device.type == "cuda"
    ray, started = _start_ray(workers, gpu, address)
    t0 = time.perf_counter()
    key = (workers, gpu, address)
    if started:
        _kept.clear()  # handles from an earlier Ray session are dead
    try:
        pool = None if started else _kept.get(key)
        if pool is not None:
            pool.t0, pool.loads, pool.sent_inputs, pool.reused, pool.warm_up_s = t0, [], 0, True, []
        else:
            actor = ray.remote(num_gpus=1 if gpu else 0, num_cpus=1, max_restarts=1, max_task_retries=1)(RowsWorker)
            pool = RowsPool(ray, [actor.remote("cuda" if gpu else "cpu") for _ in range(workers)], started, gpu, t0)
            if gpu:
                pool.warm_up_s = [a.warm_up.remote() for a in pool.actors]
            if not started:
                _kept[key] = pool
        shared_mask = _put_mask(ray, mask)
        prints = _fingerprints(inputs)
        pool.loads = [a.load.remote(shared_mask, inputs.shape, inputs.dtype, inputs.seed, prints, dtype, memory_budget)
                      for a in pool.actors]
        # Ranges go out last rows first: under causal-like masks later rows keep more keys, so
        # ending on light ranges leaves actors idle for little. Each actor computes its first
        # AHEAD_PER_WORKER ranges as soon as it has loaded; the rest go to whichever actor frees up
        # (the one sharing its GPU with the kernel under test does less).
        ranges = row_ranges(inputs.shape.q_len, workers * RANGES_PER_WORKER)[::-1]
        first = ranges[:workers * AHEAD_PER_WORKER]
        pool.ahead = [first[i::workers] for i in range(workers)]
        pool.queued = ranges[len(first):]
        pool.computing = [a.reference_rows.remote(r) for a, r in zip(pool.actors, pool.ahead)]
    except BaseException:
        if started:
            ray.shutdown()
        raise
    return pool


def compare_on_ray(mask: Mask, inputs: Inputs, out: torch.Tensor, lse: torch.Tensor | None, workers: int,
                   out_tol: Tolerance, lse_tol: Tolerance, *, dtype: torch.dtype = torch.float64,
                   memory_budget: int | None = None, address: str | None = None,
                   progress: bool = True, pool: RowsPool | None = None) -> tuple[list[TensorCheck], Reference]:
    """Forward verification split by query rows: `out` (and `lse`, unless None) of the kernel under
    test against the reference, each range compared on a worker. Returns the merged checks and a
    Reference holding everything but the rows (out and lse are None). `pool`: actors started
    earlier for the same mask and inputs (closed here); by default they are started now."""
    from tqdm.auto import tqdm

    pool = pool or start_rows_workers(mask, inputs, workers, dtype=dtype, memory_budget=memory_budget,
                                      address=address)
    ray = pool.ray
    failed = True
    try:
        drawn = ray.get(pool.loads)
        if not all(drawn):  # this device drew other bits from the seed: send the inputs once
            shared = ray.put(_moved(inputs, "cpu", grad_out=False))
            for i, ok in enumerate(drawn):
                if not ok:  # (its `reference_rows` found no inputs and did nothing: queue it again)
                    pool.actors[i].load_inputs.remote(shared)
                    pool.computing[i] = pool.actors[i].reference_rows.remote(pool.ahead[i])
            pool.sent_inputs = drawn.count(False)
        pending, waiting = {}, [0] * len(pool.actors)  # future -> (actor, rows); ranges queued per actor

        def send(i: int, rows: tuple[int, int]) -> None:
            a, b = rows
            rows_lse = None if lse is None else lse[:, :, a:b].cpu()
            pending[pool.actors[i].compare_rows.remote(rows, out[:, :, a:b].cpu(), rows_lse, out_tol, lse_tol)] = (i, rows)
            waiting[i] += 1

        queue = list(pool.queued)
        for i, ranges in enumerate(pool.ahead):
            for rows in ranges:
                send(i, rows)
            if queue:  # one more behind them, so no actor waits for the next hand-out
                send(i, queue.pop(0))
        results, busy = [], [{} for _ in pool.actors]
        with tqdm(total=inputs.shape.q_len, desc=f"reference {mask.name} on {workers} workers", disable=not progress,
                  unit="row", leave=False) as bar:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1)
                i, (a, b) = pending.pop(ready[0])
                rows, checks, ref, busy[i] = ray.get(ready[0])
                results.append((rows, checks, ref))
                waiting[i] -= 1
                if queue and waiting[i] < 2:  # this actor frees up first: it takes the next range
                    send(i, queue.pop(0))
                bar.update(b - a)
        ray.get(pool.computing)  # (an error there surfaces here)
        warm_up = ray.get(pool.warm_up_s)
        failed = False
    finally:
        pool.close(failed)
    for i, w in enumerate(warm_up):
        busy[i]["warm_up_s"] = w
    results.sort(key=lambda r: r[0][0])
    merged = [merge_checks([(r[1][i], r[0][0]) for r in results]) for i in range(len(results[0][1]))]
    joined = _joined([r[2] for r in results], [r[0] for r in results], inputs.shape.q_len,
                     time.perf_counter() - pool.t0, out=None, lse=None, grads={})
    joined.workers = busy
    return merged, joined


def reference_on_ray(mask: Mask, inputs: Inputs, workers: int, *, backward: bool = False,
                     dtype: torch.dtype = torch.float64, memory_budget: int | None = None, address: str | None = None,
                     progress: bool = True) -> Reference:
    """`reference_attention` over `workers` Ray workers; the result lands on the inputs' device."""
    gpu = inputs.device.type == "cuda"
    ray, started = _start_ray(workers, gpu, address)
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    try:
        shared_mask, shared_inputs = _share(ray, mask, inputs, grad_out=True)
        task = ray.remote(num_gpus=1 if gpu else 0, num_cpus=1, max_retries=1)(_rows_on_worker)
        ranges = row_ranges(inputs.shape.q_len, workers * RANGES_PER_WORKER)
        futures = {task.remote(shared_mask, shared_inputs, r, backward, dtype, memory_budget,
                               "cuda" if gpu else "cpu"): i for i, r in reversed(list(enumerate(ranges)))}
        pieces: list[Reference | None] = [None] * len(ranges)
        with tqdm(total=inputs.shape.q_len, desc=f"reference {mask.name} on {workers} workers", disable=not progress,
                  unit="row", leave=False) as bar:
            pending = list(futures)
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                i = futures[ready[0]]
                pieces[i] = ray.get(ready[0])
                bar.update(ranges[i][1] - ranges[i][0])
    finally:
        if started:
            ray.shutdown()
    device = inputs.device
    grads = {}
    for name in pieces[0].grads:
        parts = [p.grads[name] for p in pieces]
        grads[name] = (torch.cat(parts, dim=2) if name == "dq" else torch.stack(parts).sum(0)).to(device)
    return _joined(pieces, ranges, inputs.shape.q_len, time.perf_counter() - t0,
                   out=torch.cat([p.out for p in pieces], dim=2).to(device),
                   lse=torch.cat([p.lse for p in pieces], dim=2).to(device), grads=grads)
