"""The port on the GPU: every corpus and random mod in bf16 and fp32, library golden vectors,
decode shapes against 32K keys, and a long verification. Run with `pytest -m gpu`."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from workbench import make
from workbench.run import Shape
from workbench.verify import verify

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.gpu
def test_ports_match_the_reference_in_bf16_and_fp32(cuda):
    # every corpus and random mod in bf16 (fp32 of each runs in the interpreter on CI), and the library's
    # golden vectors through conformance in bf16 and fp32
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "run_port_corpus.py"), "cuda", "10", "bfloat16",
                          "conformance"], capture_output=True, text=True, timeout=1200,
                         env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    summary = [line for line in out.stdout.splitlines() if line.startswith("SUMMARY")]
    fails = [line for line in out.stdout.splitlines() if line.startswith("FAIL")]
    assert out.returncode == 0 and summary, "\n".join(fails[:20]) + out.stderr[-3000:]
    print(summary[0])


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
