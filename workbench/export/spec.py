"""Stage 7, export: `build_spec` -- a mask in the terms of every backend that can run it. Each
target form (`forms`) is fitted for every distinct (batch, head) mask and kept only where it
reproduces the mask exactly; the score_mod is probed; the generated port is attached; golden
outputs come from the float64 reference."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from workbench import fa4, port
from workbench.analyze import mask_stats
from workbench.blocks import FULL, PARTIAL, block_classes, scan_blocks
from workbench.define import Mask, WorkbenchError, bind
from workbench.export import forms
from workbench.export.files import INLINE_LIMIT, SPEC_VERSION, TARGETS, PortingSpec, _resolve
from workbench.export.golden import add_golden
from workbench.translate import triton_section

__all__ = ["build_spec", "triton_reason"]


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


def _pattern(sections: dict, iv: forms.Intervals, q_len: int, per_head: bool) -> dict:
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
                 tag: str) -> tuple[dict, dict, forms.Intervals]:
    """All target sections for one (b, h): ({target: section}, {target: reason}, intervals)."""
    iv = forms.mask_intervals(mask, q_len, kv_len, b, h, device=device)
    sections, reasons = {}, {}

    def keep(target, section, why):
        if section is not None:
            sections[target] = section
        else:
            reasons[target] = why

    fa, why = forms.fit_flash_attn(iv, q_len, kv_len)
    if fa is not None:  # the fit compares run ends; the rule is a dense decode with FA's semantics
        wrong = forms.check_section(forms.decode_flash_attn(fa, q_len, kv_len), iv)
        fa, why = (fa, why) if wrong is None else (None, f"fitted form did not decode to the mask: {wrong}")
    keep("flash_attn", fa, why)
    keep("vllm_triton", *forms.fit_vllm_triton(iv, q_len, kv_len))
    keep("magi", *forms.fit_magi(iv, q_len, kv_len))
    if q_len == kv_len:
        cols = forms.mask_intervals(mask, q_len, kv_len, b, h, axis="cols", device=device)
        fm, arr, why = forms.fit_flashmask(cols, iv, q_len, kv_len)
    else:
        fm, arr, why = None, None, "FlashMask needs Lq == Lk"
    if fm:
        fm["startend_row_indices"] = _tensor_ref(tensors, f"flashmask{tag}", arr)
        sections["flashmask"] = fm
    else:
        reasons["flashmask"] = why
    k, table = forms.row_intervals_table(iv)
    sections["row_intervals"] = {"max_intervals": k, "rows": _tensor_ref(tensors, f"row_intervals{tag}", table, inline=True)}
    return sections, reasons, iv


def _block_sparse(scan, b: int, h: int, tensors: dict, tag: str) -> dict:

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
    exactly; the others are listed under `unsupported` with the reason.

    mask:        the Mask (`make(...)`), rebuilt at q_len x kv_len where its factory can
    heads/batch: for masks that differ per head / batch entry (a section per variant)
    head_dim:    of the golden vectors (q [batch, heads, q_len, head_dim], k / v [.., kv_len, ..])
    golden:      compute golden vectors with the float64 reference (`conformance` runs them)
    generalize:  refit the parametric forms at other lengths and say where they hold

        >>> from workbench import make
        >>> spec = build_spec(make("causal_sliding_window", {"window": 64}), 256, 256, golden=False)
        >>> spec.doc["backends"]["flash_attn"]["window_size"]
        [63, 0]
    """
    from tqdm.auto import tqdm


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
            full = Mask("full", mask_mod=lambda _b, _h, q_idx, _kv: q_idx >= 0)
            sections, why, iv = _fit_variant(full, q_len, kv_len, 0, 0, device, tensors, tag)
        else:
            sections, why, iv = _fit_variant(mask, q_len, kv_len, b, h, device, tensors, tag)
            sections["block_sparse"] = _block_sparse(scan, b, h, tensors, tag)
            check = forms.check_section(
                forms.decode_block_sparse(_resolve(sections["block_sparse"], tensors), q_len, kv_len,
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
    score, score_arrays = forms.probe_score(mask, q_len, kv_len, heads or 1, device=device, batch=batch or 1)
    for key, arr in score_arrays.items():
        tensors[key] = arr.astype(np.float32)
    backends: dict[str, Any] = {}
    for target, rows in per_target.items():
        if rows is None:
            continue
        backends[target] = _wrap(rows, B, H)
    _apply_score(backends, reasons, score)
    pattern = _pattern({t: (rows[0][0] if rows else None) for t, rows in per_target.items() if rows}, first_iv,
                       q_len, per_head=H is not None)
    generalizes = _check_generalization(mask, backends, q_len, kv_len, device) if generalize else {}
    for target, note in generalizes.items():
        section = backends[target]
        if isinstance(section, dict) and "by_head" not in section and "by_batch" not in section:
            section["generalizes"] = note
    reasons["triton"] = reasons.get("triton") or triton_reason(mask)
    port_source = None
    if reasons["triton"] is None:

        del reasons["triton"]
        backends["triton"] = triton_section(mask, tensors)
        port_source = port.generate(mask, q_len, kv_len, heads=heads or H, batch=batch or B)
        backends["triton_attention"] = port_source.section()
    else:
        reasons["triton_attention"] = reasons["triton"]
    fa4_source = None
    try:
        fa4_source = fa4.generate(mask, q_len, kv_len, heads=heads or H, batch=batch or B,
                                  scan=scan if scan is not None and (scan.q_block, scan.kv_block) == fa4.BLOCK else None)
        backends["flash_attn_cute"] = fa4_source.section()
    except WorkbenchError as exc:
        reasons["flash_attn_cute"] = exc.cause
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
    spec = PortingSpec(doc, tensors, port=port_source, fa4=fa4_source)
    if golden:
        add_golden(spec, mask, batch=batch or B or 1, heads=heads or H or 1, head_dim=head_dim, device=device, seed=seed)
    return spec


def triton_reason(mask: Mask) -> str | None:
    try:
        from workbench.translate import unsupported_reason
    except ImportError as exc:  # pragma: no cover
        return f"the Triton generator could not be loaded: {exc}"
    return unsupported_reason(mask)


def _apply_score(backends: dict, reasons: dict, score: dict) -> None:
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
                iv = forms.mask_intervals(other, lq, lk, device=device)
            except (WorkbenchError, IndexError, RuntimeError) as exc:
                text = exc.message if isinstance(exc, WorkbenchError) else f"{type(exc).__name__}: {exc}"
                data_bound = (lq, lk, text.splitlines()[0][:200])
                break
            fit = forms.fit_flash_attn if target == "flash_attn" else forms.fit_vllm_triton
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
