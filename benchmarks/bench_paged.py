"""The port's serving entry point (attention_paged) at decode against SDPA's flash kernel: one
request against 131,072 keys and 8 requests against 32,768 (bf16, 32 query / 8 kv heads, D 128,
page sizes 16 and 128), triton.testing.do_bench medians, with the share of the H200's memory
bandwidth each reaches. Each row is one variant of the loaded file's knobs: the key loop
(`PAGED_PIPELINE`: a pipelined `for` loop or a `while` loop), its pipeline depth
(`PAGED_STAGES`), the split-KV piece size (`SPLIT_KEYS`) and the mode (fast or invariant).

    python benchmarks/bench_paged.py            # the default variants
    python benchmarks/bench_paged.py --sweep    # every loop x stages x piece size
"""

import argparse
import itertools
import sys
import tempfile
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench import make, port  # noqa: E402

PEAK_TBS = 4.8  # the H200's HBM bandwidth, TB/s
DEFAULT_VARIANTS = [  # (pipeline, stages, split_keys, invariant)
    (False, 1, 4096, False), (True, 3, 4096, False), (True, 3, 4096, True)]


def sweep_variants():
    fast = [(True, s, k, False) for s, k in itertools.product((2, 3, 4), (1024, 2048, 4096))]
    return [(False, 1, 4096, False)] + fast + [(True, 3, 4096, True), (True, 3, 2048, True)]


def decode_case(B, L, page, Hq=32, Hkv=8, D=128):
    n_pages = B * L // page
    kc = torch.randn(n_pages, page, Hkv, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.arange(n_pages, device="cuda", dtype=torch.int32).view(B, L // page)
    q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(B + 1, device="cuda", dtype=torch.int32)
    lens = torch.full((B,), L, device="cuda", dtype=torch.int32)
    return q, kc, vc, table, cu, lens


def main(variants=None, pages=(16, 128), masks=("causal",)):
    variants = variants or DEFAULT_VARIANTS
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; K and V bytes / time, and the share of "
          f"{PEAK_TBS} TB/s\n")
    print("| mask | case | page | loop | stages | SPLIT_KEYS | mode | attention_paged ms | TB/s (share) | "
          "SDPA flash ms | TB/s (share) | paged / SDPA |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in masks:
        mask = make(name) if name == "causal" else make("causal_sliding_window", {"window": 4096})
        module = port.load(port.build(mask, 256, 256, out_dir=tempfile.mkdtemp()))
        for B, L in ((1, 131072), (8, 32768)):
            for page in pages:
                q, kc, vc, table, cu, lens = decode_case(B, L, page)
                Hq, Hkv, D = q.shape[1], kc.shape[2], q.shape[2]
                kv_bytes = 2 * B * L * Hkv * D * 2
                with torch.no_grad():
                    k, v = kc.view(B, L, Hkv, D).transpose(1, 2), vc.view(B, L, Hkv, D).transpose(1, 2)
                    sd = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
                        q.view(B, Hq, 1, D), k, v, enable_gqa=True), warmup=10, rep=50)
                    for pipeline, stages, keys, invariant in variants:
                        module.PAGED_PIPELINE, module.PAGED_STAGES, module.SPLIT_KEYS = pipeline, stages, keys
                        try:
                            module.attention_paged(q, kc, vc, table, cu, lens, invariant=invariant)
                            ms = do_bench(lambda: module.attention_paged(q, kc, vc, table, cu, lens,
                                                                         invariant=invariant), warmup=10, rep=50)
                        except Exception as exc:  # a variant that does not compile is a row, not a stop
                            print(f"| {name} | B {B}, {L:,} | {page} | {'for' if pipeline else 'while'} | {stages} | "
                                  f"{keys} | {'invariant' if invariant else 'fast'} | failed: "
                                  f"{type(exc).__name__}: {str(exc)[:120]} |", flush=True)
                            continue
                        tbs = kv_bytes / ms / 1e9
                        print(f"| {name} | B {B}, {L:,} | {page} | {'for' if pipeline else 'while'} | {stages} | {keys} "
                              f"| {'invariant' if invariant else 'fast'} | {ms:.3f} | {tbs:.2f} ({tbs / PEAK_TBS:.0%}) "
                              f"| {sd:.3f} | {kv_bytes / sd / 1e9:.2f} ({kv_bytes / sd / 1e9 / PEAK_TBS:.0%}) | "
                              f"{ms / sd:.2f}x |", flush=True)
                q = kc = vc = k = v = None  # free the cache before the next case
                torch.cuda.empty_cache()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="every loop x stages x piece size")
    ap.add_argument("--window", action="store_true", help="also a causal sliding window of 4,096")
    a = ap.parse_args()
    main(sweep_variants() if a.sweep else None, masks=("causal", "window") if a.window else ("causal",))
