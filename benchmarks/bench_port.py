"""The generated Triton port vs compiled FlexAttention (and cuDNN SDPA where it can run the mask),
forward, side by side in one process on one GPU.

    python benchmarks/bench_port.py [--lengths 8192 32768] [--heads 16] [--head-dim 128] [--batch 1]
        [--masks NAME ...] [--decode] [--json FILE]

For each mask and length: the port is generated (`workbench.port`), its block lists built and
its autotuning done; FlexAttention is compiled with this workbench's block mask (equal to
create_block_mask's). Every output is checked against the other before timing ("agrees": max abs
difference within bf16 tolerance). Times are triton.testing.do_bench medians (ms); TFLOP/s count
the kept pairs only (4 * B * H * D flops per pair). `speed` = Flex time / port time (> 1: the port
is faster). --decode adds Lq = 1 against each length. --segments times the port on document masks
(8, 32 and 64 documents, uneven lengths) with its default tiling and with cu_seqlens (tiles from each
document's start: packing-invariant), and checks that both give the same attention.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench import make, port, with_score  # noqa: E402
from workbench.blocks import build_block_mask, scan_blocks  # noqa: E402
from workbench.run import Shape, compiled_flex_attention, make_inputs  # noqa: E402


def masks_at(seq: int, heads: int, device) -> dict:
    windows = [64 << (h % 6) for h in range(heads)]  # 64 .. 2048, per head
    return {
        "causal": make("causal", q_len=seq, kv_len=seq, device=device),
        "sliding window 1024": make("causal_sliding_window", {"window": 1024}, q_len=seq, kv_len=seq, device=device),
        "document (8 docs)": make("document", {"doc_lengths": [seq // 8] * 8}, q_len=seq, kv_len=seq, device=device),
        "prefix-LM 2048": make("prefix_lm", {"prefix_len": 2048}, q_len=seq, kv_len=seq, device=device),
        "per-head window": make("per_head_window", {"windows": windows}, q_len=seq, kv_len=seq, device=device),
        "dilated window 256x4": make("dilated_window", {"window": 256, "dilation": 4}, q_len=seq, kv_len=seq,
                                     device=device),
        "2-D neighbourhood k13": make("neighborhood_2d", {"kernel": 13}, q_len=seq, kv_len=seq, device=device),
        "image spans + softcap": with_score(make("image_spans", q_len=seq, kv_len=seq, device=device),
                                            make("softcap", {"cap": 50.0})),
    }


def timed(fn):
    from triton.testing import do_bench

    with torch.no_grad():
        return do_bench(fn, warmup=25, rep=100)


def one(name, mask, shape: Shape, folder: Path, with_sdpa: bool) -> dict:
    device = "cuda"
    inputs = make_inputs(shape, "bfloat16", device, seed=0)
    q, k, v = inputs.q, inputs.k, inputs.v
    row = {"mask": name, "q_len": shape.q_len, "kv_len": shape.kv_len}
    t0 = time.perf_counter()
    path = port.build(mask, shape.q_len, shape.kv_len, heads=shape.q_heads, batch=shape.batch, out_dir=folder)
    module = port.load(path)
    out_port = module.attention(q, k, v)
    torch.cuda.synchronize()
    row["port_first_call_s"] = time.perf_counter() - t0  # generate, block lists, autotune
    scan = scan_blocks(mask, shape.q_len, shape.kv_len, heads=shape.q_heads, device=device, progress=False)
    kept = scan.kept_pairs * (1 if scan.depends_on_head else shape.q_heads)
    flops = 4 * kept * shape.head_dim * shape.batch
    block_mask = build_block_mask(mask, shape.q_len, shape.kv_len, heads=shape.q_heads, device=device, shrink=True)
    flex = compiled_flex_attention()
    out_flex = flex(q, k, v, score_mod=mask.score_mod, block_mask=block_mask)
    row["agrees"] = bool((out_port.float() - out_flex.float()).abs().max() < 3e-2)
    row["port_ms"] = timed(lambda: module.attention(q, k, v))
    row["flex_ms"] = timed(lambda: flex(q, k, v, score_mod=mask.score_mod, block_mask=block_mask))
    row["speed"] = row["flex_ms"] / row["port_ms"]
    row["port_tflops"] = flops / row["port_ms"] / 1e9
    row["flex_tflops"] = flops / row["flex_ms"] / 1e9
    if with_sdpa:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            row["cudnn_ms"] = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--masks", nargs="*")
    p.add_argument("--decode", action="store_true", help="also Lq = 1 against each length")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--segments", action="store_true", help="only the cu_seqlens cost on document masks")
    args = p.parse_args(argv)
    if args.segments:
        return segments_cost(args)
    rows = []
    folder = Path(tempfile.mkdtemp(prefix="bench_port_"))
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, B={args.batch} H={args.heads} "
          f"D={args.head_dim}, forward", flush=True)
    print("| mask | tokens | port ms | Flex ms | speed (Flex/port) | port TFLOP/s | Flex TFLOP/s | cuDNN causal ms | agrees |")
    print("|---|---|---|---|---|---|---|---|---|")
    for seq in args.lengths:
        for name, mask in masks_at(seq, args.heads, "cuda").items():
            if args.masks and name not in args.masks:
                continue
            shape = Shape(batch=args.batch, q_heads=args.heads, q_len=seq, head_dim=args.head_dim)
            try:
                row = one(name, mask, shape, folder / f"{len(rows)}", with_sdpa=name == "causal")
            except Exception as exc:  # keep going: a failed row is a result
                row = {"mask": name, "q_len": seq, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            rows.append(row)
            if "error" in row:
                print(f"| {name} | {seq:,} | error: {row['error']} |", flush=True)
                continue
            cudnn = f"{row['cudnn_ms']:.3f}" if "cudnn_ms" in row else "-"
            print(f"| {name} | {seq:,} | {row['port_ms']:.3f} | {row['flex_ms']:.3f} | {row['speed']:.2f}x | "
                  f"{row['port_tflops']:.0f} | {row['flex_tflops']:.0f} | {cudnn} | {row['agrees']} |", flush=True)
    if args.decode:
        print("\n| decode (Lq = 1) | kv tokens | port ms | Flex ms | speed |\n|---|---|---|---|---|")
        for seq in args.lengths:
            mask = make("causal", q_len=1, kv_len=seq, device="cuda")
            shape = Shape(batch=args.batch, q_heads=args.heads, q_len=1, kv_len=seq, head_dim=args.head_dim)
            try:
                row = one("causal decode", mask, shape, folder / f"d{seq}", with_sdpa=False)
                rows.append(row)
                print(f"| causal | {seq:,} | {row['port_ms']:.4f} | {row['flex_ms']:.4f} | {row['speed']:.2f}x |",
                      flush=True)
            except Exception as exc:
                print(f"| causal | {seq:,} | error: {type(exc).__name__}: {str(exc)[:200]} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                               "rows": rows}, indent=1))
    ratios = [r["speed"] for r in rows if "speed" in r and r["q_len"] > 1]
    if ratios:
        print(f"\nspeed vs Flex: min {min(ratios):.2f}x, geomean {math.exp(sum(map(math.log, ratios)) / len(ratios)):.2f}x,"
              f" faster on {sum(r > 1 for r in ratios)}/{len(ratios)}")
    return 0


def segments_cost(args) -> int:
    """The price of packing invariance: default tiling vs cu_seqlens on document masks. Each call
    timed twice over: do_bench (what a Python caller sees, host work included) and replayed from a
    CUDA graph (the kernels alone, as a serving engine that captures graphs runs them); the two
    tilings alternate, twice, and each takes its faster run."""
    from triton.testing import do_bench_cudagraph

    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, H={args.heads} D={args.head_dim}")
    print("| documents | tokens | default ms | cu_seqlens ms | cost | default ms (graph) | cu_seqlens ms (graph) "
          "| cost (graph) | max abs diff | tiles chosen: default / cu_seqlens |\n|---|---|---|---|---|---|---|---|---|---|")
    folder = Path(tempfile.mkdtemp(prefix="bench_port_segments_"))
    for seq in args.lengths:
        for docs in (8, 32, 64):
            cuts = sorted({round(seq * (i / docs) ** 1.3) for i in range(1, docs)})  # uneven lengths
            bounds = [0] + [c for c in cuts if 0 < c < seq] + [seq]
            lengths = [b - a for a, b in zip(bounds, bounds[1:])]
            mask = make("document", {"doc_lengths": lengths}, q_len=seq, kv_len=seq, device="cuda")
            shape = Shape(batch=1, q_heads=args.heads, q_len=seq, head_dim=args.head_dim)
            inputs = make_inputs(shape, "bfloat16", "cuda", seed=0)
            path = port.build(mask, seq, seq, heads=args.heads, out_dir=folder / f"{seq}_{docs}")
            module = port.load(path)
            cu = bounds  # on the host, as an engine that packs requests has them: no device sync per call
            plain = module.attention(inputs.q, inputs.k, inputs.v)
            plain_config = _chosen(module)
            packed = module.attention(inputs.q, inputs.k, inputs.v, cu_seqlens=cu)
            packed_config = _chosen(module, packed=True)
            diff = float((plain.float() - packed.float()).abs().max())
            calls = {"plain": lambda: module.attention(inputs.q, inputs.k, inputs.v),
                     "packed": lambda: module.attention(inputs.q, inputs.k, inputs.v, cu_seqlens=cu)}
            times = {name: ([], []) for name in calls}
            for _ in range(2):
                for name, call in calls.items():
                    times[name][0].append(timed(call))
                    with torch.no_grad():
                        times[name][1].append(do_bench_cudagraph(call, rep=100))
            (plain_ms, plain_graph), (packed_ms, packed_graph) = (
                [min(t) for t in times[name]] for name in calls)
            print(f"| {len(lengths)} | {seq:,} | {plain_ms:.3f} | {packed_ms:.3f} | {packed_ms / plain_ms - 1:+.1%} | "
                  f"{plain_graph:.3f} | {packed_graph:.3f} | {packed_graph / plain_graph - 1:+.1%} | "
                  f"{diff:.2e} | {plain_config} / {packed_config} |", flush=True)
    return 0


def _chosen(module, packed: bool = False) -> str:
    """The tiles of the last launch: BLOCK_M x BLOCK_N, warps, stages. Plain launches autotune
    (a tiling that picks other tiles is not comparable kernel for kernel); packed ones take the
    file's fixed configuration."""
    if packed:
        fixed = list(getattr(module, "_segment_config_for", {}).values())
        return "{}x{} w{} s{}".format(*fixed[-1]) if fixed else "?"
    config = getattr(module._attention_kernel, "best_config", None)
    if config is None:
        return "?"
    return f"{config.kwargs.get('BLOCK_M')}x{config.kwargs.get('BLOCK_N')} w{config.num_warps} s{config.num_stages}"


if __name__ == "__main__":
    sys.exit(main())
