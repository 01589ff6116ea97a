"""Verification at length: `verify(...)` wall time, reference time, pairs computed, peak memory.

    python benchmarks/bench_verify.py [--lengths 262144 1048576] [--masks causal window]
                                      [--workers N] [--reference-dtype float64|float32]

B = 1, 4 heads, D = 128, bf16, compiled FlexAttention against the float64 reference (the shapes
of the verification-at-length table). With --workers N the reference is split by query rows
across N Ray workers (one GPU each) and the same cases run on one GPU first, so the speed-up
comes from one run; Ray is started once and its actors (one per GPU) serve every verification,
drawing each one's inputs from its seed while the kernel under test compiles and runs.
Peak = torch.cuda.max_memory_allocated of this process (the workers report their own). A warm-up
verify of a small causal mask runs first (with --workers also on the workers): the rows time
verification, not the session's first imports and process starts (each mask's own compile is
still timed)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench import make  # noqa: E402
from workbench.compat import raise_recompile_limit  # noqa: E402
from workbench.run import Shape  # noqa: E402
from workbench.verify import verify  # noqa: E402
from workbench.verify import ReferenceOptions  # noqa: E402

MASKS = {"causal": ("causal", {}), "window": ("causal_sliding_window", {"window": 1024})}


def one(name, length, workers, reference_dtype):
    target, params = MASKS[name]
    mask = make(target, params, q_len=length, kv_len=length, device="cuda")
    shape = Shape(batch=1, q_heads=4, kv_heads=4, q_len=length, kv_len=length, head_dim=128)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    verdict = verify(mask, shape, dtype="bfloat16", device="cuda", seed=0, progress=False,  reference=ReferenceOptions(dtype=reference_dtype, workers=workers))
    wall = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2 ** 30
    return dict(mask=mask.name, tokens=length, workers=workers or 1, wall_s=wall, reference_s=verdict.reference_seconds,
                fraction=verdict.reference_fraction, peak_gib=peak, passed=verdict.passed, rel_err=max(c.rel_err for c in verdict.checks),
                compile_s=verdict.compile_seconds or 0.0, run_s=verdict.run_seconds or 0.0,
                mask_evaluation=verdict.reference_mask_evaluation, busy=verdict.reference_workers)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[262144, 1048576])
    ap.add_argument("--masks", nargs="+", default=list(MASKS), choices=list(MASKS))
    ap.add_argument("--workers", type=int, help="also split the reference across this many Ray workers")
    ap.add_argument("--reference-dtype", default="float64", choices=["float64", "float32"])
    args = ap.parse_args()
    raise_recompile_limit()
    reference_dtype = getattr(torch, args.reference_dtype)
    # a session's first verify imports torch.compile's modules and sets up CUDA libraries: do that
    # once on a small causal mask, so the rows time the verification (the masks' own compiles stay)
    small = make("causal", q_len=4096, kv_len=4096, device="cuda")
    verify(small, Shape(q_heads=1, q_len=4096, head_dim=128), dtype="bfloat16", device="cuda", progress=False)
    if args.workers:  # Ray stays up across verifications, as in a session, and so do its actors
        import ray

        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
        verify(small, Shape(q_heads=1, q_len=4096, head_dim=128), dtype="bfloat16", device="cuda", progress=False, reference=ReferenceOptions(workers=args.workers))
    print(f"# torch {torch.__version__}, {torch.cuda.device_count()} x {torch.cuda.get_device_name()}, "
          f"reference {args.reference_dtype}")
    print("| mask | tokens | workers | verify wall s | reference s | kernel compile s | kernel run s | pairs computed "
          "| peak GiB | verdict | rel err | reference's mask |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    busy, speed = [], []
    for length in args.lengths:
        for name in args.masks:
            alone = None
            for workers in [None] + ([args.workers] if args.workers else []):
                r = one(name, length, workers, reference_dtype)
                if workers is None:
                    alone = r
                else:  # (the kernel under test compiles in the first run only: also compared without it)
                    speed.append(f"{r['mask']} at {length:,}: {args.workers} workers {alone['wall_s'] / r['wall_s']:.2f}x "
                                 f"faster than 1 GPU; {(alone['wall_s'] - alone['compile_s']) / (r['wall_s'] - r['compile_s']):.2f}x "
                                 "without the kernel's compile")
                print(f"| {r['mask']} | {length:,} | {r['workers']} | {r['wall_s']:.1f} | {r['reference_s']:.1f} | "
                      f"{r['compile_s']:.1f} | {r['run_s']:.2f} | {r['fraction']:.4f} | {r['peak_gib']:.1f} | {'PASS' if r['passed'] else 'FAIL'} | "
                      f"{r['rel_err']:.2e} | {r['mask_evaluation']} |", flush=True)
                busy.extend(f"{r['mask']} worker {i}: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else
                                                                     f"{k} {v}" for k, v in w.items())
                            for i, w in enumerate(r["busy"]))
    for line in speed + busy:  # speed-ups, and where each worker's time went (after the table)
        print(line)


if __name__ == "__main__":
    main()
