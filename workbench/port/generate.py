"""Generating the port: the mods translated to Triton (`workbench.translate`) and filled into
`templates/forward.py`, a FlashAttention-2-style forward kernel that visits only the kv blocks
holding kept pairs and evaluates the mask only in partial blocks. The result is one Python file
(plus a safetensors file for captured tensors) that imports torch and triton only: no
torch.compile, no FlexAttention.

A mask that indexes captured per-token data (document ids, spans, a tree) is valid at the
lengths of that data only; one that indexes per-head or per-sample tables, for as many heads or
batch entries as the tables hold; numbers its factory derives from the lengths (the bottom-right
offset) are computed per call. The file states this and refuses other calls with a clear error.
"""

from __future__ import annotations

import os
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import torch

from workbench.define import Mask, WorkbenchError, data_indices, index_reads
from workbench.define.lengths import RELATION_TEXT, LengthRule, follow, rebuildable, relations_text
from workbench.define.util import fill_template, template_body
from workbench.define import captured_tensors, trace_mod
from workbench.translate import Untranslatable, mod_functions, range_pointers
from workbench.translate.fast_mask import RANGE_HELPERS, translate_fast_mask
from workbench.translate.fast_score import INDEX_HELPERS, score_log2_function
from workbench.translate.derivative import derivative_mod
from workbench.translate.triton_mask import PORTABLE_TANH, translate_mod
from workbench.translate.triton_table_grad import translate_table_grad

__all__ = ["PortSource", "generate", "length_plan", "check_supported", "pinned_config", "CONFIGS", "SEGMENT_CONFIGS", "DTYPES",
           "ENTRY", "MAX_HEAD_DIM"]


TEMPLATE = Path(__file__).with_name("templates") / "forward.py"
PAGED_TEMPLATE = Path(__file__).with_name("templates") / "paged.py"  # attention_paged, appended
BACKWARD_TEMPLATE = Path(__file__).with_name("templates") / "backward.py"  # dq, dk, dv, appended
HOPPER_TEMPLATE = Path(__file__).with_name("templates") / "hopper.py"  # the sm_90 forward in Gluon, appended
HOPPER_BWD_TEMPLATE = Path(__file__).with_name("templates") / "hopper_backward.py"  # its backward, appended
HOPPER_PAGED_TEMPLATE = Path(__file__).with_name("templates") / "hopper_paged.py"  # attention_paged's prefill on sm_90
# the Triton names the mods' translation writes that Gluon has under the same name (tl.X -> gl.X)
GLUON_NAMES = frozenset({"where", "minimum", "maximum", "log", "log2", "exp", "exp2", "load", "erf", "sqrt", "rsqrt",
                         "sin", "cos", "floor", "ceil", "abs", "fma", "float16", "bfloat16", "float32", "float64", "int1",
                         "int8", "uint8", "int16", "int32", "int64"})
ENTRY = "attention"
# The Hopper forward's score in the forms of translate/fast_score.py: "bias" (biases added to the
# score in one fused multiply-add in base 2; the default) or "all" (also integer distances converted
# per row and per column), or "off" (score_mod * log2(e)). Timed on an H100 (docs/benchmarks.md,
# causal + ALiBi at 32K): "bias" 6% faster than "off" at bf16 D 128 (9.35 against 9.95 ms,
# ping-pong), 1-3% at fp16 D 64, within 1.5% on a T5 log-bucket bias; "all" 10-30% slower at D 128
# (the columns held twice), 3-7% faster at D 64. PORT_FAST_SCORE (off, bias, all; 0: off, 1: all)
# chooses when a file is generated; another value is refused by generate(), naming the variable
FAST_SCORE_FORMS = {"0": "off", "1": "all", "": "bias"}.get(os.environ.get("PORT_FAST_SCORE", ""),
                                                             os.environ.get("PORT_FAST_SCORE"))
_SCORE_FORMS = ("off", "bias", "all")
DTYPES = ("bfloat16", "float16", "float32")


# Float32 at D > 64 runs one small tile, for long rows, decode and packed launches alike. Such a call
# compiles one kernel and is never autotuned. Compiled for sm_90 (IEEE float32 products unrolled on
# the FMA units, spilling; ptxas on a 2-core CPU): at D = 128 the long-row tiles of bf16 need
# 256-352 KB of shared memory (an H200 has 227 KB) and each took 50-260 s; (64, 32, 4, 1) took 43 s,
# (16, 64, 4, 1) 7.3 s and (16, 32, 4, 1) 6.6 s. At D = 256 (64, 32, 4, 1) took 210 s (342 KB of spill
# stores), (32, 32, 4, 1) and (64, 32, 8, 1) 53-55 s, (16, 64, 4, 1) 22 s and (16, 32, 4, 1) 16 s with
# 80 KB of shared memory and 8 KB of spill stores. On an H100 (float32, D 128, causal, B 1, H 8, 4,096
# tokens; docs/benchmarks.md) (16, 32, 4, 1) also ran fastest: 6.3 ms and a first call of 5.9 s,
# against 27.5 ms and 10.0 s for (16, 64, 4, 1) and 39.4 ms and 35.0 s for (64, 32, 4, 1), whose spills
# cost more than their larger tiles save.
WIDE_TILE = (16, 32, 4, 1)
# (BLOCK_M, BLOCK_N, num_warps, num_stages) the autotuner chooses from on a GPU. BLOCK_M 16 serves
# calls with at most 16 queries (decode). The last WIDE_ROW_CONFIGS is WIDE_TILE: the only
# tile float32 at D > 64 runs, and never autotuned for other calls (a packed launch may still fall
# back to (64, 32, 4, 1), the last of SEGMENT_CONFIGS, and PORT_CONFIG may pin any of them).
CONFIGS = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (16, 64, 4, 3), (16, 128, 4, 2),
           (16, 32, 4, 1)]
WIDE_ROW_CONFIGS = 1


# Packed launches (cu_seqlens) use one fixed configuration, so a request's bits do not depend on
# what it is packed with: the first of these the chip has room for (D = 256 and float32 need the
# smaller ones). 128 x 128 was the fastest packed tiling on an H200 (docs/benchmarks.md).
SEGMENT_CONFIGS = [(128, 128, 8, 2), (128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 1)]


@dataclass
class PortSource:
    """A generated port: the file's text, the tensors it reads, and the sizes it is valid for."""

    name: str
    source: str
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    valid_q_len: int | None = None
    valid_kv_len: int | None = None
    valid_heads: int | None = None
    valid_batch: int | None = None
    # captured numbers the file computes per call from (Lq, Lk): name -> (a, b, c, d), the value
    # floor((a * Lq + b * Lk + c) / d) (lengths.LengthRule); the Lq-vs-Lk cases it accepts
    length_rules: dict[str, tuple] = field(default_factory=dict)
    relations: tuple = ("lt", "eq", "gt")
    refused: dict[str, str] = field(default_factory=dict)
    lengths_note: str = ""

    key: str = ""  # 6 hex digits of what makes this port differ from another port of the mask

    @property
    def module_name(self) -> str:
        """NAME_KEY_attention: ports of one mask at other parameters or lengths (other tables) never
        overwrite each other."""
        return f"{_identifier(self.name)}_{self.key}_attention" if self.key else f"{_identifier(self.name)}_attention"

    @property
    def file_name(self) -> str:
        return f"{self.module_name}.py"

    @property
    def tensor_file(self) -> str | None:
        return f"{self.module_name}.safetensors" if self.tensors else None

    def valid_for(self) -> str:

        if self.valid_q_len is None and self.valid_kv_len is None:
            lengths = relations_text(self.relations)
            if len(self.relations) < 3:
                lengths = "any " + lengths + " (the factory refuses " + " and ".join(
                    RELATION_TEXT[r] for r in RELATION_TEXT if r not in self.relations) + ")"
            if self.length_rules:
                lengths += " with " + ", ".join(f"{name} = {LengthRule(*rule).text()}"
                                                for name, rule in self.length_rules.items()) + " computed per call"
        else:
            why = self.lengths_note or "the mask reads per-token data"
            lengths = f"Lq = {self.valid_q_len}, Lk = {self.valid_kv_len} only ({why})"
        heads = "any heads" if self.valid_heads is None else f"up to {self.valid_heads} query heads (a per-head table)"
        batch = "any batch" if self.valid_batch is None else f"up to {self.valid_batch} batch entries (a per-sample table)"
        return f"{lengths}; {heads}; {batch}"

    def section(self) -> dict:
        """The spec's `backends.triton_attention`."""
        return {"file": self.file_name, "tensor_file": self.tensor_file, "entry": ENTRY, "dtypes": list(DTYPES),
                "q_len": self.valid_q_len, "kv_len": self.valid_kv_len, "max_heads": self.valid_heads,
                "max_batch": self.valid_batch, "valid_for": self.valid_for(),
                "length_rules": {name: list(rule) for name, rule in self.length_rules.items()},
                "relations": list(self.relations),
                "call": f"{ENTRY}(q, k, v, *, scale=None, return_lse=False, cu_seqlens=None): q [B, Hq, Lq, D], "
                        "k/v [B, Hkv, Lk, D]; cu_seqlens [0, end_1, ..., L] runs packed sequences with tiles from "
                        "each one's start (bitwise the same wherever a sequence is packed)"}


def _identifier(name: str) -> str:
    text = re.sub(r"\W+", "_", name).strip("_") or "mask"
    return text if not text[0].isdigit() else f"m_{text}"


def _port_key(port: PortSource, parts: list[str]) -> str:
    """6 hex digits of the translated mods, the sizes the port is valid for and its tables."""
    import hashlib

    digest = hashlib.sha256("\n".join(parts).encode())
    digest.update(repr((port.valid_q_len, port.valid_kv_len, port.valid_heads, port.valid_batch,
                        sorted(port.length_rules.items()), port.relations)).encode())
    for name in sorted(port.tensors):
        digest.update(name.encode())
        digest.update(port.tensors[name].reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:6]


def length_plan(mask: Mask, q_len: int, kv_len: int):
    """How a generated file follows the call's lengths (shared by the Triton port and the FA4 file):
    (what the mods index, lengths.follow's plan, whether the file holds at these lengths only, the
    length rules it computes per call, the mask to translate: rebuilt with the rules' numbers
    as named tables)."""
    indexed = data_indices(mask.mask_mod) | data_indices(mask.score_mod, "score")
    plan = follow(mask, q_len, kv_len)
    # per-token data (tables read at q_idx / kv_idx) hold at these lengths only, whatever else follows them
    per_token = (bool(indexed & {"q_idx", "kv_idx"}) or plan.kind == "fixed"
                 or (mask.q_len is not None and not rebuildable(mask)))
    rules = {} if per_token else plan.rules
    return indexed, plan, per_token, rules, (plan.mask if rules else mask)


def generate(mask: Mask, q_len: int, kv_len: int | None = None, heads: int | None = None,
             batch: int | None = None, fast_score_forms: str | bool | None = None) -> PortSource:
    """The port of `mask`, generated at these sizes. Numbers its factory computes from the lengths
    (the bottom-right offset Lk - Lq) are computed by the file per call (`lengths.follow`); a mask
    whose meaning is tied to these lengths otherwise (per-token tables) is valid at them only.
    Raises a WorkbenchError naming the construct when a mod has no Triton translation.
    `fast_score_forms`: the Hopper kernels' score functions in the forms of translate/fast_score.py,
    "off", "bias" or "all" (True: "all", False: "off"; None: FAST_SCORE_FORMS)."""

    kv_len = kv_len or q_len
    forms = FAST_SCORE_FORMS if fast_score_forms is None else fast_score_forms
    forms = {True: "all", False: "off"}.get(forms, forms)
    if forms not in _SCORE_FORMS:
        given = (f"fast_score_forms={fast_score_forms!r}" if fast_score_forms is not None
                 else f"PORT_FAST_SCORE={os.environ.get('PORT_FAST_SCORE')!r} (generate.FAST_SCORE_FORMS={forms!r})")
        raise WorkbenchError(f"{given} is not one of {_SCORE_FORMS}",
                             "pass 'off', 'bias' or 'all' (or set PORT_FAST_SCORE to 0, bias or all)", mask.name)
    indexed, plan, per_token, rules, source_mask = length_plan(mask, q_len, kv_len)
    has_bounds = mask.mask_mod is not None  # mask_mod_bounds too: the paged kernel skips tiles by them
    # 0-d tensors the score_mod learns (a temperature) are kernel arguments, not numbers in the source
    lifted = frozenset(rules) | {name for name, t in captured_tensors(source_mask).items()
                                 if t.dim() == 0 and t.requires_grad and t.is_floating_point()}
    try:
        try:
            parts, mask_ptrs, score_ptrs, captured = mod_functions(source_mask, lifted, bounds=has_bounds)
        except Untranslatable:
            has_bounds = False
            parts, mask_ptrs, score_ptrs, captured = mod_functions(source_mask, lifted)
    except Untranslatable as exc:
        raise WorkbenchError(f"the mods cannot be written as Triton: {exc}",
                             "rewrite that part with elementwise torch ops (comparisons, arithmetic, torch.where, "
                             "indexing captured tensors, .any()/.all() over small tables)", mask.name) from exc
    except Exception as exc:
        raise WorkbenchError(f"the mods could not be traced for Triton: {type(exc).__name__}: {exc}",
                             "check them with `probe(mask)`", mask.name) from exc
    if mask.mask_mod is None:
        parts.append("@triton.jit\ndef mask_mod_triton(b, h, q_idx, kv_idx):\n    # no mask_mod: every pair is kept\n"
                     "    return (q_idx >= 0) & (kv_idx >= 0)\n")
    if mask.score_mod is None:
        parts.append("@triton.jit\ndef score_mod_triton(score, b, h, q_idx, kv_idx):\n    # no score_mod\n"
                     "    return score\n")
    grad_ptrs, no_grad = _score_grad(source_mask, lifted, parts)
    table_ptrs, grad_tables = _table_grad(source_mask, lifted, parts)
    range_ptrs = range_pointers(mask_ptrs)
    if not has_bounds:
        parts.append("@triton.jit\ndef mask_mod_bounds(b, h, q_lo, q_hi, kv_lo, kv_hi"
                     + "".join(f", {p}" for p in mask_ptrs + range_ptrs) + "):\n"
                     "    # no bounds for this mask: nothing is decided over a tile (all = 0, any = 1)\n"
                     "    return q_lo * 0, q_lo * 0 + 1\n")
    reads = index_reads(mask.mask_mod)
    port = PortSource(
        name=mask.name, source="",
        tensors={name: t.detach().contiguous().cpu() for name, t in captured.items() if name not in rules},
        valid_q_len=q_len if per_token else None, valid_kv_len=kv_len if per_token else None,
        valid_heads=(mask.heads or heads) if "h" in indexed else None,
        valid_batch=(mask.batch or batch) if "b" in indexed else None,
        length_rules={n: r.as_tuple() for n, r in rules.items() if n in captured},
        relations=("lt", "eq", "gt") if per_token else plan.relations,
        refused={} if per_token else plan.refused,
        lengths_note=plan.reason if per_token and plan.kind == "fixed" else "")
    port.key = _port_key(port, parts)
    mask_names = [p[: -len("_ptr")] for p in mask_ptrs]
    all_ptrs = list(dict.fromkeys(mask_ptrs + score_ptrs))

    def params(ptrs):
        return "".join(f"{p}, " for p in ptrs)

    def args(ptrs):
        return "".join(f", {p}" for p in ptrs)

    text = (TEMPLATE.read_text() + "\n\n" + template_body(PAGED_TEMPLATE) + "\n\n"
            + template_body(BACKWARD_TEMPLATE) + "\n\n" + template_body(HOPPER_TEMPLATE) + "\n\n"
            + template_body(HOPPER_PAGED_TEMPLATE) + "\n\n" + template_body(HOPPER_BWD_TEMPLATE))
    gluon_mods, no_gluon, no_gluon_grad = _gluon_mods(
        parts, _fast_mask(source_mask, lifted, mask_ptrs),
        score_log2_function(source_mask.score_mod if forms != "off" else None, source_mask, lifted, score_ptrs,
                            convert=forms == "all")[0])
    source_comment = textwrap.indent(mask.source.strip() or "(source not available)", "    ")
    fills = {
        "@@TITLE@@": f"{mask.name}: attention with this mask and score as one standalone Triton kernel.",
        "@@MODULE@@": port.module_name,
        "@@VALID@@": port.valid_for(),
        "@@TENSOR_FILE@@": port.tensor_file or "nothing (this mask captures no tensors)",
        "@@SOURCE@@": source_comment.replace('"""', "'''").replace("\\", "\\\\"),
        "@@MODS@@": "\n\n".join(p.strip() + "\n" for p in parts).rstrip(),
        "@@NAME@@": repr(mask.name),
        "@@VALID_Q_LEN@@": repr(port.valid_q_len), "@@VALID_KV_LEN@@": repr(port.valid_kv_len),
        "@@VALID_HEADS@@": repr(port.valid_heads), "@@VALID_BATCH@@": repr(port.valid_batch),
        "@@LENGTH_RULES@@": repr(port.length_rules), "@@RELATIONS@@": repr(port.relations),
        "@@REFUSED@@": repr(port.refused),
        "@@READS_B@@": repr("b" in reads), "@@READS_H@@": repr("h" in reads),
        "@@HAS_MASK@@": repr(mask.mask_mod is not None), "@@HAS_SCORE@@": repr(mask.score_mod is not None),
        "@@MASK_POINTERS@@": repr(mask_names),
        "@@ALL_POINTERS@@": repr([p[: -len("_ptr")] for p in all_ptrs]),
        "@@TENSOR_FILE_NAME@@": repr(port.tensor_file),
        "@@MASK_PTR_PARAMS@@": params(mask_ptrs), "@@MASK_PTR_ARGS@@": args(mask_ptrs),
        "@@SCORE_PTR_ARGS@@": args(score_ptrs), "@@GRAD_PTR_ARGS@@": args(grad_ptrs),
        "@@HAS_SCORE_GRAD@@": repr(no_grad is None), "@@NO_SCORE_GRAD@@": repr(no_grad),
        "@@TGRAD_PTR_ARGS@@": args(table_ptrs), "@@GRAD_TABLES@@": repr(grad_tables),
        "@@DTABLE_PTR_PARAMS@@": params([f"d_{n}_ptr" for n in grad_tables]),
        "@@DTABLE_PTR_ARGS@@": args([f"d_{n}_ptr" for n in grad_tables]),
        "@@ALL_PTR_PARAMS@@": params(all_ptrs), "@@ALL_PTR_ARGS@@": args(all_ptrs),
        "@@CONFIGS@@": repr(CONFIGS),
        "@@SEGMENT_CONFIGS@@": repr(SEGMENT_CONFIGS),
        "@@WIDE_ROW_CONFIGS@@": repr(WIDE_ROW_CONFIGS),
        "@@WIDE_TILE@@": repr(WIDE_TILE),
        "@@HAS_BOUNDS@@": repr(has_bounds),
        "@@RANGE_PTR_PARAMS@@": params(range_ptrs), "@@RANGE_PTR_ARGS@@": args(range_ptrs),
        "@@HOPPER_MODS@@": repr(no_gluon), "@@GLUON_MODS@@": gluon_mods, "@@HOPPER_GRAD@@": repr(no_gluon_grad),
        "@@HOPPER_TABLE_READS@@": repr(_table_reads(gluon_mods)),
    }
    text = fill_template(text, fills)
    text = re.sub(r"\n[ ]+\n", "\n", text)  # parameter lines left empty by masks without tables
    port.source = text
    return port


def _fast_mask(mask: Mask, lifted: frozenset, mask_ptrs: list[str]) -> str | None:
    """mask_mod_triton with its window checks folded (translate.fast_mask), for the Gluon copy; None
    where the mask has no window check to fold (or no mask_mod)."""
    if mask.mask_mod is None:
        return None
    try:
        text, pointers = translate_fast_mask(mask, lifted)
    except Untranslatable:
        return None
    return text if pointers == mask_ptrs and "_in_range" in text else None


def _score_pointers(parts: list[str]) -> list[str]:
    """score_mod_triton's pointer parameters, read off its text in `parts`."""
    for part in parts:
        found = re.search(r"^def score_mod_triton\(score, b, h, q_idx, kv_idx((?:, \w+)*)\):", part, re.MULTILINE)
        if found:
            return [p.strip() for p in found.group(1).split(",") if p.strip()]
    return []


def _table_reads(gluon_mods: str) -> int:
    """The distinct table entries the forward's Gluon mods read (the gl.load calls of mask_mod_gluon,
    score_mod_gluon and score_log2_gluon, the same text counted once, as the compiler reads it once;
    not the derivative's): the Hopper kernel's HOPPER_UNDER_PV default."""
    forward = gluon_mods.split("def score_grad_gluon")[0]
    loads, at = set(), forward.find("gl.load(")
    while at >= 0:  # (each call's text up to its closing parenthesis)
        end = _closing(forward, at + len("gl.load"))
        loads.add(forward[at:end + 1].replace(" ", ""))
        at = forward.find("gl.load(", end)
    return len(loads)


def _closing(text: str, at: int) -> int:
    """The index of the parenthesis that closes the one at text[at] (len(text) where none does)."""
    depth = 0
    for i in range(at, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return len(text)


def _gluon_mods(parts: list[str], fast_mask: str | None = None,
                score_log2: str | None = None) -> tuple[str, str | None, str | None]:
    """The mask_mod and score_mod as Gluon functions (mask_mod_gluon, score_mod_gluon, and the
    helpers they call, each named *_gluon) for the Hopper kernels, indented for their `if` block:
    the Triton translation with Gluon's names, which are the same for every elementwise op it writes
    (tl.sigmoid, which Gluon lacks, as the same 1 / (1 + exp(-x))); then the score_mod's derivative
    (score_grad_gluon) for the Hopper backward. (text, None, None), or a stand-in and the reason for
    the mods (then the Hopper kernels do not run), or for the derivative alone (then the Hopper
    backward does not run with the score_mod). `fast_mask`: mask_mod_triton with its window checks
    folded (_fast_mask), copied in place of the plain one; `score_log2`: the Hopper forward's
    base-2 score, score_log2_triton (fast_score.score_log2_function; by default a call of
    score_mod_triton times log2(e))."""
    if score_log2 is None:
        score_log2 = score_log2_function(None, None, frozenset(), _score_pointers(parts))[0]
    if fast_mask is not None:
        parts = [fast_mask.strip() if re.search(r"^def mask_mod_triton\(", p, re.MULTILINE) else p for p in parts]
    mods, why = _as_gluon(parts + [score_log2], {"mask_mod_triton": "mask_mod_gluon", "score_mod_triton": "score_mod_gluon",
                                                 "score_log2_triton": "score_log2_gluon"})
    if why is not None:
        return "    pass", f"the mods use {why}, which Gluon does not have", None
    grad, why_grad = _as_gluon(parts, {"score_grad_triton": "score_grad_gluon"}, helpers=False)
    if why_grad is not None:
        grad = ("@gluon.jit\ndef score_grad_gluon(score, b, h, q_idx, kv_idx):\n"
                "    # no Gluon copy of the derivative (the Hopper backward does not take the score_mod)\n"
                "    return score * 0.0\n")
        why_grad = f"the score_mod's derivative uses {why_grad}, which Gluon does not have"
    mods, grad = _fast_scores(mods), _fast_scores(grad)
    helpers = "_sigmoid_gluon(" in mods + grad
    fast = "_fast_gluon(" in mods + grad
    ranges = "_in_range" in mods
    index = "_sub_as_float_gluon(" in mods + grad
    text = (("@gluon.jit\ndef _sigmoid_gluon(x):\n    # tl.sigmoid's formula\n    return 1 / (1 + gl.exp(-x))\n\n"
             if helpers else "") + (_FAST_HELPERS if fast else "") + (RANGE_HELPERS + "\n\n" if ranges else "")
            + (INDEX_HELPERS + "\n\n" if index else "")
            + mods + "\n\n" + grad)
    return textwrap.indent(text, "    "), None, why_grad


# The score functions' Gluon copies run where the Hopper kernels spend a pair's few instructions
# besides the matmuls, so they take the chip's approximate tanh (one MUFU op, as FlashAttention-3's
# softcap; the PTX ISA gives its relative error as about 2^-11) where the portable copy computes
# 2 sigmoid(2x) - 1 (an exponential and a division), a sigmoid as 0.5 tanh(x / 2) + 0.5, log and
# log2 through the chip's lg2.approx (where tl.log is the exact library routine, a dozen FMAs),
# divisions by a constant as multiplications, and the derivative's seed (d score / d score = score * 0 + 1, a tensor only for
# its shape) as a constant the compiler folds. Masks keep the exact formulas: a kept pair must be
# the one the block scan and the reference keep (a window check is written as one unsigned compare,
# which keeps the same pairs for every int32: translate/fast_mask.py)
_FAST_HELPERS = ("@gluon.jit\ndef _tanh_fast_gluon(x):\n    # the chip's tanh.approx.f32 (sm_75 and later)\n"
                 "    return gl.inline_asm_elementwise(\"tanh.approx.f32 $0, $1;\", \"=f,f\", [x.to(gl.float32)],\n"
                 "                                     dtype=gl.float32, is_pure=True, pack=1)\n\n"
                 "@gluon.jit\ndef _sigmoid_fast_gluon(x):\n    return 0.5 * _tanh_fast_gluon(0.5 * x) + 0.5\n\n"
                 "@gluon.jit\ndef _log2_fast_gluon(x):\n    # the chip's lg2.approx.f32 (error about 2^-22 by the PTX ISA)\n"
                 "    return gl.inline_asm_elementwise(\"lg2.approx.f32 $0, $1;\", \"=f,f\", [x.to(gl.float32)],\n"
                 "                                     dtype=gl.float32, is_pure=True, pack=1)\n\n"
                 "@gluon.jit\ndef _log_fast_gluon(x):\n    return _log2_fast_gluon(x) * 0.6931471805599453\n\n")
_NUMBER = r"(\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)"  # (a literal divisor: true division, as Python's and Triton's /)


def _fast_scores(text: str) -> str:
    """score_mod_gluon's and score_grad_gluon's text with the fast forms above (other functions as
    they are)."""
    parts = text.split("@gluon.jit\n")
    for i, part in enumerate(parts):
        if not part.startswith(("def score_mod_gluon(", "def score_grad_gluon(", "def score_log2_gluon(")):
            continue
        part = _replace_tanh(part)
        part = part.replace("_sigmoid_gluon(", "_sigmoid_fast_gluon(")
        part = re.sub(r"\bgl\.log\(", "_log_fast_gluon(", re.sub(r"\bgl\.log2\(", "_log2_fast_gluon(", part))
        part = re.sub(rf"(?<![/*]) / {_NUMBER}(?![\w.(])(?!\s*\*\*)", _times_reciprocal, part)
        if part.startswith("def score_grad_gluon("):  # (its first `score * 0.0` is the seed, derivative.py's)
            part = re.sub(r"^(\s+\w+) = \(score \* 0\.0\)$", r"\1 = gl.zeros_like(score)", part, count=1,
                          flags=re.M)
        parts[i] = part
    return "@gluon.jit\n".join(parts)


def _times_reciprocal(m: re.Match) -> str:
    """` / c` as ` * (1 / c)` where float32 holds c and 1 / c as normal numbers (1e-30 <= c <=
    1e30); other divisors stay divisions: 1 / 1e-39 is past float32's largest number (x * inf
    where x / c is finite), and a zero stays a division by zero."""
    c = float(m.group(1))
    return f" * {1.0 / c!r}" if 1e-30 <= c <= 1e30 else m.group(0)


def _replace_tanh(text: str) -> str:
    """(2.0 * _sigmoid_gluon(2.0 * A) - 1.0), the portable tanh (PORTABLE_TANH in its Gluon copy), as
    _tanh_fast_gluon(A); anything else that begins the same way is left as it is."""
    head, tail = PORTABLE_TANH.replace("tl.sigmoid(", "_sigmoid_gluon(").split("{a}")  # (tail: ") - 1.0)")
    start = text.find(head)
    while start >= 0:
        close = _closing(text, start + head.index("_sigmoid_gluon(") + len("_sigmoid_gluon"))  # (the sigmoid's)
        if text.startswith(tail, close):
            text = text[:start] + "_tanh_fast_gluon(" + text[start + len(head):close] + ")" + text[close + len(tail):]
            start = text.find(head, start)
        else:
            start = text.find(head, start + 1)
    return text


def _as_gluon(parts: list[str], renames: dict, helpers: bool = True) -> tuple[str, str | None]:
    """The parts that define the functions named in `renames` (and, `helpers`, the parts of _py_
    helpers) as Gluon text, renamed (calls of the helpers too); (text, None), or ("", the Triton
    names Gluon lacks)."""
    renames = dict(renames)
    wanted = set(renames)
    picked = []
    for part in parts:
        names = re.findall(r"^def (\w+)\(", part, re.MULTILINE)
        if names and all(n in wanted or n.startswith("_py_") for n in names):
            if helpers or any(n in wanted for n in names):
                picked.append(part.strip())
            renames.update({n: f"{n}_gluon" for n in names if n.startswith("_py_")})
    text = "\n\n".join(picked).replace("tl.sigmoid(", "_sigmoid_gluon(")
    missing = sorted(set(re.findall(r"\btl\.([A-Za-z_0-9]+)", text)) - GLUON_NAMES)
    if missing:
        return "", ", ".join("tl." + n for n in missing)
    text = re.sub(r"\btl\.", "gl.", text.replace("@triton.jit", "@gluon.jit"))
    for old, new in renames.items():
        text = re.sub(rf"\b{old}\(", f"{new}(", text)
    return text, None


def _score_grad(mask: Mask, lifted: frozenset, parts: list[str]) -> tuple[list[str], str | None]:
    """Append score_grad_triton (d score_mod / d score, generated from the traced score_mod) to
    `parts`; returns its table pointers and None, or ([], why) when there is no derivative (the
    file then has a forward only, and its backward says why)."""
    if mask.score_mod is None:
        parts.append("@triton.jit\ndef score_grad_triton(score, b, h, q_idx, kv_idx):\n"
                     "    # no score_mod: d score / d score = 1\n    return score * 0.0 + 1.0\n")
        return [], None
    try:
        graph = trace_mod(derivative_mod(mask.score_mod), "score")
        src, pointers = translate_mod(graph, "score_grad_triton", ["score", "b", "h", "q_idx", "kv_idx"],
                                      dict(captured_tensors(mask)), lifted)
    except Exception as exc:  # Untranslatable, or a derivative graph that does not trace: a forward-only file
        parts.append("@triton.jit\ndef score_grad_triton(score, b, h, q_idx, kv_idx):\n"
                     "    # the score_mod's derivative could not be generated: no backward\n    return score * 0.0\n")
        return [], str(exc)
    parts.append(src)
    return pointers, None


def _table_grad(mask: Mask, lifted: frozenset, parts: list[str]) -> tuple[list[str], list[str]]:
    """Append score_table_grad_triton (the gradient of the score_mod's float tables, added where
    each is read) to `parts`; returns the table pointers it reads and the tables' names (the bits
    of its LEARN). ([], []) when the score_mod reads no table that can learn, or one the
    translation cannot follow (the file then says so when such a table requires grad)."""
    stub = ("@triton.jit\ndef score_table_grad_triton(score, b, h, q_idx, kv_idx, ds, LEARN: tl.constexpr, DETERMINISTIC: tl.constexpr):\n"
            "    # no table of the score_mod learns here\n    return 0\n")
    if mask.score_mod is None:
        parts.append(stub)
        return [], []
    try:
        done = translate_table_grad(trace_mod(mask.score_mod, "score"), dict(captured_tensors(mask)), lifted)
    except Exception:  # Untranslatable (a table used whole), or a graph the tangent rules refuse
        done = None
    if done is None:
        parts.append(stub)
        return [], []
    src, pointers, names = done
    parts.append(src)
    return pointers, names


MAX_HEAD_DIM = 256


def check_supported(head_dim: int | None = None, dtype: str | None = None, name: str | None = None) -> None:
    """What the port runs, said before anything is generated or written: head dims up to 256 and
    bfloat16 / float16 / float32 inputs."""
    if head_dim is not None and head_dim > MAX_HEAD_DIM:
        raise WorkbenchError(f"the port runs head dims up to {MAX_HEAD_DIM}; asked for {head_dim}",
                             f"use --head-dim <= {MAX_HEAD_DIM} (FlexAttention itself runs larger ones: "
                             "verify --backend flex)", name)
    if dtype is not None and dtype not in DTYPES:
        raise WorkbenchError(f"the port runs {', '.join(DTYPES)} inputs; asked for {dtype}",
                             f"use --dtype {' / '.join(DTYPES)} (the float64 reference is what it is checked "
                             "against)", name)


def pinned_config(dtype: torch.dtype, head_dim: int) -> int:
    """The index of CONFIGS that callers pinning one configuration for every call (the invariance
    check) use: CONFIGS[0] (128 x 64), or for float32 at D > 64 the one long-row tile such calls
    run (WIDE_TILE), which fits the GPU's shared memory."""
    return CONFIGS.index(WIDE_TILE) if dtype == torch.float32 and head_dim > 64 else 0
