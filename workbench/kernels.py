"""Triton kernels, kept apart from the analysis that uses them.

`block_scan`: the block scan of `blocks.scan_blocks` as one fused GPU kernel. The mask_mod is
translated to Triton (`triton_gen`), and each program walks one row of blocks for one (b, h),
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
from typing import Callable

import torch

from workbench.define import Mask, cdiv, same_device

# The kernel, appended to the translated mod. `mask_mod_triton(b, h, q_idx, kv_idx, *tables)` is
# the generated function; {ptrs} stands for its table pointers.
_SCAN_KERNEL = '''
@triton.jit
def _scan_block(b, h, r, c, q_idx, q_ok, Lq, Lk, kv_block, full_count, counts_ptr, bh, n_rows, n_cols,
                row_kept, full_blocks, empty_blocks, head_acc, batch_acc{ptrs},
                SUB_Q: tl.constexpr, SUB_K: tl.constexpr, N_SUB_Q: tl.constexpr, KEEP_COUNTS: tl.constexpr,
                DIFF_HEAD: tl.constexpr, DIFF_BATCH: tl.constexpr, BOUNDED: tl.constexpr,
                ROWS_AT_END: tl.constexpr):
    # block (r, c) for this slice of query rows: its kept pairs as SUB_Q x SUB_K lane sums, then its
    # count (stored, or added to when its rows come in slices), its rows' counts and its class. With
    # BOUNDED, pairs past Lq / Lk or the block's edge are masked out (indices clamped so table reads
    # stay in bounds); without, the block must lie wholly inside Lq x Lk
    kept = tl.zeros([SUB_Q, SUB_K], tl.int32)
    for ks in range(0, kv_block, SUB_K):
        k_in_block = ks + tl.arange(0, SUB_K)
        kv_idx = c * kv_block + k_in_block
        if BOUNDED:
            inside = q_ok[:, None] & ((k_in_block < kv_block) & (kv_idx < Lk))[None, :]
            q_use = tl.minimum(q_idx, Lq - 1)[:, None]
            kv_use = tl.minimum(kv_idx, Lk - 1)[None, :]
            keep = (mask_mod_triton(b, h, q_use, kv_use{ptrs}) != 0) & inside
        else:
            q_use = q_idx[:, None]
            kv_use = kv_idx[None, :]
            keep = mask_mod_triton(b, h, q_use, kv_use{ptrs}) != 0
        kept += keep.to(tl.int32)
        if DIFF_HEAD:
            other = mask_mod_triton(b, 0, q_use, kv_use{ptrs}) != 0
            if BOUNDED:
                other = other & inside
            head_acc += (keep != other).to(tl.int32)
        if DIFF_BATCH:
            other = mask_mod_triton(0, h, q_use, kv_use{ptrs}) != 0
            if BOUNDED:
                other = other & inside
            batch_acc += (keep != other).to(tl.int32)
    if ROWS_AT_END:
        # row_kept is a SUB_Q x SUB_K tile summed over the keys once per row of blocks (by the
        # caller), so a block costs one reduction (its count) instead of a per-row one as well
        block_kept = tl.sum(kept)
        row_kept = row_kept + kept
    else:
        kept_by_row = tl.sum(kept, axis=1)
        block_kept = tl.sum(kept_by_row, axis=0)
        row_kept = row_kept + kept_by_row
    full_blocks, empty_blocks = _count_block(block_kept, r, c, full_count, counts_ptr, bh, n_rows, n_cols,
                                             full_blocks, empty_blocks, SUB_Q, N_SUB_Q, KEEP_COUNTS)
    return row_kept, full_blocks, empty_blocks, head_acc, batch_acc


@triton.jit
def _count_block(block_kept, r, c, full_count, counts_ptr, bh, n_rows, n_cols, full_blocks, empty_blocks,
                 SUB_Q: tl.constexpr, N_SUB_Q: tl.constexpr, KEEP_COUNTS: tl.constexpr):
    # a block's (slice's) kept pairs: stored in the counts table, and its class counted
    if KEEP_COUNTS:
        at = counts_ptr + (bh * n_rows + r) * n_cols + c
        if N_SUB_Q == 1:
            tl.store(at, block_kept)
        else:  # the block's rows come in N_SUB_Q slices: add them up (zero-initialised)
            tl.store(at, tl.load(at) + block_kept)
    if N_SUB_Q == 1:
        lane0 = tl.arange(0, SUB_Q) == 0
        full_blocks += (lane0 & (block_kept == full_count)).to(tl.int32)
        empty_blocks += (lane0 & (block_kept == 0)).to(tl.int32)
    return full_blocks, empty_blocks


@triton.jit
def _decided_block(all_kept, r, c, kv_block, full_count, counts_ptr, bh, n_rows, n_cols, row_kept,
                   full_blocks, empty_blocks, SUB_Q: tl.constexpr, SUB_K: tl.constexpr, N_SUB_Q: tl.constexpr,
                   KEEP_COUNTS: tl.constexpr, ROWS_AT_END: tl.constexpr):
    # an interior block whose pairs mask_mod_bounds decides: all kept (all_kept = 1) or none
    if ROWS_AT_END:  # (the row sums' tile: its first key lane takes the block's keys)
        row_kept = row_kept + tl.where(tl.arange(0, SUB_K)[None, :] == 0, all_kept * kv_block, 0)
    else:
        row_kept = row_kept + all_kept * kv_block
    full_blocks, empty_blocks = _count_block(all_kept * SUB_Q * kv_block, r, c, full_count, counts_ptr, bh, n_rows,
                                             n_cols, full_blocks, empty_blocks, SUB_Q, N_SUB_Q, KEEP_COUNTS)
    return row_kept, full_blocks, empty_blocks


{jit}
def block_scan_kernel(counts_ptr, rows_ptr, stats_ptr, Lq{int}, Lk{int}, n_rows{int}, n_cols{int}, q_block{int},
                      kv_block{int}{ptrs}{rptrs},
                      SUB_Q: tl.constexpr, SUB_K: tl.constexpr, N_SUB_Q: tl.constexpr,
                      KEEP_COUNTS: tl.constexpr, DIFF_HEAD: tl.constexpr, DIFF_BATCH: tl.constexpr,
                      INTERIOR: tl.constexpr, ROWS_AT_END: tl.constexpr, BOUNDS: tl.constexpr):
    # one program = one row of blocks r for one (b, h); the grid is (n_rows, heads, batch)
    r = tl.program_id(0)  # {salt}
    h = tl.program_id(1)
    b = tl.program_id(2)
    bh = (b * tl.num_programs(1) + h).to(tl.int64)
    full_count = q_block * kv_block
    head_diff = tl.zeros([SUB_Q], tl.int64)
    batch_diff = tl.zeros([SUB_Q], tl.int64)
    full_blocks = tl.zeros([SUB_Q], tl.int32)  # only lane 0 is used; a vector keeps loop types fixed
    empty_blocks = tl.zeros([SUB_Q], tl.int32)
    for qs in range(0, N_SUB_Q):
        q_in_block = qs * SUB_Q + tl.arange(0, SUB_Q)
        q_idx = r * q_block + q_in_block
        q_ok = (q_in_block < q_block) & (q_idx < Lq)
        if ROWS_AT_END:
            row_kept = tl.zeros([SUB_Q, SUB_K], tl.int32)
        else:
            row_kept = tl.zeros([SUB_Q], tl.int32)
        head_acc = tl.zeros([SUB_Q, SUB_K], tl.int32)
        batch_acc = tl.zeros([SUB_Q, SUB_K], tl.int32)
        if INTERIOR:
            # blocks wholly inside Lq x Lk (all but the last row and column of blocks, as a rule)
            # skip the bounds masks: each pair costs only the mask's own arithmetic and one add
            n_interior = tl.where((r + 1) * q_block <= Lq, Lk // kv_block, 0)
            c = r * 0  # a tensor from the start: a loop-carried value keeps one type
            for edge in tl.static_range(2):  # the interior blocks, then the edge blocks with bounds masks
                stop = n_interior if edge == 0 else n_cols
                while c < stop:
                    decided = c < 0  # (False)
                    all_kept = c * 0
                    if BOUNDS and edge == 0:
                        # what the mask gives over the whole block, from its arithmetic's bounds:
                        # a block it decides costs a few scalar operations instead of every pair
                        q_lo = r * q_block + qs * SUB_Q
                        kv_lo = c * kv_block
                        all_kept, any_kept = mask_mod_bounds(b, h, q_lo, q_lo + SUB_Q - 1, kv_lo,
                                                             kv_lo + kv_block - 1{ptrs}{rptrs})
                        decided = all_kept == any_kept
                        if DIFF_HEAD:  # head 0 must be decided alike, or the block's differences count
                            all_0, any_0 = mask_mod_bounds(b, h * 0, q_lo, q_lo + SUB_Q - 1, kv_lo,
                                                           kv_lo + kv_block - 1{ptrs}{rptrs})
                            decided = decided & (all_0 == any_0) & (all_0 == all_kept)
                        if DIFF_BATCH:
                            all_0, any_0 = mask_mod_bounds(b * 0, h, q_lo, q_lo + SUB_Q - 1, kv_lo,
                                                           kv_lo + kv_block - 1{ptrs}{rptrs})
                            decided = decided & (all_0 == any_0) & (all_0 == all_kept)
                    if decided:
                        row_kept, full_blocks, empty_blocks = _decided_block(
                            all_kept, r, c, kv_block, full_count, counts_ptr, bh, n_rows, n_cols, row_kept,
                            full_blocks, empty_blocks, SUB_Q, SUB_K, N_SUB_Q, KEEP_COUNTS, ROWS_AT_END)
                    else:
                        row_kept, full_blocks, empty_blocks, head_acc, batch_acc = _scan_block(
                            b, h, r, c, q_idx, q_ok, Lq, Lk, kv_block, full_count, counts_ptr, bh, n_rows, n_cols,
                            row_kept, full_blocks, empty_blocks, head_acc, batch_acc{ptrs}, SUB_Q, SUB_K, N_SUB_Q,
                            KEEP_COUNTS, DIFF_HEAD, DIFF_BATCH, BOUNDED=edge == 1, ROWS_AT_END=ROWS_AT_END)
                    c += 1
        else:
            for c in range(0, n_cols):
                row_kept, full_blocks, empty_blocks, head_acc, batch_acc = _scan_block(
                    b, h, r, c, q_idx, q_ok, Lq, Lk, kv_block, full_count, counts_ptr, bh, n_rows, n_cols, row_kept,
                    full_blocks, empty_blocks, head_acc, batch_acc{ptrs}, SUB_Q, SUB_K, N_SUB_Q, KEEP_COUNTS,
                    DIFF_HEAD, DIFF_BATCH, BOUNDED=True, ROWS_AT_END=ROWS_AT_END)
        if ROWS_AT_END:
            tl.store(rows_ptr + bh * Lq + q_idx, tl.sum(row_kept, axis=1), mask=q_ok)
        else:
            tl.store(rows_ptr + bh * Lq + q_idx, row_kept, mask=q_ok)
        head_diff += tl.sum(head_acc, axis=1).to(tl.int64)
        batch_diff += tl.sum(batch_acc, axis=1).to(tl.int64)
    at = stats_ptr + (bh * n_rows + r) * 4
    tl.store(at, tl.sum(head_diff, axis=0))
    tl.store(at + 1, tl.sum(batch_diff, axis=0))
    tl.store(at + 2, tl.sum(full_blocks, axis=0).to(tl.int64))
    tl.store(at + 3, tl.sum(empty_blocks, axis=0).to(tl.int64))
'''

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
# Interior blocks that the mask's bounds decide (triton_gen's mask_mod_bounds: all pairs kept, or
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
    """Translate `mask_mod` and build the kernel. Raises `triton_gen.Untranslatable` (or a
    tracing error) when the mod cannot be written as Triton; the caller then scans eagerly.
    q_len, kv_len: the problem's lengths (the mod is probed inside them, see lift_scalars)."""
    from workbench.define import captured_tensors, lift_scalars, structure_fact
    from workbench.triton_gen import Untranslatable, generate, load_source, range_pointers, table_ranges

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
    source = source + "\n" + _SCAN_KERNEL.replace("{ptrs}", ptr_text).replace("{rptrs}", range_text).replace(
        "{jit}", jit).replace(
        "{int}", ": tl.constexpr" if interpret else "").replace("{salt}", f"build {build_salt}")
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
