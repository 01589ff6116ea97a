"""GPU behaviour. Run on a CUDA machine: `pytest -m gpu`."""

import pytest
import torch

from helpers import FIELDS
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from workbench import library, make
from workbench.blocks import build_block_mask, scan_blocks

pytestmark = pytest.mark.gpu


def _same(a, b):
    for f in FIELDS:
        assert torch.equal(getattr(a, f), getattr(b, f)), f


@pytest.mark.parametrize("name", [n for n, f in library().items() if make(f).mask_mod is not None])
@pytest.mark.parametrize("q_len,kv_len,heads,block", [(1000, 1000, 2, 128), (777, 2049, 8, (64, 128))])
@pytest.mark.parametrize("engine", ["eager", "triton"])
def test_equals_create_block_mask_on_cuda(cuda, name, q_len, kv_len, heads, block, engine):
    mask = make(name, q_len=q_len, kv_len=kv_len, device=cuda)
    heads = min(heads, mask.heads or heads)
    ours = build_block_mask(mask, q_len, kv_len, heads=heads, block_size=block, device=cuda, engine=engine)
    _same(ours, create_block_mask(mask.mask_mod, None, heads, q_len, kv_len, device=cuda, BLOCK_SIZE=block))


def test_triton_scan_equals_eager_on_the_library_on_cuda(cuda):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("run_triton_scan.py")
    out = subprocess.run([sys.executable, str(script), "cuda"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and "ALL EQUAL" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.mark.parametrize("name,heads", [("document", None), ("per_head_window", 8), ("causal_sliding_window", None)])
def test_long_masks_pick_the_triton_scan_and_equal_torch_compiled(cuda, name, heads):
    n = 100000  # not a multiple of 128
    mask = make(name, q_len=n, kv_len=n, device=cuda)
    scan_blocks(mask, n, n, heads=heads, device=cuda)  # first ask: eager below 2^35 pairs
    scan = scan_blocks(mask, n, n, heads=heads, device=cuda)  # asked again: worth compiling
    assert scan.engine == "triton", scan.extra
    ours = build_block_mask(mask, n, n, heads=heads, device=cuda)
    _same(ours, torch.compile(create_block_mask)(mask.mask_mod, None, heads, n, n, device=cuda))


def test_forward_only_block_mask_at_1m_within_1_gib(cuda):
    n = 1 << 20
    mask = make("causal_sliding_window", {"window": 4096}, q_len=n, kv_len=n, device=cuda)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    bm = build_block_mask(mask, n, n, device=cuda, compute_q_blocks=False)
    peak = torch.cuda.max_memory_allocated() - base
    assert peak <= 1 << 30, peak / 2 ** 30
    assert bm.q_indices is None
    rows = torch.arange(8192, device=cuda)
    partial = bm.kv_num_blocks[0, 0]
    full = bm.full_kv_num_blocks[0, 0]
    assert torch.equal(partial, torch.where(rows < 32, 1, 2).to(torch.int32))  # diagonal + window edge
    assert torch.equal(full, torch.clamp(rows, max=31).to(torch.int32))


def test_128k_causal_exact(cuda):
    n = 131072
    scan = scan_blocks(make("causal"), n, n, device=cuda)
    assert scan.kept_pairs == n * (n + 1) // 2
    assert scan.full_blocks == 1024 * 1023 // 2 and scan.partial_blocks == 1024


def test_flex_attention_accepts_our_block_mask(cuda):
    n, H, D = 1536, 4, 64
    mask = make("document", q_len=n, kv_len=n, device=cuda)
    ours = build_block_mask(mask, n, n, device=cuda)
    q, k, v = (torch.randn(1, H, n, D, device=cuda) for _ in range(3))
    out = torch.compile(flex_attention)(q, k, v, block_mask=ours)
    dense = torch.zeros(n, n, dtype=torch.bool, device=cuda)
    ids = mask.data["document_id"]
    dense = (ids[:, None] == ids[None, :]) & torch.ones(n, n, dtype=torch.bool, device=cuda).tril()
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=dense)
    assert not torch.isnan(out).any()
    assert (out.double() - ref).abs().max() < 2e-3


def test_app_never_waits_for_a_scan_compile(cuda):
    """A new mod in the app: the first redraw scans without the fused kernel while it compiles
    on the side; once compiled, redraws use it, and every redraw's counts equal eager tiles'."""
    import contextlib
    import io

    from workbench import Mask, kernels
    from workbench.app import Workbench

    salt = torch.randint(1, 10**6, ()).item()  # a mod this process (and Triton's cache) never saw

    def striped(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & ((q_idx + kv_idx + salt) % 5 != 0)

    n = 32768
    with contextlib.redirect_stdout(io.StringIO()):
        app = Workbench(Mask("striped", mask_mod=striped), q_len=n, device=cuda)
    started = kernels.background_compiles()
    assert app.scan.engine != "triton" and started, "the compile should run on the side"
    for future in started:
        future.result(timeout=120)
    with contextlib.redirect_stdout(io.StringIO()):
        app.q_len.value = n - 1
    assert app.scan.engine == "triton", app.scan.engine
    eager = scan_blocks(striped, n - 1, n, device=cuda, engine="eager")
    assert torch.equal(app.scan.counts, eager.counts) and torch.equal(app.scan.row_kept, eager.row_kept)
    assert app.last_redraw_seconds < 0.25, app.timings
