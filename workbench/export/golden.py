"""Golden vectors: float64-reference outputs on random inputs at the spec's shape, for porting
engineers to run their implementation against (`conformance`)."""

from __future__ import annotations

import math
from dataclasses import asdict

import torch

from workbench.define import Mask, WorkbenchError
from workbench.export.files import PortingSpec, _safe_name, tensor_digest
from workbench.run import Shape, make_inputs, run_flex
from workbench.verify import reference_attention

__all__ = ["add_golden", "GOLDEN_VECTORS", "GRADIENTS"]


GOLDEN_VECTORS = 2
# what a backward is judged on: the upstream gradient of out, then the reference's gradients
GRADIENTS = ("grad_out", "dq", "dk", "dv")


# ---------------------------------------------------------------- golden vectors

def add_golden(spec: PortingSpec, mask: Mask, batch: int, heads: int, head_dim: int, device, seed: int | None):
    """Float64-reference outputs on random float32 inputs at the spec's shape (vector 1 has
    4x larger queries: peaked softmaxes, where masking mistakes show most), and the gradients of
    sum(out * grad_out) for a random grad_out (GRADIENTS). The inputs sit on the bfloat16 grid,
    so a port that casts them to bf16 or fp16 loses nothing."""

    q_len, kv_len = spec.doc["shape"]["q_len"], spec.doc["shape"]["kv_len"]
    shape = Shape(batch=batch, q_heads=heads, q_len=q_len, kv_len=kv_len, head_dim=head_dim)
    seeds = []
    for n in range(GOLDEN_VECTORS):
        inputs = make_inputs(shape, "float32", device, seed=None if seed is None else seed + n, backward=True)
        inputs.q, inputs.k, inputs.v, inputs.grad_out = (t.bfloat16().float() for t in (inputs.q, inputs.k, inputs.v,
                                                                                         inputs.grad_out))
        if n == 1:
            inputs.q = inputs.q * 4
        ref = reference_attention(mask, inputs, backward=True)
        nan_why = ref.nan_message(mask.name)
        if nan_why:
            raise WorkbenchError(f"no golden vectors can be written: {nan_why}",
                                 "fix the score_mod so that every kept pair has a finite score, then export again",
                                 mask.name)
        for key, value in (("q", inputs.q), ("k", inputs.k), ("v", inputs.v), ("out", ref.out), ("lse", ref.lse),
                           ("grad_out", inputs.grad_out), *((g, ref.grads[g]) for g in GRADIENTS[1:])):
            spec.tensors[f"golden.{n}.{key}"] = value.detach().cpu().numpy()
        seeds.append(inputs.seed)
    spec.doc["golden"] = {
        "file": f"{_safe_name(spec.name)}.golden.safetensors", "vectors": GOLDEN_VECTORS, "seeds": seeds,
        "input_dtype": "float32", "inputs_exact_in": ["bfloat16", "float32"], "reference_dtype": "float64", "scale": 1 / math.sqrt(head_dim),
        "shapes": {"q": [batch, heads, q_len, head_dim], "k": [batch, heads, kv_len, head_dim],
                   "v": [batch, heads, kv_len, head_dim], "out": [batch, heads, q_len, head_dim],
                   "lse": [batch, heads, q_len], "grad_out": [batch, heads, q_len, head_dim],
                   "dq": [batch, heads, q_len, head_dim], "dk": [batch, heads, kv_len, head_dim],
                   "dv": [batch, heads, kv_len, head_dim]},
        "gradients": list(GRADIENTS),
        "tensors": "golden.N.q / .k / .v / .out / .lse for N = 0 .. vectors - 1; .grad_out (the upstream gradient "
                   "of out) and .dq / .dk / .dv (the reference's gradients of sum(out * grad_out))",
        "fully_masked_rows": "out = 0 and lse = -inf there (FlexAttention's convention)",
        "sha256": {name: tensor_digest(spec.tensors[name]) for name in sorted(spec.tensors)
                   if name.startswith("golden.")},
    }
    if device.type == "cuda" and mask.mask_mod is not None:
        spec.doc["cost"].update(_flex_time(mask, shape, device))


def _flex_time(mask: Mask, shape, device) -> dict:
    from triton.testing import do_bench


    inputs = make_inputs(shape, "bfloat16", device, seed=0)
    run = run_flex(mask, inputs)
    ms = do_bench(lambda: run_flex(mask, inputs, block_mask=run.block_mask), warmup=5, rep=50)
    return {"flex_ms": ms, "flex_device": torch.cuda.get_device_name(device), "flex_dtype": "bfloat16",
            "flex_shape": asdict(shape), "torch": torch.__version__}
