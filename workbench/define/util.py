"""Small shared utilities: devices, time limits on user code, output folders, integer ceil."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import Callable

import torch

from workbench.define.mask import WorkbenchError

__all__ = ["check_device", "TimedOut", "call_with_timeout", "output_folder", "cdiv", "same_device", "fill_template",
           "template_body", "load_module"]


def check_device(device: str | torch.device | None) -> torch.device:
    """A device torch can run on here, or a WorkbenchError that says which ones exist."""
    try:
        dev = torch.device(device if device is not None else "cpu")
    except (RuntimeError, TypeError) as exc:
        raise WorkbenchError(f"unknown device {str(device)!r}", "use cpu, cuda or cuda:N") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise WorkbenchError(f"{dev} was asked for but torch sees no GPU here",
                                 "use --device cpu (device='cpu'), or run on a machine with a CUDA GPU")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise WorkbenchError(f"{dev} was asked for but there are {torch.cuda.device_count()} GPU(s)",
                                 f"use cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
    elif dev.type == "meta":
        raise WorkbenchError("device meta holds shapes but no values, and masks, references and kernels need "
                             "values", "use --device cpu (device='cpu') or cuda")
    elif dev.type != "cpu":
        raise WorkbenchError(f"device {dev} is not supported here", "use cpu or cuda")
    return dev


class TimedOut(Exception):
    """User code did not return within its time limit."""


def call_with_timeout(fn: Callable, seconds: float | None):
    """fn() in a daemon thread, waited for at most `seconds` (None: no limit). A call still running
    then raises TimedOut; the thread is left to finish or to die with the process (Python cannot
    stop it), so later work can go on."""
    if seconds is None:
        return fn()
    import threading

    box: dict = {}

    def work():
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller's thread, SystemExit included
            box["error"] = exc

    thread = threading.Thread(target=work, daemon=True, name="workbench-user-code")
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimedOut(f"did not return within {seconds:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def output_folder(path: str | Path, name: str | None = None) -> Path:
    """Create an output folder (and its parents), or a WorkbenchError naming why it cannot be."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise WorkbenchError(f"cannot write to {out}: {exc.strerror or exc}",
                             "pass an output folder you can write to (-o DIR)", name) from exc
    return out


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive integers: blocks of size b covering a tokens."""
    return -(-a // b)


def same_device(a: torch.device, b: torch.device) -> bool:
    """cuda and cuda:0 are the same device when the current device is 0."""
    if a.type != b.type:
        return False
    index = torch.cuda.current_device() if a.type == "cuda" and torch.cuda.is_available() else 0
    return (a.index if a.index is not None else index) == (b.index if b.index is not None else index)


# ---------------------------------------------------------------- generated files: templates and loading

def fill_template(text: str, fills: dict[str, str]) -> str:
    """A kernel template (`port/templates/`, `kernels/templates/`) with each @@NAME@@ marker
    replaced; a marker left unfilled is a bug of the generator, so it raises."""
    for marker, value in fills.items():
        text = text.replace(marker, value)
    left = sorted(set(re.findall(r"@@[A-Z0-9_]+@@", text)))
    if left:
        raise RuntimeError(f"template markers left unfilled: {', '.join(left)}")
    return text


def template_body(path: Path) -> str:
    """A template file's code without its module docstring and leading imports: the part that is
    appended to generated source which has its own imports."""
    text = path.read_text()
    if text.startswith('"""'):
        text = text[text.index('"""', 3) + 3:]
    lines = text.lstrip("\n").splitlines(keepends=True)
    while lines and (lines[0].startswith(("import ", "from ")) or not lines[0].strip()):
        lines.pop(0)
    return "".join(lines)


def load_module(path: str | Path, name: str, *, register: bool = True):
    """Import a Python file as module `name` (the one loader for users' files, generated ports and
    generated source written to disk). `register`: put it in sys.modules first, as a normal import
    does (dataclasses and pickling look it up there)."""
    spec = importlib.util.spec_from_file_location(name, str(path))
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        if register:
            sys.modules.pop(name, None)
        raise
    return module

