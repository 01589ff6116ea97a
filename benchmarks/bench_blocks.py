"""Block-mask building: this workbench's builder vs torch's create_block_mask, side by side.

    python benchmarks/bench_blocks.py [--lengths 8192 32768 131072 1048576] [--json FILE]

For each mask and length: time (cold = first call for that mask_mod in the process, warm =
the next) and peak GPU memory above what was allocated before the call, of
  - ours:            workbench.blocks.build_block_mask (engine picked automatically: eager tiles,
                     or the fused Triton scan where it pays off). "cold" is the first call for a
                     never-seen mask_mod in a running process (Triton compile included), "2nd" the
                     next call (a mod asked for again gets its kernel compiled), "warm" the third
  - torch:           create_block_mask (no compile)
  - torch compiled:  torch.compile(create_block_mask)
and whether our BlockMask equals torch's, tensor for tensor; also our forward-only BlockMask's peak
(no q-side tables). Then statistics alone (no BlockMask kept) at 4,194,304 tokens, and the exact
overview picture's data (512 x 512 cells) at --overview-length tokens. With --knob: turning a knob,
i.e. the scan of a window / chunk / prefix mask at --knob-length tokens for a first value and then
each new value (a new mask_mod every time, as the app makes one per change; the values are kernel
arguments, so only the first value compiles).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch.nn.attention.flex_attention import create_block_mask  # noqa: E402

from workbench import kernels, make  # noqa: E402
from workbench.blocks import build_block_mask, scan_blocks  # noqa: E402
from workbench.look import overview_fractions  # noqa: E402
from workbench.compat import raise_recompile_limit  # noqa: E402

FIELDS = ["kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"]


def masks_at(length, device):
    return {
        "causal": (make("causal", q_len=length, kv_len=length, device=device), None),
        "sliding window 1024": (make("causal_sliding_window", {"window": 1024}, q_len=length, kv_len=length,
                                     device=device), None),
        "document (16 docs)": (make("document", {"doc_lengths": [length // 16] * 16}, q_len=length, kv_len=length,
                                    device=device), None),
        "per-head window (8 heads)": (make("per_head_window", q_len=length, kv_len=length, device=device), 8),
    }


def measure(fn, device):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        out = fn()
        torch.cuda.synchronize()
        err = None
    except torch.OutOfMemoryError as exc:
        out, err = None, "OOM: " + str(exc).split("\n")[0][:80]
    except Exception as exc:  # report, keep going
        out, err = None, f"{type(exc).__name__}: {str(exc)[:80]}"
    seconds = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
    return out, seconds, peak, err


def forget_compiled_kernels():
    """The next scan compiles its Triton kernel as for a never-seen mask_mod."""
    kernels.forget()


def warm_up_process(device):
    """CUDA context, Triton's launcher and torch's first kernels, so that "cold" means a new mask_mod
    in a running session, not a new process."""
    warm = make("causal_sliding_window", {"window": 3}, q_len=4096, kv_len=4096, device=device)
    scan_blocks(warm, 4096, 4096, device=device, engine="triton")
    build_block_mask(warm, 4096, 4096, device=device, engine="eager")


def same(a, b):
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in FIELDS)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072, 1048576])
    ap.add_argument("--stats-length", type=int, default=4194304)
    ap.add_argument("--masks", nargs="+", help="only masks whose name starts with one of these")
    ap.add_argument("--overview-length", type=int, default=1048576)
    ap.add_argument("--json", help="write the rows here too")
    ap.add_argument("--knob", action="store_true", help="only the knob-turning case")
    ap.add_argument("--knob-length", type=int, default=131072)
    ap.add_argument("--profile", action="store_true", help="with --knob: where the slowest values spend their time")
    ap.add_argument("--tune", action="store_true",
                    help="only our warm scan at --lengths under each kernel setting (interior path, warps, tile)")
    ap.add_argument("--setting", type=int, default=0,
                    help="scan kernel setting: an index into SETTINGS (0 = the default)")
    args = ap.parse_args()
    for key, value in SETTINGS[args.setting].items():
        setattr(kernels.scan, key, value)  # (the scan module's globals)
    if args.knob:
        knob_turning(args.knob_length, profile=args.profile)
        return
    if args.tune:
        tune(args.lengths, args.masks)
        return
    device = "cuda"
    raise_recompile_limit()
    compiled_cbm = torch.compile(create_block_mask)
    rows = []
    print(f"# torch {torch.__version__}, {torch.cuda.get_device_name()}, scan setting {SETTINGS[args.setting]}")
    warm_up_process(device)
    header = ("| mask | tokens | ours cold s | ours 2nd s | ours warm s | ours peak GiB | torch s (warm) | torch peak GiB "
              "| torch compiled cold s | torch compiled warm s | compiled peak GiB | warm ratio torch-compiled/ours "
              "| cold ratio torch-compiled/ours | exact | ours engine | ours forward-only peak GiB |")
    print(header)
    print("|" + "---|" * header.count("|")[:-1] if False else "|" + "---|" * (header.count("|") - 1))
    for length in args.lengths:
        for name, (mask, heads) in masks_at(length, device).items():
            if args.masks and not any(name.startswith(m) for m in args.masks):
                continue
            row = dict(mask=name, tokens=length)
            forget_compiled_kernels()
            ours, row["ours_cold_s"], row["ours_peak_gib"], row["ours_err"] = measure(
                lambda: build_block_mask(mask, length, length, heads=heads, device=device, progress=False), device)
            ours = None
            _, row["ours_second_s"], _, _ = measure(
                lambda: build_block_mask(mask, length, length, heads=heads, device=device, progress=False), device)
            _, row["ours_warm_s"], _, _ = measure(
                lambda: build_block_mask(mask, length, length, heads=heads, device=device, progress=False), device)
            scan = scan_blocks(mask, length, length, heads=heads, device=device, progress=False, differences=False)
            row["ours_engine"], row["triton_fallback"] = scan.engine, scan.extra.get("triton_fallback")
            del scan
            _, _, row["ours_forward_only_peak_gib"], _ = measure(
                lambda: build_block_mask(mask, length, length, heads=heads, device=device, progress=False,
                                         compute_q_blocks=False), device)
            if length <= 65536:
                measure(lambda: create_block_mask(mask.mask_mod, None, heads, length, length, device=device), device)
                _, row["torch_s"], row["torch_peak_gib"], row["torch_err"] = measure(
                    lambda: create_block_mask(mask.mask_mod, None, heads, length, length, device=device), device)
            else:
                row["torch_s"], row["torch_peak_gib"], row["torch_err"] = None, None, "skipped (needs > 64 GiB)"
            tc, row["torch_compiled_cold_s"], row["torch_compiled_peak_gib"], row["tc_err"] = measure(
                lambda: compiled_cbm(mask.mask_mod, None, heads, length, length, device), device)
            tc, row["torch_compiled_warm_s"], _, _ = measure(
                lambda: compiled_cbm(mask.mask_mod, None, heads, length, length, device), device)
            if tc is not None:
                ours = build_block_mask(mask, length, length, heads=heads, device=device, progress=False)
                row["exact"] = same(ours, tc)
                del ours
            else:
                row["exact"] = None
            del tc
            if row["ours_warm_s"] and row["torch_compiled_warm_s"]:
                row["warm_ratio"] = row["torch_compiled_warm_s"] / row["ours_warm_s"]
                row["cold_ratio"] = row["torch_compiled_cold_s"] / row["ours_cold_s"]
            rows.append(row)
            f = lambda v, d=3: "–" if v is None else (f"{v:.{d}f}" if isinstance(v, float) else str(v))  # noqa: E731
            print(f"| {name} | {length:,} | {f(row['ours_cold_s'])} | {f(row['ours_second_s'])} | {f(row['ours_warm_s'])} | {f(row['ours_peak_gib'], 2)} "
                  f"| {f(row.get('torch_s'))}{' ' + row['torch_err'] if row.get('torch_err') else ''} "
                  f"| {f(row.get('torch_peak_gib'), 2)} | {f(row['torch_compiled_cold_s'])} | {f(row['torch_compiled_warm_s'])} "
                  f"| {f(row['torch_compiled_peak_gib'], 2)} | {f(row.get('warm_ratio'), 2)} | {f(row.get('cold_ratio'), 2)} "
                  f"| {row['exact']} | {row['ours_engine']} | {f(row['ours_forward_only_peak_gib'], 2)} |", flush=True)
    # Statistics alone at the longest length: no per-block table, no BlockMask.
    n = args.stats_length
    for name, (mask, heads) in list(masks_at(n, device).items())[:2] if n else []:
        scan, secs, peak, err = measure(lambda: scan_blocks(mask, n, n, heads=heads, device=device, keep_counts=False,
                                                            progress=False), device)
        exact = None
        if scan is not None and name == "causal":
            exact = scan.kept_pairs == n * (n + 1) // 2
        if scan is not None and name.startswith("sliding"):
            exact = scan.kept_pairs == sum(min(i + 1, 1024) for i in range(n))
        row = dict(mask=name, tokens=n, stats_only_s=secs, stats_only_peak_gib=peak, err=err,
                   compile_s=getattr(scan, "compile_seconds", None), kept_pairs_exact=exact)
        rows.append(row)
        print(f"stats only: {name} at {n:,} tokens: {secs:.2f} s (compile {row['compile_s']:.2f} s), "
              f"peak {peak:.2f} GiB, kept pairs exact: {exact} {err or ''}", flush=True)
    # The overview picture's data: exact kept fractions of 512 x 512 cells.
    n = args.overview_length
    for name, (mask, heads) in list(masks_at(n, device).items())[:3] if n else []:
        forget_compiled_kernels()
        _, cold, peak, err = measure(lambda: overview_fractions(mask, n, n, pixels=512, device=device), device)
        frac, warm, _, _ = measure(lambda: overview_fractions(mask, n, n, pixels=512, device=device), device)
        row = dict(mask=name, tokens=n, overview_cold_s=cold, overview_warm_s=warm, overview_peak_gib=peak, err=err)
        rows.append(row)
        print(f"overview: {name} at {n:,} tokens, 512 x 512 cells: cold {cold:.2f} s, warm {warm:.2f} s, "
              f"peak {peak:.2f} GiB {err or ''}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


KNOBS = {"causal_sliding_window": ("window", [256, 512, 1000, 2048, 4096]),
         "chunked_local": ("chunk", [256, 512, 1000, 2048, 4096]),
         "prefix_lm": ("prefix_len", [256, 512, 1000, 2048, 4096])}


def triton_binaries() -> int:
    """Compiled binaries of every scan kernel in this process (a value that recompiles shows here;
    the source count alone would not: one source can compile for several argument specialisations)."""
    total = 0
    for namespace in kernels._namespaces.values():
        caches = getattr(namespace["block_scan_kernel"], "device_caches", {})
        total += sum(len(entry[0]) for entry in caches.values())
    return total


def knob_turning(n: int, device: str = "cuda", profile: bool = False) -> None:
    """Scan time of each new parameter value (first value: compile included). Timed as the app
    scans: no emptying of the allocator's cache between values."""
    print(f"# knob turning at {n:,} tokens, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("| mask | parameter | first value s | each new value s (median) | slowest new value s | kernels compiled "
          "| every value s (Triton binaries after it) |")
    print("|---|---|---|---|---|---|---|")
    profiles = {}
    for name, (param, values) in KNOBS.items():
        forget_compiled_kernels()
        times, binaries = [], []
        for value in values:
            mask = make(name, {param: value}, q_len=n, kv_len=n, device=device)
            torch.cuda.synchronize()
            profiler = cProfile.Profile() if profile else None
            t0 = time.perf_counter()
            if profiler:
                profiler.enable()
            scan_blocks(mask, n, n, device=device, progress=False, engine="triton")
            torch.cuda.synchronize()
            if profiler:
                profiler.disable()
            times.append(time.perf_counter() - t0)
            binaries.append(triton_binaries())
            profiles[(name, value)] = (times[-1], profiler)
        later = sorted(times[1:])
        each = ", ".join(f"{t:.3f} ({k})" for t, k in zip(times, binaries))
        print(f"| {name} | {param} | {times[0]:.3f} | {later[len(later) // 2]:.3f} | {later[-1]:.3f} | "
              f"{len(kernels._namespaces)} | {each} |", flush=True)
    if profile:  # where the slowest and the median new value spend their time
        later = sorted((t, key) for key, (t, _) in profiles.items() if key[1] != KNOBS[key[0]][1][0])
        for t, key in (later[-1], later[-2], later[len(later) // 2]):
            print(f"\n## profile of {key[0]} = {key[1]}: {t:.3f} s")
            stream = io.StringIO()
            pstats.Stats(profiles[key][1], stream=stream).sort_stats("cumulative").print_stats("workbench|synchronize|item|tolist", 25)
            print(stream.getvalue()[-4000:])


SETTINGS = [dict(SCAN_INTERIOR=True, SCAN_WARPS=4, TILE_ELEMENTS=2048, SCAN_ROWS_AT_END=False,
                 SCAN_BOUNDS=True),  # the default
            dict(SCAN_INTERIOR=True, SCAN_WARPS=4, TILE_ELEMENTS=2048, SCAN_ROWS_AT_END=True, SCAN_BOUNDS=True),
            dict(SCAN_INTERIOR=True, SCAN_WARPS=4, TILE_ELEMENTS=2048, SCAN_ROWS_AT_END=False,
                 SCAN_BOUNDS=False),  # every pair evaluated
            dict(SCAN_INTERIOR=False, SCAN_WARPS=8, TILE_ELEMENTS=4096, SCAN_ROWS_AT_END=False,
                 SCAN_BOUNDS=False)]  # the first kernel
assert SETTINGS[0] == {key: getattr(kernels.scan, key) for key in SETTINGS[0]}


def tune(lengths, only, device: str = "cuda") -> None:
    """Our warm BlockMask build (median of 3) under each kernel setting, one table per length."""
    print(f"# scan kernel settings, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("| mask | tokens | " + " | ".join(f"interior {s['SCAN_INTERIOR']}, warps {s['SCAN_WARPS']}, "
                                           f"tile {s['TILE_ELEMENTS']}, rows at end {s['SCAN_ROWS_AT_END']}, "
                                           f"bounds {s['SCAN_BOUNDS']}" for s in SETTINGS) + " |")
    print("|---|---|" + "---|" * len(SETTINGS))
    warm_up_process(device)
    for length in lengths:
        for name, (mask, heads) in masks_at(length, device).items():
            if only and not any(name.startswith(m) for m in only):
                continue
            cells = []
            for setting in SETTINGS:
                for key, value in setting.items():
                    setattr(kernels.scan, key, value)  # (the scan module's globals)
                build = lambda: build_block_mask(mask, length, length, heads=heads, device=device,  # noqa: E731
                                                 progress=False, engine="triton")
                measure(build, device)  # compiles
                times = sorted(measure(build, device)[1] for _ in range(3))
                cells.append(f"{times[1]:.3f}")
            print(f"| {name} | {length:,} | " + " | ".join(cells) + " |", flush=True)
    for key, value in SETTINGS[0].items():
        setattr(kernels.scan, key, value)  # (the scan module's globals)


if __name__ == "__main__":
    main()
