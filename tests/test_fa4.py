"""The FA4 export on a CPU: what the generated CuTe DSL mods compute (run under a numpy model of
the DSL's semantics, `cute_shim`) against the mods themselves, the block-sparse tensors against
the dense mask, and the spec's `flash_attn_cute` section. That the text compiles in FA4's own
kernel is `run_fa4_compile.py`; that it runs right on FA4 is tests/test_gpu_fa4.py (H200)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import cute_shim
from mod_corpus import LENGTH, corpus
from workbench import Mask, WorkbenchError, compat, fa4, make
from workbench.blocks import dense_mask
from workbench.define import bind


def _mods_text(source: str) -> str:
    start = source.index("# ---------------------------------------------------------------- the mask and score")
    stop = source.index("# ---------------------------------------------------------------- what this file")
    return source[start:stop]


def _aux(src: fa4.Fa4Source) -> list:
    out = []
    for name in src.aux:
        t = src.tensors["aux." + name]
        out.append(t.numpy().astype(np.float32 if t.is_floating_point() else np.int64))
    return out


def _scalars(src: fa4.Fa4Source, q_len: int, kv_len: int, knobs: dict | None = None) -> tuple:
    """The file's aux_scalars at these lengths: the length rules' numbers, then the knobs."""
    rules = tuple((a * q_len + b * kv_len + c) // d for a, b, c, d in src.length_rules.values())
    return rules + tuple({**src.scalars, **(knobs or {})}.values())


_MOD_NAMES = ("mask_mod_cute", "score_mod_cute", "score_mod_bwd_cute")


def _variants(src: fa4.Fa4Source, knobs: tuple) -> list:
    """[(namespace, aux_scalars)]: the mods the file runs at these aux_scalars values, as its _mods
    picks them: at the generated knob values the mods with them written in (reading the length
    rules' numbers only), and the `*_knobs` copies, which read every value (the file runs them at
    other values; checked at the generated ones too, so both translations of every mod are)."""
    ns = cute_shim.load(_mods_text(src.source))
    if not any(n + "_knobs" in ns for n in _MOD_NAMES):
        return [(ns, knobs)]
    rules = len(src.length_rules)
    out = []
    if knobs[rules:] == tuple(src.scalars.values()):
        out.append((ns, knobs[:rules]))
    copy = dict(ns)
    for n in _MOD_NAMES:
        copy.pop(n, None)
        if n + "_knobs" in ns:
            copy[n] = ns[n + "_knobs"]
    return out + [(copy, knobs)]


def _check(mask: Mask, src: fa4.Fa4Source, batch: int, heads: int, q_len: int, kv_len: int,
           scalars: dict | None = None) -> str | None:
    """What the file's CuTe DSL computes (under the model) against `mask` pair by pair; `scalars`:
    knob values the file is called with (default: those it was generated with)."""
    for ns, knobs in _variants(src, _scalars(src, q_len, kv_len, scalars)):
        why = _check_mods(mask, ns, _aux(src), knobs, batch, heads, q_len, kv_len)
        if why is not None:
            return why
    return None


def _check_mods(mask: Mask, ns: dict, aux: list, knobs: tuple, batch: int, heads: int, q_len: int,
                kv_len: int) -> str | None:
    rng = torch.Generator().manual_seed(0)
    for b in range(batch):
        for h in range(heads):
            if mask.mask_mod is not None:
                want = dense_mask(mask, (0, q_len), (0, kv_len), [b], [h])[0, 0].numpy()
                got = cute_shim.run_mask(ns, b, h, q_len, kv_len, aux, scalars=knobs)
                if not np.array_equal(got, want):
                    bad = np.argwhere(got != want)[0]
                    return f"mask differs at b={b} h={h} q={bad[0]} kv={bad[1]}: {got[tuple(bad)]} vs {want[tuple(bad)]}"
            if mask.score_mod is not None:
                score = torch.randn(q_len, kv_len, generator=rng) * 3
                idx = [torch.tensor([b]), torch.tensor([h]), torch.arange(q_len), torch.arange(kv_len)]
                want = compat.vmap_bhqkv(mask.score_mod, *idx, score=score[None, None])[0, 0].float().numpy()
                got = cute_shim.run_score(ns, score.numpy(), b, h, aux, scalars=knobs)
                if not np.all(np.isfinite(got)) and np.any(np.isfinite(got) != np.isfinite(want)):
                    return f"score not finite at b={b} h={h}"
                err = np.abs(got - want) / (1 + np.abs(want))
                if float(np.nanmax(err)) > 2e-5:
                    return f"score differs at b={b} h={h}: max rel err {float(np.nanmax(err)):.3g}"
                if "score_mod_bwd_cute" in ns:  # the backward hook: grad * d score_mod / d score, against autograd
                    grad = torch.randn(q_len, kv_len, generator=rng)
                    s_in = score.clone().requires_grad_(True)
                    out = compat.vmap_bhqkv(mask.score_mod, *idx, score=s_in[None, None])[0, 0].float()
                    (want_g,) = torch.autograd.grad(out, s_in, grad)
                    got_g = cute_shim.run_score_bwd(ns, grad.numpy(), score.numpy(), b, h, aux, scalars=knobs)
                    err = np.abs(got_g - want_g.numpy()) / (1 + np.abs(want_g.numpy()))
                    if not float(np.nanmax(err)) <= 1e-4:
                        return f"score gradient differs at b={b} h={h}: max rel err {float(np.nanmax(err)):.3g}"
    return None


@pytest.mark.parametrize("case", range(len(corpus())), ids=[m.name for m, _, _ in corpus()])
def test_every_corpus_mod_in_cute_dsl_computes_the_mod(case):
    mask, batch, heads = corpus()[case]
    src = fa4.generate(mask, LENGTH, LENGTH, heads=heads, batch=batch)
    assert _check(mask, src, batch, heads, LENGTH, LENGTH) is None


@pytest.mark.parametrize("name,params", [("causal", {}), ("causal_sliding_window", {"window": 24}),
                                         ("prefix_lm", {"prefix_len": 40})])
def test_numbers_that_follow_the_lengths_are_computed_per_call(name, params):
    mask = make(name, params, q_len=96, kv_len=96)
    src = fa4.generate(mask, 96, 96)
    assert src.valid_q_len is None
    for q_len, kv_len in [(64, 200), (1, 77), (96, 96)]:
        rebuilt = bind(mask, q_len, kv_len, "cpu")
        assert _check(rebuilt, src, 1, 1, q_len, kv_len) is None, (q_len, kv_len)


def test_python_modulo_and_floor_division_on_negative_numbers():
    # the DSL's % is C's remainder: the translation must give Python's, and // must stay floor
    def mod(b, h, q_idx, kv_idx):
        return ((q_idx - kv_idx) % 7 == 3) | ((q_idx - kv_idx) // 5 == -2) | (torch.div(q_idx - kv_idx, 4, rounding_mode="trunc") == -1)

    mask = Mask("signed_arith", mask_mod=mod)
    src = fa4.generate(mask, 50, 50)
    assert "_py_mod(" in src.source and "_trunc_div(" in src.source
    assert _check(mask, src, 1, 1, 50, 50) is None


def test_the_model_of_the_dsl_can_fail():
    # a translation that writes C's remainder for Python's must be caught by the check above
    mask = Mask("signed_mod", mask_mod=lambda b, h, q_idx, kv_idx: (q_idx - kv_idx) % 7 == 3)
    src = fa4.generate(mask, 40, 40)
    broken = fa4.Fa4Source(**{**src.__dict__, "source": src.source.replace("_py_mod(", "_c_remainder(")
                              .replace("def _c_remainder(", "def _py_mod(")})
    broken.source = broken.source.replace("@cute.jit\ndef _trunc_div", "@cute.jit\ndef _c_remainder(a, b):\n"
                                          "    return a % b\n\n\n@cute.jit\ndef _trunc_div")
    assert "differs" in _check(mask, broken, 1, 1, 40, 40)


def _decode(src: fa4.Fa4Source, b: int, h: int, q_len: int, kv_len: int) -> np.ndarray:
    """The block lists as a class map [rows, cols]: 0 not listed, 1 partial, 2 full."""
    t = {k[len("blocks."):]: v.numpy() for k, v in src.tensors.items() if k.startswith("blocks.")}
    rows, cols = -(-q_len // 128), -(-kv_len // 128)
    assert t["mask_cnt"].shape[2:] == (rows,) and t["mask_idx"].shape[2:] == (rows, cols)
    assert all(v.dtype == np.int32 for v in t.values())
    out = np.zeros((rows, cols), dtype=np.int64)
    bb, hh = min(b, t["mask_cnt"].shape[0] - 1), min(h, t["mask_cnt"].shape[1] - 1)
    for r in range(rows):
        for kind, value in (("mask", 1), ("full", 2)):
            listed = t[f"{kind}_idx"][bb, hh, r, :t[f"{kind}_cnt"][bb, hh, r]]
            assert (np.diff(listed) > 0).all(), "a row's blocks ascend"
            assert (out[r, listed] == 0).all(), "a block is listed once"
            out[r, listed] = value
    return out


@pytest.mark.parametrize("name,params,q_len,kv_len,heads", [
    ("causal", {}, 300, 333, 1), ("document", None, 512, 512, 1), ("causal_sliding_window", {"window": 100}, 640, 640, 1),
    ("per_head_window", None, 384, 384, 4)])
def test_block_sparse_tensors_equal_the_dense_mask(name, params, q_len, kv_len, heads):
    mask = make(name, params or {}, q_len=q_len, kv_len=kv_len)
    heads = mask.heads or heads
    src = fa4.generate(mask, q_len, kv_len, heads=heads)
    assert src.scan_shape[2:] == (q_len, kv_len)
    for h in range(heads):
        dense = dense_mask(mask, (0, q_len), (0, kv_len), [0], [h])[0, 0].numpy()
        classes = _decode(src, 0, h, q_len, kv_len)
        for r in range(classes.shape[0]):
            for c in range(classes.shape[1]):
                tile = dense[r * 128:(r + 1) * 128, c * 128:(c + 1) * 128]
                if not tile.any():
                    assert classes[r, c] == 0, (h, r, c)
                elif tile.all() and tile.shape == (128, 128):
                    assert classes[r, c] == 2, (h, r, c)
                else:
                    assert classes[r, c] == 1, (h, r, c)


def test_the_spec_carries_the_fa4_section_and_writes_the_file(tmp_path):
    from workbench.export import build_spec, load_spec, write_spec

    w = torch.tensor([16, 32, 48, 64])

    def head_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < w[h])

    mask = Mask("own_head_window", mask_mod=head_window)
    spec = build_spec(mask, 256, 256, heads=4, golden=False)
    section = spec.doc["backends"]["flash_attn_cute"]
    assert section["fa4_version"] == fa4.FA4_VERSION and section["block_size"] == [128, 128]
    assert section["max_heads"] == 4 and section["aux_tensors"] == ["w"]
    json_path, _ = write_spec(spec, tmp_path)
    written = json_path.parent / section["file"]
    text = written.read_text()
    import ast

    imported = {alias.name.split(".")[0] for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(ast.parse(text)) if isinstance(node, ast.ImportFrom)}
    assert imported == {"importlib", "json", "os", "struct", "torch", "cutlass", "flash_attn"}, imported
    assert "pack_gqa=False if MASK_READS_HEAD" in text and "MASK_READS_HEAD = True" in text
    assert (json_path.parent / section["tensor_file"]).exists()
    assert load_spec(json_path).doc["backends"]["flash_attn_cute"]["file"] == section["file"]


def test_a_mask_fa4_cannot_read_is_listed_with_its_reason():
    big = torch.tensor([0, 2 ** 40])

    def far(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) | (big[1] < 0)

    from workbench.export import build_spec

    spec = build_spec(Mask("int64_table", mask_mod=far), 128, 128, golden=False)
    assert "flash_attn_cute" not in spec.doc["backends"]
    assert "int32" in spec.doc["unsupported"]["flash_attn_cute"]


def _plain_part(src: fa4.Fa4Source) -> dict:
    """The generated file without its CuTe DSL part, run here (its checks and list helpers need no
    cutlass)."""
    ns: dict = {}
    head = src.source.split("# ---------------------------------------------------------------- the mask and score")[0]
    tail = src.source.split("# ---------------------------------------------------------------- what this file was generated for")[1]
    import re

    tail = re.sub(r"(?m)^for _suffix in .*:\n(    .*\n)+", "", tail)  # the lines that set the hooks' attributes
    exec(compile(head.split('"""', 2)[2].replace("import cutlass\nimport cutlass.cute as cute\n", "") + tail,
                 "fa4file", "exec"), ns)
    return ns


def test_each_file_gives_its_hooks_their_own_kernel_cache_key():
    # FA4 keys its compiled kernels by the hooks' source text, the same in every file: without
    # __cute_hash__ a second mask in a process ran the first one's kernel
    a = fa4.generate(Mask("before", mask_mod=lambda b, h, q_idx, kv_idx: kv_idx <= q_idx), 128, 128).source
    b = fa4.generate(Mask("not_future", mask_mod=lambda b, h, q_idx, kv_idx: ~(kv_idx > q_idx)), 128, 128).source
    hooks = [t[t.index("def mask_mod_cute(b_idx"):].split("\n\n")[0] for t in (a, b)]
    assert hooks[0] == hooks[1]
    keys = [re.search(r"^MODS_HASH = '([0-9a-f]+)'$", t, re.M).group(1) for t in (a, b)]
    assert keys[0] != keys[1]
    assert all('globals()["mask_mod_cute" + _suffix].__cute_hash__ = MODS_HASH + ".mask" + _suffix' in t
               for t in (a, b))


@pytest.mark.parametrize("name,params,q_len,kv_len", [("causal", {}, 300, 333), ("document", None, 512, 512),
                                                      ("per_head_window", None, 384, 700)])
def test_the_backwards_lists_are_the_forwards_transposed(name, params, q_len, kv_len):
    mask = make(name, params or {}, q_len=q_len, kv_len=kv_len)
    heads = mask.heads or 1
    src = fa4.generate(mask, q_len, kv_len, heads=heads)
    ns = _plain_part(src)
    fwd = tuple(src.tensors[f"blocks.{n}"] for n in ("mask_cnt", "mask_idx", "full_cnt", "full_idx"))
    mask_cnt, mask_idx, full_cnt, full_idx = ns["_transposed"](fwd, q_len, kv_len)
    rows, cols = -(-q_len // 128), -(-kv_len // 128)
    assert mask_cnt.shape[2:] == (cols,) and mask_idx.shape[2:] == (cols, rows) and mask_idx.dtype == torch.int32
    assert all(t.is_contiguous() for t in (mask_cnt, mask_idx, full_cnt, full_idx))  # FA4 takes stride-1 rows only
    for h in range(heads):
        classes = _decode(src, 0, h, q_len, kv_len)  # [rows, cols], from the forward lists
        hh = min(h, mask_cnt.shape[1] - 1)
        for c in range(cols):
            for cnt, idx, value in ((mask_cnt, mask_idx, 1), (full_cnt, full_idx, 2)):
                listed = idx[0, hh, c, :cnt[0, hh, c]].tolist()
                assert listed == [r for r in range(rows) if classes[r, c] == value], (h, c, value)


def test_the_file_refuses_what_fa4_cannot_run_before_importing_it():
    src = fa4.generate(make("causal", q_len=128, kv_len=128), 128, 128)
    ns = _plain_part(src)
    q = torch.randn(1, 2, 128, 64)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        ns["_check"](q, q, q)
    with pytest.raises(ValueError, match="head dim 80"):
        ns["_check"](*(torch.randn(1, 2, 128, 80, dtype=torch.bfloat16),) * 3)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        ns["_check"](torch.randn(1, 3, 128, 64, dtype=torch.bfloat16), *(torch.randn(1, 2, 128, 64, dtype=torch.bfloat16),) * 2)
    with pytest.raises(ValueError, match="CUDA"):
        ns["_check"](*(torch.randn(1, 2, 128, 64, dtype=torch.bfloat16),) * 3)


def test_the_file_refuses_a_gpu_generation_whose_fa4_tiles_differ(monkeypatch):
    # the block-sparse tensors are cut at sm_90's 128 x 128; on Blackwell FA4 takes 256-query
    # blocks: the file says so instead of passing FA4 lists of the wrong size
    from torch._subclasses.fake_tensor import FakeTensorMode

    ns = _plain_part(fa4.generate(make("causal", q_len=128, kv_len=128), 128, 128))
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(1, 2, 128, 64, dtype=torch.bfloat16, device="cuda")
        monkeypatch.setenv("FLASH_ATTENTION_ARCH", "sm_100a")
        with pytest.raises(RuntimeError, match="sm_100.*FA4_ANY_ARCH=1"):
            ns["_check"](q, q, q)
        monkeypatch.setenv("FA4_ANY_ARCH", "1")
        ns["_check"](q, q, q)  # the user's override: FA4 judges the blocks itself
        monkeypatch.delenv("FA4_ANY_ARCH")
        monkeypatch.setenv("FLASH_ATTENTION_ARCH", "sm_90")
        ns["_check"](q, q, q)


def test_untranslatable_mods_raise_a_clear_error():
    with pytest.raises(WorkbenchError, match="CuTe DSL"):
        fa4.generate(Mask("complex", mask_mod=lambda b, h, q, kv: torch.tensor([1j])[0].real > q), 64, 64)


# (two minutes of CuTe DSL compiles: every corpus mod and five files; `make test-slow`)
@pytest.mark.slow
def test_the_cute_dsl_compiles_in_fa4s_hopper_kernel(early_run):
    # run_fa4_compile.py: every corpus mod in a kernel that calls it as FA4 does, and five generated
    # files through FA4's own sm_90 forward under FakeTensorMode (compiled for sm_90a, not launched)
    done = early_run("fa4_compile")
    if done.returncode == 3 and done.stdout.startswith("NO FA4"):
        pytest.skip(f"flash-attn-4 is not installed here (the dev extra installs it on Linux x86-64): {done.stdout}")
    lines = done.stdout.splitlines()
    failed = [line for line in lines if line.startswith("FAIL")]
    assert not failed, "\n".join(failed)
    assert f"SUMMARY {len(corpus()) + 5} compiled, 0 failed" in lines, done.stdout[-2000:] + done.stderr[-2000:]


def test_verify_on_fa4_says_what_it_needs_before_running():
    from workbench.run import Shape
    from workbench.verify import verify

    mask = make("causal", q_len=128, kv_len=128)
    with pytest.raises(WorkbenchError, match="CUDA GPU.*run_fa4_compile"):
        verify(mask, Shape(q_len=128, head_dim=64), backend="fa4")
    with pytest.raises(WorkbenchError, match="CUDA GPU"):
        verify(mask, Shape(q_len=128, head_dim=64), backend="fa4", backward=True)
    with pytest.raises(WorkbenchError, match="head dims 64, 96, 128"):
        verify(mask, Shape(q_len=128, head_dim=80), backend="fa4")


def test_cli_verify_on_fa4_refuses_a_cpu_with_the_fix(capsys):
    from workbench.cli import main

    code = main(["verify", "causal", "--q-len", "128", "--backend", "fa4"])
    err = capsys.readouterr().err
    assert code != 0 and "CUDA GPU" in err and "Traceback" not in err


def test_a_score_mod_without_a_derivative_gives_a_forward_only_file_that_says_why():
    mask = Mask("pow_score", score_mod=lambda score, b, h, q_idx, kv_idx: torch.pow(score, score * 0.0 + 2.5))
    src = fa4.generate(mask, 64, 64)
    section = src.section()
    assert section["backward"] is False and "derivative" in section["no_backward"]
    ns = _plain_part(src)
    assert ns["HAS_SCORE_GRAD"] is False and "def score_mod_bwd_cute" not in src.source
    assert "Backward: none (the score_mod's derivative could not be generated" in src.source


@pytest.mark.parametrize("name,params,turned", [("causal_sliding_window", {"window": 24}, {"window": 40}),
                                                ("prefix_lm", {"prefix_len": 40}, {"prefix_len": 7}),
                                                ("softcap", {"cap": 30.0}, {"cap": 2.5})])
def test_a_knob_is_read_at_run_time_and_turning_it_gives_the_other_masks_values(name, params, turned):
    mask = make(name, params, q_len=96, kv_len=96)
    src = fa4.generate(mask, 96, 96)
    (param, value), = turned.items()
    knob = f"knob_{param}"
    assert src.scalars[knob] == params[param] and (knob in src.mask_scalars) == (mask.mask_mod is not None)
    other = make(name, turned, q_len=96, kv_len=96)
    # the knob-reading copies are one text for every value of the knob (one FA4 compile serves every
    # turned value); the mods at the file's own value have it written in
    knob_part = "# The same mods reading the knobs"
    assert _mods_text(fa4.generate(other, 96, 96).source).split(knob_part)[1] == \
        _mods_text(src.source).split(knob_part)[1]
    assert _mods_text(fa4.generate(other, 96, 96).source) != _mods_text(src.source)
    assert _check(other, src, 1, 1, 96, 96, scalars={knob: value}) is None
    # the check can fail: the file at its own value is not the other mask
    assert _check(other, src, 1, 1, 96, 96) is not None
    if mask.mask_mod is not None:  # a turned knob at other lengths too (Lq = 1, Lq < Lk): the rules still follow
        for q_len, kv_len in ((1, 77), (64, 200)):
            assert _check(bind(make(name, turned, q_len=q_len, kv_len=kv_len), q_len, kv_len, "cpu"), src, 1, 1,
                          q_len, kv_len, scalars={knob: value}) is None, (q_len, kv_len)


def test_knobs_inside_and_masks_and_factories_are_lifted_and_python_control_flow_stays_a_literal():
    from torch.nn.attention.flex_attention import and_masks

    def window_of(size):
        def inner(b, h, q_idx, kv_idx):
            return q_idx - kv_idx < size
        return inner

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    mask = Mask("gym_window", mask_mod=and_masks(causal, window_of(17)))
    src = fa4.generate(mask, 100, 100)
    assert list(src.scalars.values()) == [17]
    assert _check(Mask("w9", mask_mod=and_masks(causal, window_of(9))), src, 1, 1, 100, 100,
                  scalars={next(iter(src.scalars)): 9}) is None

    steps = 3

    def stepped(b, h, q_idx, kv_idx):
        keep = q_idx >= kv_idx
        for i in range(steps):  # steers Python: a literal, never a knob
            keep = keep & (q_idx - kv_idx != 5 + i)
        return keep

    src = fa4.generate(Mask("stepped", mask_mod=stepped), 64, 64)
    assert src.scalars == {} and "aux_scalars" not in _mods_text(src.source)
    assert _check(Mask("stepped", mask_mod=stepped), src, 1, 1, 64, 64) is None


def test_the_file_checks_the_knobs_it_is_given():
    src = fa4.generate(make("causal_sliding_window", {"window": 24}, q_len=128, kv_len=128), 128, 128)
    ns = _plain_part(src)
    # the bottom-right offset Lk - Lq first (a length rule), then the window
    assert ns["_scalars"](None, 128, 128) == (0, 24) and ns["_scalars"]({"knob_window": 64.0}, 100, 128) == (28, 64)
    with pytest.raises(ValueError, match="no knob named 'window'.*knob_window"):
        ns["_scalars"]({"window": 64}, 128, 128)
    with pytest.raises(ValueError, match="no knob named 'len_offset'"):
        ns["_scalars"]({"len_offset": 3}, 128, 128)
    with pytest.raises(ValueError, match="integer knob"):
        ns["_scalars"]({"knob_window": 6.5}, 128, 128)
    with pytest.raises(TypeError, match="Python number"):
        ns["_scalars"]({"knob_window": torch.tensor(64)}, 128, 128)
    with pytest.raises(TypeError, match="Python number"):
        ns["_scalars"]({"knob_window": True}, 128, 128)
    # the block lists follow the mask's knobs: another window is another key (FA4's scan there)
    assert ns["_lists_key"](1, 1, 128, 128, "cuda:0", (0, 24)) != ns["_lists_key"](1, 1, 128, 128, "cuda:0", (0, 64))
    assert src.aux == []  # no aux tensor: FA4 wraps every index with a divmod when there is one
    section = src.section()
    assert section["aux_scalars"] == {"knob_window": 24} and section["mask_scalars"] == ["knob_window"]


def test_a_divisor_stays_a_literal_and_a_repeated_table_read_is_one_load():
    # FA4 divides by a literal with a multiply and a shift, by a run-time value with ~20 instructions;
    # a power of two is a mask (Python's % for any sign, in two's complement)
    src = fa4.generate(make("dilated_window", {"window": 256, "dilation": 4}, q_len=512, kv_len=512), 512, 512)
    assert list(src.scalars) == ["knob_window"]
    assert re.search(r"\(v_sub & 3\)", _mods_text(src.source)) and "_py_mod(v_sub" not in _mods_text(src.source)
    assert _check(make("dilated_window", {"window": 100, "dilation": 4}, q_len=512, kv_len=512), src, 1, 1, 512, 512,
                  scalars={"knob_window": 100}) is None
    # image spans read span_id[q] twice in the traced graph: one load in the CuTe DSL
    spans = fa4.generate(make("image_spans", q_len=1024, kv_len=1024), 1024, 1024)
    mask_part = _mods_text(spans.source).split("def mask_mod_cute(")[0]
    assert len(re.findall(r"span_id_ptr\[\(v_add\)\]", mask_part)) == 1
    assert _check(make("image_spans", q_len=1024, kv_len=1024), spans, 1, 1, 1024, 1024) is None


def test_a_score_divided_by_a_fixed_number_is_multiplied_by_its_reciprocal_unless_it_is_rounded():
    # inductor's CuTe DSL multiplies too (FLASH's softcap output is bitwise the reciprocal form's);
    # a quotient that is rounded, compared or used as an index keeps the exact division
    src = fa4.generate(make("softcap", {"cap": 30.0}), 64, 64)
    assert "(score * (1.0 / cutlass.Float32(aux_scalars[0])))" in _mods_text(src.source)
    assert _check(make("softcap", {"cap": 30.0}), src, 1, 1, 64, 64) is None
    table = torch.randn(40)

    def bucketed(score, b, h, q_idx, kv_idx):
        return score + table[torch.floor(score.abs() / 3.0).clamp(max=39).int()] + (q_idx - kv_idx) / 7.0

    mask = Mask("bucketed", score_mod=bucketed)
    text = _mods_text(fa4.generate(mask, 64, 64).source).split("def score_grad_cute_one")[0]
    assert re.search(r"\(\w+ / 3\.0\)", text) and re.search(r"\(\w+ \* \(1\.0 / 7\.0\)\)", text), text
    assert _check(mask, fa4.generate(mask, 64, 64), 1, 1, 64, 64) is None
    # the model can tell: a division rewritten where the quotient is rounded fails it
    bad = fa4.generate(mask, 64, 64)
    bad.source = re.sub(r"\((\w+) / 3\.0\)", r"(\1 * (1.0 / 3.0))", bad.source)
    # just below 15: 15 / 3 is just below 5 and floors to 4, 15 * fp32(1 / 3) rounds to 5
    score = torch.full((1, 1, 64, 64), float(np.nextafter(np.float32(15), np.float32(0))))
    idx = [torch.tensor([0]), torch.tensor([0]), torch.arange(64), torch.arange(64)]
    want = compat.vmap_bhqkv(bucketed, *idx, score=score)[0, 0].numpy()
    ns = cute_shim.load(_mods_text(bad.source))
    got = cute_shim.run_score(ns, score[0, 0].numpy(), 0, 0, _aux(bad), scalars=_scalars(bad, 64, 64))
    assert not np.allclose(got, want, atol=1e-3)


def test_a_range_check_is_one_unsigned_compare_exact_for_any_bound():
    # (d >= 0) & (d < w) -> Uint32(d) < Uint32(max(w, 0)): LLVM folds it for a literal w, not for a knob
    src = fa4.generate(make("causal_sliding_window", {"window": 24}, q_len=96, kv_len=96), 96, 96)
    text = _mods_text(src.source)
    assert "cutlass.Uint32(v_sub) < cutlass.Uint32(cutlass.max(cutlass.Int32(aux_scalars[1]), 0))" in text
    assert "cutlass.Uint32(v_sub) < cutlass.Uint32(24)" in text.split("# The same mods reading the knobs")[0]
    d = np.arange(96)[:, None] - np.arange(96)[None, :]
    for window in (24, 1, 0):
        for ns, values in _variants(src, (0, window)):  # the literal at 24, the knob copy at each value
            got = cute_shim.run_mask(ns, 0, 0, 96, 96, [], scalars=values)
            assert np.array_equal(got, (d >= 0) & (d < window)), window
    # the window was generated >= 0: the file keeps it so
    with pytest.raises(ValueError, match="generated non-negative"):
        _plain_part(src)["_scalars"]({"knob_window": -5}, 96, 96)

    def bounds(b, h, q_idx, kv_idx):  # both forms, the bounds per-head tables (any sign)
        d = kv_idx - q_idx
        return ((d <= w[h]) & (d >= 0)) | ((d >= 0) & (d < -u[h]))

    w = torch.tensor([3, 0, -1, 2 ** 31 - 1], dtype=torch.int32)
    u = torch.tensor([-2, 5, 7, -40], dtype=torch.int32)  # -u: 2, -5, -7, 40 (a bound of -5 keeps nothing)
    mask = Mask("bounds", mask_mod=bounds)
    src = fa4.generate(mask, 64, 64, heads=4)
    assert "(cutlass.max(" in _mods_text(src.source) and "-1) + 1)))" in _mods_text(src.source)
    assert _check(mask, src, 1, 4, 64, 64) is None


def test_a_window_from_a_moving_start_is_one_unsigned_compare_too():
    # NATTEN's (x >= lo) & (x < lo + k) with x, lo >= 0, split across a chain of ands
    src = fa4.generate(make("neighborhood_2d", {"kernel": 13}, q_len=8192, kv_len=8192), 8192, 8192)
    text = _mods_text(src.source).split("def mask_mod_cute(")[0]
    assert re.search(r"return v_\w+\n", text)
    final = re.search(r"    (v_\w+) = (.+)\n    return \1", text).group(2)
    assert final.count("cutlass.Uint32(") == 4 and final.count("< cutlass.Uint32(13)") == 2, final

    def band(b, h, q_idx, kv_idx):  # the <= form: keys lo .. lo + 4, lo = clamp(q - 2, 0, 91)
        lo = (q_idx - 2).clamp(0, 91)
        return (kv_idx <= lo + 4) & (q_idx >= 0) & (kv_idx >= lo)

    mask = Mask("band", mask_mod=band)
    src = fa4.generate(mask, 100, 100)
    assert "< cutlass.Uint32(5))" in _mods_text(src.source)
    assert _check(mask, src, 1, 1, 100, 100) is None
