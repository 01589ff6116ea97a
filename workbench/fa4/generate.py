"""Generating the FA4 file: the mods translated to CuTe DSL (`workbench.translate.cute_dsl`) and
filled into `templates/attention.py`, which runs them on FlashAttention-4's own forward
(`flash_attn.cute.flash_attn_func`) with block-sparse tensors from the workbench's exact scan.

The file imports torch and flash_attn.cute (with its cutlass DSL) only. Lengths follow the same
rules as the Triton port's (`port.generate.length_plan`): numbers the factory derives from the
lengths are computed per call, per-token data holds at the generated lengths only.
"""

from __future__ import annotations

import hashlib
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from workbench.define import Mask, WorkbenchError, captured_tensors, index_reads, lift_knobs
from workbench.define.lengths import LengthRule, relations_text
from workbench.define.util import fill_template
from workbench.translate.cute_dsl import CUTE_HELPERS, cute_mods
from workbench.translate.emitter import Untranslatable

__all__ = ["Fa4Source", "generate", "unsupported_reason", "FA4_VERSION", "BLOCK", "HEAD_DIMS", "block_tensors"]

TEMPLATE = Path(__file__).with_name("templates") / "attention.py"
FA4_VERSION = "4.0.0b36"  # the flash-attn-4 the file is generated and tested against
BLOCK = (128, 128)  # FA4's sm_90 forward tile for D <= 128 (and the sparse block it requires there)
HEAD_DIMS = (64, 96, 128)
STORED_BLOCKS_LIMIT = 64 << 20  # bytes of stored block lists; past it the file scans on the GPU
_INT32 = (-(2 ** 31), 2 ** 31 - 1)


@dataclass
class Fa4Source:
    """A generated FA4 file: its text, the tensors it reads (aux tables, stored block lists), and
    the sizes it is valid for."""

    name: str
    source: str = ""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    aux: list[str] = field(default_factory=list)
    valid_q_len: int | None = None
    valid_kv_len: int | None = None
    valid_heads: int | None = None
    valid_batch: int | None = None
    length_rules: dict[str, tuple] = field(default_factory=dict)
    relations: tuple = ("lt", "eq", "gt")
    scan_shape: tuple | None = None
    # knobs: numbers the mods capture, read at run time from FA4's aux_scalars (name -> value at
    # generation), and those the mask_mod reads (another value there needs other block lists)
    scalars: dict[str, int | float] = field(default_factory=dict)
    mask_scalars: tuple = ()
    nonneg_scalars: tuple = ()  # integer knobs generated >= 0, which must stay so
    backward: str | None = None  # why the file has no backward (None: FA4's backward runs)
    key: str = ""

    @property
    def module_name(self) -> str:
        from workbench.port.generate import _identifier  # the port's rule for a mask name as a module name

        return f"{_identifier(self.name)}_{self.key}_fa4"

    @property
    def file_name(self) -> str:
        return f"{self.module_name}.py"

    @property
    def tensor_file(self) -> str | None:
        return f"{self.module_name}.safetensors" if self.tensors else None

    def valid_for(self) -> str:
        if self.valid_q_len is not None:
            lengths = f"Lq = {self.valid_q_len}, Lk = {self.valid_kv_len} only (the mask reads per-token data)"
        else:
            lengths = relations_text(self.relations)
            if self.length_rules:
                lengths += " with " + ", ".join(f"{n} = {LengthRule(*r).text()}" for n, r in self.length_rules.items()) \
                    + " computed per call"
        heads = "any heads" if self.valid_heads is None else f"up to {self.valid_heads} query heads (a per-head table)"
        batch = "any batch" if self.valid_batch is None else f"up to {self.valid_batch} batch entries (a per-sample table)"
        return f"{lengths}; {heads}; {batch}; bfloat16 / float16; head dim {', '.join(map(str, HEAD_DIMS))}"

    def section(self) -> dict:
        """The spec's `backends.flash_attn_cute`."""
        return {"file": self.file_name, "tensor_file": self.tensor_file, "entry": "attention",
                "fa4_version": FA4_VERSION, "arch": "sm_90", "dtypes": ["bfloat16", "float16"],
                "head_dims": list(HEAD_DIMS), "block_size": list(BLOCK), "aux_tensors": list(self.aux),
                "aux_scalars": dict(self.scalars), "mask_scalars": list(self.mask_scalars),
                "q_len": self.valid_q_len, "kv_len": self.valid_kv_len, "max_heads": self.valid_heads,
                "max_batch": self.valid_batch, "valid_for": self.valid_for(),
                "length_rules": {n: list(r) for n, r in self.length_rules.items()},
                "relations": list(self.relations),
                "scan_shape": list(self.scan_shape) if self.scan_shape else None,
                "backward": self.backward is None, "no_backward": self.backward,
                "call": "attention(q, k, v, *, scale=None, return_lse=False, scalars=None): q [B, Hq, Lq, D], "
                        "k/v [B, Hkv, Lk, D] (FlexAttention's layout; the file transposes to FA4's [B, L, H, D]); "
                        "scalars={name: value} turns the knobs (read from aux_scalars by copies of the mods compiled "
                        "once, on the first turn); differentiable "
                        "in q, k, v through FA4's backward"}


def _aux_tensor(name: str, t: torch.Tensor) -> torch.Tensor:
    """A captured tensor as FA4 reads it: flattened, int32 / int8 (bool) / float32."""
    t = t.detach().cpu().reshape(-1)
    if t.dtype == torch.bool:
        return t.to(torch.int8).contiguous()
    if t.is_floating_point():
        return t.to(torch.float32).contiguous()
    if t.numel() and (int(t.min()) < _INT32[0] or int(t.max()) > _INT32[1]):
        raise Untranslatable(f"captured tensor {name} holds integers past int32 (FA4's aux tensors are read as int32)")
    return t.to(torch.int32).contiguous()


def block_tensors(classes: torch.Tensor) -> dict[str, torch.Tensor]:
    """FA4's block-sparse tensors from the scan's classes [B', H', rows, cols] (EMPTY 0, PARTIAL 1,
    FULL 2): mask_cnt / full_cnt [B', H', rows] int32 and mask_idx / full_idx [B', H', rows, cols]
    int32 (each row's blocks of that class ascending first; FA4 reads only the first cnt)."""
    from workbench.blocks import FULL, PARTIAL

    cls = classes.cpu().numpy()
    out = {}
    for name, value in (("mask", PARTIAL), ("full", FULL)):
        sel = cls == value
        out[f"{name}_cnt"] = torch.from_numpy(sel.sum(-1).astype(np.int32))
        out[f"{name}_idx"] = torch.from_numpy(np.argsort(~sel, axis=-1, kind="stable").astype(np.int32))
    return out


def generate(mask: Mask, q_len: int, kv_len: int | None = None, heads: int | None = None,
             batch: int | None = None, scan=None) -> Fa4Source:
    """The FA4 file of `mask`, generated at these sizes (`scan`: the mask's block scan at BLOCK, if
    the caller has one). Raises a WorkbenchError naming the construct when a mod has no CuTe DSL
    translation."""
    from workbench.port.generate import length_plan

    kv_len = kv_len or q_len
    indexed, plan, per_token, rules, source_mask = length_plan(mask, q_len, kv_len)
    lifted = frozenset(rules)
    # the other numbers the mods capture (a window, a softcap, a prefix) are knobs: run-time values,
    # except divisors (see _divisor_knobs)
    plain_mask = source_mask  # the knobs as the literals they were
    lifted_mask, knobs = lift_knobs(source_mask, q_len, kv_len)
    divisors = _divisor_knobs(lifted_mask, knobs)
    if divisors:
        lifted_mask, knobs = lift_knobs(source_mask, q_len, kv_len, literal=divisors)
    source_mask = lifted_mask
    knob_ids = {id(source_mask.data[n]) for n in knobs}
    captured = {n: t for n, t in captured_tensors(source_mask).items() if n in knobs or id(t) not in knob_ids}
    try:
        # the numbers that follow the lengths, then the knobs, are FA4's aux_scalars: kernel arguments
        # (a one-entry aux tensor would be a load per pair, and any aux tensor costs FA4 a divmod per pair)
        # an integer knob generated >= 0 stays >= 0 (the file refuses a negative value), so the
        # translation keeps the fast forms a non-negative literal gets (a plain `%`, `//`)
        nonneg = frozenset(n for n, (v, _) in knobs.items() if isinstance(v, int) and v >= 0)
        mods, aux, no_grad = cute_mods(source_mask, captured, lifted, scalars=list(rules) + list(knobs),
                                       nonneg=nonneg)
        # the file runs the knobs' generated values with them written in (the code inductor writes:
        # a literal folds into the instructions; read from aux_scalars, a dilated window's width
        # cost 10% and a 2-D neighbourhood's 1.6x on an H200), and other values through the copies
        # above (`*_knobs`), compiled on the first call that turns a knob
        knob_mods = None
        if knobs:
            literal, literal_aux, literal_no_grad = cute_mods(plain_mask, captured_tensors(plain_mask), lifted,
                                                              scalars=list(rules))
            if literal_aux == aux and literal_no_grad == no_grad:
                knob_mods, mods = _renamed_knob_mods(mods), literal
        stored = {f"aux.{n}": _aux_tensor(n, captured[n]) for n in aux if n not in rules}
    except Untranslatable as exc:
        raise WorkbenchError(f"the mods cannot be written as CuTe DSL: {exc}",
                             "rewrite that part with elementwise torch ops (comparisons, arithmetic, torch.where, "
                             "indexing captured tensors, .any()/.all() over small tables)", mask.name) from exc
    except Exception as exc:
        raise WorkbenchError(f"the mods could not be traced for CuTe DSL: {type(exc).__name__}: {exc}",
                             "check them with `probe(mask)`", mask.name) from exc
    src = Fa4Source(name=mask.name, aux=aux, valid_q_len=q_len if per_token else None,
                    valid_kv_len=kv_len if per_token else None,
                    valid_heads=(mask.heads or heads) if "h" in indexed else None,
                    valid_batch=(mask.batch or batch) if "b" in indexed else None,
                    length_rules={n: r.as_tuple() for n, r in rules.items()},
                    relations=("lt", "eq", "gt") if per_token else plan.relations,
                    scalars={n: v for n, (v, _) in knobs.items()},
                    nonneg_scalars=tuple(sorted(nonneg)),
                    mask_scalars=tuple(n for n, (_, role) in knobs.items() if role == "mask"))
    reads = index_reads(mask.mask_mod)
    if mask.mask_mod is not None:
        if scan is None or (scan.q_block, scan.kv_block) != BLOCK:
            from workbench.blocks import scan_blocks

            # where the mask's tables are (a mask made on the GPU scans there)
            device = next((t.device for t in captured_tensors(mask).values()), torch.device("cpu"))
            scan = scan_blocks(mask, q_len, kv_len, heads=heads or mask.heads or 1, batch=batch or mask.batch or 1,
                               block_size=BLOCK, device=device, progress=False)
        from workbench.blocks import block_classes

        classes = block_classes(scan)
        blocks = block_tensors(classes)
        if sum(t.numel() * 4 for t in blocks.values()) <= STORED_BLOCKS_LIMIT:
            stored.update({f"blocks.{n}": t for n, t in blocks.items()})
            src.scan_shape = (int(classes.shape[0]), int(classes.shape[1]), q_len, kv_len)
    src.tensors = stored
    src.backward = no_grad
    all_mods = mods + (knob_mods or "")
    src.key = _key(src, all_mods)
    source_comment = textwrap.indent(mask.source.strip() or "(source not available)", "    ")
    fills = {
        "@@TITLE@@": f"{mask.name}: attention with this mask and score on FlashAttention-4's kernel.",
        "@@MODULE@@": src.module_name, "@@VALID@@": src.valid_for(),
        "@@TENSOR_FILE@@": src.tensor_file or "nothing (no tensors)",
        "@@FA4_VERSION@@": FA4_VERSION, "@@FA4_VERSION_REPR@@": repr(FA4_VERSION),
        "@@SOURCE@@": source_comment.replace('"""', "'''").replace("\\", "\\\\"),
        "@@MODS@@": (mods.rstrip() + ("\n\n\n# The same mods reading the knobs from aux_scalars (after the length rules' numbers), for "
                                      "calls that turn a knob\n\n" + knob_mods.strip() if knob_mods else "")),
        "@@KNOB_MODS@@": repr(knob_mods is not None), "@@NAME@@": repr(mask.name),
        "@@VALID_Q_LEN@@": repr(src.valid_q_len), "@@VALID_KV_LEN@@": repr(src.valid_kv_len),
        "@@VALID_HEADS@@": repr(src.valid_heads), "@@VALID_BATCH@@": repr(src.valid_batch),
        "@@LENGTH_RULES@@": repr(src.length_rules), "@@RELATIONS@@": repr(src.relations),
        "@@REFUSED@@": repr({} if per_token else plan.refused),
        "@@HAS_MASK@@": repr(mask.mask_mod is not None), "@@HAS_SCORE@@": repr(mask.score_mod is not None),
        "@@READS_B@@": repr("b" in reads), "@@READS_H@@": repr("h" in reads),
        "@@AUX@@": repr(aux), "@@TENSOR_FILE_NAME@@": repr(src.tensor_file),
        "@@SCALARS@@": repr(src.scalars), "@@MASK_SCALARS@@": repr(src.mask_scalars),
        "@@NONNEG_SCALARS@@": repr(src.nonneg_scalars),
        "@@SCAN_SHAPE@@": repr(src.scan_shape),
        "@@MODS_HASH@@": repr(hashlib.sha256(all_mods.encode()).hexdigest()),
        "@@BACKWARD_NOTE@@": "FA4's, with the generated score_mod derivative" if no_grad is None else f"none ({no_grad})",
        "@@HAS_SCORE_GRAD@@": repr(no_grad is None), "@@NO_SCORE_GRAD@@": repr(no_grad),
    }
    src.source = fill_template(TEMPLATE.read_text(), fills)
    return src


_MOD_NAMES = ("mask_mod_cute_one", "mask_mod_cute", "score_mod_cute_one", "score_mod_cute", "score_grad_cute_one",
              "score_grad_cute", "score_mod_bwd_cute")


def _renamed_knob_mods(text: str) -> str:
    """cute_mods' text of the knob-reading mods without the shared helpers, each function `NAME`
    renamed `NAME_knobs` (calls between them included)."""
    import re

    assert text.startswith(CUTE_HELPERS), "cute_mods' text no longer starts with its helpers"
    return re.sub(r"\b(" + "|".join(_MOD_NAMES) + r")\b", r"\1_knobs", text[len(CUTE_HELPERS):])


def _divisor_knobs(mask: Mask, knobs: dict) -> frozenset:
    """The knobs a mod divides by (`//`, `%`): those stay literals. FA4 divides by a literal with a
    multiply and a shift, by a run-time value with some twenty instructions per pair (a dilation of
    4 read from aux_scalars made a dilated window 1.8x slower than inductor's literal on an H200)."""
    import torch.fx

    from workbench.define import trace_mod
    from workbench.define.trace import op_name

    if not knobs:
        return frozenset()
    by_ptr = {mask.data[n].data_ptr(): n for n in knobs}
    found = set()
    for role, fn in (("mask", mask.mask_mod), ("score", mask.score_mod)):
        if fn is None:
            continue
        gm = trace_mod(fn, role)
        for node in gm.graph.nodes:
            if node.op != "call_function" or len(node.args) < 2:
                continue
            name = op_name(node.target)
            if name not in ("remainder", "floor_divide", "fmod") and not (
                    name == "div" and node.kwargs.get("rounding_mode") is not None):
                continue
            divisor = node.args[1]
            while isinstance(divisor, torch.fx.Node) and divisor.op == "call_function" and op_name(divisor.target) in (
                    "_to_copy", "to", "convert_element_type", "clone", "alias", "detach", "lift_fresh_copy"):
                divisor = divisor.args[0]
            if isinstance(divisor, torch.fx.Node) and divisor.op == "get_attr":
                tensor = getattr(gm, divisor.target)
                if tensor.data_ptr() in by_ptr:
                    found.add(by_ptr[tensor.data_ptr()])
    return frozenset(found)


def _key(src: Fa4Source, mods: str) -> str:
    import hashlib

    digest = hashlib.sha256(mods.encode())
    digest.update(repr((src.valid_q_len, src.valid_kv_len, src.valid_heads, src.valid_batch,
                        sorted(src.length_rules.items()), src.relations, src.scan_shape,
                        sorted(src.scalars.items()))).encode())
    for name in sorted(src.tensors):
        digest.update(name.encode())
        digest.update(src.tensors[name].reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:6]


def unsupported_reason(mask: Mask) -> str | None:
    """Why the mask has no FA4 file (None: it has one)."""
    try:
        captured = dict(captured_tensors(mask))
        _, aux, _ = cute_mods(mask, captured)
        for n in aux:
            _aux_tensor(n, captured[n])
    except Untranslatable as exc:
        return f"the traced mod cannot be written as CuTe DSL: {exc}"
    except Exception as exc:
        return f"the mod could not be traced for CuTe DSL: {type(exc).__name__}: {str(exc)[:200]}"
    return None
