"""Attention speed: compiled FlexAttention vs every SDPA backend that can express the same mask.

    python benchmarks/bench_attention.py [--seq 32768] [--batch 1] [--heads 16] [--head-dim 128]
        [--masks causal ...] [--backward] [--json FILE]

For each mask, in one process on one GPU, median times from triton.testing.do_bench of
  - flex:       torch.compile(flex_attention) with this workbench's block mask
  - cudnn, flash, efficient: SDPA with is_causal=True where the mask is causal, else with a
                dense boolean attn_mask where the backend takes one (flash takes none)
  - math:       SDPA's math backend with the dense mask (the floor), when it fits in memory
TFLOP/s are counted twice: on the kept pairs (the useful work, 4*B*H*D per pair forward,
2.5x that backward) and on the pairs each kernel visits (flex: whole blocks it visits; dense
masks: every pair; is_causal: the lower triangle). Every backend's output is checked against
flex's before it is timed ("agrees"), so a row only counts if it computes the same attention.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench import make  # noqa: E402
from workbench.analyze import mask_stats  # noqa: E402
from workbench.blocks import block_mask_from_scan, dense_mask, scan_blocks  # noqa: E402
from workbench.run import compiled_flex_attention  # noqa: E402

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def masks_at(seq, device):
    return {
        "causal": make("causal", q_len=seq, kv_len=seq, device=device),
        "sliding window 1024": make("causal_sliding_window", {"window": 1024}, q_len=seq, kv_len=seq, device=device),
        "document (8 docs)": make("document", {"doc_lengths": [seq // 8] * 8}, q_len=seq, kv_len=seq, device=device),
        "prefix-LM 2048": make("prefix_lm", {"prefix_len": 2048}, q_len=seq, kv_len=seq, device=device),
    }


def bench(fn, backward, grad_out, inputs):
    from triton.testing import do_bench

    if not backward:
        with torch.no_grad():
            return do_bench(fn, warmup=25, rep=200)

    def step():
        out = fn()
        torch.autograd.grad(out, inputs, grad_out)
    return do_bench(step, warmup=25, rep=200)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--masks", nargs="+", help="only masks whose name starts with one of these")
    ap.add_argument("--backward", action="store_true", help="time forward + backward")
    ap.add_argument("--math-limit-gib", type=float, default=40, help="skip math SDPA above this estimate")
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args()
    device = "cuda"
    B, H, S, D = args.batch, args.heads, args.seq, args.head_dim
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(3))
    if args.backward:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    grad_out = torch.randn(B, H, S, D, device=device, dtype=torch.bfloat16, generator=gen)
    flex = compiled_flex_attention()
    mult = 3.5 if args.backward else 1.0  # forward + backward = 3.5x the forward FLOPs
    rows = []
    print(f"# torch {torch.__version__}, {torch.cuda.get_device_name()}, B={B} H={H} S={S} D={D} bf16, "
          f"{'forward+backward' if args.backward else 'forward'}")
    for name, mask in masks_at(S, device).items():
        if args.masks and not any(name.startswith(m) for m in args.masks):
            continue
        scan = scan_blocks(mask, S, S, device=device)
        stats = mask_stats(scan, head_dim=D)
        block_mask = block_mask_from_scan(scan, mask.mask_mod)
        kept = stats.kept_pairs * B * H
        visited_flex = (stats.full_blocks + stats.partial_blocks) * scan.q_block * scan.kv_block * B * H
        causal = name == "causal"

        def run_flex():
            return flex(q, k, v, block_mask=block_mask)
        ref = run_flex().detach()
        results = {"flex": (bench(run_flex, args.backward, grad_out, (q, k, v)), visited_flex, True, "")}
        dense = None if causal else dense_mask(mask, (0, S), (0, S), device=device)
        for backend, kind in BACKENDS.items():
            if backend == "flash" and not causal:
                results[backend] = (None, 0, False, "takes no attn_mask")
                continue
            if backend == "math":
                need = B * H * S * S * 4 * 3 * (3 if args.backward else 1)
                if need > args.math_limit_gib * 2**30:
                    results[backend] = (None, 0, False, f"needs ~{need / 2**30:.0f} GiB")
                    continue

            def run_sdpa(kind=kind):
                with sdpa_kernel([kind]):
                    if causal and kind != SDPBackend.MATH:
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
                    m = dense if dense is not None else dense_mask(mask, (0, S), (0, S), device=device)
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=m)
            try:
                got = run_sdpa().detach()
                agrees = bool(((got.float() - ref.float()).abs().max() < 3e-2).item())
                visited = (S * (S + 1) // 2 if causal and kind != SDPBackend.MATH else S * S) * B * H
                results[backend] = (bench(run_sdpa, args.backward, grad_out, (q, k, v)), visited, agrees, "")
            except Exception as exc:  # a backend that refuses this input: say why
                results[backend] = (None, 0, False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:60]}")
            torch.cuda.empty_cache()
        flex_ms = results["flex"][0]
        for backend, (ms, visited, agrees, why) in results.items():
            row = dict(mask=name, backend=backend, ms=ms, agrees=agrees, note=why,
                       tflops_kept=None if ms is None else 4 * D * kept * mult / ms / 1e9,
                       tflops_visited=None if ms is None else 4 * D * visited * mult / ms / 1e9,
                       flex_time_ratio=None if ms is None else flex_ms / ms, density=stats.density)
            rows.append(row)
        torch.cuda.empty_cache()
    print("| mask | backend | ms | TFLOP/s (kept) | TFLOP/s (visited) | flex time / backend time | agrees | note |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["ms"] is None:
            print(f"| {r['mask']} | {r['backend']} | – | – | – | – | – | {r['note']} |")
        else:
            print(f"| {r['mask']} | {r['backend']} | {r['ms']:.3f} | {r['tflops_kept']:.0f} | {r['tflops_visited']:.0f} "
                  f"| {r['flex_time_ratio']:.2f} | {'yes' if r['agrees'] else 'NO'} | {r['note']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
