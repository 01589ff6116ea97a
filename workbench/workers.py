"""Worker processes for jobs whose steps are mostly compiling (the report on a GPU): each task runs
in whichever worker is free, and a follow-up task can go back to the worker that ran an earlier one,
which still holds what it built (compiled kernels, loaded ports). Plain functions over one class:

    pool = Pool(4, env={"TORCHINDUCTOR_COMPILE_THREADS": "4"})
    for key, worker, value in pool.map("workbench.report:_analyze_job", jobs):   # jobs: {key: args}
        ...
    value = pool.call(worker, "workbench.report:_timing_job", key)                # on that worker
    pool.close()

Workers are fresh Python processes (CUDA cannot be forked, and a caller's script is never run
again in them) that talk over pipes; values come back pickled with every tensor moved to the CPU. A worker that dies (a crash in a kernel, killed for memory) is
replaced, and its task comes back as a `WorkerDied` value, so one bad task never stops the job."""

from __future__ import annotations

import importlib
import io
import os
import pickle
import subprocess
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch

__all__ = ["Pool", "WorkerDied", "WorkerFailed", "default_workers"]


@dataclass
class WorkerDied:
    """The worker running a task exited (exit code `code`) before it answered."""

    code: int | None

    def __str__(self) -> str:
        if self.code is None:
            return "the worker process running it did not answer in time and was stopped"
        return f"the worker process running it exited (code {self.code}) before it answered"


@dataclass
class WorkerFailed:
    """The task raised in the worker (or its value could not be sent back): the traceback, as text."""

    text: str

    def __str__(self) -> str:
        return self.text.strip().splitlines()[-1] if self.text.strip() else "failed"


def default_workers(n_tasks: int, device: str) -> int:
    """How many workers a job of n_tasks compile-bound tasks gets: on a GPU, three per four CPU cores
    (the rest run their compilers), at most 12 and at most n_tasks; on a CPU, 1 (in-process)."""
    if not str(device).startswith("cuda"):
        return 1
    return max(1, min(12, (os.cpu_count() or 2) * 3 // 4, n_tasks))


class _CPUPickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
            return _same, (obj.detach().cpu(),)
        return NotImplemented


def _same(x):
    return x


def _dumps(value) -> bytes:
    buf = io.BytesIO()
    _CPUPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buf.getvalue()


def _resolve(name: str):
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


def _main(read_fd: int, write_fd: int) -> None:
    """A worker's loop: (function name, args) in, ("ok", pickled value) or ("error", traceback) out."""
    incoming, conn = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    while True:
        try:
            message = incoming.recv()
        except EOFError:
            return
        if message is None:
            return
        name, args = message
        try:
            reply = ("ok", _dumps(_resolve(name)(*args)))
        except BaseException:  # noqa: BLE001 -- every failure goes back as text; the worker lives on
            reply = ("error", traceback.format_exc())
        conn.send(reply)


class Pool:
    """`n` worker processes (see the module docstring)."""

    def __init__(self, n: int, env: dict[str, str] | None = None):
        self._env = dict(env or {})
        self._workers: list = [None] * n
        for i in range(n):
            self._start(i)

    def _start(self, i: int) -> None:
        to_child_r, to_child_w = os.pipe()
        to_parent_r, to_parent_w = os.pipe()
        here = str(Path(__file__).resolve().parents[1])  # the folder holding this package
        env = dict(os.environ, **self._env)
        env["PYTHONPATH"] = os.pathsep.join([here] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        proc = subprocess.Popen([sys.executable, "-c", "import sys; from workbench.workers import _main; "
                                 "_main(int(sys.argv[1]), int(sys.argv[2]))", str(to_child_r), str(to_parent_w)],
                                pass_fds=(to_child_r, to_parent_w), env=env, stdin=subprocess.DEVNULL)
        os.close(to_child_r)
        os.close(to_parent_w)
        self._workers[i] = (proc, Connection(to_child_w, readable=False), Connection(to_parent_r, writable=False))

    def __len__(self) -> int:
        return len(self._workers)

    def _answer(self, i: int, timeout: float | None = None):
        """The pending answer of worker i (it has answered or died; after `timeout` seconds without
        an answer it is killed and replaced)."""
        proc, _, conn = self._workers[i]
        try:
            if timeout is not None and not conn.poll(timeout):
                self._replace(i, kill=True)
                return WorkerDied(None)
            status, payload = conn.recv()
        except (EOFError, OSError):
            return WorkerDied(self._replace(i))
        return pickle.loads(payload) if status == "ok" else WorkerFailed(payload)

    def _replace(self, i: int, kill: bool = False) -> int | None:
        proc, send, recv = self._workers[i]
        if kill:
            proc.kill()
        try:
            code = proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        send.close()
        recv.close()
        self._start(i)
        return code

    def map(self, function: str, jobs: dict) -> Iterator[tuple[object, int, object]]:
        """Run function(*args) for each key -> args of `jobs`, each on a free worker; yields
        (key, worker index, value) as they finish. `function` is "module:name"."""
        pending = list(jobs.items())
        running: dict[int, object] = {}  # worker -> key
        while pending or running:
            for i in range(len(self._workers)):
                if i not in running and pending:
                    key, args = pending.pop(0)
                    self._workers[i][1].send((function, tuple(args)))
                    running[i] = key
            by_handle = {self._workers[i][2]: i for i in running}  # a worker that dies closes its pipe too
            for handle in wait(list(by_handle)):
                i = by_handle[handle]
                yield running.pop(i), i, self._answer(i)

    def call(self, worker: int, function: str, *args, timeout: float | None = None):
        """function(*args) on that worker, waited for (at most `timeout` seconds: then WorkerDied(None))."""
        self._workers[worker][1].send((function, args))
        return self._answer(worker, timeout)

    def close(self) -> None:
        for proc, send, recv in self._workers:
            try:
                send.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc, send, recv in self._workers:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            send.close()
            recv.close()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
