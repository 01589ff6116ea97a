"""The builder against torch's create_block_mask (every tensor), and statistics against brute force."""

import numpy as np
import pytest
import torch

from helpers import FIELDS
from torch.nn.attention.flex_attention import create_block_mask

from workbench import WorkbenchError, library, make
from workbench.analyze import mask_stats
from workbench.define import index_reads
from workbench.blocks import build_block_mask, dense_mask, scan_blocks



def assert_same_block_mask(ours, ref):
    for name in FIELDS:
        a, b = getattr(ours, name), getattr(ref, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert tuple(ours.seq_lengths) == tuple(ref.seq_lengths)
    assert tuple(ours.BLOCK_SIZE) == tuple(ref.BLOCK_SIZE)


def library_masks():
    return [n for n, f in library().items() if make(f).mask_mod is not None]


@pytest.mark.parametrize("name", library_masks())
@pytest.mark.parametrize("q_len,kv_len,heads,batch,block", [
    (256, 256, None, None, 128), (300, 300, 3, 2, 64), (200, 333, 8, None, (32, 64)), (129, 129, 2, None, 16),
])
def test_equals_create_block_mask(name, q_len, kv_len, heads, batch, block, device="cpu"):
    mask = make(name, q_len=q_len, kv_len=kv_len, device=device)
    if mask.heads is not None and heads is not None:
        heads = min(heads, mask.heads)
    if heads is None and "h" in index_reads(mask.mask_mod):
        # broadcasting a per-head mask would give every head head 0's blocks: refused, with the fix
        with pytest.raises(WorkbenchError, match=r"reads `h`.*Fix: pass heads=N"):
            build_block_mask(mask, q_len, kv_len, heads=heads, batch=batch, block_size=block, device=device)
        heads = mask.heads
    ours = build_block_mask(mask, q_len, kv_len, heads=heads, batch=batch, block_size=block, device=device)
    ref = create_block_mask(mask.mask_mod, batch, heads, q_len, kv_len, device=device, BLOCK_SIZE=block)
    assert_same_block_mask(ours, ref)


def test_tiny_memory_budget_forces_many_tiles_and_stays_exact():
    mask = make("document", q_len=1000, kv_len=1000)
    scan = scan_blocks(mask, 1000, 1000, block_size=64, memory_budget=1)
    assert scan.extra["tiles"] > 50
    ours = build_block_mask(mask, 1000, 1000, block_size=64, memory_budget=1)
    assert_same_block_mask(ours, create_block_mask(mask.mask_mod, None, None, 1000, 1000, device="cpu", BLOCK_SIZE=64))


def test_mask_depending_on_batch_and_head():
    offsets = torch.tensor([0, 7, 30])

    def shifted_causal(b, h, q_idx, kv_idx):
        return q_idx + offsets[b] + h >= kv_idx

    ours = build_block_mask(shifted_causal, 150, 150, heads=4, batch=3, block_size=32)
    assert_same_block_mask(ours, create_block_mask(shifted_causal, 3, 4, 150, 150, device="cpu", BLOCK_SIZE=32))
    scan = scan_blocks(shifted_causal, 150, 150, heads=4, batch=3, block_size=32)
    assert scan.depends_on_batch and scan.depends_on_head


def test_mod_that_does_not_broadcast_falls_back_to_vmap():
    def stacked(b, h, q_idx, kv_idx):  # torch.stack over scalars: fine under vmap, wrong when broadcast
        pair = torch.stack([q_idx, kv_idx])
        return pair[0] >= pair[1]

    scan = scan_blocks(stacked, 100, 100, block_size=32)
    assert scan.evaluator == "vmap"
    ours = build_block_mask(stacked, 100, 100, block_size=32)
    assert_same_block_mask(ours, create_block_mask(stacked, None, None, 100, 100, device="cpu", BLOCK_SIZE=32))


def test_stats_against_brute_force():
    q_len, kv_len, heads = 270, 300, 3
    mask = make("per_head_window", {"windows": [5, 40, 400]}, q_len=q_len, kv_len=kv_len)
    dense = dense_mask(mask, (0, q_len), (0, kv_len), heads=heads)[0].numpy()  # [H, Lq, Lk]
    stats = mask_stats(scan_blocks(mask, q_len, kv_len, heads=heads, block_size=(64, 32)))
    assert stats.kept_pairs == dense.sum()
    assert stats.density == pytest.approx(dense.sum() / dense.size)
    rows, cols = -(-q_len // 64), -(-kv_len // 32)
    padded = np.zeros((heads, rows * 64, cols * 32), bool)
    padded[:, :q_len, :kv_len] = dense
    blocks = padded.reshape(heads, rows, 64, cols, 32).sum(axis=(2, 4))
    assert stats.full_blocks == (blocks == 64 * 32).sum()
    assert stats.empty_blocks == (blocks == 0).sum()
    assert stats.partial_blocks == ((blocks > 0) & (blocks < 64 * 32)).sum()
    assert stats.kernel_flops == 4 * 128 * (stats.full_blocks + stats.partial_blocks) * 64 * 32
    assert stats.partial_waste == pytest.approx(1 - dense.sum() / ((stats.full_blocks + stats.partial_blocks) * 64 * 32))
    assert stats.fully_masked_rows == 0
    assert stats.differs_across_heads
    assert stats.head_pairs_differing == [int((dense[h] != dense[0]).sum()) for h in range(heads)]


def test_fully_masked_rows_are_found():
    def every_third_row_blind(b, h, q_idx, kv_idx):
        return (q_idx % 3 != 0) & (kv_idx <= q_idx)

    stats = mask_stats(scan_blocks(every_third_row_blind, 100, 100, block_size=32))
    assert stats.fully_masked_rows == 34
    assert [r[2] for r in stats.fully_masked_row_examples[:3]] == [0, 3, 6]


def test_batch_broadcast_stats_count_every_entry():
    mask = make("causal")
    one = mask_stats(scan_blocks(mask, 128, 128, block_size=32))
    many = mask_stats(scan_blocks(mask, 128, 128, heads=4, batch=2, block_size=32))
    assert many.kept_pairs == 8 * one.kept_pairs and many.full_blocks == 8 * one.full_blocks
    assert not many.differs_across_heads


@pytest.mark.parametrize("bad,cause", [
    (dict(block_size=0), "block size"), (dict(block_size=(128, -1)), "kv block"),
    (dict(q_len=0), "q_len"), (dict(heads=-2), "heads"),
])
def test_bad_sizes_are_named(bad, cause):
    kwargs = dict(q_len=128, kv_len=128)
    kwargs.update(bad)
    with pytest.raises(WorkbenchError, match=cause):
        scan_blocks(make("causal"), **kwargs)


def test_table_that_cannot_fit_fails_before_allocating():
    with pytest.raises(WorkbenchError, match="would not fit") as err:
        scan_blocks(make("causal"), 2 ** 40, 2 ** 40, block_size=16)
    assert "block-size" in str(err.value)


def test_stats_only_mode_at_length_on_cpu():
    # 32,845 x 32,845 (an odd length, 1.08e9 pairs) without keeping the counts
    n = (1 << 15) + 77
    mask = make("causal_sliding_window", {"window": 1024})
    scan = scan_blocks(mask, n, n, keep_counts=False)
    assert scan.counts is None
    assert scan.kept_pairs == sum(min(i + 1, 1024) for i in range(n))


def test_wrong_lengths_for_a_bound_mask():
    mask = make("document", q_len=200, kv_len=200)
    with pytest.raises(WorkbenchError, match="built for q_len=200"):
        scan_blocks(mask, 300, 300)


def test_too_many_heads_for_a_per_head_mask():
    mask = make("per_head_window", {"windows": [4, 8]})
    with pytest.raises(WorkbenchError, match="defined for 2 heads"):
        scan_blocks(mask, 64, 64, heads=3)


@pytest.mark.parametrize("name,heads", [("document", None), ("per_head_window", 8), ("image_spans", None)])
def test_compiled_tiles_equal_eager(device, name, heads):
    """The compiled tile path equals the eager tiles: clamped and masked edges (lengths that are
    not a multiple of the tile or block). On the CPU one case (~25 s of compiles), at 1,500 tokens;
    on a GPU all three at 20,000."""
    if device == "cpu" and name != "document":
        pytest.skip("one compiled case on the CPU")
    n, budget, block = (1500, 1 << 20, 64) if device == "cpu" else (20000, 64 << 20, 128)
    mask = make(name, q_len=n, kv_len=n, device=device)
    eager = scan_blocks(mask, n, n, heads=heads, device=device, block_size=block, engine="eager")
    compiled = scan_blocks(mask, n, n, heads=heads, device=device, block_size=block, engine="compiled",
                           memory_budget=budget)
    assert compiled.engine == "compiled" and compiled.extra["tiles"] > 1
    assert torch.equal(eager.counts, compiled.counts) and torch.equal(eager.row_kept, compiled.row_kept)
    if heads:
        assert torch.equal(eager.head_pairs_differing, compiled.head_pairs_differing)


@pytest.mark.slow
def test_triton_scan_equals_eager_on_the_library_in_the_interpreter(early_run):
    """The fused kernel (Triton's CPU interpreter, a fresh process): every library mask and a
    batch- and head-dependent mod, at odd lengths, uneven and tall blocks (~55 s)."""
    pytest.importorskip("triton")

    out = early_run("triton_scan")  # tests/run_triton_scan.py cpu, started at collection (conftest)
    assert out.returncode == 0 and "ALL EQUAL" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


def _pretend_triton(monkeypatch, corrupt):
    """Stand in for the GPU kernel with the eager counts, optionally corrupted (bug injection)."""
    from workbench import blocks, kernels

    class FakeKernel:
        def __init__(self, mod):
            self.mod, self.source = mod, f"fake {id(mod)}"

    def fake_block_scan(kernel, q_len, kv_len, q_block, kv_block, batch, heads, diff_head, diff_batch,
                        keep_counts, device):
        scan = scan_blocks(kernel.mod, q_len, kv_len, heads=heads if heads > 1 else None,
                           batch=batch if batch > 1 else None, block_size=(q_block, kv_block), engine="eager")
        counts, rows = scan.counts.clone(), scan.row_kept.clone()
        corrupt(counts, rows)
        zero = torch.zeros(batch, heads, dtype=torch.int64)
        return dict(counts=counts, row_kept=rows, head_diff=zero, batch_diff=zero, full=scan.full_blocks,
                    empty=scan.empty_blocks, tile=(1, 1))

    monkeypatch.setattr(kernels, "scan_kernel", lambda mask_mod, device, *lengths: FakeKernel(mask_mod))
    monkeypatch.setattr(kernels, "block_scan", fake_block_scan)
    monkeypatch.setattr(kernels, "available", lambda device: True)
    monkeypatch.setattr(blocks, "TRITON_ABOVE_PAIRS", 0)
    monkeypatch.setattr(blocks, "TRITON_COLD_ABOVE_PAIRS", 0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_spot_check_rejects_a_kernel_that_disagrees_with_torch(monkeypatch):
    mask = make("causal_sliding_window", {"window": 100})
    _pretend_triton(monkeypatch, lambda counts, rows: None)
    assert scan_blocks(mask, 1024, 1024, engine="triton").engine == "triton"

    def one_block_off(counts, rows):  # the middle block row, as a wrong translation would give
        counts[0, 0, 4, 4] -= 1
        rows[0, 0, 4 * 128] -= 1
    _pretend_triton(monkeypatch, one_block_off)
    with pytest.raises(WorkbenchError, match="differ from torch's in block row 4"):
        scan_blocks(mask, 1024, 1024, engine="triton")
    # Picked automatically, a disagreeing kernel is dropped for the eager tiles, and the reason kept.
    scan = scan_blocks(mask, 1024, 1024)
    assert scan.engine == "eager" and "block row 4" in scan.extra["triton_fallback"]
    assert scan.kept_pairs == sum(min(i + 1, 100) for i in range(1024))


def test_untranslatable_mod_is_named_and_falls_back(monkeypatch):
    def by_sign(b, h, q_idx, kv_idx):  # aten.sign has no Triton translation here
        return (q_idx - kv_idx).sign() >= 0

    monkeypatch.setattr("workbench.kernels.available", lambda device: True)
    monkeypatch.setattr("workbench.blocks.TRITON_ABOVE_PAIRS", 0)
    monkeypatch.setattr("workbench.blocks.TRITON_COLD_ABOVE_PAIRS", 0)
    scan = scan_blocks(by_sign, 300, 300)
    assert scan.engine == "eager" and "sign" in scan.extra["triton_fallback"]
    assert scan.kept_pairs == 300 * 301 // 2
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(WorkbenchError, match="no Triton translation") as err:
        scan_blocks(by_sign, 300, 300, engine="triton")
    assert "engine='eager'" in str(err.value)


def test_triton_engine_needs_cuda(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(WorkbenchError, match="runs on CUDA"):
        scan_blocks(make("causal"), 256, 256, engine="triton")
    with pytest.raises(WorkbenchError, match="unknown engine"):
        scan_blocks(make("causal"), 256, 256, engine="fast")


def test_forward_only_block_mask_drops_the_q_side_and_still_runs():
    from torch.nn.attention.flex_attention import flex_attention

    mask = make("document", {"doc_lengths": [100, 156]}, q_len=256, kv_len=256)
    ours = build_block_mask(mask, 256, 256, block_size=64, compute_q_blocks=False)
    ref = create_block_mask(mask.mask_mod, None, None, 256, 256, device="cpu", BLOCK_SIZE=64)
    for name in FIELDS[:4]:
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name
    assert ours.q_indices is None and ours.full_q_indices is None
    q, k, v = (torch.randn(1, 2, 256, 16) for _ in range(3))
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=ours), flex_attention(q, k, v, block_mask=ref))


@pytest.fixture
def fake_scan_kernel(monkeypatch):
    """A CPU stand-in for the fused scan: every mod "translates", and a launch (recorded by its
    q_len in the returned list) gives the eager tiles' counts. Thresholds shrink to small sizes."""
    from workbench import blocks, kernels

    launches = []

    class FakeKernel:
        source = "fake"

    def fake_block_scan(kernel, q_len, kv_len, q_block, kv_block, batch, heads, diff_head, diff_batch,
                        keep_counts, device):
        launches.append(q_len)
        scan = scan_blocks(make("causal"), q_len, kv_len, engine="eager")
        zero = torch.zeros(1, 1, dtype=torch.int64)
        return dict(counts=scan.counts, row_kept=scan.row_kept, head_diff=zero, batch_diff=zero,
                    full=scan.full_blocks, empty=scan.empty_blocks, tile=(1, 1))

    monkeypatch.setattr(kernels, "available", lambda device: True)
    monkeypatch.setattr(kernels, "block_scan", fake_block_scan)
    monkeypatch.setattr(blocks, "TRITON_WARM_ABOVE_PAIRS", 100 * 100)
    monkeypatch.setattr(blocks, "TRITON_ABOVE_PAIRS", 256 * 256)
    monkeypatch.setattr(blocks, "TRITON_COLD_ABOVE_PAIRS", 512 * 512)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernels.forget()
    monkeypatch.setattr(kernels, "scan_kernel", lambda mod, device, *lengths: (
        kernels._requests.update({"fake": 1}), FakeKernel())[1])
    yield launches
    kernels.forget()


def test_auto_engine_compiles_only_where_it_pays_off(fake_scan_kernel):
    """Below the cold threshold a first scan stays eager; the same mod asked again gets the kernel."""
    launches, mask = fake_scan_kernel, make("causal")
    assert scan_blocks(mask, 200, 200).engine == "eager"            # below TRITON_ABOVE_PAIRS
    assert scan_blocks(mask, 300, 300).engine == "eager" and not launches  # first ask, small: eager
    assert scan_blocks(mask, 300, 300).engine == "triton"     # asked again: compile
    assert scan_blocks(mask, 600, 600).engine == "triton"     # past the cold threshold
    assert launches == [300, 600]


def test_background_compile_keeps_scans_off_the_compile(fake_scan_kernel, monkeypatch):
    """The app's scans (background_compile=True): a new mod is scanned eagerly while its kernel
    compiles on the side, asking again never compiles in the scan, and once compiled the kernel
    serves from TRITON_WARM_ABOVE_PAIRS on."""
    from workbench import kernels

    launches, mask, background, compiled = fake_scan_kernel, make("causal"), [], set()
    monkeypatch.setattr(kernels, "is_compiled", lambda kernel, *settings: bool(compiled))
    monkeypatch.setattr(kernels, "compile_in_background", lambda kernel, *args: background.append(args))
    assert scan_blocks(mask, 64, 64, background_compile=True).engine == "eager" and not background  # tiny
    assert scan_blocks(mask, 200, 200, background_compile=True).engine == "eager" and len(background) == 1
    assert scan_blocks(mask, 300, 300, background_compile=True).engine == "eager"  # asked again: still eager
    assert not launches and len(background) == 2
    compiled.add("done")  # the background compile finished
    assert scan_blocks(mask, 200, 200, background_compile=True).engine == "triton"
    assert scan_blocks(mask, 200, 200).engine == "eager"  # a plain scan of this size does not translate
    assert launches == [200]


def test_turning_a_knob_reuses_one_scan_kernel():
    # the Python numbers a mod captures become kernel arguments: every window shares one source
    # (so one compile on a GPU), with the values passed as 0-d tables
    from workbench import kernels

    cpu = torch.device("cpu")
    built = [kernels.scan_kernel(make("causal_sliding_window", {"window": w}, q_len=4096, kv_len=4096).mask_mod, cpu)
             for w in (64, 100, 1000)]
    assert len({k.source for k in built}) == 1
    assert [[int(t) for t in k.tables if t.dim() == 0] for k in built] == [[0, 64], [0, 100], [0, 1000]]
    chunks = {kernels.scan_kernel(make("chunked_local", {"chunk": c}).mask_mod, cpu).source for c in (128, 300)}
    assert len(chunks) == 1


def test_a_number_that_steers_python_stays_a_constant():
    from workbench.define import lift_scalars

    def factory(width):
        def steered(b, h, q_idx, kv_idx):
            if width > 10:  # Python control flow on the captured number
                return kv_idx <= q_idx
            return (q_idx - kv_idx).abs() < width
        return steered

    assert lift_scalars(factory(20), "cpu") == (None, {})
    twin, lifted = lift_scalars(make("causal_sliding_window", {"window": 7}).mask_mod, "cpu")
    assert set(lifted) == {"window", "offset"} and int(lifted["window"]) == 7


def test_lifting_probes_only_inside_the_lengths():
    """A per-token table sized for the problem, read at q_idx + offset (a bottom-right document
    mask at Lq < Lk): the probes that check the lifted mod must stay inside Lq x Lk. (On a GPU a
    read past the table is a device-side assert that poisons the process; here it raises.)"""
    from workbench.define import lift_scalars

    def bottom_right_documents(q_len, kv_len):
        document_id = torch.arange(kv_len) // 40
        offset = kv_len - q_len

        def documents(b, h, q_idx, kv_idx):
            pos = q_idx + offset
            return (document_id[pos] == document_id[kv_idx]) & (pos >= kv_idx)
        return documents

    twin, lifted = lift_scalars(bottom_right_documents(200, 333), "cpu", 200, 333)
    assert set(lifted) == {"offset"} and int(lifted["offset"]) == 133
