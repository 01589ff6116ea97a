"""Triton kernels, kept apart from the analysis that uses them.

`block_scan`: the block scan of `blocks.scan_blocks` as one fused GPU kernel. The mask_mod is
translated to Triton (`workbench.translate`), and each program walks one row of blocks for one (b, h),
evaluating the mask on register tiles and keeping only sums: per-block kept counts, per-row kept
counts, and the pairs where this head / batch entry differs from head 0 / entry 0. No pair is
ever written to memory, so the scan runs at the speed of the mask's arithmetic, and a new
mask_mod costs one Triton compile (a fraction of a second) instead of a torch.compile.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
import threading
from pathlib import Path
from typing import Callable

import torch

from workbench.define import Mask, captured_tensors, cdiv, lift_scalars, same_device, structure_fact
from workbench.define.util import fill_template, template_body
from workbench.translate import Untranslatable, generate, load_source, range_pointers, table_ranges

__all__ = ["ScanKernel", "scan_kernel", "block_scan", "available", "interpreting", "forget", "is_compiled",
           "compile_in_background", "background_compiles", "compiling", "times_requested", "tile_shape", "TEMPLATE"]

# The kernel, appended to the translated mod (see the template's docstring for its @@ markers).
TEMPLATE = Path(__file__).with_name("templates") / "scan.py"

# Register tile: SUB_Q x SUB_K lanes of int32 accumulators per program, and warps per program.
# On an H200 at 1M tokens (benchmarks/bench_blocks.py --tune) 2048 lanes with 4 warps and the
# interior fast path beat 4096 with 8 warps by 1.2-1.5x; 8192 lanes was 2x slower.
TILE_ELEMENTS = 2048
SCAN_WARPS = 4
# Interior blocks (every pair inside Lq x Lk, whole register tiles) run as their own loop without
# bounds masks, before the bounded loop over the edge blocks. tests/run_triton_scan.py checks both
# settings against the eager tiles.
SCAN_INTERIOR = True
# Per-row kept counts summed over the key lanes once per row of blocks instead of once per block.
# Compiled for sm_90, a block of the causal scan is 8 column steps of 53 instructions and a
# reduction tail of about 400 (66 shuffles, 5 barriers); this leaves one reduction per block.
# Timed on an H200 (`bench_blocks.py --tune`): 0.9-1.15x, mixed by mask, so off.
SCAN_ROWS_AT_END = False
# Interior blocks that the mask's bounds decide (translate.triton's mask_mod_bounds: all pairs kept, or
# none) skip their pairs: a causal or sliding-window scan then evaluates pair by pair only the
# blocks on its diagonals. tests/run_triton_scan.py checks both settings against the eager tiles.
SCAN_BOUNDS = True
_namespaces: dict[str, dict] = {}
_launched: set[tuple] = set()  # (source, constexprs) already compiled in this process
_requests: collections.Counter = collections.Counter()  # scans asked of each source
_background: dict[tuple, concurrent.futures.Future] = {}  # (source, constexprs) compiling on the side
_background_lock = threading.Lock()
_compiler: concurrent.futures.ThreadPoolExecutor | None = None
# Written into the kernel as a comment; benchmarks bump it to time a never-seen mask_mod.
build_salt = 0


def interpreting() -> bool:
    """Triton's CPU interpreter is on (TRITON_INTERPRET=1): kernels run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@dataclasses.dataclass
class ScanKernel:
    """A compiled-on-first-launch block-scan kernel for one mask_mod, with its table arguments."""

    fn: object
    tables: list[torch.Tensor]
    source: str
    ranges: list[torch.Tensor] = dataclasses.field(default_factory=list)  # per table: (sorted, min, max)


def scan_kernel(mask_mod: Callable, device: torch.device, q_len: int = 300, kv_len: int = 300) -> ScanKernel:
    """Translate `mask_mod` and build the kernel. Raises `translate.Untranslatable` (or a
    tracing error) when the mod cannot be written as Triton; the caller then scans eagerly.
    q_len, kv_len: the problem's lengths (the mod is probed inside them, see lift_scalars)."""

    # the Python numbers it captures (a window, a chunk, an offset) become kernel arguments, so
    # turning a knob reuses the compiled kernel; if that cannot be done they stay constants
    twin, lifted = lift_scalars(mask_mod, device, q_len, kv_len)
    try:
        if twin is None:
            raise Untranslatable("nothing to lift")

        def translate():
            source, mask_ptrs, _, _ = generate(Mask("scan", mask_mod=twin), frozenset(lifted), bounds=True)
            return source, mask_ptrs

        # the source is the same for every value of the knob (the values are arguments): it is
        # translated once, and each new value only finds its tensors by name
        source, mask_ptrs = structure_fact(mask_mod, ("scan source", frozenset(lifted)), translate)
        captured = captured_tensors(Mask("scan", mask_mod=twin))
    except Exception:
        source, mask_ptrs, _, captured = generate(Mask("scan", mask_mod=mask_mod), bounds=True)
    tables = []
    for ptr in mask_ptrs:
        table = captured[ptr[: -len("_ptr")]]
        if not same_device(table.device, device):
            raise Untranslatable(f"table {ptr[:-4]!r} is on {table.device}, not {device}")
        tables.append(table.contiguous())
    ptr_text = "".join(f", {p}" for p in mask_ptrs)
    range_text = "".join(f", {p}" for p in range_pointers(mask_ptrs))
    # Lengths and block sizes change between calls, and specialising on them would recompile. The
    # CPU interpreter (used by the tests) cannot loop over runtime integers: there they are constants.
    interpret = interpreting()
    jit = "@triton.jit" if interpret else \
        '@triton.jit(do_not_specialize=["Lq", "Lk", "n_rows", "n_cols", "q_block", "kv_block"])'
    kernel = fill_template(template_body(TEMPLATE), {
        "@@PTRS@@": ptr_text, "@@RANGE_PTRS@@": range_text, "@@JIT@@": jit,
        "@@INT@@": ": tl.constexpr" if interpret else "", "@@SALT@@": f"build {build_salt}"})
    source = source + "\n" + kernel
    _requests[source] += 1
    if source not in _namespaces:
        _namespaces[source] = load_source(source)
    return ScanKernel(_namespaces[source]["block_scan_kernel"], tables, source, table_ranges(tables))


def forget() -> None:
    """Make the next scan compile afresh, as for a mask_mod never seen (benchmarks time first
    builds with it): drops this process's kernels and changes the source Triton's cache keys on."""
    global build_salt
    _namespaces.clear()
    _launched.clear()
    _requests.clear()
    _background.clear()
    build_salt += 1


def _constexprs(q_block, kv_block, diff_head, diff_batch, keep_counts) -> dict:
    sub_q, sub_k = tile_shape(q_block, kv_block)
    n_sub_q = cdiv(q_block, sub_q)
    # the fast path covers whole blocks in whole register tiles only
    tiles_fit = n_sub_q * sub_q == q_block and kv_block % sub_k == 0
    return dict(SUB_Q=sub_q, SUB_K=sub_k, N_SUB_Q=n_sub_q, KEEP_COUNTS=keep_counts,
                DIFF_HEAD=diff_head, DIFF_BATCH=diff_batch, INTERIOR=SCAN_INTERIOR and tiles_fit,
                ROWS_AT_END=SCAN_ROWS_AT_END, BOUNDS=SCAN_BOUNDS and SCAN_INTERIOR and tiles_fit)


def is_compiled(kernel: "ScanKernel", q_block: int, kv_block: int, diff_head: bool, diff_batch: bool,
                keep_counts: bool) -> bool:
    """Has this process already compiled the kernel for these settings (so a scan costs no compile)?"""
    key = tuple(_constexprs(q_block, kv_block, diff_head, diff_batch, keep_counts).items())
    return (kernel.source, key) in _launched


def compile_in_background(kernel: "ScanKernel", q_block: int, kv_block: int, diff_head: bool, diff_batch: bool,
                          keep_counts: bool, device: torch.device, q_len: int, kv_len: int
                          ) -> concurrent.futures.Future:
    """Compile the kernel for these settings on a background thread (by scanning the first block
    of the Lq x Lk problem, so captured tables are read where the real scan reads them), so that a
    later scan finds it ready. One compile at a time; asking twice returns the same future."""
    global _compiler
    key = (kernel.source, tuple(_constexprs(q_block, kv_block, diff_head, diff_batch, keep_counts).items()))
    with _background_lock:
        if key in _background:
            return _background[key]
        if _compiler is None:
            _compiler = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="scan-compile")

        def compile_one():
            with torch.cuda.device(device):  # a new thread starts on device 0
                block_scan(kernel, min(q_len, q_block), min(kv_len, kv_block), q_block, kv_block, 1, 1, diff_head,
                           diff_batch, keep_counts, device)
                torch.cuda.synchronize(device)

        _background[key] = _compiler.submit(compile_one)
        return _background[key]


def background_compiles() -> list[concurrent.futures.Future]:
    """Every background compile this process started (since `forget`), finished or not."""
    return list(_background.values())


def compiling() -> list[concurrent.futures.Future]:
    """Background compiles not finished yet."""
    return [f for f in _background.values() if not f.done()]


def times_requested(kernel: "ScanKernel") -> int:
    """How many scans of this process have asked for this kernel (a mod drawn again is likely to be
    drawn many times: then compiling pays off even where one eager scan would be sooner)."""
    return _requests[kernel.source]


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def tile_shape(q_block: int, kv_block: int) -> tuple[int, int]:
    """(SUB_Q, SUB_K): a whole q block when it is <= 128 rows (so a block's count is final after
    one pass and its class can be counted in the kernel), else slices of 64 rows."""
    sub_q = _pow2(q_block) if q_block <= 128 else 64
    sub_k = max(16, min(_pow2(kv_block), TILE_ELEMENTS // sub_q))
    return sub_q, sub_k


def block_scan(kernel: ScanKernel, q_len: int, kv_len: int, q_block: int, kv_block: int, batch: int, heads: int,
               diff_head: bool, diff_batch: bool, keep_counts: bool, device: torch.device) -> dict:
    """Run the kernel over every block. Returns counts [B, H, rows, cols] int32 (or None), row_kept
    [B, H, q_len] int64, head / batch differing pairs [B, H] int64, and full / empty block totals
    (None when a block spans several row slices and no counts table is kept)."""
    n_rows, n_cols = cdiv(q_len, q_block), cdiv(kv_len, kv_block)
    const = _constexprs(q_block, kv_block, diff_head, diff_batch, keep_counts)
    sub_q, sub_k, n_sub_q = const["SUB_Q"], const["SUB_K"], const["N_SUB_Q"]
    alloc = torch.zeros if n_sub_q > 1 else torch.empty
    counts = alloc(batch, heads, n_rows, n_cols, dtype=torch.int32, device=device) if keep_counts else None
    rows = torch.empty(batch, heads, q_len, dtype=torch.int32, device=device)
    stats = torch.empty(batch, heads, n_rows, 4, dtype=torch.int64, device=device)
    counts_arg = counts if counts is not None else rows  # never written when KEEP_COUNTS is off
    kernel.fn[(n_rows, heads, batch)](
        counts_arg, rows, stats, q_len, kv_len, n_rows, n_cols, q_block, kv_block, *kernel.tables, *kernel.ranges,
        num_warps=SCAN_WARPS, **const)
    _launched.add((kernel.source, tuple(const.items())))
    totals = stats.sum(dim=2)
    return dict(counts=counts, row_kept=rows.to(torch.int64), head_diff=totals[..., 0], batch_diff=totals[..., 1],
                full=int(totals[..., 2].sum()) if n_sub_q == 1 else None,
                empty=int(totals[..., 3].sum()) if n_sub_q == 1 else None,
                tile=(sub_q, sub_k))
