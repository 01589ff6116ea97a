"""Translate every mod of the corpus to Triton and compare the generated functions with torch
on every pair, batch entry and head. Usage: python tests/run_triton_corpus.py DEVICE; with
TRITON_INTERPRET=1 it runs on the CPU. Prints `CASE <id> OK|WRONG|UNTRANSLATED detail` per mod
(ids: `case_ids`) and a COVERAGE line; exits 1 if a translated mod disagrees with torch."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mod_corpus import LENGTH, corpus  # noqa: E402
from workbench import compat  # noqa: E402
from workbench.blocks import dense_mask  # noqa: E402
from workbench.translate import Untranslatable, generate, run_grid  # noqa: E402


def check(mask, batch, heads, device):
    source, mask_ptrs, score_ptrs, captured = generate(mask)
    n = LENGTH
    for b in range(batch):
        for h in range(heads):
            if mask.mask_mod is not None:
                got = run_grid(source, b, h, n, n, [captured[p[:-4]].to(device) for p in mask_ptrs], device=device)
                want = dense_mask(mask, (0, n), (0, n), batch=[b], heads=[h], device=device)[0, 0]
                if not torch.equal(got, want):
                    bad = (got != want).nonzero()[0].tolist()
                    return f"mask differs at b={b} h={h} (q, kv)={bad}"
            if mask.score_mod is not None:
                score = torch.randn(n, n, device=device)
                got = run_grid(source, b, h, n, n, [captured[p[:-4]].to(device) for p in score_ptrs], device=device,
                               score=score)
                idx = [torch.tensor([x], dtype=torch.int32, device=device) for x in (b, h)]
                q = torch.arange(n, dtype=torch.int32, device=device)
                want = compat.vmap_bhqkv(mask.score_mod, *idx, q, q, score=score[None, None])[0, 0].float()
                if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
                    return f"score differs at b={b} h={h}: max err {float((got - want).abs().max()):.3g}"
    return None


def case_ids() -> list[str]:
    """One id per corpus mod, in order (the test collects them)."""
    return [f"{i}-{mask.name}".replace(" ", "") for i, (mask, _, _) in enumerate(corpus())]


def main():
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    translated, wrong, total = 0, 0, 0
    for case, (mask, batch, heads) in zip(case_ids(), corpus()):
        total += 1
        try:
            problem = check(mask, batch, heads, device)
        except Untranslatable as exc:
            print(f"CASE {case} UNTRANSLATED {exc}")
            continue
        translated += 1
        if problem:
            wrong += 1
            print(f"CASE {case} WRONG {problem}")
        else:
            print(f"CASE {case} OK")
    print(f"COVERAGE {translated}/{total} translated, {wrong} wrong")
    sys.exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
