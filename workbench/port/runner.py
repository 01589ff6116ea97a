"""Run a generated port on saved inputs, in a process of its own (on a CPU: under Triton's
interpreter, which must be on before triton is imported). Used by `port.run_file`.

    TRITON_INTERPRET=1 python -m workbench.port.runner PORT.py INPUTS.safetensors OUT.safetensors [SCALE]

INPUTS holds q, k, v (and cu_seqlens, or grad_out for a backward, with `table.NAME` for tables
that learn), or the six tensors of attention_paged (PAGED_ARGS, and `invariant` for its invariant
mode). Exit 0 with OUT holding `out` and `lse` (and dq, dk, dv, dtable.NAME after a backward); 3 when the port refuses the call (sizes it is not valid
for), with the reason on the last line of stderr.
"""

import importlib.util
import sys

__all__ = ["main", "PAGED_ARGS"]

PAGED_ARGS = ("q", "k_cache", "v_cache", "block_table", "cu_seqlens_q", "seq_lens")


def main(argv: list[str]) -> int:
    from safetensors.torch import load_file, save_file

    port_path, inputs_path, out_path = argv[:3]
    scale = float(argv[3]) if len(argv) > 3 else None
    spec = importlib.util.spec_from_file_location("port_under_test", port_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    inputs = load_file(inputs_path)
    try:
        if "block_table" in inputs:  # one serving step over a paged cache
            out, lse = module.attention_paged(*(inputs[n] for n in PAGED_ARGS), scale=scale, return_lse=True,
                                              check=True, invariant="invariant" in inputs)
        elif "grad_out" in inputs:  # forward and backward: dq, dk, dv for the upstream gradient grad_out
            import torch

            q, k, v = (inputs[n].requires_grad_() for n in ("q", "k", "v"))
            tables = {n[len("table."):]: t.requires_grad_() for n, t in inputs.items() if n.startswith("table.")}
            out, lse = module.attention(q, k, v, scale=scale, return_lse=True, tables=tables)
            got = torch.autograd.grad(out, (q, k, v, *tables.values()), inputs["grad_out"])
            grads = dict(zip(("dq", "dk", "dv", *(f"dtable.{n}" for n in tables)), got))
            out, lse = out.detach(), lse.detach()
        else:
            extra = {"cu_seqlens": inputs["cu_seqlens"]} if "cu_seqlens" in inputs else {}
            out, lse = module.attention(inputs["q"], inputs["k"], inputs["v"], scale=scale, return_lse=True, **extra)
    except (ValueError, TypeError) as exc:
        print(str(exc), file=sys.stderr)
        return 3
    save_file({"out": out.contiguous(), "lse": lse.contiguous(),
               **{n: g.contiguous() for n, g in (grads if "grad_out" in inputs else {}).items()}}, out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
