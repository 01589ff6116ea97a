"""The port on disk and in use: `write` puts a generated port into a folder, `load` imports it the
way a user would, `run_file` calls it on workbench inputs (on a GPU in this process; on a CPU in
a fresh process under Triton's interpreter, the port's files alone)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch

from workbench.define import Mask, WorkbenchError, output_folder
from workbench.define.util import load_module
from workbench.kernels import interpreting
from workbench.port.generate import CONFIGS, PortSource, generate

__all__ = ["write", "build", "load", "loaded", "run_file", "run_paged_file", "in_process", "triton_installed",
           "require_triton"]


def write(port: PortSource, out_dir: str | Path) -> Path:
    """Write NAME_attention.py (and NAME_attention.safetensors when the mask captures tensors)."""
    out = output_folder(out_dir, port.name)
    path = out / port.file_name
    path.write_text(port.source)
    if port.tensors:
        from safetensors.torch import save_file

        save_file(port.tensors, str(out / port.tensor_file), metadata={"port": port.file_name})
    return path


def build(mask: Mask, q_len: int, kv_len: int | None = None, heads: int | None = None, batch: int | None = None,
          out_dir: str | Path | None = None) -> Path:
    """generate + write: the port's file (in a temporary folder unless `out_dir` is given)."""
    import tempfile

    port = generate(mask, q_len, kv_len, heads, batch)
    folder = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="workbench_port_"))
    return write(port, folder)


def load(path: str | Path):
    """Import a generated port from its file, the way a user would. On a machine without a GPU,
    Triton runs kernels only under its CPU interpreter, which must be switched on
    (TRITON_INTERPRET=1) before triton is first imported: use `run_file` there."""
    path = Path(path)
    if not path.is_file():
        raise WorkbenchError(f"no port file at {path}", "generate it with `python -m workbench port ... -o DIR`")
    return load_module(path, f"{path.stem}_{abs(hash(str(path.resolve()))) % 10**8}")


# the ports run_file has loaded in this process, by (path, contents, pinned config): a file run
# again keeps its compiled kernels and its tile choices, as an engine that imported it once would
_LOADED: dict = {}
_LOADED_MAX = 32


def loaded(path: str | Path, config: int | None = None):
    """The port at `path` as run_file runs it in this process: loaded once per contents (and
    pinned `config`), so later calls reuse its compiled, autotuned kernels. A changed file is
    loaded again."""
    import hashlib

    path = Path(path)
    if not path.is_file():
        raise WorkbenchError(f"no port file at {path}", "generate it with `python -m workbench port ... -o DIR`")
    key = (str(path.resolve()), hashlib.sha256(path.read_bytes()).hexdigest(), config,
           os.environ.get("PORT_CONFIG"), os.environ.get("TRITON_INTERPRET"))
    if key not in _LOADED:
        if len(_LOADED) >= _LOADED_MAX:
            _LOADED.pop(next(iter(_LOADED)))  # the oldest
        _LOADED[key] = _load_pinned(path, config)
    return _LOADED[key]


def _load_pinned(path, config: int | None):
    """load(path), with the file's autotuner replaced by one configuration when `config` is given."""
    if config is None:
        return load(path)
    before = os.environ.get("PORT_CONFIG")
    os.environ["PORT_CONFIG"] = str(config)  # read once, when the file defines its kernel
    try:
        return load(path)
    finally:
        if before is None:
            os.environ.pop("PORT_CONFIG", None)
        else:
            os.environ["PORT_CONFIG"] = before


def triton_installed() -> bool:
    """Can generated ports run here at all (on a CPU, under Triton's interpreter)?"""
    return importlib.util.find_spec("triton") is not None


def require_triton() -> None:
    if not triton_installed():
        raise WorkbenchError("running the port needs Triton, which is not installed",
                             "pip install triton (CPU machines run it under Triton's interpreter), or "
                             "pip install 'flex-workbench[dev]'")


def in_process(device: torch.device) -> bool:
    """Can this process run a port's kernels on `device`? On CUDA yes; on a CPU only when Triton's
    interpreter was on from the start (TRITON_INTERPRET=1 in the environment)."""

    return device.type == "cuda" or (device.type == "cpu" and interpreting())


def run_file(path: str | Path, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
             timeout: float = 1800, cu_seqlens: torch.Tensor | None = None,
             config: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the port at `path` on q, k, v (packed sequences: `cu_seqlens`). In this
    process on a GPU; on a CPU in a fresh process under Triton's interpreter (the port's files
    alone, as a user would run them). `config`: pin the kernel to CONFIGS[config] instead of
    autotuning (the file's PORT_CONFIG switch), as an engine that needs fixed tiles would."""
    if config is not None and (isinstance(config, bool) or not isinstance(config, int)
                               or not 0 <= config < len(CONFIGS)):
        raise WorkbenchError(f"config {config!r} is not one of the port's {len(CONFIGS)} tile configurations",
                             f"pass an index 0..{len(CONFIGS) - 1} of workbench.port.CONFIGS, or None to autotune")
    extra = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
    require_triton()
    if in_process(q.device):
        module = loaded(path, config)
        return _refusals(lambda: module.attention(q, k, v, scale=scale, return_lse=True, **extra))
    tensors = {"q": q, "k": k, "v": v}
    if cu_seqlens is not None:
        tensors["cu_seqlens"] = torch.as_tensor(cu_seqlens)  # as given: the file refuses non-integers
    return _run_interpreted(path, tensors, scale, timeout, q.device)


def run_file_backward(path: str | Path, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
                      scale: float | None = None, timeout: float = 1800, tables: dict | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(out, lse, {"dq", "dk", "dv", "dNAME" per table}) of the port at `path`: its forward on q,
    k, v and its backward for the upstream gradient `grad_out` [B, Hq, Lq, D]. `tables`: {name:
    tensor} the port's tables to learn (its `tables=`). Where it runs as `run_file` says."""
    require_triton()
    tables = dict(tables or {})
    if in_process(q.device):
        module = loaded(path)

        def call():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            learn = {n: t.detach().requires_grad_() for n, t in tables.items()}
            with torch.enable_grad():
                out, lse = module.attention(*leaves, scale=scale, return_lse=True, tables=learn)
                grads = torch.autograd.grad(out, [*leaves, *learn.values()], grad_out)
            return out.detach(), lse.detach(), dict(zip(("dq", "dk", "dv", *(f"d{n}" for n in learn)), grads))

        return _refusals(call)
    names = ("out", "lse", "dq", "dk", "dv", *(f"dtable.{n}" for n in tables))
    result = _run_interpreted(path, {"q": q, "k": k, "v": v, "grad_out": grad_out,
                                     **{f"table.{n}": t.detach() for n, t in tables.items()}}, scale, timeout,
                              q.device, names=names)
    return result[0], result[1], dict(zip(("dq", "dk", "dv", *(f"d{n}" for n in tables)), result[2:]))


def run_paged_file(path: str | Path, step, scale: float | None = None, timeout: float = 1800,
                   invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) [total_q, Hq, D] / [total_q, Hq] of the port's `attention_paged` on `step` (a
    `workbench.port.layout.PagedStep`), with its content checks on (`check=True`), in invariant
    mode if asked. Where it runs as `run_file` says."""
    require_triton()
    if in_process(step.q.device):
        module = loaded(path)
        return _refusals(lambda: module.attention_paged(*step.args(), scale=scale, return_lse=True, check=True,
                                                        invariant=invariant))
    from workbench.port.runner import PAGED_ARGS

    tensors = dict(zip(PAGED_ARGS, step.args()))
    if invariant:
        tensors["invariant"] = torch.ones(1, dtype=torch.int32)
    return _run_interpreted(path, tensors, scale, timeout, step.q.device)


def _refusals(call):
    try:
        return call()
    except (ValueError, TypeError) as exc:  # the file's own checks: sizes it is not valid for
        raise WorkbenchError(f"the port refused the call: {exc}",
                             "call it within what it is valid for (the file's docstring says so)") from exc


def _run_interpreted(path, tensors: dict, scale, timeout, device, names=("out", "lse")) -> tuple:
    """The port's file run on `tensors` in a fresh process under Triton's interpreter."""
    import subprocess
    import tempfile

    from safetensors.torch import load_file, save_file

    folder = Path(tempfile.mkdtemp(prefix="workbench_port_run_"))
    save_file({name: t.contiguous().cpu() for name, t in tensors.items()}, str(folder / "inputs.safetensors"))
    cmd = [sys.executable, "-m", "workbench.port.runner", str(path), str(folder / "inputs.safetensors"),
           str(folder / "outputs.safetensors")] + ([] if scale is None else [repr(float(scale))])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        if done.returncode == 3:
            raise WorkbenchError(f"the port refused the call: {last}",
                                 "call it within what it is valid for (the file's docstring says so)")
        raise WorkbenchError(f"the port failed under Triton's interpreter: {last[:400]}",
                             "run the port file by hand to see the traceback (TRITON_INTERPRET=1 on a CPU)")
    result = load_file(str(folder / "outputs.safetensors"))
    return tuple(result[n].to(device) for n in names)
