"""The port's Hopper kernel (Gluon, sm_90) on a machine without a GPU: it is generated for users'
mods and compiles for sm_90a without spilling registers (tests/run_hopper_compile.py, which runs
Triton's compiler against a stand-in driver). Whether it computes attention is checked on a GPU:
tests/test_gpu_port.py::test_hopper_kernel_matches_the_reference."""

import os
import subprocess
import sys
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


@pytest.mark.skipif(not _has_gluon(), reason="this Triton has no Gluon Hopper module (Triton 3.5 and later)")
def test_hopper_kernel_compiles_for_sm90_without_spills():
    # the causal mask, a softcap score_mod (tl.sigmoid, which Gluon lacks, written out) and a user's
    # .any() over captured image spans (the most registers of the compile script's masks)
    names = ["causal_bottom_right", "causal_bottom_right+softcap_30", "users_image_spans"]
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "run_hopper_compile.py"), *names],
                          capture_output=True, text=True, timeout=900,
                          env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "SUMMARY 3/3" in done.stdout, done.stdout[-3000:]


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
    assert "def _sigmoid_gluon(x)" in soft and "HOPPER_MODS = None" in soft
    monkeypatch.setenv("PORT_HOPPER", "0")
    module = port.load(port.write(generated, tmp_path / "off"))
    assert module.HOPPER is False
    monkeypatch.delenv("PORT_HOPPER", raising=False)
    module = port.load(port.write(generated, tmp_path / "on"))
    import torch
    q = torch.zeros(1, 1, 128, 64, dtype=torch.bfloat16)
    assert module.HOPPER is True and not module._hopper_ready(q, q, q, None, False)  # a CPU tensor: never


def test_mods_with_a_name_gluon_lacks_keep_the_portable_kernel():
    # a translation that writes a Triton name with no Gluon counterpart gets no Gluon copy: the file
    # says why (HOPPER_MODS) and the Hopper kernel never takes its calls
    from workbench.port.generate import _gluon_mods

    part = "@triton.jit\ndef mask_mod_triton(b, h, q_idx, kv_idx):\n    return tl.cumsum(q_idx, 0) >= kv_idx\n"
    text, reason = _gluon_mods([part])
    assert reason == "the mods use tl.cumsum, which Gluon does not have" and "mask_mod_gluon" not in text
    text, reason = _gluon_mods([part.replace("tl.cumsum(q_idx, 0)", "tl.maximum(q_idx, 0)")])
    assert reason is None and "gl.maximum(q_idx, 0)" in text and "@gluon.jit" in text


@pytest.mark.skipif(not _has_gluon(), reason="this Triton has no Gluon Hopper module (Triton 3.5 and later)")
def test_a_loop_the_kernel_does_not_have_is_refused_by_name(tmp_path):
    import torch

    module = port.load(port.build(make("causal"), 128, 128, out_dir=tmp_path))
    module.HOPPER_LOOP = "ping-pong"
    q = torch.zeros(1, 1, 128, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="HOPPER_LOOP = 'ping-pong' names no form.*'auto', 'serial', 'overlap', "
                       "'specialized', 'pingpong'"):
        module._hopper_launch(q, q, q, 0.125, False, {})
