"""The port's forward beside Flex Triton and Flex FLASH, each path timed four ways, with the GPU's SM
clock and power while it runs, in one process on one GPU.
    python benchmarks/bench_clocks.py [--lengths 32768] [--masks causal "sliding window 1024" ...]
        [--rounds 2] [--seconds 1.5] [--heads 16] [--head-dim 128] [--dtype bfloat16]
        [--port-variants default persistent+ls1 persistent@3 ...] [--untimed-flex-triton]
For each mask and length (B 1): the port's file as generated (the Hopper kernel on an H100 / H200),
or each form of its Hopper loop --port-variants names (as bench_port.py's --loops: "default" is the
file as generated), compiled Flex (Triton backend; --untimed-flex-triton keeps it only as the
outputs' reference) and Flex's FLASH backend (FlashAttention-4, where it is installed and can run
the mask). Every output is compared with Flex Triton's first. Each round times each path in
turn four ways (ms per call):
  - do_bench: triton.testing.do_bench's median, an L2 flush before each call;
  - back to back: 20 calls between two CUDA events, no flush;
  - graph: the call captured in a CUDA graph, the replay's do_bench median (no host in it);
  - sustained: calls back to back for --seconds, the state a training run lives in, while
    nvidia-smi samples the SM clock, power, temperature and its clock-event reasons every 20 ms.
The last columns are the sustained run's mean clock, power, peak temperature, the reasons seen
(0x4: software power cap) and its cycles per call (ms x MHz, thousands). Where every path runs at
the power cap, a faster kernel is one that does the work in fewer joules, and the clock each path
is given and the cycles it takes say whether it lost time to the clock or to its own stalls.
Needs a CUDA GPU and nvidia-smi.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_paged import graph_ms  # noqa: E402
from bench_port import check_variants, hopper_variant, masks_at  # noqa: E402
from workbench import port  # noqa: E402
from workbench.blocks import build_block_mask  # noqa: E402
from workbench.run import Shape, compiled_flex_attention, make_inputs  # noqa: E402

MASKS = ["causal", "sliding window 1024", "document (8 docs)", "prefix-LM 2048", "per-head window",
         "dilated window 256x4", "2-D neighbourhood k13", "image spans + softcap", "causal + ALiBi",
         "T5 bias (log bucket)"]
_QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


def _positive(kind):
    def read(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} is not a positive {kind.__name__}")
        return value
    return read


def _sampled(fn, seconds: float) -> tuple[float, dict]:
    """ms per call of `fn` run back to back for `seconds`, and the GPU's state meanwhile (nvidia-smi
    every 20 ms; the first samples, taken while the calls start, are dropped)."""
    fn()
    torch.cuda.synchronize()
    samples: list[str] = []
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={_QUERY}", "--format=csv,noheader,nounits", "-lms", "20"],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    reader = threading.Thread(target=lambda: samples.extend(line.strip() for line in smi.stdout), daemon=True)
    reader.start()
    time.sleep(0.3)
    first = len(samples)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls, t0 = 0, time.perf_counter()
    start.record()
    while time.perf_counter() - t0 < seconds:
        for _ in range(5):
            fn()
        calls += 5
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    last = len(samples)
    smi.terminate()
    smi.wait()
    rows = [s.split(", ") for s in samples[first + 3:last]]
    rows = [r for r in rows if len(r) == 4]
    if not rows:
        return start.elapsed_time(end) / calls, {}
    state = {"MHz": sum(float(r[0]) for r in rows) / len(rows), "W": sum(float(r[1]) for r in rows) / len(rows),
             "C": max(float(r[2]) for r in rows), "reasons": sorted({r[3] for r in rows}), "samples": len(rows)}
    return start.elapsed_time(end) / calls, state


def _back_to_back(fn, calls: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def _graph(fn) -> float | None:
    """bench_paged's graph_ms (the call captured in a CUDA graph, its replay's do_bench median: no
    host in it); None where the path cannot be captured."""
    try:
        return graph_ms(fn)
    except Exception:  # (a path whose host work syncs or allocates by content cannot be captured)
        torch.cuda.synchronize()
        return None


def _in_variant(module, variant: str, q, k, v):
    with hopper_variant(module, variant):
        return module.attention(q, k, v)


def _median(xs):
    xs = sorted(x for x in xs if x is not None)
    return xs[len(xs) // 2] if xs else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", nargs="+", type=_positive(int), default=[32768])
    p.add_argument("--masks", nargs="+", choices=MASKS, default=["causal", "sliding window 1024"])
    p.add_argument("--rounds", type=_positive(int), default=2)
    p.add_argument("--seconds", type=_positive(float), default=1.5, help="the sustained run's length per path")
    p.add_argument("--heads", type=_positive(int), default=16)
    p.add_argument("--head-dim", type=int, choices=[64, 128], default=128)
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--port-variants", nargs="+", default=["default"],
                   help="forms of the port's Hopper loop to time side by side, as bench_port.py's --loops names "
                   "them (e.g. persistent+ls1, persistent@3, persistent+pv1); default: the file as generated")
    p.add_argument("--untimed-flex-triton", action="store_true",
                   help="run Flex Triton once, as the outputs' reference, and leave it out of the timings")
    args = p.parse_args(argv)
    why = check_variants(args.port_variants, "--port-variants")
    if why:
        p.error(why)
    if not torch.cuda.is_available() or shutil.which("nvidia-smi") is None:
        p.error("needs a CUDA GPU and nvidia-smi on the PATH (it reads the clock while each path runs): run it on "
                "the GPU machine")
    from triton.testing import do_bench

    flex = compiled_flex_attention()
    folder = Path(tempfile.mkdtemp(prefix="bench_clocks_"))
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, B=1 H={args.heads} "
          f"D={args.head_dim}, forward; medians of {args.rounds} rounds, each path timed in turn", flush=True)
    print("| mask | tokens | path | do_bench ms | back to back ms | graph ms | sustained ms | MHz | W | peak C | "
          "reasons | kcycles a call | max abs diff vs Flex Triton |")
    print("|---" * 13 + "|")
    for seq in args.lengths:
        masks = masks_at(seq, args.heads, "cuda")
        for name in args.masks:
            mask = masks[name]
            shape = Shape(batch=1, q_heads=args.heads, q_len=seq, head_dim=args.head_dim)
            inputs = make_inputs(shape, args.dtype, "cuda", seed=0)
            q, k, v = inputs.q, inputs.k, inputs.v
            module = port.load(port.build(mask, seq, seq, heads=args.heads, out_dir=folder / f"{seq}_{len(name)}_{name[:6]}"))
            block_mask = build_block_mask(mask, seq, seq, heads=args.heads, device="cuda", shrink=True, progress=False)
            paths = {}
            for variant in args.port_variants:
                label = "port" if args.port_variants == ["default"] else f"port {variant}"
                paths[label] = lambda variant=variant: _in_variant(module, variant, q, k, v)
            paths["Flex Triton"] = lambda: flex(q, k, v, score_mod=mask.score_mod, block_mask=block_mask)
            try:
                with torch.no_grad():
                    flex(q, k, v, score_mod=mask.score_mod, block_mask=block_mask, kernel_options={"BACKEND": "FLASH"})
                paths["Flex FLASH"] = lambda: flex(q, k, v, score_mod=mask.score_mod, block_mask=block_mask,
                                                   kernel_options={"BACKEND": "FLASH"})
            except Exception:  # not installed, or it cannot run this mask
                pass
            with torch.no_grad():
                want = paths["Flex Triton"]().float()
                diffs = {n: float((fn().float() - want).abs().max()) for n, fn in paths.items()}
                if args.untimed_flex_triton:
                    del paths["Flex Triton"]
                got = {n: {"do_bench": [], "b2b": [], "graph": [], "sustained": [], "state": []} for n in paths}
                for _ in range(args.rounds):
                    for n, fn in paths.items():
                        got[n]["do_bench"].append(do_bench(fn, warmup=10, rep=100))
                        got[n]["b2b"].append(_back_to_back(fn))
                        got[n]["graph"].append(_graph(fn))
                        ms, state = _sampled(fn, args.seconds)
                        got[n]["sustained"].append(ms)
                        got[n]["state"].append(state)
            for n in paths:
                g = got[n]
                sustained = _median(g["sustained"])
                state = g["state"][g["sustained"].index(sustained)]
                graph = _median(g["graph"])
                mhz = state.get("MHz")
                cells = [f"{_median(g['do_bench']):.3f}", f"{_median(g['b2b']):.3f}",
                         "cannot capture" if graph is None else f"{graph:.3f}", f"{sustained:.3f}",
                         f"{mhz:.0f}" if mhz else "-", f"{state['W']:.0f}" if state else "-",
                         f"{state['C']:.0f}" if state else "-", " ".join(state.get("reasons", [])) or "-",
                         f"{sustained * mhz:.0f}" if mhz else "-", f"{diffs[n]:.1e}"]
                print(f"| {name} | {seq:,} | {n} | " + " | ".join(cells) + " |", flush=True)
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
