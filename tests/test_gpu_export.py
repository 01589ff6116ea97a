"""Porting specs on the GPU: generated Triton compiled for real, specs built on CUDA with the
FlexAttention time in `cost`. Run on a CUDA machine: `pytest -m gpu`."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from workbench import library, make
from workbench.blocks import dense_mask
from workbench.define import with_score
from workbench.export import build_spec, conformance, write_spec

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]


def test_triton_source_of_every_library_mask_compiles_and_matches(cuda, tmp_path):
    paths = []
    for name, factory in library().items():
        mask = make(factory, q_len=1000, kv_len=1000, device=cuda)
        if mask.mask_mod is None:
            mask = with_score(make("causal"), mask)
        spec = build_spec(mask, 1000, 1000, heads=mask.heads, golden=False, generalize=False, device=cuda)
        assert "triton" in spec.supported, (name, spec.unsupported.get("triton"))
        json_path, _ = write_spec(spec, tmp_path)
        np.save(tmp_path / f"{spec.name}.want.npy", dense_mask(mask, (0, 1000), (0, 1000), device=cuda)[0, 0].cpu().numpy())
        paths.append(str(json_path))
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "run_triton_spec.py"), "cuda", *paths],
                         capture_output=True, text=True, timeout=600)
    print(out.stdout)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("OK") == len(paths)


def test_spec_on_cuda_records_flex_time_and_golden_passes_a_port(cuda, tmp_path):
    import torch

    mask = make("document", {"doc_lengths": [1000, 548, 500]}, q_len=2048, kv_len=2048, device=cuda)
    spec = build_spec(mask, 2048, 2048, heads=4, device=cuda, seed=3)
    assert spec.doc["cost"]["flex_ms"] > 0 and spec.doc["cost"]["flex_device"]
    assert spec.doc["backends"]["flash_attn"]["cu_seqlens_q"] == [0, 1000, 1548, 2048]
    path, _ = write_spec(spec, tmp_path)

    def fa_reading(q, k, v, s):  # the FA kwargs read as segments, run with SDPA per segment
        fa = s["backends"]["flash_attn"]
        out = torch.empty_like(q)
        cu = fa["cu_seqlens_q"]
        for a, b in zip(cu[:-1], cu[1:]):
            out[:, :, a:b] = torch.nn.functional.scaled_dot_product_attention(
                q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=fa["causal"])
        return out
    report = conformance(path, fa_reading, device=cuda)
    assert report.passed, report.to_frame()
