"""The score_mod's derivative for the port's backward (issue: the port learns backward), generated
op by op from the traced graph: equal to torch.autograd on every score_mod of the corpus, in torch
and translated to Triton (under the interpreter); an op without a rule is refused by name."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workbench.define import trace_mod
from workbench.translate import Untranslatable
from workbench.translate.derivative import derivative_mod, score_derivative

ROOT = Path(__file__).resolve().parent


def test_every_corpus_score_mod_derivative_equals_autograd_in_torch_and_in_triton():
    pytest.importorskip("triton")
    done = subprocess.run([sys.executable, str(ROOT / "run_score_derivative.py"), "cpu"], capture_output=True,
                          text=True, env=dict(os.environ, TRITON_INTERPRET="1"), timeout=600)
    summary = [line for line in done.stdout.splitlines() if line.startswith("SUMMARY")]
    assert done.returncode == 0 and summary, done.stdout[-3000:] + done.stderr[-2000:]
    total = int(summary[0].split()[1].split("/")[1])
    assert summary[0].startswith(f"SUMMARY {total}/{total}") and total >= 12, summary[0]


SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])


def users_bias(score, b, h, q_idx, kv_idx):  # a per-head slope, a clamp and a where, the way users write them
    rel = (q_idx - kv_idx).clamp(-8, 8).float()
    return torch.where(score > 0, score * 1.5, score / (1 + score * score)) - SLOPES[h] * rel.abs()


def test_a_users_mod_with_a_table_clamp_and_where_matches_autograd():
    d = derivative_mod(users_bias)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        s = (torch.randn((), generator=g) * 5).requires_grad_()
        idx = [torch.tensor(int(x), dtype=torch.int32) for x in torch.randint(0, 4, (2,), generator=g)] + \
              [torch.tensor(int(x), dtype=torch.int32) for x in torch.randint(0, 40, (2,), generator=g)]
        (want,) = torch.autograd.grad(users_bias(s, *idx), s)
        assert torch.allclose(d(s.detach(), *idx), want, rtol=1e-6, atol=1e-6)


def test_an_op_without_a_rule_is_refused_by_name():
    with pytest.raises(Untranslatable, match="`atan` of the score_mod has no derivative rule"):
        score_derivative(trace_mod(lambda score, b, h, q_idx, kv_idx: torch.atan(score), "score"))
