import time, torch, sys
sys.path.insert(0, ".")
from workbench import make, kernels
from workbench.blocks import scan_blocks, build_block_mask
dev = "cuda"
def t(fn):
    torch.cuda.synchronize(); t0 = time.perf_counter(); out = fn(); torch.cuda.synchronize(); return out, time.perf_counter() - t0
scan_blocks(make("causal_sliding_window", {"window": 7}, device=dev), 20000, 20000, device=dev, engine="triton")
n, N = 131072, 1 << 20
ph = make("per_head_window", q_len=n, kv_len=n, device=dev)
c = make("causal", device=dev)
for tile in [8192, 4096, 2048]:
    kernels.TILE_ELEMENTS = tile
    kernels.forget()
    _, cold = t(lambda: build_block_mask(ph, n, n, heads=8, device=dev, engine="triton"))
    _, warm = t(lambda: scan_blocks(ph, n, n, heads=8, device=dev, engine="triton", differences=False))
    kernels.forget()
    _, ccold = t(lambda: scan_blocks(c, N, N, device=dev, engine="triton", differences=False))
    _, cwarm = t(lambda: scan_blocks(c, N, N, device=dev, engine="triton", differences=False))
    print(f"tile {tile}: per-head 128K build cold {cold:.3f} scan warm {warm:.3f}; causal 1M scan cold {ccold:.3f} warm {cwarm:.3f}", flush=True)
