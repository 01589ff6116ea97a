"""attention(q, k, v, invariant=True), the trainer's side of invariant mode, against the float64
reference: library masks, score mods and users' mods at odd lengths, Lq != Lk and GQA, in fp32
and bf16. Usage:

    TRITON_INTERPRET=1 python tests/run_port_invariant.py cpu
    python tests/run_port_invariant.py cuda

Prints `CASE <id> OK|FAIL detail` per case, then a SUMMARY line."""

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench import Mask, make, port, with_score  # noqa: E402
from workbench.define import prepare  # noqa: E402
from workbench.run import Shape, make_inputs  # noqa: E402
from workbench.verify import LSE_TOLERANCE, TOLERANCES, compare, reference_attention  # noqa: E402

W = torch.tensor([5, 33, 70, 200])  # a user's per-head windows


def head_window(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx < W[h])


def cases():
    return [("causal", make("causal"), 4, 2, 200, 200), ("causal_lq_lt_lk", make("causal"), 4, 4, 37, 290),
            ("users_head_window", Mask("users_head_window", mask_mod=head_window), 4, 2, 150, 150),
            ("prefix_lm", make("prefix_lm", {"prefix_len": 40}), 2, 1, 170, 170),
            ("causal+alibi", with_score(make("causal"), make("alibi", {"num_heads": 4})), 4, 4, 130, 130),
            ("sinks_window", make("sinks_window"), 8, 1, 260, 260)]


def main(argv) -> int:
    device = argv[0] if argv else "cpu"
    folder = Path(tempfile.mkdtemp(prefix="port_invariant_"))
    failed = total = 0
    for name, mask, heads, kv_heads, lq, lk in cases():
        for dtype in ("float32", "bfloat16"):
            total += 1
            try:
                shape = Shape(batch=1, q_heads=heads, kv_heads=kv_heads, q_len=lq, kv_len=lk, head_dim=16)
                ready = prepare(mask, None, lq, lk, device, heads=heads)
                module = port.load(port.build(ready, lq, lk, heads=heads, out_dir=folder / f"{name}_{dtype}"))
                inputs = make_inputs(shape, dtype, device, seed=total)
                with torch.no_grad():
                    out, lse = module.attention(inputs.q, inputs.k, inputs.v, invariant=True, return_lse=True)
                ref = reference_attention(ready, inputs, progress=False)
                checks = [compare("out", out, ref.out, TOLERANCES[dtype]), compare("lse", lse, ref.lse,
                                                                                    LSE_TOLERANCE[dtype])]
                bad = [c for c in checks if not c.passed]
                problem = "; ".join(f"{c.name} max abs err {c.max_abs_err:.3g}, {c.bad_count} bad, {c.nan_count} NaN"
                                    for c in bad) or None
            except Exception as exc:
                problem = f"raised {type(exc).__name__}: {str(exc)[:300]}"
            failed += problem is not None
            print(f"CASE {name}-{dtype} {'OK' if problem is None else 'FAIL'}" + (f" {problem}" if problem else ""),
                  flush=True)
    print(f"SUMMARY {total - failed}/{total} invariant contiguous calls equal the reference")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
