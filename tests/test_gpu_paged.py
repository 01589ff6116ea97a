"""attention_paged on the GPU: every case of tests/run_port_paged.py against the float64 reference,
and a step captured in a CUDA graph and replayed with new contents. Run with `pytest -m gpu`."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent
pytestmark = pytest.mark.gpu


def test_paged_steps_match_the_reference_on_cuda(cuda):
    done = subprocess.run([sys.executable, str(ROOT / "run_port_paged.py"), "cuda", "5"], capture_output=True,
                          text=True, timeout=900, env=dict(os.environ))
    summary = [line for line in done.stdout.splitlines() if line.startswith("SUMMARY")]
    print("\n".join(line for line in done.stdout.splitlines() if line.startswith(("CASE", "SUMMARY"))))
    assert done.returncode == 0 and summary, done.stdout[-4000:] + done.stderr[-3000:]


def test_a_paged_step_replays_in_a_cuda_graph(cuda, tmp_path):
    """No host sync and no content-sized allocation: capture one step, change q, the cache, the
    block table and seq_lens in place, replay, and get what a plain call gives."""
    from workbench import make, port

    module = port.load(port.build(make("causal_sliding_window", {"window": 300}), 256, 256, out_dir=tmp_path))
    g = torch.Generator(device="cuda").manual_seed(0)
    num_seqs, page, pages = 4, 16, 64
    q = torch.randn(40, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    kc = torch.randn(pages * num_seqs, page, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn_like(kc)
    table = torch.randperm(pages * num_seqs, device="cuda", generator=g).view(num_seqs, pages).to(torch.int32)
    cu = torch.tensor([0, 1, 2, 12, 40], dtype=torch.int32, device="cuda")
    lens = torch.tensor([500, 900, 300, 1000], dtype=torch.int32, device="cuda")
    with torch.no_grad():
        module.attention_paged(q, kc, vc, table, cu, lens)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = module.attention_paged(q, kc, vc, table, cu, lens)
        q.copy_(torch.randn_like(q))
        kc.copy_(torch.randn_like(kc))
        table.copy_(torch.randperm(pages * num_seqs, device="cuda").view(num_seqs, pages).to(torch.int32))
        lens.copy_(torch.tensor([700, 33, 1024, 128], dtype=torch.int32, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        plain = module.attention_paged(q, kc, vc, table, cu, lens)
    assert torch.equal(out, plain) and not torch.isnan(out).any()


def _serve_and_check(module, mask, reqs, page, heads, kv_heads, d, dtype, rng, seed):
    """One step of requests (n_q, seq_len) over shuffled pages of `page` keys (NaN in every unused
    slot, garbage in the block table past each request's pages) through attention_paged; each
    request's rows against its float64 reference."""
    sys.path.insert(0, str(ROOT))
    from run_port_paged import gather, poison_unused, request_view

    from workbench.run import Inputs, Shape
    from workbench.verify import LSE_TOLERANCE, TOLERANCES, compare, reference_attention

    pages_of = [-(-length // page) for _, length in reqs]
    physical = list(range(sum(pages_of) + 2))
    rng.shuffle(physical)
    table = torch.full((len(reqs), max(pages_of) + 1), 10**6, dtype=torch.int32)
    it = iter(physical)
    for r, n in enumerate(pages_of):
        table[r, :n] = torch.tensor([next(it) for _ in range(n)], dtype=torch.int32)
    real = getattr(torch, dtype)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(n for n, _ in reqs), heads, d, generator=g).to(real)
    kc = torch.randn(len(physical), page, kv_heads, d, generator=g).to(real)
    vc = torch.randn(len(physical), page, kv_heads, d, generator=g).to(real)
    poison_unused(kc, vc, table, reqs)  # (NaN in every slot that holds none of the step's keys)
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor([n for n, _ in reqs]), 0)), dtype=torch.int32)
    lens = torch.tensor([length for _, length in reqs], dtype=torch.int32)
    with torch.no_grad():
        out, lse = module.attention_paged(*(t.cuda() for t in (q, kc, vc, table, cu, lens)), return_lse=True,
                                          check=True)
    out, lse = out.cpu(), lse.cpu()
    for r, (n_q, length) in enumerate(reqs):
        start = int(cu[r])
        shape = Shape(batch=1, q_heads=heads, kv_heads=kv_heads, q_len=n_q, kv_len=length, head_dim=d)
        qr = q[start:start + n_q].permute(1, 0, 2)[None].float()
        kr, vr = gather(kc, table[r], length)[None].float(), gather(vc, table[r], length)[None].float()
        ref = reference_attention(request_view(mask, r, n_q, length),
                                  Inputs(q=qr, k=kr, v=vr, shape=shape, dtype="float32", seed=0), progress=False)
        got = out[start:start + n_q].permute(1, 0, 2)[None]
        checks = [compare("out", got, ref.out, TOLERANCES[dtype]),
                  compare("lse", lse[start:start + n_q].permute(1, 0)[None], ref.lse, LSE_TOLERANCE[dtype])]
        assert all(c.passed for c in checks), (reqs, page, r, [(c.name, c.max_abs_err, c.bad_count, c.nan_count)
                                                              for c in checks])


@pytest.mark.parametrize("name", ["causal", "sliding_window_700", "users_head_window"])
def test_prefill_heavy_steps_take_the_wide_tiles_and_match_the_reference(cuda, tmp_path, name):
    """Steps whose requests bring many queries run fast mode's wide tiles (PAGED_TILES: 128 or
    64 rows); each request of such a step equals its float64 reference, in bf16."""
    import random

    sys.path.insert(0, str(ROOT))
    from run_port_paged import W, head_window

    from workbench import Mask, make, port

    mask = {"causal": lambda: make("causal"),
            "sliding_window_700": lambda: make("causal_sliding_window", {"window": 700}),
            "users_head_window": lambda: Mask("users_head_window", mask_mod=head_window)}[name]()
    heads, kv_heads, d = (4, 2, 128) if name == "users_head_window" else (32, 8, 128)
    module = port.load(port.build(mask, 256, 256, heads=heads, batch=4, out_dir=tmp_path))
    module.HOPPER_PAGED = False  # (the Hopper prefill has its own test)
    rng = random.Random(0)
    for reqs in ([(700, 1200), (300, 300), (1, 2000)], [(64, 64), (40, 500), (33, 33)]):
        _serve_and_check(module, mask, reqs, 16, heads, kv_heads, d, "bfloat16", rng, len(reqs))
    assert W.numel() == 4


@pytest.mark.parametrize("name", ["causal", "users_head_window"])
def test_long_decodes_cut_into_even_pieces_match_the_reference(cuda, tmp_path, name):
    """Fast mode's split-KV on the GPU: the cut the GPU's program slots choose (PAGED_BALANCE: a
    request's key tiles in near-equal pieces, as many as fill the SMs), and 33 pieces asked for, at
    lengths off every tile grid, with short requests and a chunk in the same step; each request
    against its float64 reference, in bf16."""
    import random

    sys.path.insert(0, str(ROOT))
    from run_port_paged import W, head_window

    from workbench import Mask, make, port

    mask = make("causal") if name == "causal" else Mask("users_head_window", mask_mod=head_window)
    heads, kv_heads = (8, 2) if name == "causal" else (4, 2)
    module = port.load(port.build(mask, 256, 256, heads=heads, batch=4, out_dir=tmp_path))
    module.PAGED_BALANCE = True
    rng = random.Random(1)
    for pieces in (None, 33):
        module.PAGED_PIECES = pieces
        for reqs in ([(1, 20011)], [(1, 20011), (1, 5000), (5, 3001), (1, 1)]):
            _serve_and_check(module, mask, reqs, 16, heads, kv_heads, 128, "bfloat16", rng, len(reqs))
    assert W.numel() == 4


def test_the_fold_launched_as_a_dependent_gives_the_same_bits_and_replays(cuda, tmp_path):
    """On an H100 / H200 a split decode's fold (_paged_fold) is launched as a programmatic dependent
    of _paged_kernel (PAGED_PDL): it must give the same bits as the fold launched after the kernel,
    alone and in a mixed step, called and replayed from a CUDA graph with new contents; later calls
    of a kind go straight to the compiled kernels (the file's launch sites), with the same bits."""
    from workbench import make, port

    module = port.load(port.build(make("causal"), 256, 256, heads=8, batch=4, out_dir=tmp_path))
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90 or newer")
    assert module._paged_pdl(torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(3)
    page, pages = 16, 1400
    kc = torch.randn(pages, page, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn_like(kc)
    table = torch.randperm(pages, device="cuda", generator=g)[:4 * 350].view(4, 350).to(torch.int32)
    for reqs in ([(1, 5587)], [(1, 5587), (1, 3001), (4, 2500), (1, 17)]):
        q = torch.randn(sum(n for n, _ in reqs), 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        cu = torch.tensor([0] + list(torch.cumsum(torch.tensor([n for n, _ in reqs]), 0)), dtype=torch.int32,
                          device="cuda")
        lens = torch.tensor([length for _, length in reqs], dtype=torch.int32, device="cuda")
        bt = table[:len(reqs)].contiguous()
        with torch.no_grad():
            module.PAGED_PDL = False
            after, lse_after = module.attention_paged(q, kc, vc, bt, cu, lens, return_lse=True)
            module.PAGED_PDL = True
            sites = len(module._SITES)
            dependent, lse_dep = module.attention_paged(q, kc, vc, bt, cu, lens, return_lse=True)
            again, lse_again = module.attention_paged(q, kc, vc, bt, cu, lens, return_lse=True)  # (through its site)
            assert len(module._SITES) > sites  # (the paged kernel's and the fold's sites)
            assert torch.equal(after, dependent) and torch.equal(lse_after, lse_dep), reqs
            assert torch.equal(after, again) and torch.equal(lse_after, lse_again), reqs
            assert not torch.isnan(after).any() and torch.isfinite(lse_after).all()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                replayed = module.attention_paged(q, kc, vc, bt, cu, lens)
            q.copy_(torch.randn_like(q))
            lens.sub_(1)
            graph.replay()
            torch.cuda.synchronize()
            module.PAGED_PDL = False
            plain = module.attention_paged(q, kc, vc, bt, cu, lens)
            module.PAGED_PDL = True
        assert torch.equal(replayed, plain) and not torch.isnan(plain).any(), reqs
    # and the numbers themselves: the last step's first request against SDPA in float64
    k = kc[bt[0].long()].reshape(-1, 2, 128)[:int(lens[0])].transpose(0, 1)[None].double()
    v = vc[bt[0].long()].reshape(-1, 2, 128)[:int(lens[0])].transpose(0, 1)[None].double()
    want = torch.nn.functional.scaled_dot_product_attention(q[:1].permute(1, 0, 2)[None].double(), k, v,
                                                            enable_gqa=True)
    assert (plain[:1].permute(1, 0, 2)[None].double() - want).abs().max() < 2e-2


_HOPPER_PREFILL = ["causal", "sliding_window_700", "users_head_window", "users_per_request_prefix", "causal+softcap",
                   "users_spans_any", "and_masks_window", "users_score_biases"]


@pytest.mark.parametrize("form", ["bfloat16-128", "float16-64"])
@pytest.mark.parametrize("name", _HOPPER_PREFILL)
def test_prefill_steps_on_hopper_match_the_reference(cuda, tmp_path, name, form):
    """On an H100 / H200, prefill-heavy steps of attention_paged run the Hopper kernel
    (templates/hopper_paged.py: keys and values by TMA through the block table, the tiles planned on
    the device): pages of 16, 64 and 128 keys, chunks off the 128 grid, a decode among them, GQA,
    users' per-head and per-request tables, a score_mod; each request against float64."""
    import random

    sys.path.insert(0, str(ROOT))
    from run_hopper_compile import masks
    from run_port_paged import head_window, per_request_prefix, spans_any
    from torch.nn.attention.flex_attention import and_masks

    from workbench import Mask, make, port, with_score

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def window_300(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < 300

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel runs on sm_90 only")
    mask = {"causal": lambda: make("causal"),
            "sliding_window_700": lambda: make("causal_sliding_window", {"window": 700}),
            "users_head_window": lambda: Mask("users_head_window", mask_mod=head_window),
            "users_per_request_prefix": lambda: Mask("users_per_request_prefix", mask_mod=per_request_prefix),
            "causal+softcap": lambda: with_score(make("causal"), make("softcap")),
            "users_spans_any": lambda: Mask("users_spans_any", mask_mod=spans_any),
            "and_masks_window": lambda: Mask("and_masks_window", mask_mod=and_masks(causal, window_300)),
            # (causal, attention-gym's ALiBi and a relative table: biases in one fused multiply-add;
            # its tables made on the CPU, where the float64 reference runs: the port takes them to the GPU)
            "users_score_biases": lambda: next(m for m in masks() if m.name == "users_score_biases")}[name]()
    dtype, d = form.split("-")
    heads, kv_heads = (4, 2) if name.startswith("users") else (16, 4)
    module = port.load(port.build(mask, 256, 256, heads=heads, batch=4, out_dir=tmp_path))
    assert module.HOPPER_MODS is None and module.HOPPER_PAGED, module.HOPPER_MODS
    runs = []
    real = module._attention_paged_hopper
    module._attention_paged_hopper = lambda *a, **kw: runs.append(real(*a, **kw)) or runs[-1]
    rng = random.Random(1)
    steps = [[(700, 1200), (300, 300), (129, 2000)], [(500, 500), (1, 900), (260, 1000)]]  # (LENS: 3 requests)
    for page in (16, 64, 128):
        for reqs in steps:
            _serve_and_check(module, mask, reqs, page, heads, kv_heads, int(d), dtype, rng, page + len(reqs))
    assert runs == [True] * 6, (runs, module._HOPPER_PAGED_FAILED)


def test_the_hopper_prefills_default_wait_after_the_max_gives_way_where_it_spills(cuda, tmp_path):
    """_under_pv_by_spills in attention_paged's Hopper prefill: with the wait for P V after the row max
    (UNDER_PV 2) made the file's default, each kind of step (page size) runs the form that spills
    less by the driver's count, 2 where it spills nothing; a user's .any() spans (6 table entries)
    and the library's causal, pages of 16 and 128, each request against float64."""
    import random

    sys.path.insert(0, str(ROOT))
    from run_port_paged import spans_any

    from workbench import Mask, make, port

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel runs on sm_90 only")
    for mask in (Mask("users_spans_any", mask_mod=spans_any), make("causal")):
        module = port.load(port.build(mask, 256, 256, heads=4, batch=4, out_dir=tmp_path / mask.name))
        module.HOPPER_UNDER_PV, module.HOPPER_UNDER_PV_CHOSEN = 2, False
        spilled = []
        real = module._spill_bytes
        module._spill_bytes = lambda compiled: spilled.append(real(compiled)) or spilled[-1]
        rng = random.Random(2)
        for page in (16, 128):
            before = len(spilled)
            _serve_and_check(module, mask, [(700, 1200), (300, 300), (129, 2000)], page, 4, 2, 128, "bfloat16", rng,
                             page)
            (key, place), = [(key, place) for key, place in module._PAGED_UNDER_PV.items()
                             if dict(key[2])["PAGE_SIZE"] == page]
            counts = spilled[before:]
            where = f"{mask.name}, page {page}: spill bytes {counts}"
            assert counts and (place == 0) == (len(counts) == 2 and counts[1] < counts[0]), where
        assert not module._HOPPER_PAGED_FAILED, module._HOPPER_PAGED_FAILED


def test_the_hopper_prefill_replays_in_a_cuda_graph_and_poisons_bad_pages(cuda, tmp_path):
    """The Hopper prefill plans its tiles on the device: a captured step replays with new contents
    (lengths, pages, queries) and gives what a plain call gives; a request whose table names a page
    outside the cache gets NaN rows, and the other requests do not."""
    from workbench import make, port

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel runs on sm_90 only")
    module = port.load(port.build(make("causal_sliding_window", {"window": 300}), 256, 256, out_dir=tmp_path))
    runs = []
    real = module._attention_paged_hopper
    module._attention_paged_hopper = lambda *a, **kw: runs.append(real(*a, **kw)) or runs[-1]
    g = torch.Generator(device="cuda").manual_seed(0)
    num_seqs, page, pages = 3, 16, 128
    q = torch.randn(900, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    kc = torch.randn(pages * num_seqs, page, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn_like(kc)
    table = torch.randperm(pages * num_seqs, device="cuda", generator=g).view(num_seqs, pages).to(torch.int32)
    cu = torch.tensor([0, 300, 700, 900], dtype=torch.int32, device="cuda")
    lens = torch.tensor([500, 1900, 300], dtype=torch.int32, device="cuda")
    with torch.no_grad():
        module.attention_paged(q, kc, vc, table, cu, lens)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = module.attention_paged(q, kc, vc, table, cu, lens)
        q.copy_(torch.randn_like(q))
        kc.copy_(torch.randn_like(kc))
        table.copy_(torch.randperm(pages * num_seqs, device="cuda").view(num_seqs, pages).to(torch.int32))
        lens.copy_(torch.tensor([2000, 400, 256], dtype=torch.int32, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        plain = module.attention_paged(q, kc, vc, table, cu, lens)
        assert torch.equal(out, plain) and not torch.isnan(out).any()
        # request 1 (400 queries, 400 keys, q rows 300-700) names a page outside the cache for keys
        # 320-335: the slots whose window reads them (queries 256-399) are NaN, nothing else
        table[1, 20] = pages * num_seqs + 5
        poisoned = module.attention_paged(q, kc, vc, table, cu, lens)
    assert torch.isnan(poisoned[556:700]).all() and torch.equal(poisoned[:556], plain[:556])
    assert torch.equal(poisoned[700:], plain[700:])
    assert runs == [True] * 4, (runs, module._HOPPER_PAGED_FAILED)


@pytest.mark.parametrize("name", ["causal", "sliding_window_200", "users_head_window"])
def test_verify_judges_the_paged_port_on_cuda(cuda, name):
    """verify(..., backend="port-paged") on the GPU, at a length and head dim at which an H100 / H200
    may run the Hopper prefill (bf16, D 128, 300 queries a request): the inputs over a shuffled cache
    with NaN in every unused slot (spare pages, each request's page tail), each request against the
    float64 reference."""
    from workbench import Mask, make, port
    from workbench.run import Shape
    from workbench.verify import verify

    w = torch.tensor([40, 90, 200, 333], device=cuda)

    def users_head_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < w[h])

    mask = {"causal": lambda: make("causal"),
            "sliding_window_200": lambda: make("causal_sliding_window", {"window": 200}),
            "users_head_window": lambda: Mask("users_head_window", mask_mod=users_head_window)}[name]()
    seen = []
    real = port.run_paged_file

    def spy(path, step, **kw):
        seen.append(step)
        return real(path, step, **kw)

    port.run_paged_file = spy
    try:
        verdict = verify(mask, Shape(batch=2, q_heads=4, kv_heads=2, q_len=300, kv_len=300, head_dim=128),
                         dtype="bfloat16", device=cuda, backend="port-paged", seed=2, progress=False)
    finally:
        port.run_paged_file = real
    print(verdict.line)
    assert verdict.passed and all(c.nan_count == 0 for c in verdict.checks), verdict.line
    assert seen and torch.isnan(seen[0].v_cache).any()

