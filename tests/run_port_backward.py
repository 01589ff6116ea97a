"""The port's backward on every mod of the corpus (and random mods of the trust grammar): dq, dk,
dv, and the gradients of learnable tables, against the float64 reference's autograd. Usage:

    TRITON_INTERPRET=1 python tests/run_port_backward.py cpu [N_RANDOM]
    python tests/run_port_backward.py cuda [N_RANDOM] [LENGTH]

Cases: the corpus at its lengths (GQA where the heads allow, Lq != Lk where a mask is defined
so), the random mods (odd lengths, Lq < Lk), learnable tables (a T5-style bucketed bias at a
computed index, a per-head slope, a 0-d temperature), a finite-difference check of the gradient
along a random direction, packed documents (cu_seqlens), rows that keep nothing, a gradient
flowing into lse, Lq = 1, bfloat16, deterministic=True run twice (bitwise), and dq and dk / dv in
two launches (bitwise one launch's). Prints `CASE <id> OK|FAIL detail`, then a SUMMARY line; exits 1 on any failure."""

import os
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mod_corpus import corpus  # noqa: E402
from run_port_corpus import random_mod  # noqa: E402
from workbench import Mask, make, port, with_score  # noqa: E402
from workbench.define import prepare  # noqa: E402
from workbench.define.trace import captured_tensors  # noqa: E402
from workbench.run import Shape, learnable_tensors, make_inputs  # noqa: E402
from workbench.verify import TOLERANCES, compare, reference_attention  # noqa: E402
from workbench.verify.compare import _grad_tolerance  # noqa: E402

class _Launches:
    """Stands in for a kernel of the file, recording each launch's kernel name in `launched`."""

    def __init__(self, name, kernel, launched):
        self.name, self.kernel, self.launched = name, kernel, launched

    def __getitem__(self, grid):
        self.launched.append(self.name)
        return self.kernel[grid]

    def __getattr__(self, attr):  # (what the file's _launch reads of a kernel on a GPU: its signature)
        if attr == "kernel":
            raise AttributeError(attr)
        return getattr(self.kernel, attr)


def run(mask, shape, dtype, device, folder, lse_weight=None, deterministic=False, cu_seqlens=None, fused=True,
        built_at=None):
    """(out, lse, grads by the reference's names) of the port's forward and backward on fresh
    inputs, with the loss sum(out * grad_out) (+ sum(lse * lse_weight)). fused=False: dq and
    dk / dv in two launches (the path where their tiles cannot share one), checked to be taken.
    built_at: the (Lq, Lk) the port is generated at, when not the call's."""
    if str(device) != "cpu":  # the cases' tables are made on the CPU, as users make them: moved, in place,
        for t in captured_tensors(mask).values():  # to where this run is (their mods capture them)
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                t.data = t.data.to(device)
    mask = prepare(mask, None, shape.q_len, shape.kv_len, device, heads=shape.q_heads)
    module = port.load(port.build(mask, *(built_at or (shape.q_len, shape.kv_len)), heads=shape.q_heads,
                                  batch=shape.batch, out_dir=folder))
    module.BWD_FUSED = fused
    launched = []
    for name in ("_bwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel"):
        setattr(module, name, _Launches(name, getattr(module, name), launched))
    inputs = make_inputs(shape, dtype, device, seed=0, backward=True)
    learn = learnable_tensors(mask)
    tables = {name: t.detach().clone().requires_grad_() for name, t in learn.items()}
    q, k, v = (t.detach().requires_grad_() for t in (inputs.q, inputs.k, inputs.v))
    out, lse = module.attention(q, k, v, return_lse=True, tables=tables, deterministic=deterministic,
                                cu_seqlens=cu_seqlens)
    loss = (out.float() * inputs.grad_out.float()).sum()
    if lse_weight is not None:
        loss = loss + (torch.where(lse.isinf(), 0.0, lse) * lse_weight).sum()
    loss.backward()
    want = ["_bwd_kernel"] if fused else ["_bwd_dq_kernel", "_bwd_dkdv_kernel"]
    # (a tile that does not fit is tried again with fewer stages: the same kernel twice in a row)
    assert list(dict.fromkeys(launched)) == want, f"the backward launched {launched}, not {want}"
    grads = {"dq": q.grad, "dk": k.grad, "dv": v.grad, **{f"d{n}": t.grad for n, t in tables.items()}}
    return mask, inputs, out.detach(), grads


def finite_difference(mask, shape, dtype, device, folder, eps=None) -> str | None:
    """The gradient along a random direction u of (q, k, v, the learnable tables) against the
    central difference (L(x + eps u) - L(x - eps u)) / 2 eps of the port's own forward, L =
    sum(out * grad_out). (Not torch.autograd.gradcheck: the kernels accumulate in float32, so the
    file runs float32 at most; in float32 the difference is good to about 1e-4 here.)"""
    # the step: on a GPU each float32 forward's rounding (about 1e-7 of each of the 5,760 outputs,
    # in an order the kernel picks) moves L by about 1e-5, 4e-3 of the difference at eps = 1e-3
    # (measured on an H200: dk -1.45758 by the backward, -1.45313 by the difference); at 1e-2 that
    # is 4e-4, and the central difference's own error (eps^2) is still inside the tolerance (under
    # the interpreter the case passes at eps 1e-2 and 3e-2 too)
    eps = eps if eps is not None else (1e-3 if device == "cpu" else 1e-2)
    mask, inputs, _, grads = run(mask, shape, dtype, device, folder)
    module = port.load(port.build(mask, shape.q_len, shape.kv_len, heads=shape.q_heads, batch=shape.batch,
                                  out_dir=folder))
    learn = learnable_tensors(mask)
    x = {"dq": inputs.q, "dk": inputs.k, "dv": inputs.v, **{f"d{n}": t.detach() for n, t in learn.items()}}
    g = torch.Generator(device=device).manual_seed(5)
    u = {n: torch.randn(t.shape, generator=g, device=device) for n, t in x.items()}

    def loss(which, sign):
        moved = {n: (t.double() + sign * eps * u[n]).float() if n == which else t for n, t in x.items()}
        with torch.no_grad():
            out = module.attention(moved["dq"], moved["dk"], moved["dv"],
                                   tables={n: moved[f"d{n}"] for n in learn})
        return float((out.double() * inputs.grad_out.double()).sum())

    wrong = []
    for name in x:  # one input at a time: each gradient on its own
        numeric = (loss(name, 1) - loss(name, -1)) / (2 * eps)
        analytic = float((grads[name].double() * u[name]).sum())
        if abs(numeric - analytic) > 2e-3 * max(1.0, abs(analytic)):
            wrong.append(f"{name}: {analytic:.6g} (backward) against {numeric:.6g} (finite difference)")
    return "; ".join(wrong) or None


def check(mask, shape, dtype, device, folder, lse_grad=False, deterministic=False, fd=False,
          cu_seqlens=None, two_launches=False, built_at=None) -> str | None:
    if fd:
        return finite_difference(mask, shape, dtype, device, folder)
    weight = torch.randn(shape.batch, shape.q_heads, shape.q_len, device=device) if lse_grad else None
    mask, inputs, out, grads = run(mask, shape, dtype, device, folder, weight, deterministic, cu_seqlens,
                                   fused=not two_launches, built_at=built_at)
    if two_launches:  # the same bits as one launch: dq, dk, dv always; a table's gradient where it is
        # summed in a fixed order (deterministic=True); float atomics add in the order the GPU runs them
        _, _, _, fused = run(mask, shape, dtype, device, folder / "fused", weight, deterministic, cu_seqlens)
        exact = [n for n in grads if deterministic or n in ("dq", "dk", "dv")]
        differ = [n for n in exact if not torch.equal(grads[n], fused[n])]
        if differ:
            return f"two launches gave other bits than one in {differ}"
    if weight is not None:  # the reference's loss has no lse term: fold it into grad_out's rows instead
        return _check_lse(mask, inputs, grads, weight, dtype)
    ref = reference_attention(mask, inputs, backward=True, device=device, progress=False)
    checks = [compare("out", out, ref.out, TOLERANCES[dtype])]
    for name, want in ref.grads.items():
        got = grads.get(name)
        if got is None:
            return f"no gradient for {name}"
        checks.append(compare(name, got, want, _grad_tolerance(dtype, name, want, shape)))
    if deterministic:
        _, _, _, again = run(mask, shape, dtype, device, folder / "again", None, True)
        same = [n for n in grads if not torch.equal(grads[n], again[n])]
        if same:
            return f"deterministic=True gave other bits in {same}"
    bad = [c for c in checks if not c.passed]
    return None if not bad else "; ".join(f"{c.name}: max abs err {c.max_abs_err:.3g}, rel {c.rel_err:.3g}, "
                                          f"{c.bad_count} bad, {c.nan_count} NaN" for c in bad)


def _check_lse(mask, inputs, grads, weight, dtype) -> str | None:
    """d/dq of sum(out * grad_out) + sum(lse * weight), against float64 autograd of the oracle."""
    from workbench.verify import oracle_attention

    q, k, v = (t.detach().double().requires_grad_() for t in (inputs.q, inputs.k, inputs.v))
    out, lse = oracle_attention(mask, q, k, v)
    loss = (out * inputs.grad_out.double()).sum() + (torch.where(lse.isinf(), 0.0, lse) * weight.double()).sum()
    want = dict(zip(("dq", "dk", "dv"), torch.autograd.grad(loss, (q, k, v))))
    bad = []
    for name, w in want.items():
        c = compare(name, grads[name], w, _grad_tolerance(dtype, name, w, inputs.shape))
        if not c.passed:
            bad.append(f"{name}: max abs err {c.max_abs_err:.3g}, {c.bad_count} bad, {c.nan_count} NaN")
    return "; ".join(bad) or None


def special_cases() -> list[tuple[str, Mask, Shape, str, dict]]:
    """(id, mask, shape, dtype, options) beyond the corpus."""
    H = 4
    bias = torch.randn(H, 33, generator=torch.Generator().manual_seed(3)) * 0.5
    slope = torch.rand(H, generator=torch.Generator().manual_seed(4))
    temp = torch.tensor(0.7)

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def t5(score, b, h, q_idx, kv_idx):  # a T5-style bucket: exact up to 8, then logarithmic
        d = (q_idx - kv_idx).clamp(0, 1000)
        bucket = torch.where(d < 8, d, (8 + (torch.log((d.float() + 1) / 8) / 2.0 * 8).int()).clamp(max=32))
        return score + bias[bucket.new_zeros(()) + h, bucket]

    def sloped(score, b, h, q_idx, kv_idx):
        return score * temp - slope[h] * (q_idx - kv_idx).abs()

    def late_keys(b, h, q_idx, kv_idx):  # rows 0..9 keep nothing
        return (kv_idx <= q_idx) & (kv_idx >= 10)

    wide = torch.randn(H, 200, generator=torch.Generator().manual_seed(6)) * 0.5

    def relative(score, b, h, q_idx, kv_idx):  # 200 entries a tile may read: added pair by pair
        return score + wide[h, (q_idx - kv_idx + 100).clamp(0, 199)]

    t5_mask = Mask("learn_t5_bias", mask_mod=causal, score_mod=t5, data={"bias": bias.requires_grad_()})
    wide_mask = Mask("learn_wide_relative_table", score_mod=relative, data={"wide": wide.requires_grad_()})
    slope_mask = Mask("learn_slope_and_temperature", mask_mod=causal, score_mod=sloped,
                      data={"slope": slope.requires_grad_(), "temp": temp.requires_grad_()})
    def distance(score, b, h, q_idx, kv_idx):
        return score - 0.1 * (q_idx - kv_idx).abs()

    doc_mask = make("document", {"doc_lengths": [40, 57, 53]}, q_len=150, kv_len=150)
    soft = with_score(make("causal_sliding_window", {"window": 24}), make("softcap", {"cap": 4.0}))
    return [
        ("learn_t5_bias", t5_mask, Shape(batch=1, q_heads=H, kv_heads=2, q_len=90, kv_len=90, head_dim=16), "float32", {}),
        ("learn_slope_and_temperature", slope_mask, Shape(batch=2, q_heads=H, kv_heads=1, q_len=70, kv_len=70,
                                                          head_dim=16), "float32", {}),
        ("learn_t5_bias_deterministic", t5_mask, Shape(batch=1, q_heads=H, kv_heads=2, q_len=90, kv_len=90,
                                                       head_dim=16), "float32", {"deterministic": True}),
        ("learn_slope_and_temperature_deterministic", slope_mask, Shape(batch=2, q_heads=H, kv_heads=1, q_len=70,
                                                                        kv_len=70, head_dim=16), "float32",
         {"deterministic": True}),
        ("learn_t5_bias_two_launches", t5_mask, Shape(batch=1, q_heads=H, kv_heads=2, q_len=77, kv_len=90,
                                                      head_dim=16), "float32", {"two_launches": True}),
        ("learn_t5_bias_two_launches_deterministic", t5_mask, Shape(batch=1, q_heads=H, kv_heads=2, q_len=77,
                                                                    kv_len=90, head_dim=16), "float32",
         {"two_launches": True, "deterministic": True}),
        ("learn_wide_relative_table", wide_mask, Shape(batch=1, q_heads=H, kv_heads=2, q_len=150, kv_len=130,
                                                       head_dim=16), "float32", {}),
        # tables read inside their bounds hold at any length (define.value_spans): generated at one
        # length, called and trained at another
        ("learn_t5_bias_other_length", t5_mask, Shape(batch=1, q_heads=H, kv_heads=2, q_len=131, kv_len=140,
                                                      head_dim=16), "float32", {"built_at": (64, 64)}),
        ("learn_wide_relative_table_other_length", wide_mask, Shape(batch=1, q_heads=H, kv_heads=2, q_len=70,
                                                                    kv_len=190, head_dim=16), "float32",
         {"built_at": (150, 130)}),
        ("finite_difference_t5_bias", t5_mask, Shape(batch=1, q_heads=H, kv_heads=2, q_len=90, kv_len=90,
                                                     head_dim=16), "float32", {"fd": True}),
        ("packed_documents", doc_mask, Shape(batch=1, q_heads=4, kv_heads=2, q_len=150, kv_len=150, head_dim=16),
         "float32", {"cu_seqlens": [0, 40, 97, 150]}),
        ("rows_that_keep_nothing", Mask("late_keys", mask_mod=late_keys), Shape(q_heads=2, q_len=75, kv_len=75,
                                                                                head_dim=16), "float32", {}),
        ("gradient_into_lse", soft, Shape(q_heads=2, q_len=80, kv_len=120, head_dim=16), "float32", {"lse_grad": True}),
        ("decode_one_query", make("causal"), Shape(q_heads=4, kv_heads=2, q_len=1, kv_len=150, head_dim=16),
         "float32", {}),
        ("head_dim_40_bf16", soft, Shape(batch=2, q_heads=4, kv_heads=2, q_len=100, kv_len=130, head_dim=40),
         "bfloat16", {}),
        ("queries_over_keys", Mask("top_left_causal_distance", mask_mod=causal, score_mod=distance),
         Shape(q_heads=2, q_len=140, kv_len=60, head_dim=16), "float32", {}),
    ]


def cases(n_random: int, length: int | None = None) -> list[tuple[str, Mask, Shape, str, dict]]:
    out = []
    for n, (mask, batch, heads) in enumerate(corpus()):
        L = mask.q_len or length or 96
        shape = Shape(batch=batch, q_heads=heads, kv_heads=1 if heads % 2 else heads // 2 or 1, q_len=L,
                      kv_len=mask.kv_len or L, head_dim=16)
        out.append((f"{n}-{mask.name}".replace(" ", ""), mask, shape, "float32", {}))
    rng = random.Random(2)
    for n in range(n_random):
        q_len = rng.randint(1, 150)
        kv_len = q_len + rng.randint(0, 40)
        batch, heads = rng.randint(1, 2), rng.randint(1, 4)
        out.append((f"random{n}", random_mod(rng, q_len, kv_len, batch, heads),
                    Shape(batch=batch, q_heads=heads, q_len=q_len, kv_len=kv_len, head_dim=rng.choice([16, 24])),
                    "bfloat16" if n % 2 else "float32", {}))
    return out + special_cases()


def refusals(device, folder) -> list[tuple[str, str | None]]:
    """(case id, the error's text or None): calls the backward must refuse with a clear error."""
    table = torch.randn(4, 8)
    ids = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3] * 4)

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def bias(score, b, h, q_idx, kv_idx):
        return score + table[h, (q_idx - kv_idx).clamp(0, 7)]

    def documents(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]

    def growth(score, b, h, q_idx, kv_idx):  # its derivative needs d(a ** score): no rule
        return torch.pow(score, score * 0.0 + 2.5)

    out = []

    def attempt(case, fn):
        try:
            fn()
            out.append((case, None))
        except (ValueError, TypeError, RuntimeError) as exc:
            out.append((case, str(exc)))

    L = 32
    q, k, v = (torch.randn(1, 4, L, 16, device=device, requires_grad=True) for _ in range(3))
    m = port.load(port.build(Mask("bias", mask_mod=causal, score_mod=bias), L, L, heads=4, out_dir=folder / "a"))
    attempt("refuse-unknown-table", lambda: m.attention(q, k, v, tables={"bais": table.clone()}))
    attempt("refuse-table-shape", lambda: m.attention(q, k, v, tables={"table": torch.zeros(4, 9)}))
    docs = port.load(port.build(Mask("docs", mask_mod=documents), L, L, out_dir=folder / "b"))
    attempt("refuse-mask-table", lambda: docs.attention(q, k, v, tables={"ids": ids.clone()}))
    try:
        pw = port.load(port.build(Mask("growth", mask_mod=causal, score_mod=growth), L, L, out_dir=folder / "c"))
        attempt("refuse-no-derivative", lambda: pw.attention(q, k, v).sum().backward())
    except Exception as exc:  # the forward itself does not translate: nothing to refuse here
        out.append(("refuse-no-derivative", f"forward not generated: {exc}"))
    return out


REFUSALS = {"refuse-unknown-table": "reads no tensor named 'bais'", "refuse-table-shape": "of shape (4, 8)",
            "refuse-mask-table": "read by the mask_mod",
            "refuse-no-derivative": "derivative could not be generated"}


def main(argv):
    device = argv[0] if argv else "cpu"
    n_random = int(argv[1]) if len(argv) > 1 else 4
    length = int(argv[2]) if len(argv) > 2 else None
    folder = Path(tempfile.mkdtemp(prefix="port_backward_"))
    # BWD_SHARD=i/n: every n-th case from the i-th (the refusals in shard 0), so that a GPU run,
    # whose cases each compile their own kernels, can be split across processes
    shard, shards = (int(x) for x in os.environ.get("BWD_SHARD", "0/1").split("/"))
    only = [w for w in os.environ.get("BWD_ONLY", "").split(",") if w]  # BWD_ONLY=a,b: the cases naming a or b
    todo = [c for c in cases(n_random, length) if not only or any(w in c[0] for w in only)]
    todo = [c for n, c in enumerate(todo) if n % shards == shard]
    failed = 0
    for n, (case, mask, shape, dtype, options) in enumerate(todo):
        try:
            problem = check(mask, shape, dtype, device, folder / f"case{n}", **options)
        except Exception as exc:
            problem = f"raised {type(exc).__name__}: {str(exc)[:300]}"
        failed += problem is not None
        size = f"B={shape.batch} Hq={shape.q_heads} Hkv={shape.kv_heads} {shape.q_len}x{shape.kv_len} D={shape.head_dim}"
        print(f"CASE {case}-{dtype} {'OK' if problem is None else 'FAIL'} {size}" + (f": {problem}" if problem else ""),
              flush=True)
    refused = refusals(device, folder) if shard == 0 and not only else []
    for case, text in refused:
        ok = text is not None and REFUSALS[case] in text
        failed += not ok
        print(f"CASE {case} {'OK' if ok else 'FAIL'}: {text}", flush=True)
    print(f"SUMMARY {len(todo) + len(refused) - failed}/{len(todo) + len(refused)} backward passes match the "
          "float64 reference or refuse clearly" + (f" (shard {shard}/{shards})" if shards > 1 else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
