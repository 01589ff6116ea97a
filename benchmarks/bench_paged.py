"""The port's serving entry point (attention_paged) against SDPA at decode (its default, cuDNN's kernel
on Hopper, and its FLASH_ATTENTION backend, FlashAttention-2) and against the contiguous port at
prefill, on one process's GPU, side by side.

Decode: one request against 131,072 keys and 8 requests against 32,768 (bf16, 32 query / 8 kv heads,
D 128, page sizes 16 and 128), with the share of the H200's memory bandwidth each reaches (the K and
V bytes over the time). Prefill: one request of 8,192 and 32,768 tokens through attention_paged and
through the contiguous `attention` (autotuned), the same keys. Every timed call's output is first
compared with SDPA's (decode) or the contiguous port's (prefill): a variant that computes something
else is a row that says so, not a time.

Each row is one variant of the loaded file's knobs: the tile (BLOCK_M, BLOCK_N, warps, stages; set
through PAGED_TILES), the split-KV piece size (FAST_SPLIT_KEYS) or count (PAGED_PIECES, --pieces)
and the mode (fast or invariant), and with --pdl whether the fold of split-KV pieces is launched as a
programmatic dependent of the kernel (PAGED_PDL). Decode rows also give the GPU time of each call's
kernels (torch.profiler over CUDA-graph replays) beside SDPA's.

    python benchmarks/bench_paged.py                       # the file's defaults
    python benchmarks/bench_paged.py --sweep               # tiles x piece sizes, decode and prefill
    python benchmarks/bench_paged.py --prefill 8192 32768  # prefill rows only at these lengths
    python benchmarks/bench_paged.py --prefill --pieces auto fixed 32 33  # decode: cuts of split-KV
    python benchmarks/bench_paged.py --prefill --pdl on off  # decode: the fold as a dependent launch or not
    python benchmarks/bench_paged.py --prefill --layouts nhd hnd  # decode: vLLM's cache and a head-major one
    python benchmarks/bench_paged.py --prefill --tiles 16x64x4x3 16x128x4x2  # decode: these tiles
    python benchmarks/bench_paged.py --prefill --tiles 16x64x4x3 16x64x4x2@168  # the second under 168 registers
"""

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench import make, port  # noqa: E402

from bench_host import kernels as kernel_times  # noqa: E402  (each kernel's GPU time per call, torch.profiler)
from bench_port import _kernel_ms  # noqa: E402  (the kernels' GPU time per call, torch.profiler)

# HBM bandwidth (TB/s) by the GPU's name: a row's share is its K and V bytes over the time against this
PEAK_TBS = {"H200": 4.8, "H100 80GB HBM3": 3.35, "H100 NVL": 3.9, "H100 PCIe": 2.0}


def peak_tbs() -> float | None:
    """The HBM bandwidth of this process's GPU (TB/s), or None where it is not in PEAK_TBS."""
    name = torch.cuda.get_device_name()
    return next((tbs for key, tbs in PEAK_TBS.items() if key in name), None)


def _share(tbs: float, peak: float | None) -> str:
    return f"{tbs:.2f} ({tbs / peak:.0%})" if peak else f"{tbs:.2f}"
DECODE_CASES = ((1, 131072), (8, 32768))
# (tile or None for the file's own, split_keys or None for the file's own, invariant[, pieces]):
# pieces None: the file's cut, "auto": even pieces, as many as fill the GPU (PAGED_BALANCE),
# "fixed": pieces of split_keys keys at fixed positions, a number: that many even pieces
DEFAULT_DECODE = [(None, None, False), (None, None, True)]
SWEEP_DECODE = ([(None, None, False)]
                + [((m, n, w, s), k, False) for m, n, w, s in ((16, 64, 4, 3), (16, 64, 4, 4), (16, 128, 4, 3),
                                                               (16, 32, 4, 4), (64, 64, 4, 3))
                   for k in (2048, 4096)]
                + [(None, None, True)])
# prefill: (tile or None for the file's own, invariant, Hopper kernel on sm_90: HOPPER_PAGED)
DEFAULT_PREFILL = [(None, False, True), (None, False, False), (None, True, False)]
SWEEP_PREFILL = [(None, False, True), (None, False, False), ((128, 64, 8, 3), False, False),
                 ((128, 128, 8, 2), False, False), ((128, 128, 8, 3), False, False), ((128, 32, 8, 4), False, False),
                 (None, True, False)]


def decode_case(B, L, page, Hq=32, Hkv=8, D=128, seed=0, layout="nhd"):
    """q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens of B requests decoding against L keys.
    layout "nhd": the caches as vLLM allocates them, [pages, page, Hkv, D] contiguous (a page's
    keys interleave the heads: one head's keys are 256-byte rows 2 KB apart at D 128); "hnd":
    allocated [pages, Hkv, page, D] (each head's keys of a page in one run, as FlashInfer's HND
    layout) and passed as the [pages, page, Hkv, D] view attention_paged takes (other strides)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n_pages = B * L // page
    shape = (n_pages, page, Hkv, D) if layout == "nhd" else (n_pages, Hkv, page, D)
    kc = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
    if layout == "hnd":
        kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)
    # each request's pages in a shuffled order, as an engine's cache holds them after a while
    table = torch.randperm(n_pages, device="cuda", generator=g).to(torch.int32).view(B, L // page)
    q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = torch.arange(B + 1, device="cuda", dtype=torch.int32)
    lens = torch.full((B,), L, device="cuda", dtype=torch.int32)
    return q, kc, vc, table, cu, lens


def _contiguous(cache, table, B, L, page):
    """[B, Hkv, L, D]: each request's keys gathered from its pages."""
    Hkv, D = cache.shape[2], cache.shape[3]
    return cache[table.long()].reshape(B, L, Hkv, D).transpose(1, 2).contiguous()


def kernel_split(step, steps: int = 30) -> str:
    """Each kernel's GPU µs per call of `step` (torch.profiler), as "name µs, ...": how a call's time
    divides between the attention kernel and the fold of its pieces (SDPA: cuDNN's kernel and its
    reduction)."""
    return ", ".join(f"{name[:28]} {us:.1f}" for name, us in kernel_times(step, steps)[1].items())


def graph_ms(fn, kernels=False):
    """do_bench of `fn` captured in a CUDA graph and replayed: the kernels alone, as an engine that
    captures its decode steps runs them (no Python, no launch gaps). kernels: also the GPU time of
    the graph's kernels per replay (µs, torch.profiler over 30 replays), without the gaps."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = do_bench(graph.replay, warmup=10, rep=50)
    if not kernels:
        return ms
    return ms, 1e3 * _kernel_ms(graph.replay, steps=30)


def _set_variant(module, tile, split_keys, defaults, pieces=None):
    # (a tile of five numbers: the fifth is its register budget, PAGED_MAXNREG)
    module.PAGED_TILES = defaults["tiles"] if tile is None else [(0, tuple(tile[:4]))]
    module.PAGED_MAXNREG = ({tuple(tile[:4]): tile[4]} if tile is not None and len(tile) == 5
                            else dict(defaults.get("maxnreg", {})))
    module.FAST_SPLIT_KEYS = defaults["split"] if split_keys is None else split_keys
    module.PAGED_STAGES = None
    module.PAGED_BALANCE = defaults["balance"] if pieces is None else pieces != "fixed"  # ("auto": balanced)
    module.PAGED_PIECES = pieces if isinstance(pieces, int) else None


def _label(tile, split_keys, invariant, module, pieces=None):
    if invariant:
        m, n, w = module.INVARIANT_TILE
        return f"invariant {m}x{n} w{w} s{module.INVARIANT_PAGED_STAGES}, pieces {module.SPLIT_KEYS}"
    t = "file's tiles" if tile is None else "{}x{} w{} s{}".format(*tile) + (f" @{tile[4]} registers" if len(tile) == 5
                                                                             else "")
    if module.PAGED_BALANCE:
        if pieces in (None, "auto"):
            return f"fast {t}, the file's cut (even pieces where fixed ones leave slots idle)"
        return f"fast {t}, {pieces} even pieces"
    return f"fast {t}, pieces of {split_keys or module.FAST_SPLIT_KEYS or module.SPLIT_KEYS} keys"


def _pieces_of(module, q, kc, table):
    """The pieces per request this decode call's keys are cut into (1: none), as the file plans it."""
    (B, Hq, D), (page, Hkv) = q.shape, kc.shape[1:3]
    return module._paged_shape(B, B, Hq, Hkv, D, table.shape[1] * page, q.element_size(), q.device, False)[7]


def _flash_us(fn, want) -> float | str:
    """The GPU µs per call of `fn` under SDPA's FLASH_ATTENTION backend alone (FlashAttention-2;
    SDPA's default on Hopper is cuDNN's kernel), replayed from a CUDA graph, after checking its
    output against `want`; a string saying why where that backend refuses the call or differs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def forced():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return fn()
    try:
        diff = float((forced().reshape(want.shape).float() - want).abs().max())
        if not diff < 2e-2:
            return f"differs ({diff:.1e})"
        return graph_ms(forced, kernels=True)[1]
    except RuntimeError as exc:  # (the backend refuses these shapes on this build)
        return f"cannot run ({str(exc).splitlines()[0][:60]})"


def _us(value) -> str:
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def _ratio(us: float, other) -> str:
    return f"{us / other:.3f}x" if isinstance(other, float) else "-"


def _sdpa_kernels(fn) -> str:
    """The names of the kernels one call of fn runs (torch.profiler), shortened: which SDPA backend ran,
    and whether it copied its inputs first."""
    return ", ".join(sorted(kernel_times(fn, steps=1)[1]))


def decode(module, variants, pages, defaults, pdl=(None,), layouts=("nhd",)):
    peak = peak_tbs()
    print("\n### Decode (Lq = 1), bf16, 32 query / 8 kv heads, D 128, shuffled pages\n")
    print("Each call timed twice: as Python calls it (do_bench; host work included) and replayed from a CUDA graph "
          "(the kernels alone, as an engine that captures decode runs them). TB/s: the K and V bytes over the time"
          + (f" (share of this GPU's {peak} TB/s)" if peak else "") + ". SDPA reads the same keys gathered into "
          "[B, Hkv, L, D], contiguous; \"SDPA, cache order\": the same keys as [B, L, Hkv, D] (the order of a "
          "vLLM cache whose pages are in order) passed as a [B, Hkv, L, D] view.\n")
    print("| case | page | cache | variant | pieces | attention_paged ms | TB/s | SDPA ms | TB/s | paged / SDPA | "
          "graphs: paged ms | SDPA ms | paged / SDPA | kernels: paged µs | SDPA µs | paged / SDPA | "
          "SDPA's FLASH_ATTENTION (FA2) µs | paged / FA2 | "
          "SDPA, cache order µs | max abs diff vs SDPA |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
          "---|---|---|---|")
    notes = []
    for B, L in DECODE_CASES:
        for page in pages:
            for layout in layouts:
                q, kc, vc, table, cu, lens = decode_case(B, L, page, layout=layout)
                Hq, Hkv, D = q.shape[1], kc.shape[2], q.shape[2]
                kv_bytes = 2 * B * L * Hkv * D * 2
                k, v = _contiguous(kc, table, B, L, page), _contiguous(vc, table, B, L, page)
                # (the cache's own order: [B, L, Hkv, D] contiguous, seen as [B, Hkv, L, D])
                k_nhd, v_nhd = k.transpose(1, 2).contiguous().transpose(1, 2), v.transpose(1, 2).contiguous().transpose(1, 2)
                with torch.no_grad():
                    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                        q.view(B, Hq, 1, D), k, v, enable_gqa=True)
                    sdpa_nhd = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                        q.view(B, Hq, 1, D), k_nhd, v_nhd, enable_gqa=True)
                    want = sdpa().view(B, Hq, D).float()
                    sd = do_bench(sdpa, warmup=10, rep=50)
                    sd_graph, sd_us = graph_ms(sdpa, kernels=True)
                    fa2_us = _flash_us(lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731,B023
                        q.view(B, Hq, 1, D), k, v, enable_gqa=True), want)
                    nhd_us = 1e3 * _kernel_ms(sdpa_nhd, steps=30)
                    nhd_diff = float((sdpa_nhd().view(B, Hq, D).float() - want).abs().max())
                    if layout == layouts[0] and page == pages[0]:
                        notes.append(f"B {B}, {L:,}: SDPA ran {_sdpa_kernels(sdpa)}; in the cache's order "
                                     f"{_sdpa_kernels(sdpa_nhd)} (max abs diff {nhd_diff:.1e})")
                    if layout == layouts[0]:
                        notes.append(f"B {B}, {L:,}, page {page}: SDPA's kernels (µs per call): {kernel_split(sdpa)}")
                    for (tile, keys, invariant, *pieces), dependent in [(v, d) for v in variants for d in pdl]:
                        pieces = pieces[0] if pieces else None
                        _set_variant(module, tile, keys, defaults, pieces)
                        module.PAGED_PDL = defaults["pdl"] if dependent is None else dependent
                        label = _label(tile, keys, invariant, module, pieces)
                        if dependent is not None:
                            label += ", fold as a dependent launch (PDL)" if dependent else ", fold after the kernel"
                        n = "-" if invariant else _pieces_of(module, q, kc, table)
                        call = lambda: module.attention_paged(q, kc, vc, table, cu, lens, invariant=invariant)  # noqa: E731,B023
                        try:
                            diff = float((call().float() - want).abs().max())
                            ms = do_bench(call, warmup=10, rep=50)
                            ms_graph, us = graph_ms(call, kernels=True)
                        except Exception as exc:  # a variant that does not compile is a row, not a stop
                            print(f"| B {B}, {L:,} | {page} | {layout} | {label} | {n} | failed: {type(exc).__name__}: "
                                  f"{str(exc)[:120]} |", flush=True)
                            continue
                        if layout == layouts[0]:
                            notes.append(f"B {B}, {L:,}, page {page}, {label}: kernels (µs per call): "
                                         f"{kernel_split(call)}")
                        tbs, sd_tbs = kv_bytes / ms / 1e9, kv_bytes / sd / 1e9
                        wrong = "" if diff < 2e-2 else " **WRONG**"
                        g_tbs = kv_bytes / ms_graph / 1e9
                        print(f"| B {B}, {L:,} | {page} | {layout} | {label} | {n} | {ms:.3f} | {_share(tbs, peak)} | "
                              f"{sd:.3f} | {_share(sd_tbs, peak)} | {ms / sd:.2f}x | {ms_graph:.3f} "
                              f"({_share(g_tbs, peak)}) | {sd_graph:.3f} | {ms_graph / sd_graph:.3f}x | {us:.1f} | "
                              f"{sd_us:.1f} | {us / sd_us:.3f}x | {_us(fa2_us)} | {_ratio(us, fa2_us)} | {nhd_us:.1f} | "
                              f"{diff:.1e}{wrong} |", flush=True)
                q = kc = vc = k = v = k_nhd = v_nhd = table = None  # free the cache before the next case
                torch.cuda.empty_cache()
    for line in notes:
        print(f"- {line}")


def prefill(module, variants, lengths, pages, defaults):
    print("\n### Paged prefill, one request, bf16, 32 query / 8 kv heads, D 128, shuffled pages\n")
    print("| tokens | page | variant | attention_paged ms | contiguous attention ms (its tiles) | paged / contiguous | "
          "max abs diff |\n|---|---|---|---|---|---|---|")
    for L in lengths:
        for page in pages:
            q, kc, vc, table, _, lens = decode_case(1, L, page)
            g = torch.Generator(device="cuda").manual_seed(1)
            q = torch.randn(L, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
            cu = torch.tensor([0, L], device="cuda", dtype=torch.int32)
            k, v = _contiguous(kc, table, 1, L, page), _contiguous(vc, table, 1, L, page)
            qc = q.transpose(0, 1)[None].contiguous()
            with torch.no_grad():
                want = module.attention(qc, k, v)
                contiguous_ms = do_bench(lambda: module.attention(qc, k, v), warmup=25, rep=100)
                config = getattr(module._attention_kernel, "best_config", None)
                tiles = "?" if config is None else (f"{config.kwargs['BLOCK_M']}x{config.kwargs['BLOCK_N']} "
                                                    f"w{config.num_warps} s{config.num_stages}")
                if module._hopper_ready(qc, k, v, None, False, 128 ** -0.5):
                    tiles = f"Hopper, {module._hopper_paged_loop()}"
                want = want[0].transpose(0, 1).float()
                for tile, invariant, hopper in variants:
                    _set_variant(module, tile, None, defaults)
                    module.HOPPER_PAGED = hopper
                    label = _label(tile, None, invariant, module)
                    call = lambda: module.attention_paged(q, kc, vc, table, cu, lens, invariant=invariant)  # noqa: E731
                    try:
                        diff = float((call().float() - want).abs().max())
                        # (judged after the call: a Hopper kernel that failed is off by now)
                        if not invariant and module._hopper_paged_ready(q, kc, vc, L, 128 ** -0.5):
                            label = f"fast, Hopper ({module._hopper_loop()})"
                        ms = do_bench(call, warmup=25, rep=100)
                    except Exception as exc:
                        print(f"| {L:,} | {page} | {label} | failed: {type(exc).__name__}: {str(exc)[:120]} |",
                              flush=True)
                        continue
                    wrong = "" if diff < 2e-2 else " **WRONG**"
                    print(f"| {L:,} | {page} | {label} | {ms:.3f} | {contiguous_ms:.3f} ({tiles}) | "
                          f"{ms / contiguous_ms:.2f}x | {diff:.1e}{wrong} |", flush=True)
            q = qc = kc = vc = k = v = table = want = None
            torch.cuda.empty_cache()


def _cut(text: str):
    """One --pieces value: 'auto', 'fixed' or a whole number of pieces >= 1."""
    if text in ("auto", "fixed"):
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a cut: give 'auto', 'fixed' or a number of pieces >= 1")
    return int(text)


def _tile(text: str) -> tuple:
    """One --tiles value: BLOCK_M x BLOCK_N x warps x stages, e.g. 16x64x4x3, and optionally @ a
    register budget a thread (PAGED_MAXNREG), e.g. 16x64x4x2@168."""
    shape, at, regs = text.lower().partition("@")
    parts = shape.split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts) or (
            at and not (regs.isdigit() and 24 <= int(regs) <= 255)):
        raise argparse.ArgumentTypeError(f"{text!r} is not a tile: give BLOCK_M x BLOCK_N x warps x stages, e.g. "
                                         "16x64x4x3, optionally @ registers a thread (24-255), e.g. 16x64x4x2@168")
    return tuple(int(p) for p in parts) + ((int(regs),) if regs else ())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true", help="tiles x piece sizes (decode) and tiles (prefill)")
    ap.add_argument("--pages", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--prefill", type=int, nargs="*", default=None,
                    help="prefill lengths (default 8192 32768); give none to skip prefill")
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--pieces", nargs="+", type=_cut, default=None, metavar="N",
                    help="decode rows for these cuts of fast mode's split-KV: 'auto' (even pieces, as "
                         "many as fill the GPU), 'fixed' (pieces of FAST_SPLIT_KEYS keys at fixed positions) or a "
                         "number of even pieces per request")
    ap.add_argument("--pdl", nargs="+", choices=["on", "off"], default=None,
                    help="decode rows with the fold launched as a programmatic dependent of the kernel (on) and "
                         "after it (off), side by side (PAGED_PDL; default: the file's setting)")
    ap.add_argument("--tiles", nargs="+", type=_tile, default=None, metavar="MxNxWxS",
                    help="decode rows for these fast-mode tiles (BLOCK_M x BLOCK_N x warps x stages), e.g. 16x64x4x3, "
                         "optionally @ a register budget a thread (PAGED_MAXNREG), e.g. 16x64x4x2@168")
    ap.add_argument("--layouts", nargs="+", choices=["nhd", "hnd"], default=["nhd"],
                    help="decode rows over caches allocated [pages, page, Hkv, D] (nhd, vLLM's) and [pages, Hkv, "
                         "page, D] (hnd, passed as a [pages, page, Hkv, D] view), side by side")
    ap.add_argument("--once", type=int, nargs=3, metavar=("B", "L", "PAGE"),
                    help="only three calls of the file's default decode at this shape (for a profiler)")
    a = ap.parse_args(argv)
    module = port.load(port.build(make("causal"), 256, 256, out_dir=tempfile.mkdtemp()))
    defaults = {"tiles": list(module.PAGED_TILES), "split": module.FAST_SPLIT_KEYS, "balance": module.PAGED_BALANCE,
                "pdl": module.PAGED_PDL, "maxnreg": dict(module.PAGED_MAXNREG)}
    if a.once:
        args = decode_case(*a.once)
        with torch.no_grad():
            for _ in range(3):
                module.attention_paged(*args)
        torch.cuda.synchronize()
        return
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; the causal port; do_bench medians")
    if not a.no_decode:
        variants = SWEEP_DECODE if a.sweep else DEFAULT_DECODE
        if a.pieces:
            variants = [(None, None, False, p) for p in a.pieces]
        if a.tiles:
            variants = [(t, None, False) for t in a.tiles]
        decode(module, variants, a.pages, defaults, pdl=[p == "on" for p in a.pdl] if a.pdl else (None,),
               layouts=a.layouts)
    lengths = [8192, 32768] if a.prefill is None else a.prefill
    if lengths:
        prefill(module, SWEEP_PREFILL if a.sweep else DEFAULT_PREFILL, lengths, a.pages, defaults)


if __name__ == "__main__":
    main()
