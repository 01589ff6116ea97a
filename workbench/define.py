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
import weakref
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
    lengths it was built for, when its meaning depends on them (None: any length); `heads` /
    `batch` the number of heads / batch entries it is defined for, when it indexes per-head or
    per-sample data (None: any). Whether the mods read `b` or `h` at all is never taken from
    these fields: it is read off the traced mods (`index_reads`).
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
    batch: int | None = None
    # a mask + score (`with_score`): the two masks it was made of, each rebuilt on its own by `bind`
    parts: tuple = ()

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
        if ("mask_mod" in changes or "score_mod" in changes) and "parts" not in changes:
            changes["parts"] = ()  # other mods: no longer the mask + score it was made of
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
    if any(p.kind is p.VAR_POSITIONAL for p in sig.parameters.values()):
        return None  # def mod(*args): FlexAttention's call fits whatever it passes
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in sig.parameters.values() if p.kind in kinds and p.default is p.empty)


_BATCH_NAMES = {"b", "batch", "b_idx", "batch_idx", "bi"}


def returned_role(fn: Callable, name: str) -> str:
    """Whether a function a factory returned is a mask_mod or a score_mod, by its arguments. A
    five-argument function whose first argument is named like the batch index is a mask_mod
    with an argument too many, not a score_mod."""
    arity = positional_arity(fn)
    if arity is None:
        return "mask_mod"
    if arity == 5:
        first = next(iter(inspect.signature(fn).parameters))
        if first in _BATCH_NAMES:
            raise WorkbenchError(f"{getattr(fn, '__name__', 'the mod')!r} takes 5 arguments starting with {first!r}: "
                                 "a mask_mod takes 4 (b, h, q_idx, kv_idx), a score_mod takes the score first",
                                 f"define it as {_SIGNATURES['mask_mod']}, or as {_SIGNATURES['score_mod']}", name)
        return "score_mod"
    if arity != 4:
        check_signature(fn, 4, "mask_mod", name)
    return "mask_mod"


def mod_role(fn: Callable, params: dict | None = None) -> str | None:
    """'mask_mod' / 'score_mod' when a target is itself a mod rather than a factory: it takes no
    --param, declares no Callable/Mask return, and takes only required positional arguments
    (four or five, as FlexAttention calls mods) or *args. Otherwise None (a factory)."""
    if params:
        return None
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    ret = sig.return_annotation
    if ret is not sig.empty and any(word in str(ret) for word in ("Callable", "Mask", "callable")):
        return None
    values = list(sig.parameters.values())
    if any(p.kind is p.VAR_POSITIONAL for p in values):
        return "mask_mod" if all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is not p.empty
                                 for p in values) else None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if not values or any(p.kind not in positional or p.default is not p.empty for p in values):
        return None
    if not {p.name for p in values} & _INDEX_NAMES:
        return None  # a factory whose parameters are all required: it needs --param values
    return {4: "mask_mod", 5: "score_mod"}.get(len(values), "unknown")


_INDEX_NAMES = {"b", "h", "q", "kv", "k", "q_idx", "kv_idx", "score", "batch", "head", "token_q", "token_kv",
                "b_idx", "h_idx", "qi", "ki", "query_idx", "key_idx", "i", "j"}


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
        batch=min((n for n in (mask.batch, score.batch) if n), default=None),
        parts=(mask, score),
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
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise WorkbenchError(f"{path_text!r} cannot be imported as Python", "give a .py file", target)
    module = importlib.util.module_from_spec(spec)
    added = [r for r in _importable_roots(path) if r not in sys.path]
    sys.path[:0] = added
    sys.modules[module_name] = module
    try:
        _run_user_code(f"importing {path_text}", target, spec.loader.exec_module, module)
    except WorkbenchError:
        sys.modules.pop(module_name, None)
        raise
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

    A factory may also return a bare mask_mod (4 arguments) or score_mod (5 arguments); it is
    wrapped into a Mask named after the factory. A target that *is* a mod (four or five required
    positional arguments, e.g. `causal.py:causal_mask`) is taken as the mask itself.
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


def explain_mod_error(exc: BaseException, role: str, mod: Callable | None = None) -> WorkbenchError:
    """Turn an exception raised while evaluating a mod into a WorkbenchError that names the cause
    (the captured tensor, its size or device, the construct FlexAttention cannot trace)."""
    text = f"{type(exc).__name__}: {exc}"
    first = text.splitlines()[0][:200]
    closure = _closure(mod) if mod is not None else {}
    arrays = [n for n, v in closure.items() if type(v).__module__.startswith("numpy") and hasattr(v, "shape")]
    if arrays:
        return WorkbenchError(f"{role} captures the numpy array {arrays[0]!r}; FlexAttention's mods index torch "
                              f"tensors only ({first})",
                              f"capture torch.as_tensor({arrays[0]}) instead, on the device the run uses")
    if "random" in text.lower() and "vmap" in text.lower():
        return WorkbenchError(f"{role} draws random numbers (torch.rand / randn / randint...); a mask or score "
                              f"must give the same value every time it is evaluated ({first})",
                              "draw the random values once, outside the mod, and capture the tensor")
    bound = re.search(r"index (-?\d+) is out of bounds for dimension (\d+) with size (\d+)", text)
    if bound:
        index, size = int(bound.group(1)), int(bound.group(3))
        tensors = {n: t for n, t in closure.items() if isinstance(t, torch.Tensor) and t.dim() > 0}
        named = [n for n, t in tensors.items() if size in t.shape] or list(tensors)
        who = f"the captured tensor {named[0]!r} ({size} entries)" if named else f"a captured tensor ({size} entries)"
        return WorkbenchError(f"{role} reads {who} at index {index}: it is too short for the sizes asked",
                              "give the table one entry per head / batch entry / token asked for, or ask for "
                              f"fewer (at most {size}); a factory that takes q_len/kv_len/device keywords is "
                              "rebuilt for each size")
    if "device" in text and ("same device" in text or "Expected all tensors" in text or "cuda" in text
                             or "expected device" in text):
        tensors = [f"{n!r} on {t.device}" for n, t in closure.items() if isinstance(t, torch.Tensor)]
        return WorkbenchError(f"{role} mixes devices: it captures {', '.join(tensors) or 'a tensor'} ({first})",
                              "create the captured tensors on the run's device (a factory with a `device` "
                              "keyword gets it filled in), or move them with .to(device)")
    for needle, cause, fix in _HINTS:
        if needle in text:
            return WorkbenchError(f"{role} uses {cause}, which FlexAttention cannot trace ({first})", fix)
    return WorkbenchError(f"{role} failed on probe inputs: {text.splitlines()[0][:300]}",
                          "make it a function of tensors using torch ops only; captured tensors must "
                          "be indexable by every q_idx/kv_idx in range")


def _check_result(out, shape: tuple, role: str, name: str) -> None:
    if not isinstance(out, torch.Tensor):
        raise WorkbenchError(f"{role} returned {type(out).__name__}, not a tensor",
                             "return a tensor expression of the index arguments", name)
    if tuple(out.shape) != tuple(shape):
        raise WorkbenchError(f"{role} returned a tensor of shape {tuple(out.shape)[len(shape):] or '()'} per pair; "
                             "FlexAttention needs one value per (b, h, q_idx, kv_idx)",
                             "reduce with .any() / .all() / .sum(), or index captured tables with one index per "
                             "dimension", name)


def probe(mask: Mask, q_len: int = 37, kv_len: int = 45, heads: int = 2, batch: int = 2,
          device: str | torch.device = "cpu") -> None:
    """Run the mods as FlexAttention would (vmapped over scalars) on a tiny problem and turn
    common mistakes into WorkbenchErrors: Python control flow or .item() on tensors, wrong
    return types or shapes, tables too short, numpy arrays, random numbers, and mods that give
    other values when called again (a changing global). Lengths are clipped to what the mask
    was built for; heads / batch to what it is defined for."""
    q_len = min(q_len, mask.q_len or q_len)
    kv_len = min(kv_len, mask.kv_len or kv_len)
    heads = min(heads, mask.heads or heads)
    batch = min(batch, mask.batch or batch)
    idx = [torch.arange(n, device=device, dtype=torch.int32) for n in (batch, heads, q_len, kv_len)]
    shape = (batch, heads, q_len, kv_len)
    for role, mod in (("mask_mod", mask.mask_mod), ("score_mod", mask.score_mod)):
        if mod is None:
            continue
        score = torch.randn(shape, device=device) if role == "score_mod" else None
        results = []
        for _ in range(2):  # twice: a mask must not change between calls
            try:
                with torch.no_grad():
                    results.append(compat.vmap_bhqkv(mod, *idx, score=score))
            except Exception as exc:
                raise explain_mod_error(exc, role, mod).for_mask(mask.name) from exc
        out = results[0]
        _check_result(out, shape, role, mask.name)
        if role == "mask_mod" and out.dtype != torch.bool:
            raise WorkbenchError(f"mask_mod returned {out.dtype}, FlexAttention needs a bool tensor",
                                 "return a comparison such as `q_idx >= kv_idx` (combine with & and |)", mask.name)
        if role == "score_mod" and not out.is_floating_point():
            raise WorkbenchError(f"score_mod returned {out.dtype}, FlexAttention needs a float score",
                                 "return an expression of `score`, e.g. score + bias", mask.name)
        if not torch.equal(results[0], results[1]) and not (
                out.is_floating_point() and torch.equal(results[0].isnan(), results[1].isnan())
                and torch.equal(results[0].nan_to_num(), results[1].nan_to_num())):
            raise WorkbenchError(f"{role} gives different values when called twice on the same indices: it reads "
                                 "something that changes between calls (a global counter, the clock, random numbers)",
                                 "make it a pure function of its arguments and of tensors captured once", mask.name)


# ---------------------------------------------------------------- what a mod captures and reads

def _closure(fn: Callable | None) -> dict[str, object]:
    """The values a function reads from outside: its closure cells, and the module globals it
    names that hold data (tensors, arrays, numbers), by name."""
    code = getattr(fn, "__code__", None)
    out = {}
    for name, cell in zip(getattr(code, "co_freevars", ()), getattr(fn, "__closure__", None) or ()):
        try:
            out[name] = cell.cell_contents
        except ValueError:  # an empty cell
            continue
    module_globals = getattr(fn, "__globals__", {})
    for name in getattr(code, "co_names", ()):
        value = module_globals.get(name)
        if isinstance(value, torch.Tensor) or (hasattr(value, "shape") and hasattr(value, "dtype")):
            out.setdefault(name, value)
    return out


def captured_scalars(fn: Callable | None) -> dict[str, object]:
    """Python numbers a mod captures from its enclosing scope. Dynamo bakes them into the
    compiled kernel, so each new value compiles a new graph."""
    return {k: v for k, v in _closure(fn).items() if isinstance(v, (bool, int, float))}


def lift_scalars(fn: Callable | None, device, q_len: int = 300, kv_len: int = 300
                 ) -> tuple[Callable | None, dict[str, torch.Tensor]]:
    """The mod with the Python numbers its closure holds (ints and floats, not bools) replaced by
    0-d tensors on `device`, so a generated kernel can take them as arguments and every value of
    a parameter shares one compile. (None, {}) when there is nothing to lift, and when the lifted
    mod does not give the same values as the mod on probe regions of the q_len x kv_len problem
    (a number used in Python control flow, say). The probes stay inside those lengths: on a GPU a
    captured table read out of range is a device-side assert, not an exception to catch."""
    import types

    code = getattr(fn, "__code__", None)
    if code is None or not getattr(fn, "__closure__", None):
        return None, {}
    cells, lifted = [], {}
    for name, cell in zip(code.co_freevars, fn.__closure__):
        try:
            value = cell.cell_contents
        except ValueError:
            cells.append(cell)
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < 2 ** 31:
            lifted[name] = torch.tensor(value, dtype=torch.int32 if isinstance(value, int) else torch.float32,
                                        device=device)
            cells.append(types.CellType(lifted[name]))
        else:
            cells.append(cell)
    if not lifted:
        return None, {}
    twin = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, tuple(cells))
    twin.__kwdefaults__ = getattr(fn, "__kwdefaults__", None)
    try:
        one = torch.zeros(1, dtype=torch.int32, device=device)
        q, kv = probe_grid(q_len, kv_len, 24, device)
        how = "broadcast" if elementwise(fn) else "vmap"  # a span's .any() is per pair only under vmap
        with torch.no_grad():
            if not torch.equal(evaluate_mod(fn, how, one, one, q, kv), evaluate_mod(twin, how, one, one, q, kv)):
                return None, {}
        structure = _structure(fn)
        if structure is None or not structure["liftable"]:  # else another value of this knob traced already
            _trace_without_scalar_reads(twin)
    except Exception:  # the number steers Python code: it stays a constant
        return None, {}
    if structure is not None:
        structure["liftable"] = True
    return twin, lifted


class _NoScalarReads(torch.overrides.TorchFunctionMode):
    """Refuses every read of a tensor's value back into Python (item, bool, int, float, index,
    tolist) while a lifted mod is traced: such a read bakes the value of the number it came from
    into the graph (`int(window)`, `if window > 0`), so the graph would not serve other values."""

    READS = {torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
             torch.Tensor.__index__, torch.Tensor.tolist}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            raise ValueError("the mod reads a tensor's value back into Python")
        return func(*args, **(kwargs or {}))


def _trace_without_scalar_reads(twin: Callable) -> None:
    """Trace the lifted mod as FlexAttention traces it (a number in an `if` fails here), refusing
    reads of values into Python; the graph is kept as the twin's trace."""
    def guarded(*args):
        with _NoScalarReads():
            return twin(*args)

    graph = trace_mod(guarded, "mask")
    _traces.setdefault(twin, {})["mask"] = graph


def captured_tensors(mask: Mask) -> dict[str, torch.Tensor]:
    """Tensors the mods read: `Mask.data` plus any tensor in the mods' closures, and in the
    closures of mods they wrap (torch's and_masks / or_masks, attention-gym's factories)."""
    found = {k: t for k, t in mask.data.items() if isinstance(t, torch.Tensor)}
    seen: set[int] = set()

    def walk(fn, depth=0):
        if fn is None or id(fn) in seen or depth > 8:
            return
        seen.add(id(fn))
        for name, value in _closure(fn).items():
            if isinstance(value, torch.Tensor):
                if not any(value is t for t in found.values()):
                    found.setdefault(name if name not in found else f"{name}_{len(found)}", value)
            elif callable(value):
                walk(value, depth + 1)
            elif isinstance(value, (tuple, list)):
                for item in value:
                    if isinstance(item, torch.Tensor) and not any(item is t for t in found.values()):
                        found.setdefault(f"{name}_{len(found)}", item)
                    elif callable(item):
                        walk(item, depth + 1)

    walk(mask.mask_mod)
    walk(mask.score_mod)
    return found


MASK_ARGS = ("b", "h", "q_idx", "kv_idx")
SCORE_ARGS = ("score", "b", "h", "q_idx", "kv_idx")
# ops that read only the dtype, device or shape of their tensor argument, never its value
_SHAPE_ONLY_OPS = {"new_ones", "new_zeros", "new_full", "new_empty", "empty_like", "zeros_like", "ones_like",
                   "full_like", "sym_size", "size", "new_empty_strided"}


# ---------------------------------------------------------------- facts shared by every value of a knob

# A researcher turning a knob makes a new mod per value: the same code, other numbers in its
# closure. Once that code's numbers have been lifted into tensors (lift_scalars) and it still
# traced, its graph, and every fact read off it, cannot depend on them: facts are then kept per
# *structure* (structure_key) and a new value skips the traces. Entries hold the objects their
# key names by id, so an id cannot be reused while its entry lives.
_STRUCTURES_KEPT = 16
_structures: dict = {}  # key -> {"keep": [...], "liftable": bool, "facts": {...}}


def _structure_parts(fn: Callable | None) -> tuple[tuple, list] | None:
    """(key, the objects it names by id). The key is what a mod's traced graph can depend on, with
    the Python numbers of its own closure (those lift_scalars lifts) by type only: code objects,
    closure cells, defaults and the module globals they name (numbers, strings, lists by value;
    tensors by identity, in-place version, shape, dtype and device; functions walked the same
    way; other objects by identity). None: not a plain function, or something unhashable."""
    if getattr(fn, "__code__", None) is None:
        return None
    keep: list = []
    seen: set = set()

    def names_of(code) -> set:
        names = set(code.co_names)
        for const in code.co_consts:
            if hasattr(const, "co_names"):
                names |= names_of(const)
        return names

    def classify(value, depth: int, top_number: bool = False):
        if isinstance(value, bool) or value is None or isinstance(value, str):
            return ("val", value)
        if isinstance(value, (int, float)):
            if top_number and abs(value) < 2 ** 31:  # lifted: any value shares the structure
                return ("num", type(value).__name__)
            return ("val", type(value).__name__, value)
        if isinstance(value, torch.Tensor):
            keep.append(value)
            return ("tensor", id(value), compat.tensor_version(value), tuple(value.shape), value.dtype,
                    str(value.device))
        if isinstance(value, (tuple, list)) and len(value) <= 256:  # a list by value: it can change in place
            return (type(value).__name__,) + tuple(classify(v, depth) for v in value)
        if isinstance(value, dict) and len(value) <= 256:
            return ("dict",) + tuple((k, classify(v, depth)) for k, v in sorted(value.items(), key=repr))
        if hasattr(value, "tobytes") and getattr(value, "nbytes", 1 << 30) <= 1 << 20:  # a numpy array
            keep.append(value)
            return ("array", id(value), hash(value.tobytes()))
        if type(value).__name__ == "module":
            return ("module", value.__name__)
        if getattr(value, "__code__", None) is not None and depth < 4:
            return walk(value, depth + 1)
        keep.append(value)
        return ("obj", id(value))

    def walk(f, depth: int):
        if id(f) in seen:
            return ("seen", id(f))
        seen.add(id(f))
        keep.append(f)
        code = f.__code__
        cells = []
        for cell in f.__closure__ or ():
            try:
                cells.append(classify(cell.cell_contents, depth, top_number=depth == 0))
            except ValueError:  # an empty cell
                cells.append(("empty",))
        module_globals = getattr(f, "__globals__", {})
        named = tuple((n, classify(module_globals[n], depth)) for n in sorted(names_of(code)) if n in module_globals)
        defaults = tuple(classify(v, depth) for v in (f.__defaults__ or ()))
        return ("fn", code, tuple(cells), named, defaults)

    try:
        key = walk(fn, 0)
        hash(key)
    except Exception:  # something unhashable on the way: no sharing
        return None
    return key, keep


def structure_key(fn: Callable | None) -> tuple | None:
    """What a mod's traced graph can depend on (see _structure_parts); None: nothing to share."""
    parts = _structure_parts(fn)
    return None if parts is None else parts[0]


def _structure(fn: Callable | None) -> dict | None:
    """The entry of fn's structure (made on first sight; the least recently used one goes)."""
    parts = _structure_parts(fn)
    if parts is None:
        return None
    key, keep = parts
    entry = _structures.pop(key, None) or {"keep": keep, "liftable": False, "facts": {}}
    _structures[key] = entry  # (the most recently used last)
    while len(_structures) > _STRUCTURES_KEPT:
        _structures.pop(next(iter(_structures)))
    return entry


def structure_fact(fn: Callable | None, fact: tuple, compute: Callable[[], Any]):
    """compute(), or the value it gave for another mod of the same structure whose numbers were
    lifted (see structure_key); kept for the next value of the knob either way."""
    entry = _structure(fn)
    if entry is not None and entry["liftable"] and fact in entry["facts"]:
        return entry["facts"][fact]
    value = compute()
    if entry is not None:
        entry["facts"][fact] = value
    return value


def forget_structures() -> None:
    _structures.clear()


_traces: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # mod -> {role: graph, or the exception tracing raised}


def trace_mod(fn: Callable, role: str = "mask"):
    """The mod traced with make_fx on 0-d int32 index tensors (float32 score), the way
    FlexAttention's tracer sees it: an aten graph (tensor[idx] becomes aten.index). Traced once
    per mod object (the stages ask for it often); a mod that cannot be traced raises each time."""
    from torch.fx.experimental.proxy_tensor import make_fx

    try:
        cached = _traces.setdefault(fn, {})
    except TypeError:  # not weak-referenceable (a builtin): trace every time
        cached = {}
    if role not in cached:
        args = [torch.tensor(0, dtype=torch.int32) for _ in range(4)]
        if role == "score":
            args = [torch.tensor(0.0, dtype=torch.float32)] + args
        try:
            with compat.getitem_as_index():
                cached[role] = make_fx(fn)(*args)
        except Exception as exc:
            cached[role] = exc
    if isinstance(cached[role], Exception):
        raise cached[role]
    return cached[role]


def op_name(target) -> str:
    """`aten.add.Tensor` -> 'add'."""
    name = getattr(target, "_opname", None) or getattr(target, "__name__", str(target))
    return name.split(".")[0]


def _data_flow(mod: Callable, role: str) -> tuple[frozenset, frozenset]:
    """(arguments the result depends on, arguments that index a captured tensor), by data flow
    over the traced graph. A mod that cannot be traced reads (and indexes with) everything."""
    return structure_fact(mod, ("data_flow", role), lambda: _traced_data_flow(mod, role))


def _traced_data_flow(mod: Callable, role: str) -> tuple[frozenset, frozenset]:
    names = MASK_ARGS if role == "mask" else SCORE_ARGS
    try:
        gm = trace_mod(mod, role)
    except Exception:
        return frozenset(names), frozenset(names)
    deps: dict[str, frozenset] = {}
    placeholders = iter(names)
    result: frozenset = frozenset()
    indexing: frozenset = frozenset()

    def inputs_of(args) -> frozenset:
        out: frozenset = frozenset()
        for a in args:
            if isinstance(a, (list, tuple)):
                out |= inputs_of(a)
            elif hasattr(a, "name") and a.name in deps:
                out |= deps[a.name]
        return out

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            deps[node.name] = frozenset([next(placeholders, node.name)])
        elif node.op == "call_function":
            op = op_name(node.target)
            deps[node.name] = frozenset() if op in _SHAPE_ONLY_OPS else \
                inputs_of(list(node.args) + list(node.kwargs.values()))
            if op in ("index", "select", "slice", "gather", "index_select", "take"):
                indexing |= inputs_of(list(node.args[1:]) + list(node.kwargs.values()))
        elif node.op == "output":
            result = inputs_of(node.args)
        else:
            deps[node.name] = frozenset()
    return result, indexing


def index_reads(mod: Callable | None, role: str = "mask") -> frozenset[str]:
    """Which of the mod's arguments (b, h, q_idx, kv_idx; score) its result depends on, read off
    its traced graph by data flow. An argument used only for its dtype or device (torch's
    `and_masks` calls b.new_ones) does not count. A mod that cannot be traced reads them all."""
    return frozenset() if mod is None else _data_flow(mod, role)[0]


def data_indices(mod: Callable | None, role: str = "mask") -> frozenset[str]:
    """Which arguments index a captured tensor (w[h], lens[b], doc_id[q_idx]...): the mask is then
    bound to the sizes of that data (heads, batch entries, tokens)."""
    return frozenset() if mod is None else _data_flow(mod, role)[1]


# ---------------------------------------------------------------- evaluating a mod on index tensors

def broadcast_indices(b, h, q, kv):
    """1-d index tensors as b [B,1,1,1], h [1,H,1,1], q [1,1,Q,1], kv [1,1,1,K]."""
    return b.view(-1, 1, 1, 1), h.view(1, -1, 1, 1), q.view(1, 1, -1, 1), kv.view(1, 1, 1, -1)


def evaluate_mod(mod: Callable, how: str, b, h, q, kv, score=None) -> torch.Tensor:
    """A mod over the grid b x h x q x kv (1-d index tensors), as a [B, H, Q, KV] tensor:
    'broadcast' calls it once on broadcast index tensors (fast), 'vmap' exactly as
    FlexAttention's tracer does (nested vmap over scalars)."""
    shape = (len(b), len(h), len(q), len(kv))
    if how == "vmap":
        return compat.vmap_bhqkv(mod, b, h, q, kv, score=score)
    args = broadcast_indices(b, h, q, kv)
    out = mod(*args) if score is None else mod(score, *args)
    if not isinstance(out, torch.Tensor):
        out = torch.as_tensor(out, device=q.device)
    return out.expand(shape) if tuple(out.shape) != shape else out


def probe_grid(q_len: int, kv_len: int, size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, kv) int32 index tensors: the rows and the columns of every probe region, so that one
    evaluation over q x kv covers them all (and nothing else)."""
    qs, ks = set(), set()
    for q_range, kv_range in probe_regions(q_len, kv_len, size):
        qs.update(range(*q_range))
        ks.update(range(*kv_range))
    # built in int64 and cast, as torch.arange(..., dtype=torch.int32) would
    return (torch.tensor(sorted(qs), dtype=torch.int64).to(device=device, dtype=torch.int32),
            torch.tensor(sorted(ks), dtype=torch.int64).to(device=device, dtype=torch.int32))


def _region_of(q: int, kv: int, q_len: int, kv_len: int, size: int) -> tuple:
    """The probe region (q_range, kv_range) that holds the pair (q, kv)."""
    for q_range, kv_range in probe_regions(q_len, kv_len, size):
        if q_range[0] <= q < q_range[1] and kv_range[0] <= kv < kv_range[1]:
            return q_range, kv_range
    return next(iter(probe_regions(q_len, kv_len, size)))


def probe_regions(q_len: int, kv_len: int, size: int = 48):
    """Corners and the middle of the pair space: where off-by-ones and data edges live."""
    qs = sorted({0, max(0, q_len // 2 - size // 2), max(0, q_len - size)})
    ks = sorted({0, max(0, kv_len // 2 - size // 2), max(0, kv_len - size)})
    for q0 in qs:
        for k0 in ks:
            yield (q0, min(q_len, q0 + size)), (k0, min(kv_len, k0 + size))


@dataclass(frozen=True)
class EvaluatorChoice:
    """How to evaluate a mod on index tensors. `how` is 'broadcast' when calling the mod on
    broadcast index tensors gives exactly FlexAttention's vmapped values on probe regions, else
    'vmap'. `differs_at` is set when the direct call ran but gave other values (the
    eager-vs-traced trap: Python `and`/`or`, in-place ops); None when it agreed or raised."""

    how: str
    differs_at: tuple | None = None


def elementwise(mod: Callable, role: str = "mask") -> bool:
    """Does every value in the mod's traced graph stay one value per pair? A mod that builds a
    vector per pair (`q_idx >= starts` against a captured table) and reduces it (`.any()`) means
    something else when called once on broadcast index tensors: the reduction would run over the
    whole tile. Such mods are evaluated under vmap, whatever a probe region shows."""
    return structure_fact(mod, ("elementwise", role), lambda: _elementwise(mod, role))


def _elementwise(mod: Callable, role: str) -> bool:
    try:
        gm = trace_mod(mod, role)
    except Exception:
        return False
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() > 0:
            return False
    return True


def choose_evaluator(mod: Callable, q_len: int, kv_len: int, batch: int = 1, heads: int = 1, device="cpu",
                     role: str = "mask", size: int = 48) -> EvaluatorChoice:
    """The one broadcast-vs-vmap rule, for mask_mods and score_mods alike: broadcast only for
    mods whose traced graph is elementwise and whose broadcast call matches vmap on probe
    regions. Raises a WorkbenchError naming the mistake when the mod does not run under vmap."""
    b = torch.unique(torch.tensor([0, batch - 1], dtype=torch.int32)).to(device)
    h = torch.unique(torch.tensor([0, heads - 1], dtype=torch.int32)).to(device)
    how, differs_at = ("broadcast" if elementwise(mod, role) else "vmap"), None
    # every probe region at once: their rows x their columns is exactly their union
    q, kv = probe_grid(q_len, kv_len, size, device)
    shape = (len(b), len(h), len(q), len(kv))
    score = torch.randn(shape, device=device, dtype=torch.float64) if role == "score" else None
    try:
        with torch.no_grad():
            ref = evaluate_mod(mod, "vmap", b, h, q, kv, score=score)
    except Exception as exc:
        raise explain_mod_error(exc, f"{role}_mod", mod) from exc
    _check_result(ref, shape, f"{role}_mod", None)
    if role == "mask" and (not isinstance(ref, torch.Tensor) or ref.dtype != torch.bool):
        got = ref.dtype if isinstance(ref, torch.Tensor) else type(ref).__name__
        raise WorkbenchError(f"mask_mod returned {got}, FlexAttention needs a bool tensor",
                             "return a comparison such as `q_idx >= kv_idx` (combine with & and |)")
    if how == "vmap":
        return EvaluatorChoice(how)
    try:
        with torch.no_grad():
            got = evaluate_mod(mod, "broadcast", b, h, q, kv, score=score)
    except Exception:
        return EvaluatorChoice("vmap")
    if tuple(got.shape) != shape or (role == "mask" and got.dtype != torch.bool):
        return EvaluatorChoice("vmap", _region_of(0, 0, q_len, kv_len, size))
    if role == "mask":
        differ = got != ref
    else:
        differ = ~torch.isclose(got.double(), ref.double(), rtol=1e-12, atol=1e-12, equal_nan=True)
    if bool(differ.any()):
        _, _, i, j = (int(x) for x in differ.nonzero()[0])
        how, differs_at = "vmap", _region_of(int(q[i]), int(kv[j]), q_len, kv_len, size)
    return EvaluatorChoice(how, differs_at)
