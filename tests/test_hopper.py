"""The port's Hopper kernel (Gluon, sm_90) on a machine without a GPU: it is generated for users'
mods and compiles for sm_90a without spilling registers (tests/run_hopper_compile.py, which runs
Triton's compiler against a stand-in driver). Whether it computes attention is checked on a GPU:
tests/test_gpu_port.py::test_hopper_kernel_matches_the_reference."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from workbench import Mask, make, port, with_score

ROOT = Path(__file__).resolve().parents[1]


def _has_gluon() -> bool:
    try:
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
    except ImportError:
        return False
    return True


class _Cuda:
    """A tensor's face as the files' dispatch tests (_hopper_ready, _hopper_bwd_ready,
    _hopper_paged_ready) read it: shape, dtype and a "cuda" device, contiguous, its data at `ptr`."""

    def __init__(self, *shape, dtype=None, ptr=1 << 20):
        import torch

        self.shape, self.dtype, self.device, self.ptr = shape, dtype or torch.bfloat16, torch.device("cuda", 0), ptr

    def is_contiguous(self):
        return True

    def data_ptr(self):
        return self.ptr


def _on_sm90(module, monkeypatch, hopper: bool = True):
    """The loaded file judges its calls as on an sm_90 GPU outside Triton's interpreter."""
    monkeypatch.setattr(module, "_INTERPRET", False)
    monkeypatch.setattr(module, "_capability", lambda device: (9, 0))
    if hopper:
        monkeypatch.setattr(module, "HOPPER", True)
    return module


@pytest.mark.skipif(not _has_gluon(), reason="this Triton has no Gluon Hopper module (Triton 3.5 and later)")
def test_hopper_kernel_compiles_for_sm90_without_spills():
    # a softcap score_mod (tl.sigmoid, which Gluon lacks, written out; the ping-pong loop) and a
    # user's .any() over captured image spans (the most registers of the compile script's masks;
    # the persistent loop), in the forms a call takes by default (the slow test below compiles every
    # form of every mask)
    names = ["causal_bottom_right+softcap_30", "users_image_spans"]
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "run_hopper_compile.py"), "--quick", *names],
                          capture_output=True, text=True, timeout=900,
                          env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "SUMMARY 2/2" in done.stdout, done.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(not _has_gluon(), reason="this Triton has no Gluon Hopper module (Triton 3.5 and later)")
def test_every_form_of_every_masks_hopper_kernels_compiles_for_sm90():
    # every mask of the compile script (the library's, users' tables, spans, and_masks, documents,
    # score_mods, biases added to the score, a 2-D neighbourhood), every loop form, page size and backward form a switch can choose
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "run_hopper_compile.py")], capture_output=True,
                          text=True, timeout=3000, env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "SUMMARY 12/12" in done.stdout, done.stdout[-3000:]
    # the score functions' fast forms, both (translate/fast_score.py, PORT_FAST_SCORE=1; the runs above take the
    # default, the bias form alone), on the masks with a score_mod
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "run_hopper_compile.py"), "causal_bottom_right+alibi_4heads",
                           "causal_bottom_right+softcap_30", "users_score_biases"], capture_output=True, text=True,
                          timeout=3000, env={**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
                                             "PORT_FAST_SCORE": "1"})
    assert done.returncode == 0 and "SUMMARY 3/3" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


def test_the_mods_gluon_copy_and_the_kernel_is_on_unless_turned_off(tmp_path, monkeypatch):
    # the Gluon copy of a user's mod keeps its table reads and Python floor division; the file runs
    # the Hopper kernel unless PORT_HOPPER=0 (or HOPPER = False), and never on a CPU
    ids = [0, 0, 1, 1, 1, 2, 2, 2] * 16

    def docs_floor(b, h, q_idx, kv_idx):
        import torch
        t = torch.tensor(ids)
        return (t[q_idx] == t[kv_idx]) & ((q_idx // 3) >= (kv_idx // 3))

    generated = port.generate(Mask("docs_floor", mask_mod=docs_floor), 128, 128)
    src = generated.source
    gluon_part = src[src.index("if _HAS_GLUON and HOPPER_MODS is None:"):]
    assert "HOPPER_MODS = None" in src
    assert "def mask_mod_gluon(b, h, q_idx, kv_idx, " in gluon_part and "gl.load(" in gluon_part
    assert "_py_floordiv_gluon(" in gluon_part and "tl." not in gluon_part.split("def _hopper_tile_start")[0]
    soft = port.generate(with_score(make("causal"), make("softcap")), 128, 128).source
    assert "def _tanh_fast_gluon(x)" in soft and "HOPPER_MODS = None" in soft
    monkeypatch.setenv("PORT_HOPPER", "0")
    module = port.load(port.write(generated, tmp_path / "off"))
    assert module.HOPPER is False
    monkeypatch.delenv("PORT_HOPPER", raising=False)
    module = port.load(port.write(generated, tmp_path / "on"))
    import torch
    q = torch.zeros(1, 1, 128, 64, dtype=torch.bfloat16)
    assert module.HOPPER is True and not module._hopper_ready(q, q, q, None, False)  # a CPU tensor: never


def _run_gluon_text(text: str, names: list[str]) -> dict:
    """The Gluon copies' functions run on torch tensors: gl's elementwise names as torch's, the
    approximate tanh and log2 as torch's (what they approximate), so the rewrites' algebra can be
    checked."""
    import types

    import torch

    def asm(code, constraints, args, dtype, is_pure, pack):
        exact = {"tanh.approx.f32 $0, $1;": torch.tanh, "lg2.approx.f32 $0, $1;": torch.log2}[code]
        assert constraints == "=f,f" and is_pure and pack == 1
        return exact(args[0])

    def both(op):  # (a literal takes the tensor's dtype, as in Triton)
        return lambda a, b: op(a, torch.as_tensor(b, dtype=a.dtype)) if isinstance(a, torch.Tensor) else op(
            torch.as_tensor(a, dtype=b.dtype), b)

    gl = types.SimpleNamespace(exp=torch.exp, exp2=torch.exp2, log=torch.log, where=torch.where, float32=torch.float32,
                               zeros_like=torch.zeros_like, inline_asm_elementwise=asm, minimum=both(torch.minimum),
                               abs=torch.abs, maximum=both(torch.maximum), load=lambda p: p, int32=torch.int32,
                               constexpr=int, fma=lambda a, b, c: a * b + c)
    # (an int32 seen as uint32: its bits as a number 0 .. 2^32 - 1, in int64)
    text = textwrap.dedent(text).replace("x.to(gl.float32)", "x.to(torch.float32)").replace(
        ".to(gl.uint32, bitcast=True)", ".to(torch.int64).bitwise_and(4294967295)")
    scope = {"gl": gl, "gluon": types.SimpleNamespace(jit=lambda f: f), "torch": torch}
    exec(text, scope)
    return {n: scope[n] for n in names}


def test_the_score_functions_gluon_copies_take_fast_forms_with_the_same_values():
    # score_mod_gluon / score_grad_gluon (the Hopper kernels' inner loop) use the chip's tanh (one
    # MUFU op), a sigmoid through it, divisions by constants as multiplications and a folded seed;
    # their values equal the mods' and derivatives' (tanh standing in for its approximation), and
    # the mask keeps its exact formulas
    import torch

    from workbench.port.generate import _replace_tanh

    def gelu_bias(score, b, h, q_idx, kv_idx):
        return torch.nn.functional.gelu(score / 3.0, approximate="tanh") + torch.sigmoid(score) / 2.0

    def sigmoid_mask(b, h, q_idx, kv_idx):
        return torch.sigmoid((q_idx - kv_idx) / 4.0) >= 0.5  # (float math in a mask: exact formulas)

    def log_distance(score, b, h, q_idx, kv_idx):  # (an integer divisor, a log of a distance)
        return score - torch.log((q_idx - kv_idx).abs().float() + 1) / 8

    cases = [(make("causal"), make("softcap", {"cap": 30.0}).score_mod, lambda s, q: 30.0 * torch.tanh(s / 30.0)),
             (Mask("sig", mask_mod=sigmoid_mask), gelu_bias,
              lambda s, q: torch.nn.functional.gelu(s / 3.0, approximate="tanh") + torch.sigmoid(s) / 2.0),
             (make("causal"), log_distance, lambda s, q: s - torch.log(q.abs().double() + 1) / 8)]
    for mask, score_mod, exact in cases:
        source = port.generate(with_score(mask, Mask("s", score_mod=score_mod)), 128, 128).source
        text = source[source.index("if _HAS_GLUON and HOPPER_MODS is None:"):source.index("def _hopper_tile_start")]
        text = text[text.rindex("\n", 0, text.index("@gluon.jit")) + 1:].rsplit("@gluon.jit", 1)[0]
        score_text = text[text.index("def score_mod_gluon"):]
        assert score_mod is log_distance or ("_tanh_fast_gluon(" in score_text and "_sigmoid_gluon(" not in score_text)
        assert score_mod is not log_distance or ("_log_fast_gluon(" in score_text and "gl.log(" not in score_text)
        assert not re.search(r" / \d", score_text) and "(score * 0.0)" not in score_text, score_text
        if mask.name == "sig":  # the mask's copy: the exact sigmoid, its division as written
            mask_text = text[text.index("def mask_mod_gluon"):text.index("def score_mod_gluon")]
            assert "_sigmoid_gluon(" in mask_text and " / 4.0" in mask_text and "_fast" not in mask_text
        run = _run_gluon_text(text, ["score_mod_gluon", "score_grad_gluon"])
        s = torch.linspace(-60.0, 60.0, 241, dtype=torch.float64).reshape(1, -1).to(torch.float32)
        idx = torch.zeros((), dtype=torch.int32)
        q_idx = torch.arange(-120, 121, dtype=torch.int32).reshape(1, -1)  # (kv_idx 0: distances -120 .. 120)
        s64 = s.double().requires_grad_()
        want = exact(s64, q_idx)
        (grad,) = torch.autograd.grad(want.sum(), s64)
        torch.testing.assert_close(run["score_mod_gluon"](s, idx, idx, q_idx, idx).double(), want.detach(),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(run["score_grad_gluon"](s, idx, idx, q_idx, idx).double() + 0 * s64.detach(), grad,
                                   rtol=1e-5, atol=1e-5)
    # divisions by a constant become multiplications only where float32 holds the reciprocal as a
    # normal number: a divisor of 1e-39 (1 / c past float32's range) or 0 stays a division
    from workbench.port.generate import _fast_scores

    divides = ("@gluon.jit\ndef score_mod_gluon(score, b, h, q_idx, kv_idx):\n"
                 "    return score / 4 + score / 1e-39 + score / 0.0 + score / 2.5e30 + score / 1e-30\n")
    assert _fast_scores(divides).endswith(
        f"return score * 0.25 + score / 1e-39 + score / 0.0 + score / 2.5e30 + score * {1 / 1e-30!r}\n"), _fast_scores(divides)
    # only the portable tanh is rewritten: text that begins like it is left as it is
    for other in ("(2.0 * _sigmoid_gluon(2.0 * x) - 2.0)", "(2.0 * _sigmoid_gluon(2.0 * (x + 1))",
                  "y = (2.0 * _sigmoid_gluon(2.0 * x)) * 3.0"):
        assert _replace_tanh(other) == other
    assert (_replace_tanh("(2.0 * _sigmoid_gluon(2.0 * x) - 2.0) + (2.0 * _sigmoid_gluon(2.0 * (y * 3)) - 1.0)")
            == "(2.0 * _sigmoid_gluon(2.0 * x) - 2.0) + _tanh_fast_gluon((y * 3))")


def _gluon_section(source: str) -> str:
    """The Gluon copies of a generated file's mods (helpers, mask, score, derivative), dedented."""
    text = source[source.index("if _HAS_GLUON and HOPPER_MODS is None:"):source.index("def _hopper_tile_start")]
    return text[text.rindex("\n", 0, text.index("@gluon.jit")) + 1:].rsplit("@gluon.jit", 1)[0]


def test_window_checks_in_the_masks_gluon_copy_are_one_unsigned_compare_exact_for_every_int32():
    # (x >= lo) & (x < lo + k), k a literal, is one unsigned compare of x - lo in the Gluon copy
    # (_in_range_gluon), two windows of one k one compare of the larger offset (_in_ranges_gluon: a
    # 2-D neighbourhood's row and column). The copy must keep the very pairs the mask keeps, for every
    # int32 x and lo, lo + k wrapping past 2^31 - 1 included (there the mask, in int32, keeps nothing)
    import torch

    from workbench.translate.fast_mask import RANGE_HELPERS

    run = _run_gluon_text(RANGE_HELPERS, ["_in_range_gluon", "_in_ranges_gluon"])
    top, bottom = 2 ** 31 - 1, -2 ** 31
    edges = [bottom, bottom + 1, -14, -13, -1, 0, 1, 12, 13, 14, top - 14, top - 13, top - 12, top - 1, top]
    values = torch.tensor(edges + torch.randint(bottom, top, (25,), generator=torch.Generator().manual_seed(0)).tolist(),
                          dtype=torch.int32)
    x, lo = values[:, None], values[None, :]
    for k in (0, 1, 13, 2 ** 30, top):
        want = (x >= lo) & (x < lo + k)  # int32 arithmetic, as the kernel's: lo + k wraps
        got = run["_in_range_gluon"](x, lo, k)
        assert torch.equal(got, want), (k, x.expand_as(want)[got != want][:4], lo.expand_as(want)[got != want][:4])
        x2, lo2 = values.flip(0)[:, None], values.roll(3)[None, :]
        want2 = want & (x2 >= lo2) & (x2 < lo2 + k)
        assert torch.equal(run["_in_ranges_gluon"](x, lo, x2, lo2, k), want2), k
    # an int64 operand keeps the compares as written (64-bit arithmetic, no fold)
    big = torch.tensor([2 ** 40, 5], dtype=torch.int64)
    assert run["_in_range_gluon"](big, big - 3, 4).tolist() == [True, True]
    assert run["_in_range_gluon"](big + 2 ** 32, big, 4).tolist() == [False, False]

    # in generated files: the library's 2-D neighbourhood (both axes in one compare), a user's 1-D
    # neighbourhood under a causal mask (`<=` for the upper end), Lq != Lk; the Gluon copy keeps the
    # mask's pairs, and the portable copy (the reference for the Hopper kernel) keeps the mask as written
    def natten_1d(b, h, q_idx, kv_idx):
        lo = (q_idx + 50 - 3).clamp(0, 200 - 7)
        return (kv_idx >= lo) & (kv_idx <= lo + 6) & (kv_idx <= q_idx + 50)

    def head_window(b, h, q_idx, kv_idx):  # (a window whose size is no literal: no fold)
        lo = q_idx - 4
        return (kv_idx >= lo) & (kv_idx < lo + (h + 2))

    def sinks_or_window(b, h, q_idx, kv_idx):  # (a window inside an or, lo of either sign)
        lo = q_idx - 4
        return (kv_idx < 2) | ((kv_idx >= lo) & (kv_idx < lo + 3))

    def outside(b, h, q_idx, kv_idx):  # (the same compares joined by an or: no fold)
        lo = q_idx - 4
        return (kv_idx < lo) | (kv_idx >= lo + 3)

    from torch.nn.attention.flex_attention import and_masks

    def from_start(b, h, q_idx, kv_idx):
        return kv_idx >= q_idx - 4

    def before_end(b, h, q_idx, kv_idx):
        return kv_idx < q_idx - 4 + 6

    cases = [(make("neighborhood_2d", {"kernel": 5}, q_len=150, kv_len=150), 150, 150, "_in_ranges_gluon("),
             (Mask("natten_1d", mask_mod=natten_1d), 150, 200, "_in_range_gluon("),
             (Mask("natten_1d", mask_mod=natten_1d), 1, 200, "_in_range_gluon("),  # (one query: decode)
             (Mask("and_masks_window", mask_mod=and_masks(from_start, before_end)), 64, 64, "_in_range_gluon("),
             (Mask("sinks_or_window", mask_mod=sinks_or_window), 64, 64, "_in_range_gluon("),
             (Mask("head_window", mask_mod=head_window), 64, 64, None),
             (Mask("outside", mask_mod=outside), 64, 64, None)]
    for mask, lq, lk, call in cases:
        source = port.generate(mask, lq, lk).source
        section = _gluon_section(source)
        body = section[section.index("def mask_mod_gluon"):section.index("def score_mod_gluon")]
        portable = source[source.index("def mask_mod_triton"):source.index("def mask_mod_bounds")]
        assert "_in_range" not in portable, portable
        if call is None:
            assert "_in_range" not in section, (mask.name, body)
        else:
            assert call in body, body
        run = _run_gluon_text(section, ["mask_mod_gluon"])
        q_idx = torch.arange(lq, dtype=torch.int32)[:, None]
        kv_idx = torch.arange(lk, dtype=torch.int32)[None, :]
        b = h = torch.zeros((), dtype=torch.int32)
        for h_val in (0, 3):
            h = torch.full((), h_val, dtype=torch.int32)
            got = run["mask_mod_gluon"](b, h, q_idx, kv_idx)
            want = mask.mask_mod(b, h, q_idx, kv_idx)
            assert torch.equal(got.expand_as(want), want), (mask.name, int((got != want).sum()))
            assert 0 < int(want.sum()) < lq * lk or (lq == 1 and int(want.sum()) > 0)


class _Pointer:
    """A table pointer for _run_gluon_text: `ptr + offset` moves it, gl.load reads the table there."""

    def __init__(self, table, offset=0):
        self.table, self.offset = table, offset

    def __add__(self, offset):
        return _Pointer(self.table, self.offset + offset)

    def load(self):
        import torch

        return self.table[torch.as_tensor(self.offset).long()]


def test_integer_distances_in_the_score_functions_gluon_copies_convert_per_row_and_column_with_the_same_bits():
    # (the fast score forms, translate/fast_score.py: the bias form by default, both with PORT_FAST_SCORE=1)
    # float(q_idx + c - kv_idx) in a score_mod (ALiBi's distance) converts every pair; the Gluon copy
    # converts the row part and the column part once each (_sub_as_float_gluon), split at 2^12 so
    # that the result is float32(a - b), one rounding, for every int32 a, b whose difference fits
    # int32: the same bits as the mod, past 2^24 too. A bias added to the score joins the base-2
    # scaling in one fused multiply-add (score_log2_gluon), within a rounding of the mod's value
    import torch

    from workbench.port.generate import _as_gluon
    from workbench.translate.fast_score import INDEX_HELPERS, translate_fast_score
    from workbench.translate.triton_mask import HELPERS

    run = _run_gluon_text(INDEX_HELPERS, ["_sub_as_float_gluon"])
    top, bottom = 2 ** 31 - 1, -2 ** 31
    edges = [0, 1, -1, 4095, 4096, 4097, -4096, -4097, 2 ** 24 - 1, 2 ** 24, 2 ** 24 + 1, 2 ** 24 + 3, 2 ** 25 + 1,
             -2 ** 24 - 1, 2 ** 30 + 12345, 2 ** 30 - 1, -2 ** 30 - 7, top, top - 4096, bottom, bottom + 4097]
    values = torch.tensor(edges + torch.randint(bottom, top, (40,), generator=torch.Generator().manual_seed(1)).tolist(),
                          dtype=torch.int32)
    a, b = values[:, None], values[None, :]
    exact = a.long() - b.long()  # (the true difference; float64 holds it, and rounds it once to float32)
    got = run["_sub_as_float_gluon"](a, b)
    assert got.dtype == torch.float32 and torch.equal(got, exact.double().float())
    fits = (exact >= bottom) & (exact <= top)  # there it is float32 of the int32 difference, bit for bit
    assert torch.equal(got[fits], (a - b).float()[fits]) and int(fits.sum()) > 2000
    assert not torch.equal(a.float() - b.float(), exact.double().float())  # (one conversion per side would not be exact)
    big = torch.tensor([2 ** 40 + 2 ** 16 + 1])  # (int64 converts as written)
    assert torch.equal(run["_sub_as_float_gluon"](big, torch.tensor([1])), (big - 1).float())

    slope = torch.tensor([0.5, 0.25, 0.125, 2.0 ** -20])  # (undeclared per-head and per-sample tables)
    lens = torch.tensor([3, 2 ** 24 + 5], dtype=torch.int32)
    bias = torch.randn(40, generator=torch.Generator().manual_seed(2))

    def alibi_gym(score, b, h, q_idx, kv_idx):  # attention-gym's: no abs, kv - q
        return score + slope[h] * (kv_idx - q_idx)

    def cast_distance(score, b, h, q_idx, kv_idx):  # an explicit cast, a per-sample shift, a literal divisor
        return score - (q_idx - lens[b] - kv_idx + 7).float() / 8

    def bucket(score, b, h, q_idx, kv_idx):  # a T5-style bucket: the clamp and the log in floats
        d = (q_idx - kv_idx).clamp(0, 2 ** 20)
        big = (8 + (torch.log((d.float() + 1) / 8) * 2.5).int()).clamp(max=39)
        return score + bias[torch.where(d < 8, d, big)]

    def clamped(score, b, h, q_idx, kv_idx):  # (both bounds reached in the tiles below)
        return score - (kv_idx - q_idx).clamp(-2000, 1500).float() / 1024

    def negated(score, b, h, q_idx, kv_idx):
        return score * 1.5 + (-(kv_idx - q_idx).abs()) * slope[h]

    def product(score, b, h, q_idx, kv_idx):  # (one term reads both indices: converted per pair)
        return score + (q_idx * kv_idx - q_idx).float() * 1e-9

    def biases(score, b, h, q_idx, kv_idx):  # (three biases: added, added, subtracted)
        return score + slope[h] * (kv_idx - q_idx) + bias[(q_idx - kv_idx).clamp(0, 39)] - (q_idx - lens[b]).float() / 64

    def scaled(score, b, h, q_idx, kv_idx):  # (the score times a number: no bias form)
        return score * 0.5 - slope[h] * (q_idx - kv_idx).abs()

    # (score_mod, Lq, Lk, converts a distance per row / column, the kernels' base-2 score is score + bias)
    cases = [(make("alibi", {"num_heads": 4}, q_len=3000, kv_len=3100).score_mod, 3000, 3100, True, True),
             (alibi_gym, 64, 64, True, True), (cast_distance, 64, 64, True, True), (bucket, 64, 64, True, True),
             (clamped, 64, 64, True, True), (negated, 64, 64, True, False), (product, 64, 64, False, True),
             (biases, 64, 64, True, True), (scaled, 64, 64, True, False)]
    for score_mod, lq, lk, converts, adds in cases:
        mask = with_score(make("causal") if score_mod is not product else make("full"), Mask("s", score_mod=score_mod))
        generated = port.generate(mask, lq, lk, fast_score_forms=True)
        source = generated.source
        plain = _gluon_section(port.generate(mask, lq, lk, fast_score_forms=False).source)  # (the default)
        assert "_sub_as_float" not in plain and "gl.fma(" not in plain and \
            "return score_mod_gluon(qk * sm_scale, b, h, q_idx, kv_idx" in plain
        bias_only = _gluon_section(port.generate(mask, lq, lk, fast_score_forms="bias").source)
        assert "_sub_as_float" not in bias_only and ("gl.fma(qk, sm_scale" in bias_only) == adds
        section = _gluon_section(source)
        body = section[section.index("def score_mod_gluon"):]
        portable = source[source.index("def score_mod_triton"):source.index("def mask_mod_triton")]
        assert "_sub_as_float" not in portable
        assert ("_sub_as_float_gluon(" in body) == converts, body
        log2_text = body[body.index("def score_log2_gluon"):]
        assert ("gl.fma(qk, sm_scale * 1.4426950408889634, " in log2_text) == adds, log2_text
        assert adds or ("return score_mod_gluon(qk * sm_scale, " in log2_text) != converts, log2_text
        # the walk with the conversions, as a score function (the forward's score_log2_gluon makes
        # the same walk), bit for bit against the mod
        fast_text, _, converted = translate_fast_score(score_mod, "score_mod_triton", mask)
        assert (converted > 0) == converts
        fast_gluon, why = _as_gluon([HELPERS, fast_text], {"score_mod_triton": "score_mod_gluon"})
        assert why is None, why
        run = _run_gluon_text((textwrap.dedent(section) + "\n" + INDEX_HELPERS + "\n" + fast_gluon).replace(
            "gl.load(", "_load("),
                              ["score_mod_gluon", "score_log2_gluon"])
        run["score_mod_gluon"].__globals__["_load"] = _Pointer.load
        run_bias = _run_gluon_text(bias_only.replace("gl.load(", "_load("), ["score_log2_gluon"])
        run_bias["score_log2_gluon"].__globals__["_load"] = _Pointer.load
        names = re.findall(r"def score_mod_gluon\(score, b, h, q_idx, kv_idx((?:, \w+_ptr)*)\)", body)[0]
        pointers = [_Pointer(generated.tensors[n.strip()[:-4]]) for n in names.split(",") if n.strip()]
        # positions past 2^24 (where float32 skips odd integers) and near 0, rows and columns of a tile
        for base in (0, 2 ** 24 - 40, 2 ** 27 + 3):
            q_idx = (base + torch.arange(0, 64, dtype=torch.int32) * 37)[:, None]
            kv_idx = (base + torch.arange(0, 64, dtype=torch.int32) * 41 - 900)[None, :]
            score = torch.randn(64, 64, generator=torch.Generator().manual_seed(base % 97))
            for b_val, h_val in ((0, 0), (1, 3)):
                b, h = torch.tensor(b_val, dtype=torch.int32), torch.tensor(h_val, dtype=torch.int32)
                want = score_mod(score, b, h, q_idx, kv_idx)
                got = run["score_mod_gluon"](score, b, h, q_idx, kv_idx, *pointers)
                if score_mod is bucket:  # (the copy's log is the chip's approximation: torch's log2 stands in)
                    assert torch.equal(got, want) or (got != want).float().mean() < 0.01
                else:
                    assert torch.equal(got, want), (score_mod.__name__, base, (got - want).abs().max())
                # the kernels' base-2 score: qk * (scale * log2 e) + bias * log2 e where the mod adds
                # a bias (one rounding apart from (qk * scale + bias) * log2 e, float64 the judge)
                qk, scale = score * 9.0, 0.125
                want2 = score_mod(qk.double() * scale, b, h, q_idx, kv_idx) * 1.4426950408889634
                for log2 in (run["score_log2_gluon"], run_bias["score_log2_gluon"]):  # (all forms; the bias form alone)
                    got2 = log2(qk, scale, b, h, q_idx, kv_idx, *pointers)
                    if score_mod is not bucket:
                        torch.testing.assert_close(got2.double(), want2, rtol=2e-6, atol=2e-6 * float(want2.abs().max()))


def test_fast_score_forms_other_than_off_bias_all_are_refused_naming_the_setting(monkeypatch):
    # fast_score_forms / PORT_FAST_SCORE: "off" (0), "bias" (the default), "all" (1); a typo is an error that names
    # the setting and the values, not a file silently generated without the forms
    import importlib

    from workbench.define import WorkbenchError

    generator = importlib.import_module("workbench.port.generate")
    mask = with_score(make("causal"), make("alibi", {"num_heads": 4}))
    with pytest.raises(WorkbenchError, match=r"fast_score_forms='fast' is not one of \('off', 'bias', 'all'\).*Fix: pass"):
        port.generate(mask, 256, 256, fast_score_forms="fast")
    monkeypatch.setenv("PORT_FAST_SCORE", "bais")
    monkeypatch.setattr(generator, "FAST_SCORE_FORMS", "bais")
    with pytest.raises(WorkbenchError, match=r"PORT_FAST_SCORE='bais'.*is not one of.*set PORT_FAST_SCORE to 0, bias or all"):
        port.generate(mask, 256, 256)
    assert "gl.fma(qk, sm_scale" in port.generate(mask, 1, 300, fast_score_forms="bias").source  # (Lq = 1)
    # the variable as a process reads it
    code = "import workbench.port.generate as g, sys; print(sys.modules['workbench.port.generate'].FAST_SCORE_FORMS)"
    # (unset or empty: "bias", the default, timed on an H100: docs/benchmarks.md)
    for value, want in ((None, "bias"), ("", "bias"), ("0", "off"), ("off", "off"), ("1", "all"), ("bias", "bias"),
                        ("all", "all"), ("fast", "fast")):
        env = {n: x for n, x in os.environ.items() if n != "PORT_FAST_SCORE"}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                              env=env if value is None else {**env, "PORT_FAST_SCORE": value})
        assert done.stdout.strip() == want, (value, done.stdout, done.stderr[-500:])


def test_mods_with_a_name_gluon_lacks_keep_the_portable_kernel():
    # a translation that writes a Triton name with no Gluon counterpart gets no Gluon copy: the file
    # says why (HOPPER_MODS) and the Hopper kernel never takes its calls
    from workbench.port.generate import _gluon_mods

    part = "@triton.jit\ndef mask_mod_triton(b, h, q_idx, kv_idx):\n    return tl.cumsum(q_idx, 0) >= kv_idx\n"
    text, reason, _ = _gluon_mods([part])
    assert reason == "the mods use tl.cumsum, which Gluon does not have" and "mask_mod_gluon" not in text
    text, reason, _ = _gluon_mods([part.replace("tl.cumsum(q_idx, 0)", "tl.maximum(q_idx, 0)")])
    assert reason is None and "gl.maximum(q_idx, 0)" in text and "@gluon.jit" in text
    # the score_mod's derivative gets its own copy (score_grad_gluon, for the Hopper backward); one
    # that needs a name Gluon lacks costs the backward its Hopper kernel, not the forward
    helpers = "@triton.jit\ndef _py_mod(a, b):\n    return a % b\n"
    score = "@triton.jit\ndef score_mod_triton(score, b, h, q_idx, kv_idx):\n    return tl.sigmoid(score) * 8.0\n"
    grad = ("@triton.jit\ndef score_grad_triton(score, b, h, q_idx, kv_idx):\n"
            "    return tl.sigmoid(score) * (1.0 - tl.sigmoid(score)) * 8.0 + _py_mod(kv_idx, 2) * 0.0\n")
    text, reason, why_grad = _gluon_mods([helpers, part.replace("tl.cumsum(q_idx, 0)", "q_idx"), score, grad])
    assert reason is None and why_grad is None, (reason, why_grad)
    assert "def score_grad_gluon(" in text and "_py_mod_gluon(kv_idx, 2)" in text and "_sigmoid_fast_gluon(score)" in text
    assert text.count("def _py_mod_gluon(") == 1 and text.count("def _sigmoid_fast_gluon(") == 1
    text, reason, why_grad = _gluon_mods([part.replace("tl.cumsum(q_idx, 0)", "q_idx"), score,
                                          grad.replace("tl.sigmoid(score) * (", "tl.cumsum(score, 0) * (")])
    assert reason is None and "def score_mod_gluon(" in text
    assert why_grad == "the score_mod's derivative uses tl.cumsum, which Gluon does not have"
    assert "def score_grad_gluon(" in text and "cumsum" not in text  # (a stand-in the backward never calls)


@pytest.mark.skipif(not _has_gluon(), reason="this Triton has no Gluon Hopper module (Triton 3.5 and later)")
def test_a_loop_the_kernel_does_not_have_is_refused_by_name(tmp_path):
    import torch

    module = port.load(port.build(make("causal"), 128, 128, out_dir=tmp_path))
    module.HOPPER_LOOP = "ping-pong"
    q = torch.zeros(1, 1, 128, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="HOPPER_LOOP = 'ping-pong' names no form.*'auto', 'specialized', "
                       "'pingpong', 'persistent'"):
        module._hopper_launch(q, q, q, 0.125, False, {})


_FAILING_HOPPER = """
import sys, warnings
import torch
from workbench import make, port
from workbench.run import Inputs, Shape
from workbench.verify import reference_attention

mask = make("causal_sliding_window", {"window": 40})
module = port.load(port.build(mask, 128, 128, heads=2, out_dir=sys.argv[1]))
attempts = []

class Broken:  # the Hopper kernel as a Triton it was not built for would launch it
    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            attempts.append(grid)
            raise RuntimeError("PTX .version 9.9 does not support .target sm_90a")
        return launch

module._hopper_specialized_kernel = module._hopper_persistent_kernel = Broken()
module._hopper_launch = lambda q, k, v, scale, return_lse, tables: ((1, 1), (), {}, None, None, None)
# a CPU is never sm_90: take the Hopper path unless this kind of call already failed
module._hopper_ready = lambda q, k, v, bounds, invariant, scale=None: \
    (q.dtype, q.shape[-1], module._hopper_loop()) not in module._HOPPER_FAILED
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 128, 32, generator=g) for _ in range(3))
with warnings.catch_warnings(record=True) as first:
    warnings.simplefilter("always")
    out = module.attention(q, k, v)
ref = reference_attention(mask, Inputs(q=q, k=k, v=v, shape=Shape(q_heads=2, q_len=128, head_dim=32),
                                       dtype="float32", seed=0), progress=False)
with warnings.catch_warnings(record=True) as second:
    warnings.simplefilter("always")
    again = module.attention(q, k, v)
print("WARNED", [str(w.message) for w in first if w.category is RuntimeWarning])
print("ERROR", float((out.double() - ref.out).abs().max()), bool(torch.isnan(out).any()))
print("ATTEMPTS", len(attempts), "SECOND", len(second), torch.equal(again, out))
"""


def test_a_hopper_kernel_that_fails_here_warns_once_and_the_portable_kernel_answers(tmp_path):
    # a compile or launch failure of the Hopper kernel (a Triton or driver the kernel was not built
    # for) must not cost the user the call: one warning naming the cause, the portable kernel's
    # answer (equal to the float64 reference), and later calls of that kind skip the attempt
    # (under Triton's interpreter, in a process of its own)
    script = tmp_path / "failing.py"
    script.write_text(_FAILING_HOPPER)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "port")], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in done.stdout.splitlines() if " " in line}
    assert "the Hopper kernel (persistent loop, torch.float32, D 32) failed here (RuntimeError: PTX .version 9.9" \
        in lines["WARNED"] and "portable kernel instead" in lines["WARNED"] and "PORT_HOPPER=0" in lines["WARNED"]
    error, nan = lines["ERROR"].split()
    assert float(error) < 1e-4 and nan == "False", lines["ERROR"]
    assert lines["ATTEMPTS"] == "1 SECOND 0 True", lines["ATTEMPTS"]


def test_an_older_triton_runs_the_portable_kernel_only(tmp_path, monkeypatch):
    # the Hopper kernel is written against Triton 3.6's Gluon; with 3.5 the file must not try it
    import triton

    monkeypatch.setattr(triton, "__version__", "3.5.1")
    module = port.load(port.build(make("causal"), 128, 128, out_dir=tmp_path))
    assert module._HAS_GLUON is False and "_hopper_specialized_kernel" not in vars(module)
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    module = port.load(port.build(make("causal"), 128, 128, out_dir=tmp_path / "new"))
    assert module._HAS_GLUON is _has_gluon()


@pytest.mark.skipif(not _has_gluon(), reason="this Triton has no Gluon Hopper module (Triton 3.5 and later)")
def test_lengths_off_the_128_grid_take_the_hopper_kernel_unless_turned_off(tmp_path, monkeypatch):
    # HOPPER_RAGGED (on by default): at least 128 queries and 128 keys; Lq = 1 (decode) or fewer
    # than 128 keys always run the portable kernel, and so does every length off the grid when it is off. The call is judged as on an sm_90 GPU.
    import torch

    module = _on_sm90(port.load(port.build(make("causal"), 128, 128, out_dir=tmp_path)), monkeypatch)

    def takes(lq, lk, d=128, dtype=torch.bfloat16):
        q, kv = _Cuda(1, 4, lq, d, dtype=dtype), _Cuda(1, 2, lk, d, dtype=dtype)
        return module._hopper_ready(q, kv, kv, None, False, 0.1)

    assert module.HOPPER_RAGGED is True
    assert takes(1000, 1011) and takes(128, 129) and takes(1024, 2048)
    assert not takes(1, 1011) and not takes(127, 1011) and not takes(1000, 100)
    assert not takes(1000, 1011, d=96) and not takes(1000, 1011, dtype=torch.float32)
    # TMA reads from 16-byte boundaries: a slice starting elsewhere runs the portable kernel (rather
    # than failing the descriptor's check, which would turn the Hopper kernel off for the process)
    kv = _Cuda(1, 2, 1024, 128)
    assert module._hopper_ready(_Cuda(1, 4, 1024, 128, ptr=(1 << 20) + 16), kv, kv, None, False, 0.1)
    assert not module._hopper_ready(_Cuda(1, 4, 1024, 128, ptr=(1 << 20) + 8), kv, kv, None, False, 0.1)
    assert not module._hopper_ready(kv, _Cuda(1, 2, 1024, 128, ptr=2), kv, None, False, 0.1)
    monkeypatch.setattr(module, "HOPPER_RAGGED", False)
    assert takes(1024, 2048) and not takes(1000, 1011) and not takes(1024, 1000)
    # the environment variable reaches a freshly loaded file
    monkeypatch.setenv("PORT_HOPPER_RAGGED", "0")
    assert port.load(port.build(make("causal"), 128, 128, out_dir=tmp_path / "off")).HOPPER_RAGGED is False


def test_kept_blocks_are_counted_from_the_lists_once_and_never_while_a_graph_captures(tmp_path, monkeypatch):
    """_kept_blocks: the partial and full blocks of the block lists, times the batch entries and
    heads the lists stand for (one line for all where the mask reads neither), counted once per
    shape; while a CUDA graph captures a shape not counted yet it returns None without reading
    the lists (no sync), and counts at the next call outside the capture."""
    import torch

    causal = port.load(port.build(make("causal"), 128, 128, out_dir=tmp_path / "causal"))
    built = []

    def lists(batch, heads, q_len, kv_len, device):
        built.append((batch, heads, q_len, kv_len))
        partial = torch.tensor([[[1, 0, 2, 1]]], dtype=torch.int32)  # [1, 1, rows]: one line for every (b, h)
        full = torch.tensor([[[0, 3, 1, 2]]], dtype=torch.int32)
        return partial, None, full, None

    monkeypatch.setattr(causal, "block_lists", lists)
    cpu = torch.device("cpu")
    assert causal._kept_blocks(2, 4, 512, 512, cpu) == 10 * 2 * 4
    assert causal._kept_blocks(2, 4, 512, 512, cpu) == 80 and len(built) == 1  # (counted once)
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    cuda = torch.device("cuda", 0)
    assert causal._kept_blocks(1, 8, 512, 512, cuda) is None and len(built) == 1
    capturing[0] = False
    assert causal._kept_blocks(1, 8, 512, 512, cuda) == 80 and len(built) == 2
    capturing[0] = True  # (counted already: the count, with no sync)
    assert causal._kept_blocks(1, 8, 512, 512, cuda) == 80 and len(built) == 2

    def per_head_lists(batch, heads, q_len, kv_len, device):  # [1, heads, rows]: a line per head
        return torch.ones(1, heads, 4, dtype=torch.int32), None, torch.zeros(1, heads, 4, dtype=torch.int32), None

    monkeypatch.setattr(causal, "block_lists", per_head_lists)
    assert causal._kept_blocks(3, 4, 512, 256, cpu) == 4 * 4 * 3


USERS_W = None  # (a user's per-head windows and per-sample lengths, set by the test below)
USERS_LENS = None


def _users_head_window(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx + 256) & (q_idx + 256 - kv_idx < USERS_W[h])


def _users_lengths(b, h, q_idx, kv_idx):
    return kv_idx < USERS_LENS[b]


def test_kept_blocks_of_users_mods_at_lq_not_lk_equal_a_dense_count(tmp_path):
    """_kept_blocks on the lists of mods written as users write them (an undeclared per-head table
    w[h], a per-sample table lens[b]) at Lq 384 != Lk 640, B 2, H 4, under Triton's interpreter:
    the blocks of 128 x 128 pairs where the dense mask keeps any pair, counted with torch."""
    import torch

    global USERS_W, USERS_LENS
    USERS_W, USERS_LENS = torch.tensor([1, 100, 300, 900]), torch.tensor([130, 640])
    b, h = torch.arange(2)[:, None, None, None], torch.arange(4)[None, :, None, None]
    q_idx, kv_idx = torch.arange(384)[None, None, :, None], torch.arange(640)[None, None, None, :]
    for name, mod in (("head_window", _users_head_window), ("lengths", _users_lengths)):
        dense = mod(b, h, q_idx, kv_idx).expand(2, 4, 384, 640)
        want = int(dense.reshape(2, 4, 3, 128, 5, 128).any(5).any(3).sum())
        path = port.write(port.generate(Mask(name, mask_mod=mod), 384, 640, heads=4, batch=2), tmp_path / name)
        code = ("import sys, torch; sys.path.insert(0, sys.argv[2]); from workbench import port; "
                "m = port.load(sys.argv[1]); print('KEPT', m._kept_blocks(2, 4, 384, 640, torch.device('cpu')))")
        done = subprocess.run([sys.executable, "-c", code, str(path), str(ROOT)], capture_output=True, text=True,
                              timeout=300, env=dict(os.environ, TRITON_INTERPRET="1"))
        assert f"KEPT {want}" in done.stdout, (name, want, done.stdout[-500:] + done.stderr[-2000:])
        assert 0 < want < 2 * 4 * 3 * 5, want  # (some blocks kept, some not: the count can tell)


@pytest.mark.skipif(not _has_gluon(), reason="this Triton has no Gluon Hopper module (Triton 3.5 and later)")
def test_the_hopper_backward_takes_mask_only_calls_at_whole_blocks(tmp_path, monkeypatch):
    # the backward's Hopper kernels take what they were written for (sm_90, bf16 / fp16, Lq and Lk
    # multiples of 128, no score_mod, no learning tables) at the head dims where they were measured
    # faster: the fused forms at D 64 and 128, the two deterministic kernels at D 64 only; the rest
    # runs the portable backward, and PORT_HOPPER_BWD=0 turns them off. The call is judged as on sm_90.
    import torch

    kept = [1 << 20]  # (the blocks the mask keeps, as _kept_blocks would count them from the lists)

    def ready(module, lq=1024, lk=2048, d=128, dtype=torch.bfloat16, learn=(), deterministic=False):
        _on_sm90(module, monkeypatch, hopper=False)
        monkeypatch.setattr(module, "_kept_blocks", lambda *args: kept[0])
        q, kv = _Cuda(1, 4, lq, d, dtype=dtype), _Cuda(1, 2, lk, d, dtype=dtype)
        return module._hopper_bwd_ready(q, kv, kv, learn, deterministic)

    causal = port.load(port.build(make("causal"), 128, 128, out_dir=tmp_path / "causal"))
    assert causal.HOPPER_BWD is True
    assert ready(causal, d=64) and ready(causal, d=64, dtype=torch.float16) and ready(causal, d=64, deterministic=True)
    assert ready(causal, d=128) and ready(causal, d=128, dtype=torch.float16)  # the split fused form
    # deterministic at D 128: the two kernels were measured slower than the portable backward there
    assert not ready(causal, d=128, deterministic=True)
    monkeypatch.setattr(causal, "HOPPER_BWD_FUSED_DQ", 0)
    assert not ready(causal, d=128) and ready(causal, d=64)
    monkeypatch.setattr(causal, "HOPPER_BWD_HEAD_DIMS", (64, 128))
    assert ready(causal, d=128) and ready(causal, d=128, deterministic=True)
    assert not ready(causal, lq=1000) and not ready(causal, lk=1011) and not ready(causal, d=96)
    assert not ready(causal, lq=1)  # decode
    assert not ready(causal, dtype=torch.float32) and not ready(causal, learn=("bias",))
    off = _Cuda(1, 2, 2048, 128, ptr=(1 << 20) + 2)  # (off TMA's 16-byte alignment)
    assert not causal._hopper_bwd_ready(_Cuda(1, 4, 1024, 128), off, _Cuda(1, 2, 2048, 128), ())
    # a call whose mask keeps fewer than HOPPER_BWD_MIN_BLOCKS blocks runs the portable backward (a
    # step bound by the host); uncounted (a CUDA graph capturing a new shape), the Hopper one
    assert causal.HOPPER_BWD_MIN_BLOCKS == 4096
    kept[0] = 4095
    assert not ready(causal, d=64) and not ready(causal, d=128)
    kept[0] = None
    assert ready(causal, d=64) and ready(causal, d=128)
    kept[0] = 4096
    assert ready(causal, d=128)
    kept[0] = 1
    monkeypatch.setattr(causal, "HOPPER_BWD_MIN_BLOCKS", 0)
    assert ready(causal, d=128)
    monkeypatch.setattr(causal, "HOPPER_BWD_MIN_BLOCKS", 4096)
    kept[0] = 1 << 20
    w = torch.tensor([64, 128, 256, 512])

    def head_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < w[h])

    per_head = port.load(port.build(Mask("users_head_window", mask_mod=head_window), 128, 128, heads=4,
                                    out_dir=tmp_path / "head"))
    # per-head lists: on calls of HOPPER_BWD_PER_HEAD_MIN_PAIRS pairs and more (measured slower below)
    assert per_head.MASK_READS_HEAD and per_head.HOPPER_BWD_PER_HEAD and not ready(per_head, d=64)
    monkeypatch.setattr(per_head, "HOPPER_BWD_PER_HEAD_MIN_PAIRS", 4 * 1024 * 2048)  # (B 1, Hq 4, 1024 x 2048)
    assert ready(per_head, d=64) and not ready(per_head, d=64, lk=1024)
    monkeypatch.setattr(per_head, "HOPPER_BWD_PER_HEAD", False)
    assert not ready(per_head, d=64)
    # a score_mod: in the keys-down form (its scores and their derivative in each tile), where the
    # derivative has a Gluon copy and HOPPER_BWD_SCORE is on (the default); never deterministic
    # or learning
    soft = port.load(port.build(with_score(make("causal"), make("softcap")), 128, 128, out_dir=tmp_path / "soft"))
    assert soft.HOPPER_GRAD is None and soft.HOPPER_BWD_SCORE is True
    assert "def score_grad_gluon(" in open(soft.__file__).read()
    keys_down = soft._HAS_TMA_REDUCE  # (form 3 needs the builder's TMA reduce-adds)
    assert ready(soft, d=64) == keys_down and ready(soft, d=128) == keys_down
    assert not ready(soft, d=64, deterministic=True) and not ready(soft, d=64, learn=("cap",))
    monkeypatch.setattr(soft, "HOPPER_BWD_SPLIT_KEYS_DOWN", False)  # (queries down: no score path)
    assert not ready(soft, d=128)
    monkeypatch.setattr(soft, "HOPPER_BWD_SPLIT_KEYS_DOWN", True)
    monkeypatch.setattr(soft, "HOPPER_GRAD", "the score_mod's derivative uses tl.cumsum, which Gluon does not have")
    assert not ready(soft, d=64)
    monkeypatch.setattr(soft, "HOPPER_GRAD", None)
    monkeypatch.setattr(soft, "HOPPER_BWD_SCORE", False)
    assert not ready(soft, d=64)
    monkeypatch.setenv("PORT_HOPPER_BWD_SCORE", "0")
    assert port.load(port.build(with_score(make("causal"), make("softcap")), 128, 128,
                                out_dir=tmp_path / "soft_off")).HOPPER_BWD_SCORE is False
    monkeypatch.setenv("PORT_HOPPER_BWD", "0")
    off = port.load(port.build(make("causal"), 128, 128, out_dir=tmp_path / "off"))
    assert off.HOPPER_BWD is False and not ready(off, d=64)
    # dq from the dk / dv programs (five matmuls a pair instead of seven), summed over a program's
    # 128 keys and added by TMA reduce-adds: the default at D 64 and 128 (split between the
    # warpgroups keys down); PORT_HOPPER_BWD_FUSED_DQ picks another form (0: the two kernels)
    fresh = port.load(port.build(make("causal"), 128, 128, out_dir=tmp_path / "fresh"))
    assert fresh.HOPPER_BWD_FUSED_DQ == 3 and fresh.HOPPER_BWD_FUSED_HEAD_DIMS == (64, 128)
    assert fresh.HOPPER_BWD_DQ_SPLIT_HEAD_DIMS == (64, 128) and fresh.HOPPER_BWD_SPLIT_KEYS_DOWN
    monkeypatch.setenv("PORT_HOPPER_BWD_FUSED_DQ", "0")
    assert port.load(port.build(make("causal"), 128, 128, out_dir=tmp_path / "fused")).HOPPER_BWD_FUSED_DQ == 0
    # a value that names no form: refused with the forms there are
    monkeypatch.setenv("PORT_HOPPER_BWD_FUSED_DQ", "yes")
    with pytest.raises(ValueError, match=r"PORT_HOPPER_BWD_FUSED_DQ='yes' names no form.*0 \(two kernels"):
        port.load(port.build(make("causal"), 128, 128, out_dir=tmp_path / "bad"))
    monkeypatch.delenv("PORT_HOPPER_BWD_FUSED_DQ")
    monkeypatch.delenv("PORT_HOPPER_BWD")
    # the thresholds from the environment: a call keeping 1,000 blocks takes the Hopper backward
    # once PORT_HOPPER_BWD_MIN_BLOCKS is 1,000 or less; a value that is no whole number is refused
    monkeypatch.setenv("PORT_HOPPER_BWD_MIN_BLOCKS", "1000")
    monkeypatch.setenv("PORT_HOPPER_BWD_PER_HEAD_MIN_PAIRS", "0")
    low = port.load(port.build(make("causal"), 128, 128, out_dir=tmp_path / "low"))
    assert low.HOPPER_BWD_MIN_BLOCKS == 1000 and low.HOPPER_BWD_PER_HEAD_MIN_PAIRS == 0
    kept[0] = 1000
    assert ready(low, d=128) and not ready(causal, d=128)  # (causal: the default, 4,096)
    kept[0] = 999
    assert not ready(low, d=128)
    for bad in ("8k", "-1", "\u00b2"):  # (a superscript two is a digit to str.isdigit, not to int())
        monkeypatch.setenv("PORT_HOPPER_BWD_MIN_BLOCKS", bad)
        with pytest.raises(ValueError, match=rf"PORT_HOPPER_BWD_MIN_BLOCKS={bad!r} is not a whole number.*default, 4096"):
            port.load(port.build(make("causal"), 128, 128, out_dir=tmp_path / f"bad_blocks_{ord(bad[-1])}"))


@pytest.mark.skipif(not _has_gluon(), reason="this Triton has no Gluon Hopper module (Triton 3.5 and later)")
def test_the_fused_dq_form_is_never_taken_with_deterministic(tmp_path, monkeypatch):
    # HOPPER_BWD_FUSED_DQ adds dq with atomics (bits vary run to run): a deterministic backward must
    # take the two-kernel form, and so must head dims outside HOPPER_BWD_FUSED_HEAD_DIMS. The
    # kernels are not launched here: the plan is recorded and its tensors returned, and the float32
    # sum of the fused form comes back in q's dtype.
    import torch

    module = port.load(port.build(make("causal"), 128, 128, out_dir=tmp_path))
    assert module.HOPPER_BWD_FUSED_DQ == 3
    monkeypatch.setattr(module, "HOPPER_BWD_FUSED_DQ", 2)
    asked = []

    def plan(q, k, v, dout, lse2, delta, scale, tables, fused=False, zeroed=None):
        asked.append(fused)
        dq = torch.ones(q.shape, dtype=torch.float32 if fused else q.dtype)
        return dq, torch.zeros_like(k), torch.zeros_like(v), []

    monkeypatch.setattr(module, "_hopper_bwd_plan", plan)
    q = torch.randn(1, 2, 128, 64, dtype=torch.bfloat16)
    rows = torch.zeros(1, 2, 128)
    for deterministic in (True, False):
        dq, dk, dv = module._hopper_bwd_launch(q, q, q, q, rows, rows, 0.125, {}, deterministic)
        assert dq.dtype == torch.bfloat16 and bool((dq == 1).all())
    wide = torch.randn(1, 2, 128, 96, dtype=torch.bfloat16)  # (D 96: no fused form there)
    module._hopper_bwd_launch(wide, wide, wide, wide, rows, rows, 0.125, {}, False)
    # form 3 (TMA reduce-adds) where Triton's builder has them, else form 2
    monkeypatch.setattr(module, "HOPPER_BWD_FUSED_DQ", 3)
    module._hopper_bwd_launch(q, q, q, q, rows, rows, 0.125, {}, False)
    monkeypatch.setattr(module, "_HAS_TMA_REDUCE", False)
    module._hopper_bwd_launch(q, q, q, q, rows, rows, 0.125, {}, False)
    assert asked == [0, 2, 0, 3, 2]
    monkeypatch.setattr(module, "HOPPER_BWD_FUSED_DQ", 5)  # (set in the file or on the module)
    with pytest.raises(ValueError, match=r"HOPPER_BWD_FUSED_DQ = 5 names no form.*\(0, 1, 2, 3\)"):
        module._hopper_bwd_launch(q, q, q, q, rows, rows, 0.125, {}, False)


def test_the_keys_down_splits_flat_dq_comes_back_in_order(tmp_path):
    # The keys-down split (D 64 and 128) sums dq flat: each math warpgroup stores its [64 queries,
    # D / 2] dQ tile as gl.reshape(gl.permute(gl.reshape(dq, [4, 2, 8, J, 4, 2]), [3, 0, 2, 4, 1, 5]),
    # [2 J, 256]) into chunk (b, h, tile, half) of a flat float32 buffer (J = D / 16). The same
    # reshape / permute done here on random tiles must come back from _dq_unflat as the tiles, bit for
    # bit, in q's dtype; and the plan takes that form (a flat dq, descriptors of D / 8 rows x 256)
    # for form 3 at the split's head dims, the queries-down one for form 2.
    import torch

    module = port.load(port.build(make("causal"), 128, 128, out_dir=tmp_path))
    assert module.HOPPER_BWD_SPLIT_KEYS_DOWN and module.HOPPER_BWD_DQ_SPLIT_HEAD_DIMS == (64, 128)
    gen = torch.Generator().manual_seed(0)
    for D in (64, 128):
        B, Hq, Lq, J = 2, 3, 192, D // 16
        dq = torch.randn(B, Hq, Lq, D, generator=gen)
        chunks = []
        for b in range(B):
            for h in range(Hq):
                for tile in range(Lq // 64):
                    for half in range(2):
                        part = dq[b, h, tile * 64:(tile + 1) * 64, half * D // 2:(half + 1) * D // 2]
                        chunks.append(part.reshape(4, 2, 8, J, 4, 2).permute(3, 0, 2, 4, 1, 5).reshape(2 * J, 256))
        flat = torch.cat(chunks).reshape(-1)
        for dtype in (torch.float32, torch.bfloat16):
            back = module._dq_unflat(flat, dq.shape, dtype)
            assert back.dtype == dtype and back.shape == dq.shape and torch.equal(back, dq.to(dtype)), (D, dtype)
        # one element by hand: query 16 * 2 + 8 + 5 of tile 1, column D / 2 + 8 * 1 + 2 * 3 + 1
        # (warp 2, row half 1, lane 4 * 5 + 3, j 1, p 1) of (b 1, h 2) sits at j * 512 + lane's 4
        # values + 2 * 1 + 1 in chunk ((1 * Hq + 2) * 3 + 1) * 2 + 1
        chunk = ((1 * Hq + 2) * (Lq // 64) + 1) * 2 + 1
        at = chunk * 64 * D // 2 + 1 * 512 + (32 * 2 + 4 * 5 + 3) * 4 + 2 * 1 + 1
        assert flat[at] == dq[1, 2, 64 + 16 * 2 + 8 + 5, D // 2 + 8 + 6 + 1]
    if not _has_gluon():
        return
    rows = 8
    zeros = torch.zeros(rows, dtype=torch.int32), torch.zeros(rows, rows, dtype=torch.int32)
    module.column_lists = lambda *args, **kw: (*zeros, *zeros)
    module._SM_COUNTS[torch.device("cpu")] = 132  # (a persistent form's programs: an H100's / H200's SMs)
    for D, fused, keys in ((128, 3, True), (64, 3, True), (128, 2, False)):
        q = torch.zeros(1, 2, 1024, D, dtype=torch.bfloat16)
        stats = torch.zeros(1, 2, 1024)
        tables = module._tables(torch.device("cpu"), 1024, 1024)
        dq, dk, dv, launches = module._hopper_bwd_plan(q, q, q, q, stats, stats, 0.125, tables, fused=fused)
        (kernel, grid, args, options, site), = launches
        assert options["KEYS_SPLIT"] == keys and options["DQ_SPLIT"] == (not keys), (D, fused, options)
        # every argument where the kernel's signature has it (what is shared per site included)
        names = kernel.arg_names
        for name, want in (("DK", dk), ("DV", dv), ("DQ_acc", dq), ("Lse2", stats), ("Lq", 1024), ("Lk", 1024),
                           ("Hq", 2), ("sm_scale", 0.125)):
            got = args[names.index(name)]
            assert got is want if isinstance(want, torch.Tensor) else got == want, (name, got)
        # a second call of the site: new gradient tensors, the same grid and options
        dq2, _, _, ((_, grid2, args2, options2, site2), ) = module._hopper_bwd_plan(q, q, q, q, stats, stats, 0.125,
                                                                                     tables, fused=fused)
        assert site2 == site and grid2 == grid and options2 == options and dq2 is not dq and len(args2) == len(args)
        assert dq.dim() == (1 if keys else 4) and dq.dtype == torch.float32
        if keys:  # (the dq descriptor: chunks of D / 8 rows of 256 floats)
            assert list(args[4].block_shape) == [D // 8, 256], args[4].block_shape
            # persistent: min(16 items (8 keys blocks x 2 heads), 132 SMs) programs taking items from a
            # zeroed counter
            assert options["PERSISTENT"] and grid == (16, 1), (grid, options)
            counter = args[kernel.arg_names.index("counter")]
            assert counter.dtype == torch.int32 and counter.tolist() == [0]


_UNFLAT = r'''
import sys, torch
sys.path.insert(0, sys.argv[2])
from workbench import make, port
module = port.load(port.build(make("causal"), 128, 128, out_dir=sys.argv[1]))
assert module._INTERPRET
gen = torch.Generator().manual_seed(1)
for D in (64, 128):
    B, Hq, Lq, J = 2, 3, 192, D // 16
    dq = torch.randn(B, Hq, Lq, D, generator=gen)
    # the warpgroups' order, built here tile by tile (as in test_the_keys_down_splits_flat_dq_comes_back_in_order)
    tiles = dq.view(B, Hq, Lq // 64, 64, 2, D // 2).permute(0, 1, 2, 4, 3, 5)
    flat = tiles.reshape(-1, 4, 2, 8, J, 4, 2).permute(0, 4, 1, 3, 5, 2, 6).reshape(-1).contiguous()
    back = module._dq_unflat(flat, dq.shape, torch.float32)
    print("UNFLAT", D, torch.equal(back, dq), float((back - dq).abs().max()))
# the prep kernel with ZERO: delta and lse2 as always, and the flat buffer (NaN before) all zeros
for D, Lq in ((64, 200), (128, 96)):
    B, Hq = 2, 3
    o, do = (torch.randn(B, Hq, Lq, D, generator=gen) for _ in range(2))
    lse = torch.randn(B, Hq, Lq, generator=gen)
    lse[0, 1, 7] = float("-inf")
    delta, lse2 = torch.empty(B, Hq, Lq), torch.empty(B, Hq, Lq)
    zero = torch.full((B * Hq * Lq * D + 4, ), float("nan"))
    module._launch(module._bwd_prep_kernel, (-(-Lq // 32), B * Hq),
                   (o, do, lse, delta, delta, lse2, zero, *o.stride(), *do.stride(), *lse.stride(), Hq, Lq, D),
                   dict(HAS_DLSE=False, BLOCK_M=32, D_PAD=D, ZERO=True, num_warps=4))
    want = (o.double() * do.double()).sum(-1)
    want2 = torch.where(lse == float("-inf"), float("inf"), lse.double() * 1.4426950408889634)
    print("PREP", D, bool((zero == 0).all()), bool(torch.allclose(delta.double(), want, rtol=1e-5, atol=1e-5)),
          bool(torch.allclose(lse2.double(), want2, rtol=1e-6)))
'''


def test_the_dq_unflat_kernel_puts_the_flat_sum_back_in_order(tmp_path):
    # The Triton kernel that puts the keys-down split's flat dq back in order (what a GPU runs),
    # here under Triton's interpreter: random tiles laid out in the warpgroups' order come back
    # bit for bit at D 64 and 128; and the prep kernel that zeroes that sum first.
    script = tmp_path / "unflat.py"
    script.write_text(_UNFLAT)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "port"), str(ROOT)], capture_output=True,
                          text=True, timeout=600, cwd=ROOT, env=dict(os.environ, TRITON_INTERPRET="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.split() for line in done.stdout.splitlines() if line.startswith("UNFLAT")]
    assert [(d, ok) for _, d, ok, _ in lines] == [("64", "True"), ("128", "True")], done.stdout
    # the backward's prep kernel zeroes that flat sum and its counter on its way (ZERO), at lengths
    # off its 32-row blocks too, and its delta and lse2 stay those of the float64 reference
    prep = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("PREP")]
    assert prep == [["64", "True", "True", "True"], ["128", "True", "True", "True"]], done.stdout


_PAGED_LISTS = r'''
import json, random, sys, torch
sys.path.insert(0, sys.argv[2])
sys.path.insert(0, sys.argv[2] + "/tests")
from workbench import Mask, make, port
from run_port_paged import W, head_window, LENS, per_request_prefix

cases = {"causal": (make("causal"), 4), "window_300": (make("causal_sliding_window", {"window": 300}), 4),
         "users_head_window": (Mask("users_head_window", mask_mod=head_window), 4),
         "users_per_request_prefix": (Mask("users_per_request_prefix", mask_mod=per_request_prefix), 2)}
report = {}
for name, (mask, heads) in cases.items():
    m = port.load(port.build(mask, 256, 256, heads=heads, batch=3, out_dir=sys.argv[1] + "/" + name))
    for page in (16, 128):
        rng = random.Random(page)
        # a prefill chunk of 300 queries over 1000 keys, a whole 200-token prompt, a decode, and a
        # request whose page names a page outside the cache (its rows must come back NaN)
        reqs = [(300, 1000), (200, 200), (1, 700)]
        pages_of = [-(-length // page) for _, length in reqs]
        table = torch.full((3, max(pages_of) + 2), 10 ** 6, dtype=torch.int32)
        physical = list(range(sum(pages_of)))
        rng.shuffle(physical)
        it = iter(physical)
        for r, n in enumerate(pages_of):
            table[r, :n] = torch.tensor([next(it) for _ in range(n)], dtype=torch.int32)
        table[2, 1] = 10 ** 6  # request 2's second page is outside the cache
        cu = torch.tensor([0, 300, 500, 501], dtype=torch.int32)
        lens = torch.tensor([length for _, length in reqs], dtype=torch.int32)
        q = torch.zeros(501, heads, 64, dtype=torch.bfloat16)
        kc = torch.zeros(len(physical), page, 2, 64, dtype=torch.bfloat16)
        captured = dict(m._tables(q.device, 1, 1))
        pointers = [captured[n] for n in m.ALL_POINTERS]
        ranges = m._mask_ranges(captured, q.device, replaced=False) if m.HAS_BOUNDS else []
        Slots, Rows, full_idx, partial_idx = m._hopper_paged_plan(q, kc, table, cu, lens, pointers, ranges)
        report[f"{name}@{page}"] = dict(slots=Slots.tolist(), rows=Rows.tolist(), full=full_idx.tolist(),
                                        partial=partial_idx.tolist(), heads=heads, per_head=m.MASK_READS_HEAD)
print(json.dumps(report))
'''


def test_the_paged_hopper_lists_name_every_tile_the_mask_keeps(tmp_path):
    # attention_paged's Hopper prefill plans each step on the device (_hopper_paged_lists, a Triton
    # kernel, run here by the interpreter): per slot of 128 queries, its request and rows, and per
    # head the tiles of 128 keys to visit. Judged against the mask evaluated pair by pair: every
    # tile holding a kept pair is listed, a full tile keeps every pair and ends inside its request,
    # the tiles ascend, and a request that names a page outside the cache is marked to be NaN.
    import json

    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from run_port_paged import head_window, per_request_prefix

    from workbench import make

    script = tmp_path / "lists.py"
    script.write_text(_PAGED_LISTS)
    done = subprocess.run([sys.executable, str(script), str(tmp_path), str(ROOT)], capture_output=True, text=True,
                          timeout=900, cwd=ROOT, env=dict(os.environ, TRITON_INTERPRET="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    mods = {"causal": make("causal").mask_mod, "window_300": make("causal_sliding_window", {"window": 300}).mask_mod,
            "users_head_window": head_window, "users_per_request_prefix": per_request_prefix}
    reqs, starts = [(300, 1000), (200, 200), (1, 700)], [0, 300, 500]
    assert len(report) == 8
    for case, got in report.items():
        mod = mods[case.split("@")[0]]
        heads = got["heads"] if got["per_head"] else 1
        expected_slots = [(r, s) for r, (n_q, _) in enumerate(reqs) for s in range(starts[r] // 128 + r,
                                                                                  starts[r] // 128 + r + -(-n_q // 128))]
        used = 0
        for slot, (req, q_row, q_pos0, n_valid, L, bad, *_) in enumerate(got["slots"]):
            mine = [s for r, s in expected_slots if s == slot]
            if not mine:  # a spare slot: nothing to store, nothing to visit
                assert n_valid == 0 and all(got["rows"][slot * heads + h][:2] == [0, 0] for h in range(heads)), \
                    (case, slot, got["slots"][slot])
                continue
            used += 1
            n_q, length = reqs[req]
            first = (slot - (starts[req] // 128 + req)) * 128
            assert (q_row, q_pos0, n_valid, L, bad) == (starts[req] + first, length - n_q + first,
                                                        min(128, n_q - first), length, 0), (case, slot)
            q_idx = torch.arange(q_pos0, q_pos0 + n_valid)[:, None]
            for h in range(heads):
                n_f, n_p, page_bad = got["rows"][slot * heads + h]
                full, partial = got["full"][slot * heads + h][:n_f], got["partial"][slot * heads + h][:n_p]
                assert full == sorted(full) and partial == sorted(partial) and not set(full) & set(partial)
                for t in range(-(-length // 128)):
                    kv_idx = torch.arange(t * 128, min(t * 128 + 128, length))[None, :]
                    kept = mod(torch.tensor(req), torch.tensor(h), q_idx, kv_idx).expand(len(q_idx), kv_idx.shape[1])
                    if kept.any():
                        assert t in full or t in partial, (case, slot, h, t)
                    if t in full:
                        assert kept.all() and t * 128 + 128 <= length, (case, slot, h, t)
                # request 2's logical page 1 is outside the cache: its rows are NaN where a tile read reads it
                page = int(case.split("@")[1])
                assert page_bad == (req == 2 and page // 128 in full + partial), (case, slot, h, page_bad)
        assert used == len(expected_slots), case


@pytest.mark.skipif(not _has_gluon(), reason="this Triton has no Gluon Hopper module (Triton 3.5 and later)")
def test_prefill_steps_take_the_paged_hopper_kernel_unless_turned_off(tmp_path, monkeypatch):
    # attention_paged's Hopper prefill (_hopper_paged_ready), judged as on an sm_90 GPU: steps of at
    # least 128 queries per request in bf16 / fp16 at D 64 / 128 over pages of 16, 32, 64 or a
    # multiple of 128; decode-heavy steps, other head dims, float32, odd pages, other GPUs, and a
    # file with PORT_HOPPER_PAGED=0 (or HOPPER off) keep the portable paged kernel
    import torch

    module = _on_sm90(port.load(port.build(make("causal"), 128, 128, out_dir=tmp_path)), monkeypatch)

    def takes(per_request=300, d=128, page=16, dtype=torch.bfloat16, scale=0.1):
        q, cache = _Cuda(900, 8, d, dtype=dtype), _Cuda(64, page, 2, d, dtype=dtype)
        return module._hopper_paged_ready(q, cache, cache, per_request, scale)

    assert module.HOPPER_PAGED is True
    assert takes() and takes(d=64) and takes(page=32) and takes(page=64) and takes(page=256)
    assert takes(dtype=torch.float16) and takes(per_request=128)
    assert not takes(per_request=127) and not takes(d=96) and not takes(dtype=torch.float32)
    assert not takes(page=48) and not takes(page=80) and not takes(scale=0.0)
    monkeypatch.setattr(module, "_capability", lambda device: (8, 0))
    assert not takes()
    monkeypatch.setattr(module, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(module, "HOPPER", False)
    assert not takes()
    monkeypatch.setenv("PORT_HOPPER_PAGED", "0")
    assert port.load(port.build(make("causal"), 128, 128, out_dir=tmp_path / "off")).HOPPER_PAGED is False


def test_launch_reuses_the_compiled_kernel_only_for_launches_that_specialize_alike(tmp_path, monkeypatch):
    # _launch (the port's kernel launches on a GPU): the first launch of a kind goes through the
    # JIT; a later one goes straight to its compiled kernel with every parameter in order (defaults
    # and options included), but only when options, constexpr arguments and each argument's
    # specialization (a tensor's dtype and 16-byte alignment, an int being 1 or a multiple of 16)
    # match. Here with a stand-in for a JIT function that records what it is asked.
    import torch

    module = port.load(port.build(make("causal"), 128, 128, out_dir=tmp_path))
    monkeypatch.setattr(module, "_INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    calls = []

    class Compiled:
        function = object()

        def __getitem__(self, grid):
            return lambda *args: calls.append(("direct", grid, args))

    class Kernel:
        def __init__(self):
            import inspect

            class constexpr:  # (what _launch looks for in an annotation, as in tl.constexpr)
                pass

            def fn(X, n, MODE: constexpr, BLOCK: constexpr = 32, WIDE: constexpr = False):
                pass

            self.signature = inspect.signature(fn)

        def __getitem__(self, grid):
            def jit(*args, **options):
                calls.append(("jit", grid, args, options))
                return Compiled()
            return jit

    kernel = Kernel()
    x = torch.zeros(64)
    module._launch(kernel, (4,), (x, 32, 1), {"BLOCK": 64})
    module._launch(kernel, (8, 2), (x, 48, 1), {"BLOCK": 64})  # (same kind: 48 is a multiple of 16 too)
    assert [c[0] for c in calls] == ["jit", "direct"]
    assert calls[1][1] == (8, 2, 1) and calls[1][2] == (x, 48, 1, 64, False), calls[1]
    for args, options in (((x, 33, 1), {"BLOCK": 64}),  # (33: not a multiple of 16)
                          ((x, 1, 1), {"BLOCK": 64}),  # (1: a constant to the JIT)
                          ((x, 32, 2), {"BLOCK": 64}),  # (a constexpr argument's value)
                          ((x, 32, 1), {"BLOCK": 128}),  # (an option)
                          ((x.half(), 32, 1), {"BLOCK": 64}),  # (a dtype)
                          ((torch.zeros(65)[1:], 32, 1), {"BLOCK": 64})):  # (a pointer off 16 bytes)
        calls.clear()
        module._launch(kernel, (4,), args, options)
        module._launch(kernel, (4,), args, options)
        assert [c[0] for c in calls] == ["jit", "direct"], (args, options, calls)
    # an argument of a kind _launch does not know (here a list) always goes through the JIT, and
    # nothing is kept for it
    calls.clear()
    kept = len(module._COMPILED)
    for _ in range(3):
        module._launch(kernel, (4,), (x, [1, 2], 1), {"BLOCK": 64})
    assert [c[0] for c in calls] == ["jit"] * 3 and len(module._COMPILED) == kept
    # a launch with a site (the caller's key for everything that decides grid, options and kinds)
    # is bound once, through the kinds above, and later launches of that site skip them: the
    # arguments go straight to the compiled kernel, every parameter in order
    calls.clear()
    sites = len(module._SITES)
    y = torch.ones(64)
    module._launch(kernel, (4,), (x, 32, 1), {"BLOCK": 64}, ("s", 1))  # (a kind seen above: direct, and bound)
    module._launch(kernel, (4,), (y, 64, 1), {"BLOCK": 64}, ("s", 1))
    module._launch(kernel, (2,), (x, 16, 3), {"WIDE": True}, ("s", 2))  # (a new kind: the JIT, then bound)
    module._launch(kernel, (2,), (y, 16, 3), {"WIDE": True}, ("s", 2))
    assert [c[0] for c in calls] == ["direct", "direct", "jit", "direct"], calls
    assert calls[1][1:] == ((4, 1, 1), (y, 64, 1, 64, False)) and calls[3][1:] == ((2, 1, 1), (y, 16, 3, 32, True))
    assert len(module._SITES) == sites + 2
    calls.clear()  # (an argument of no known kind binds no site)
    for _ in range(2):
        module._launch(kernel, (4,), (x, [1, 2], 1), {"BLOCK": 64}, ("s", 3))
    assert [c[0] for c in calls] == ["jit"] * 2 and len(module._SITES) == sites + 2


@pytest.mark.skipif(not _has_gluon(), reason="this Triton has no Gluon Hopper module (Triton 3.5 and later)")
def test_a_copied_descriptor_is_the_one_the_constructor_would_make(tmp_path):
    # _descriptor checks a kind of TMA descriptor once (Gluon's constructor) and copies it for later
    # tensors: each copy must hold the same fields as a descriptor built for that tensor, its own
    # tensor (not the first one's), and a tensor off 16 bytes still meets the constructor's check
    import dataclasses

    import torch

    module = port.load(port.build(make("causal"), 128, 128, out_dir=tmp_path))
    first, second = torch.randn(2, 4, 256, 64).bfloat16(), torch.randn(2, 4, 256, 64).bfloat16()
    made = [module._hopper_descriptor(t, 128) for t in (first, second)]
    layout = module._SHARED_LAYOUTS[(128, 64, torch.bfloat16)]
    for t, got in zip((first, second), made):
        want = module._GluonDescriptor(t.reshape(-1, 64), [2048, 64], [64, 1], [128, 64], layout)
        assert type(got) is type(want) and got.base is t
        assert {f.name: getattr(got, f.name) for f in dataclasses.fields(want) if f.name != "base"} == \
            {f.name: getattr(want, f.name) for f in dataclasses.fields(want) if f.name != "base"}
    # the kept prototype holds no tensor
    assert all(p.base is None for p in module._DESCRIPTORS.values())
    off = torch.randn(2 * 4 * 256 * 64 + 4).bfloat16()[4:]  # (8 bytes past a 16-byte boundary)
    with pytest.raises(AssertionError, match="16-byte aligned"):
        module._descriptor(off, 2048, 64, [128, 64], layout)


@pytest.mark.skipif(not _has_gluon(), reason="this Triton has no Gluon Hopper module (Triton 3.5 and later)")
def test_the_early_compile_sees_arguments_that_specialize_as_the_launchs_do(tmp_path):
    # A new kind of call compiles the Hopper kernel in a second thread from stand-ins of the block
    # lists, while this thread builds them (HOPPER_EARLY_COMPILE). The launch finds that compile
    # only if the kernel, grid and options are the same and every argument specializes alike
    # (_arg_kind: a tensor's dtype and alignment, a descriptor's block and layout); the integers
    # must be the very values (the JIT makes 1 a constant, and the kernel reads them). Users' mods
    # reading head and batch tables, Lq != Lk off the 128 grid, GQA, every loop, with and without lse.
    import torch

    w = torch.tensor([64, 128, 256, 1024])
    lens = torch.tensor([300, 700])

    def head_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + 500) & (q_idx + 500 - kv_idx < w[h])

    def per_sample_prefix(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < lens[b])

    cases = [(Mask("users_head_window", mask_mod=head_window), (2, 4, 2, 512, 1011, 128, torch.bfloat16), "auto", True),
             (Mask("users_per_sample_prefix", mask_mod=per_sample_prefix), (2, 4, 4, 1000, 1000, 64, torch.float16),
              "specialized", False),
             (with_score(make("causal"), make("softcap")), (1, 2, 1, 1024, 1024, 128, torch.bfloat16), "auto", False),
             (make("full"), (1, 2, 2, 256, 2048, 64, torch.bfloat16), "pingpong", True)]
    for mask, (B, Hq, Hkv, Lq, Lk, D, dtype), loop, want_lse in cases:
        module = port.load(port.build(mask, Lq, Lk, heads=Hq, batch=B, out_dir=tmp_path / mask.name))
        module.HOPPER_LOOP = loop
        cpu = torch.device("cpu")
        module._SM_COUNTS[cpu] = 132
        rows, cols = -(-Lq // 128), -(-Lk // 128)
        shape = (B if module.MASK_READS_BATCH else 1, Hq if module.MASK_READS_HEAD else 1, rows, cols)
        built = []

        def lists(*a, **kw):  # (the scan kernel would launch: lists of their true shapes, as int32)
            built.append(a)
            return tuple(torch.zeros(shape[:-1] if i % 2 == 0 else shape, dtype=torch.int32) for i in range(4))

        early = []
        module.block_lists = lists
        module._compile_early = lambda kernel, grid, args, options, device, chosen=None: early.append(
            (kernel, grid, args, options))
        q = torch.randn(B, Hq, Lq, D).to(dtype)
        k, v = (torch.randn(B, Hkv, Lk, D).to(dtype) for _ in range(2))
        tables = module._tables(cpu, Lq, Lk)
        grid, args, options, out, lse, _ = module._hopper_launch(q, k, v, D ** -0.5, want_lse, tables)
        assert len(early) == 1 and len(built) == 1, (mask.name, early, built)
        kernel, e_grid, e_args, e_options = early[0]
        assert kernel is module._hopper_kernel(D) and e_grid == grid and e_options == options, mask.name
        assert ("persistent" in kernel.fn.__name__) == (module._hopper_loop(D) == "persistent")
        assert len(e_args) == len(args), mask.name
        for i, (a, b) in enumerate(zip(e_args, args)):
            if isinstance(b, (int, float)):
                assert type(a) is type(b) and a == b, (mask.name, i, a, b)
            else:
                assert module._arg_kind(a) == module._arg_kind(b), (mask.name, i, module._arg_kind(a), module._arg_kind(b))
        assert e_args[3] is out and (e_args[4] is lse) and (lse is not out) == want_lse
        # the integers the kernel walks the lists by are the lists' own (a column count, line strides)
        partial_num, partial_idx = args[5], args[6]
        assert args[11] == partial_idx.shape[-1] == cols and args[14:16] == (Lq, Lk), (mask.name, args[9:16])
        assert args[9:11] == tuple(partial_num.stride(i) if partial_num.shape[i] > 1 else 0 for i in (0, 1)), mask.name
        # the same kind of call again: the plan is kept, nothing is built or compiled again
        module._hopper_launch(q, k, v, D ** -0.5, want_lse, tables)
        assert len(early) == 1 and len(built) == 1, mask.name


def _planned_on_cpu(tmp_path):
    """(a causal port of 1,024 tokens and 2 heads whose Hopper launches can be planned on the CPU, the
    CPU device): 132 SMs, stand-in block lists, no early compile; nothing launches."""
    import torch

    module = port.load(port.build(make("causal"), 1024, 1024, heads=2, out_dir=tmp_path))
    cpu = torch.device("cpu")
    module._SM_COUNTS[cpu] = 132
    module.block_lists = lambda *a, **kw: tuple(torch.zeros((1, 1, 8) if i % 2 else (1, 1), dtype=torch.int32)
                                                for i in range(4))
    module._compile_early = lambda *a: None
    return module, cpu


def _paged_prefill_options(module, tables) -> dict:
    """The options the paged prefill's Hopper kernel would launch with: 300 query tokens of 2 heads,
    bf16, D 128, pages of 16 (nothing launches)."""
    import torch

    plan = (torch.zeros(3, 8, dtype=torch.int32), torch.zeros(3, 3, dtype=torch.int32),
            torch.zeros(3, 8, dtype=torch.int32), torch.zeros(3, 8, dtype=torch.int32))
    qp = torch.zeros(300, 2, 128, dtype=torch.bfloat16)
    cache = torch.zeros(64, 16, 1, 128, dtype=torch.bfloat16)
    table = torch.zeros(2, 32, dtype=torch.int32)
    pointers = [tables[n] for n in module.ALL_POINTERS]
    return module._hopper_paged_launch(qp, cache, cache, table, 0.125, False, pointers, plan, qp, qp)[2]


@pytest.mark.skipif(not _has_gluon(), reason="this Triton has no Gluon Hopper module (Triton 3.5 and later)")
def test_the_warpgroups_hand_offs_reach_the_kernel_as_the_switch_says(tmp_path):
    # HOPPER_NAMED chooses how the ping-pong and persistent loops' warpgroups take turns and give
    # K / V buffers back (bit 1: named turns, bit 2: named releases, 0: mbarriers; bit 4: the turn
    # taken before the tile's waits). The launch
    # passes it to the kernel for those loops only; the named releases need a ring of at most 3
    # slots (their barrier ids: 10 + slot, 13 + slot), so a 4-buffer ring keeps only the turns; a
    # changed switch is a new kind of call (never a plan made under the other setting); and the
    # paged prefill takes the named turns only.
    import torch

    module, cpu = _planned_on_cpu(tmp_path)
    q = torch.zeros(1, 2, 1024, 128, dtype=torch.bfloat16)
    tables = module._tables(cpu, 1024, 1024)
    assert module.HOPPER_NAMED == int(os.environ.get("PORT_HOPPER_NAMED", "").strip() or 7)
    seen = {}
    for loop in ("specialized", "pingpong", "persistent"):
        for named, buffers in ((3, 0), (1, 0), (0, 0), (3, 4), (7, 0), (5, 0), (7, 4)):
            module.HOPPER_LOOP, module.HOPPER_NAMED = loop, named
            module.HOPPER_TILE = (128, buffers, 8)
            _, _, options, _, _, site = module._hopper_launch(q, q, q, 0.125, False, tables)
            want = 0 if loop == "specialized" else (named if buffers <= 3 else named & 5)
            assert options.get("NAMED", 0) == want, (loop, named, buffers, options)
            assert site not in seen, (loop, named, buffers, seen.get(site))
            seen[site] = (loop, named, buffers)
    module.HOPPER_TILE = (128, 0, 8)
    for named, want in ((3, 1), (1, 1), (0, 0), (7, 5), (5, 5)):
        module.HOPPER_LOOP, module.HOPPER_NAMED = "auto", named
        options = _paged_prefill_options(module, tables)
        assert options.get("NAMED", 0) == want, (named, options)


@pytest.mark.skipif(not _has_gluon(), reason="this Triton has no Gluon Hopper module (Triton 3.5 and later)")
def test_two_buffers_of_queries_reach_the_persistent_kernel_within_its_shared_memory(tmp_path):
    # HOPPER_Q_BUFFERS = 2: the persistent loop's kernel gets Q_BUF = 2 (other loops never), and at
    # D 128 its K / V ring shrinks to 2 buffers so both fit the 227 KB an SM gives a program (at D 64
    # the ring keeps 3); a changed switch is a new kind of call. Compiled for sm_90a: tests/run_hopper_compile.py.
    import torch

    module, cpu = _planned_on_cpu(tmp_path)
    assert module.HOPPER_Q_BUFFERS == int(os.environ.get("PORT_HOPPER_Q_BUFFERS", "").strip() or 1)
    sites = set()
    for D, want_buf in ((128, 2), (64, 3)):
        q = torch.zeros(1, 2, 1024, D, dtype=torch.bfloat16)
        tables = module._tables(cpu, 1024, 1024)
        for loop in ("persistent", "pingpong"):
            for q_buffers in (1, 2):
                module.HOPPER_LOOP, module.HOPPER_Q_BUFFERS = loop, q_buffers
                _, _, options, _, _, site = module._hopper_launch(q, q, q, 0.125, False, tables)
                two = loop == "persistent" and q_buffers == 2
                assert options.get("Q_BUF", 1) == (2 if two else 1), (D, loop, q_buffers, options)
                assert options["NUM_BUF"] == (want_buf if two else 3), (D, loop, q_buffers, options)
                assert site not in sites
                sites.add(site)


@pytest.mark.parametrize("name, attribute, read, refused, message", [
    # unset or empty 1, "1" or "2"
    ("PORT_HOPPER_Q_BUFFERS", "HOPPER_Q_BUFFERS", ((None, 1), ("", 1), ("1", 1), (" 2 ", 2)), ("3", "0", "two", "on"),
     r"names no number.*set 1 \(the default\) or 2"),
    # unset or empty 2, "0", "1" or "2"
    ("PORT_HOPPER_UNDER_PV", "HOPPER_UNDER_PV", ((None, 2), ("", 2), (" 1 ", 1), ("0", 0), ("2", 2)),
     ("3", "on", "yes", "-1"),
     r"is not a place.*set 1 \(after the exponentials\), 2 \(after the row max, the default for masks without a "
     r"score_mod reading at most 3 table entries\) or 0 \("),
    # unset or empty 1, "0" or "1" (the tile counts, the store, the row sums)
    ("PORT_HOPPER_TILE_INFO", "HOPPER_TILE_INFO", ((None, 1), ("", 1), (" 0 ", 0), ("1", 1)), ("2", "on", "true"),
     r"is not a switch of the persistent loop's tile counts: set 1 \(the default, .*\) or 0 \("),
    ("PORT_HOPPER_FAST_STORE", "HOPPER_FAST_STORE", ((None, 1), ("", 1), ("0", 0), (" 1 ", 1)), ("yes", "-1", "1.0"),
     r"is not a switch of the persistent loop's store: set 1 \(the default, .*\) or 0 \("),
    ("PORT_HOPPER_LANE_SUMS", "HOPPER_LANE_SUMS", ((None, 1), ("", 1), (" 0 ", 0), ("1", 1)), ("2", "on", "-1"),
     r"is not a switch of the softmax's row sums: set 1 \(the default, each thread's share, .*\) or 0 \(the whole "),
])
def test_a_hopper_setting_is_read_from_the_environment_and_a_typo_is_refused(tmp_path, monkeypatch, name, attribute,
                                                                             read, refused, message):
    # PORT_HOPPER_Q_BUFFERS, PORT_HOPPER_UNDER_PV, PORT_HOPPER_TILE_INFO, PORT_HOPPER_FAST_STORE,
    # PORT_HOPPER_LANE_SUMS: any value not in the list stops the file's load
    # with an error that names the variable and the values (never a silent default)
    path = port.build(make("causal"), 256, 256, out_dir=tmp_path)
    for value, want in read:
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        assert getattr(port.load(path), attribute) == want, value
    for value in refused:
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=rf"{name}='{value}' " + message):
            port.load(path)


def test_mods_reading_many_table_entries_keep_the_wait_for_p_v_where_ptxas_puts_it(tmp_path, monkeypatch):
    # HOPPER_UNDER_PV's default follows the mods' table reads (HOPPER_TABLE_READS, the distinct
    # gl.load calls of their forward Gluon copy): 2 (the wait after the row max) up to 3 entries
    # without a score_mod, else 0, where the wait after the max made two .any() spans, four tables and
    # a score_mod's fast bias form spill (tests/run_hopper_compile.py checks the spills); the
    # environment still chooses for every mask
    import torch
    from torch.nn.attention.flex_attention import and_masks, or_masks

    monkeypatch.delenv("PORT_HOPPER_UNDER_PV", raising=False)
    w, lens = torch.tensor([64, 128, 256, 1024]), torch.tensor([300, 1024])
    sink, shift = torch.tensor([4, 8, 16, 0]), torch.tensor([0, 17])
    one, two = torch.tensor([[100, 300]]), torch.tensor([[100, 300], [600, 700]])

    def head_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < w[h])

    def three_tables(b, h, q_idx, kv_idx):
        return ((kv_idx <= q_idx) & (q_idx - kv_idx < w[h])) | (kv_idx < lens[b]) | (kv_idx < sink[h])

    def four_tables(b, h, q_idx, kv_idx):
        return ((kv_idx <= q_idx + shift[b]) & (q_idx - kv_idx < w[h])) | (kv_idx < lens[b]) | (kv_idx < sink[h])

    def spans_of(spans):
        def image_spans(b, h, q_idx, kv_idx):
            both = ((q_idx[..., None] >= spans[:, 0]) & (q_idx[..., None] < spans[:, 1])
                    & (kv_idx[..., None] >= spans[:, 0]) & (kv_idx[..., None] < spans[:, 1]))
            return (kv_idx <= q_idx) | both.any(-1)
        return image_spans

    def biases(score, b, h, q_idx, kv_idx):  # (a table read in the score_mod counts too, once)
        return score + w[h] * 0.001 * (kv_idx - q_idx)

    # (the library's causal is bottom-right aligned: it reads its length offset, one entry)
    cases = [(make("causal"), 1, 2), (Mask("head_window", mask_mod=head_window), 1, 2),
             (with_score(make("causal"), make("softcap")), 1, 0),
             (Mask("head_window_biased", mask_mod=head_window, score_mod=biases), 1, 0),
             (Mask("three_tables", mask_mod=three_tables), 3, 2), (Mask("four_tables", mask_mod=four_tables), 4, 0),
             (Mask("one_span", mask_mod=spans_of(one)), 2, 2), (Mask("two_spans", mask_mod=spans_of(two)), 4, 0),
             (Mask("two_spans_biased", mask_mod=spans_of(two), score_mod=biases), 5, 0),
             # (and_masks / or_masks of a user's mods, built at Lq != Lk and at Lq = 1: the same count)
             (Mask("and_window", mask_mod=and_masks(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx, head_window)), 1, 2),
             (Mask("or_spans", mask_mod=or_masks(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx, spans_of(two))), 4, 0)]
    for i, (mask, reads, default) in enumerate(cases):
        # (the library's causal, in the first three, at 1,024 x 1,024, where it reads its length offset;
        # the users' mods also at Lq != Lk and Lq = 1)
        q_len, kv_len = ((1024, 1024), (777, 1500), (1, 1000))[i % 3] if i >= 3 else (1024, 1024)
        path = port.build(mask, q_len, kv_len, heads=4, batch=2, out_dir=tmp_path / mask.name)
        module = port.load(path)
        assert module.HOPPER_MODS is None, (mask.name, module.HOPPER_MODS)
        assert (module.HOPPER_TABLE_READS, module.HOPPER_UNDER_PV) == (reads, default), mask.name
        assert module.HOPPER_UNDER_PV_CHOSEN is False, mask.name  # (a default 2 gives way where it spills)
        monkeypatch.setenv("PORT_HOPPER_UNDER_PV", "2")
        chosen = port.load(path)
        assert (chosen.HOPPER_UNDER_PV, chosen.HOPPER_UNDER_PV_CHOSEN) == (2, True), mask.name
        monkeypatch.delenv("PORT_HOPPER_UNDER_PV")


class _Compiled:
    """A compiled kernel as Triton's warmup returns it: its spills (words) known once it is loaded."""

    def __init__(self, spills, known=True):
        self.spills, self.known, self.n_spills = spills, known, None

    def _init_handles(self):
        if not self.known:
            raise RuntimeError("no device to load on")
        self.n_spills = self.spills


class _Kernel:
    """A kernel whose compile, by the wait's place (UNDER_PV), spills `spills[place]` words."""

    def __init__(self, spills, known=True):
        self.spills, self.known, self.compiled = spills, known, []

    def warmup(self, *args, grid, **options):
        place = options.get("UNDER_PV", 0)
        self.compiled.append(place)
        return _Compiled(self.spills[place], self.known)


def test_a_default_wait_after_the_max_gives_way_where_it_spills_and_the_other_spills_less(tmp_path):
    # _under_pv_by_spills: where the file's default place of the wait for P V (2, after the row max)
    # spills, the first call of a kind compiles the 0 form too and takes it where it spills less;
    # a place chosen in the environment (HOPPER_UNDER_PV_CHOSEN), 0 or 1, or a kernel that spills
    # nothing compiles once and stays; a count this Triton cannot give leaves the default
    module = port.load(port.build(make("causal"), 1024, 1024, out_dir=tmp_path))
    options = {"HAS_SCORE": False, "NUM_BUF": 3, "UNDER_PV": 2, "NAMED": 7}
    rest = {name: value for name, value in options.items() if name != "UNDER_PV"}
    cases = [({2: 10, 0: 0}, True, rest, [2, 0]),   # (2 spills 40 bytes, 0 none: 0)
             ({2: 10, 0: 3}, True, rest, [2, 0]),   # (both spill, 0 less: 0)
             ({2: 3, 0: 10}, True, options, [2, 0]),  # (0 spills more: 2 stays)
             ({2: 3, 0: 3}, True, options, [2, 0]),   # (the same: 2 stays)
             ({2: 0, 0: 10}, True, options, [2]),     # (2 spills nothing: one compile)
             ({2: 10, 0: 0}, False, options, [2])]    # (no count: the default)
    for spills, known, picked, compiled in cases:
        kernel = _Kernel(spills, known)
        assert module._under_pv_by_spills(kernel, (1,), (), options) == picked, spills
        assert kernel.compiled == compiled, spills
    for other in ({**options, "UNDER_PV": 1}, rest):  # (1 or 0: nothing to check)
        kernel = _Kernel({0: 10, 1: 10, 2: 0})
        assert module._under_pv_by_spills(kernel, (1,), (), other) == other and kernel.compiled == []
    module.HOPPER_UNDER_PV_CHOSEN = True  # (PORT_HOPPER_UNDER_PV=2: the place the user named)
    kernel = _Kernel({2: 10, 0: 0})
    assert module._under_pv_by_spills(kernel, (1,), (), options) == options and kernel.compiled == []


@pytest.mark.skipif(not _has_gluon(), reason="this Triton has no Gluon Hopper module (Triton 3.5 and later)")
def test_the_tile_counts_and_the_store_switches_reach_only_the_persistent_kernel(tmp_path):
    # HOPPER_TILE_INFO / HOPPER_FAST_STORE (on unless set to 0): the persistent loop's kernel gets INFO =
    # 1 (its load warp writes each tile's counts beside its number) / FAST_STORE (a reciprocal per
    # row); the other loops never get them; a changed switch is a new kind of call. (That both give
    # the bits and the float64 agreement they should: tests/test_gpu_port.py, on an H100 / H200.)
    import torch

    module, cpu = _planned_on_cpu(tmp_path)
    assert module.HOPPER_TILE_INFO == int(os.environ.get("PORT_HOPPER_TILE_INFO", "").strip() or 1)
    assert module.HOPPER_FAST_STORE == int(os.environ.get("PORT_HOPPER_FAST_STORE", "").strip() or 1)
    q = torch.zeros(1, 2, 1024, 128, dtype=torch.bfloat16)
    tables = module._tables(cpu, 1024, 1024)
    sites = set()
    for loop in ("specialized", "pingpong", "persistent"):
        for info, fast in ((1, 0), (0, 0), (0, 1), (1, 1)):
            module.HOPPER_LOOP, module.HOPPER_TILE_INFO, module.HOPPER_FAST_STORE = loop, info, fast
            _, _, options, _, _, site = module._hopper_launch(q, q, q, 0.125, False, tables)
            persistent = loop == "persistent"
            assert options.get("INFO", 0) == (info if persistent else 0), (loop, info, options)
            assert options.get("FAST_STORE", False) == bool(fast and persistent), (loop, fast, options)
            assert site not in sites, (loop, info, fast)
            sites.add(site)


@pytest.mark.skipif(not _has_gluon(), reason="this Triton has no Gluon Hopper module (Triton 3.5 and later)")
@pytest.mark.parametrize("attribute, option", [("HOPPER_UNDER_PV", "UNDER_PV"), ("HOPPER_LANE_SUMS", "LANE")])
def test_the_softmax_switches_reach_every_loop_and_the_paged_prefill_as_they_say(tmp_path, attribute, option):
    # HOPPER_UNDER_PV (the softmax under the previous tile's P V) / HOPPER_LANE_SUMS (the row sums
    # by thread): every loop's kernel, and the paged prefill's, gets UNDER_PV / LANE = 1 when it is on
    # and nothing when off; a changed switch is a new kind of call (never a plan made under the other
    # setting). Where the compiled wait sits: tests/run_hopper_compile.py; the lane sums' float64
    # agreement: tests/test_gpu_port.py on an H100 / H200.
    import torch

    module, cpu = _planned_on_cpu(tmp_path)
    variable, default = "PORT_" + attribute, {"HOPPER_UNDER_PV": "2", "HOPPER_LANE_SUMS": "1"}[attribute]
    assert getattr(module, attribute) == int(os.environ.get(variable, "").strip() or default)
    q = torch.zeros(1, 2, 1024, 128, dtype=torch.bfloat16)
    tables = module._tables(cpu, 1024, 1024)
    sites = set()
    values = (1, 2, 0) if attribute == "HOPPER_UNDER_PV" else (1, 0)  # (2: the wait after the row max)
    for loop in ("specialized", "pingpong", "persistent"):
        for on in values:
            module.HOPPER_LOOP = loop
            setattr(module, attribute, on)
            _, _, options, _, _, site = module._hopper_launch(q, q, q, 0.125, False, tables)
            assert options.get(option, 0) == on, (loop, on, options)
            assert site not in sites, (loop, on)
            sites.add(site)
    module.HOPPER_LOOP = "auto"
    for on in values:
        setattr(module, attribute, on)
        options = _paged_prefill_options(module, tables)
        assert options.get(option, 0) == on, (on, options)


def test_auto_runs_the_persistent_loop_except_with_a_score_mod_at_d128(tmp_path):
    # HOPPER_LOOP = "auto": the persistent loop, except the ping-pong one with a score_mod at D 128
    # (measured: with a score_mod persistent was slower at D 128, faster at D 64)
    plain = port.load(port.build(make("causal"), 256, 256, out_dir=tmp_path / "plain"))
    scored = port.load(port.build(with_score(make("causal"), make("softcap")), 256, 256, out_dir=tmp_path / "scored"))
    assert [plain._hopper_loop(d) for d in (64, 128)] == ["persistent", "persistent"]
    assert [scored._hopper_loop(d) for d in (64, 128)] == ["persistent", "pingpong"]
    assert scored._hopper_kernel(64) is scored._hopper_persistent_kernel or not scored._HAS_GLUON
    scored.HOPPER_LOOP = "specialized"
    assert [scored._hopper_loop(d) for d in (64, 128)] == ["specialized", "specialized"]


def test_the_hand_off_setting_is_read_from_the_environment_and_a_typo_is_refused(tmp_path, monkeypatch):
    # PORT_HOPPER_NAMED: unset or empty 7 (turns and releases named, the turn before the tile's waits),
    # 0 (mbarriers), 1 (named turns), 3 (turns and releases), 5 (1, the turn first); any
    # other value stops the file's load with an error that names the variable and the values
    path = port.build(make("causal"), 256, 256, out_dir=tmp_path)
    for value, want in ((None, 7), ("", 7), ("1", 1), (" 3 ", 3), ("0", 0), ("7", 7), ("5", 5)):
        if value is None:
            monkeypatch.delenv("PORT_HOPPER_NAMED", raising=False)
        else:
            monkeypatch.setenv("PORT_HOPPER_NAMED", value)
        assert port.load(path).HOPPER_NAMED == want, value
    for value in ("2", "4", "6", "on", "yes"):
        monkeypatch.setenv("PORT_HOPPER_NAMED", value)
        with pytest.raises(ValueError, match=rf"PORT_HOPPER_NAMED='{value}' names no hand-off.*set 0 \(mbarriers\), "
                           r"1 \(named turns\), 3"):
            port.load(path)


def test_sass_loops_reads_a_loop_its_straight_path_and_its_order():
    # benchmarks/sass_loops.py on a listing in nvdisasm's form: the loop from its label to the branch
    # back, its straight path without the longest forward branch (the masked work), innermost only
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import sass_loops

    listing = textwrap.dedent("""\
        .L_x_1:
                /*0000*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;
                /*0010*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
                /*0020*/              @!P1 BRA `(.L_x_2) ;
                /*0030*/                   ISETP.GE.AND P0, PT, R1, R2, PT ;
                /*0040*/                   FSEL R3, R3, -INF , P0 ;
        .L_x_2:
                /*0050*/                   MUFU.EX2 R4, R3 ;
                /*0060*/                   MUFU.EX2 R5, R3 ;
                /*0070*/                   FMUL R6, R6, R7 ;
                /*0080*/               @P2 BRA `(.L_x_1) ;
                /*0090*/                   EXIT ;
        """)
    (loop, ) = sass_loops.loops(listing)
    assert loop.ops["HGMMA"] == 1 and loop.ops["FSEL"] == 1 and loop.size == 9
    assert loop.path["FSEL"] == 0 and loop.path["ISETP"] == 0 and loop.path_size == 7
    assert [kind for kind, _ in loop.order][3:] == ["MUFU.EX2", "FMUL", "@P2 BRA `(.L_x_1)"]
    assert loop.order[3] == ("MUFU.EX2", 2)
    assert loop.tail == (2, 1)  # (the FMUL and the branch back come after the last exponential)
    no_exp = sass_loops.loops(listing.replace("MUFU.EX2", "FADD"))[0]
    assert no_exp.tail == (0, 0)
    assert loop.stalls is None  # (no control bits in a listing without nvdisasm's -hex)
    # the same listing as nvdisasm -hex prints it: each instruction's first word at its line's end, the
    # second (its control bits from bit 41: the stall count, yield, no scoreboards) on a line of its own
    stalls = iter([2, 1, 5, 7, 9, 4, 3, 1, 6, 1])
    words = []
    for line in listing.splitlines():
        if "/*0" not in line:
            words.append(line)
            continue
        control = next(stalls) | 1 << 4 | 7 << 5 | 7 << 8
        words += [f"{line}   /* 0x0000000000007a02 */", f"{' ' * 60}/* 0x{control << 41:016x} */"]
    (worded, ) = sass_loops.loops("\n".join(words) + "\n")
    assert (worded.start, worded.end, worded.path, worded.order) == (loop.start, loop.end, loop.path, loop.order)
    assert worded.stalls == 2 + 1 + 5 + 4 + 3 + 1 + 6  # (the straight path's: not the masked ISETP's 7 and FSEL's 9)
    assert sass_loops.loops(listing.replace("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT", "NOP")) == []


@pytest.mark.skipif(not _has_gluon(), reason="this Triton has no Gluon Hopper module (Triton 3.5 and later)")
def test_the_row_sums_by_thread_take_four_shuffles_and_four_adds_fewer_a_tile():
    # HOPPER_LANE_SUMS compiled for sm_90a (no GPU): each warpgroup's tile loop keeps its 16 warpgroup
    # MMAs and 66 exponentials (64 scores and 2 rows' alpha a thread), and gathers no row sum across
    # a quad: the row max's 4 shuffles remain, the sums' 4 shuffles and 4 adds go
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import sass_loops

    def tile_loops(lane):
        found = sass_loops.loops(sass_loops.port_sass("causal", "persistent", {"HOPPER_LANE_SUMS": lane}))
        return [x.path for x in found if x.path["HGMMA"] == 16 and x.path["MUFU"] == 66]

    by_thread, whole = tile_loops(1), tile_loops(0)
    assert len(by_thread) == len(whole) == 2  # (the two warpgroups' copies of the loop)
    for a, b in zip(by_thread, whole):
        assert (a["SHFL"], b["SHFL"]) == (4, 8)
        assert b["FADD"] - a["FADD"] == 4
        assert sum(b.values()) - sum(a.values()) == 8


@pytest.mark.skipif(not _has_gluon(), reason="this Triton has no Gluon Hopper module (Triton 3.5 and later)")
def test_sass_loops_refuses_a_setting_the_file_lacks_and_a_loop_the_table_does_not_list(capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import sass_loops

    def refused(argv):  # (argparse's exit status 2, and what it printed)
        with pytest.raises(SystemExit) as stop:
            sass_loops.main(argv)
        assert stop.value.code == 2
        return capsys.readouterr().err

    err = refused(["--port", "causal", "--set", "HOPPER_NO_SUCH=1"])
    assert "the port's file has no setting HOPPER_NO_SUCH: give one of its HOPPER_ names" in err
    err = refused(["--port", "causal", "--order", "5"])
    assert "--order 5: no loop of the table starts at that line: give one of " in err
