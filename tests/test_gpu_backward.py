"""The port's backward on the GPU: every case of tests/run_port_backward.py (the corpus, random
mods, learnable tables, deterministic bitwise, refusals), then dq, dk, dv against the float64
reference at 32K tokens (causal, sliding window, a learnable bias table) and 128K for causal.
Run with `pytest -m gpu`."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workbench import Mask, make
from workbench.run import Shape
from workbench.verify import verify

ROOT = Path(__file__).resolve().parent
pytestmark = pytest.mark.gpu
BWD_SHARDS = 8  # test_the_backward_cases_match_the_reference_on_cuda's shards


@pytest.mark.parametrize("shard", [f"{i}/{BWD_SHARDS}" for i in range(BWD_SHARDS)])
def test_the_backward_cases_match_the_reference_on_cuda(cuda, shard):
    # each case compiles its own kernels (up to about 35 s a case on an H200 host): the cases (80) run in
    # BWD_SHARDS shards (BWD_SHARD=i/n: every n-th case), each its own process and its own test, so
    # that each reports on its own and none runs for many minutes (all of them in one process ran past
    # 450 s on an H100)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    limit = float(os.environ.get("BWD_SHARD_TIMEOUT", "540"))
    try:
        done = subprocess.run([sys.executable, str(ROOT / "run_port_backward.py"), "cuda", "10"], capture_output=True,
                              text=True, timeout=limit, env={**env, "BWD_SHARD": shard, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired as exc:  # a stuck or slow shard still says how far it got
        so_far = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        cases = [line for line in so_far.splitlines() if line.startswith("CASE")]
        pytest.fail(f"shard {shard} ran past {limit:.0f} s (BWD_SHARD_TIMEOUT) after {len(cases)} cases, "
                    f"{sum(' FAIL' in c for c in cases)} failed; the last: {cases[-1] if cases else 'none'}")
    summary = [line for line in done.stdout.splitlines() if line.startswith("SUMMARY")]
    fails = [line for line in done.stdout.splitlines() if " FAIL" in line]
    print("\n".join(summary))
    assert done.returncode == 0 and summary, "\n".join(fails[:20]) + done.stderr[-3000:]


def _t5(seq):
    bias = (torch.randn(8, 32, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0)) * 0.1)

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def t5(score, b, h, q_idx, kv_idx):
        d = (q_idx - kv_idx).clamp(0, seq)
        bucket = torch.where(d < 8, d, (8 + (torch.log((d.float() + 1) / 8) / 8.0 * 24).int()).clamp(max=31))
        return score + bias[h, bucket]

    return Mask("t5_learnable_bias", mask_mod=causal, score_mod=t5, data={"bias": bias.requires_grad_()})


@pytest.mark.parametrize("name, seq, head_dim", [("causal", 32768, 64), ("window", 32768, 64), ("t5", 32768, 64),
                                                 ("causal", 131072, 64), ("causal", 32768, 128), ("window", 32768, 128)])
def test_long_backward_matches_the_reference(cuda, name, seq, head_dim):
    # (through the file's defaults: on an H100 / H200 the Hopper backward's fused forms at D 64 and
    # D 128, whose dq is summed by TMA reduce-adds)
    mask = {"causal": lambda: make("causal", q_len=seq, kv_len=seq, device=cuda),
            "window": lambda: make("causal_sliding_window", {"window": 1024}, q_len=seq, kv_len=seq, device=cuda),
            "t5": lambda: _t5(seq)}[name]()
    heads = 8 if name == "t5" else 4
    verdict = verify(mask, Shape(q_heads=heads, kv_heads=2, q_len=seq, kv_len=seq, head_dim=head_dim), dtype="bfloat16",
                     device=cuda, backend="port", backward=True, seed=0)
    print(verdict.line)
    assert verdict.passed and {"dq", "dk", "dv"} <= {c.name for c in verdict.checks}, verdict.line


@pytest.mark.parametrize("form", ["overlap", "in_turn", "fused_dq", "fused_dq_summed", "fused_dq_reduce",
                                  "fused_dq_split", "fused_dq_split_reduce", "fused_dq_split_reduce_queries_down"])
@pytest.mark.parametrize("dtype, head_dim", [("bfloat16", 64), ("bfloat16", 128), ("float16", 64), ("float16", 128)])
def test_the_hopper_backward_matches_the_reference(cuda, tmp_path, dtype, head_dim, form):
    # dq, dk, dv of attention() through the Hopper backward (templates/hopper_backward.py) against
    # the float64 reference, for the library's and users' masks, GQA, Lq != Lk; each call must run
    # the Hopper kernels (not the portable ones) and two calls give the same bits; both orders of
    # the kernels' tile loops (overlapped as in FlashAttention-3, or one matmul pair after the other),
    # and the fused forms (HOPPER_BWD_FUSED_DQ: dq from the dk / dv programs by atomic adds, whose
    # bits may differ run to run: per warpgroup, or summed over the program's 128 keys first, by
    # atomics or by the copy engine's reduce-add; `split`: dQ's matmul split between the warpgroups by
    # halves of the head dim at every head dim: with the copy engine's sum keys down, as D 128 runs it
    # by default (named barriers, a dQ warp, dQ summed in register order), or queries down; with
    # atomic adds queries down). The keys-down form takes score_mods too (a softcap, per-head ALiBi
    # slopes): their scores and the derivative generated from them in each tile
    from workbench import port
    from workbench.run import make_inputs
    from workbench.verify.compare import _grad_tolerance, compare
    from workbench.verify.reference import reference_attention

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper backward runs on sm_90 only")
    bad = []
    # the masks the sm_90a compile check builds: the library's causal, full, window and documents,
    # and users' mods (an undeclared w[h] table, a lens[b] table, .any() spans, and_masks)
    sys.path.insert(0, str(ROOT))
    from run_hopper_compile import masks

    for mask in masks(device="cuda"):
        if mask.score_mod is not None and form != "fused_dq_split_reduce":  # (score_mods: the keys-down form)
            continue
        name = mask.name
        q_len, kv_len = (mask.q_len, mask.kv_len) if mask.q_len else (768, 1024)
        shape = Shape(batch=2, q_heads=4, kv_heads=2, q_len=q_len, kv_len=kv_len, head_dim=head_dim)
        module = port.load(port.build(mask, q_len, kv_len, heads=4, batch=2, out_dir=tmp_path / name))
        # both orders of the tile loop; D 128, and per-head masks at these short lengths too (by
        # default they run the portable backward below HOPPER_BWD_PER_HEAD_MIN_PAIRS, measured faster there)
        module.HOPPER_BWD_HEAD_DIMS, module.HOPPER_BWD_PER_HEAD_MIN_PAIRS = (64, 128), 0
        module.HOPPER_BWD_MIN_BLOCKS = 0  # (these short calls keep few blocks: the Hopper backward anyway)
        module.HOPPER_BWD_TILES = {d: (*tile[:3], form == "overlap") for d, tile in module.HOPPER_BWD_TILES.items()}
        module.HOPPER_BWD_FUSED_DQ = {"fused_dq": 1, "fused_dq_summed": 2, "fused_dq_reduce": 3, "fused_dq_split": 2,
                                      "fused_dq_split_reduce": 3, "fused_dq_split_reduce_queries_down": 3}.get(form, 0)
        if "split" in form:
            module.HOPPER_BWD_DQ_SPLIT_HEAD_DIMS = (64, 128)
            module.HOPPER_BWD_SPLIT_KEYS_DOWN = not form.endswith("queries_down")
        module.HOPPER_BWD_FUSED_HEAD_DIMS = (64, 128)
        module.HOPPER_BWD_SCORE = True  # (score_mods in the keys-down form: the default, PORT_HOPPER_BWD_SCORE aside)
        ran = []
        real = module._hopper_bwd_launch

        def spy(*args, real=real, ran=ran):
            done = real(*args)
            ran.append(done is not None)
            return done

        module._hopper_bwd_launch = spy
        inputs = make_inputs(shape, dtype, "cuda", seed=3, backward=True)
        grads = []
        for _ in range(2):
            q, k, v = (x.detach().clone().requires_grad_() for x in (inputs.q, inputs.k, inputs.v))
            module.attention(q, k, v).backward(inputs.grad_out)
            grads.append((q.grad, k.grad, v.grad))
        ref = reference_attention(mask, inputs, backward=True)
        if not (ran and all(ran)):
            bad.append(f"{name}: the Hopper backward did not run ({module._HOPPER_BWD_FAILED or 'not taken'})")
            continue
        # (both calls: the second launches the kernels compiled for the first straight, _launch)
        for call, label, got in [(i, label, got) for i in range(2) for label, got in zip(("dq", "dk", "dv"), grads[i])]:
            check = compare(label, got, ref.grads[label], _grad_tolerance(dtype, label, ref.grads[label], shape))
            if not check.passed or torch.isnan(got).any():
                bad.append(f"{name} {label} (call {call + 1}): max abs err {check.max_abs_err:.3g}, "
                           f"rel {check.rel_err:.3g}, {check.bad_count} bad, {check.nan_count} NaN")
        if not form.startswith("fused_dq") and not all(torch.equal(a, b) for a, b in zip(*grads)):
            bad.append(f"{name}: two calls gave different bits")
        print(name, "OK" if not bad or not bad[-1].startswith(name) else "FAIL")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_saturated_softcap_on_the_hopper_kernels_matches_the_reference(cuda, tmp_path, head_dim):
    # the score functions' Gluon copies take the chip's approximate tanh: with q scaled so a fifth
    # of the scores lie past the cap (tanh near 1, where the approximation's relative error costs
    # the most), out, lse, dq, dk and dv of the Hopper forward and backward against float64
    from workbench import port, with_score
    from workbench.run import Inputs
    from workbench.verify import LSE_TOLERANCE, TOLERANCES, compare, reference_attention
    from workbench.verify.compare import _grad_tolerance

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernels run on sm_90 only")
    mask = with_score(make("causal"), make("softcap", {"cap": 20.0}))
    shape = Shape(batch=2, q_heads=4, kv_heads=2, q_len=1024, kv_len=1024, head_dim=head_dim)
    module = port.load(port.build(mask, 1024, 1024, heads=4, batch=2, out_dir=tmp_path))
    module.HOPPER_BWD_MIN_BLOCKS = 0  # (a short call: the Hopper backward even with few blocks)
    ran = {"forward": [], "backward": []}
    fwd, bwd = module._attention_hopper, module._hopper_bwd_launch
    module._attention_hopper = lambda *a: ran["forward"].append(1) or fwd(*a)
    module._hopper_bwd_launch = lambda *a: (lambda done: ran["backward"].append(done is not None) or done)(bwd(*a))
    g = torch.Generator(device="cuda").manual_seed(5)
    draw = lambda *size: torch.randn(*size, device="cuda", generator=g)  # noqa: E731
    q = (draw(2, 4, 1024, head_dim) * 15.0).bfloat16()  # (scores about 15 N(0, 1))
    k, v = draw(2, 2, 1024, head_dim).bfloat16(), draw(2, 2, 1024, head_dim).bfloat16()
    grad_out = draw(2, 4, 1024, head_dim).bfloat16()
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse = module.attention(qg, kg, vg, return_lse=True)
    out.backward(grad_out)
    assert ran["forward"] and ran["backward"] and all(ran["backward"]), ran
    inputs = Inputs(q=q, k=k, v=v, shape=shape, dtype="bfloat16", seed=5, grad_out=grad_out)
    ref = reference_attention(mask, inputs, backward=True, progress=False)
    scores = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)) * head_dim ** -0.5
    assert (scores.abs() > 20).float().mean() > 0.15  # (the case is the one it says: past the cap)
    checks = [compare("out", out, ref.out, TOLERANCES["bfloat16"]), compare("lse", lse, ref.lse, LSE_TOLERANCE["bfloat16"])]
    checks += [compare(n, got, ref.grads[n], _grad_tolerance("bfloat16", n, ref.grads[n], shape))
               for n, got in (("dq", qg.grad), ("dk", kg.grad), ("dv", vg.grad))]
    bad = [f"{c.name}: max abs err {c.max_abs_err:.3g}, {c.bad_count} bad, {c.nan_count} NaN" for c in checks
           if not c.passed or c.nan_count]
    assert not bad, "; ".join(bad)


@pytest.mark.parametrize("forms", ["off", "bias", "all"])
@pytest.mark.parametrize("name, dtype, head_dim", [("alibi", "bfloat16", 128), ("alibi", "float16", 64),
                                                   ("users_score_biases", "bfloat16", 128)])
def test_the_fast_score_forms_on_the_hopper_kernels_match_the_reference(cuda, tmp_path, monkeypatch, name, dtype,
                                                                        head_dim, forms):
    # PORT_FAST_SCORE's forms (translate/fast_score.py; "bias" the default) in the Hopper forward: biases
    # added to the score in one fused multiply-add in base 2 ("bias"), and integer distances converted
    # per row and column ("all"), and neither ("off"); positions past 2^24 are not reached at these lengths (the CPU test
    # checks the conversion's bits there). Causal + ALiBi (per-head slopes), and a user's sum of biases
    # (ALiBi as attention-gym writes it, a relative table read at a clamped distance): out and lse of
    # the forward, and dq, dk, dv of the Hopper backward (its plain score_mod against the forward's
    # lse) against float64, at Lq != Lk (the ALiBi distance's offset)
    import importlib

    from workbench import port, with_score
    from workbench.run import make_inputs
    from workbench.verify import LSE_TOLERANCE, TOLERANCES, compare, reference_attention
    from workbench.verify.compare import _grad_tolerance

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernels run on sm_90 only")
    monkeypatch.setattr(importlib.import_module("workbench.port.generate"), "FAST_SCORE_FORMS", forms)
    sys.path.insert(0, str(ROOT))
    from run_hopper_compile import masks

    q_len, kv_len = 1024, 1280
    mask = (with_score(make("causal"), make("alibi", {"num_heads": 4}, q_len=q_len, kv_len=kv_len, device="cuda"))
            if name == "alibi" else {m.name: m for m in masks("cuda")}[name])
    path = port.build(mask, q_len, kv_len, heads=4, batch=2, out_dir=tmp_path)
    text = path.read_text()  # (the forms were written)
    assert ("gl.fma(qk, sm_scale * 1.4426950408889634, " in text) == (forms != "off")
    assert ("_sub_as_float_gluon(" in text) == (forms == "all")
    module = port.load(path)
    module.HOPPER_BWD_PER_HEAD_MIN_PAIRS = module.HOPPER_BWD_MIN_BLOCKS = 0
    ran = {"forward": [], "backward": []}
    fwd, bwd = module._attention_hopper, module._hopper_bwd_launch
    module._attention_hopper = lambda *a: ran["forward"].append(1) or fwd(*a)
    module._hopper_bwd_launch = lambda *a: (lambda done: ran["backward"].append(done is not None) or done)(bwd(*a))
    shape = Shape(batch=2, q_heads=4, kv_heads=2, q_len=q_len, kv_len=kv_len, head_dim=head_dim)
    inputs = make_inputs(shape, dtype, "cuda", seed=7, backward=True)
    qg, kg, vg = (x.detach().clone().requires_grad_() for x in (inputs.q, inputs.k, inputs.v))
    out, lse = module.attention(qg, kg, vg, return_lse=True)
    out.backward(inputs.grad_out)
    assert ran["forward"] and ran["backward"] and all(ran["backward"]), ran
    ref = reference_attention(mask, inputs, backward=True, progress=False)
    checks = [compare("out", out, ref.out, TOLERANCES[dtype]), compare("lse", lse, ref.lse, LSE_TOLERANCE[dtype])]
    checks += [compare(n, got, ref.grads[n], _grad_tolerance(dtype, n, ref.grads[n], shape))
               for n, got in (("dq", qg.grad), ("dk", kg.grad), ("dv", vg.grad))]
    bad = [f"{c.name}: max abs err {c.max_abs_err:.3g}, {c.bad_count} bad, {c.nan_count} NaN" for c in checks
           if not c.passed or c.nan_count]
    assert not bad, "; ".join(bad)


def test_one_port_called_at_several_lengths_matches_the_reference_every_call(cuda, tmp_path):
    # One generated file, called again and again: after a kind of launch has run once, _launch
    # sends the next launches of that kind straight to the compiled kernel with their own arguments
    # (lengths, heads, pointers). Forward and backward (the Hopper kernels at D 128: the persistent
    # forward, the keys-down backward, the dq unflat) at four shapes in turn, one of them twice,
    # each against the float64 reference (Lq != Lk: the window ends at the last key), and the Hopper
    # backward ran every time.
    from workbench import port
    from workbench.run import make_inputs
    from workbench.verify.compare import TOLERANCES, _grad_tolerance, compare
    from workbench.verify.reference import reference_attention

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernels run on sm_90 only")
    mask = make("causal_sliding_window", {"window": 300})
    module = port.load(port.build(mask, 1024, 1024, heads=4, batch=2, out_dir=tmp_path))
    module.HOPPER_BWD_MIN_BLOCKS = 0  # (short calls: the Hopper backward even with few blocks)
    ran = []
    real = module._hopper_bwd_launch
    module._hopper_bwd_launch = lambda *args: ran.append(1) or real(*args)
    bad = []
    for B, Hq, Hkv, Lq, Lk in ((2, 4, 2, 1024, 1024), (1, 8, 8, 2048, 2048), (2, 4, 2, 1024, 1024),
                               (1, 4, 1, 768, 1280)):
        shape = Shape(batch=B, q_heads=Hq, kv_heads=Hkv, q_len=Lq, kv_len=Lk, head_dim=128)
        inputs = make_inputs(shape, "bfloat16", "cuda", seed=Lq + Hq, backward=True)
        q, k, v = (x.detach().clone().requires_grad_() for x in (inputs.q, inputs.k, inputs.v))
        before = len(ran)
        out = module.attention(q, k, v)
        out.backward(inputs.grad_out)
        # (the file computes the window's bottom-right offset Lk - Lq per call, as the factory does)
        ref = reference_attention(make("causal_sliding_window", {"window": 300}, q_len=Lq, kv_len=Lk), inputs,
                                  backward=True)
        if len(ran) != before + 1 or module._HOPPER_BWD_FAILED:
            bad.append(f"{shape}: the Hopper backward did not run ({module._HOPPER_BWD_FAILED})")
        checks = [compare("out", out, ref.out, TOLERANCES["bfloat16"])]
        checks += [compare(label, got, ref.grads[label], _grad_tolerance("bfloat16", label, ref.grads[label], shape))
                   for label, got in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad))]
        bad += [f"{shape} {c.name}: max abs err {c.max_abs_err:.3g}, {c.bad_count} bad, {c.nan_count} NaN"
                for c in checks if not c.passed or c.nan_count]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("seq, backward", [(3072, "backward"), (3000, "portable backward")])
def test_the_lean_launch_gives_the_same_bits_is_taken_and_steps_aside_for_hooks(cuda, tmp_path, seq, backward):
    """A launch site's later calls go through the file's lean launch (LEAN_LAUNCH: tensors passed as
    addresses, descriptors expanded there, no hooks' metadata): on this Triton every site of a
    training step (forward, prep, dk / dv, dq) and of a split decode (kernel and fold) gets one and
    takes it; out, lse and the gradients are the same bits with it on and off; a CUDA graph captured
    through it replays what a plain call gives; and while a launch hook is set (a profiler's) the
    launches go through Triton's own path, where the hook sees every one. At 3,072 tokens the
    backward runs the Hopper kernels (TMA descriptors); at 3,000 the portable one."""
    import triton

    from workbench import make, port

    if not triton.__version__.startswith(("3.6.",)):
        pytest.skip(f"the lean launch knows Triton 3.6's launcher; this is {triton.__version__}")
    module = port.load(port.build(make("causal_sliding_window", {"window": 700}), seq, seq, heads=4, batch=2,
                                  out_dir=tmp_path))
    assert module.LEAN_TRITON == ("3.6.",) and module.LEAN_LAUNCH
    module.HOPPER_BWD_MIN_BLOCKS = 0  # (3,072 tokens keep few blocks: the Hopper backward anyway)
    g = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = (torch.randn(2, 4, seq, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    grad = torch.randn(2, 4, seq, 128, device="cuda", dtype=torch.bfloat16, generator=g)

    def step():
        q.grad = k.grad = v.grad = None
        out, lse = module.attention(q, k, v, return_lse=True)
        out.backward(grad)
        torch.cuda.synchronize()
        return out.detach().clone(), lse.detach().clone(), q.grad.clone(), k.grad.clone(), v.grad.clone()

    module.LEAN_LAUNCH = False
    plain = step()
    plain_again = step()  # (through the sites, Triton's own launcher)
    assert module._SITES and all(entry[2] is not None for entry in module._SITES.values()), \
        [(key[0], entry[2]) for key, entry in module._SITES.items()]
    taken = []
    for key, (runner, extra, lean) in list(module._SITES.items()):
        def counted(args, lean=lean, name=key[0]):
            done = lean(args)
            taken.append((name, done))
            return done
        module._SITES[key] = (runner, extra, counted)
    module.LEAN_LAUNCH = True
    lean = step()
    assert len(taken) >= 3 and all(done for _, done in taken), taken
    names = {name for name, _ in taken}
    assert {"forward", "prep", backward} <= names, names
    for a, b, c, what in zip(plain, plain_again, lean, ("out", "lse", "dq", "dk", "dv")):
        assert not torch.isnan(a).any() and not torch.isnan(c).any(), what
        if what == "dq" and backward == "backward":  # (the Hopper backward sums dq with atomic adds: its last
            # bits vary run to run either way, README)
            assert (a.float() - c.float()).abs().max() < 1e-2 and (a.float() - b.float()).abs().max() < 1e-2, what
            continue
        assert torch.equal(a, b) and torch.equal(a, c), what
    # a hook set: Triton's own path, and the hook sees each launch
    seen = []
    hook = lambda metadata: seen.append(metadata.get()["name"] if hasattr(metadata, "get") else metadata)  # noqa: E731
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        taken.clear()
        hooked = step()
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert taken and not any(done for _, done in taken), taken
    assert len(seen) >= len(taken), (seen, taken)
    for a, c, what in zip(plain, hooked, ("out", "lse", "dq", "dk", "dv")):
        assert torch.equal(a, c) or (what == "dq" and backward == "backward"
                                     and (a.float() - c.float()).abs().max() < 1e-2), what
    # the numbers: the forward against float64 SDPA with the window's mask
    idx = torch.arange(seq, device="cuda")
    keep = (idx[None, :] <= idx[:, None]) & (idx[:, None] - idx[None, :] < 700)
    want = torch.nn.functional.scaled_dot_product_attention(q.detach().double(), k.detach().double(),
                                                            v.detach().double(), attn_mask=keep)
    assert (plain[0].double() - want).abs().max() < 2e-2

    # a split decode through the lean launch: kernel and fold, called and replayed from a graph
    paged = port.load(port.build(make("causal"), 256, 256, heads=8, batch=2, out_dir=tmp_path / "paged"))
    kc = torch.randn(700, 16, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn_like(kc)
    table = torch.randperm(700, device="cuda", generator=g)[:2 * 350].view(2, 350).to(torch.int32)
    qd = torch.randn(2, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
    lens = torch.tensor([5587, 3001], dtype=torch.int32, device="cuda")
    with torch.no_grad():
        paged.LEAN_LAUNCH = False
        first = paged.attention_paged(qd, kc, vc, table, cu, lens)
        assert all(entry[2] is not None for entry in paged._SITES.values())
        paged.LEAN_LAUNCH = True
        second = paged.attention_paged(qd, kc, vc, table, cu, lens)
        assert {key[0] for key in paged._SITES} >= {"paged", "fold"}, list(paged._SITES)
        third = paged.attention_paged(qd, kc, vc, table, cu, lens)  # (both sites bound: the lean launches)
        assert torch.equal(first, second) and torch.equal(first, third) and not torch.isnan(first).any()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = paged.attention_paged(qd, kc, vc, table, cu, lens)
        qd.copy_(torch.randn_like(qd))
        lens.sub_(7)
        graph.replay()
        torch.cuda.synchronize()
        paged.LEAN_LAUNCH = False
        again = paged.attention_paged(qd, kc, vc, table, cu, lens)
    assert torch.equal(replayed, again) and not torch.isnan(again).any()


W4 = torch.tensor([64, 700, 2048, 300])  # a user's per-head windows, kept next to the mod
LENS2 = torch.tensor([3072, 2000])  # and per-sample lengths


def users_windows(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < W4[h]) & (kv_idx < LENS2[b])


def _kept(name: str, n: int) -> torch.Tensor:
    """[B, H, n, n] bool on the GPU: the pairs the test's mask keeps (B 2, H 4)."""
    i = torch.arange(n, device="cuda")
    causal = i[None, :] <= i[:, None]
    if name == "window":
        return (causal & (i[:, None] - i[None, :] < 700)).expand(2, 4, n, n)
    w, lens = W4.cuda()[None, :, None, None], LENS2.cuda()[:, None, None, None]
    return causal & (i[:, None] - i[None, :] < w) & (i[None, :] < lens)


@pytest.mark.parametrize("mask", ["window", "users"])
def test_the_lean_launch_encodes_tensor_maps_once_and_follows_new_tensors(cuda, tmp_path, monkeypatch, mask):
    """Training steps through the lean launch (the Hopper forward and backward, TMA descriptors)
    reuse each descriptor's tensor map while its tensor's address, shape and strides recur
    (LEAN_TMA_CACHE): five steps over the same q, k, v encode fewer maps than five steps with the
    maps encoded every launch, and give the same bits; steps over new tensors (other addresses) get
    their own maps and the same out, lse, dk, dv bits as the maps encoded afresh (dq: the Hopper
    backward's atomic sum, within 1e-2), and out and the gradients match float64 SDPA. On the
    library's sliding window and on a user's mod: an undeclared per-head window table `W4[h]` and
    per-sample lengths `LENS2[b]`, whose second sample's rows past its length keep no key (out and
    dq 0 there, never NaN)."""
    import triton
    import triton.backends.nvidia.driver as nvidia

    from workbench import port

    if not triton.__version__.startswith(("3.6.",)) or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the lean launch's descriptors: Triton 3.6 on sm_90")
    encoded = []
    real = nvidia.make_tensordesc_arg
    monkeypatch.setattr(nvidia, "make_tensordesc_arg", lambda arg, meta: encoded.append(1) or real(arg, meta))
    spec = (make("causal_sliding_window", {"window": 700}) if mask == "window"
            else Mask("users_windows", mask_mod=users_windows))
    module = port.load(port.build(spec, 3072, 3072, heads=4, batch=2, out_dir=tmp_path))
    module.HOPPER_BWD_MIN_BLOCKS = 0  # (few blocks at 3,072 tokens: the Hopper backward anyway)
    module.HOPPER_BWD_PER_HEAD_MIN_PAIRS = 0  # (and for the user's per-head windows, at few pairs)

    def inputs(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        q, k, v = (torch.randn(2, 4, 3072, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
                   for _ in range(3))
        return q, k, v, torch.randn(2, 4, 3072, 128, device="cuda", dtype=torch.bfloat16, generator=g)

    def step(q, k, v, grad):
        q.grad = k.grad = v.grad = None
        out, lse = module.attention(q, k, v, return_lse=True)
        out.backward(grad)
        torch.cuda.synchronize()
        return out.detach().clone(), lse.detach().clone(), q.grad.clone(), k.grad.clone(), v.grad.clone()

    def same(x, y):
        for a, b, what in zip(x, y, ("out", "lse", "dq", "dk", "dv")):
            assert not torch.isnan(a).any(), what
            assert torch.equal(a, b) or (what == "dq" and (a.float() - b.float()).abs().max() < 1e-2), what

    first = inputs(1)
    for _ in range(2):  # (the sites and their lean launches built)
        step(*first)
    encoded.clear()
    runs = [step(*first) for _ in range(5)]
    cached = len(encoded)
    module.LEAN_TMA_CACHE = False
    encoded.clear()
    plain = [step(*first) for _ in range(5)]
    fresh = len(encoded)
    module.LEAN_TMA_CACHE = True
    assert fresh >= 5 * 5 and cached < fresh, (cached, fresh)  # (the backward's five descriptors a step, and the forward's)
    for run in runs + plain[1:]:
        same(plain[0], run)
    other = inputs(2)  # new tensors, other addresses
    encoded.clear()
    got = step(*other)
    assert encoded, "new tensors' descriptors were not encoded"
    module.LEAN_TMA_CACHE = False
    want = step(*other)
    module.LEAN_TMA_CACHE = True
    same(want, got)
    assert not torch.equal(got[0], runs[0][0])
    q, k, v, grad = other
    keep = _kept(mask, 3072)
    rows = keep.any(-1)  # [B, H, L]: rows that keep some key
    assert (mask == "users") == bool((~rows).any())
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    # (SDPA's rows that keep nothing are NaN, FlexAttention's 0: such rows attend to everything here,
    # then are zeroed, so that no NaN reaches the reference's gradients)
    ref = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, attn_mask=keep | ~rows[..., None])
    ref = torch.where(rows[..., None], ref, 0.0)
    ref.backward(grad.double())
    assert not torch.isnan(ref).any() and (got[0].double() - ref).abs().max() < 2e-2
    for mine, want, what in ((got[2], q64.grad, "dq"), (got[3], k64.grad, "dk"), (got[4], v64.grad, "dv")):
        assert not torch.isnan(mine).any(), what
        err = float((mine.double() - want).abs().max() / want.abs().max())
        assert err < 2e-2, (what, err)
    assert torch.equal(got[0][~rows], torch.zeros_like(got[0][~rows])) and not got[2][~rows].any()


def test_calls_of_few_kept_blocks_take_the_portable_backward(cuda, tmp_path):
    """HOPPER_BWD_MIN_BLOCKS on the GPU: the causal mask at 2,048 x 2,048 with 2 heads keeps 16 x 17
    / 2 x 2 = 272 blocks, counted from its block lists; with the threshold one above that the step
    runs the portable backward, at 272 the Hopper one, and both give SDPA's gradients in float64."""
    from workbench import port

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper backward runs on sm_90 only")
    module = port.load(port.build(make("causal"), 2048, 2048, heads=2, out_dir=tmp_path))
    ran = []
    real = module._hopper_bwd_launch
    module._hopper_bwd_launch = lambda *args: ran.append(1) or real(*args)
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(1, 2, 2048, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    grad = torch.randn(1, 2, 2048, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*ref, is_causal=True).backward(grad.double())
    assert module._kept_blocks(1, 2, 2048, 2048, q.device) == 272
    for threshold, hopper in ((273, False), (272, True)):
        module.HOPPER_BWD_MIN_BLOCKS = threshold
        mine = [t.clone().requires_grad_() for t in (q, k, v)]
        before = len(ran)
        module.attention(*mine).backward(grad)
        assert (len(ran) > before) == hopper and not module._HOPPER_BWD_FAILED, (threshold, ran)
        for name, got, want in zip("qkv", mine, ref):
            err = float((got.grad.double() - want.grad).abs().max() / want.grad.abs().max())
            assert err < 2e-2, (threshold, f"d{name}", err)
