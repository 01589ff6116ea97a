"""Stage 5, verify: a kernel (FlexAttention, or the generated port) against the float64 reference,
on fresh random inputs, judged per tensor; the Verdict says PASS / FAIL, where, and the traps found."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import pandas as pd
import torch
from torch.nn.attention.flex_attention import BlockMask

from workbench import port
from workbench.define import Mask, WorkbenchError
from workbench.run import (
    Fa4Backend,
    FlexBackend,
    PortBackend,
    PortPagedBackend,
    Shape,
    backend_for,
    check_backward_device,
    check_block_mask,
    check_device_dtype,
    dtype_name,
    make_inputs,
)
from workbench.verify.compare import LSE_TOLERANCE, TOLERANCES, TensorCheck, _grad_tolerance, compare
from workbench.verify.distribute import compare_on_ray, reference_on_ray, start_rows_workers
from workbench.verify.findings import Finding, _changed_roles, _mod_snapshot, block_mask_findings, mod_findings
from workbench.verify.reference import reference_attention, reference_budget

__all__ = ["Verdict", "verify", "ReferenceOptions"]


# ---------------------------------------------------------------- the verdict

@dataclass
class Verdict:
    """FlexAttention vs the reference for one mask and one set of random inputs."""

    name: str
    shape: Shape
    dtype: str
    device: str
    seed: int
    compiled: bool
    checks: list[TensorCheck]
    findings: list[Finding]
    fully_masked_rows: int
    masked_row_examples: list[tuple[int, int, int]]
    compile_seconds: float | None
    run_seconds: float
    reference_seconds: float
    reference_dtype: str
    torch_version: str = torch.__version__
    backend: str = "flex"
    reference_fraction: float = 1.0  # the share of the Lq x Lk pairs whose scores the reference computed
    reference_mask_evaluation: str = "eager"  # how the reference computed the mask (Reference.mask_evaluation)
    reference_workers: list[dict] = field(default_factory=list)  # Reference.workers: each Ray worker's seconds

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks) and not any(f.severity == "error" for f in self.findings)

    @property
    def line(self) -> str:
        """The verdict in one line."""
        worst = max(self.checks, key=lambda c: (not c.passed, c.rel_err))
        state = "PASS" if self.passed else "FAIL"
        s = self.shape
        head = (f"{state} {self.name}: {self.dtype} on {self.device}, B={s.batch} Hq={s.q_heads} Hkv={s.kv_heads} "
                f"Lq={s.q_len} Lk={s.kv_len} D={s.head_dim}, seed {self.seed}")
        if not self.passed:
            failing = [c for c in self.checks if not c.passed]
            if failing:
                c = failing[0]
                where = ", ".join(f"{k}={v}" for k, v in c.worst.items())
                head += (f"; {c.name} off: max abs err {c.max_abs_err:.3g} at ({where}), rel err {c.rel_err:.3g}, "
                         f"{c.bad_count} bad, {c.nan_count} NaN")
            errors = [f for f in self.findings if f.severity == "error"]
            if errors:
                head += f"; {errors[0].message}"
            return head
        return head + f"; worst rel err {worst.rel_err:.2e} ({worst.name}), max abs err {max(c.max_abs_err for c in self.checks):.2e}"

    def __str__(self) -> str:
        return self.line

    def to_frame(self) -> pd.DataFrame:
        rows = []
        for c in self.checks:
            row = asdict(c)
            row["worst"] = ", ".join(f"{k}={v}" for k, v in c.worst.items())
            rows.append(row)
        return pd.DataFrame(rows).set_index("name")

    def to_dict(self) -> dict:
        out = {"name": self.name, "passed": self.passed, "dtype": self.dtype, "device": self.device,
               "seed": self.seed, "compiled": self.compiled, "backend": self.backend, **asdict(self.shape),
               "max_abs_err": max(c.max_abs_err for c in self.checks),
               "rel_err": max(c.rel_err for c in self.checks),
               "nan_count": sum(c.nan_count for c in self.checks),
               "fully_masked_rows": self.fully_masked_rows,
               "masked_row_examples": [list(x) for x in self.masked_row_examples],
               "compile_seconds": self.compile_seconds, "run_seconds": self.run_seconds,
               "reference_fraction": self.reference_fraction,
               "reference_mask_evaluation": self.reference_mask_evaluation,
               "reference_seconds": self.reference_seconds, "reference_dtype": self.reference_dtype,
               "torch": self.torch_version,
               "checks": {c.name: {k: v for k, v in asdict(c).items() if k != "name"} for c in self.checks},
               "findings": [asdict(f) for f in self.findings], "line": self.line}
        return _json_safe(out)


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


@dataclass(frozen=True)
class ReferenceOptions:
    """How the float64 reference is computed: in `dtype`, within `memory_budget` bytes of
    temporaries (None: a share of what is free), split by query rows across `workers` Ray workers
    (one GPU each on a GPU machine; `address` joins a Ray cluster)."""

    dtype: torch.dtype = torch.float64
    memory_budget: int | None = None
    workers: int | None = None
    address: str | None = None


# keywords of older versions of verify(), still taken (with a FutureWarning), and where they went
_MOVED_KEYWORDS = {"compile": "backend='flex' / 'eager'", "port_path": "backend=PortBackend(path)",
                   "block_size": "backend=FlexBackend(block_size=...)", "workers": "reference=ReferenceOptions(workers=...)",
                   "address": "reference=ReferenceOptions(address=...)",
                   "memory_budget": "reference=ReferenceOptions(memory_budget=...)",
                   "reference_dtype": "reference=ReferenceOptions(dtype=...)"}


def _older_keywords(moved: dict, backend, reference):
    """(backend, reference) with verify()'s older keywords folded in."""
    import dataclasses
    import warnings

    unknown = sorted(set(moved) - set(_MOVED_KEYWORDS))
    if unknown:
        raise TypeError(f"verify() got an unexpected keyword argument {unknown[0]!r}")
    warnings.warn("verify(): " + "; ".join(f"{k}= is now {_MOVED_KEYWORDS[k]}" for k in moved), FutureWarning,
                  stacklevel=3)
    if "port_path" in moved:
        backend = PortBackend(moved["port_path"])
    elif backend in ("flex", "eager") and ("compile" in moved or "block_size" in moved):
        compile_ = moved.get("compile", backend == "flex")
        backend = FlexBackend(compile=compile_ is not False, block_size=moved.get("block_size") or 128)
    fields = {"dtype": moved.get("reference_dtype"), "memory_budget": moved.get("memory_budget"),
              "workers": moved.get("workers"), "address": moved.get("address")}
    reference = dataclasses.replace(reference or ReferenceOptions(), **{k: v for k, v in fields.items() if v is not None})
    return backend, reference


def verify(mask: Mask, shape: Shape, *, dtype: str = "bfloat16", device: str | torch.device = "cpu",
           backend="flex", backward: bool = False, seed: int | None = None, block_mask: BlockMask | None = None,
           expected: Mask | None = None, reference: ReferenceOptions | None = None, progress: bool | None = None,
           **moved) -> Verdict:
    """Run `mask` through a backend and compare it with the float64 reference of `expected`
    (default: the same mask) on fresh random inputs (never zeros; the seed is kept).

    mask:       the attention under test (`make(...)`, or your own `Mask(name, mask_mod=...)`)
    shape:      `Shape(batch, q_heads, kv_heads, q_len, kv_len, head_dim)`: q [B, Hq, Lq, D], k / v [B, Hkv, Lk, D]
    dtype:      the kernel's dtype: bfloat16, float16, float32, tf32 (CUDA) or float64 (CPU)
    backend:    "flex" (compiled FlexAttention), "eager" (its uncompiled math path), "port" (the generated
                Triton port, workbench.port), "port-paged" (its attention_paged, the inputs laid out
                over a shuffled paged KV cache), "port-paged-invariant" (the same in invariant mode),
                "fa4" (the FA4 export, workbench.fa4: a CUDA GPU with flash-attn-4), or a backend
                object of workbench.run (FlexBackend, Fa4Backend(path),
                PortBackend(path) / PortPagedBackend(path, page_size) for a port file you have)
    backward:   also compare dq, dk, dv (and gradients of captured tensors that require grad)
    block_mask: run with this block mask instead of building one (it is checked against the mask)
    expected:   the attention the run should equal -- e.g. the intended mask when `mask` is a draft
    reference:  ReferenceOptions (dtype, memory budget, Ray workers)

        >>> from workbench import make
        >>> from workbench.run import Shape
        >>> verify(make("causal"), Shape(q_len=64, head_dim=16), dtype="float32", backend="eager", seed=0).passed
        True
    """
    if moved:
        backend, reference = _older_keywords(moved, backend, reference)
    reference = reference or ReferenceOptions()
    workers, address, memory_budget = reference.workers, reference.address, reference.memory_budget

    device = torch.device(device)
    dtype = dtype_name(dtype)
    check_device_dtype(device, dtype)
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise WorkbenchError(f"workers = {workers!r} must be a whole number of at least 1",
                             "pass workers >= 1 to split the reference, or None to compute it here", mask.name)
    expected = expected or mask
    reference_dtype = reference.dtype
    # fail before drawing inputs or compiling
    try:
        backend = backend_for(backend)
    except WorkbenchError as exc:
        raise exc.for_mask(mask.name) from None
    if isinstance(backend, (PortBackend, PortPagedBackend)):
        port.check_supported(shape.head_dim, dtype, mask.name)
    if isinstance(backend, Fa4Backend):
        backend.check(shape, dtype, device, mask.name)
    budget, _ = reference_budget(shape, backward, reference_dtype, device, memory_budget, mask.name)
    if backward and isinstance(backend, PortPagedBackend):
        raise WorkbenchError("attention_paged is an engine's forward (prefill and decode): it has no backward",
                             "verify the backward with --backend port (attention(), what a trainer runs)", mask.name)
    if not isinstance(backend, PortBackend):  # the port's backward runs on a CPU too (Triton's interpreter)
        check_backward_device(backward, device, mask.name)
    inputs = make_inputs(shape, dtype, device, seed=seed, backward=backward)
    findings = mod_findings(mask, shape, device)
    before = _mod_snapshot(mask, shape, device)
    drifted = [role for role, values in before["values"].items() if values is None]
    if drifted:  # it changed while being called a few times: no kernel can be judged against it
        raise WorkbenchError(f"the {' and the '.join(drifted)} gives other values when called again on the same "
                             "indices: it reads something that changes between calls (a global counter, the clock, "
                             "random numbers)", "make it a pure function of its arguments and of tensors captured once",
                             mask.name)
    if block_mask is not None:

        check_block_mask(block_mask, shape, mask.name)
        findings += block_mask_findings(mask, block_mask, shape)
    pool = None
    if workers and not backward:
        # each worker compares its rows of the kernel's output with its rows of the reference and
        # sends back only the statistics (dk / dv sum over every row, so a backward check gathers);
        # the workers start now and compute their rows while the kernel under test compiles and runs

        pool = start_rows_workers(expected, inputs, workers, dtype=reference_dtype, memory_budget=budget,
                                  address=address)
    try:
        run = backend.run(mask, inputs, backward=backward, block_mask=block_mask)
    except BaseException:
        if pool is not None:
            pool.close()
        raise
    checks = None
    if pool is not None:
        checks, ref = compare_on_ray(expected, inputs, run.out, run.lse, workers, TOLERANCES[dtype],
                                     LSE_TOLERANCE[dtype], dtype=reference_dtype, memory_budget=budget,
                                     address=address, progress=progress is not False, pool=pool)
    elif workers:

        ref = reference_on_ray(expected, inputs, workers, backward=backward, dtype=reference_dtype,
                               memory_budget=budget, address=address, progress=progress is not False)
    else:
        ref = reference_attention(expected, inputs, backward=backward, dtype=reference_dtype,
                                  memory_budget=budget, progress=progress)
    if run.compile_error:
        findings.append(Finding("compile_failed", "warning",
                                f"torch.compile could not build this mask ({run.compile_error}); the mods are valid "
                                "and ran uncompiled, so the verdict judges uncompiled FlexAttention (same "
                                "semantics, dense memory). A serving path that compiles FlexAttention would fail "
                                "here: report the error to PyTorch, or port the mask (workbench port)"))
    nan_why = ref.nan_message(expected.name)
    if nan_why:
        findings.append(Finding("reference_nan", "error", nan_why))
    changed = _changed_roles(mask, before)
    if changed:
        findings.append(Finding("stateful_mod", "error",
                                f"the {' and the '.join(changed)} gave other values after the run than before it, on "
                                "the same indices: it reads something that changes between calls (a global counter, "
                                "the clock, random numbers), so the kernel and the reference saw different masks and "
                                "no comparison can hold. Make it a pure function of its arguments and of tensors "
                                "captured once"))
    if checks is None:
        checks = [compare("out", run.out, ref.out, TOLERANCES[dtype])]
        if run.lse is not None:
            checks.append(compare("lse", run.lse, ref.lse, LSE_TOLERANCE[dtype]))
    if run.lse is None:
        findings.append(Finding("lse_not_checked", "info", "compiled FlexAttention on the CPU does not return the "
                                "log-sum-exp, so only the output was compared (run with --eager to check lse too)"))
    for name, g in ref.grads.items():
        got = run.grads.get(name)
        if got is None:
            got = torch.zeros_like(g)  # FlexAttention gave no gradient where the reference has one
        checks.append(compare(name, got, g, _grad_tolerance(dtype, name, g, shape)))
    if ref.fully_masked_rows:
        ex = ", ".join(f"(b={b}, h={h}, q={q})" for b, h, q in ref.masked_row_examples[:3])
        findings.append(Finding("fully_masked_rows", "warning",
                                f"{ref.fully_masked_rows} query row(s) keep no key, e.g. {ex}. FlexAttention returns 0 "
                                "there with lse = -inf; a softmax kernel (SDPA, FA with a dense mask) gives NaN or "
                                "uniform weights instead. Any port must special-case these rows"))
    name = mask.name if expected is mask else f"{mask.name} vs {expected.name}"
    return Verdict(name=name + backend.label, shape=shape, dtype=dtype,
                   device=str(device), seed=inputs.seed, compiled=run.compiled, checks=checks, findings=findings,
                   fully_masked_rows=ref.fully_masked_rows, masked_row_examples=ref.masked_row_examples,
                   compile_seconds=run.compile_seconds, run_seconds=run.run_seconds, reference_seconds=ref.seconds,
                   reference_dtype=ref.dtype, backend=backend.name, reference_fraction=ref.computed_fraction,
                   reference_mask_evaluation=ref.mask_evaluation, reference_workers=ref.workers)


