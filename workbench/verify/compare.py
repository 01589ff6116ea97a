"""Comparing a kernel's tensors with the reference's: tolerances per run dtype (the reasoning next to
each), one TensorCheck per tensor (errors, where the worst one is, NaN counts), and merging checks
computed in pieces (split references)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from workbench.run import Shape

__all__ = ["Tolerance", "TOLERANCES", "LSE_TOLERANCE", "AXES", "TensorCheck", "compare", "merge_checks",
           "_grad_tolerance"]


# ---------------------------------------------------------------- tolerances

@dataclass(frozen=True)
class Tolerance:
    """An element passes when |got - ref| <= atol + rtol * |ref|; the tensor also needs
    ||got - ref||_F / max(||ref||_F, rms_floor * sqrt(n)) <= rel_fro (rms_floor: the size below
    which a tensor's values are cancellation, not magnitude; 0 for all but the log-sum-exp)."""

    atol: float
    rtol: float
    rel_fro: float
    why: str
    rms_floor: float = 0.0


TOLERANCES = {
    # Inputs are drawn in the run dtype and the reference upcasts those same values, so the
    # only error is the kernel's arithmetic and the final rounding of its output.
    "float64": Tolerance(1e-9, 1e-9, 1e-10, "float64 kernel vs float64 reference: summation order only"),
    "float32": Tolerance(2e-5, 2e-5, 1e-5,
                         "fp32 unit roundoff 6e-8; online softmax over up to 1e6 keys loses a few "
                         "hundred ulps in the worst row"),
    "tf32": Tolerance(5e-3, 5e-3, 2e-3, "TF32 matmuls keep 10 mantissa bits (roundoff 4.9e-4) on q.k and p.v; "
                      "errors average out over the head dim"),
    "float16": Tolerance(5e-3, 5e-3, 2e-3, "fp16 output rounding 4.9e-4 plus p cast to fp16 before p.v; "
                         "measured rel error ~3e-4"),
    "bfloat16": Tolerance(3e-2, 3e-2, 1e-2,
                          "bf16 output rounding 3.9e-3 plus p cast to bf16 before p.v; measured rel error "
                          "2.1e-3 on the H200 (same as SDPA flash), so 1e-2 leaves 5x room"),
}


# The log-sum-exp comes back in float32 whatever the dtype; scores are O(sqrt(D)) so it gets an
# absolute tolerance of its own. Its Frobenius check counts a row's lse as at least 1 in size: an
# lse near 0 is a sum of O(1) terms that cancel (one key: lse = q.k * scale), whose rounding
# follows the terms, not the result (a correct float32 kernel at Lq = Lk = 1 was failed at an lse
# of 9e-4 off by 1.1e-8).
LSE_TOLERANCE = {"float64": Tolerance(1e-9, 1e-9, 1e-10, "float64", rms_floor=1.0),
                 "float32": Tolerance(1e-4, 1e-5, 1e-5, "fp32 log-sum-exp", rms_floor=1.0),
                 "tf32": Tolerance(2e-2, 2e-3, 2e-3, "tf32 q.k", rms_floor=1.0),
                 "float16": Tolerance(1e-2, 2e-3, 2e-3, "lse from fp16-rounded scores", rms_floor=1.0),
                 "bfloat16": Tolerance(2e-2, 4e-3, 4e-3, "lse from the kernel's fp32 scores of bf16 inputs",
                                       rms_floor=1.0)}


# ---------------------------------------------------------------- comparing

AXES = {"out": ("b", "h", "q", "d"), "lse": ("b", "h", "q"), "dq": ("b", "h", "q", "d"),
        "dk": ("b", "h_kv", "kv", "d"), "dv": ("b", "h_kv", "kv", "d")}


@dataclass
class TensorCheck:
    """One tensor compared with the reference."""

    name: str
    max_abs_err: float
    rel_err: float  # ||got - ref||_F / ||ref||_F (finite entries)
    worst: dict[str, int]  # index of the largest error, by axis name
    worst_got: float
    worst_ref: float
    bad_count: int  # elements outside atol + rtol * |ref| (NaN counts as bad)
    nan_count: int
    inf_count: int  # infinities where the reference is finite (or of the other sign)
    numel: int
    atol: float
    rtol: float
    rel_tol: float
    passed: bool
    ref_norm: float = 0.0  # ||ref||_F and ||got - ref||_F over finite entries (checks of row ranges merge with them)
    err_norm: float = 0.0


def compare(name: str, got: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> TensorCheck:
    got = got.to(ref.device, torch.float64)
    ref = ref.to(torch.float64)
    nan = torch.isnan(got) | torch.isnan(ref)  # NaN on either side never passes
    same_inf = torch.isinf(got) & torch.isinf(ref) & (torch.sign(got) == torch.sign(ref))
    bad_inf = torch.isinf(got) & ~same_inf
    ref_inf = torch.isinf(ref) & ~same_inf  # reference says -inf (dead row) and the kernel does not
    finite = torch.isfinite(got) & torch.isfinite(ref)
    diff = torch.where(finite, (got - ref).abs(), torch.zeros((), dtype=torch.float64, device=ref.device))
    diff = torch.where(nan | bad_inf | ref_inf, torch.full((), float("inf"), dtype=torch.float64, device=ref.device), diff)
    limit = tol.atol + tol.rtol * torch.where(finite, ref.abs(), torch.zeros((), dtype=torch.float64, device=ref.device))
    bad = diff > limit
    ref_f = torch.where(finite, ref, 0.0)
    norm = max(float(torch.linalg.vector_norm(ref_f)), tol.rms_floor * math.sqrt(int(finite.sum())))
    err_f = float(torch.linalg.vector_norm(torch.where(finite, got - ref, 0.0)))
    rel = err_f / norm if norm > 0 else err_f
    flat = int(torch.argmax(diff))
    index = list(torch.unravel_index(torch.tensor(flat), diff.shape)) if diff.dim() else []
    axes = AXES.get(name, tuple(f"dim{i}" for i in range(diff.dim())))
    worst = {axis: int(i) for axis, i in zip(axes, index)}
    max_abs = float(diff.max()) if diff.numel() else 0.0
    n_nan, n_inf, n_bad = int(nan.sum()), int((bad_inf | ref_inf).sum()), int(bad.sum())
    passed = n_nan == 0 and n_inf == 0 and n_bad == 0 and rel <= tol.rel_fro
    return TensorCheck(name=name, max_abs_err=max_abs, rel_err=rel, worst=worst,
                       worst_got=float(got.reshape(-1)[flat]) if got.numel() else 0.0,
                       worst_ref=float(ref.reshape(-1)[flat]) if ref.numel() else 0.0,
                       bad_count=n_bad, nan_count=n_nan, inf_count=n_inf, numel=got.numel(), atol=tol.atol,
                       rtol=tol.rtol, rel_tol=tol.rel_fro, passed=passed, ref_norm=norm, err_norm=err_f)


def merge_checks(parts: list[tuple[TensorCheck, int]]) -> TensorCheck:
    """One check from checks of consecutive query-row ranges: (check, first row of its range)."""
    import dataclasses

    first = parts[0][0]
    worst_part, offset = max(parts, key=lambda p: p[0].max_abs_err)
    worst = dict(worst_part.worst)
    if "q" in worst:
        worst["q"] += offset
    norm = math.sqrt(sum(c.ref_norm ** 2 for c, _ in parts))
    err = math.sqrt(sum(c.err_norm ** 2 for c, _ in parts))
    rel = err / norm if norm > 0 else err
    n_nan, n_inf, n_bad = (sum(getattr(c, f) for c, _ in parts) for f in ("nan_count", "inf_count", "bad_count"))
    return dataclasses.replace(
        first, max_abs_err=worst_part.max_abs_err, rel_err=rel, worst=worst, worst_got=worst_part.worst_got,
        worst_ref=worst_part.worst_ref, bad_count=n_bad, nan_count=n_nan, inf_count=n_inf,
        numel=sum(c.numel for c, _ in parts), ref_norm=norm, err_norm=err,
        passed=n_nan == 0 and n_inf == 0 and n_bad == 0 and rel <= first.rel_tol)


def _grad_tolerance(dtype: str, name: str, ref: torch.Tensor, shape: Shape | None = None) -> Tolerance:
    base = TOLERANCES[dtype]
    if name in ("dq", "dk", "dv"):
        # dk and dv sum over every query row: their size grows with the length, so the
        # elementwise check is looser and the Frobenius check carries the weight
        factor = 1 if name == "dq" else 4
        return Tolerance(base.atol * factor, base.rtol * factor, base.rel_fro * 2,
                         f"{base.why}; x{factor} for a gradient summed over rows")
    # a captured tensor's gradient sums over up to B x H x Lq x Lk pairs per entry (a bias table
    # entry collects every pair at its distance; the clamped last one most of them): its rounding
    # error scales with the largest entry, and for the Frobenius check with sqrt(pairs) roundoffs
    # of the kernel's float32 (float64) accumulation -- measured on an H200: 4.1e-5 for a
    # 65-entry table over 2 x 1024 x 1024 pairs in float32, 4x the plain float32 limit
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    pairs = shape.batch * shape.q_heads * shape.q_len * shape.kv_len if shape is not None else 1
    roundoff = 1.1e-16 if dtype == "float64" else 6e-8
    rel_fro = max(base.rel_fro * 2, 4 * math.sqrt(pairs) * roundoff)
    return Tolerance(base.atol * 4 + base.rtol * 4 * scale, base.rtol * 4, rel_fro,
                     f"{base.why}; entries are sums over many pairs, so errors scale with the largest "
                     f"(and with sqrt({pairs}) accumulation roundoffs)")
