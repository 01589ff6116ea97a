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
