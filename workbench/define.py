"""Stage 1, define: a mask is a value.

A `Mask` bundles one attention variant: its FlexAttention mods (plain functions, unchanged),
its parameters, a description, the mods' source and the tensors they capture. Masks come from
factories -- the library in `masks/`, or any `file.py:function` of the user's -- and a factory
may ask for the sizes and device it is used at (`q_len`, `kv_len`, `device` keywords), so the
same pattern can be rebuilt for any length.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import json
import pkgutil
import re
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from workbench import compat

# Keywords the workbench fills in for a factory that declares them; they are not parameters.
CONTEXT_KEYS = ("q_len", "kv_len", "device")


class WorkbenchError(Exception):
    """An error a user can act on: what went wrong, for which mask, and how to fix it."""

    def __init__(self, cause: str, fix: str = "", name: str | None = None):
        self.cause, self.fix, self.name = cause, fix, name
        super().__init__(self.message)

    @property
    def message(self) -> str:
        head = f"{self.name}: " if self.name else ""
        tail = f" Fix: {self.fix}" if self.fix else ""
        return f"{head}{self.cause}.{tail}"

    def for_mask(self, name: str) -> "WorkbenchError":
        return WorkbenchError(self.cause, self.fix, self.name or name)


@dataclass(frozen=True)
class Mask:
    """One attention variant. `mask_mod=None` attends everything; `score_mod=None` keeps scores.

    `data` names the tensors the mods capture (document ids, spans, tables...). `factory` and
    `params` rebuild the mask for other sizes or devices (see `bind`). `q_len`/`kv_len` are the
    lengths it was built for, when its meaning depends on them (None: any length); `heads` the
    number of heads it is defined for, when it indexes per-head data (None: any).
    """

    name: str
    mask_mod: Callable | None = None
    score_mod: Callable | None = None
    params: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    source: str = ""
    data: dict[str, torch.Tensor] = field(default_factory=dict)
    factory: Callable | None = None
    q_len: int | None = None
    kv_len: int | None = None
    heads: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "description", inspect.cleandoc(self.description or ""))
        if not self.source:
            object.__setattr__(self, "source", mod_source(self.mask_mod, self.score_mod))
        check_signature(self.mask_mod, 4, "mask_mod", self.name)
        check_signature(self.score_mod, 5, "score_mod", self.name)

    @property
    def summary(self) -> str:
        """First sentence of the description, on one line."""
        text = " ".join(self.description.split())
        first = re.split(r"(?<!\bal)\.\s+(?=[A-Z(])", text)[0].rstrip(".")
        return first if len(first) <= 110 else first[:107] + "..."

    def replace(self, **changes) -> "Mask":
        return dataclasses.replace(self, **changes)


def mod_source(*mods: Callable | None) -> str:
    parts = []
    for mod in mods:
        if mod is None:
            continue
        try:
            parts.append(textwrap.dedent(inspect.getsource(mod)))
        except (OSError, TypeError):
            parts.append(f"# source of {getattr(mod, '__name__', mod)!r} is not available\n")
    return "\n".join(parts)


def positional_arity(fn: Callable) -> int | None:
    """Number of required positional parameters, as FlexAttention counts them."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in sig.parameters.values() if p.kind in kinds and p.default is p.empty)


def check_signature(mod: Callable | None, want: int, role: str, name: str) -> None:
    if mod is None:
        return
    if not callable(mod):
        raise WorkbenchError(f"{role} is {type(mod).__name__}, not a function",
                             f"pass a function {_SIGNATURES[role]}", name)
    got = positional_arity(mod)
    if got is not None and got != want:
        raise WorkbenchError(
            f"{role} {getattr(mod, '__name__', '?')!r} takes {got} positional arguments, "
            f"FlexAttention calls it with {want}",
            f"define it as {_SIGNATURES[role]}", name)


_SIGNATURES = {
    "mask_mod": "def mask_mod(b, h, q_idx, kv_idx) -> bool tensor",
    "score_mod": "def score_mod(score, b, h, q_idx, kv_idx) -> score",
}


def with_score(mask: Mask, score: Mask) -> Mask:
    """`mask`'s mask_mod with `score`'s score_mod (e.g. causal + softcap)."""
    if score.score_mod is None:
        raise WorkbenchError(f"{score.name!r} has no score_mod", "pick a score target "
                             "such as softcap, alibi, relative_bias or head_bias", mask.name)
    return Mask(
        name=f"{mask.name}+{score.name}", mask_mod=mask.mask_mod, score_mod=score.score_mod,
        params={**mask.params, **{f"score.{k}": v for k, v in score.params.items()}},
        description=f"{mask.description.strip()}\n\nScore: {score.description.strip()}",
        data={**mask.data, **{f"score.{k}": v for k, v in score.data.items()}},
        q_len=mask.q_len or score.q_len, kv_len=mask.kv_len or score.kv_len,
        heads=min((n for n in (mask.heads, score.heads) if n), default=None),
    )


# ---------------------------------------------------------------- targets and parameters

def parse_params(items: list[str] | None) -> dict[str, Any]:
    """`["width=64", "name=abc", "spans=[[0,9]]"]` -> dict; values are JSON, else strings."""
    params: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise WorkbenchError(f"--param {item!r} is not key=value", "write e.g. --param window=256")
        try:
            params[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            params[key.strip()] = raw
    return params


def library() -> dict[str, Callable]:
    """The built-in library: module `masks/NAME.py` holds factory `NAME`."""
    import masks

    found = {}
    for info in sorted(pkgutil.iter_modules(masks.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"masks.{info.name}")
        factory = getattr(module, info.name, None)
        if callable(factory):
            found[info.name] = factory
    return found


def library_variants(name: str) -> list[dict[str, Any]]:
    """Parameter sets shown in the report for a library pattern: defaults, then VARIANTS."""
    module = importlib.import_module(f"masks.{name}")
    return [{}] + [dict(v) for v in getattr(module, "VARIANTS", [])]


def load_factory(target: str) -> Callable:
    """A library name, or `path/to/file.py:function`."""
    if ":" in target:
        path_text, _, func_name = target.rpartition(":")
        path = Path(path_text)
        if not path.is_file():
            raise WorkbenchError(f"file {path_text!r} does not exist", "give path/to/file.py:factory", target)
        module_name = f"_workbench_user_{path.stem}_{abs(hash(path.resolve()))}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        try:
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
        except Exception as exc:  # user code: report, do not crash the run
            sys.modules.pop(module_name, None)
            raise WorkbenchError(f"importing {path_text} failed: {type(exc).__name__}: {exc}",
                                 "fix the error in that file (run `python FILE` to see the traceback)",
                                 target) from exc
        factory = getattr(module, func_name, None)
        if not callable(factory):
            options = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module_name]
            raise WorkbenchError(f"{path_text} has no function {func_name!r}",
                                 f"use one of: {', '.join(options) or '(none defined)'}", target)
        return factory
    try:
        lib = library()
    except Exception as exc:
        raise WorkbenchError(f"importing the mask library failed: {type(exc).__name__}: {exc}",
                             "fix the file in masks/ named in the message", target) from exc
    if target not in lib:
        raise WorkbenchError(f"no library mask named {target!r}",
                             "run `python -m workbench list`, or give path/to/file.py:factory", target)
    return lib[target]


def make(factory: Callable | str, params: dict[str, Any] | None = None, *, q_len: int | None = None,
         kv_len: int | None = None, device: str | torch.device | None = None) -> Mask:
    """Call a factory with user parameters plus the context keywords it declares.

    A factory may also return a bare mask_mod (4 arguments) or score_mod (5 arguments); it is
    wrapped into a Mask named after the factory.
    """
    if isinstance(factory, str):
        factory = load_factory(factory)
    params = dict(params or {})
    fname = getattr(factory, "__name__", "mask")
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        sig = None
    if sig is not None and not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        known = [n for n in sig.parameters if n not in CONTEXT_KEYS]
        for key in params:
            if key not in sig.parameters or key in CONTEXT_KEYS:
                raise WorkbenchError(f"unknown parameter {key!r}",
                                     f"{fname} takes: {', '.join(known) or '(no parameters)'}", fname)
    context = {"q_len": q_len, "kv_len": kv_len,
               "device": None if device is None else torch.device(device)}
    kwargs = dict(params)
    if sig is not None:
        for key, value in context.items():
            if key in sig.parameters and value is not None:
                kwargs[key] = value
    try:
        result = factory(**kwargs)
    except WorkbenchError as exc:
        raise exc.for_mask(fname)
    except Exception as exc:
        raise WorkbenchError(f"factory raised {type(exc).__name__}: {exc}",
                             "check the parameters against the factory's docstring", fname) from exc
    if isinstance(result, Mask):
        mask = result
    elif callable(result):
        arity = positional_arity(result)
        role = {4: "mask_mod", 5: "score_mod"}.get(arity)
        if role is None:
            check_signature(result, 4, "mask_mod", fname)
        mask = Mask(name=fname, params=params, description=inspect.getdoc(factory) or "",
                    **{role: result})
    else:
        raise WorkbenchError(f"factory returned {type(result).__name__}",
                             "return a workbench.Mask, a mask_mod or a score_mod", fname)
    if mask.factory is None:
        mask = mask.replace(factory=factory)
    if not mask.params and params:
        mask = mask.replace(params=params)
    return mask


def same_device(a: torch.device, b: torch.device) -> bool:
    """cuda and cuda:0 are the same device when the current device is 0."""
    if a.type != b.type:
        return False
    index = torch.cuda.current_device() if a.type == "cuda" and torch.cuda.is_available() else 0
    return (a.index if a.index is not None else index) == (b.index if b.index is not None else index)


def bind(mask: Mask, q_len: int, kv_len: int, device: str | torch.device = "cpu") -> Mask:
    """The same pattern rebuilt for these lengths and this device (if its factory can), with
    its captured tensors moved to `device`."""
    device = torch.device(device)
    if mask.factory is not None:
        try:
            sig = inspect.signature(mask.factory)
            wants = {k for k in CONTEXT_KEYS if k in sig.parameters}
        except (TypeError, ValueError):
            wants = set()
        if wants:
            rebuilt = make(mask.factory, mask.params, q_len=q_len, kv_len=kv_len, device=device)
            if rebuilt.score_mod is None and mask.score_mod is not None:
                rebuilt = rebuilt.replace(score_mod=mask.score_mod, name=mask.name)
            mask = rebuilt
    for key, tensor in mask.data.items():
        if not same_device(tensor.device, device):
            raise WorkbenchError(
                f"captured tensor {key!r} is on {tensor.device}, the run is on {device}",
                "let the factory take a `device` keyword and create its tensors there", mask.name)
    if mask.q_len is not None and mask.kv_len is not None and (mask.q_len, mask.kv_len) != (q_len, kv_len):
        raise WorkbenchError(
            f"built for q_len={mask.q_len}, kv_len={mask.kv_len}, asked for {q_len}, {kv_len}",
            "let the factory take `q_len`/`kv_len` keywords so the workbench can rebuild it", mask.name)
    return mask


# ---------------------------------------------------------------- probing a mod

_HINTS = [
    ("data-dependent control flow", "a Python `if`/`and`/`or` or bool() on a tensor",
     "compute both branches and select with torch.where(cond, a, b); combine conditions with & and |"),
    ("Boolean value of Tensor", "a Python `if`/`and`/`or` or bool() on a tensor",
     "compute both branches and select with torch.where(cond, a, b); combine conditions with & and |"),
    (".item()", "a `.item()` call on a tensor", "keep values as tensors; index captured tensors directly"),
    ("item()", "a `.item()` call on a tensor", "keep values as tensors; index captured tensors directly"),
    ("int()", "int()/float() on a tensor", "keep values as tensors (torch ops only)"),
]


def explain_mod_error(exc: BaseException, role: str) -> WorkbenchError:
    text = f"{type(exc).__name__}: {exc}"
    for needle, cause, fix in _HINTS:
        if needle in text:
            return WorkbenchError(f"{role} uses {cause}, which FlexAttention cannot trace "
                                  f"({text.splitlines()[0][:200]})", fix)
    return WorkbenchError(f"{role} failed on probe inputs: {text.splitlines()[0][:300]}",
                          "make it a function of tensors using torch ops only; captured tensors must "
                          "be indexable by every q_idx/kv_idx in range")


def probe(mask: Mask, q_len: int = 37, kv_len: int = 45, heads: int = 2, batch: int = 2,
          device: str | torch.device = "cpu") -> None:
    """Run the mods as FlexAttention would (vmapped over scalars) on a tiny problem and turn
    common mistakes into WorkbenchErrors: Python control flow or .item() on tensors, wrong
    return types. Lengths are clipped to what the mask was built for."""
    q_len = min(q_len, mask.q_len or q_len)
    kv_len = min(kv_len, mask.kv_len or kv_len)
    idx = [torch.arange(n, device=device, dtype=torch.int32) for n in (batch, heads, q_len, kv_len)]
    if mask.mask_mod is not None:
        try:
            out = compat.vmap_bhqkv(mask.mask_mod, *idx)
        except Exception as exc:
            raise explain_mod_error(exc, "mask_mod").for_mask(mask.name) from exc
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
            got = out.dtype if isinstance(out, torch.Tensor) else type(out).__name__
            raise WorkbenchError(f"mask_mod returned {got}, FlexAttention needs a bool tensor",
                                 "return a comparison such as `q_idx >= kv_idx` (combine with & and |)",
                                 mask.name)
    if mask.score_mod is not None:
        score = torch.randn(batch, heads, q_len, kv_len, device=device)
        try:
            out = compat.vmap_bhqkv(mask.score_mod, *idx, score=score)
        except Exception as exc:
            raise explain_mod_error(exc, "score_mod").for_mask(mask.name) from exc
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            got = out.dtype if isinstance(out, torch.Tensor) else type(out).__name__
            raise WorkbenchError(f"score_mod returned {got}, FlexAttention needs a float score",
                                 "return an expression of `score`, e.g. score + bias", mask.name)
