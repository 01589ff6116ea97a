"""Where masks come from: targets (the library in `masks/`, `file.py:factory`, `package.module:fn`,
a mod itself), their parameters, and the one path from a target to a mask ready to run
(`make` -> `bind` -> `prepare`). A factory that declares `q_len` / `kv_len` / `device` keywords
gets them filled in, so the same pattern is rebuilt for any size and device."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import pkgutil
import re
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from workbench.define.evaluate import probe
from workbench.define.mask import (CONTEXT_KEYS, Mask, WorkbenchError, mod_role, returned_role, with_score)
from workbench.define.trace import captured_tensors
from workbench.define.util import check_device, load_module, same_device

__all__ = ["parse_params", "factory_params", "library", "library_variants", "load_factory", "make", "prepare",
           "bind", "check_captured_devices"]


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
        except json.JSONDecodeError as exc:
            if raw.strip()[:1] in ("[", "{", '"') or re.fullmatch(r"[-+.\d eE]+", raw.strip() or "x"):
                raise WorkbenchError(f"--param {key.strip()}={raw} is not valid JSON ({exc.msg} at character "
                                     f"{exc.pos})", "quote it for the shell and close every bracket, e.g. "
                                     f"--param '{key.strip()}=[1, 2]'") from exc
            params[key.strip()] = raw  # a plain word is taken as a string
    return params


def factory_params(factory: Callable) -> dict[str, Any]:
    """A factory's own parameters and their defaults (None where it has none), without the
    context keywords (q_len, kv_len, device) the workbench fills in."""
    out = {}
    for name, p in inspect.signature(factory).parameters.items():
        if name in CONTEXT_KEYS or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        out[name] = None if p.default is p.empty else p.default
    return out


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


def _importable_roots(path: Path) -> list[str]:
    """The file's folder and, when it sits inside packages (folders with __init__.py), the folder
    above the outermost one: what `python path/to/file.py` or an installed package would see."""
    folder = path.resolve().parent
    roots = [folder]
    top = folder
    while (top / "__init__.py").exists() and top.parent != top:
        top = top.parent
    if top != folder:
        roots.append(top)
    return [str(r) for r in roots]


def _run_user_code(what: str, target: str, fn: Callable, *args, **kwargs):
    """Call user code; an exception or a sys.exit() becomes a WorkbenchError naming `what`."""
    try:
        return fn(*args, **kwargs)
    except WorkbenchError:
        raise
    except SystemExit as exc:
        raise WorkbenchError(f"{what} called sys.exit({exc.code!r}); nothing was run",
                             "remove the sys.exit() (put script code under `if __name__ == '__main__':`)",
                             target) from None
    except Exception as exc:  # user code: report, do not crash the run
        raise WorkbenchError(f"{what} failed: {type(exc).__name__}: {exc}",
                             "fix the error in that code (run it on its own to see the traceback)", target) from exc


def _module_from_file(path_text: str, target: str):
    path = Path(path_text)
    if path.is_dir():
        raise WorkbenchError(f"{path_text!r} is a directory, not a Python file", "give path/to/file.py:factory",
                             target)
    if not path.is_file():
        raise WorkbenchError(f"file {path_text!r} does not exist", "give path/to/file.py:factory", target)
    module_name = f"_workbench_user_{path.stem}_{abs(hash(path.resolve()))}"
    if importlib.util.spec_from_file_location(module_name, path) is None:
        raise WorkbenchError(f"{path_text!r} cannot be imported as Python", "give a .py file", target)
    added = [r for r in _importable_roots(path) if r not in sys.path]
    sys.path[:0] = added
    module = _run_user_code(f"importing {path_text}", target, load_module, path, module_name)
    return module, module_name


def _module_from_name(name: str, target: str):
    try:
        module = _run_user_code(f"importing module {name!r}", target, importlib.import_module, name)
    except WorkbenchError as exc:
        if isinstance(exc.__cause__, ModuleNotFoundError):
            raise WorkbenchError(f"cannot import module {name!r} ({exc.__cause__})",
                                 "install the package that provides it, give a file path (path/to/file.py:"
                                 "factory), or set PYTHONPATH", target) from None
        raise
    return module, module.__name__


def load_factory(target: str) -> Callable:
    """A library name, `path/to/file.py:function`, or `package.module:function` (an installed
    package, e.g. attn_gym.masks.natten:generate_natten)."""
    if ":" in target:
        path_text, _, func_name = target.rpartition(":")
        is_module = not path_text.endswith(".py") and "/" not in path_text and "\\" not in path_text and \
            not Path(path_text).exists() and all(p.isidentifier() for p in path_text.split("."))
        module, module_name = (_module_from_name(path_text, target) if is_module
                               else _module_from_file(path_text, target))
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


def _coerce_params(factory: Callable, sig, params: dict, context: dict) -> dict:
    """Values from the command line (JSON) made into what the factory takes: a list becomes a
    tensor where the parameter is annotated as a Tensor, and a string names a target (a library
    mask, file.py:factory, module:function) where the factory takes a mod (a Callable)."""
    if sig is None:
        return params
    hints = {}
    try:
        import typing

        hints = typing.get_type_hints(factory)
    except Exception:
        hints = {n: p.annotation for n, p in sig.parameters.items() if p.annotation is not p.empty}
    out = dict(params)
    for key, value in params.items():
        hint = hints.get(key)
        text = str(hint)
        if hint in (int, float) and (isinstance(value, (str, list, dict)) or value is None):
            raise WorkbenchError(f"parameter {key} takes {hint.__name__}, got {json.dumps(value)}",
                                 f"give a number, e.g. --param {key}=64", getattr(factory, "__name__", None))
        if isinstance(value, (list, int, float)) and not isinstance(value, bool) and (
                hint is torch.Tensor or "Tensor" in text and "Callable" not in text):
            out[key] = torch.tensor(value, device=context.get("device") or "cpu")
        elif isinstance(value, str) and ("Callable" in text or key.endswith("mod") or key.endswith("_fn")):
            inner = make(value, q_len=context.get("q_len"), kv_len=context.get("kv_len"), device=context.get("device"))
            mod = inner.mask_mod or inner.score_mod
            if mod is None:
                raise WorkbenchError(f"parameter {key}={value!r} names a target with no mod", "name a mask target",
                                     getattr(factory, "__name__", None))
            out[key] = mod
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]


def _out_of_memory(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in text \
        or "out of memory" in text.lower()


def _hint_text(hint) -> str:
    return getattr(hint, "__name__", None) if isinstance(hint, type) else str(hint).replace("typing.", "")


def _matches(value, hint) -> bool | None:
    """Does a JSON-ish value fit a simple annotation (int, float, bool, str, list[...], tuple,
    dict, Optional / unions of these)? None where the annotation is not one of those."""
    import types as pytypes
    import typing

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, getattr(pytypes, "UnionType", ())):
        verdicts = [_matches(value, a) for a in args]
        return None if None in verdicts else any(verdicts)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int)
    if hint is float:
        return isinstance(value, (int, float))
    if hint is str:
        return isinstance(value, str)
    if hint in (list, tuple) or origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        inner = [a for a in args if a is not Ellipsis]
        if origin is list and inner:
            verdicts = [_matches(v, inner[0]) for v in value]
            return None if None in verdicts else all(verdicts)
        return True
    if hint is dict or origin is dict:
        return isinstance(value, dict)
    return None


def _check_param_types(factory: Callable, sig, params: dict, fname: str) -> None:
    """A parameter whose value cannot be what the factory's annotation says: name it, before the
    factory fails somewhere inside (a list of ints given as a string)."""
    if sig is None:
        return
    try:
        import typing

        hints = typing.get_type_hints(factory)
    except Exception:
        return
    for key, value in params.items():
        hint = hints.get(key)
        if hint is None or isinstance(value, torch.Tensor) or callable(value):
            continue
        if _matches(value, hint) is False:
            shown = json.dumps(value) if isinstance(value, (str, int, float, bool, list, dict, type(None))) else repr(value)
            raise WorkbenchError(f"parameter {key} takes {_hint_text(hint)}, got {shown} ({type(value).__name__})",
                                 f"give {key} as the factory documents it (--param {key}=JSON)", fname)


def make(factory: Callable | str, params: dict[str, Any] | None = None, *, q_len: int | None = None,
         kv_len: int | None = None, device: str | torch.device | None = None) -> Mask:
    """Call a factory with user parameters plus the context keywords it declares.

    factory:  a library name ("document"), "path/file.py:factory", "package.module:factory", a
              factory function, or a mod itself (four or five required positional arguments:
              mask_mod(b, h, q_idx, kv_idx) / score_mod(score, b, h, q_idx, kv_idx))
    params:   the factory's parameters ({"window": 256}); JSON lists become tensors where the
              factory annotates a Tensor, and strings name targets where it takes a mod
    q_len, kv_len, device: filled in for a factory that declares them (so the pattern is rebuilt
              for any size); a mask's captured tensors are made on `device`

    A factory may also return a bare mask_mod or score_mod; it is wrapped into a Mask named after
    the factory.

        >>> mask = make("document", {"doc_lengths": [3, 5]}, q_len=8, kv_len=8)
        >>> mask.name, tuple(mask.data["document_id"].tolist())
        ('document_causal_2docs', (0, 0, 0, 1, 1, 1, 1, 1))
    """
    if isinstance(factory, str):
        factory = load_factory(factory)
    params = dict(params or {})
    fname = getattr(factory, "__name__", "mask")
    role = mod_role(factory, params)
    if role is not None:
        role = returned_role(factory, fname)
        return Mask(name=fname, description=inspect.getdoc(factory) or "", **{role: factory})
    if params and mod_role(factory) in ("mask_mod", "score_mod") and not any(
            k in inspect.signature(factory).parameters for k in params):
        raise WorkbenchError(f"{fname} is a mod itself, so it takes no parameters, got {', '.join(params)}",
                             "drop --param, or point at the factory that builds the mod", fname)
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
    if sig is not None:
        missing = [n for n, p in sig.parameters.items() if p.default is p.empty and n not in CONTEXT_KEYS
                   and n not in params and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if missing:
            raise WorkbenchError(f"the factory needs values for {', '.join(missing)}",
                                 "give each with --param NAME=JSON (in Python: make(target, {...}))", fname)
    context = {"q_len": q_len, "kv_len": kv_len,
               "device": None if device is None else torch.device(device)}
    _check_param_types(factory, sig, params, fname)
    kwargs = _coerce_params(factory, sig, params, context)
    if sig is not None:
        for key, value in context.items():
            if key in sig.parameters and value is not None:
                kwargs[key] = value
    try:
        result = factory(**kwargs)
    except WorkbenchError as exc:
        raise exc.for_mask(fname)
    except SystemExit as exc:
        raise WorkbenchError(f"the factory called sys.exit({exc.code!r})", "return a Mask or a mod instead of "
                             "exiting", fname) from None
    except Exception as exc:
        if _out_of_memory(exc):
            sizes = ", ".join(f"{k}={v:,}" for k, v in (("q_len", q_len), ("kv_len", kv_len)) if v is not None)
            raise WorkbenchError(f"the factory ran out of memory building the mask at {sizes or 'these sizes'} "
                                 f"({_first_line(exc)})", "use shorter lengths: its per-token tables grow with "
                                 "the sequence", fname) from None
        raise WorkbenchError(f"factory raised {type(exc).__name__}: {exc}",
                             "check the parameters against the factory's docstring", fname) from exc
    if isinstance(result, Mask):
        mask = result
    elif callable(result):
        role = returned_role(result, fname)
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


def prepare(target: Callable | str | Mask, params: dict[str, Any] | None = None, q_len: int = 1024,
            kv_len: int | None = None, device: str | torch.device = "cpu", score: Callable | str | None = None,
            score_params: dict[str, Any] | None = None, heads: int | None = None, batch: int | None = None) -> Mask:
    """The one path from a target to a mask ready to run: make (factory + parameters, or a Mask as
    it is), add a score target, bind to these lengths and this device, probe the mods. The CLI,
    the report and the app all start here."""
    kv_len = kv_len or q_len
    device = check_device(device)
    mask = target if isinstance(target, Mask) else make(target, params, q_len=q_len, kv_len=kv_len, device=device)
    if score is not None:
        mask = with_score(mask, make(score, score_params, q_len=q_len, kv_len=kv_len, device=device))
    mask = bind(mask, q_len, kv_len, device)
    # probe at most the heads and batch entries the run has (a per-sample table may hold one entry)
    probe(mask, q_len=min(37, q_len), kv_len=min(45, kv_len), heads=min(2, heads or 2), batch=min(2, batch or 1),
          device=device)
    return mask


def check_captured_devices(mask: Mask, device: str | torch.device, data_only: bool = False) -> None:
    """The one rule for where a mask's tensors live: every tensor its mods capture (`Mask.data`
    and closures, or only `Mask.data`) is on the run's device, else an error naming the tensor."""
    device = torch.device(device)
    tensors = mask.data if data_only else captured_tensors(mask)
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor) or same_device(tensor.device, device):
            continue
        raise WorkbenchError(
            f"captured tensor {name!r} ({tuple(tensor.shape)}, {str(tensor.dtype).removeprefix('torch.')}) is on "
            f"{tensor.device}, the run is on {device}; a kernel there cannot read it",
            f"create {name!r} on {device} (a factory with a `device` keyword gets it filled in: "
            f"make(..., device={str(device)!r})), or move it with .to({str(device)!r}) before defining the mod",
            mask.name)


def bind(mask: Mask, q_len: int, kv_len: int, device: str | torch.device = "cpu") -> Mask:
    """The same pattern rebuilt for these lengths and this device (if its factory can), with
    its captured tensors moved to `device`."""
    device = torch.device(device)
    if mask.parts:  # a mask + score: each part follows the lengths its own way
        base, score = (bind(p, q_len, kv_len, device) for p in mask.parts)
        combined = with_score(base, score)
        return combined.replace(name=mask.name) if combined.name != mask.name else combined
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
    check_captured_devices(mask, device, data_only=True)
    if mask.q_len is not None and mask.kv_len is not None and (mask.q_len, mask.kv_len) != (q_len, kv_len):
        raise WorkbenchError(
            f"built for q_len={mask.q_len}, kv_len={mask.kv_len}, asked for {q_len}, {kv_len}",
            "let the factory take `q_len`/`kv_len` keywords so the workbench can rebuild it", mask.name)
    return mask
