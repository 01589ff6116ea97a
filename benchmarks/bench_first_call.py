"""A new mask's first call on the port at 32K tokens (bf16, B 1, H 16, D 128), on the GPU: for
each mask, the time to build its port (`port.build`: trace, generate, write), to load it, its first
`attention` call (block lists, the kernel's compile) and its second call. Run it twice with the same
kernel cache to see what a later process pays once the compiled kernels are on disk:

    TRITON_CACHE_DIR=/tmp/tc python benchmarks/bench_first_call.py   # empty cache: compiles
    TRITON_CACHE_DIR=/tmp/tc python benchmarks/bench_first_call.py   # the cache the first filled

Prints `FIRST <mask>: ...` per mask, with whether the calls ran the Hopper kernel. The first call
builds the block lists (a scan kernel compiled for each mask) while a second thread compiles the
Hopper kernel (the file's HOPPER_EARLY_COMPILE; PORT_HOPPER_EARLY_COMPILE=0 turns it off, for the
plain order). `--split` builds the block lists before the call instead, so the two are timed apart
(the block lists, then the rest: the attention kernel's compile and launch). `--profile MASK` also
prints the functions the first call of that mask spent its time in (cProfile, cumulative).

    python benchmarks/bench_first_call.py --split --profile "per-head window"
"""

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

t00 = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from bench_port import masks_at  # noqa: E402

from workbench import port  # noqa: E402
from workbench.run import Shape, make_inputs  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
MASKS = ["causal", "sliding window 1024", "document (8 docs)", "per-head window"]
ap.add_argument("--profile", default=None, choices=MASKS, metavar="MASK",
                help=f"cProfile this mask's first call (one of: {', '.join(MASKS)})")
ap.add_argument("--split", action="store_true", help="build the block lists before the first call and time them apart "
                "(no compile beside them)")
args = ap.parse_args()
torch.zeros(1, device="cuda")
torch.cuda.synchronize()
print(f"# torch + CUDA context {time.perf_counter() - t00:.2f} s", flush=True)
seq, heads = 32768, 16
allm = masks_at(seq, heads, "cuda")
folder = Path(tempfile.mkdtemp())
inputs = make_inputs(Shape(batch=1, q_heads=heads, q_len=seq, head_dim=128), "bfloat16", "cuda", seed=0)
for name in MASKS:
    t0 = time.perf_counter()
    path = port.build(allm[name], seq, seq, heads=heads, batch=1, out_dir=folder / name.replace(" ", "_"))
    t1 = time.perf_counter()
    module = port.load(path)
    ran = []
    real = module._attention_hopper
    module._attention_hopper = lambda *a, real=real, **kw: ran.append(1) or real(*a, **kw)
    t2 = time.perf_counter()
    profile = cProfile.Profile() if name == args.profile else None
    with torch.no_grad():
        if profile:
            profile.enable()
        if args.split:
            module.block_lists(1, heads, seq, seq, inputs.q.device)  # (kept: the call below finds them)
            torch.cuda.synchronize()
        t_lists = time.perf_counter()
        out = module.attention(inputs.q, inputs.k, inputs.v)
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        if profile:
            profile.disable()
        out = module.attention(inputs.q, inputs.k, inputs.v)
        torch.cuda.synchronize()
        t4 = time.perf_counter()
    kernel = f"hopper x{len(ran)}" if ran else "portable"
    split = f" (block lists {t_lists - t2:.2f}, the rest {t3 - t_lists:.2f})" if args.split else (
        f" (Hopper compile beside the block lists: {'on' if module.HOPPER_EARLY_COMPILE else 'off'})")
    print(f"FIRST {name}: build {t1 - t0:.2f} s, load {t2 - t1:.2f} s, first call {t3 - t2:.2f} s{split}, second "
          f"{1000 * (t4 - t3):.1f} ms; total {t3 - t0:.2f} s ({kernel}, {'NaN!' if out.isnan().any() else 'finite'})",
          flush=True)
    if profile:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(25)
        print(text.getvalue(), flush=True)
