"""The port's serving entry point (attention_paged) at decode against SDPA's flash kernel: one
request against 131,072 keys and 8 requests against 32,768 (bf16, 32 query / 8 kv heads, D 128,
page sizes 16 and 128, split-KV pieces of 1,024 / 2,048 / 4,096 keys), triton.testing.do_bench
medians, with the share of the H200's memory bandwidth each reaches. The mixed-step, paged-prefill
and invariant-mode rows the serving benchmark needs grow from here.

    python benchmarks/bench_paged.py
"""

import sys
import tempfile
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench import make, port  # noqa: E402


PEAK_TBS = 4.8  # the H200's HBM bandwidth, TB/s


def main(split_keys=(1024, 2048, 4096), pages=(16, 128)):
    module = port.load(port.build(make("causal"), 256, 256, out_dir=tempfile.mkdtemp()))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; K and V bytes / time, and the share of "
          f"{PEAK_TBS} TB/s\n")
    print("| case | page | SPLIT_KEYS | attention_paged ms | TB/s (share) | SDPA flash ms | TB/s (share) |\n"
          "|---|---|---|---|---|---|---|")
    for B, L in ((1, 131072), (8, 32768)):
        Hq, Hkv, D = 32, 8, 128
        for page in pages:
            n_pages = B * L // page
            kc = torch.randn(n_pages, page, Hkv, D, device="cuda", dtype=torch.bfloat16)
            vc = torch.randn_like(kc)
            table = torch.arange(n_pages, device="cuda", dtype=torch.int32).view(B, L // page)
            q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
            cu = torch.arange(B + 1, device="cuda", dtype=torch.int32)
            lens = torch.full((B,), L, device="cuda", dtype=torch.int32)
            kv_bytes = 2 * B * L * Hkv * D * 2
            with torch.no_grad():
                k, v = kc.view(B, L, Hkv, D).transpose(1, 2), vc.view(B, L, Hkv, D).transpose(1, 2)
                sd = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
                    q.view(B, Hq, 1, D), k, v, enable_gqa=True), warmup=10, rep=50)
                for keys in split_keys:
                    module.SPLIT_KEYS = keys
                    module.attention_paged(q, kc, vc, table, cu, lens)
                    ms = do_bench(lambda: module.attention_paged(q, kc, vc, table, cu, lens), warmup=10, rep=50)
                    print(f"| B {B}, {L:,} keys | {page} | {keys} | {ms:.3f} | {kv_bytes / ms / 1e9:.2f} "
                          f"({kv_bytes / ms / 1e9 / PEAK_TBS:.0%}) | {sd:.3f} | {kv_bytes / sd / 1e9:.2f} "
                          f"({kv_bytes / sd / 1e9 / PEAK_TBS:.0%}) |", flush=True)


if __name__ == "__main__":
    main()
