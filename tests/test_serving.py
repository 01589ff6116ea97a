"""Invariant mode: attention_paged(..., invariant=True) gives a request the bits of the trainer's
attention(q, k, v, invariant=True) in every serving layout (workbench.serving; on a CPU under
Triton's interpreter), and that contiguous call equals the float64 reference. Fast mode is
reported, not required to be bitwise."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from workbench import Mask, serving  # noqa: E402
from workbench.define import WorkbenchError  # noqa: E402

W = torch.tensor([4, 9, 30, 100])  # a user's per-head windows, read at w[h]


def users_head_window(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx < W[h])


# (minutes of the interpreter: every serving layout through the CLI; `make test-slow`)
@pytest.mark.slow
def test_the_cli_reports_invariant_mode_bitwise_in_every_serving_layout():
    done = subprocess.run([sys.executable, "-m", "workbench", "invariance", "causal", "--q-len", "80", "--backend",
                           "port", "--serving", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--dtype",
                           "float32", "--device", "cpu", "--json"], capture_output=True, text=True, timeout=900,
                          cwd=ROOT.parent)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    record = json.loads(done.stdout.strip().splitlines()[-1])
    rows = record["modes"]["invariant"]
    keys = {r["key"] for r in rows}
    assert {"contiguous", "step", "order", "pages_shuffled", "page_128", "split", "unsplit", "chunked_aligned",
            "chunked_unaligned", "decode"} <= keys
    assert record["passed"] and all(r["bitwise"] and r["max_ulp"] == 0 for r in rows), rows
    assert record["modes"]["fast"], "fast mode is reported too"


@pytest.mark.slow  # (a minute or more here; make test-slow, which CI runs)
def test_a_users_per_head_table_in_bf16_with_gqa_at_an_odd_length_over_two_pieces():
    result = serving.check(Mask("users_head_window", mask_mod=users_head_window), q_len=70, heads=4, kv_heads=2,
                           head_dim=16, dtype="bfloat16", device="cpu", modes=("invariant",))
    assert result.passed, result.to_frame().to_string()
    assert len(result.modes["invariant"]) == 10 and "INVARIANT users_head_window" in result.line


def test_a_bidirectional_prefix_is_not_the_same_attention_when_chunked():
    """A chunk sees only the keys so far; prefix-LM rows keep later prefix keys, so the chunked and
    decode layouts compute another attention: they are marked, not counted, not called invariant
    or broken."""
    result = serving.check("prefix_lm", {"prefix_len": 30}, q_len=64, heads=2, head_dim=16, dtype="float32",
                           device="cpu", modes=("invariant",))
    rows = {r.key: r for r in result.modes["invariant"]}
    assert not rows["chunked_aligned"].same_attention and "keeps key" in rows["chunked_aligned"].why
    assert rows["step"].same_attention and rows["step"].bitwise
    assert result.passed and "not the same attention" in result.line


@pytest.mark.slow  # (a minute or more here; make test-slow, which CI runs)
def test_invariant_contiguous_calls_equal_the_reference(early_run):
    done = early_run("port_invariant")  # tests/run_port_invariant.py cpu, started at collection (conftest)
    summary = [line for line in done.stdout.splitlines() if line.startswith("SUMMARY")]
    assert done.returncode == 0 and summary and summary[0].startswith("SUMMARY 12/12"), done.stdout[-3000:] + \
        done.stderr[-2000:]


@pytest.mark.parametrize("kwargs, match", [
    ({"q_len": 4}, "too short to chunk"), ({"q_len": 64, "dtype": "float64"}, "compares 'float64' bits"),
    ({"q_len": 64, "heads": 4, "kv_heads": 3}, "not a multiple of kv_heads"),
    ({"q_len": 64, "modes": ("slow",)}, "name some of invariant, fast"),
])
def test_bad_serving_checks_name_the_cause(kwargs, match):
    with pytest.raises(WorkbenchError, match=match):
        serving.check("causal", head_dim=16, device="cpu", **{"dtype": "float32", **kwargs})


def test_serving_needs_the_port_backend():
    done = subprocess.run([sys.executable, "-m", "workbench", "invariance", "causal", "--q-len", "64", "--serving",
                           "--device", "cpu"], capture_output=True, text=True, timeout=300, cwd=ROOT.parent)
    assert done.returncode != 0 and "add --backend port" in done.stderr, done.stderr[-1500:]


def test_verify_judges_the_invariant_paged_port_against_the_reference():
    from workbench import make
    from workbench.run import Shape
    from workbench.verify import verify

    verdict = verify(make("causal_sliding_window", {"window": 40}), Shape(batch=2, q_heads=4, kv_heads=2, q_len=37,
                                                                           kv_len=150, head_dim=16),
                     dtype="bfloat16", backend="port-paged-invariant", device="cpu")
    assert verdict.passed and "paged, invariant mode" in verdict.line, verdict.line


PACKED = '''
import sys, torch
sys.path.insert(0, sys.argv[1])
from workbench import make, port
from workbench.port.layout import paged_step
L1, L2 = 150, 200
doc = make("document", {"doc_lengths": [L1, L2]}, q_len=L1 + L2, kv_len=L1 + L2)
packed_port = port.load(port.build(doc, L1 + L2, L1 + L2, out_dir=sys.argv[2] + "/doc"))
causal_port = port.load(port.build(make("causal"), 256, 256, out_dir=sys.argv[2] + "/causal"))
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 4, L1 + L2, 16, generator=g).bfloat16() for _ in range(3))
k, v = k[:, :2], v[:, :2]
with torch.no_grad():
    packed = packed_port.attention(q, k, v, cu_seqlens=[0, L1, L1 + L2], invariant=True)
    for s, e in ((0, L1), (L1, L1 + L2)):
        alone = causal_port.attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], invariant=True)
        step = paged_step(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], page_size=16, seed=1)
        paged = step.unpack(causal_port.attention_paged(*step.args(), invariant=True, check=True))
        print("DOC", torch.equal(packed[:, :, s:e], alone), torch.equal(paged, alone), bool(alone.isnan().any()))
'''


def test_a_packed_training_batch_gives_each_document_the_engines_bits(tmp_path):
    """A trainer packs documents (a document mask with cu_seqlens); the engine serves each one as
    its own request over pages. In invariant mode both give a document the same bits: the
    packed call's tiles start at each document's start, so its keys fall into the same tiles."""
    script = tmp_path / "packed.py"
    script.write_text(PACKED)
    done = subprocess.run([sys.executable, str(script), str(ROOT.parent), str(tmp_path)], capture_output=True,
                          text=True, env=dict(os.environ, TRITON_INTERPRET="1"), timeout=600)
    lines = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("DOC")]
    assert lines == [["True", "True", "False"]] * 2, done.stdout[-2000:] + done.stderr[-2000:]
