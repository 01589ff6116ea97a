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


def test_the_backward_cases_match_the_reference_on_cuda(cuda):
    # each case compiles its own kernels (about 35 s a case on an H200's host): BWD_SHARD=i/n in
    # the environment runs every n-th case, so shards can run side by side in separate processes
    done = subprocess.run([sys.executable, str(ROOT / "run_port_backward.py"), "cuda", "10"], capture_output=True,
                          text=True, timeout=1200, env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
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


@pytest.mark.parametrize("name, seq", [("causal", 32768), ("window", 32768), ("t5", 32768), ("causal", 131072)])
def test_long_backward_matches_the_reference(cuda, name, seq):
    mask = {"causal": lambda: make("causal", q_len=seq, kv_len=seq, device=cuda),
            "window": lambda: make("causal_sliding_window", {"window": 1024}, q_len=seq, kv_len=seq, device=cuda),
            "t5": lambda: _t5(seq)}[name]()
    heads = 8 if name == "t5" else 4
    verdict = verify(mask, Shape(q_heads=heads, kv_heads=2, q_len=seq, kv_len=seq, head_dim=64), dtype="bfloat16",
                     device=cuda, backend="port", backward=True, seed=0)
    print(verdict.line)
    assert verdict.passed and {"dq", "dk", "dv"} <= {c.name for c in verdict.checks}, verdict.line
