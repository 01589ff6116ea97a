"""The derivative of every score_mod of the corpus (d score_mod / d score, generated op by op from
its traced graph by workbench.translate.derivative) against torch.autograd on the original mod,
over a grid of random scores, per batch entry and head; then translated to Triton like any mod
and run there. Usage: TRITON_INTERPRET=1 python tests/run_score_derivative.py cpu. Prints
`CASE <id> OK|WRONG|UNTRANSLATED detail` and a SUMMARY line; exits 1 if one is wrong."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mod_corpus import LENGTH, corpus  # noqa: E402
from workbench import Mask, compat  # noqa: E402
from workbench.translate import Untranslatable, generate, run_grid  # noqa: E402
from workbench.translate.derivative import derivative_mod  # noqa: E402


def check(mask, batch, heads, device) -> str | None:
    d_mod = derivative_mod(mask.score_mod)
    source, _, score_ptrs, captured = generate(Mask(f"{mask.name}_dscore", score_mod=d_mod))
    n = LENGTH
    for b in range(batch):
        for h in range(heads):
            score = (torch.randn(n, n, device=device) * 10).requires_grad_()
            idx = [torch.tensor([x], dtype=torch.int32, device=device) for x in (b, h)]
            q = torch.arange(n, dtype=torch.int32, device=device)
            out = compat.vmap_bhqkv(mask.score_mod, *idx, q, q, score=score[None, None])
            (want,) = torch.autograd.grad(out.sum(), score, allow_unused=True)
            want = torch.zeros_like(score) if want is None else want
            fx_got = compat.vmap_bhqkv(d_mod, *idx, q, q, score=score.detach()[None, None])[0, 0]
            if not torch.allclose(fx_got.float(), want, rtol=1e-5, atol=1e-5):
                return f"graph derivative differs at b={b} h={h}: max err {float((fx_got - want).abs().max()):.3g}"
            got = run_grid(source, b, h, n, n, [captured[p[:-4]].to(device) for p in score_ptrs], device=device,
                           score=score.detach())
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
                return f"Triton derivative differs at b={b} h={h}: max err {float((got - want).abs().max()):.3g}"
    return None


def main() -> int:
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    total = wrong = untranslated = 0
    for i, (mask, batch, heads) in enumerate(corpus()):
        if mask.score_mod is None:
            continue
        total += 1
        case = f"{i}-{mask.name}".replace(" ", "")
        try:
            problem = check(mask, batch, heads, device)
        except Untranslatable as exc:
            untranslated += 1
            print(f"CASE {case} UNTRANSLATED {exc}", flush=True)
            continue
        wrong += problem is not None
        print(f"CASE {case} {'OK' if problem is None else 'WRONG'}" + (f" {problem}" if problem else ""), flush=True)
    print(f"SUMMARY {total - wrong - untranslated}/{total} score_mod derivatives equal autograd "
          f"({untranslated} untranslated)")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
