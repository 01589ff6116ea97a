"""A new mask's first call on the port at 32K tokens (bf16, B 1, H 16, D 128), on the GPU: for
each mask, the time to build its port (`port.build`: trace, generate, write), to load it, its first
`attention` call (block lists, the kernel's compile) and its second call. Run it twice with the same
kernel cache to see what a later process pays once the compiled kernels are on disk:

    TRITON_CACHE_DIR=/tmp/tc python benchmarks/bench_first_call.py   # empty cache: compiles
    TRITON_CACHE_DIR=/tmp/tc python benchmarks/bench_first_call.py   # the cache the first filled

Prints `FIRST <mask>: ...` per mask, with whether the calls ran the Hopper kernel. The first call
is split in two: the block lists (`block_lists`, built on the GPU by a scan kernel that is compiled
for each mask) and the rest (the attention kernel's compile and launch). `--profile MASK` also
prints the functions the first call of that mask spent its time in (cProfile, cumulative).

    python benchmarks/bench_first_call.py --profile "per-head window"
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
    print(f"FIRST {name}: build {t1 - t0:.2f} s, load {t2 - t1:.2f} s, first call {t3 - t2:.2f} s (block lists "
          f"{t_lists - t2:.2f}, the rest {t3 - t_lists:.2f}), second "
          f"{1000 * (t4 - t3):.1f} ms; total {t3 - t0:.2f} s ({kernel}, {'NaN!' if out.isnan().any() else 'finite'})",
          flush=True)
    if profile:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(25)
        print(text.getvalue(), flush=True)
