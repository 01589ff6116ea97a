"""Stage 7, export: the porting spec -- a mask in the terms of every backend that can run it.

`build_spec` fits each target form (workbench.porting) for every distinct (batch, head) mask,
keeps only forms that reproduce the mask exactly, probes the score_mod, and computes golden
outputs with the float64 reference. `write_spec` writes NAME-DIGEST.spec.json + .golden.safetensors
(validated against spec.schema.json); `load_spec` reads them back without executing anything.
`conformance` runs a candidate implementation on the golden vectors; `diff_specs` says whether
two specs describe the same attention.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
import torch

from workbench import porting
from workbench.define import Mask, WorkbenchError, bind, cdiv, output_folder

SPEC_VERSION = "1.0"
SCHEMA_PATH = Path(__file__).with_name("spec.schema.json")
TARGETS = ("flash_attn", "vllm_triton", "magi", "flashmask", "row_intervals", "block_sparse", "triton",
           "triton_attention")
INLINE_LIMIT = 4096  # integer arrays longer than this go to the safetensors file
GOLDEN_VECTORS = 2


@dataclass
class PortingSpec:
    """A spec in memory: the JSON document and the arrays it references by {"$tensor": name}."""

    doc: dict
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    port: Any = None  # port.PortSource: the generated attention file, written next to the spec

    @property
    def name(self) -> str:
        return self.doc["name"]

    @property
    def supported(self) -> list[str]:
        return list(self.doc["backends"])

    @property
    def unsupported(self) -> dict[str, str]:
        return dict(self.doc["unsupported"])

    def backends_frame(self) -> pd.DataFrame:
        """One row per backend: exact or not, the arguments of an exact one (its spec section as
        compact JSON; arrays appear as {"$tensor": name} references) and, if not, the reason."""
        rows = [dict(backend=t, exact=t in self.doc["backends"],
                     arguments=_compact(self.doc["backends"][t]) if t in self.doc["backends"] else "",
                     reason=self.doc["unsupported"].get(t, "")) for t in TARGETS]
        return pd.DataFrame(rows).set_index("backend")

    def backends_view(self):
        """`backends_frame` for a notebook: every argument and reason in full, wrapped (a bare
        DataFrame cuts cells at 50 characters)."""
        return (self.backends_frame().style
                .set_properties(**{"white-space": "pre-wrap", "text-align": "left", "font-size": "12px"})
                .set_properties(subset=["arguments"], **{"font-family": "monospace", "max-width": "640px"})
                .set_table_styles([{"selector": "th", "props": [("text-align", "left")]}]))


ARGUMENTS_SHOWN = 4000  # characters of a section shown in a table; the spec file has all of it


def _compact(section) -> str:
    text = json.dumps(section, separators=(", ", ": "))
    if len(text) <= ARGUMENTS_SHOWN:
        return text
    return text[:ARGUMENTS_SHOWN] + f" ... ({len(text):,} characters; all of it in the spec file)"


# ---------------------------------------------------------------- building

def _tensor_ref(tensors: dict, name: str, array: np.ndarray, inline: bool = False):
    if inline and array.size <= INLINE_LIMIT:
        return array.tolist()
    tensors[name] = np.ascontiguousarray(array)
    return {"$tensor": name}


def _variants(scan) -> tuple[int | None, int | None]:
    """Which (b, h) masks really differ, from an exact scan that counted the pairs where each head /
    batch entry differs from the first: (B or None, H or None) as the spec's shape. A mod that
    reads h but gives every head the same mask (a cross-attention mask, say) is not per-head."""
    if scan is None:
        return None, None

    def differs(flag, pairs):
        return flag and (pairs is None or int(pairs.sum()) > 0)

    b = scan.batch if differs(scan.depends_on_batch, scan.batch_pairs_differing) else None
    h = scan.heads if differs(scan.depends_on_head, scan.head_pairs_differing) else None
    return b, h


def _wrap(per_variant: list[list[Any]], B, H):
    """[[section per head] per batch] -> the section, or {"by_head": ...} / {"by_batch": ...}."""
    def heads_of(row):
        return row[0] if H is None else {"by_head": row}
    return heads_of(per_variant[0]) if B is None else {"by_batch": [heads_of(r) for r in per_variant]}


def _pattern(sections: dict, iv: porting.Intervals, q_len: int, kv_len: int, per_head: bool) -> dict:
    if per_head:
        return {"kind": "per_head", "params": {}}
    fa, vl = sections.get("flash_attn"), sections.get("vllm_triton")
    if fa is not None:
        l, r = fa["window_size"]
        if fa["cu_seqlens_q"]:
            return {"kind": "document", "params": {"cu_seqlens_q": fa["cu_seqlens_q"], "cu_seqlens_k": fa["cu_seqlens_k"],
                                                   "causal": fa["causal"]}}
        if fa["attention_chunk"]:
            return {"kind": "chunked", "params": {"chunk": fa["attention_chunk"], "causal": fa["causal"]}}
        if fa["causal"]:
            return ({"kind": "causal", "params": {"align": "bottom_right"}} if l < 0 else
                    {"kind": "sliding_window", "params": {"left": l, "right": 0}})
        if l < 0 and r < 0:
            return {"kind": "full", "params": {}}
        return {"kind": "sliding_window", "params": {"left": l, "right": r}}
    if vl is not None:
        if vl["rswa"]:
            return {"kind": "sinks_window", "params": dict(vl["rswa"])}
        ranges = vl["mm_prefix_ranges"] or []
        if vl["attn_type"] == "decoder" and not vl["sliding_window"]:
            if len(ranges) == 1 and ranges[0][0] == 0:
                return {"kind": "prefix_lm", "params": {"prefix_len": ranges[0][1] + 1}}
            return {"kind": "spans_in_causal", "params": {"spans": ranges}}
    lo, hi, empty = iv.single() if (iv.counts <= 1).all() else (None, None, None)
    if lo is not None and not empty.any() and (lo == 0).all() and np.array_equal(hi, np.arange(1, q_len + 1)):
        return {"kind": "causal", "params": {"align": "top_left"}}
    return {"kind": "unknown", "params": {}}


def _fit_variant(mask: Mask, q_len: int, kv_len: int, b: int, h: int, device, tensors: dict,
                 tag: str) -> tuple[dict, dict, porting.Intervals]:
    """All target sections for one (b, h): ({target: section}, {target: reason}, intervals)."""
    iv = porting.mask_intervals(mask, q_len, kv_len, b, h, device=device)
    sections, reasons = {}, {}

    def keep(target, section, why):
        if section is not None:
            sections[target] = section
        else:
            reasons[target] = why

    fa, why = porting.fit_flash_attn(iv, q_len, kv_len)
    if fa is not None:  # the fit compares run ends; the rule is a dense decode with FA's semantics
        wrong = porting.check_section(porting.decode_flash_attn(fa, q_len, kv_len), iv)
        fa, why = (fa, why) if wrong is None else (None, f"fitted form did not decode to the mask: {wrong}")
    keep("flash_attn", fa, why)
    keep("vllm_triton", *porting.fit_vllm_triton(iv, q_len, kv_len))
    keep("magi", *porting.fit_magi(iv, q_len, kv_len))
    if q_len == kv_len:
        cols = porting.mask_intervals(mask, q_len, kv_len, b, h, axis="cols", device=device)
        fm, arr, why = porting.fit_flashmask(cols, iv, q_len, kv_len)
    else:
        fm, arr, why = None, None, "FlashMask needs Lq == Lk"
    if fm:
        fm["startend_row_indices"] = _tensor_ref(tensors, f"flashmask{tag}", arr)
        sections["flashmask"] = fm
    else:
        reasons["flashmask"] = why
    k, table = porting.row_intervals_table(iv)
    sections["row_intervals"] = {"max_intervals": k, "rows": _tensor_ref(tensors, f"row_intervals{tag}", table, inline=True)}
    return sections, reasons, iv


def _block_sparse(scan, b: int, h: int, tensors: dict, tag: str) -> dict:
    from workbench.blocks import FULL, PARTIAL, block_classes

    classes = block_classes(scan)
    cls = classes[min(b, classes.shape[0] - 1), min(h, classes.shape[1] - 1)].cpu().numpy()
    rows_idx, cols_idx = np.nonzero(cls != 0)
    indptr = np.concatenate([[0], np.cumsum(np.bincount(rows_idx, minlength=cls.shape[0]))]).astype(np.int32)
    partial = (cls[rows_idx, cols_idx] == PARTIAL).astype(np.int8)
    flex = {"BLOCK_SIZE": [scan.q_block, scan.kv_block]}
    for name, value in (("kv", PARTIAL), ("full_kv", FULL)):
        sel = cls == value
        num = sel.sum(-1).astype(np.int32)
        order = np.argsort(~sel, axis=-1, kind="stable").astype(np.int32)
        flex[f"{name}_num_blocks"] = _tensor_ref(tensors, f"flex_{name}_num_blocks{tag}", num)
        flex[f"{name}_indices"] = _tensor_ref(tensors, f"flex_{name}_indices{tag}", order)
    return {"R": scan.q_block, "C": scan.kv_block,
            "indptr": _tensor_ref(tensors, f"bsr_indptr{tag}", indptr),
            "indices": _tensor_ref(tensors, f"bsr_indices{tag}", cols_idx.astype(np.int32)),
            "partial": _tensor_ref(tensors, f"bsr_partial{tag}", partial),
            "flex": flex}


def _parametric(target: str, section: dict) -> dict | None:
    """The part of a section that should not change with the length (None: size-specific data)."""
    if target == "flash_attn" and not section["cu_seqlens_q"]:
        return {k: section[k] for k in ("causal", "window_size", "attention_chunk")}
    if target == "vllm_triton" and not section["mm_prefix_ranges"]:
        return {k: section[k] for k in ("attn_type", "sliding_window", "rswa")}
    return None


def _other_sizes(q_len: int, kv_len: int) -> list[tuple[int, int]]:
    """Sizes to refit a parametric form at: two with the same kv_len - q_len, and two where that
    offset changes (a mask can fit one window at one offset and be another mask at the next)."""
    sizes = [(max(1, q_len - 37), max(1, kv_len - 37)), (q_len + 61, kv_len + 61),
             (max(1, q_len // 2 + 3), kv_len), (q_len, kv_len + 97)]
    return list(dict.fromkeys(s for s in sizes if s != (q_len, kv_len)))


def build_spec(mask: Mask, q_len: int, kv_len: int | None = None, *, heads: int | None = None,
               batch: int | None = None, head_dim: int = 64, block_size: int = 128, device="cpu",
               seed: int | None = None, golden: bool = True, generalize: bool = True,
               progress: bool = False) -> PortingSpec:
    """The porting spec of `mask` at these sizes. Every backend section in it reproduces the mask
    exactly; the others are listed under `unsupported` with the reason."""
    from tqdm.auto import tqdm

    from workbench.analyze import mask_stats
    from workbench.blocks import scan_blocks

    kv_len = kv_len or q_len
    device = torch.device(device)
    limit = 1 << 28
    if q_len * kv_len > limit:
        raise WorkbenchError(f"a porting spec at {q_len} x {kv_len} would list {q_len * kv_len:,} pairs per head",
                             f"export at a length with q_len * kv_len <= {limit:,} (e.g. 16384 x 16384); the parametric "
                             "forms are checked at other sizes anyway", mask.name)
    mask = bind(mask, q_len, kv_len, device)
    heads = heads or mask.heads
    batch = batch or mask.batch
    tensors: dict[str, np.ndarray] = {}
    scan = scan_blocks(mask, q_len, kv_len, heads=heads, batch=batch, block_size=block_size, device=device,
                       progress=False) if mask.mask_mod is not None else None
    B, H = _variants(scan)
    per_target: dict[str, list[list]] = {t: [] for t in ("flash_attn", "vllm_triton", "magi", "flashmask",
                                                            "row_intervals", "block_sparse")}
    reasons: dict[str, str] = {}
    first_iv = None
    variants = [(b, h) for b in range(B or 1) for h in range(H or 1)]
    for b, h in tqdm(variants, desc=f"spec {mask.name}", disable=not progress or len(variants) < 2):
        tag = "" if (B is None and H is None) else f".b{b}.h{h}"
        if mask.mask_mod is None:
            full = Mask("full", mask_mod=lambda bb, hh, q_idx, kv_idx: q_idx >= 0)
            sections, why, iv = _fit_variant(full, q_len, kv_len, 0, 0, device, tensors, tag)
        else:
            sections, why, iv = _fit_variant(mask, q_len, kv_len, b, h, device, tensors, tag)
            sections["block_sparse"] = _block_sparse(scan, b, h, tensors, tag)
            check = porting.check_section(
                porting.decode_block_sparse(_resolve(sections["block_sparse"], tensors), q_len, kv_len,
                                            lambda r0, r1, iv=iv: iv.dense((r0, r1))), iv)
            if check is not None:  # cannot happen unless the block scan is wrong; never emit it then
                del sections["block_sparse"]
                why["block_sparse"] = f"block list did not reproduce the mask: {check}"
        first_iv = first_iv or iv
        for target in per_target:
            if per_target[target] is None:
                continue
            if target in sections:
                if len(per_target[target]) <= b:
                    per_target[target].append([])
                per_target[target][b].append(sections[target])
            else:
                per_target[target] = None
                where = "" if tag == "" else f" (batch {b}, head {h})"
                reasons[target] = why.get(target, "not applicable") + where
    if mask.mask_mod is None:
        reasons["block_sparse"] = "there is no mask_mod: every block is full; run dense attention"
        per_target["block_sparse"] = None
    score, score_arrays = porting.probe_score(mask, q_len, kv_len, heads or 1, device=device, batch=batch or 1)
    for key, arr in score_arrays.items():
        tensors[key] = arr.astype(np.float32)
    backends: dict[str, Any] = {}
    for target, rows in per_target.items():
        if rows is None:
            continue
        backends[target] = _wrap(rows, B, H)
    _apply_score(backends, reasons, score, heads)
    pattern = _pattern({t: (rows[0][0] if rows else None) for t, rows in per_target.items() if rows}, first_iv,
                       q_len, kv_len, per_head=H is not None)
    generalizes = _check_generalization(mask, backends, q_len, kv_len, device) if generalize else {}
    for target, note in generalizes.items():
        section = backends[target]
        if isinstance(section, dict) and "by_head" not in section and "by_batch" not in section:
            section["generalizes"] = note
    reasons["triton"] = reasons.get("triton") or triton_reason(mask)
    port_source = None
    if reasons["triton"] is None:
        from workbench import port
        from workbench.triton_gen import triton_section

        del reasons["triton"]
        backends["triton"] = triton_section(mask, tensors)
        port_source = port.generate(mask, q_len, kv_len, heads=heads or H, batch=batch or B)
        backends["triton_attention"] = port_source.section()
    else:
        reasons["triton_attention"] = reasons["triton"]
    doc = {
        "spec_version": SPEC_VERSION,
        "name": mask.name,
        "params": mask.params,
        "library": getattr(mask.factory, "__name__", None),
        "description": mask.description,
        "source": mask.source,
        "shape": {"B": B, "H": H, "q_len": q_len, "kv_len": kv_len},
        "notation": "i = query index, j = key index, D = kv_len - q_len, a = i + D; keep = attended",
        "pattern": pattern,
        "score": score,
        "backends": backends,
        "unsupported": {t: reasons[t] for t in TARGETS if t not in backends and t in reasons},
        "hazards": {},
        "golden": None,
        "cost": {},
    }
    if scan is not None:
        stats = mask_stats(scan, head_dim=head_dim)
        doc["hazards"] = {"fully_masked_rows": stats.fully_masked_rows,
                          "fully_masked_row_examples": [list(x) for x in stats.fully_masked_row_examples[:8]]}
        doc["cost"] = {"density": stats.density, "block_size": [scan.q_block, scan.kv_block],
                       "block_density": 1 - stats.block_sparsity, "head_dim": head_dim,
                       "kernel_flops": stats.kernel_flops, "kept_flops": stats.kept_flops,
                       "partial_waste": stats.partial_waste}
    else:
        doc["cost"] = {"density": 1.0, "block_density": 1.0, "head_dim": head_dim,
                       "kept_flops": 4.0 * head_dim * q_len * kv_len * (heads or 1) * (batch or 1)}
    spec = PortingSpec(doc, tensors, port=port_source)
    if golden:
        add_golden(spec, mask, batch=batch or B or 1, heads=heads or H or 1, head_dim=head_dim, device=device, seed=seed)
    return spec


def triton_reason(mask: Mask) -> str | None:
    try:
        from workbench.triton_gen import unsupported_reason
    except ImportError as exc:  # pragma: no cover
        return f"the Triton generator could not be loaded: {exc}"
    return unsupported_reason(mask)


def _apply_score(backends: dict, reasons: dict, score: dict, heads: int | None) -> None:
    """Put the score into the sections that can carry it; drop those that cannot."""
    kind = score["kind"]

    def each_section(section):
        if "by_batch" in section:
            for s in section["by_batch"]:
                yield from each_section(s)
        elif "by_head" in section:
            yield from section["by_head"]
        else:
            yield section

    if "flash_attn" in backends:
        if kind in ("none", "softcap", "alibi"):
            for s in each_section(backends["flash_attn"]):
                s["softcap"] = score["cap"] if kind == "softcap" else 0.0
                s["alibi_slopes"] = score["slopes"] if kind == "alibi" else None
        else:
            del backends["flash_attn"]
            reasons["flash_attn"] = f"the score_mod is {kind}; FlashAttention takes only softcap and alibi_slopes"
    if "vllm_triton" in backends:
        if kind in ("none", "softcap", "alibi"):
            for s in each_section(backends["vllm_triton"]):
                s["logits_soft_cap"] = score["cap"] if kind == "softcap" else None
                s["alibi_slopes"] = score["slopes"] if kind == "alibi" else None
        else:
            del backends["vllm_triton"]
            reasons["vllm_triton"] = f"the score_mod is {kind}; TritonAttention takes only logits_soft_cap and alibi_slopes"
    if kind != "none":
        for target in ("magi", "flashmask"):
            if target in backends:
                del backends[target]
                reasons[target] = f"the score_mod is {kind}; {target} sections describe masks only"
    for target in ("row_intervals", "block_sparse"):
        if target in backends and kind != "none":
            backends[target]["score"] = "apply the spec's `score` section to every kept pair"


def _check_generalization(mask: Mask, backends: dict, q_len: int, kv_len: int, device) -> dict:
    """Refit the parametric forms at other sizes (other lengths and other kv_len - q_len offsets);
    say whether they hold there, at which sizes that was checked, and where they break."""
    out = {}
    targets = {t: _parametric(t, s) for t, s in backends.items()
               if t in ("flash_attn", "vllm_triton") and isinstance(s, dict) and "by_head" not in s
               and "by_batch" not in s}
    for target, params in targets.items():
        if params is None:
            out[target] = {"parametric": False, "note": "segment/range lists are specific to these lengths"}
            continue
        checked, failed, data_bound = [], None, None
        for lq, lk in _other_sizes(q_len, kv_len):
            try:
                other = bind(mask, lq, lk, device)
                iv = porting.mask_intervals(other, lq, lk, device=device)
            except (WorkbenchError, IndexError, RuntimeError) as exc:
                text = exc.message if isinstance(exc, WorkbenchError) else f"{type(exc).__name__}: {exc}"
                data_bound = (lq, lk, text.splitlines()[0][:200])
                break
            fit = porting.fit_flash_attn if target == "flash_attn" else porting.fit_vllm_triton
            section, _ = fit(iv, lq, lk)
            if section is None or _parametric(target, section) != params:
                failed = [lq, lk]
                break
            checked.append([lq, lk])
        if data_bound is not None:
            lq, lk, text = data_bound
            out[target] = {"parametric": False, "checked_sizes": checked,
                           "note": f"data-bound: the mask cannot be evaluated at {lq} x {lk} ({text}); its "
                                   f"captured data fixes it to {q_len} x {kv_len}, so these arguments hold only there"}
            continue
        offsets = sorted({lk - lq for lq, lk in checked} | {kv_len - q_len})
        out[target] = {"parametric": failed is None, "checked_sizes": checked,
                       **({"differs_at": failed} if failed else
                          {"holds_for": "any q_len, kv_len (checked at kv_len - q_len = "
                                        f"{', '.join(map(str, offsets))})"})}
    return out


# ---------------------------------------------------------------- golden vectors

def add_golden(spec: PortingSpec, mask: Mask, batch: int, heads: int, head_dim: int, device, seed: int | None):
    """Float64-reference outputs on random float32 inputs at the spec's shape (vector 1 has
    4x larger queries: peaked softmaxes, where masking mistakes show most). The inputs sit on
    the bfloat16 grid, so a port that casts them to bf16 or fp16 loses nothing."""
    from workbench.run import Shape, make_inputs
    from workbench.verify import reference_attention

    q_len, kv_len = spec.doc["shape"]["q_len"], spec.doc["shape"]["kv_len"]
    shape = Shape(batch=batch, q_heads=heads, q_len=q_len, kv_len=kv_len, head_dim=head_dim)
    seeds = []
    for n in range(GOLDEN_VECTORS):
        inputs = make_inputs(shape, "float32", device, seed=None if seed is None else seed + n)
        inputs.q, inputs.k, inputs.v = (t.bfloat16().float() for t in (inputs.q, inputs.k, inputs.v))
        if n == 1:
            inputs.q = inputs.q * 4
        ref = reference_attention(mask, inputs)
        nan_why = ref.nan_message(mask.name)
        if nan_why:
            raise WorkbenchError(f"no golden vectors can be written: {nan_why}",
                                 "fix the score_mod so that every kept pair has a finite score, then export again",
                                 mask.name)
        for key, value in (("q", inputs.q), ("k", inputs.k), ("v", inputs.v), ("out", ref.out), ("lse", ref.lse)):
            spec.tensors[f"golden.{n}.{key}"] = value.detach().cpu().numpy()
        seeds.append(inputs.seed)
    spec.doc["golden"] = {
        "file": f"{_safe_name(spec.name)}.golden.safetensors", "vectors": GOLDEN_VECTORS, "seeds": seeds,
        "input_dtype": "float32", "inputs_exact_in": ["bfloat16", "float32"], "reference_dtype": "float64", "scale": 1 / math.sqrt(head_dim),
        "shapes": {"q": [batch, heads, q_len, head_dim], "k": [batch, heads, kv_len, head_dim],
                   "v": [batch, heads, kv_len, head_dim], "out": [batch, heads, q_len, head_dim],
                   "lse": [batch, heads, q_len]},
        "tensors": "golden.N.q / .k / .v / .out / .lse for N = 0 .. vectors - 1",
        "fully_masked_rows": "out = 0 and lse = -inf there (FlexAttention's convention)",
        "sha256": {name: tensor_digest(spec.tensors[name]) for name in sorted(spec.tensors)
                   if name.startswith("golden.")},
    }
    if device.type == "cuda" and mask.mask_mod is not None:
        spec.doc["cost"].update(_flex_time(mask, shape, device))


def tensor_digest(array: np.ndarray) -> str:
    """sha256 of an array's dtype, shape and bytes: a golden file edited after export (zeroed,
    NaN-filled, swapped) no longer matches the digest its spec recorded."""
    import hashlib

    h = hashlib.sha256(f"{array.dtype.str}{list(array.shape)}".encode())
    h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()


def _flex_time(mask: Mask, shape, device) -> dict:
    from triton.testing import do_bench

    from workbench.run import make_inputs, run_flex

    inputs = make_inputs(shape, "bfloat16", device, seed=0)
    run = run_flex(mask, inputs)
    ms = do_bench(lambda: run_flex(mask, inputs, block_mask=run.block_mask), warmup=5, rep=50)
    return {"flex_ms": ms, "flex_device": torch.cuda.get_device_name(device), "flex_dtype": "bfloat16",
            "flex_shape": asdict(shape), "torch": torch.__version__}


# ---------------------------------------------------------------- files

def spec_stem(doc: dict) -> str:
    """NAME-DIGEST: the mask's name and 8 hex digits of its parameters, score parameters and shape,
    so specs of one factory at other parameters or lengths get their own files."""
    import hashlib

    key = json.dumps({"params": doc.get("params"), "score": (doc.get("score") or {}).get("params"),
                      "shape": doc.get("shape")}, sort_keys=True, default=str)
    return f"{_safe_name(doc['name'])}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"


def _safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.+" else "_" for c in name)


def _schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


def validate_doc(doc: dict, where: str = "spec") -> None:
    import jsonschema

    try:
        jsonschema.validate(doc, _schema())
    except jsonschema.ValidationError as exc:
        path = "/".join(str(p) for p in exc.absolute_path) or "(top level)"
        raise WorkbenchError(f"{where} fails the porting-spec schema at `{path}`: {exc.message[:300]}",
                             "fix that field, or export the spec again with `python -m workbench export`") from exc


def write_spec(spec: PortingSpec, out_dir: str | Path) -> tuple[Path, Path]:
    from safetensors.numpy import save_file

    out = output_folder(out_dir, spec.name)
    base = spec_stem(spec.doc)
    doc = dict(spec.doc)
    doc["tensor_file"] = f"{base}.golden.safetensors"
    doc["tensors"] = {k: {"dtype": str(v.dtype), "shape": list(v.shape)} for k, v in sorted(spec.tensors.items())}
    doc = _json_ready(doc)
    validate_doc(doc)
    json_path, st_path = out / f"{base}.spec.json", out / f"{base}.golden.safetensors"
    save_file({k: np.ascontiguousarray(v) for k, v in spec.tensors.items()}, str(st_path),
              metadata={"spec": json_path.name, "spec_version": SPEC_VERSION})
    json_path.write_text(json.dumps(doc, indent=1))
    if spec.port is not None:
        from workbench import port

        port.write(spec.port, out)
    return json_path, st_path


def _json_ready(value):
    if isinstance(value, dict):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _resolve(value, tensors: dict, field_path: str = ""):
    """Replace {"$tensor": name} by the array (numpy) everywhere inside `value`."""
    if isinstance(value, dict):
        if set(value) == {"$tensor"}:
            name = value["$tensor"]
            if name not in tensors:
                raise WorkbenchError(f"field `{field_path}` references tensor {name!r}, which is not in the tensor file",
                                     "export the spec again so the JSON and the safetensors file match")
            return tensors[name]
        return {k: _resolve(v, tensors, f"{field_path}/{k}" if field_path else k) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, tensors, f"{field_path}/{i}") for i, v in enumerate(value)]
    return value


def load_spec(path: str | Path, golden: bool = True) -> PortingSpec:
    """Read NAME.spec.json and its safetensors file: JSON and safetensors only (no pickle, no
    code runs). Validates the schema, every tensor reference and every array shape; with `golden`
    also the golden vectors' digests (what `diff`, which never reads them, skips)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    path = Path(path)
    if path.is_dir():
        raise WorkbenchError(f"{path} is a directory, not a spec file", "pass the NAME.spec.json that `export` wrote")
    try:
        doc = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError as exc:
        raise WorkbenchError(f"no spec file at {path}", "pass the NAME.spec.json that `export` wrote") from exc
    except UnicodeDecodeError as exc:
        raise WorkbenchError(f"{path.name} is not UTF-8 text, so it is not a spec (nothing in it was run)",
                             "pass the NAME.spec.json that `export` wrote") from exc
    except json.JSONDecodeError as exc:
        raise WorkbenchError(f"{path.name} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})",
                             "export the spec again, or repair the JSON") from exc
    except RecursionError as exc:
        raise WorkbenchError(f"{path.name} is nested too deeply to be a spec", "pass the NAME.spec.json that `export` "
                             "wrote") from exc
    except OSError as exc:
        raise WorkbenchError(f"cannot read {path}: {exc.strerror or exc}", "pass a readable spec file") from exc
    if not isinstance(doc, dict):
        raise WorkbenchError(f"{path.name} holds a JSON {type(doc).__name__}, not a spec object (it fails the "
                             "porting-spec schema)", "pass the NAME.spec.json that `export` wrote")
    try:
        validate_doc(doc, path.name)
    except RecursionError as exc:
        raise WorkbenchError(f"{path.name} is nested too deeply to be a spec", "pass the NAME.spec.json that `export` "
                             "wrote") from exc
    st_path = path.with_name(doc["tensor_file"])
    try:
        tensors = load_file(str(st_path))
    except FileNotFoundError as exc:
        raise WorkbenchError(f"the tensor file {st_path.name} named by `tensor_file` is missing",
                             "keep NAME.spec.json and NAME.golden.safetensors together") from exc
    except (SafetensorError, OSError, ValueError) as exc:
        raise WorkbenchError(f"{st_path.name} is not a readable safetensors file ({exc})",
                             "export the spec again") from exc
    spec = PortingSpec(doc, tensors)
    check_shapes(spec, golden)
    return spec


def _expect(cond: bool, field_path: str, what: str):
    if not cond:
        raise WorkbenchError(f"field `{field_path}` has the wrong shape: {what}",
                             "export the spec again so every array matches the spec's shape")


def _sections(section, path):
    if isinstance(section, dict) and "by_batch" in section:
        for b, s in enumerate(section["by_batch"]):
            yield from _sections(s, f"{path}/by_batch/{b}")
    elif isinstance(section, dict) and "by_head" in section:
        for h, s in enumerate(section["by_head"]):
            yield from _sections(s, f"{path}/by_head/{h}")
    else:
        yield section, path


def check_shapes(spec: PortingSpec, golden: bool = True) -> None:
    doc, tensors = spec.doc, spec.tensors
    q_len, kv_len = doc["shape"]["q_len"], doc["shape"]["kv_len"]
    _resolve(doc, tensors)  # every reference exists
    for name, meta in doc.get("tensors", {}).items():
        _expect(name in tensors and list(tensors[name].shape) == meta["shape"], f"tensors/{name}",
                f"index says {meta['shape']}, file has {list(tensors[name].shape) if name in tensors else 'nothing'}")
    backends = doc["backends"]
    for target, section in backends.items():
        for s, p in _sections(section, f"backends/{target}"):
            s = _resolve(s, tensors, p)
            if target == "row_intervals":
                rows = np.asarray(s["rows"]) if not isinstance(s["rows"], np.ndarray) else s["rows"]
                _expect(len(rows) == q_len, f"{p}/rows", f"{len(rows)} rows for q_len {q_len}")
            elif target == "flashmask":
                arr = np.asarray(s["startend_row_indices"])
                _expect(arr.ndim == 2 and arr.shape[0] == kv_len and arr.shape[1] in (1, 2, 4),
                        f"{p}/startend_row_indices", f"{list(arr.shape)}, want [kv_len={kv_len}, 1|2|4]")
            elif target == "block_sparse":
                rows = cdiv(q_len, s["R"])
                _expect(len(s["indptr"]) == rows + 1, f"{p}/indptr", f"{len(s['indptr'])} entries, want {rows + 1}")
                _expect(len(s["indices"]) == len(s["partial"]) == int(s["indptr"][-1]), f"{p}/indices",
                        "indices/partial lengths differ from indptr[-1]")
            elif target == "magi":
                _expect(len(s["q_ranges"]) == len(s["k_ranges"]) == len(s["attn_type_map"]), f"{p}/q_ranges",
                        "q_ranges, k_ranges and attn_type_map differ in length")
    g = doc.get("golden")
    if g:
        want = {"q": [q_len], "out": [q_len], "lse": [q_len], "k": [kv_len], "v": [kv_len]}
        for key, (length,) in want.items():
            declared = g["shapes"].get(key, [])
            _expect(len(declared) >= 3 and declared[2] == length, f"golden/shapes/{key}",
                    f"{key} has length {declared[2] if len(declared) >= 3 else '?'}, but shape says "
                    f"{'q_len' if key in ('q', 'out', 'lse') else 'kv_len'} = {length}")
        for n in range(g["vectors"]):
            for key in ("q", "k", "v", "out", "lse"):
                name = f"golden.{n}.{key}"
                _expect(name in tensors and list(tensors[name].shape) == g["shapes"][key], f"golden/shapes/{key}",
                        f"{name} is {list(tensors[name].shape) if name in tensors else 'missing'}, want {g['shapes'][key]}")
        if golden:
            check_golden(spec)


def check_golden(spec: PortingSpec) -> None:
    """Golden vectors are trusted only when they match the digests the spec recorded at export
    and hold no NaN (a NaN golden would let any port pass)."""
    g, tensors = spec.doc["golden"], spec.tensors
    digests = g.get("sha256")
    if not isinstance(digests, dict) or not digests:
        raise WorkbenchError("the spec's golden vectors carry no sha256 digests, so edits to them cannot be detected",
                             "export the spec again with this version (`python -m workbench export`)")
    for n in range(g["vectors"]):
        for key in ("q", "k", "v", "out", "lse"):
            name = f"golden.{n}.{key}"
            want = digests.get(name)
            if want is None or tensor_digest(tensors[name]) != want:
                raise WorkbenchError(f"golden tensor {name} in {doc_file(spec)} does not match the digest recorded at "
                                     "export: the file was modified after it was written",
                                     "export the spec again; never edit golden vectors by hand")
            if np.isnan(tensors[name]).any():
                raise WorkbenchError(f"golden tensor {name} holds NaN; NaN goldens would let any port pass",
                                     "export the spec again from a mask whose reference is finite")


def doc_file(spec: PortingSpec) -> str:
    return spec.doc.get("tensor_file", "the tensor file")


# ---------------------------------------------------------------- reading a spec back as a mask

DECODERS = ("flash_attn", "vllm_triton", "magi", "flashmask")  # exact sections a diff can read rows from
MAX_DENSE_KV = 1 << 26


def spec_rows(spec: PortingSpec, b: int, h: int) -> Callable[[int, int], list[list[tuple[int, int]]]]:
    """The spec's kept runs [s, e) of rows r0..r1-1 for (b, h): read from `row_intervals` (no dense
    matrix, any length), or decoded from another exact section when that one is missing."""
    kv_len = spec.doc["shape"]["kv_len"]
    q_len = spec.doc["shape"]["q_len"]

    def pick(section):
        if "by_batch" in section:
            section = section["by_batch"][min(b, len(section["by_batch"]) - 1)]
        if "by_head" in section:
            section = section["by_head"][min(h, len(section["by_head"]) - 1)]
        return _resolve(section, spec.tensors)

    backends = spec.doc["backends"]
    if "row_intervals" in backends:
        table = pick(backends["row_intervals"])["rows"]

        def from_table(r0, r1):
            out = []
            for n in range(r0, r1):
                runs = [(int(s), int(e)) for s, e in table[n] if e > s]
                if any(s < 0 or e > kv_len for s, e in runs):
                    raise WorkbenchError(f"row_intervals row {n} holds a run outside 0..{kv_len}",
                                         "export the spec again")
                out.append(runs)
            return out
        return from_table
    target = next((t for t in DECODERS if t in backends), None)
    if target is None:
        raise WorkbenchError(f"{spec.name} has no section a diff can read rows from (row_intervals, "
                             f"{', '.join(DECODERS)})", "export the spec again (row_intervals is always written)")
    if kv_len > MAX_DENSE_KV:
        raise WorkbenchError(f"{spec.name} has no row_intervals and kv_len = {kv_len:,} is too long to decode its "
                             f"{target} section densely", "export the spec again (it writes row_intervals)")
    section = pick(backends[target])
    decode = {"flash_attn": lambda: porting.decode_flash_attn(section, q_len, kv_len),
              "vllm_triton": lambda: porting.decode_vllm_triton(section, q_len, kv_len),
              "magi": lambda: porting.decode_magi(section, q_len, kv_len),
              "flashmask": lambda: porting.decode_flashmask(section, q_len, kv_len,
                                                            np.asarray(section["startend_row_indices"]))}[target]()

    def from_dense(r0, r1):
        dense = torch.from_numpy(decode(r0, r1))
        rise, fall = porting._runs(dense)
        out = [[] for _ in range(r1 - r0)]
        for (n, s), (_, e) in zip(rise, fall):
            out[n].append((int(s), int(e)))
        return out
    return from_dense


def _row_difference(ra: list, rb: list) -> list[tuple[int, int, bool]]:
    """Where two rows' kept runs differ: (start, end, kept by a) pieces, in order."""
    points = sorted({p for s, e in ra + rb for p in (s, e)})
    out = []
    for lo, hi in zip(points, points[1:]):
        in_a = any(s <= lo and hi <= e for s, e in ra)
        in_b = any(s <= lo and hi <= e for s, e in rb)
        if in_a != in_b:
            if out and out[-1][1] == lo and out[-1][2] == in_a:
                out[-1] = (out[-1][0], hi, in_a)
            else:
                out.append((lo, hi, in_a))
    return out


# ---------------------------------------------------------------- conformance

@dataclass
class ConformanceReport:
    spec: str
    impl: str
    rows: list[dict]

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(r["passed"] for r in self.rows)

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows).set_index("vector")

    @property
    def line(self) -> str:
        n_pass = sum(r["passed"] for r in self.rows)
        return f"{'PASS' if self.passed else 'FAIL'} {self.impl} on {self.spec}: {n_pass}/{len(self.rows)} golden vectors"


def _generated_port(target: str) -> Callable | None:
    """impl(q, k, v, spec) for a port file the workbench generated (`PORT.py:attention`, e.g. the
    one `export` writes next to the spec), run as it is: in this process on a GPU, on a CPU in a
    fresh process under Triton's interpreter. None for any other target."""
    from workbench import port

    file, _, entry = target.partition(":")
    path = Path(file)
    if entry not in ("", port.ENTRY) or path.suffix != ".py" or not path.is_file():
        return None
    if "Generated by flex-workbench" not in path.read_text(errors="replace")[:20000]:
        return None

    def run_port(q, k, v, spec):
        return port.run_file(path, q, k, v)[0]

    run_port.__name__ = f"{path.name}:{port.ENTRY}"
    return run_port


def _with_spec_argument(fn: Callable) -> Callable:
    """fn as impl(q, k, v, spec): one that takes only (q, k, v) -- a FlexAttention-like attention()
    -- is called without the spec."""
    import inspect

    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return fn
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind is p.VAR_POSITIONAL for p in params) or len(positional) >= 4:
        return fn
    if len(positional) == 3:
        return lambda q, k, v, spec: fn(q, k, v)
    return fn


def load_impl(target: str) -> Callable:
    from workbench.define import load_factory

    return load_factory(target)


def conformance(spec_path: str | Path, impl: Callable | str, device="cpu", dtype: str | None = None,
                timeout: float | None = 300.0) -> ConformanceReport:
    """Run impl(q, k, v, spec) -> out (or impl(q, k, v) -> out, e.g. a generated port's
    `attention`, run as it is) on every golden vector and compare with the reference at
    the tolerance of impl's output dtype (or `dtype`). `spec` is the JSON dict with each
    {"$tensor": name} replaced by a CPU torch tensor. A call that raises, exits, returns
    something other than a tensor of the right shape, or does not return within `timeout`
    seconds fails its vector with the reason."""
    from workbench.define import TimedOut, call_with_timeout
    from workbench.run import dtype_name
    from workbench.verify import TOLERANCES, compare

    if dtype is not None:
        dtype = dtype_name(dtype)
    spec = load_spec(spec_path)
    if not spec.doc.get("golden"):
        raise WorkbenchError(f"{Path(spec_path).name} has no golden vectors (`golden` is null), so there is "
                             "nothing to run an implementation against",
                             "export the spec with golden vectors (`python -m workbench export`, the default)")
    impl_name = impl if isinstance(impl, str) else getattr(impl, "__name__", repr(impl))
    fn = _generated_port(impl) if isinstance(impl, str) else None
    fn = fn or (load_impl(impl) if isinstance(impl, str) else impl)
    fn = _with_spec_argument(fn)
    resolved = _resolve(spec.doc, {k: torch.from_numpy(v.copy()) for k, v in spec.tensors.items()})
    rows = []
    for n in range(spec.doc["golden"]["vectors"]):
        q, k, v = (torch.from_numpy(spec.tensors[f"golden.{n}.{x}"].copy()).to(device) for x in ("q", "k", "v"))
        want = torch.from_numpy(spec.tensors[f"golden.{n}.out"].copy())
        row = {"vector": n, "passed": False, "max_abs_err": None, "rel_err": None, "nan_count": None,
               "worst": "", "message": ""}
        rows.append(row)
        try:
            got = call_with_timeout(lambda: fn(q, k, v, resolved), timeout)
        except TimedOut:
            row["message"] = (f"did not return within {timeout:g} s; the remaining vectors were not run "
                              "(raise --timeout if the implementation is just slow)")
            break
        except SystemExit as exc:
            row["message"] = f"called sys.exit({exc.code!r}) instead of returning the output"
            continue
        except Exception as exc:  # the candidate's failure is a result, not a crash
            row["message"] = f"raised {type(exc).__name__}: {str(exc).strip()[:300]}"
            continue
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            row["message"] = f"returned {shape}, want a tensor of shape {tuple(want.shape)}"
            continue
        if got.device.type == "meta":
            row["message"] = "returned a meta tensor (a shape with no data)"
            continue
        if got.is_complex() or not (got.is_floating_point()):
            row["message"] = f"returned {got.dtype}, want a floating-point output"
            continue
        out_dtype = dtype or str(got.dtype).removeprefix("torch.")
        tol = TOLERANCES.get(out_dtype, TOLERANCES["float32"])
        check = compare("out", got.detach().cpu(), want, tol)
        row.update(passed=check.passed, max_abs_err=check.max_abs_err, rel_err=check.rel_err,
                   nan_count=check.nan_count, worst=", ".join(f"{a}={i}" for a, i in check.worst.items()),
                   message=(f"{check.bad_count} elements outside atol {tol.atol:g} + rtol {tol.rtol:g} ({out_dtype})"
                            + (f", {check.nan_count} NaN" if check.nan_count else "")
                            if not check.passed else "ok"))
    return ConformanceReport(spec=Path(spec_path).name, impl=impl_name, rows=rows)


# ---------------------------------------------------------------- diff

@dataclass
class SpecDiff:
    a: str
    b: str
    same: bool
    shape_a: dict
    shape_b: dict
    score_same: bool
    differing_pairs: int | None  # None when the specs cannot be compared pair by pair (other sizes)
    examples: list[dict]  # first differences: b, h, rows q [q0, q1), keys kv [kv0, kv1), which spec keeps them
    notes: list[str]

    @property
    def line(self) -> str:
        if self.same:
            return f"SAME {self.a} and {self.b}: identical masks and scores"
        pairs = ("not comparable pair by pair" if self.differing_pairs is None
                 else f"{self.differing_pairs:,} pairs differ")
        return (f"DIFFERENT {self.a} vs {self.b}: {pairs}"
                + ("" if self.score_same else "; scores differ") + ("; " + "; ".join(self.notes) if self.notes else ""))


def diff_specs(path_a: str | Path, path_b: str | Path, max_examples: int = 10) -> SpecDiff:
    """Whether two specs describe the same attention: their masks compared row by row on their
    kept runs (no dense matrix, so any length), and their scores. Differences come back as
    ranges: rows [q0, q1) where keys [kv0, kv1) are kept by only one of the two."""
    a, b = load_spec(path_a, golden=False), load_spec(path_b, golden=False)  # (diff never reads golden vectors)
    name_a, name_b = _spec_label(a, path_a), _spec_label(b, path_b)
    sa, sb = a.doc["shape"], b.doc["shape"]
    notes = []
    score_same = a.doc["score"] == b.doc["score"] or _score_close(a, b)
    if (sa["q_len"], sa["kv_len"]) != (sb["q_len"], sb["kv_len"]):
        notes.append(f"lengths differ: {name_a} is {sa['q_len']} x {sa['kv_len']} (q_len x kv_len), {name_b} is "
                     f"{sb['q_len']} x {sb['kv_len']}; pairs can only be compared at one size: export both with the "
                     "same --q-len / --kv-len")
        return SpecDiff(name_a, name_b, False, sa, sb, score_same, None, [], notes)
    for key in ("B", "H"):
        if sa[key] and sb[key] and sa[key] != sb[key]:
            notes.append(f"{key} differs: {sa[key]} vs {sb[key]}; export both with the same --batch / --heads")
            return SpecDiff(name_a, name_b, False, sa, sb, score_same, None, [], notes)
    B = max(sa["B"] or 1, sb["B"] or 1)
    H = max(sa["H"] or 1, sb["H"] or 1)
    q_len = sa["q_len"]
    step = 4096
    differing, examples = 0, []
    for bb in range(B):
        for hh in range(H):
            rows_a, rows_b = spec_rows(a, bb, hh), spec_rows(b, bb, hh)
            for r0 in range(0, q_len, step):
                r1 = min(q_len, r0 + step)
                for n, (ra, rb) in enumerate(zip(rows_a(r0, r1), rows_b(r0, r1))):
                    if ra == rb:
                        continue
                    for lo, hi, in_a in _row_difference(ra, rb):
                        differing += hi - lo
                        q = r0 + n
                        last = examples[-1] if examples else None
                        if last and (last["b"], last["h"], last["q"][1], last["kv"], last["kept_by"]) == (
                                bb, hh, q, [lo, hi], name_a if in_a else name_b):
                            last["q"][1] = q + 1  # the same keys differ on the next row too: one range
                        elif len(examples) < max_examples:
                            examples.append({"b": bb, "h": hh, "q": [q, q + 1], "kv": [lo, hi],
                                             "kept_by": name_a if in_a else name_b})
    if not score_same:
        notes.append(f"score {a.doc['score'].get('kind')} vs {b.doc['score'].get('kind')}")
    return SpecDiff(name_a, name_b, differing == 0 and score_same, sa, sb, score_same, differing, examples, notes)


def _spec_label(spec: PortingSpec, path) -> str:
    """The file name, with the parameters when they tell two exports apart."""
    params = spec.doc.get("params") or {}
    shown = ", ".join(f"{k}={json.dumps(v)}" for k, v in params.items())
    return f"{Path(path).name} ({shown})" if shown and len(shown) < 80 else Path(path).name


def _score_close(a: PortingSpec, b: PortingSpec) -> bool:
    sa, sb = a.doc["score"], b.doc["score"]
    if sa.get("kind") != sb.get("kind"):
        return False
    ra, rb = _resolve(sa, a.tensors), _resolve(sb, b.tensors)
    for key in set(ra) | set(rb):
        va, vb = ra.get(key), rb.get(key)
        if isinstance(va, (list, np.ndarray, float, int)) and isinstance(vb, (list, np.ndarray, float, int)):
            va, vb = np.asarray(va, dtype=float), np.asarray(vb, dtype=float)
            if va.shape != vb.shape or not np.allclose(va, vb, rtol=1e-6, atol=1e-7):
                return False
        elif va != vb:
            return False
    return True
