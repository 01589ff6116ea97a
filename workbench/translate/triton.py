"""Triton source for a mask_mod / score_mod, generated from the traced mod: the assembly of the
pair-wise translation (`triton_mask`), the bounds over a block (`triton_bounds`) and test-harness
kernels, and the spec's `triton` section.

The mod is traced with make_fx on 0-d index tensors (the way FlexAttention sees it) into an
aten graph; each aten op becomes one line of Triton. The generated text is data: it goes into
specs and into the port's file, and the block-scan kernel (`workbench.kernels`) and the port
compile it. `load_source`, `run_grid` and `run_bounds` compile and run it here too, for tests and
harnesses (on the GPU, or on the CPU under TRITON_INTERPRET=1); loading a spec never does.
"""

from __future__ import annotations

from pathlib import Path

import torch

from workbench.define import Mask, captured_tensors, cdiv, trace_mod
from workbench.define.util import fill_template, load_module, template_body
from workbench.translate.emitter import Untranslatable
from workbench.translate.triton_bounds import range_pointers, table_ranges, translate_bounds
from workbench.translate.triton_mask import HELPERS, MAX_UNROLLED, translate_mod

# the test-harness kernels appended to the translated mods (templates in the @@ dialect)
HARNESS = Path(__file__).with_name("templates")

__all__ = ["Untranslatable", "mod_functions", "generate", "unsupported_reason", "triton_section", "load_source",
           "run_bounds", "run_grid", "range_pointers", "table_ranges", "HELPERS", "MAX_UNROLLED"]


def mod_functions(mask: Mask, lifted: frozenset = frozenset(), bounds: bool = False
                  ) -> tuple[list[str], list[str], list[str], dict[str, torch.Tensor]]:
    """The helpers and the translated mods as Triton source parts (mask_mod_triton,
    score_mod_triton: only those the mask has; with `bounds`, also mask_mod_bounds), their pointer
    arguments and the captured tensors by name. Raises Untranslatable when a mod has no
    translation."""
    captured = dict(captured_tensors(mask))
    parts, mask_ptrs, score_ptrs = [HELPERS], [], []
    if mask.mask_mod is not None:
        gm = trace_mod(mask.mask_mod, "mask")
        src, mask_ptrs = translate_mod(gm, "mask_mod_triton", ["b", "h", "q_idx", "kv_idx"], captured, lifted)
        parts.append(src)
        if bounds:
            parts.append(translate_bounds(gm, "mask_mod_bounds", captured, lifted, mask_ptrs))
    if mask.score_mod is not None:
        src, score_ptrs = translate_mod(trace_mod(mask.score_mod, "score"), "score_mod_triton",
                                     ["score", "b", "h", "q_idx", "kv_idx"], captured, lifted)
        parts.append(src)
    used = {p[:-4] for p in mask_ptrs + score_ptrs}
    return parts, mask_ptrs, score_ptrs, {k: v for k, v in captured.items() if k in used}


def generate(mask: Mask, lifted: frozenset = frozenset(), bounds: bool = False
             ) -> tuple[str, list[str], list[str], dict[str, torch.Tensor]]:
    """(source, mask pointer args, score pointer args, captured tensors by name). `lifted` names
    captured 0-d tensors (see define.lift_scalars) read as kernel arguments, not written in.
    `bounds`: also mask_mod_bounds (what the mask gives over a block) and bounds_grid_kernel."""
    parts, mask_ptrs, score_ptrs, captured = mod_functions(mask, lifted, bounds)
    def harness(name: str, pointers: list[str]) -> str:
        return fill_template(template_body(HARNESS / f"{name}.py"), {"@@PTRS@@": "".join(f", {p}" for p in pointers)})

    if mask.mask_mod is not None:
        parts.append(harness("mask_grid", mask_ptrs))
    if bounds and mask.mask_mod is not None:
        parts.append(harness("bounds_grid", mask_ptrs + range_pointers(mask_ptrs)))
    if mask.score_mod is not None:
        parts.append(harness("score_grid", score_ptrs))
    return "import triton\nimport triton.language as tl\n\n\n" + "\n\n".join(parts), mask_ptrs, score_ptrs, captured


def unsupported_reason(mask: Mask) -> str | None:
    try:
        generate(mask)
    except Untranslatable as exc:
        return f"the traced mod cannot be written as Triton: {exc}"
    except Exception as exc:
        return f"the mod could not be traced for Triton: {type(exc).__name__}: {str(exc)[:200]}"
    return None


def triton_section(mask: Mask, tensors: dict | None = None) -> dict:
    """The spec's `backends.triton`: source text, function names and pointer arguments (the
    captured tensors, stored in the tensor file as triton.NAME)."""
    source, mask_ptrs, score_ptrs, captured = generate(mask)
    if tensors is not None:
        for name, t in captured.items():
            tensors[f"triton.{name}"] = t.detach().cpu().numpy()
    return {
        "source": source,
        "mask_fn": "mask_mod_triton" if mask.mask_mod is not None else None,
        "score_fn": "score_mod_triton" if mask.score_mod is not None else None,
        "grid_kernel": "mask_grid_kernel" if mask.mask_mod is not None else None,
        "score_grid_kernel": "score_grid_kernel" if mask.score_mod is not None else None,
        "mask_args": ["b", "h", "q_idx", "kv_idx"] + mask_ptrs,
        "score_args": ["score", "b", "h", "q_idx", "kv_idx"] + score_ptrs if mask.score_mod is not None else None,
        "pointers": {p: {"$tensor": f"triton.{p[:-4]}"} for p in dict.fromkeys(mask_ptrs + score_ptrs)},
    }


def load_source(source: str) -> dict:
    """Compile generated source into a namespace (for tests and harnesses; never on spec load)."""
    import hashlib
    import os
    import tempfile
    from pathlib import Path


    # triton.jit reads the function's source from a file, so the text must live in one: one file
    # per distinct source (named by its hash), written once, not one per call
    digest = hashlib.sha1(source.encode()).hexdigest()[:20]
    folder = Path(tempfile.gettempdir()) / f"flexwb_triton_{os.getuid() if hasattr(os, 'getuid') else 0}"
    folder.mkdir(exist_ok=True)
    path = folder / f"k{digest}.py"
    if not path.exists() or path.read_text() != source:
        part = path.with_suffix(f".{os.getpid()}.tmp")
        part.write_text(source)
        os.replace(part, path)  # (atomic: a process reading it never sees half a file)
    return vars(load_module(path, f"flexwb_triton_{digest}"))


def run_bounds(source: str, b: int, h: int, boxes: torch.Tensor, pointers: list, device="cuda") -> torch.Tensor:
    """mask_mod_bounds of each box [n, 4] = (q_lo, q_hi, kv_lo, kv_hi) (int32) as [n, 2] int32
    (all kept, any kept), with the generated bounds_grid_kernel."""
    ns = load_source(source)
    out = torch.empty(len(boxes), 2, dtype=torch.int32, device=device)
    pointers = [p.contiguous() for p in pointers]
    ns["bounds_grid_kernel"][(len(boxes),)](out, boxes.to(device=device, dtype=torch.int32).contiguous(), b, h,
                                            *pointers, *table_ranges(pointers))
    return out


def run_grid(source: str, b: int, h: int, q_len: int, kv_len: int, pointers: list, device="cuda",
             block: int = 32, score: torch.Tensor | None = None) -> torch.Tensor:
    """Evaluate the generated mask (or, given `score` [q_len, kv_len] float32, the generated
    score_mod) over [q_len, kv_len] with the generated grid kernels."""
    ns = load_source(source)
    grid = (cdiv(q_len, block), cdiv(kv_len, block))
    pointers = [p.contiguous() for p in pointers]
    if score is not None:
        out = torch.empty(q_len, kv_len, dtype=torch.float32, device=device)
        ns["score_grid_kernel"][grid](score.contiguous(), out, b, h, q_len, kv_len, *pointers, BLOCK_Q=block,
                                      BLOCK_K=block)
        return out
    out = torch.zeros(q_len, kv_len, dtype=torch.int8, device=device)
    ns["mask_grid_kernel"][grid](out, b, h, q_len, kv_len, *pointers, BLOCK_Q=block, BLOCK_K=block)
    return out.bool()
