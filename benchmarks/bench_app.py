"""How fast the notebook app redraws after a change (no browser: the same calls the widgets make).

    python benchmarks/bench_app.py [--length 32768] [--device cuda]

For a few masks: the first draw (block scan, block map, stats, token zoom; compiles what it
needs) and then redraws after changing a parameter and the lengths, median of 5.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench.app import Workbench  # noqa: E402

CHANGES = {  # mask -> (parameter, values to cycle through)
    "causal_sliding_window": ("window", [512, 1024, 2048]),
    "document": ("doc_lengths", None),
    "image_spans": (None, None),
    "per_head_window": (None, None),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    n = args.length
    print(f"# torch {torch.__version__}, device {args.device}"
          f"{' (' + torch.cuda.get_device_name() + ')' if args.device.startswith('cuda') else ''}, Lq = Lk = {n}")
    print("| mask | first draw s | redraw after a parameter change s (median of 5) | redraw after a length change s |")
    print("|---|---|---|---|")
    for name, (param, values) in CHANGES.items():
        with contextlib.redirect_stdout(io.StringIO()):  # outside a notebook, widget output goes to stdout
            app, first, param_times, length_times = measure(name, param, values, n, args.device)
        assert app.mask is not None, app.message.value
        print(f"| {app.mask.name} | {first:.2f} | {statistics.median(param_times):.3f} | "
              f"{statistics.median(length_times):.3f} |")


def measure(name, param, values, n, device):
    """First draw, then 5 parameter changes and 5 length changes, each timed by the app."""
    app = Workbench(name, q_len=n, device=device)
    first = app.last_redraw_seconds
    param_times, length_times = [], []
    for k in range(5):
        if param == "window":
            app.param_widgets["window"].value = values[k % len(values)]
        elif param == "doc_lengths":
            cut = n // (k + 2)
            app.param_widgets["doc_lengths"].value = f"[{cut}, {n - cut}]"
        else:  # no simple parameter to move: change the block size
            app.block.value = [64, 128][k % 2]
        param_times.append(app.last_redraw_seconds)
        app.q_len.value = n - 100 * (k + 1) if k % 2 == 0 else n
        length_times.append(app.last_redraw_seconds)
    return app, first, param_times, length_times

if __name__ == "__main__":
    main()
