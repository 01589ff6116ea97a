"""How fast the notebook app redraws after a change (no browser: the same calls the widgets make).

    python benchmarks/bench_app.py [--length 32768] [--device cuda] [--masks NAME ...]

For every library mask (or those named): the first draw in a warmed-up process (block scan, block
map, focus; a new mod's fused scan kernel compiles on a background thread meanwhile), then five
parameter changes (the mask's first integer parameter, halved and back; a mask without one
changes its block size) and five length changes. Each redraw is timed by the app itself
(`last_redraw_seconds`, split into its steps in `timings`); the table gives medians and the
slowest, and the scan engine of the last redraw.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import io
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench import kernels  # noqa: E402
from workbench.app import Workbench  # noqa: E402
from workbench.define import factory_params, library  # noqa: E402

STEPS = ("build", "scan", "focus", "draw")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--masks", nargs="+", help="only these library masks")
    args = ap.parse_args()
    n = args.length
    print(f"# torch {torch.__version__}, device {args.device}"
          f"{' (' + torch.cuda.get_device_name() + ')' if args.device.startswith('cuda') else ''}, Lq = Lk = {n}")
    print("| mask | first draw s | parameter change s (median / slowest) | length change s (median / slowest) "
          "| median redraw: " + " / ".join(STEPS) + " s | engine |")
    print("|---|---|---|---|---|---|")
    kernels.forget()
    with contextlib.redirect_stdout(io.StringIO()):  # the process's own warm-up, not a mask's
        Workbench("causal_sliding_window", {"window": 3}, q_len=n, device=args.device)
    worst = 0.0
    for name in args.masks or list(library()):
        with contextlib.redirect_stdout(io.StringIO()):  # outside a notebook, widget output goes to stdout
            app, first, param_times, length_times, steps = measure(name, n, args.device)
        assert app.mask is not None, app.message.value
        worst = max(worst, *param_times, *length_times)
        split = " / ".join(f"{statistics.median(s[k] for s in steps):.3f}" for k in STEPS)
        print(f"| {app.mask.name} | {first:.2f} | {statistics.median(param_times):.3f} / {max(param_times):.3f} | "
              f"{statistics.median(length_times):.3f} / {max(length_times):.3f} | {split} | {app.scan.engine} |",
              flush=True)
        # why the fused scan was not used, if it was not: a refused translation or a failed compile
        failed = [f.exception() for f in kernels.background_compiles() if f.done() and f.exception()]
        if app.scan.extra.get("triton_fallback") or failed:
            print(f"  note {app.mask.name}: fallback {app.scan.extra.get('triton_fallback')!r}; "
                  f"background compile errors {[repr(e)[:300] for e in failed]}", flush=True)
    print(f"slowest redraw after the first draw: {worst:.3f} s")


def knob(name):
    """(parameter, two values) to turn, or None for a mask without an integer parameter."""
    for param, default in factory_params(library()[name]).items():
        if isinstance(default, int) and not isinstance(default, bool) and default >= 2:
            return param, [default // 2, default]
    return None


def measure(name, n, device):
    """First draw, then 5 parameter changes and 5 length changes, each timed by the app."""
    app = Workbench(name, q_len=n, device=device)
    first = app.last_redraw_seconds
    turn = knob(name)
    param_times, length_times, steps = [], [], []
    for k in range(5):
        if turn:
            app.param_widgets[turn[0]].value = turn[1][k % 2]
        else:  # no simple parameter to move: change the block size
            app.block.value = [64, 128][k % 2]
        param_times.append(app.last_redraw_seconds)
        steps.append(app.timings)
        app.q_len.value = n - 100 * (k + 1) if k % 2 == 0 else n
        length_times.append(app.last_redraw_seconds)
        steps.append(app.timings)
    app.wait()
    concurrent.futures.wait(kernels.compiling())
    return app, first, param_times, length_times, steps


if __name__ == "__main__":
    main()
