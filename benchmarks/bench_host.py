"""Where a training step's host time goes: the port's forward + backward (bf16, B 1, H 16, D 128,
`out.backward(grad_out)`) on masks whose short steps are bound by the host, on the GPU.

    python benchmarks/bench_host.py [--masks window docs perhead causal] [--seq 8192] [--head-dim 128]
    python benchmarks/bench_host.py --tree /path/to/another/checkout --label before
    python benchmarks/bench_host.py --lean on off   # the file's lean launch against Triton's own, in turn
    python benchmarks/bench_host.py --masks causal prefix --timeline 3   # the GPU's idle gaps in a step

For each mask: the step's do_bench median, its host time (steps issued back to back, timed until
the last one was issued: three runs of 40, each printed, the smallest first), the GPU kernels'
sum per step (torch.profiler) and each kernel's; then the same steps with the generated file's
functions wrapped in timers: microseconds per step spent inside each (inclusive, so nested ones
count twice; the wrappers add about a microsecond a call), and a bare autograd.Function step over
the same tensors (no kernels: autograd's own share, which any custom attention pays). --tree runs
another checkout's workbench (e.g. an older commit's) in this process's place, so two trees can be
timed in turn on one machine: the host's speed varies between machines by up to 2x. --gc-freeze
moves the objects alive after warm-up out of Python's collector's reach first. --cprofile N prints,
per step, the functions with the most time of their own over N steps under cProfile. --timeline N
profiles N steps and prints the last one's kernels in the order the GPU ran them, each with the idle
time before it (a step longer than its kernels' sum is idle somewhere), and the calls of the CUDA
runtime in those steps that wait for the GPU (synchronizations, copies to the host)."""

from __future__ import annotations

import argparse
import ast
import collections
import functools
import sys
import tempfile
import time
from pathlib import Path

TIMED = ["attention", "_check", "_call_tables", "_attention", "_tables", "_hopper_ready", "_hopper_launch",
         "_hopper_descriptor", "block_lists", "_launch", "_attention_backward", "_hopper_bwd_ready",
         "_hopper_bwd_plan", "_hopper_bwd_launch", "_dq_unflat", "column_lists", "_arg_kind"]


def host_ms(step, calls: int = 40) -> float:
    """Host milliseconds per step: `calls` steps issued back to back, timed until the last is issued
    (bench_port.py's _host_ms; this file imports nothing of the workbench's before --tree is on
    the path, and bench_port puts its own tree first)."""
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    return 1e3 * (issued - start) / calls


def kernels(step, steps: int = 10) -> tuple[float, dict]:
    """(GPU kernels' ms per step, {kernel: µs per step}) from torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    found = [e for e in prof.key_averages() if e.device_time_total > 0]
    return (sum(e.device_time_total for e in found) / steps / 1e3,
            {e.key[:40]: round(e.device_time_total / steps, 1) for e in found})


def split(module, step, calls: int = 60) -> tuple[float, dict]:
    """(wrapped host ms per step, {function: (µs per step, calls per step)}) of the file's functions."""
    spent, count, real = collections.Counter(), collections.Counter(), {}
    for name in TIMED:
        fn = getattr(module, name, None)
        if fn is None:
            continue
        real[name] = fn

        def timed(*args, fn=fn, name=name, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start
                count[name] += 1
        setattr(module, name, functools.wraps(fn)(timed))
    try:
        wrapped = host_ms(step, calls)
    finally:
        for name, fn in real.items():
            setattr(module, name, fn)
    return wrapped, {n: (1e6 * spent[n] / calls, count[n] // calls) for n in TIMED if count[n]}


WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaFree",
         "cudaMalloc", "cuMemAlloc", "cuMemFree")


def timeline(kernels: list[tuple[str, float, float]], steps: int) -> tuple[list[tuple[str, float, float]], float, float]:
    """The last of `steps` steps' kernels, from (name, start µs, end µs) of every kernel the steps ran
    (each step runs the same kernels): ([(name, µs idle before it, its µs)], the step's span from its
    first kernel's start to its last one's end, its kernels' sum). The first kernel's idle time is
    from the step before's last kernel."""
    if not kernels or len(kernels) % steps:
        raise ValueError(f"{len(kernels)} kernels over {steps} steps: the steps did not run the same kernels")
    ordered = sorted(kernels, key=lambda k: k[1])
    per = len(ordered) // steps
    last = ordered[-per:]
    before = ordered[-per - 1][2] if steps > 1 else last[0][1]
    rows = []
    for name, start, end in last:
        rows.append((name, max(0.0, start - before), end - start))
        before = max(before, end)
    return rows, last[-1][2] - last[0][1], sum(r[2] for r in rows)


def _setting(text: str) -> tuple:
    """One --set value: NAME=VALUE, VALUE a Python literal (a number, a string in quotes, a tuple...)."""
    name, eq, value = text.partition("=")
    if not eq or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE (e.g. HOPPER_BWD_PER_HEAD_MIN_PAIRS=0)")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        raise argparse.ArgumentTypeError(f"{text!r}: {value!r} is not a Python literal (a number, a quoted string, "
                                         "True / False / None, a tuple)") from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--masks", nargs="*", default=["window", "docs", "perhead"],
                   choices=["window", "docs", "perhead", "causal", "prefix"])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]),
                   help="the checkout whose workbench runs (default: this one)")
    p.add_argument("--label", default="this tree")
    p.add_argument("--gc-freeze", action="store_true",
                   help="gc.freeze() after each mask's warm-up: whether Python's collector passes over the "
                        "process's objects are part of the host time")
    p.add_argument("--set", nargs="+", default=[], metavar="NAME=VALUE", type=_setting,
                   help="set these attributes of each generated file before its steps (a Python literal each), "
                        "e.g. HOPPER_BWD_PER_HEAD_MIN_PAIRS=0")
    p.add_argument("--lean", nargs="+", choices=["on", "off"], default=None,
                   help="host time per step with the generated file's lean launch on and off (LEAN_LAUNCH), "
                        "in turn, in this process")
    p.add_argument("--cprofile", type=int, default=0, metavar="STEPS",
                   help="also run STEPS steps under cProfile and print the functions with the most time of their "
                        "own (torch's, autograd's and Triton's included), per step")
    p.add_argument("--timeline", type=int, default=0, metavar="STEPS",
                   help="also profile STEPS steps (at least 2) and print the last one's kernels in order with the "
                        "GPU's idle time before each, and the runtime calls in them that wait for the GPU")
    args = p.parse_args(argv)
    if args.timeline == 1 or args.timeline < 0:
        p.error(f"--timeline {args.timeline}: give at least 2 steps (the first kernel's idle time is from the step "
                "before), or leave it out")
    sys.path.insert(0, str(Path(args.tree).resolve()))
    import torch
    from triton.testing import do_bench

    from workbench import make, port
    from workbench.run import Shape, make_inputs

    seq, heads, d = args.seq, 16, args.head_dim
    masks = {"window": make("causal_sliding_window", {"window": 1024}, q_len=seq, kv_len=seq, device="cuda"),
             "docs": make("document", {"doc_lengths": [seq // 8] * 8}, q_len=seq, kv_len=seq, device="cuda"),
             "perhead": make("per_head_window", {"windows": [64 << (h % 6) for h in range(heads)]}, q_len=seq,
                             kv_len=seq, device="cuda"),
             "causal": make("causal", q_len=seq, kv_len=seq, device="cuda"),
             "prefix": make("prefix_lm", {"prefix_len": 2048}, q_len=seq, kv_len=seq, device="cuda")}
    inputs = make_inputs(Shape(batch=1, q_heads=heads, q_len=seq, head_dim=d), "bfloat16", "cuda", seed=0,
                         backward=True)
    q, k, v = (t.detach().requires_grad_() for t in (inputs.q, inputs.k, inputs.v))
    grad_out = inputs.grad_out
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, workbench from {args.tree} "
          f"({args.label}); bf16, B 1, H {heads}, D {d}, {seq} tokens", flush=True)

    class Bare(torch.autograd.Function):  # autograd's own share of a step: outputs allocated, no kernels
        @staticmethod
        def forward(ctx, q, k, v):
            ctx.save_for_backward(q, k, v)
            return torch.empty_like(q), torch.empty(q.shape[:3], device=q.device)

        @staticmethod
        def backward(ctx, dout, dlse):
            q, k, v = ctx.saved_tensors
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def bare():
        q.grad = k.grad = v.grad = None
        Bare.apply(q, k, v)[0].backward(grad_out)

    for name in args.masks:
        module = port.load(port.build(masks[name], seq, seq, heads=heads, batch=1, out_dir=Path(tempfile.mkdtemp())))
        for attr, value in args.set:
            if not hasattr(module, attr):
                raise SystemExit(f"--set {attr}=...: the generated file has no {attr}")
            setattr(module, attr, value)

        def step(module=module):
            q.grad = k.grad = v.grad = None
            module.attention(q, k, v).backward(grad_out)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        if args.gc_freeze:
            import gc

            gc.freeze()
        ms = do_bench(step, warmup=5, rep=40)
        hosts = sorted(host_ms(step) for _ in range(3))
        gpu, each = kernels(step)
        wrapped, inside = split(module, step)
        print(f"{name}: step {ms:.3f} ms; host {hosts[0]:.3f} ms ({', '.join(f'{h:.3f}' for h in hosts[1:])}); "
              f"GPU kernels {gpu:.3f} ms {each}", flush=True)
        print(f"  wrapped host {wrapped:.3f} ms; µs per step inside: "
              + ", ".join(f"{n} {us:.0f} (x{n_calls})" for n, (us, n_calls) in inside.items()), flush=True)
        print(f"  bare autograd.Function step: host {min(host_ms(bare) for _ in range(3)):.3f} ms", flush=True)
        if args.lean and hasattr(module, "LEAN_LAUNCH"):
            default, runs = module.LEAN_LAUNCH, {}
            for _ in range(3):  # (in turn, three times: the host's speed drifts)
                for setting in args.lean:
                    module.LEAN_LAUNCH = setting == "on"
                    step()
                    runs.setdefault(setting, []).append(min(host_ms(step) for _ in range(3)))
            module.LEAN_LAUNCH = default
            print("  lean launch: host ms per step " + "; ".join(
                f"{s} {min(r):.3f} ({', '.join(f'{x:.3f}' for x in r)})" for s, r in runs.items()), flush=True)
        if args.cprofile:
            import cProfile
            import pstats

            torch.cuda.synchronize()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.cprofile):
                step()
            prof.disable()
            torch.cuda.synchronize()
            stats = pstats.Stats(prof)
            rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:30]  # (cc, nc, tottime, cumtime, callers)
            print(f"  cProfile, {args.cprofile} steps: µs per step of own time (calls per step), cumulative µs")
            for (file, line, fn), (_, calls, own, cum, _) in rows:
                print(f"    {1e6 * own / args.cprofile:8.1f} ({calls / args.cprofile:5.1f})  {1e6 * cum / args.cprofile:8.1f}  "
                      f"{Path(file).name}:{line} {fn}", flush=True)
        if args.timeline:
            print_timeline(step, args.timeline)
    return 0


def print_timeline(step, steps: int) -> None:
    """--timeline: the last of `steps` profiled steps, kernel by kernel, and the waits among the runtime's calls."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    found, waits = [], collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start:
            found.append((e.name, e.time_range.start, e.time_range.end))  # (kernels, memsets and copies)
        elif e.name.startswith(WAITS):
            waits[e.name] += 1
    waits["cudaDeviceSynchronize"] -= 1  # (the closing torch.cuda.synchronize())
    try:
        rows, span, busy = timeline(found, steps)
    except ValueError as exc:
        print(f"  timeline: {exc}", flush=True)
        return
    print(f"  timeline of one step: {span:.1f} µs from its first kernel's start to its last one's end, kernels "
          f"{busy:.1f} µs, idle {span - busy + rows[0][1]:.1f} µs (the first kernel's wait included)", flush=True)
    for name, idle, us in rows:
        print(f"    idle {idle:7.1f}  run {us:8.1f}  {name[:90]}", flush=True)
    told = ", ".join(f"{n} x{c / steps:g}" for n, c in waits.items() if c > 0)
    print(f"  runtime calls that wait, per step: {told or 'none (the closing synchronize aside)'}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
