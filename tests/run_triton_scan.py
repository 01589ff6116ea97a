"""The fused Triton block scan against the eager tiles on the whole library, in this process.

Run with TRITON_INTERPRET=1 on a CPU (tests/test_blocks.py does) or plainly on a GPU:
    python tests/run_triton_scan.py DEVICE
Prints one line per mismatch and "ALL EQUAL" at the end when there is none.
"""

import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench import Mask, library, make  # noqa: E402
from workbench.blocks import scan_blocks  # noqa: E402
from workbench.define import index_reads  # noqa: E402

# (q_len, kv_len, heads, batch, block): odd lengths, Lq != Lk, small / uneven / tall blocks
CASES = [(200, 333, 4, 2, (32, 64)), (260, 300, None, None, (160, 48)), (300, 330, 2, None, (128, 128)),
         (320, 330, None, 2, (256, 64))]
# each kernel switch (kernels.scan.SCAN_INTERIOR, SCAN_ROWS_AT_END, SCAN_BOUNDS) turned the other way:
# every case on a GPU, the one with two interior rows and columns of 128-blocks under the CPU
# interpreter, where it is slow. (The last case: interior blocks in row slices of 64.)
INTERIOR_CASES = {"cuda": CASES, "cpu": CASES[2:3]}


def same(a, b) -> bool:
    if (a is None) != (b is None):
        return False
    return a is None or torch.equal(a, b)


def compare(mask, q_len, kv_len, heads, batch, block, device) -> str | None:
    eager = scan_blocks(mask, q_len, kv_len, heads=heads, batch=batch, block_size=block, device=device,
                        engine="eager")
    fused = scan_blocks(mask, q_len, kv_len, heads=heads, batch=batch, block_size=block, device=device,
                        engine="triton")
    if fused.engine != "triton":
        return f"engine {fused.engine}"
    checks = dict(counts=same(eager.counts, fused.counts), rows=same(eager.row_kept, fused.row_kept),
                  classes=(eager.full_blocks, eager.empty_blocks) == (fused.full_blocks, fused.empty_blocks),
                  heads=same(eager.head_pairs_differing, fused.head_pairs_differing),
                  batch=same(eager.batch_pairs_differing, fused.batch_pairs_differing))
    bad = [k for k, ok in checks.items() if not ok]
    return ", ".join(bad) or None


def shifted_per_batch(b, h, q_idx, kv_idx):  # depends on batch and head
    return (q_idx - kv_idx >= b * 7) & ((q_idx + h) % 3 != 0)


def run_cases(masks, cases, device, label="") -> int:
    """Compare every mask on every case; print one line per mismatch (or refusal), return how many."""
    failures = 0
    for base in masks:
        for q_len, kv_len, heads, batch, block in cases:
            mask = make(base.factory, base.params, q_len=q_len, kv_len=kv_len, device=device) if base.factory else base
            if mask.heads is not None:
                heads = min(heads or mask.heads, mask.heads)
            if batch is None and "b" in index_reads(mask.mask_mod):
                batch = 2
            if heads is None and "h" in index_reads(mask.mask_mod):
                heads = 2
            try:
                problem = compare(mask, q_len, kv_len, heads, batch, block, device)
            except Exception as exc:  # e.g. the scan's spot check refusing the kernel's counts
                problem = f"{type(exc).__name__}: {str(exc)[:300]}"
                if not failures:  # the first one in full: on a GPU later ones may only echo it
                    traceback.print_exc()
            if problem:
                failures += 1
                print(f"MISMATCH{label} {mask.name} {q_len}x{kv_len} heads={heads} batch={batch} block={block}: "
                      f"{problem}", flush=True)
    return failures


# a researcher turning a knob: each new value reuses the first value's translation and kernel
KNOBS = {"chunked_local": ("chunk", [37, 64, 100]), "causal_sliding_window": ("window", [37, 64, 100]),
         "prefix_lm": ("prefix_len", [37, 64, 100]), "sliding_window": ("left", [5, 40, 77])}


def turn_knobs(device: str) -> int:
    """Every value of each knob against the eager tiles, and one kernel source per knob."""
    from workbench import kernels

    failures = 0
    q_len, kv_len, heads, batch, block = CASES[0]
    knobs = dict(KNOBS)
    if device == "cpu":  # and users' knobs over CPU-global tables: lens[b], spans with .any()
        from user_mods import lengths_window, spans_or_window

        knobs.update({factory: ("window", [5, 40, 77]) for factory in (lengths_window, spans_or_window)})
    for name, (param, values) in knobs.items():
        sources = set()
        for value in values:
            mask = make(name, {param: value}, q_len=q_len, kv_len=kv_len, device=device) if isinstance(name, str) \
                else Mask(f"{name.__name__}_{value}", mask_mod=name(value))
            try:
                problem = compare(mask, q_len, kv_len, None, 2 if not isinstance(name, str) else None, block, device)
            except Exception as exc:  # the scan's spot check refusing the kernel's counts
                problem = f"{type(exc).__name__}: {str(exc)[:300]}"
            sources.add(kernels.scan_kernel(mask.mask_mod, torch.device(device), q_len, kv_len).source)
            if problem:
                failures += 1
                print(f"MISMATCH (knob) {mask.name} {param}={value}: {problem}", flush=True)
        if len(sources) != 1:
            failures += 1
            print(f"MISMATCH (knob) {mask.name}: {len(sources)} kernel sources for {len(values)} values", flush=True)
    return failures


def main(device: str) -> int:
    from workbench.kernels import scan as kernels  # the switches are the scan module's globals

    masks = [make(f, q_len=q, kv_len=k, device=device) for name, f in library().items()
             for q, k, *_ in CASES[:1]]
    masks = [m for m in masks if m.mask_mod is not None] + [Mask("shifted_per_batch", mask_mod=shifted_per_batch)]
    if device == "cpu":
        # and mods written the way users write them (tests/test_bounds.py: their tables are CPU
        # globals): and_masks / or_masks over a factory's closure and a per-head table, image spans
        # with segment ids, per-sample lengths
        from user_mods import combined, image_spans, per_sample_lengths

        masks += [Mask("and_or_masks", mask_mod=combined()), Mask("image_spans", mask_mod=image_spans),
                  Mask("per_sample_lengths", mask_mod=per_sample_lengths)]
    failures = run_cases(masks, CASES, device)
    failures += turn_knobs(device)
    # the other setting of each kernel switch too (the interior fast path, row sums at the end,
    # blocks decided by the mask's bounds)
    for switch in ("SCAN_INTERIOR", "SCAN_ROWS_AT_END", "SCAN_BOUNDS"):
        default = getattr(kernels, switch)
        setattr(kernels, switch, not default)
        try:
            failures += run_cases(masks, INTERIOR_CASES["cuda" if device.startswith("cuda") else "cpu"], device,
                                  f" ({switch}={not default})")
        finally:
            setattr(kernels, switch, default)
    print("ALL EQUAL" if not failures else f"{failures} MISMATCHES")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
