"""The port's serving entry point (attention_paged) at decode against SDPA's flash kernel: one
request against 131,072 keys and 8 requests against 32,768 (bf16, 32 query / 8 kv heads, D 128,
page size 16), triton.testing.do_bench medians. A first measurement of #30's fast mode; the
benchmark the issue asks for (mixed steps, invariant mode, page sizes) grows from here.

    python benchmarks/bench_paged.py
"""

import sys
import tempfile
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench import make, port  # noqa: E402


def main():
    module = port.load(port.build(make("causal"), 256, 256, out_dir=tempfile.mkdtemp()))
    print("| case | attention_paged ms | TB/s | SDPA ms | TB/s |\n|---|---|---|---|---|")
    for B, L in ((1, 131072), (8, 32768)):
        Hq, Hkv, D, page = 32, 8, 128, 16
        pages = B * L // page
        kc = torch.randn(pages, page, Hkv, D, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        table = torch.arange(pages, device="cuda", dtype=torch.int32).view(B, L // page)
        q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
        cu = torch.arange(B + 1, device="cuda", dtype=torch.int32)
        lens = torch.full((B,), L, device="cuda", dtype=torch.int32)
        with torch.no_grad():
            module.attention_paged(q, kc, vc, table, cu, lens)
            ms = do_bench(lambda: module.attention_paged(q, kc, vc, table, cu, lens), warmup=10, rep=50)
            k, v = kc.view(B, L, Hkv, D).transpose(1, 2), vc.view(B, L, Hkv, D).transpose(1, 2)
            sd = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q.view(B, Hq, 1, D), k, v,
                                                                                  enable_gqa=True), warmup=10, rep=50)
        kv_bytes = 2 * B * L * Hkv * D * 2
        print(f"| B {B}, {L:,} keys | {ms:.3f} | {kv_bytes / ms / 1e9:.2f} | {sd:.3f} | {kv_bytes / sd / 1e9:.2f} |")


if __name__ == "__main__":
    main()
