"""A mask is a value: `Mask` bundles one attention variant (its FlexAttention mods, parameters,
description, source and captured tensors); `WorkbenchError` is the error a user can act on
(cause, fix, mask); `with_score` adds a score_mod to a mask. Signature checks live here too."""

from __future__ import annotations

import dataclasses
import inspect
import re
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

__all__ = ["CONTEXT_KEYS", "WorkbenchError", "Mask", "with_score", "mod_source", "positional_arity", "mod_role",
           "returned_role", "check_signature"]


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
