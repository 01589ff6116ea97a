"""The generated Triton port vs compiled FlexAttention (Triton and FLASH backends), the FA4 export,
FA4 called directly and cuDNN SDPA where each can run the mask, forward, side by side in one
process on one GPU.

    python benchmarks/bench_port.py [--lengths 8192 32768] [--heads 16] [--head-dim 128] [--batch 1]
        [--masks NAME ...] [--decode] [--json FILE]
    python benchmarks/bench_port.py --serving
    python benchmarks/bench_port.py --hopper [--lengths 8192 32768] [--rounds 5]

For each mask and length: the port is generated (`workbench.port`), its block lists built and
its autotuning done; FlexAttention is compiled with this workbench's block mask (equal to
create_block_mask's). Every output is checked against the other before timing ("agrees": max abs
difference within bf16 tolerance). Times are triton.testing.do_bench medians (ms); TFLOP/s count
the kept pairs only (4 * B * H * D flops per pair). `speed` = Flex time / port time (> 1: the port
is faster). The FA4 columns need flash-attn-4 (the `fa4` extra): Flex's FLASH backend, the FA4
export (`workbench.fa4`: the spec's `flash_attn_cute` file, checked against Flex before timing;
its first call, block lists included, is in --json), and FA4's flash_attn_func with the mask's
FlashAttention arguments (causal, window) where it has them; "cannot run" where one refuses the
mask; with --fa4 the FA4 paths are timed in turn over --rounds rounds and their medians reported
(clock and temperature drift reach each path alike), as --backward times its training steps. --decode adds Lq = 1 against each length. --segments times the port on document masks
(8, 32 and 64 documents, uneven lengths) with its default tiling and with cu_seqlens (tiles from each
document's start: packing-invariant), and checks that both give the same attention.
--serving times attention_paged (bf16, 32 query / 8 kv heads, D 128, page size 16): a mixed engine
step (prefill chunks of 2,048 and 512 queries and 30 decodes over 4K-32K contexts) in one launch,
fast and invariant mode, against the same work through the contiguous port (one call per request,
the calls' times summed) and compiled FlexAttention over the same paged layout (a block mask built
from the block table, as vLLM's Flex backend does); and paged prefill of one request at 8K and 32K
against the contiguous port. Decode alone: benchmarks/bench_paged.py.
--backward times forward + backward (out.backward(grad_out), bf16) of the port, compiled Flex
(Triton backend) and Flex's FLASH backend (FlashAttention-4, where it is installed and can run the
mask) on causal, sliding window 1024, 8 documents, prefix-LM 2048, per-head windows, image spans +
softcap and a T5-style learnable bias table (its gradient included; FLASH refuses captured tensors
that require grad), with the port's deterministic=True beside it; dq of the port and of Flex are
compared first; TFLOP/s count 3.5x the forward's flops (1 forward + 2.5 backward); peak memory is
torch.cuda.max_memory_allocated over one step. Short steps are bound by the host (Python, autograd,
the launches): beside the step's time stand the host's time per step and the GPU kernels' sum per
step (torch.profiler), what the step costs where the host runs ahead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench import Mask, make, port, with_score  # noqa: E402
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
        "causal + ALiBi": with_score(make("causal", q_len=seq, kv_len=seq, device=device),
                                     make("alibi", {"num_heads": heads}, device=device)),
        "T5 bias (log bucket)": _t5_fixed(seq, heads, device),
    }


def _t5_fixed(seq: int, heads: int, device) -> Mask:
    """_t5_bias with its table fixed (no gradient): a score_mod FLASH cannot compile (the bucket's
    log in floats)."""
    t5 = _t5_bias(seq, heads, device)
    return Mask("t5_bias", mask_mod=t5.mask_mod, score_mod=t5.score_mod, data={"bias": t5.data["bias"].detach()})


def kept_pairs(mask, q_len: int, kv_len: int, heads: int, device) -> int:
    """The (query, key) pairs the mask keeps over `heads` heads of one batch entry (from its block
    scan: a mask that does not read the head keeps the same pairs in every head)."""
    scan = scan_blocks(mask, q_len, kv_len, heads=heads, device=device, progress=False)
    return scan.kept_pairs * (1 if scan.depends_on_head else heads)


def timed(fn):
    from triton.testing import do_bench

    with torch.no_grad():
        return do_bench(fn, warmup=25, rep=100)


def step_ms(step):
    """do_bench median (ms) of a training step (forward + backward, with grad)."""
    from triton.testing import do_bench

    return do_bench(step, warmup=5, rep=30)


def timed_in_turn(fns: dict, rounds: int, timer=timed) -> dict:
    """{path: median ms} over `rounds` rounds in which every path is timed once (by `timer`), one
    after another: a drift of the GPU's clocks or temperature, or of the host's speed, reaches every
    path alike, so their ratio holds."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(timer(fn))
    return {name: sorted(ms)[len(ms) // 2] for name, ms in times.items()}


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
    kept = kept_pairs(mask, shape.q_len, shape.kv_len, shape.q_heads, device)
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
    # FlashAttention-4, three ways, where it is installed and can run the mask: Flex's FLASH backend
    # (inductor's CuTe DSL lowering), the workbench's FA4 export (its own CuTe DSL, the exact scan's
    # block-sparse tensors), and FA4 called directly with FlashAttention's arguments (causal, window)
    try:
        out_flash = flex(q, k, v, score_mod=mask.score_mod, block_mask=block_mask, kernel_options={"BACKEND": "FLASH"})
        row["flash_agrees"] = bool((out_flash.float() - out_flex.float()).abs().max() < 3e-2)
        row["flash_ms"] = timed(lambda: flex(q, k, v, score_mod=mask.score_mod, block_mask=block_mask,
                                             kernel_options={"BACKEND": "FLASH"}))
    except Exception as exc:
        row["flash_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    try:
        from workbench import fa4

        t0 = time.perf_counter()
        exported = fa4.load(fa4.write(fa4.generate(mask, shape.q_len, shape.kv_len, heads=shape.q_heads,
                                                   batch=shape.batch), folder / "fa4"))
        out_fa4 = exported.attention(q, k, v)
        torch.cuda.synchronize()
        row["fa4_export_first_call_s"] = time.perf_counter() - t0
        row["fa4_export_agrees"] = bool((out_fa4.float() - out_flex.float()).abs().max() < 3e-2)
        row["fa4_export_ms"] = timed(lambda: exported.attention(q, k, v))
    except Exception as exc:
        row["fa4_export_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    direct = {"causal": dict(causal=True), "sliding window 1024": dict(causal=True, window_size=(1023, 0))}.get(name)
    if direct is not None and shape.q_len == shape.kv_len:
        try:
            from flash_attn.cute import flash_attn_func

            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            row["fa4_direct_ms"] = timed(lambda: flash_attn_func(qt, kt, vt, **direct))
        except Exception as exc:
            row["fa4_direct_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    return row


def _ms(row, key) -> str:
    if key in row:
        agrees = row.get(key.replace("_ms", "_agrees"), True)
        return f"{row[key]:.3f}" + ("" if agrees else " (differs!)")
    return "-" if f"{key[:-3]}_error" not in row else "cannot run"


def _rounds(text: str) -> int:
    """--rounds: a whole number of rounds, at least 1 (a median needs one timing)."""
    try:
        rounds = int(text)
    except ValueError:
        rounds = 0
    if rounds < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of rounds: give a whole number, at least 1 "
                                         "(e.g. --rounds 5)")
    return rounds


# --loops suffixes after '+': q2 (two buffers of queries, HOPPER_Q_BUFFERS), pv0 / pv1 / pv2 (the wait
# for the previous tile's P V where ptxas puts it / after the exponentials / after the row max,
# HOPPER_UNDER_PV), ti0 / ti1 (the persistent
# loop's tile counts loaded by the warpgroups / handed over by the load warp, HOPPER_TILE_INFO), fs0 /
# fs1 (the persistent loop's store: a division per element / a reciprocal per row, HOPPER_FAST_STORE), ls0 /
# ls1 (the softmax's row sums: the whole row's every tile / each thread's share, HOPPER_LANE_SUMS)
_LOOP_EXTRAS = ("q2", "pv0", "pv1", "pv2", "ti0", "ti1", "fs0", "fs1", "ls0", "ls1")


def check_variants(variants, option: str = "--loops") -> str | None:
    """Why one of `variants` (HOPPER_LOOP forms as --loops takes them) names a suffix after '+' that
    no setting has, or None: such a suffix would otherwise time the default silently."""
    for loop in variants:
        unknown = [x for x in loop.split(" ")[0].split("+")[1:] if x not in _LOOP_EXTRAS]
        if unknown:
            return (f"{option} {loop!r}: after '+' only {', '.join(_LOOP_EXTRAS)} are known (two buffers of queries; "
                    f"the wait for the previous tile's P V first / after the exponentials / after the row max; "
                    f"the tile counts loaded / handed over; the "
                    f"store by a division / a reciprocal; the row sums whole / by thread), "
                    f"e.g. persistent+q2 or persistent+ti0")
    return None


@contextlib.contextmanager
def hopper_variant(module, variant: str):
    """The port's file `module` set, for the block's calls, to one form of its Hopper loop as
    --loops names it: LOOP[:BUFFERS][@NAMED][+EXTRA...], e.g. "persistent@3+ls1" (HOPPER_LOOP, the
    K / V buffers, HOPPER_NAMED, and the switches of _LOOP_EXTRAS); "default" leaves the file as
    generated. Every setting is put back on leaving."""
    saved = {name: getattr(module, name) for name in ("HOPPER", "HOPPER_LOOP", "HOPPER_TILE", "HOPPER_NAMED",
                                                       "HOPPER_Q_BUFFERS", "HOPPER_UNDER_PV", "HOPPER_TILE_INFO",
                                                       "HOPPER_FAST_STORE", "HOPPER_LANE_SUMS",
                                                       "HOPPER_UNDER_PV_CHOSEN")}
    try:
        if variant != "default":
            variant, *extras = variant.split("+")
            variant, _, named = variant.partition("@")
            loop, _, buffers = variant.partition(":")
            block_n, default_buffers, warps = module.HOPPER_TILE
            module.HOPPER, module.HOPPER_LOOP = True, loop or module.HOPPER_LOOP
            module.HOPPER_TILE = (block_n, int(buffers or default_buffers), warps)
            if named:
                module.HOPPER_NAMED = int(named)
            for on, off, name in (("q2", None, "HOPPER_Q_BUFFERS"), ("pv1", "pv0", "HOPPER_UNDER_PV"),
                                  ("ti1", "ti0", "HOPPER_TILE_INFO"), ("fs1", "fs0", "HOPPER_FAST_STORE"),
                                  ("ls1", "ls0", "HOPPER_LANE_SUMS")):
                if on in extras:
                    setattr(module, name, 2 if on == "q2" else 1)
                elif off in extras:
                    setattr(module, name, 0)
            if "pv2" in extras:
                module.HOPPER_UNDER_PV = 2
            if {"pv0", "pv1", "pv2"} & set(extras):  # (the place named, not the one that spills less)
                module.HOPPER_UNDER_PV_CHOSEN = True
        yield module
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--kv-heads", type=int, help="--hopper: grouped-query attention with this many kv heads")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="--hopper: q, k, v's dtype")
    p.add_argument("--masks", nargs="*")
    p.add_argument("--decode", action="store_true", help="also Lq = 1 against each length")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--segments", action="store_true", help="only the cu_seqlens cost on document masks")
    p.add_argument("--serving", action="store_true", help="only attention_paged: a mixed step and paged prefill")
    p.add_argument("--backward", action="store_true", help="only forward + backward (training), against Flex's "
                   "Triton and FLASH backends")
    p.add_argument("--rounds", type=_rounds, default=5, help="--fa4: rounds in which the FA4 paths are timed in turn; "
                   "--backward: the training steps of every path (medians reported)")
    p.add_argument("--fa4", action="store_true", help="only the FA4 columns: Flex FLASH, the FA4 export, FA4 "
                   "direct (and the port and Flex Triton where FLASH cannot run the mask), plus each path's host "
                   "cost per call")
    p.add_argument("--hopper", action="store_true", help="only the port's Hopper kernel (Gluon, sm_90) beside its "
                   "portable kernel, Flex Triton and Flex FLASH")
    p.add_argument("--loops", nargs="+", default=["specialized", "pingpong"],
                   help="--hopper: the forms of its tile loop to time (HOPPER_LOOP), each optionally with its number "
                   "of K / V buffers and its warpgroups' hand-offs (HOPPER_NAMED: 0 mbarriers, 1 named turns, 3 named "
                   "turns and releases, 5 or 7: 1 or 3 with the turn taken before the tile's waits), `+q2`, two buffers of "
                   "queries (HOPPER_Q_BUFFERS), `+pv0` / `+pv1` / `+pv2`, the wait for the previous tile's "
                   "P V where ptxas puts it / after the exponentials / after the row max (HOPPER_UNDER_PV), "
                   "`+ti0` / `+ti1`, the persistent loop's tile counts "
                   "loaded by the warpgroups / handed over by the load warp (HOPPER_TILE_INFO), and `+fs0` / `+fs1`, "
                   "its store by a division per element / a reciprocal per row (HOPPER_FAST_STORE), `+ls0` / `+ls1`, "
                   "the softmax's row sums whole every tile / each thread's share (HOPPER_LANE_SUMS): pingpong:3, "
                   "persistent@7, persistent+q2, persistent+pv0, persistent+ti1+fs1, persistent+ls1")
    p.add_argument("--score-forms", nargs="+", choices=["off", "bias", "all"],
                   help="--hopper: the score functions' forms to time, each loop with each (PORT_FAST_SCORE's; default: "
                   "the generator's, bias unless PORT_FAST_SCORE says otherwise): off "
                   "(score_mod times log2 e), bias (biases added to the score in one fused multiply-add), all (and "
                   "integer distances converted per row and column)")
    args = p.parse_args(argv)
    why = check_variants(args.loops)  # (a suffix after '+' that names nothing would time the default silently)
    if why:
        p.error(why)
    # (other libraries' notes that repeat on every row and push the table off a short log: torch's
    # profiler on each measured cycle, the CuTe DSL on FA4's aux_data argument at each compile)
    warnings.filterwarnings("ignore", message="Warning: Profiler clears events")
    warnings.filterwarnings("ignore", message="Argument aux_data .* cannot be converted to a JitArgument")
    if args.hopper:
        return hopper_bench(args)
    if args.fa4:
        return fa4_bench(args)
    if args.serving:
        return serving_bench(args)
    if args.backward:
        return backward_bench(args)
    if args.segments:
        return segments_cost(args)
    rows = []
    folder = Path(tempfile.mkdtemp(prefix="bench_port_"))
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, B={args.batch} H={args.heads} "
          f"D={args.head_dim}, forward", flush=True)
    print("| mask | tokens | port ms | Flex ms | speed (Flex/port) | port TFLOP/s | Flex TFLOP/s | Flex FLASH ms | "
          "FA4 export ms | FA4 direct ms | cuDNN causal ms | agrees |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
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
                  f"{row['port_tflops']:.0f} | {row['flex_tflops']:.0f} | {_ms(row, 'flash_ms')} | "
                  f"{_ms(row, 'fa4_export_ms')} | {_ms(row, 'fa4_direct_ms')} | {cudnn} | {row['agrees']} |", flush=True)
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


def _host_us(fn, calls: int = 300) -> float:
    """Microseconds of host work per call: `calls` back to back on a problem the GPU finishes at
    once (the wall time is the host's), after a warm-up."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def hopper_bench(args) -> int:
    """The port's Hopper kernel (templates/hopper.py, Gluon: TMA and warpgroup MMA) beside the
    portable kernel of the same file, Flex's Triton backend and Flex's FLASH backend (FA4, where it
    is installed and can run the mask), timed in turn over --rounds rounds; each output is checked
    against Flex Triton's first, and the Hopper columns only count calls that ran the Hopper kernel
    (each form of its tile loop, HOPPER_LOOP "specialized", "pingpong", "persistent", or "auto").
    Beside the calls' times, each path's GPU kernels alone (torch.profiler): at short lengths a
    call's time can be its host's."""
    import importlib

    folder = Path(tempfile.mkdtemp(prefix="bench_hopper_"))
    generator = importlib.import_module("workbench.port.generate")
    fast_default = generator.FAST_SCORE_FORMS
    flex = compiled_flex_attention()
    kv_heads = args.kv_heads or args.heads
    gqa = {"enable_gqa": True} if kv_heads != args.heads else {}
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, B={args.batch} H={args.heads} "
          f"Hkv={kv_heads} D={args.head_dim}, forward; medians of {args.rounds} rounds timed in turn", flush=True)
    forms = list(dict.fromkeys(args.score_forms or [fast_default]))
    # the timed columns: each loop form, with each score form when there are several
    loops = [loop if len(forms) == 1 else f"{loop} {form}" for form in forms for loop in args.loops]
    print("| mask | tokens | " + " | ".join(f"Hopper {loop} ms (TFLOP/s)" for loop in loops) + " | portable port ms | "
          "Flex Triton ms | Flex FLASH ms | portable / best Hopper | Flex Triton / best Hopper | FLASH / best Hopper | "
          "GPU kernels ms: " + " / ".join(f"Hopper {loop}" for loop in loops) + " / portable / Flex Triton / FLASH | "
          "max abs diff vs Flex | first Hopper call s |")
    print("|---" * (len(loops) + 11) + "|")
    for seq in args.lengths:
        for name, mask in masks_at(seq, args.heads, "cuda").items():
            if args.masks and name not in args.masks:
                continue
            shape = Shape(batch=args.batch, q_heads=args.heads, kv_heads=kv_heads, q_len=seq, head_dim=args.head_dim)
            inputs = make_inputs(shape, args.dtype, "cuda", seed=0)
            q, k, v = inputs.q, inputs.k, inputs.v
            try:
                modules = {}
                for form in forms:
                    generator.FAST_SCORE_FORMS = form
                    try:
                        modules[form] = port.load(port.build(mask, seq, seq, heads=args.heads, batch=args.batch,
                                                             out_dir=folder / f"{seq}_{name[:12]}_{form}".replace(" ", "_")))
                    finally:
                        generator.FAST_SCORE_FORMS = fast_default
                module = modules[forms[0]]
                block_mask = build_block_mask(mask, seq, seq, heads=args.heads, device="cuda", shrink=True, progress=False)
                flops = 4 * kept_pairs(mask, seq, seq, args.heads, "cuda") * args.head_dim * args.batch
                module.HOPPER = True
                if not module._hopper_ready(q, k, v, None, False):
                    raise RuntimeError(f"the Hopper kernel does not take this call ({module.HOPPER_MODS or 'shape'})")

                def hopper(variant, modules=modules):
                    variant, _, form = variant.partition(" ")
                    module = modules[form or forms[0]]
                    with hopper_variant(module, variant):
                        return module.attention(q, k, v)

                def portable(module=module):
                    module.HOPPER = False
                    return module.attention(q, k, v)

                diff, first, flex_error = 0.0, {}, None
                with torch.no_grad():
                    try:
                        want = flex(q, k, v, score_mod=mask.score_mod, block_mask=block_mask, **gqa)
                    except Exception as exc:  # (compiled Flex cannot run it: the portable kernel is the reference)
                        flex_error = f"cannot run: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
                        want = portable()
                    for loop in loops:  # the first call: block lists and the kernel's compile (or Triton's disk cache)
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        got = hopper(loop)
                        torch.cuda.synchronize()
                        first[loop] = time.perf_counter() - t0
                        diff = max(diff, float((got.float() - want.float()).abs().max()))
                paths = {loop: (lambda loop=loop: hopper(loop)) for loop in loops}
                paths["portable"] = portable
                if flex_error is None:
                    paths["flex"] = lambda: flex(q, k, v, score_mod=mask.score_mod, block_mask=block_mask, **gqa)
                try:
                    with torch.no_grad():
                        flex(q, k, v, score_mod=mask.score_mod, block_mask=block_mask, kernel_options={"BACKEND": "FLASH"},
                             **gqa)
                    paths["flash"] = lambda: flex(q, k, v, score_mod=mask.score_mod, block_mask=block_mask,
                                                  kernel_options={"BACKEND": "FLASH"}, **gqa)
                except Exception:  # not installed, or it cannot run this mask
                    pass
                ms = timed_in_turn(paths, args.rounds)
            except Exception as exc:  # a failed row is a result
                print(f"| {name} | {seq:,} | error: {type(exc).__name__}: {str(exc)[:200]} |", flush=True)
                continue
            best = min(ms[loop] for loop in loops)
            flash = f"{ms['flash']:.3f}" if "flash" in ms else "-"
            vs_flash = f"{ms['flash'] / best:.2f}x" if "flash" in ms else "-"
            wrong = "" if diff < 3e-2 else " **differs**"
            cells = " | ".join(f"{ms[loop]:.3f} ({flops / ms[loop] / 1e9:.0f})" for loop in loops)
            # a short call's time above can be the host's (Python, the launch): the kernels alone,
            # what a CUDA graph or a busy stream would see
            with torch.no_grad():
                kernels = [_kernel_ms(paths[p]) if p in paths else None
                           for p in (*loops, "portable", "flex", "flash")]
            kernels = " / ".join("-" if t is None else f"{t:.3f}" for t in kernels)
            flex_ms = flex_error or f"{ms['flex']:.3f}"
            vs_flex = "-" if flex_error else f"{ms['flex'] / best:.2f}x"
            print(f"| {name} | {seq:,} | {cells} | {ms['portable']:.3f} | {flex_ms} | {flash} | "
                  f"{ms['portable'] / best:.2f}x | {vs_flex} | {vs_flash} | {kernels} | "
                  f"{diff:.1e}{wrong}{' (vs the portable kernel)' if flex_error else ''} | {max(first.values()):.2f} |",
                  flush=True)
            torch.cuda.empty_cache()
    return 0


def fa4_bench(args) -> int:
    """The FA4 export beside Flex's FLASH backend (the same FA4 kernel, reached through inductor) and
    FA4 called directly; where FLASH cannot run the mask, beside the port and Flex's Triton backend
    (the kernels that can). Each output is checked against another path's before it is timed."""
    from workbench import fa4

    folder = Path(tempfile.mkdtemp(prefix="bench_fa4_"))
    flex = compiled_flex_attention()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, flash-attn-4 {fa4.installed()}, bf16, "
          f"B={args.batch} H={args.heads} D={args.head_dim}, forward", flush=True)
    print("| mask | tokens | Flex FLASH ms | FA4 export ms | export / FLASH | FA4 direct ms | port ms | Flex Triton ms "
          "| export TFLOP/s | export first call s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    host = {}
    for seq in args.lengths:
        masks = masks_at(seq, args.heads, "cuda")
        for name, mask in masks.items():
            if args.masks and name not in args.masks:
                continue
            shape = Shape(batch=args.batch, q_heads=args.heads, q_len=seq, head_dim=args.head_dim)
            inputs = make_inputs(shape, "bfloat16", "cuda", seed=0)
            q, k, v = inputs.q, inputs.k, inputs.v
            row = {}
            try:
                block_mask = build_block_mask(mask, seq, seq, heads=args.heads, device="cuda", shrink=True, progress=False)
                flops = 4 * kept_pairs(mask, seq, seq, args.heads, "cuda") * args.head_dim * args.batch
                flash = lambda: flex(q, k, v, score_mod=mask.score_mod, block_mask=block_mask,  # noqa: E731
                                     kernel_options={"BACKEND": "FLASH"})
                try:
                    want = flash()
                except Exception as exc:
                    row["flash_error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
                    want = flex(q, k, v, score_mod=mask.score_mod, block_mask=block_mask)
                    row["flex_ms"] = timed(lambda: flex(q, k, v, score_mod=mask.score_mod, block_mask=block_mask))
                    module = port.load(port.build(mask, seq, seq, heads=args.heads, batch=args.batch,
                                                  out_dir=folder / f"p{seq}{len(host)}{name[:3]}"))
                    assert (module.attention(q, k, v).float() - want.float()).abs().max() < 3e-2, "port differs"
                    row["port_ms"] = timed(lambda: module.attention(q, k, v))
                t0 = time.perf_counter()
                exported = fa4.load(fa4.write(fa4.generate(mask, seq, seq, heads=args.heads, batch=args.batch),
                                              folder / f"f{seq}{len(host)}"))
                got = exported.attention(q, k, v)
                torch.cuda.synchronize()
                row["first_s"] = time.perf_counter() - t0
                row["fa4_export_agrees"] = bool((got.float() - want.float()).abs().max() < 3e-2)
                paths = {"fa4_export_ms": lambda: exported.attention(q, k, v)}
                if "flash_error" not in row:
                    paths["flash_ms"] = flash
                direct = {"causal": dict(causal=True),
                          "sliding window 1024": dict(causal=True, window_size=(1023, 0))}.get(name)
                if direct is not None:
                    from flash_attn.cute import flash_attn_func

                    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
                    paths["fa4_direct_ms"] = lambda: flash_attn_func(qt, kt, vt, **direct)
                row.update(timed_in_turn(paths, args.rounds))
                if name == "causal" and seq == args.lengths[0]:  # host cost per call, on a problem of 128 tokens
                    small = make_inputs(Shape(batch=1, q_heads=2, q_len=128, head_dim=args.head_dim), "bfloat16",
                                        "cuda", seed=1)
                    sq, sk, sv = small.q, small.k, small.v
                    small_bm = build_block_mask(make("causal", q_len=128, kv_len=128), 128, 128, device="cuda")
                    tiny = fa4.load(fa4.write(fa4.generate(make("causal", q_len=128, kv_len=128), 128, 128),
                                              folder / "tiny"))
                    from flash_attn.cute import flash_attn_func

                    st = [t.transpose(1, 2) for t in (sq, sk, sv)]
                    with torch.no_grad():
                        host["Flex FLASH"] = _host_us(lambda: flex(sq, sk, sv, block_mask=small_bm,
                                                                   kernel_options={"BACKEND": "FLASH"}))
                        host["FA4 export"] = _host_us(lambda: tiny.attention(sq, sk, sv))
                        host["FA4 direct (causal=True)"] = _host_us(lambda: flash_attn_func(*st, causal=True))
                        host["Flex Triton"] = _host_us(lambda: flex(sq, sk, sv, block_mask=small_bm))
            except Exception as exc:  # keep going: a failed row is a result
                row["error"] = f"{type(exc).__name__}: {str(exc)[:240]}"
            if "error" in row:
                print(f"| {name} | {seq:,} | error: {row['error']} |", flush=True)
                continue
            ratio = (f"{row['fa4_export_ms'] / row['flash_ms']:.3f}" if "flash_ms" in row else "-")
            print(f"| {name} | {seq:,} | {_ms(row, 'flash_ms')} | {_ms(row, 'fa4_export_ms')} | {ratio} | "
                  f"{_ms(row, 'fa4_direct_ms')} | {_ms(row, 'port_ms')} | {_ms(row, 'flex_ms')} | "
                  f"{flops / row['fa4_export_ms'] / 1e9:.0f} | {row['first_s']:.1f} |", flush=True)
    if host:
        print("\n| path (B 1, H 2, 128 tokens, causal) | host µs per call |\n|---|---|")
        for what, us in host.items():
            print(f"| {what} | {us:.0f} |")
    return 0


def _t5_bias(seq: int, heads: int, device) -> Mask:
    """causal + a T5-style learnable bias: exact buckets up to 8, then logarithmic up to 32."""

    bias = (torch.randn(heads, 32, device=device) * 0.1).requires_grad_()

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def t5(score, b, h, q_idx, kv_idx):
        d = (q_idx - kv_idx).clamp(0, seq)
        bucket = torch.where(d < 8, d, (8 + (torch.log((d.float() + 1) / 8) / math.log(seq / 8) * 24).int()).clamp(max=31))
        return score + bias[h, bucket]

    return Mask("t5_learnable_bias", mask_mod=causal, score_mod=t5, data={"bias": bias}, q_len=seq, kv_len=seq)


def _step_peak(step) -> float:
    """A training step's peak memory (GiB) over one call, after a first call (its compiles)."""
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def _host_ms(step, calls: int = 30) -> float:
    """Host time (ms) per training step: `calls` steps back to back, timed until the last one has
    been issued (not run): what Python, autograd and the launches cost. A step whose host time
    exceeds its GPU time is bound by the host."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    return 1e3 * (issued - start) / calls


def _kernel_ms(step, steps: int = 10) -> float:
    """GPU time (ms) per training step: the sum of the kernels one step runs (torch.profiler,
    averaged over `steps`), without the host's gaps between them: what the step costs where the
    host runs ahead of the GPU (a model whose other layers keep the GPU busy)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages() if e.device_time_total > 0) / steps / 1e3


def backward_bench(args) -> int:
    from workbench.run import learnable_tensors

    folder = Path(tempfile.mkdtemp(prefix="bench_backward_"))
    flex = compiled_flex_attention()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, B={args.batch} H={args.heads} "
          f"D={args.head_dim}, forward + backward; medians of {args.rounds} rounds of do_bench timed in turn (ms), "
          "TFLOP/s on kept pairs (3.5x the forward's flops), peak GiB over one step\n", flush=True)
    print("| mask | tokens | port ms (TFLOP/s, GiB) | port deterministic ms | Flex Triton ms (TFLOP/s, GiB) | "
          "Flex FLASH ms (TFLOP/s) | port / Flex Triton | port / FLASH | host ms per step (port, Flex Triton) | "
          "GPU kernels ms per step (port, Flex Triton, FLASH) | kernels: port / Flex Triton | dq max abs diff vs Flex |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    wanted = ("causal", "sliding window 1024", "document (8 docs)", "prefix-LM 2048", "per-head window",
              "image spans + softcap")
    for seq in args.lengths:
        masks = {n: m for n, m in masks_at(seq, args.heads, "cuda").items() if n in wanted}
        masks["T5 learnable bias"] = _t5_bias(seq, args.heads, "cuda")
        for name, mask in masks.items():
            if args.masks and name not in args.masks:
                continue
            try:
                print(_backward_row(name, mask, seq, args, flex, folder / f"{name}_{seq}".replace(" ", "_"),
                                    learnable_tensors(mask)), flush=True)
            except Exception as exc:  # a failed row is a result
                print(f"| {name} | {seq:,} | error: {type(exc).__name__}: {str(exc)[:200]} |", flush=True)
            torch.cuda.empty_cache()
    return 0


def _backward_row(name, mask, seq, args, flex, folder, learn) -> str:
    shape = Shape(batch=args.batch, q_heads=args.heads, q_len=seq, head_dim=args.head_dim)
    inputs = make_inputs(shape, "bfloat16", "cuda", seed=0, backward=True)
    q, k, v = (t.detach().requires_grad_() for t in (inputs.q, inputs.k, inputs.v))
    grad_out = inputs.grad_out
    module = port.load(port.build(mask, seq, seq, heads=args.heads, batch=args.batch, out_dir=folder))
    kept = kept_pairs(mask, seq, seq, args.heads, "cuda")
    flops = 3.5 * 4 * kept * args.head_dim * args.batch
    tables = {n: t for n, t in learn.items()}  # the port learns the mask's own tables through tables=
    leaves = [q, k, v, *tables.values()]

    def clear():
        for t in leaves:
            t.grad = None

    def port_step(deterministic=False):
        clear()
        module.attention(q, k, v, tables=tables, deterministic=deterministic).backward(grad_out)

    block_mask = build_block_mask(mask, seq, seq, heads=args.heads, device="cuda", shrink=True, progress=False)

    def flex_step(**options):
        clear()
        flex(q, k, v, score_mod=mask.score_mod, block_mask=block_mask, **options).backward(grad_out)

    try:
        port_step()
    except Exception as exc:
        raise RuntimeError(f"the port: {type(exc).__name__}: {exc}") from exc
    dq_port = q.grad.clone()
    # each path's first steps (compiles) and its peak memory, then every path that runs timed in turn
    # over --rounds rounds (medians): short steps are bound by the host, whose speed drifts between
    # one timing and the next, and timing in turn gives every path the same drift
    paths = {"port": port_step, "deterministic": lambda: port_step(True)}  # (its sums the same bits run to run)
    port_gib = _step_peak(port_step)
    _step_peak(paths["deterministic"])
    try:  # Flex's own failures (its compile, its tiles) are a result too: the port's figures stand
        flex_step()
        diff = f"{float((dq_port.float() - q.grad.float()).abs().max()):.1e}"
        flex_gib = _step_peak(flex_step)
        paths["flex"] = flex_step
        flex_host = f"{_host_ms(flex_step):.2f}"
    except Exception as exc:
        ms = timed_in_turn(paths, args.rounds, timer=step_ms)
        port_ms = ms["port"]
        return (f"| {name} | {seq:,} | {port_ms:.2f} ({flops / port_ms / 1e9:.0f}, {port_gib:.2f}) | "
                f"{ms['deterministic']:.2f} | cannot run ({type(exc).__name__}: {str(exc)[:100]}) | - | - | - | "
                f"{_host_ms(port_step):.2f}, - | {_kernel_ms(port_step):.3f}, -, - | - | - |")
    port_gpu, flex_gpu, flash_gpu = _kernel_ms(port_step), _kernel_ms(flex_step), "-"
    flash_step = lambda: flex_step(kernel_options={"BACKEND": "FLASH"})  # noqa: E731
    flash_error = None
    try:
        _step_peak(flash_step)
        paths["flash"] = flash_step
        flash_gpu = f"{_kernel_ms(flash_step):.3f}"
    except Exception as exc:  # not installed, or it cannot run this mask
        flash_error = f"n/a ({type(exc).__name__}: {str(exc)[:80]})"
    ms = timed_in_turn(paths, args.rounds, timer=step_ms)
    port_ms, det_ms, flex_ms = ms["port"], ms["deterministic"], ms["flex"]
    if flash_error is None:
        flash = f"{ms['flash']:.2f} ({flops / ms['flash'] / 1e9:.0f})"
        vs_flash = f"{ms['flash'] / port_ms:.2f}x"
    else:
        flash, vs_flash = flash_error, "-"
    det = f"{det_ms:.2f}"
    host = f"{_host_ms(port_step):.2f}, {flex_host}"
    return (f"| {name} | {seq:,} | {port_ms:.2f} ({flops / port_ms / 1e9:.0f}, {port_gib:.2f}) | {det} | "
            f"{flex_ms:.2f} ({flops / flex_ms / 1e9:.0f}, {flex_gib:.2f}) | {flash} | {flex_ms / port_ms:.2f}x | "
            f"{vs_flash} | {host} | {port_gpu:.3f}, {flex_gpu:.3f}, {flash_gpu} | {flex_gpu / port_gpu:.2f}x | {diff} |")


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



def _paged_layout(requests, page: int, hkv: int, d: int, device="cuda"):
    """Each request's keys in consecutive pages (requests one after another), and the step's
    arguments: (q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens) plus per request its
    contiguous (q [1, Hq, n_q, D], k, v [1, Hkv, L, D])."""
    g = torch.Generator(device=device).manual_seed(0)
    pages_of = [-(-length // page) for _, length in requests]
    total_pages = sum(pages_of)
    kc = torch.randn(total_pages, page, hkv, d, device=device, dtype=torch.bfloat16, generator=g)
    vc = torch.randn_like(kc)
    table = torch.zeros(len(requests), max(pages_of), dtype=torch.int32, device=device)
    start, per_request = 0, []
    hq = 32
    qs = []
    for r, ((n_q, length), n) in enumerate(zip(requests, pages_of)):
        table[r, :n] = torch.arange(start, start + n, device=device, dtype=torch.int32)
        k = kc[start:start + n].reshape(n * page, hkv, d)[:length].permute(1, 0, 2)[None].contiguous()
        v = vc[start:start + n].reshape(n * page, hkv, d)[:length].permute(1, 0, 2)[None].contiguous()
        q = torch.randn(n_q, hq, d, device=device, dtype=torch.bfloat16, generator=g)
        qs.append(q)
        per_request.append((q.permute(1, 0, 2)[None].contiguous(), k, v))
        start += n
    counts = torch.tensor([n for n, _ in requests])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32).to(device)
    lens = torch.tensor([length for _, length in requests], dtype=torch.int32, device=device)
    return (torch.cat(qs).contiguous(), kc, vc, table, cu, lens), per_request


def _flex_over_pages(args, requests, page: int):
    """Compiled FlexAttention over the step's paged layout: q [1, Hq, total_q, D] against every
    cache slot [1, Hkv, pages * page, D]; the mask keeps a pair when the slot is the query's
    request's, at a position it may see (causal within the request). Returns (call, build ms)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, kc, vc, table, cu, lens = args
    device = q.device
    num_pages = kc.shape[0]
    page_req = torch.full((num_pages,), -1, dtype=torch.int64, device=device)
    page_logical = torch.zeros(num_pages, dtype=torch.int64, device=device)
    for r, (n_q, length) in enumerate(requests):
        n = -(-length // page)
        page_req[table[r, :n].long()] = r
        page_logical[table[r, :n].long()] = torch.arange(n, device=device)
    q_req = torch.repeat_interleave(torch.arange(len(requests), device=device), (cu[1:] - cu[:-1]).long())
    q_pos = torch.cat([torch.arange(length - n_q, length, device=device) for n_q, length in requests])
    lens64 = lens.long()

    def mask_mod(b, h, q_idx, kv_idx):
        r = q_req[q_idx]
        pos = page_logical[kv_idx // page] * page + kv_idx % page
        return (page_req[kv_idx // page] == r) & (pos <= q_pos[q_idx]) & (pos < lens64[r])

    t0 = time.perf_counter()
    block_mask = create_block_mask(mask_mod, 1, None, q.shape[0], num_pages * page, device=device, _compile=True)
    torch.cuda.synchronize()
    build_ms = (time.perf_counter() - t0) * 1e3
    fx = torch.compile(flex_attention)
    qf = q.permute(1, 0, 2)[None]
    kf = kc.reshape(-1, kc.shape[2], kc.shape[3]).permute(1, 0, 2)[None]
    vf = vc.reshape(-1, vc.shape[2], vc.shape[3]).permute(1, 0, 2)[None]
    return (lambda: fx(qf, kf, vf, block_mask=block_mask, enable_gqa=True)), build_ms


def serving_bench(args) -> int:
    """The mixed step and paged prefill (see the module's docstring)."""
    folder = Path(tempfile.mkdtemp(prefix="bench_serving_"))
    module = port.load(port.build(make("causal"), 256, 256, out_dir=folder))
    hkv, d, page = 8, 128, 16
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, 32 query / 8 kv heads, D {d}, "
          f"page size {page}, causal; do_bench medians (ms)\n")
    gen = torch.Generator().manual_seed(1)
    decodes = [(1, int(x)) for x in torch.randint(4096, 32769, (30,), generator=gen)]
    mixed = [(2048, 2048 + 6144), (512, 512)] + decodes
    cases = [("mixed step: chunks of 2,048 (context 6,144) and 512 + 30 decodes over 4K-32K", mixed),
             ("paged prefill, one request of 8,192", [(8192, 8192)]),
             ("paged prefill, one request of 32,768", [(32768, 32768)])]
    print("| case | paged fast ms | paged invariant ms | contiguous port, sum of calls ms | fast / contiguous | "
          "Flex over the pages ms | fast / Flex | Flex block mask build ms | max abs diff fast vs contiguous |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, requests in cases:
        step, per_request = _paged_layout(requests, page, hkv, d)
        with torch.no_grad():
            fast = module.attention_paged(*step)
            module.attention_paged(*step, invariant=True)
            fast_ms = timed(lambda: module.attention_paged(*step))
            inv_ms = timed(lambda: module.attention_paged(*step, invariant=True))
            contiguous_ms, diff = 0.0, 0.0
            cu = step[4].tolist()
            for r, (q, k, v) in enumerate(per_request):
                out = module.attention(q, k, v)
                diff = max(diff, float((out[0].permute(1, 0, 2).float() - fast[cu[r]:cu[r + 1]].float()).abs().max()))
                contiguous_ms += timed(lambda: module.attention(q, k, v))
        flex_ms, build_ms = float("nan"), float("nan")
        try:
            call, build_ms = _flex_over_pages(step, requests, page)
            with torch.no_grad():
                flex_out = call()[0].permute(1, 0, 2)
                diff_flex = float((flex_out.float() - fast.float()).abs().max())
                flex_ms = timed(call)
            flex_note = f"{flex_ms:.3f} (agrees to {diff_flex:.1e})"
        except Exception as exc:  # a failed column is a result
            flex_note = f"failed: {type(exc).__name__}: {str(exc)[:100]}"
        print(f"| {label} | {fast_ms:.3f} | {inv_ms:.3f} | {contiguous_ms:.3f} | {fast_ms / contiguous_ms:.2f}x | "
              f"{flex_note} | {fast_ms / flex_ms:.2f}x | {build_ms:.0f} | {diff:.1e} |", flush=True)
        step = per_request = None  # free the pages before the next case
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
