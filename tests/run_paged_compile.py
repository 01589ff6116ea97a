"""attention_paged's portable kernel compiled for sm_90a on a machine without a GPU (Triton's
compiler against a stand-in driver, as tests/run_hopper_compile.py does; nothing launches): a
decode step in bf16, which splits its keys (its pieces stored for _paged_fold; the decode tile
under its register budget, PAGED_MAXNREG, kept without spills), a prefill step, and the decode
step without the budget. Prints `CASE <name> OK|FAIL` per form, then a
SUMMARY line; exits 1 on any failure."""

import os
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
import torch  # noqa: E402
from triton.runtime import driver  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from run_hopper_compile import _Target, ptxas  # noqa: E402
from workbench import make, port  # noqa: E402


def main() -> int:
    driver.set_active(_Target())
    module = port.load(port.build(make("causal_sliding_window", {"window": 300}), 256, 256,
                                  out_dir=tempfile.mkdtemp(prefix="paged_compile_")))
    launches = []
    module._launch_paged = lambda grid, args, flags, stages, *rest: launches.append((grid, args, flags, stages))
    real_check = module._check_paged

    def check(*args):  # (the tensors are on the CPU: pass the device test as the interpreter would)
        module._INTERPRET = True
        try:
            return real_check(*args)
        finally:
            module._INTERPRET = False

    module._check_paged = check
    failed = 0
    budgets = dict(module.PAGED_MAXNREG)  # (the file's: the decode tile's register budget)
    forms = (("decode", 4, 1, budgets), ("prefill", 512, 256, budgets), ("decode_no_budget", 4, 1, {}))
    for name, total_q, per_seq, budget_of in forms:
        launches.clear()
        module.PAGED_MAXNREG = budget_of
        seqs = total_q // per_seq
        q = torch.zeros(total_q, 8, 128, dtype=torch.bfloat16)
        cache = torch.zeros(512, 16, 2, 128, dtype=torch.bfloat16)
        table = torch.zeros(seqs, 512, dtype=torch.int32)  # (8,192 keys: two pieces of SPLIT_KEYS)
        cu = torch.arange(0, total_q + 1, per_seq, dtype=torch.int32)
        lens = torch.full((seqs,), 8000, dtype=torch.int32)
        try:
            module.attention_paged(q, cache, cache, table, cu, lens)
        except Exception:  # (the fold kernel's launch, after the kernel's, fails on the stand-in driver)
            pass
        try:
            grid, args, flags, stages = launches[0]
            assert flags["SPLIT"] or per_seq > 1, flags  # (a decode step splits its keys)
            # (on a GPU of sm_90 and newer a split decode's kernel and fold take programmatic
            # dependent launch: PDL, griddepcontrol; a CPU tensor never does, so it is set here)
            kernel = module._paged_kernel.warmup(*args, grid=grid, **flags, num_stages=stages, PDL=flags["SPLIT"])
            report = ptxas(kernel)
            budget = budget_of.get((flags["BLOCK_M"], flags["BLOCK_N"], flags["num_warps"], stages))
            assert name != "decode" or budget, (flags, stages, budget_of)  # (the file's decode tile has one)
            if budget:  # (the launch asked for the budget, and ptxas kept it without spilling)
                assert flags.get("maxnreg") == budget, flags
                used = int(report.split(" registers")[0].split()[-1])
                assert used <= budget and "0 bytes spill stores" in report, report
            print(f"CASE {name} OK {report}", flush=True)
            if flags["SPLIT"]:
                out = torch.zeros(total_q, 8, 128, dtype=torch.bfloat16)
                part = torch.zeros(2, total_q, 8, 128, dtype=torch.float32)
                fold = module._paged_fold.warmup(out, part, part, part, lens, cu, seqs, total_q, 8, 128, 2, 4096,
                                                 grid=(total_q, 8), D_PAD=128, RETURN_LSE=True, INTERPRET=False,
                                                 ORDERED=False, PIECES=2, PDL=True, launch_pdl=True, num_warps=4,
                                                 num_stages=3)
                assert "griddepcontrol.wait" in fold.asm["ptx"], "the fold does not wait for the kernel"
                assert "griddepcontrol.launch_dependents" in kernel.asm["ptx"], "the kernel never lets the fold start"
                print(f"CASE {name}_fold OK {ptxas(fold)}", flush=True)
        except Exception as exc:
            failed += 1
            print(f"CASE {name} FAIL {type(exc).__name__}: {str(exc)[-400:]}", flush=True)
    print(f"SUMMARY {len(forms) - failed}/{len(forms)} forms of the paged kernel compile for sm_90a")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
