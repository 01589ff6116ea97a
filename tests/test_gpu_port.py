"""The port on the GPU: every corpus and random mod in bf16 and fp32, library golden vectors,
decode shapes against 32K keys, and a long verification. Run with `pytest -m gpu`."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from workbench import Mask, make
from workbench.run import Shape
from workbench.verify import verify

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.gpu
def test_ports_match_the_reference_in_bf16(cuda):
    # every corpus and random mod in bf16 (fp32 of each runs in the interpreter on CI), in up to 8
    # processes side by side (each case compiles its own kernel: the compiles dominate; 8 shards
    # took about 150 s on a 16-core H200 host with the golden vectors below in the first)
    _corpus_in_shards(["10", "bfloat16"], timeout=1200)


@pytest.mark.gpu
def test_the_librarys_golden_vectors_pass_conformance_in_bf16_and_fp32(cuda, tmp_path, capsys):
    # the library's specs written with their ports and run through `conformance` on their golden
    # vectors, as a porting engineer would (autotuning on). Writing a spec validates it against its
    # schema: a GPU host without the jsonschema package (a declared dependency) reports a skip here,
    # and the corpus above still runs
    pytest.importorskip("jsonschema", reason="writing a porting spec needs the jsonschema package, a declared "
                        "dependency, and this host lacks it: install it (or carry it) to run conformance here")
    sys.path.insert(0, str(ROOT / "tests"))
    from run_port_corpus import CONFORMANCE_CASES, conformance_of_the_library

    failed = conformance_of_the_library("cuda", ["bfloat16", "float32"], tmp_path)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("CASE")]
    assert len(lines) == 2 * len(CONFORMANCE_CASES), lines
    assert failed == 0, "\n".join(line for line in lines if " FAIL" in line)


def _corpus_in_shards(args: list[str], timeout: int) -> list[str]:
    """tests/run_port_corpus.py cuda *args in up to 8 processes side by side (shard=i/n), each of
    which must pass and print its SUMMARY; their output lines (failing cases named in the assert)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    n = max(1, min(8, (os.cpu_count() or 2) // 2))
    shards = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "run_port_corpus.py"), "cuda", *args,
                                f"shard={i}/{n}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
              for i in range(n)]
    outs = [shard.communicate(timeout=timeout) for shard in shards]
    lines = [line for out, _ in outs for line in out.splitlines()]
    summary = [line for line in lines if line.startswith("SUMMARY")]
    fails = [line for line in lines if line.startswith("CASE") and " FAIL" in line]
    errors = "".join(err[-1500:] for (_, err), shard in zip(outs, shards) if shard.returncode)
    assert all(shard.returncode == 0 for shard in shards) and len(summary) == n, "\n".join(fails[:20]) + errors
    print("; ".join(summary))
    return lines


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", ["whole_blocks", "ragged"])
def test_the_hopper_kernel_runs_drawn_mods_like_the_reference(cuda, lengths):
    # 16 mods drawn from the trust grammar (tables per head / per sample, documents, .any() spans,
    # and_masks / or_masks, ALiBi-like and softcap scores) at lengths the Hopper kernel takes, in bf16
    # and fp16: each call must run that kernel (not its fallback) and match the float64 reference.
    # "ragged": lengths off the 128 grid, with the file's HOPPER_RAGGED on
    import torch

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel runs on sm_90 only")
    extra = ["ragged"] if lengths == "ragged" else []
    lines = _corpus_in_shards(["16", "hopper", *extra, "bfloat16", "float16"], timeout=900)
    assert sum(line.startswith("CASE") and line.split()[2] == "OK" for line in lines) == 32, lines


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [1, 7, 16])
def test_decode_against_32k_keys(cuda, q_len):
    mask = make("causal", q_len=q_len, kv_len=32768, device=cuda)
    verdict = verify(mask, Shape(q_heads=8, kv_heads=2, q_len=q_len, kv_len=32768, head_dim=128), dtype="bfloat16",
                     device=cuda, backend="port", seed=0)
    assert verdict.passed, verdict.line


@pytest.mark.gpu
def test_port_at_128k(cuda):
    mask = make("causal_sliding_window", {"window": 2048})
    verdict = verify(mask, Shape(q_heads=4, q_len=131072, head_dim=128), dtype="bfloat16", device=cuda,
                     backend="port", seed=0)
    assert verdict.passed, verdict.line



def packed_request_check(device, dtype, head_dim, folder, lengths=(333, 1000, 3000)):
    """A request (the middle of `lengths`) alone, with cu_seqlens = [0, n], and packed between a
    shorter and a longer partner: (the request's worst error against a float64 reference, whether
    its packed rows are bit for bit the same as alone)."""
    import torch

    from workbench import port
    from workbench.run import make_inputs
    from workbench.verify import reference_attention

    before, n, after = lengths
    module = port.load(port.build(make("causal", q_len=n, kv_len=n), n, n, heads=4, out_dir=folder))
    request = make_inputs(Shape(q_heads=4, q_len=n, head_dim=head_dim), dtype, device, seed=1)
    alone = module.attention(request.q, request.k, request.v, cu_seqlens=[0, n])
    ref = reference_attention(make("causal", q_len=n, kv_len=n, device=device), request).out
    error = float((alone.double() - ref).abs().max())
    generator = torch.Generator(device=device).manual_seed(2)
    packed = [torch.cat([torch.randn(1, 4, before, head_dim, generator=generator, device=device).to(x.dtype), x,
                         torch.randn(1, 4, after, head_dim, generator=generator, device=device).to(x.dtype)], dim=2)
              for x in (request.q, request.k, request.v)]
    out = module.attention(*packed, cu_seqlens=[0, before, before + n, before + n + after])
    assert not torch.isnan(out).any()
    return error, torch.equal(out[:, :, before:before + n], alone)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_dim", [("bfloat16", 64), ("bfloat16", 128), ("bfloat16", 256), ("float32", 128)])
def test_packed_requests_are_exact_and_their_bits_do_not_depend_on_their_partners(cuda, tmp_path, dtype, head_dim):
    # the port autotunes its plain launches; a packed launch (cu_seqlens) takes its fixed tiles, so a
    # request packed between a short and a long partner gives bit for bit what it gives alone, for
    # every head dim (D = 256 and float32 need the smaller fallback tiles)
    error, bitwise = packed_request_check(cuda, dtype, head_dim, tmp_path)
    assert error < (2e-2 if dtype == "bfloat16" else 1e-5), error
    assert bitwise


@pytest.mark.gpu
@pytest.mark.timeout(240)  # (pytest-timeout: a compile stuck in ptxas fails the test, with its stack, not the run)
@pytest.mark.parametrize("head_dim", [128, 256])
def test_float32_at_wide_head_dims(cuda, head_dim):
    # every larger tile overflows Hopper's shared memory in float32 at D >= 128 and took 50-260 s to
    # compile ((64, 32, 4, 1) 210 s at D 256): such a call compiles its one small tile (WIDE_TILE)
    # and launches it without the autotuner, and the invariance check pins that tile
    from workbench import invariance

    mask = make("causal_sliding_window", {"window": 300})
    verdict = verify(mask, Shape(q_heads=2, q_len=1000, head_dim=head_dim), dtype="float32", device=cuda,
                     backend="port", seed=0)
    assert verdict.passed, verdict.line
    result = invariance.check("causal", q_len=700, heads=2, head_dim=head_dim, dtype="float32", device=cuda,
                              backend="port", layouts=["run", "batch", "padded"])
    assert result.passed, result.line


_HOPPER_CASES = ["users_and_masks", "causal_bottom_right", "full", "causal_sliding_window_256", "document_causal_3docs",
                 "causal_bottom_right+softcap_30", "causal_bottom_right+alibi_4heads", "users_head_window", "users_per_sample_prefix",
                 "users_image_spans", "causal_8k_fp16_d64", "full_512x2048", "neighborhood_2d_k7_1000",
                 "users_natten_1d", "users_score_biases", "users_score_biases_fp16_d64", "softcap_fp16_d64_1000"]


def _hopper_case(name: str):
    # (mask, B, Hq, Hkv, Lq, Lk, D, dtype): the compile script's masks (library, softcap, ALiBi, users'
    # per-head / per-sample tables and .any() spans; their tensors on the GPU) at 1,024 tokens, GQA,
    # bf16, D 128; and causal at 8K in fp16 at D 64, full attention at Lq < Lk; windows whose checks
    # the Gluon copy folds into one unsigned compare (translate/fast_mask.py): the 2-D neighbourhood
    # off the 128 grid, and a user's 1-D neighbourhood shifted per head by a table, `<=` at its top
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from run_hopper_compile import masks

    if name == "causal_8k_fp16_d64":
        return make("causal", q_len=8192, kv_len=8192), 1, 8, 8, 8192, 8192, 64, "float16"
    if name == "full_512x2048":
        return make("full"), 1, 4, 1, 512, 2048, 128, "bfloat16"
    if name == "neighborhood_2d_k7_1000":
        return make("neighborhood_2d", {"kernel": 7}, q_len=1000, kv_len=1000), 2, 4, 2, 1000, 1000, 128, "bfloat16"
    if name == "users_natten_1d":
        shift = torch.tensor([0, 5, 17, 40], dtype=torch.int32, device="cuda")

        def natten_1d(b, h, q_idx, kv_idx):
            lo = (q_idx - 16 + shift[h]).clamp(0, 1024 - 33)
            return (kv_idx >= lo) & (kv_idx <= lo + 32)

        return Mask("users_natten_1d", mask_mod=natten_1d), 2, 4, 2, 1024, 1024, 128, "bfloat16"
    found = {m.name: m for m in masks("cuda")}
    # score_mods at D 64 in fp16, where "auto" runs the persistent loop: whole blocks, and a
    # softcap (tanh.approx) off the 128 grid
    at_d64 = {"users_score_biases_fp16_d64": ("users_score_biases", 1024, 1024),
              "softcap_fp16_d64_1000": ("causal_bottom_right+softcap_30", 1000, 1011)}
    if name in at_d64:
        base, Lq, Lk = at_d64[name]
        return found[base], 2, 4, 2, Lq, Lk, 64, "float16"
    assert name in found, f"no compile-script mask named {name}: {sorted(found)}"
    return found[name], 2, 4, 2, 1024, 1024, 128, "bfloat16"


@pytest.mark.gpu
@pytest.mark.parametrize("loop", ["auto", "specialized", "pingpong", "persistent"])
@pytest.mark.parametrize("case", _HOPPER_CASES)
def test_hopper_kernel_matches_the_reference(cuda, tmp_path, case, loop):
    # the Gluon sm_90 kernel (templates/hopper.py, HOPPER on, each form of its tile loop) against
    # the float64 reference, and the call must have gone through it
    import torch

    from workbench import port
    from workbench.run import Inputs
    from workbench.verify import LSE_TOLERANCE, TOLERANCES, compare, reference_attention

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel runs on sm_90 only")
    mask, B, Hq, Hkv, Lq, Lk, D, dtype = _hopper_case(case)
    module = port.load(port.build(mask, Lq, Lk, heads=Hq, batch=B, out_dir=tmp_path))
    assert module.HOPPER_MODS is None, module.HOPPER_MODS
    module.HOPPER, module.HOPPER_LOOP = True, loop
    if loop == "auto" and mask.score_mod is not None:  # (ping-pong at D 128, persistent at D 64)
        assert module._hopper_loop(D) == ("persistent" if D == 64 else "pingpong"), module._hopper_loop(D)
    calls = []
    real = module._attention_hopper
    module._attention_hopper = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    g = torch.Generator(device="cuda").manual_seed(0)
    real_dtype = getattr(torch, dtype)
    q = torch.randn(B, Hq, Lq, D, device="cuda", generator=g).to(real_dtype)
    k = torch.randn(B, Hkv, Lk, D, device="cuda", generator=g).to(real_dtype)
    v = torch.randn(B, Hkv, Lk, D, device="cuda", generator=g).to(real_dtype)
    with torch.no_grad():
        out, lse = module.attention(q, k, v, return_lse=True)
    assert calls, "attention() did not run the Hopper kernel"
    shape = Shape(batch=B, q_heads=Hq, kv_heads=Hkv, q_len=Lq, kv_len=Lk, head_dim=D)
    ref = reference_attention(mask, Inputs(q=q, k=k, v=v, shape=shape, dtype=dtype, seed=0), progress=False)
    checks = [compare("out", out, ref.out, TOLERANCES[dtype]), compare("lse", lse, ref.lse, LSE_TOLERANCE[dtype])]
    assert all(c.passed for c in checks), "; ".join(
        f"{c.name}: max abs err {c.max_abs_err:.3g}, {c.bad_count} bad, {c.nan_count} NaN" for c in checks)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [(2048, 2048), (1000, 1011), (3000, 3000)])
def test_the_persistent_form_hands_every_tile_out_once(cuda, tmp_path, lengths):
    # HOPPER_LOOP = "persistent": programs take (row block, head) tiles from a counter until none is
    # left. Row blocks that keep nothing (the first 300 queries keep no key), rows of every length,
    # lengths off the 128 grid, more tiles than SMs (B 3, 16 heads, GQA 16 / 4), and a second call
    # (the counter starts again at 0): out and lse against the float64 reference, every row
    import torch

    from workbench import Mask, port
    from workbench.run import Inputs
    from workbench.verify import LSE_TOLERANCE, TOLERANCES, compare, reference_attention

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel runs on sm_90 only")
    Lq, Lk = lengths
    lens = torch.tensor([700, 1500, 64], device="cuda")

    def late_start(b, h, q_idx, kv_idx):
        return (q_idx >= 300) & (kv_idx <= q_idx) & ((q_idx - kv_idx < lens[b]) | (kv_idx < 16))

    mask = Mask("late_start", mask_mod=late_start)
    B, Hq, Hkv, D = 3, 16, 4, 128
    module = port.load(port.build(mask, Lq, Lk, heads=Hq, batch=B, out_dir=tmp_path))
    module.HOPPER, module.HOPPER_LOOP = True, "persistent"
    calls = []
    real = module._attention_hopper
    module._attention_hopper = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(B, Hq, Lq, D, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(B, Hkv, Lk, D, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(B, Hkv, Lk, D, device="cuda", generator=g).to(torch.bfloat16)
    with torch.no_grad():
        first = module.attention(q, k, v, return_lse=True)
        out, lse = module.attention(q, k, v, return_lse=True)
    assert len(calls) == 2, "attention() did not run the Hopper kernel"
    assert torch.equal(first[0], out), "a second call gave other bits"
    shape = Shape(batch=B, q_heads=Hq, kv_heads=Hkv, q_len=Lq, kv_len=Lk, head_dim=D)
    ref = reference_attention(mask, Inputs(q=q, k=k, v=v, shape=shape, dtype="bfloat16", seed=1), progress=False)
    checks = [compare("out", out, ref.out, TOLERANCES["bfloat16"]),
              compare("lse", lse, ref.lse, LSE_TOLERANCE["bfloat16"])]
    assert all(c.passed for c in checks), "; ".join(
        f"{c.name}: max abs err {c.max_abs_err:.3g}, {c.bad_count} bad, {c.nan_count} NaN" for c in checks)
    assert bool((out[:, :, :300] == 0).all()) and bool(torch.isinf(lse[:, :, :300]).all())


@pytest.mark.gpu
@pytest.mark.parametrize("loop", ["pingpong", "persistent"])
def test_the_warpgroups_hand_offs_give_the_same_bits_every_way(cuda, tmp_path, loop):
    # HOPPER_NAMED: the two warpgroups take turns on the tensor cores and give K / V buffers back to
    # the load warp through named barriers (3), named turns only (1) or mbarriers (0, the default);
    # 5 and 7 are 1 and 3 with the turn taken before the tile's waits; the persistent loop also with
    # two buffers of queries (HOPPER_Q_BUFFERS = 2) and with the tile counts handed over by the load
    # warp or loaded (HOPPER_TILE_INFO flipped); both loops also with the other place of the wait
    # for P V (HOPPER_UNDER_PV: the wait first, where ptxas puts it; after the exponentials; after the
    # row max).
    # The arithmetic is the same, so the bits must be; a barrier left half done or a buffer given
    # back early would hang or mix tiles. Programs whose rows keep nothing (no turn at all), rows of
    # every length, more tiles than SMs, GQA, lengths off the 128 grid, a softcap in the ping-pong
    # loop; each setting called twice, and against float64.
    import torch

    from workbench import Mask, make, port, with_score
    from workbench.run import Inputs
    from workbench.verify import LSE_TOLERANCE, TOLERANCES, compare, reference_attention

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel runs on sm_90 only")
    lens = torch.tensor([700, 1500, 64], device="cuda")

    def late_start(b, h, q_idx, kv_idx):
        return (q_idx >= 300) & (kv_idx <= q_idx) & ((q_idx - kv_idx < lens[b]) | (kv_idx < 16))

    mask = Mask("late_start", mask_mod=late_start)
    if loop == "pingpong":
        mask = with_score(mask, make("softcap", {"cap": 20.0}))
    B, Hq, Hkv, D = 3, 16, 4, 128
    for Lq, Lk in ((2048, 2048), (1000, 1011)):
        module = port.load(port.build(mask, Lq, Lk, heads=Hq, batch=B, out_dir=tmp_path / f"{Lq}"))
        module.HOPPER, module.HOPPER_LOOP = True, loop
        calls = []
        real = module._attention_hopper
        module._attention_hopper = lambda *a, real=real, **kw: calls.append(1) or real(*a, **kw)
        g = torch.Generator(device="cuda").manual_seed(2)
        q = torch.randn(B, Hq, Lq, D, device="cuda", generator=g).to(torch.bfloat16)
        k = torch.randn(B, Hkv, Lk, D, device="cuda", generator=g).to(torch.bfloat16)
        v = torch.randn(B, Hkv, Lk, D, device="cuda", generator=g).to(torch.bfloat16)
        got = {}
        with torch.no_grad():
            for named in (3, 1, 0, 7, 5, 3):
                module.HOPPER_NAMED = named
                out, lse = module.attention(q, k, v, return_lse=True)
                torch.cuda.synchronize()
                if named in got:
                    assert torch.equal(got[named][0], out), f"HOPPER_NAMED = {named}: a second call gave other bits"
                got[named] = (out, lse)
            if loop == "persistent":  # (two buffers of queries, HOPPER_Q_BUFFERS: the same arithmetic)
                module.HOPPER_NAMED, module.HOPPER_Q_BUFFERS = 0, 2
                got["q2"] = module.attention(q, k, v, return_lse=True)
                module.HOPPER_Q_BUFFERS = 1
                # (the tile counts handed over by the load warp, HOPPER_TILE_INFO, against loaded)
                info = module.HOPPER_TILE_INFO
                module.HOPPER_TILE_INFO = 1 - info
                got["ti"] = module.attention(q, k, v, return_lse=True)
                module.HOPPER_TILE_INFO = info
            under = module.HOPPER_UNDER_PV  # (the softmax's place against the wait: the same arithmetic)
            module.HOPPER_NAMED, module.HOPPER_UNDER_PV_CHOSEN = 0, True  # (each place as named)
            for place in (0, 1, 2):  # (where ptxas puts it, after the exponentials, after the row max)
                if place != under:
                    module.HOPPER_UNDER_PV = place
                    got[f"pv{place}"] = module.attention(q, k, v, return_lse=True)
            module.HOPPER_UNDER_PV = under
        assert len(calls) == 8 + 2 * (loop == "persistent"), "attention() did not run the Hopper kernel"
        places = tuple(f"pv{place}" for place in (0, 1, 2) if place != under)
        for named in (1, 0, 7, 5) + places + (("q2", "ti") if loop == "persistent" else ()):
            assert torch.equal(got[named][0], got[3][0]) and torch.equal(got[named][1], got[3][1]), \
                f"{loop}, {Lq} x {Lk}: HOPPER_NAMED = {named} gave other bits than 3"
        out, lse = got[3]
        shape = Shape(batch=B, q_heads=Hq, kv_heads=Hkv, q_len=Lq, kv_len=Lk, head_dim=D)
        ref = reference_attention(mask, Inputs(q=q, k=k, v=v, shape=shape, dtype="bfloat16", seed=2), progress=False)
        checks = [compare("out", out, ref.out, TOLERANCES["bfloat16"]),
                  compare("lse", lse, ref.lse, LSE_TOLERANCE["bfloat16"])]
        assert all(c.passed for c in checks), f"{loop}, {Lq} x {Lk}: " + "; ".join(
            f"{c.name}: max abs err {c.max_abs_err:.3g}, {c.bad_count} bad, {c.nan_count} NaN" for c in checks)


@pytest.mark.gpu
@pytest.mark.parametrize("loop", ["specialized", "pingpong", "persistent"])
def test_a_default_wait_after_the_max_that_spills_gives_way_on_the_gpu(cuda, tmp_path, loop):
    # _under_pv_by_spills on the GPU, with the driver's own count of local memory: a user's two
    # .any() image spans spill 40-164 bytes with the wait for P V after the row max (UNDER_PV 2) and
    # none with the wait where ptxas puts it (tests/run_hopper_compile.py), so with 2 made the file's
    # default the first call must run the 0 form; causal, which spills nothing with 2, keeps it; a
    # place named in the environment (HOPPER_UNDER_PV_CHOSEN) runs as named. The same bits every
    # way, and against float64; whole blocks and Lq != Lk off the 128 grid, GQA.
    import torch

    from workbench import port
    from workbench.run import Inputs
    from workbench.verify import LSE_TOLERANCE, TOLERANCES, compare, reference_attention

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel runs on sm_90 only")
    spans = torch.tensor([[100, 300], [600, 700]], device="cuda")

    def image_spans(b, h, q_idx, kv_idx):
        both = ((q_idx[..., None] >= spans[:, 0]) & (q_idx[..., None] < spans[:, 1])
                & (kv_idx[..., None] >= spans[:, 0]) & (kv_idx[..., None] < spans[:, 1]))
        return (kv_idx <= q_idx) | both.any(-1)

    B, Hq, Hkv, D = 2, 4, 2, 128
    for mask, gives_way in ((Mask("users_image_spans", mask_mod=image_spans), True), (make("causal"), False)):
        for Lq, Lk in ((1024, 1024), (1000, 1011)):
            module = port.load(port.build(mask, Lq, Lk, heads=Hq, batch=B, out_dir=tmp_path / f"{mask.name}_{Lq}"))
            module.HOPPER, module.HOPPER_LOOP, module.HOPPER_UNDER_PV = True, loop, 2
            module.HOPPER_UNDER_PV_CHOSEN = False  # (2 as the file's default, whatever the environment says)
            spilled = []
            real = module._spill_bytes
            module._spill_bytes = lambda compiled: spilled.append(real(compiled)) or spilled[-1]
            g = torch.Generator(device="cuda").manual_seed(5)
            q = torch.randn(B, Hq, Lq, D, device="cuda", generator=g).to(torch.bfloat16)
            k = torch.randn(B, Hkv, Lk, D, device="cuda", generator=g).to(torch.bfloat16)
            v = torch.randn(B, Hkv, Lk, D, device="cuda", generator=g).to(torch.bfloat16)
            with torch.no_grad():
                out, lse = module.attention(q, k, v, return_lse=True)
                (plan, ) = module._HOPPER_PLANS.values()
                ran = plan[1].get("UNDER_PV", 0)
                module.HOPPER_UNDER_PV_CHOSEN = True  # (PORT_HOPPER_UNDER_PV=2: the place as named)
                named, named_lse = module.attention(q, k, v, return_lse=True)
            where = f"{mask.name}, {loop}, {Lq} x {Lk}: spill bytes {spilled}"
            if (Lq, Lk) == (1024, 1024):  # (whole blocks, measured offline: see above)
                assert ran == (0 if gives_way else 2), where
            assert (ran == 0) == (len(spilled) == 2 and spilled[1] < spilled[0]), where
            assert all(plan[1].get("UNDER_PV", 0) in (0, 2) for plan in module._HOPPER_PLANS.values())
            assert max(plan[1].get("UNDER_PV", 0) for plan in module._HOPPER_PLANS.values()) == 2, where
            assert torch.equal(out, named) and torch.equal(lse, named_lse), where
            shape = Shape(batch=B, q_heads=Hq, kv_heads=Hkv, q_len=Lq, kv_len=Lk, head_dim=D)
            ref = reference_attention(mask, Inputs(q=q, k=k, v=v, shape=shape, dtype="bfloat16", seed=5),
                                      progress=False)
            checks = [compare("out", out, ref.out, TOLERANCES["bfloat16"]),
                      compare("lse", lse, ref.lse, LSE_TOLERANCE["bfloat16"])]
            assert all(c.passed for c in checks), where + ": " + "; ".join(
                f"{c.name}: max abs err {c.max_abs_err:.3g}, {c.bad_count} bad, {c.nan_count} NaN" for c in checks)


@pytest.mark.gpu
@pytest.mark.parametrize("early", [True, False])
def test_a_new_kind_of_call_compiles_the_hopper_kernel_once_beside_its_block_lists(cuda, tmp_path, early):
    # HOPPER_EARLY_COMPILE: a new kind of call compiles the Hopper kernel in a second thread while
    # the block lists are built; the launch must find that compile (the JIT holds one kernel after
    # the call, not two) and the answer must be the one the plain order gives, bit for bit, and the
    # float64 reference's. A user's per-head table at Lq != Lk off the 128 grid, GQA, a persistent
    # and a pingpong (softcap) loop; a fresh kernel cache so the compile really runs.
    import torch

    from workbench import port, with_score
    from workbench.run import Inputs
    from workbench.verify import LSE_TOLERANCE, TOLERANCES, compare, reference_attention

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel runs on sm_90 only")
    w = torch.tensor([64, 300, 1000, 5000], device="cuda")

    def head_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + 400) & (q_idx + 400 - kv_idx < w[h])

    B, Hq, Hkv, Lq, Lk, D = 2, 4, 2, 1600, 2000, 128
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(B, Hq, Lq, D, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(B, Hkv, Lk, D, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(B, Hkv, Lk, D, device="cuda", generator=g).to(torch.bfloat16)
    shape = Shape(batch=B, q_heads=Hq, kv_heads=Hkv, q_len=Lq, kv_len=Lk, head_dim=D)
    for mask in (Mask("users_head_window", mask_mod=head_window), with_score(Mask("users_head_window_softcap",
                                                                                  mask_mod=head_window), make("softcap"))):
        env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / f"cache_{mask.name}_{early}"))
        old = os.environ.copy()
        os.environ.update(env)
        try:
            module = port.load(port.build(mask, Lq, Lk, heads=Hq, batch=B, out_dir=tmp_path / mask.name))
            module.HOPPER, module.HOPPER_EARLY_COMPILE = True, early
            threads = []
            real = module._compile_early
            module._compile_early = lambda *a: threads.append(real(*a)) or threads[-1]
            counted, real_count = [], module._spill_bytes  # (a default wait that spilled: two compiles)
            module._spill_bytes = lambda compiled: counted.append(real_count(compiled)) or counted[-1]
            with torch.no_grad():
                out, lse = module.attention(q, k, v, return_lse=True)
                again = module.attention(q, k, v, return_lse=True)
        finally:
            os.environ.clear()
            os.environ.update(old)
        kernel = module._hopper_kernel()
        assert len(threads) == (1 if early else 0), threads
        assert all(t is not None and not t.is_alive() for t in threads)
        assert len(kernel.device_caches[torch.cuda.current_device()][0]) == max(1, len(counted)), \
            f"the launch compiled the kernel again (spill counts {counted})"
        assert torch.equal(out, again[0]) and torch.equal(lse, again[1])
        ref = reference_attention(mask, Inputs(q=q, k=k, v=v, shape=shape, dtype="bfloat16", seed=3), progress=False)
        checks = [compare("out", out, ref.out, TOLERANCES["bfloat16"]),
                  compare("lse", lse, ref.lse, LSE_TOLERANCE["bfloat16"])]
        assert all(c.passed for c in checks), "; ".join(
            f"{c.name}: max abs err {c.max_abs_err:.3g}, {c.bad_count} bad, {c.nan_count} NaN" for c in checks)
        # the other order's bits, from a second load of the same file
        other = port.load(port.build(mask, Lq, Lk, heads=Hq, batch=B, out_dir=tmp_path / f"{mask.name}_other"))
        other.HOPPER, other.HOPPER_EARLY_COMPILE = True, not early
        with torch.no_grad():
            out2, lse2 = other.attention(q, k, v, return_lse=True)
        assert torch.equal(out, out2) and torch.equal(lse, lse2), "the compile's order changed the answer"


@pytest.mark.gpu
def test_the_persistent_kernels_tile_counter_is_left_at_zero_by_each_call(cuda, tmp_path):
    """The persistent Hopper forward takes its tiles from a counter per stream that each call puts
    back to 0 at its end (no zeroing launch per call): calls one after another, a call on a second
    stream beside one on the first, and a CUDA graph replayed twice all give the same bits as the
    first call and match float64 SDPA; the counters read 0 after each."""
    import torch

    from workbench import make, port

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel runs on sm_90 only")
    module = port.load(port.build(make("causal_sliding_window", {"window": 900}), 4096, 4096, heads=8, batch=2,
                                  out_dir=tmp_path))
    module.HOPPER_LOOP = "persistent"
    g = torch.Generator(device="cuda").manual_seed(21)
    q, k, v = (torch.randn(2, 8, 4096, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    q2 = torch.randn_like(q)

    def counters_at_zero():
        torch.cuda.synchronize()
        return bool(module._TILE_COUNTERS) and all(int(c.item()) == 0 for c in module._TILE_COUNTERS.values())

    with torch.no_grad():
        first = module.attention(q, k, v)
        assert module._hopper_ready(q, k, v, None, False, 128 ** -0.5) and counters_at_zero()
        again = [module.attention(q, k, v) for _ in range(3)]
        assert all(torch.equal(first, a) for a in again) and counters_at_zero()
        side = torch.cuda.Stream()
        other_first = module.attention(q2, k, v)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            beside = [module.attention(q2, k, v) for _ in range(2)]
        main = [module.attention(q, k, v) for _ in range(2)]
        torch.cuda.current_stream().wait_stream(side)
        assert all(torch.equal(other_first, b) for b in beside) and all(torch.equal(first, m) for m in main)
        assert len(module._TILE_COUNTERS) >= 2 and counters_at_zero()
        capture = torch.cuda.Stream()
        capture.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(capture):
            module.attention(q, k, v)  # (warm the capture stream's counter outside the capture)
        torch.cuda.current_stream().wait_stream(capture)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=capture):
            replayed = module.attention(q, k, v)
        for _ in range(2):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(replayed, first)
        assert counters_at_zero()
    idx = torch.arange(4096, device="cuda")
    keep = (idx[None, :] <= idx[:, None]) & (idx[:, None] - idx[None, :] < 900)
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=keep)
    assert not torch.isnan(first).any() and (first.double() - want).abs().max() < 2e-2
