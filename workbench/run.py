"""Stage 4, run: a mask through FlexAttention, with compilation managed and timed.

`make_inputs` draws fresh random q, k, v (never zeros; the seed is kept), `run_flex` runs them
through `flex_attention` -- compiled by default -- forward and optionally backward, and says
what was compiled and how long that took, apart from the run itself.

Why the compile bookkeeping: `torch.compile(flex_attention)` compiles once per distinct mod
(code, captured Python values, shapes, dtype). Past dynamo's recompile limit (8 by default)
torch silently falls back to the unfused path, which needs memory quadratic in the length. A
session that tries many masks lifts the limit (compat.raise_recompile_limit) and starts over
(compat.reset_compiled) before reaching it.
"""

from __future__ import annotations

import ast
import secrets
import tempfile
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from workbench import compat, port
from workbench.port.layout import paged_step
from workbench.blocks import build_block_mask, device_memory
from workbench.define import Mask, WorkbenchError, captured_scalars, check_captured_devices, check_device

DTYPES = {"float32": torch.float32, "tf32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "float64": torch.float64}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float64", "half": "float16",
                 "float": "float32", "double": "float64"}
# What FlexAttention runs on each device type (float64 is the reference's job on CUDA).
SUPPORTED = {"cpu": {"float32", "bfloat16", "float16", "float64"},
             "cuda": {"float32", "tf32", "bfloat16", "float16"}}
RECOMPILE_LIMIT = 512


@dataclass(frozen=True)
class Defaults:
    """What the front ends run when the user does not say (the report, the app, `port`, sweeps):
    on a GPU compiled FlexAttention in bfloat16 at sizes worth a compile; on a CPU float32 at
    small sizes (FlexAttention runs uncompiled there, the port under Triton's interpreter, which
    multiplies bfloat16 dot operands wrongly unless widened)."""

    dtype: str
    head_dim: int          # verifications and ports
    invariance_heads: int  # the layout-invariance check's request
    invariance_head_dim: int
    invariance_batch: int
    invariance_len: int


GPU_DEFAULTS = Defaults("bfloat16", 64, 8, 128, 8, 3000)
CPU_DEFAULTS = Defaults("float32", 32, 2, 32, 3, 256)


def defaults_for(device: str | torch.device) -> Defaults:
    """GPU_DEFAULTS on a CUDA device, else CPU_DEFAULTS."""
    return GPU_DEFAULTS if torch.device(device).type == "cuda" else CPU_DEFAULTS


def dtype_name(dtype: str | torch.dtype) -> str:
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    name = DTYPE_ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise WorkbenchError(f"unknown dtype {dtype!r}", f"use one of {', '.join(DTYPES)}")
    return name


@dataclass(frozen=True)
class Shape:
    """Attention problem size: q [batch, q_heads, q_len, head_dim], k/v [batch, kv_heads, kv_len, head_dim]."""

    batch: int = 1
    q_heads: int = 1
    kv_heads: int | None = None  # None: same as q_heads
    q_len: int = 128
    kv_len: int | None = None  # None: same as q_len
    head_dim: int = 64

    def __post_init__(self):
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.q_heads)
        if self.kv_len is None:
            object.__setattr__(self, "kv_len", self.q_len)
        for name in ("batch", "q_heads", "kv_heads", "q_len", "kv_len", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise WorkbenchError(f"{name} = {value!r} must be a positive integer", f"pass a positive {name}")
        if self.q_heads % self.kv_heads:
            raise WorkbenchError(f"q_heads = {self.q_heads} is not a multiple of kv_heads = {self.kv_heads}",
                                 "grouped-query attention needs q_heads = kv_heads * group; change --heads or --kv-heads")

    @property
    def gqa(self) -> bool:
        return self.q_heads != self.kv_heads


@dataclass
class Inputs:
    """Random attention inputs; `grad_out` is the upstream gradient used for backward runs."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    shape: Shape
    dtype: str
    seed: int
    grad_out: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.q.device


def check_device_dtype(device: torch.device, dtype: str) -> None:
    """The device exists (`define.check_device`, the one device rule) and FlexAttention runs
    `dtype` there."""
    kind = check_device(device).type
    allowed = SUPPORTED.get(kind)
    if allowed is None:
        raise WorkbenchError(f"device {device} is not supported by the runner", "use cpu or cuda")
    if dtype not in allowed:
        fix = ("use float32, tf32, bfloat16 or float16; the float64 reference runs separately"
               if kind == "cuda" else "tf32 exists only on CUDA; use float32 on the CPU")
        raise WorkbenchError(f"FlexAttention does not run {dtype} on {kind}", fix)
    if kind == "cuda" and dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        raise WorkbenchError("this GPU does not support bfloat16", "use float16 or float32")


def input_bytes(shape: Shape, dtype: str, backward: bool) -> int:
    item = DTYPES[dtype].itemsize
    q = shape.batch * shape.q_heads * shape.q_len * shape.head_dim
    kv = 2 * shape.batch * shape.kv_heads * shape.kv_len * shape.head_dim
    per_pass = 2 * q + kv + shape.batch * shape.q_heads * shape.q_len * 2  # q, out, k, v, lse (fp32)
    return item * per_pass * (2 if backward else 1)


def make_inputs(shape: Shape, dtype: str | torch.dtype = "bfloat16", device: str | torch.device = "cpu",
                seed: int | None = None, backward: bool = False) -> Inputs:
    """q, k, v ~ N(0, 1) drawn with `seed` (a fresh one when None), on `device` in `dtype`."""
    dtype, device = dtype_name(dtype), check_device(device)
    check_device_dtype(device, dtype)

    need, free = input_bytes(shape, dtype, backward), device_memory(device)
    if need > free * 0.8:
        raise WorkbenchError(f"inputs for {shape} need about {need / 2**30:.1f} GiB, "
                             f"{free / 2**30:.1f} GiB is free on {device}",
                             "use fewer heads, a smaller batch or a shorter length")
    seed = secrets.randbits(31) if seed is None else int(seed)
    generator = torch.Generator(device=device).manual_seed(seed)
    real = DTYPES[dtype]

    def draw(*size):
        return torch.randn(*size, generator=generator, device=device, dtype=torch.float32).to(real)

    s = shape
    q = draw(s.batch, s.q_heads, s.q_len, s.head_dim)
    k = draw(s.batch, s.kv_heads, s.kv_len, s.head_dim)
    v = draw(s.batch, s.kv_heads, s.kv_len, s.head_dim)
    grad_out = draw(s.batch, s.q_heads, s.q_len, s.head_dim) if backward else None
    return Inputs(q, k, v, s, dtype, seed, grad_out)


# ---------------------------------------------------------------- compilation

_compiled_flex: Callable | None = None
_graphs: dict[tuple, float] = {}  # graph key -> compile seconds


def compiled_flex_attention() -> Callable:
    global _compiled_flex
    if _compiled_flex is None:
        compat.raise_recompile_limit(RECOMPILE_LIMIT)
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def graph_key(mask: Mask, inputs: Inputs, backward: bool, block_size: tuple[int, int]) -> tuple:
    """What makes dynamo compile a new graph for flex_attention, as far as we can see it."""

    def code(fn):
        return None if fn is None else getattr(fn, "__code__", id(fn))

    scalars = tuple(sorted(captured_scalars(mask.mask_mod).items())) + tuple(sorted(captured_scalars(mask.score_mod).items()))
    return (code(mask.mask_mod), code(mask.score_mod), scalars, tuple(inputs.q.shape), tuple(inputs.k.shape),
            inputs.dtype, str(inputs.device), backward, block_size)


def forget_compiled() -> None:
    """Drop every compiled graph and the bookkeeping about them."""
    global _compiled_flex
    compat.reset_compiled()
    _compiled_flex = None
    _graphs.clear()


# ---------------------------------------------------------------- running

@dataclass
class FlexRun:
    """What one FlexAttention run produced and what it cost.

    compile_seconds: time spent compiling a new graph in this call (0 when the graph was
    already compiled; None for an uncompiled run). run_seconds: one forward (+ backward) with
    the graph compiled. grads: dq, dk, dv and, for captured tensors that require grad, their
    gradients under their `Mask.data` names."""

    out: torch.Tensor
    lse: torch.Tensor | None  # None where FlexAttention cannot return it (compiled, CPU)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    compiled: bool = True
    compile_seconds: float | None = None
    run_seconds: float = 0.0
    new_graph: bool = False
    graphs_in_session: int = 0
    block_mask: BlockMask | None = None
    compile_error: str | None = None  # set when torch.compile failed and the run fell back to eager


def learnable_tensors(mask: Mask) -> dict[str, torch.Tensor]:
    return {k: t for k, t in mask.data.items() if isinstance(t, torch.Tensor) and t.requires_grad}


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _call(flex_fn, mask: Mask, inputs: Inputs, block_mask, scale, backward: bool, want_lse: bool = True):
    with compat.float32_matmul("tf32" if inputs.dtype == "tf32" else "ieee"), warnings.catch_warnings():
        # an uncompiled run is asked for explicitly; torch's advice to compile is noise here
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        if not backward:
            with torch.no_grad():
                out, lse = compat.flex_with_lse(flex_fn, inputs.q, inputs.k, inputs.v, mask.score_mod, block_mask,
                                                scale, inputs.shape.gqa, want_lse)
            return out, lse, {}
        learn = learnable_tensors(mask)
        q, k, v = (t.detach().requires_grad_() for t in (inputs.q, inputs.k, inputs.v))
        out, lse = compat.flex_with_lse(flex_fn, q, k, v, mask.score_mod, block_mask, scale, inputs.shape.gqa)
        grads = torch.autograd.grad(out, [q, k, v, *learn.values()], inputs.grad_out, allow_unused=True)
        names = ["dq", "dk", "dv", *(f"d{name}" for name in learn)]
        return out.detach(), lse.detach() if lse is not None else None, {n: g for n, g in zip(names, grads) if g is not None}


def run_flex(mask: Mask, inputs: Inputs, *, block_mask: BlockMask | None = None,
             block_size: int | tuple[int, int] = 128, backward: bool = False, compile: bool = True,
             scale: float | None = None) -> FlexRun:
    """Run `mask` through flex_attention on `inputs`. Builds the block mask (exactly, in bounded
    memory) unless one is given. Raises WorkbenchError for inputs the mask cannot take."""

    shape = inputs.shape
    if backward and inputs.grad_out is None:
        raise WorkbenchError("backward=True needs inputs made with backward=True (they carry grad_out)",
                             "call make_inputs(..., backward=True)")
    check_backward_device(backward, inputs.device, mask.name)
    check_mask_fits(mask, shape)
    check_captured_devices(mask, inputs.device)
    q_block, kv_block = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    if block_mask is None:
        if mask.mask_mod is not None:
            # the inputs' real batch and heads: the scan finds which of them the mask depends on,
            # and axes it does not depend on stay size 1 (broadcast)
            block_mask = build_block_mask(mask, shape.q_len, shape.kv_len, heads=shape.q_heads, batch=shape.batch,
                                          block_size=(q_block, kv_block), device=inputs.device, shrink=True)
    else:
        check_block_mask(block_mask, shape, mask.name)
    try:
        return _run(mask, inputs, block_mask, (q_block, kv_block), backward, compile, scale)
    except _CompileFailed as failed:
        # a valid mod that torch.compile cannot build: the uncompiled path gives FlexAttention's
        # answer too, if its dense scores fit
        check_eager_memory(shape, inputs.device, backward, mask.name, failed.text)
        run = _run(mask, inputs, block_mask, (q_block, kv_block), backward, False, scale)
        run.compile_error = failed.text
        return run


class _CompileFailed(Exception):
    def __init__(self, text: str):
        super().__init__(text)
        self.text = text


def eager_bytes(shape: Shape, backward: bool) -> int:
    """Rough peak of uncompiled FlexAttention: it materialises [B, Hq, Lq, Lk] float32 scores and
    a few of their kind (mask, probabilities; more with the autograd graph)."""
    return shape.batch * shape.q_heads * shape.q_len * shape.kv_len * 4 * (10 if backward else 4)


def check_eager_memory(shape: Shape, device: torch.device, backward: bool, name: str, why: str) -> None:

    need, free = eager_bytes(shape, backward), device_memory(device)
    if need > free * 0.7:
        raise WorkbenchError(f"torch.compile failed on this mask ({why}), and uncompiled FlexAttention would need "
                             f"about {need / 2**30:.1f} GiB for {shape}, more than the {free / 2**30:.1f} GiB free",
                             "use a shorter length or fewer heads to judge it uncompiled, or report the compile "
                             "error to PyTorch", name)


def _run(mask: Mask, inputs: Inputs, block_mask, block_size: tuple[int, int], backward: bool, compile: bool,
         scale) -> FlexRun:
    shape = inputs.shape
    flex_fn = compiled_flex_attention() if compile else flex_attention
    # compiled FlexAttention on the CPU is inference-only and cannot return the log-sum-exp
    want_lse = not (compile and inputs.device.type == "cpu")
    key = graph_key(mask, inputs, backward, block_size)
    new_graph = compile and key not in _graphs
    if new_graph and len(_graphs) >= RECOMPILE_LIMIT // 2:
        forget_compiled()  # start over well before dynamo's limit
        flex_fn = compiled_flex_attention()
    try:
        _sync(inputs.device)
        t0 = time.perf_counter()
        out, lse, grads = _call(flex_fn, mask, inputs, block_mask, scale, backward, want_lse)
        _sync(inputs.device)
        first = time.perf_counter() - t0
        if new_graph:  # the first call compiled; time a second one for the run alone
            t0 = time.perf_counter()
            out, lse, grads = _call(flex_fn, mask, inputs, block_mask, scale, backward, want_lse)
            _sync(inputs.device)
            run = time.perf_counter() - t0
            _graphs[key] = max(0.0, first - run)
        else:
            run = first
    except WorkbenchError:
        raise
    except torch.OutOfMemoryError as exc:
        raise WorkbenchError(f"FlexAttention ran out of memory on {inputs.device} for {shape}",
                             "use fewer heads, a smaller batch or a shorter length", mask.name) from exc
    except Exception as exc:
        text = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
        if compile and _is_compile_error(exc):
            raise _CompileFailed(text) from exc
        raise WorkbenchError(f"flex_attention failed ({'compiled' if compile else 'eager'}, {inputs.dtype} on "
                             f"{inputs.device}): {text}",
                             "check the mods with `probe(mask)`; try compile=False to see whether the "
                             "failure is in compilation", mask.name) from exc
    return FlexRun(out=out, lse=lse, grads=grads, compiled=compile,
                   compile_seconds=(_graphs[key] if new_graph else 0.0) if compile else None,
                   run_seconds=run, new_graph=new_graph, graphs_in_session=len(_graphs), block_mask=block_mask)


def _is_compile_error(exc: BaseException) -> bool:
    """Raised by torch.compile (dynamo, inductor, a C++/Triton build), not by the mods' own logic."""
    return compat.is_compile_error(exc)


def check_mask_fits(mask: Mask, shape: Shape) -> None:
    """A mask defined for H heads (or B batch entries) runs with exactly that many."""
    if mask.heads is not None and mask.heads != shape.q_heads:
        raise WorkbenchError(f"the mask is defined for {mask.heads} heads, the inputs have {shape.q_heads}",
                             f"use --heads {mask.heads} or give the mask one entry per head", mask.name)
    if mask.batch is not None and shape.batch > mask.batch:
        raise WorkbenchError(f"the mask is defined for {mask.batch} batch entries, the inputs have {shape.batch}",
                             f"use --batch {mask.batch} or fewer, or give the mask one entry per batch entry",
                             mask.name)


def check_backward_device(backward: bool, device: torch.device, name: str | None = None) -> None:
    if backward and device.type != "cuda":
        raise WorkbenchError("FlexAttention has no backward on the CPU", "verify the backward pass on a GPU "
                             "(--device cuda), or drop --backward", name)


def check_block_mask(block_mask: BlockMask, shape: Shape, name: str | None = None) -> None:
    """A block mask must be built for the inputs' lengths and broadcast over their batch/heads."""
    seq = tuple(getattr(block_mask, "seq_lengths", ()) or ())
    if seq and seq != (shape.q_len, shape.kv_len):
        raise WorkbenchError(
            f"the block mask was built for q_len={seq[0]}, kv_len={seq[1]}, the inputs have "
            f"q_len={shape.q_len}, kv_len={shape.kv_len}; FlexAttention would read the wrong blocks",
            "rebuild it for these lengths: build_block_mask(mask, q_len, kv_len)", name)
    b, h = block_mask.kv_num_blocks.shape[:2]
    if b not in (1, shape.batch) or h not in (1, shape.q_heads):
        raise WorkbenchError(f"the block mask has batch={b}, heads={h}, the inputs batch={shape.batch}, "
                             f"heads={shape.q_heads}; they do not broadcast",
                             "build it with heads/batch None (broadcast) or equal to the inputs'", name)


# ---------------------------------------------------------------- the port beside FlexAttention

def time_port_and_flex(mask: Mask, shape: Shape, port_path, dtype: str = "bfloat16", device="cuda",
                       warmup: int = 25, rep: int = 100) -> dict:
    """Forward times of the generated port and of compiled FlexAttention on the same inputs, side by
    side (triton.testing.do_bench medians, ms; block lists, autotuning and compiles done first)."""
    return prepare_timing(mask, shape, port_path, dtype, device).measure(warmup, rep)


@dataclass
class PreparedTiming:
    """The port and compiled FlexAttention, compiled, tuned and run once on the same inputs:
    `measure()` only times them (so the compiling can happen elsewhere, or earlier)."""

    port_call: Callable
    flex_call: Callable
    dtype: str
    device: torch.device

    @contextmanager
    def flex_state(self):
        """The state run_flex calls FlexAttention in (no grad, its float32 matmul precision): the
        compiled graph it made is the one timed."""
        with compat.float32_matmul("tf32" if self.dtype == "tf32" else "ieee"), torch.no_grad():
            yield

    def measure(self, warmup: int = 25, rep: int = 100) -> dict:
        from triton.testing import do_bench

        port_ms = do_bench(self.port_call, warmup=warmup, rep=rep)
        with self.flex_state():
            flex_ms = do_bench(self.flex_call, warmup=warmup, rep=rep)
        return {"port_ms": port_ms, "flex_ms": flex_ms, "speed_vs_flex": flex_ms / port_ms, "dtype": self.dtype,
                "device": torch.cuda.get_device_name(self.device), "torch": torch.__version__}


def prepare_timing(mask: Mask, shape: Shape, port_path, dtype: str = "bfloat16", device="cuda") -> PreparedTiming:
    """Everything `time_port_and_flex` does before it times: inputs, the port loaded (as run_file
    loads it: a port verified in this process keeps its compiled, autotuned kernels), its block
    lists built, FlexAttention's block mask built and its forward compiled (the call run_flex
    makes, so a graph compiled for a run of the same shape serves here too). Both calls return
    out and the log-sum-exp."""
    inputs = make_inputs(shape, dtype, device, seed=0)
    module = port.loaded(port_path)

    def port_call():
        return module.attention(inputs.q, inputs.k, inputs.v, return_lse=True)

    port_call()  # block lists and autotuning, outside the timing
    flex = run_flex(mask, inputs)  # builds the block mask and compiles, outside the timing
    if flex.compile_error:
        raise WorkbenchError(f"torch.compile could not build FlexAttention's forward for this mask "
                             f"({flex.compile_error[:160]}), so there is no compiled kernel to time the port against",
                             "time it against the uncompiled path yourself, or simplify the mods", mask.name)
    flex_fn = compiled_flex_attention()

    def flex_call():  # what run_flex's forward calls (timed within the same matmul precision, no grad)
        return compat.flex_with_lse(flex_fn, inputs.q, inputs.k, inputs.v, mask.score_mod, flex.block_mask, None,
                                    shape.gqa, True)

    timing = PreparedTiming(port_call, flex_call, dtype, inputs.device)
    with timing.flex_state():
        flex_call()
    torch.cuda.synchronize(inputs.device)
    return timing


# ---------------------------------------------------------------- backends: what runs a mask

@dataclass(frozen=True)
class FlexBackend:
    """FlexAttention: compiled (`compile=True`, the default on any device) or its uncompiled math
    path (`compile=False`: the `eager` backend)."""

    compile: bool = True
    block_size: int | tuple[int, int] = 128  # of the block mask it builds (when none is given)
    label: str = ""

    @property
    def name(self) -> str:
        return "flex" if self.compile else "eager"

    def run(self, mask: Mask, inputs: Inputs, *, backward: bool = False, block_mask: BlockMask | None = None,
            cu_seqlens=None, config: int | None = None) -> FlexRun:  # noqa: ARG002 (cu_seqlens, config: the port's)
        return run_flex(mask, inputs, block_mask=block_mask, block_size=self.block_size, backward=backward,
                        compile=self.compile)


@dataclass(frozen=True)
class PortBackend:
    """The generated Triton port (`workbench.port`): the file at `path`, or one generated for the
    inputs' sizes. `backward`: also its dq, dk, dv (on a CPU under Triton's interpreter too);
    `cu_seqlens` runs packed segments (forward), `config` pins one tile configuration (the
    invariance check's)."""

    path: object = None
    name: str = "port"
    label: str = " (Triton port)"

    def run(self, mask: Mask, inputs: Inputs, *, backward: bool = False, block_mask: BlockMask | None = None,  # noqa: ARG002
            cu_seqlens=None, config: int | None = None) -> FlexRun:  # (a port builds its own block lists)
        shape = inputs.shape
        if backward and (cu_seqlens is not None or config is not None):
            raise WorkbenchError("the port's backward runs unpacked calls with its own tiles",
                                 "verify the backward without cu_seqlens / config", mask.name)
        if backward and inputs.grad_out is None:
            raise WorkbenchError("backward=True needs inputs made with backward=True (they carry grad_out)",
                                 "call make_inputs(..., backward=True)", mask.name)
        path = self.path or port.build(mask, shape.q_len, shape.kv_len, heads=shape.q_heads, batch=shape.batch)
        start = time.perf_counter()
        grads = {}
        if backward:
            # captured tensors that require grad learn through the port's tables= (named as in the file)
            from workbench.translate.emitter import argument_name

            learn = {argument_name(name): (name, t) for name, t in learnable_tensors(mask).items()}
            out, lse, got = port.run_file_backward(path, inputs.q, inputs.k, inputs.v, inputs.grad_out,
                                                   tables={n: t for n, (_, t) in learn.items()})
            grads = {n: got[n] for n in ("dq", "dk", "dv")}
            grads.update({f"d{name}": got[f"d{n}"] for n, (name, _) in learn.items()})
        else:
            out, lse = port.run_file(path, inputs.q, inputs.k, inputs.v, cu_seqlens=cu_seqlens, config=config)
        if inputs.device.type == "cuda":
            torch.cuda.synchronize(inputs.device)
        return FlexRun(out=out, lse=lse, grads=grads, compiled=False, compile_seconds=None,
                       run_seconds=time.perf_counter() - start)


@dataclass(frozen=True)
class PortPagedBackend:
    """The generated port's serving entry point, `attention_paged`: the inputs laid out as one step
    over a paged KV cache (`workbench.port.layout.paged_step`: each batch element a request, its
    pages shuffled, NaN in the unused pages and page tails, an out-of-range page in unused
    block-table entries), the step's rows laid back.
    A mask whose offset follows Lk - Lq (the library's bottom-right masks) runs its Lq queries as
    each request's last positions, a chunk or a decode as an engine runs it; any other mask runs a
    whole prefill of Lk queries (generated at Lk, Lk) and keeps the first Lq rows, FlexAttention's
    view. Needs Lq <= Lk; forward only. `invariant`: run attention_paged's invariant mode
    ("port-paged-invariant")."""

    path: object = None
    page_size: int = 16
    name: str = "port-paged"
    label: str = " (Triton port, paged)"
    invariant: bool = False

    def run(self, mask: Mask, inputs: Inputs, *, backward: bool = False, block_mask: BlockMask | None = None,  # noqa: ARG002
            cu_seqlens=None, config: int | None = None) -> FlexRun:  # noqa: ARG002 (the contiguous port's)
        if backward:
            raise WorkbenchError("attention_paged is an engine's forward (prefill and decode): it has no backward",
                                 "verify the backward with --backend port (attention(), what a trainer runs)",
                                 mask.name)
        shape = inputs.shape
        if shape.q_len > shape.kv_len:
            raise WorkbenchError(f"q_len {shape.q_len} is over kv_len {shape.kv_len}: in a paged step a request's "
                                 "queries are its last positions, so there are never more queries than keys",
                                 "verify the paged port with q_len <= kv_len", mask.name)
        path, queries = self.path, "all"
        if path is None:
            source = port.generate(mask, shape.q_len, shape.kv_len, heads=shape.q_heads, batch=shape.batch)
            if source.length_rules and all(a + b == 0 for a, b, _, _ in source.length_rules.values()):
                queries = "last"  # the port computes the offset: q sits at the request's last positions
            else:
                source = port.generate(mask, shape.kv_len, shape.kv_len, heads=shape.q_heads, batch=shape.batch)
            path = port.write(source, tempfile.mkdtemp(prefix="workbench_port_"))
        else:
            queries = "last" if port_offset_rules(path) else "all"
        try:
            step = paged_step(inputs.q, inputs.k, inputs.v, page_size=self.page_size, seed=inputs.seed or 0,
                              queries=queries)
        except WorkbenchError as exc:
            raise exc.for_mask(mask.name) from None
        start = time.perf_counter()
        out, lse = port.run_paged_file(path, step, invariant=self.invariant)
        if inputs.device.type == "cuda":
            torch.cuda.synchronize(inputs.device)
        return FlexRun(out=step.unpack(out).contiguous(), lse=step.unpack(lse).contiguous(), compiled=False,
                       compile_seconds=None, run_seconds=time.perf_counter() - start)


@dataclass(frozen=True)
class Fa4Backend:
    """The FA4 export (`workbench.fa4`): the generated file at `path`, or one generated for the
    inputs' sizes, run on FlashAttention-4's forward (a CUDA GPU with flash-attn-4 installed;
    bfloat16 / float16; head dim 64, 96, 128). `backward`: dq, dk, dv from FA4's backward (captured
    tables do not learn on FA4)."""

    path: object = None
    name: str = "fa4"
    label: str = " (FlashAttention-4 export)"

    def check(self, shape: Shape, dtype: str, device: torch.device, name: str | None) -> None:
        """What the FA4 file runs, said before any input is drawn."""
        from workbench import fa4

        if dtype not in ("bfloat16", "float16"):
            raise WorkbenchError(f"FA4 runs bfloat16 / float16, asked for {dtype}", "use --dtype bfloat16 or float16",
                                 name)
        if shape.head_dim not in fa4.HEAD_DIMS:
            raise WorkbenchError(f"the FA4 file runs head dims {', '.join(map(str, fa4.HEAD_DIMS))}, asked for "
                                 f"{shape.head_dim}", "use --head-dim 64, 96 or 128", name)
        if device.type != "cuda":
            raise WorkbenchError(f"the FA4 export runs on a CUDA GPU (sm_90), asked for {device.type}",
                                 "verify it on a GPU (--device cuda); on a CPU its CuTe DSL is checked by compiling "
                                 "it: python tests/run_fa4_compile.py", name)
        if fa4.installed() is None:
            raise WorkbenchError("flash-attn-4 is not installed", "pip install 'flex-workbench[fa4]' on the GPU machine",
                                 name)

    def run(self, mask: Mask, inputs: Inputs, *, backward: bool = False, block_mask: BlockMask | None = None,  # noqa: ARG002
            cu_seqlens=None, config: int | None = None) -> FlexRun:  # noqa: ARG002 (the port's)
        from workbench import fa4

        shape = inputs.shape
        self.check(shape, dtype_name(inputs.q.dtype), inputs.device, mask.name)
        path = self.path
        if path is None:
            path = fa4.write(fa4.generate(mask, shape.q_len, shape.kv_len, heads=shape.q_heads, batch=shape.batch),
                             tempfile.mkdtemp(prefix="workbench_fa4_"))
        module = fa4.load(path)
        if backward and getattr(module, "HAS_SCORE_GRAD", False) is False:
            raise WorkbenchError(f"the FA4 file has no backward ({module.NO_SCORE_GRAD})",
                                 "verify the backward with --backend port", mask.name)
        if backward and learnable_tensors(mask):
            raise WorkbenchError("a captured table requires grad: FA4 does not differentiate aux tensors",
                                 "verify learnable tables with --backend port (its tables=)", mask.name)
        start = time.perf_counter()
        grads = {}
        if backward:
            if inputs.grad_out is None:
                raise WorkbenchError("backward=True needs inputs made with backward=True (they carry grad_out)",
                                     "call make_inputs(..., backward=True)", mask.name)
            q, k, v = (t.detach().requires_grad_(True) for t in (inputs.q, inputs.k, inputs.v))
            out, lse = module.attention(q, k, v, return_lse=True)
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), inputs.grad_out)
            grads = {"dq": dq, "dk": dk, "dv": dv}
            out, lse = out.detach(), lse.detach()
        else:
            with torch.no_grad():
                out, lse = module.attention(inputs.q, inputs.k, inputs.v, return_lse=True)
        torch.cuda.synchronize(inputs.device)
        return FlexRun(out=out, lse=lse, grads=grads, compiled=False, compile_seconds=None,
                       run_seconds=time.perf_counter() - start)


def port_offset_rules(path) -> bool:
    """Does the port file at `path` compute an offset that follows Lk - Lq (its LENGTH_RULES, read
    as a literal: the file is not run)?"""
    for line in Path(path).read_text().splitlines():
        if line.startswith("LENGTH_RULES = "):
            rules = ast.literal_eval(line.split("=", 1)[1].split("#")[0].strip())
            return bool(rules) and all(a + b == 0 for a, b, _, _ in rules.values())
    raise WorkbenchError(f"{path} is not a generated port (it defines no LENGTH_RULES)",
                         "generate one with `python -m workbench port ... -o DIR`")


BACKENDS = {"flex": FlexBackend(), "eager": FlexBackend(compile=False), "port": PortBackend(),
            "port-paged": PortPagedBackend(), "fa4": Fa4Backend(),
            "port-paged-invariant": PortPagedBackend(name="port-paged-invariant",
                                                     label=" (Triton port, paged, invariant mode)", invariant=True)}
__all__ = ["Shape", "Inputs", "FlexRun", "make_inputs", "run_flex", "dtype_name", "defaults_for", "Defaults",
           "FlexBackend", "PortBackend", "PortPagedBackend", "Fa4Backend", "BACKENDS", "backend_for", "time_port_and_flex", "prepare_timing", "PreparedTiming", "check_device_dtype",
           "check_mask_fits", "compiled_flex_attention"]


def backend_for(backend, *, compile: bool | None = None, port_path=None):
    """A backend object from a name ("flex", "eager", "port", "port-paged", "port-paged-invariant") or a backend object
    itself. `compile=False` turns flex into eager; `port_path` names the port file to run."""
    if not isinstance(backend, str):
        return backend
    if backend not in BACKENDS:
        raise WorkbenchError(f"unknown backend {backend!r}", f"use one of {', '.join(BACKENDS)}")
    if backend in ("port", "port-paged", "port-paged-invariant", "fa4"):
        return replace(BACKENDS[backend], path=port_path) if port_path is not None else BACKENDS[backend]
    if backend == "flex" and compile is False:
        return BACKENDS["eager"]
    return BACKENDS[backend]

