"""The port's backward kernels under each tile choice, on one process's GPU: the dq kernel's tiles
(the dk / dv kernel at the file's own) and the dk / dv kernel's (the dq kernel at the file's own),
one mask and length at a time, backward alone (the forward's out and lse computed once). Every
variant's dq, dk, dv are compared with the file's own tiles' before it is timed, so a tile that
computes something else is a row that says so.

    python benchmarks/bench_backward_tiles.py                 # causal at 8K and 32K
    python benchmarks/bench_backward_tiles.py --window        # and a sliding window of 1,024
    python benchmarks/bench_backward_tiles.py --lengths 8192
    python benchmarks/bench_backward_tiles.py --pairs         # dq and dk / dv tiles that run in one launch
    python benchmarks/bench_backward_tiles.py --hopper-buffers --head-dim 64   # the Hopper backward's ring
    python benchmarks/bench_backward_tiles.py --pairs --masks "per-head window" --lengths 8192   # bench_port's masks

--hopper-buffers sweeps the Hopper backward's ring of query / dO tiles (HOPPER_BWD_FUSED_BUFFERS, 3
to 6; the file lowers it to what fits in shared memory, and the row says how many ran) on an H100
/ H200.
"""

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_port import kept_pairs, masks_at  # noqa: E402

from workbench import make, port  # noqa: E402

DQ_TILES = [(128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 2), (64, 32, 4, 3), (64, 64, 4, 1)]
DKDV_TILES = [(32, 128, 8, 2), (32, 128, 8, 3), (32, 64, 4, 3), (64, 128, 8, 2), (64, 64, 4, 2), (64, 64, 4, 1)]
# --pairs: (dq tile, dk / dv tile) pairs with one warp count and depth, which run in one launch
PAIRS = [((128, 64, 8, 2), (64, 128, 8, 2)), ((128, 64, 8, 3), (64, 128, 8, 3)), ((128, 64, 8, 1), (64, 128, 8, 1)),
         ((128, 128, 8, 2), (64, 128, 8, 2)), ((64, 64, 4, 3), (64, 64, 4, 3)), ((128, 64, 8, 2), (128, 128, 8, 2))]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--window", action="store_true", help="also a sliding window of 1,024")
    ap.add_argument("--pairs", action="store_true", help="only the one-launch pairs of PAIRS (both kernels' tiles)")
    ap.add_argument("--hopper-buffers", action="store_true", help="only the Hopper backward's ring buffers, 3 to 6")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--masks", nargs="+", metavar="NAME", help="bench_port.py's masks by name (instead of causal)")
    a = ap.parse_args(argv)
    if a.masks:  # (names checked before anything touches the GPU)
        known = list(masks_at(256, a.heads, "cpu"))
        for name in a.masks:
            if name not in known:
                ap.error(f"--masks {name!r}: not one of bench_port.py's masks ({', '.join(map(repr, known))})")
    d = a.head_dim
    masks = {"causal": make("causal")} if not a.masks else {name: None for name in a.masks}
    if a.window:
        masks["sliding window 1024"] = make("causal_sliding_window", {"window": 1024})
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; bf16, B 1, H {a.heads}, D {d}; backward "
          "alone (dq, dk, dv from out and lse), do_bench medians\n")
    print("| mask | tokens | kernel swept | tile (M, N, warps, stages) | backward ms | TFLOP/s (2.5x forward) | "
          "max abs diff vs file's tiles |\n|---|---|---|---|---|---|---|")
    for name, mask in masks.items():
        for L in a.lengths:
            if a.masks:  # (built at each length: their tables are sized to it)
                mask = masks_at(L, a.heads, "cuda")[name]
            module = port.load(port.build(mask, L if a.masks else 256, L if a.masks else 256, heads=a.heads,
                                          out_dir=tempfile.mkdtemp()))
            own = (list(module.BWD_DQ_TILES), list(module.BWD_DKDV_TILES))
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, dout = (torch.randn(1, a.heads, L, d, device="cuda", dtype=torch.bfloat16, generator=g)
                             for _ in range(4))
            with torch.no_grad():
                out, lse = module.attention(q, k, v, return_lse=True)
            if a.masks:
                kept = kept_pairs(mask, L, L, a.heads, "cuda")
            else:
                kept = ((L * (L + 1) // 2) if name == "causal" else sum(min(i + 1, 1024) for i in range(L))) * a.heads
            flops = 2.5 * 4 * kept * d
            scale = d ** -0.5

            def backward():
                return module._attention_backward(q, k, v, out, lse, dout, None, scale)[:3]

            module.BWD_DQ_TILES, module.BWD_DKDV_TILES = own
            buffers = module.HOPPER_BWD_FUSED_BUFFERS
            want = backward()
            if a.hopper_buffers:
                rows = [("Hopper ring buffers", n) for n in (3, 4, 5, 6)]
            else:
                rows = ([("pair", t) for t in PAIRS] + [("two launches", PAIRS[0]), ("Gluon backward", "-")] if a.pairs else
                        [("dq", t) for t in DQ_TILES] + [("dk / dv", t) for t in DKDV_TILES])
            for which, tile in rows:
                module.BWD_DQ_TILES, module.BWD_DKDV_TILES = [list(x) for x in own]
                module.BWD_FUSED = which != "two launches"
                module.HOPPER_BWD_FUSED_BUFFERS = buffers
                min_blocks = module.HOPPER_BWD_MIN_BLOCKS
                if which == "Gluon backward":  # (the Hopper backward, at any count of kept blocks)
                    module.HOPPER_BWD_MIN_BLOCKS = 0
                elif which == "Hopper ring buffers":
                    module.HOPPER_BWD_FUSED_BUFFERS = tile
                    plan = module._hopper_bwd_plan(q, k, v, dout, lse, lse, scale, module._tables(q.device, L, L),
                                                   fused=module._hopper_bwd_form(d, False))
                    tile = f"{tile} asked, {plan[3][0][3].get('NUM_BUF')} ran"  # (what fits in shared memory)
                elif which in ("pair", "two launches"):
                    module.BWD_DQ_TILES[0], module.BWD_DKDV_TILES[0] = tile
                else:
                    (module.BWD_DQ_TILES if which == "dq" else module.BWD_DKDV_TILES)[0] = tile
                try:
                    got = backward()
                    diff = max(float((x.float() - y.float()).abs().max()) for x, y in zip(got, want))
                    ms = do_bench(backward, warmup=10, rep=100)
                except Exception as exc:  # a tile that does not fit is a row, not a stop
                    print(f"| {name} | {L:,} | {which} | {tile} | failed: {type(exc).__name__}: {str(exc)[:100]} |",
                          flush=True)
                    continue
                finally:
                    module.HOPPER_BWD_MIN_BLOCKS = min_blocks
                wrong = "" if diff < 6e-2 else " **differs**"
                print(f"| {name} | {L:,} | {which} | {tile} | {ms:.3f} | {flops / ms / 1e9:.0f} | {diff:.1e}{wrong} |",
                      flush=True)
            module.BWD_DQ_TILES, module.BWD_DKDV_TILES = own
            module.HOPPER_BWD_FUSED_BUFFERS = buffers
            q = k = v = dout = out = lse = want = None
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
