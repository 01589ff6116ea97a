"""Stage 2, build blocks: an exact, memory-bounded block-mask builder for any mask_mod.

The mask is evaluated tile by tile (a tile is a few thousand queries x a few thousand keys, sized
from a memory budget), and each tile is reduced at once to the kept-pair count of every
(q_block x kv_block) block it covers. Nothing of size Lq x Lk is ever held. From the counts the
builder writes exactly the tensors torch's `create_block_mask` writes: a block is *full* when all
q_block * kv_block pairs are kept (a block cut short by the sequence end is never full, as in
torch, which pads with masked pairs), *partial* when some are, *empty* otherwise; the indices
of a row list its kept blocks in ascending order followed by the others in ascending order
(torch's stable descending argsort), so every tensor equals torch's, element for element.

Two engines count. Eager tiles evaluate mods on broadcast index tensors (b: [B,1,1,1],
h: [1,H,1,1], q: [1,1,Q,1], kv: [1,1,1,K]) -- the fastest exact form for the elementwise mods
people write -- after checking them against FlexAttention's own semantics (vmap over scalars) on
probe regions; a mod that does not broadcast the same way is evaluated under vmap instead. On
CUDA the mod can also be translated to Triton (`workbench.translate`) and counted by one fused
kernel (`workbench.kernels`), whose result is trusted only after three block rows recounted by
the eager tiles agree exactly.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from tqdm.auto import tqdm

from workbench import compat, kernels
from workbench.define import Mask, WorkbenchError, broadcast_indices, cdiv, choose_evaluator, evaluate_mod, index_reads

__all__ = ["BlockScan", "ScanOptions", "scan_blocks", "build_block_mask", "block_mask_from_scan", "block_classes", "dense_mask",
           "device_memory", "default_budget", "pick_engine", "check_index_sizes", "EMPTY", "PARTIAL", "FULL",
           "DEFAULT_BLOCK"]

DEFAULT_BLOCK = 128
# Rough bytes of temporaries per evaluated pair (bool results, int32 intermediates of a mod).
BYTES_PER_PAIR = 16
# Above this many pairs per (b, h) the CUDA path compiles the tile function.
COMPILE_ABOVE_PAIRS = 2 ** 36
# From this many pairs (x batch x heads) on, a CUDA scan uses the fused Triton kernel once it is
# compiled. A first compile (~0.3-0.5 s on an H200) pays off above the second threshold, where
# eager tiles (~1e11 pairs/s there, vs 2-3e12 fused) would take longer than it, or for a mod that
# is scanned again (a notebook redrawing it).
TRITON_ABOVE_PAIRS = 2 ** 33
TRITON_COLD_ABOVE_PAIRS = 2 ** 35
# A kernel compiled already runs from this size on: its launch and spot check cost a few ms.
TRITON_WARM_ABOVE_PAIRS = 2 ** 24


@dataclass
class BlockScan:
    """Kept-pair counts of a mask, block by block: what every later stage reads.

    `counts[b, h, r, c]` is the number of kept pairs in block (r, c); b / h have size 1 when the
    mask does not depend on them (`depends_on_batch` / `depends_on_head` False). `row_kept` is the
    kept-pair count of each query row. `head_pairs_differing[b, h]` counts the pairs where head h
    differs from head 0 (likewise `batch_pairs_differing[b, h]` against batch entry 0).
    With `keep_counts=False` (very long masks) `counts` is None and only the totals are kept.
    """

    q_len: int
    kv_len: int
    q_block: int
    kv_block: int
    batch: int
    heads: int
    depends_on_batch: bool
    depends_on_head: bool
    counts: torch.Tensor | None
    row_kept: torch.Tensor
    full_blocks: int
    partial_blocks: int
    empty_blocks: int
    kept_pairs: int
    head_pairs_differing: torch.Tensor | None = None
    batch_pairs_differing: torch.Tensor | None = None
    engine: str = "eager"  # eager | compiled | triton: what counted the pairs
    evaluator: str = "broadcast"  # broadcast | vmap: how the mod was called on index tensors
    seconds: float = 0.0
    compile_seconds: float = 0.0
    device: str = "cpu"
    extra: dict = field(default_factory=dict)

    @property
    def block_rows(self) -> int:
        return cdiv(self.q_len, self.q_block)

    @property
    def block_cols(self) -> int:
        return cdiv(self.kv_len, self.kv_block)

    @property
    def block_shape(self) -> tuple[int, int]:
        return self.q_block, self.kv_block


# ---------------------------------------------------------------- evaluating a mod

def dense_mask(mask: Mask | Callable, q_range: tuple[int, int], kv_range: tuple[int, int],
               batch: int | list[int] = 1, heads: int | list[int] = 1, device="cpu",
               evaluator: str | None = None) -> torch.Tensor:
    """The mask on a window, as a bool tensor [B, H, q_stop - q_start, kv_stop - kv_start].

    `batch`/`heads` are counts (0..n-1) or explicit index lists. For windows, not whole
    masks: the caller keeps the window small (the pictures stop at 4096 x 4096)."""
    mask_mod = mask.mask_mod if isinstance(mask, Mask) else mask
    b = torch.as_tensor(list(range(batch)) if isinstance(batch, int) else batch, device=device, dtype=torch.int32)
    h = torch.as_tensor(list(range(heads)) if isinstance(heads, int) else heads, device=device, dtype=torch.int32)
    q = torch.arange(*q_range, device=device, dtype=torch.int32)
    kv = torch.arange(*kv_range, device=device, dtype=torch.int32)
    shape = (len(b), len(h), len(q), len(kv))
    if mask_mod is None:
        return torch.ones(shape, dtype=torch.bool, device=device)
    if evaluator is None:
        evaluator = choose_evaluator(mask_mod, q_range[1], kv_range[1], int(b.max()) + 1, int(h.max()) + 1,
                                     device).how
    with torch.no_grad():
        return evaluate_mod(mask_mod, evaluator, b, h, q, kv).to(torch.bool)


def _dependence(mask_mod: Callable, batch: int, heads: int, device, evaluator: str) -> tuple[bool, bool]:
    """Does the mod's value change with b / h? Only if its traced graph reads them
    (`index_reads`); for broadcast-evaluated mods also only if the result has that axis."""
    reads = index_reads(mask_mod)
    dep_b, dep_h = batch > 1 and "b" in reads, heads > 1 and "h" in reads
    if evaluator != "broadcast" or not (dep_b or dep_h):
        return dep_b, dep_h
    b = torch.arange(batch, device=device, dtype=torch.int32)
    h = torch.arange(heads, device=device, dtype=torch.int32)
    one = torch.zeros(1, device=device, dtype=torch.int32)
    out = mask_mod(*broadcast_indices(b, h, one, one))
    shape = tuple(out.shape) if isinstance(out, torch.Tensor) and out.dim() == 4 else (1, 1, 1, 1)
    return dep_b and shape[0] > 1, dep_h and shape[1] > 1


def check_index_sizes(mask_mod: Callable | None, heads: int | None, batch: int | None, name: str) -> None:
    """A broadcast (None) head or batch axis is only right for a mod that does not read h / b:
    otherwise every head would get head 0's blocks (what create_block_mask(mod, None, None)
    silently does)."""
    if mask_mod is None:
        return
    reads = index_reads(mask_mod)
    for axis, given, flag in (("h", heads, "heads"), ("b", batch, "batch")):
        if given is None and axis in reads:
            what = "head" if axis == "h" else "batch entry"
            raise WorkbenchError(
                f"the mask_mod reads `{axis}` (the {what} index), but no {flag} count was given; a block mask "
                f"broadcast over {flag} would give every {what} the blocks of {what} 0",
                f"pass {flag}=N (--{flag} N on the command line), the number of {flag} the attention runs with",
                name)


# ---------------------------------------------------------------- scanning

def device_memory(device: torch.device) -> int:
    """Bytes this process can still allocate on `device`. On CUDA: what the driver reports free
    plus what PyTorch's caching allocator holds reserved but unused (freed tensors it keeps for
    reuse; the driver counts them as taken, but the next allocation gets them first)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + max(0, cached)
    try:
        import os

        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return 8 << 30


def default_budget(device: torch.device) -> int:
    """Bytes of temporaries a tile may use: 1 GiB on a GPU, 256 MiB on a CPU (and never more
    than a quarter of what is free)."""
    cap = (1 << 30) if device.type == "cuda" else (256 << 20)
    return int(min(cap, device_memory(device) // 4))


def _format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _block_sizes(block_size) -> tuple[int, int]:
    q_block, kv_block = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    for name, value in (("q block", q_block), ("kv block", kv_block)):
        if not isinstance(value, int) or value < 1:
            raise WorkbenchError(f"{name} size {value!r} is not a positive integer",
                                 "use e.g. --block-size 128 (FlexAttention's default)")
    return q_block, kv_block


def _check_sizes(q_len, kv_len, batch, heads):
    for name, value in (("q_len", q_len), ("kv_len", kv_len), ("batch", batch), ("heads", heads)):
        if not isinstance(value, int) or value < 1:
            raise WorkbenchError(f"{name} = {value!r} must be a positive integer", f"pass a positive {name}")


@dataclass(frozen=True)
class ScanOptions:
    """How a scan counts, where the defaults do not suit: `memory_budget` bytes of temporaries per
    eager tile (None: a share of what is free); `keep_counts=False` keeps only totals (no per-block
    table, for lengths where even that table would not fit); `differences=False` skips counting the
    pairs where heads / batch entries differ from the first (half the work of a per-head mask; a
    BlockMask does not need them); `background_compile=True` (the notebook app) scans a mod whose
    fused kernel is not compiled yet with the other engines while it compiles on a background thread."""

    memory_budget: int | None = None
    keep_counts: bool = True
    differences: bool = True
    background_compile: bool = False


def scan_blocks(mask: Mask | Callable, q_len: int, kv_len: int, *, heads: int | None = None,
                batch: int | None = None, block_size: int | tuple[int, int] = DEFAULT_BLOCK,
                device: str | torch.device = "cpu", engine: str | None = None, progress: bool | None = None,
                options: ScanOptions | None = None, **settings) -> BlockScan:
    """Count kept pairs block by block: a BlockScan with `counts` [B', H', rows, cols] (kept pairs
    of each q_block x kv_block block; B', H' are 1 where the mask does not depend on b / h),
    `row_kept` [B', H', q_len] and totals, without ever holding q_len x kv_len.

    mask:        a Mask or a bare mask_mod(b, h, q_idx, kv_idx)
    block_size:  128, or (q_block, kv_block)

    heads / batch: None means broadcast (size 1), as in create_block_mask.
    engine: "triton" (the mod translated into one fused kernel: CUDA), "compiled" (torch.compile'd
    tiles), "eager" (tiles that fit the memory budget: any device), or None to pick:
    triton on CUDA past TRITON_ABOVE_PAIRS (2^33, e.g. 92K x 92K) when the mod translates, else
    eager (compiled above COMPILE_ABOVE_PAIRS, 2^36).
    options: ScanOptions (memory budget, totals only, no head / batch differences, background
    compiles); its fields are taken as keywords too (`keep_counts=False`).

        >>> from workbench import make
        >>> scan = scan_blocks(make("causal"), 256, 256, block_size=128)
        >>> scan.counts[0, 0].tolist()          # a full block below the diagonal, partial on it
        [[8256, 0], [16384, 8256]]
    """
    unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(ScanOptions)})
    if unknown:
        raise TypeError(f"scan_blocks() got an unexpected keyword argument {unknown[0]!r}")
    options = dataclasses.replace(options or ScanOptions(), **settings)
    memory_budget, keep_counts = options.memory_budget, options.keep_counts
    differences, background_compile = options.differences, options.background_compile
    mask_mod = mask.mask_mod if isinstance(mask, Mask) else mask
    name = mask.name if isinstance(mask, Mask) else getattr(mask, "__name__", "mask_mod")
    device = torch.device(device)
    heads_n, batch_n = heads or 1, batch or 1
    _check_sizes(q_len, kv_len, batch_n, heads_n)
    q_block, kv_block = _block_sizes(block_size)
    if engine not in (None, "eager", "compiled", "triton"):
        raise WorkbenchError(f"unknown engine {engine!r}", "use engine='triton', 'compiled' or 'eager' (or None)", name)
    if engine == "triton" and device.type != "cuda" and not kernels.interpreting():
        raise WorkbenchError(f"engine='triton' runs on CUDA, the scan is on {device}",
                             "use engine='eager' or 'compiled' (or None) on this device", name)
    if isinstance(mask, Mask) and mask.heads is not None and heads_n > mask.heads:
        raise WorkbenchError(f"the mask is defined for {mask.heads} heads, {heads_n} were asked",
                             f"use --heads {mask.heads} or fewer, or give the factory more per-head values", name)
    if isinstance(mask, Mask):
        for what, built, asked in (("q_len", mask.q_len, q_len), ("kv_len", mask.kv_len, kv_len)):
            if built is not None and built != asked:
                raise WorkbenchError(f"the mask was built for {what}={built}, asked for {asked}",
                                     "rebuild it with workbench.bind(mask, q_len, kv_len, device)", name)
    start = time.perf_counter()
    if mask_mod is None:
        evaluator, dep_b, dep_h = "broadcast", False, False
    else:
        try:
            evaluator = choose_evaluator(mask_mod, q_len, kv_len, batch_n, heads_n, device).how
        except WorkbenchError as exc:
            raise exc.for_mask(name)
        check_index_sizes(mask_mod, heads, batch, name)
        dep_b, dep_h = _dependence(mask_mod, batch_n, heads_n, device, evaluator)
    b_eff, h_eff = (batch_n if dep_b else 1), (heads_n if dep_h else 1)
    n_rows, n_cols = cdiv(q_len, q_block), cdiv(kv_len, kv_block)

    table_bytes = b_eff * h_eff * n_rows * n_cols * 4
    free = device_memory(device)
    if keep_counts and table_bytes > free // 2:
        raise WorkbenchError(
            f"the per-block table for {q_len:,} x {kv_len:,} tokens in {q_block} x {kv_block} blocks "
            f"({b_eff}x{h_eff}x{n_rows:,}x{n_cols:,} int32 = {_format_bytes(table_bytes)}) would not fit "
            f"in the {_format_bytes(free)} free on {device}",
            "use a larger --block-size, or statistics only (keep_counts=False)", name)

    geometry = _Geometry(name, q_len, kv_len, q_block, kv_block, b_eff, h_eff, dep_b and differences,
                         dep_h and differences, device,
                         memory_budget or default_budget(device), free)
    kernel, fallback = None, None
    # the app (background_compile) wants a kernel from the size where a compiled one is used on
    triton_from = TRITON_WARM_ABOVE_PAIRS if background_compile else TRITON_ABOVE_PAIRS
    triton_ok = mask_mod is not None and (engine == "triton" or (
        engine is None and geometry.pairs >= triton_from and kernels.available(device)))
    if triton_ok:
        try:
            kernel = kernels.scan_kernel(mask_mod, device, q_len, kv_len)
        except Exception as exc:  # a mod that does not translate
            if engine == "triton":
                raise WorkbenchError(f"the Triton block scan is not usable for this mod: {exc}",
                                     "use engine='eager' or 'compiled'", name) from exc
            fallback = f"{type(exc).__name__}: {exc}"
    settings = (q_block, kv_block, geometry.diff_h, geometry.diff_b, keep_counts)
    compiled = kernel is not None and kernels.is_compiled(kernel, *settings)
    asked_again = kernel is not None and not background_compile and kernels.times_requested(kernel) >= 2
    chosen = pick_engine(engine, device.type, geometry.pairs, q_len * kv_len, evaluator, kernel is not None,
                         compiled, asked_again)
    if background_compile and kernel is not None and chosen != "triton" and not compiled:
        kernels.compile_in_background(kernel, *settings, device, q_len, kv_len)
    if mask_mod is None:
        chosen = "eager"
    result = None
    if chosen == "triton":
        try:
            result = _scan_triton(mask_mod, kernel, evaluator, geometry, keep_counts)
        except Exception as exc:  # a translation that disagrees with torch
            if engine == "triton":
                raise WorkbenchError(f"the Triton block scan is not usable for this mod: {exc}",
                                     "use engine='eager' or 'compiled'", name) from exc
            fallback, chosen = f"{type(exc).__name__}: {exc}", "eager"
    if result is None:
        result = _scan_tiles(mask_mod, evaluator, geometry, keep_counts, chosen == "compiled", progress)
    if fallback:
        result["extra"]["triton_fallback"] = fallback
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    total_blocks = b_eff * h_eff * n_rows * n_cols
    full_n, empty_n = result["full"], result["empty"]
    row_kept = result["row_kept"]
    return BlockScan(
        q_len=q_len, kv_len=kv_len, q_block=q_block, kv_block=kv_block, batch=batch_n, heads=heads_n,
        depends_on_batch=dep_b, depends_on_head=dep_h, counts=result["counts"], row_kept=row_kept,
        full_blocks=full_n, partial_blocks=total_blocks - full_n - empty_n, empty_blocks=empty_n,
        kept_pairs=int(row_kept.sum()), head_pairs_differing=result["head_diff"] if geometry.diff_h else None,
        batch_pairs_differing=result["batch_diff"] if geometry.diff_b else None,
        engine=chosen, evaluator=evaluator, seconds=time.perf_counter() - start,
        compile_seconds=result["compile_seconds"], device=str(device), extra=result["extra"])


@dataclass
class _Geometry:
    name: str
    q_len: int
    kv_len: int
    q_block: int
    kv_block: int
    b_eff: int
    h_eff: int
    diff_b: bool  # count the pairs where batch entry b differs from entry 0
    diff_h: bool  # likewise head h from head 0
    device: torch.device
    budget: int
    free: int

    @property
    def n_rows(self) -> int:
        return cdiv(self.q_len, self.q_block)

    @property
    def n_cols(self) -> int:
        return cdiv(self.kv_len, self.kv_block)

    @property
    def pairs(self) -> int:  # pairs to evaluate, over the batch entries and heads that differ
        return self.q_len * self.kv_len * self.b_eff * self.h_eff

    def pairs_per_tile(self, bytes_per_pair: int) -> int:
        """Pairs (per batch entry and head) in a tile whose temporaries fit the budget; one block at least."""
        return max(self.q_block * self.kv_block, self.budget // (bytes_per_pair * self.b_eff * self.h_eff))


def pick_engine(requested: str | None, device_type: str, pairs: int, pairs_per_bh: int, evaluator: str,
                translated: bool, compiled: bool, asked_again: bool = False) -> str:
    """'triton', 'compiled' or 'eager' for one scan (a pure function of what it is given).

    pairs: pairs to evaluate over the batch entries and heads that differ; pairs_per_bh: per
    (b, h). translated: the mod has a fused-kernel translation; compiled: that kernel is compiled
    already; asked_again: this mod was scanned before (a notebook redrawing it), so compiling now
    is likely to pay off."""
    if requested == "compiled":
        return "compiled" if evaluator == "broadcast" else "eager"
    if requested is not None:
        return requested
    if translated and ((compiled and pairs >= TRITON_WARM_ABOVE_PAIRS) or pairs > TRITON_COLD_ABOVE_PAIRS
                       or (asked_again and pairs >= TRITON_ABOVE_PAIRS)):
        return "triton"
    if device_type == "cuda" and pairs_per_bh > COMPILE_ABOVE_PAIRS and evaluator == "broadcast":
        return "compiled"
    return "eager"


def _scan_triton(mask_mod, kernel, evaluator, g: _Geometry, keep_counts: bool) -> dict:
    """The fused kernel, then an exact spot check of three block rows against the eager tiles:
    the translation must agree with torch before its counts are trusted."""
    t0 = time.perf_counter()
    out = kernels.block_scan(kernel, g.q_len, g.kv_len, g.q_block, g.kv_block, g.b_eff, g.h_eff, g.diff_h,
                             g.diff_b, keep_counts, g.device)
    counts = out["counts"]
    full, empty = out["full"], out["empty"]
    if full is None:
        if counts is None:
            raise ValueError("blocks taller than 128 rows need the per-block table (keep_counts=True)")
        full, empty = _class_totals(counts, g.q_block * g.kv_block)
    seconds = time.perf_counter() - t0
    check_rows = sorted({0, g.n_rows // 2, g.n_rows - 1})
    _spot_check(mask_mod, evaluator, g, check_rows, counts, out["row_kept"])
    return dict(counts=counts, row_kept=out["row_kept"], full=full, empty=empty, head_diff=out["head_diff"],
                batch_diff=out["batch_diff"], compile_seconds=0.0,
                extra=dict(tile=out["tile"], tiles=g.n_rows * g.b_eff * g.h_eff, kernel_seconds=seconds,
                           spot_checked_rows=check_rows))


def _class_totals(counts: torch.Tensor, full_count: int) -> tuple[int, int]:
    return int((counts == full_count).sum()), int((counts == 0).sum())


def _spot_check(mask_mod, evaluator, g: _Geometry, block_rows: list[int], counts, row_kept) -> None:
    tile_kv = min(g.n_cols * g.kv_block,
                  max(g.kv_block, (g.pairs_per_tile(BYTES_PER_PAIR) // g.q_block) // g.kv_block * g.kv_block))
    b_idx = torch.arange(g.b_eff, device=g.device, dtype=torch.int32)
    h_idx = torch.arange(g.h_eff, device=g.device, dtype=torch.int32)
    tile_fn, _ = _tile_function(mask_mod, evaluator, b_idx, h_idx, g.q_len, g.kv_len, g.q_block, g.kv_block,
                                g.q_block, tile_kv, g.device, False, False, False)
    with torch.no_grad():
        for r in block_rows:
            q0, q1 = r * g.q_block, min((r + 1) * g.q_block, g.q_len)
            rows = torch.zeros(g.b_eff, g.h_eff, q1 - q0, dtype=torch.int64, device=g.device)
            for k0 in range(0, g.n_cols * g.kv_block, tile_kv):
                tile_counts, tile_rows, _ = tile_fn(q0, k0)
                c0 = k0 // g.kv_block
                c1 = min(c0 + tile_counts.shape[3], g.n_cols)
                if counts is not None and not torch.equal(counts[:, :, r, c0:c1], tile_counts[:, :, 0, : c1 - c0]):
                    raise ValueError(f"the translated mod's block counts differ from torch's in block row {r}")
                rows += tile_rows[:, :, : q1 - q0]
            if not torch.equal(rows, row_kept[:, :, q0:q1]):
                raise ValueError(f"the translated mod's row counts differ from torch's in block row {r}")


def _scan_tiles(mask_mod, evaluator, g: _Geometry, keep_counts: bool, use_compile: bool, progress) -> dict:
    """Eager (or torch.compile'd) tiles of a few thousand x a few thousand pairs."""
    device, b_eff, h_eff, q_block, kv_block = g.device, g.b_eff, g.h_eff, g.q_block, g.kv_block
    n_rows, n_cols = g.n_rows, g.n_cols
    # A compiled tile is fused (no per-pair temporaries beyond ~2 bytes), so it can be far larger,
    # which matters at millions of tokens where per-tile launch overhead would dominate.
    per_pair = 2 if use_compile else BYTES_PER_PAIR
    pairs_per_tile = g.pairs_per_tile(per_pair)
    tile_kv = min(n_cols * kv_block, max(kv_block, (int(math.sqrt(pairs_per_tile) * 2) // kv_block) * kv_block))
    tile_q = min(n_rows * q_block, max(q_block, (pairs_per_tile // tile_kv) // q_block * q_block))
    if q_block * kv_block * per_pair * b_eff * h_eff > g.free // 2:
        raise WorkbenchError(f"one {q_block} x {kv_block} block for {b_eff}x{h_eff} (batch x heads) "
                             f"does not fit in the memory on {device}", "use a smaller block size or fewer heads",
                             g.name)

    counts = torch.zeros(b_eff, h_eff, n_rows, n_cols, dtype=torch.int32, device=device) if keep_counts else None
    row_kept = torch.zeros(b_eff, h_eff, g.q_len, dtype=torch.int64, device=device)
    class_totals = torch.zeros(3, dtype=torch.int64, device=device)  # full, partial, empty
    head_diff = torch.zeros(b_eff, h_eff, dtype=torch.int64, device=device)
    batch_diff = torch.zeros(b_eff, h_eff, dtype=torch.int64, device=device)
    b_idx = torch.arange(b_eff, device=device, dtype=torch.int32)
    h_idx = torch.arange(h_eff, device=device, dtype=torch.int32)
    full_count = q_block * kv_block

    tile_fn, compile_seconds = _tile_function(mask_mod, evaluator, b_idx, h_idx, g.q_len, g.kv_len,
                                              q_block, kv_block, tile_q, tile_kv, device, use_compile,
                                              g.diff_b, g.diff_h)
    tiles = [(q0, k0) for q0 in range(0, n_rows * q_block, tile_q) for k0 in range(0, n_cols * kv_block, tile_kv)]
    show = progress if progress is not None else (len(tiles) > 64)
    with torch.no_grad():
        for q0, k0 in tqdm(tiles, desc=f"blocks {g.name}", disable=not show, leave=False):
            tile_counts, tile_rows, diffs = tile_fn(q0, k0)
            r0, c0 = q0 // q_block, k0 // kv_block
            r1, c1 = r0 + tile_counts.shape[2], c0 + tile_counts.shape[3]
            r1, c1 = min(r1, n_rows), min(c1, n_cols)
            tile_counts = tile_counts[:, :, : r1 - r0, : c1 - c0]
            if counts is not None:
                counts[:, :, r0:r1, c0:c1] = tile_counts
            q1 = min(q0 + tile_q, g.q_len)
            row_kept[:, :, q0:q1] += tile_rows[:, :, : q1 - q0]
            class_totals[0] += (tile_counts == full_count).sum()
            class_totals[2] += (tile_counts == 0).sum()
            if g.diff_h:
                head_diff += diffs[0]
            if g.diff_b:
                batch_diff += diffs[1]
    return dict(counts=counts, row_kept=row_kept, full=int(class_totals[0]), empty=int(class_totals[2]),
                head_diff=head_diff, batch_diff=batch_diff,
                compile_seconds=compile_seconds, extra=dict(tile=(tile_q, tile_kv), tiles=len(tiles)))


def _reduce_tile(m: torch.Tensor, q_block: int, kv_block: int, diff_b: bool, diff_h: bool, packed: bool = False):
    """Per-block kept counts, per-row kept counts and head/batch difference counts of a tile.

    packed=True sums the bool bytes eight at a time through an int64 view (each byte stays
    <= kv_block / 8, so no byte overflows), then adds the bytes: ~10x faster than summing bools,
    and exact. The compiled path keeps the plain form, which inductor fuses.
    """
    B, H, Q, K = m.shape
    if packed and kv_block % 8 == 0 and kv_block <= 2040 and m.is_contiguous():
        def count(x):  # x: bool [B', H', Q, K] -> kept per (row, kv block), int32
            words = x.view(torch.uint8).view(torch.int64).view(*x.shape[:3], K // kv_block, kv_block // 8)
            return words.sum(-1).view(torch.uint8).view(*x.shape[:3], K // kv_block, 8).sum(-1, dtype=torch.int32)

        def differing(x, ref):  # pairs where x != ref, per (b, h)
            xw = x.view(torch.uint8).view(torch.int64)
            rw = ref.view(torch.uint8).view(torch.int64)
            return count((xw ^ rw).view(torch.uint8).view(torch.bool)).sum(dim=(2, 3), dtype=torch.int64)

        row_block = count(m)
        counts = row_block.view(B, H, Q // q_block, q_block, K // kv_block).sum(3, dtype=torch.int32)
        rows = row_block.sum(-1, dtype=torch.int32)
        head_diff = differing(m, m[:, :1].expand_as(m).contiguous()) if diff_h else None
        batch_diff = differing(m, m[:1].expand_as(m).contiguous()) if diff_b else None
        return counts, rows, (head_diff, batch_diff)
    # One pass over the pairs: count each (row, kv block) first, then fold rows into blocks.
    row_block = m.view(B, H, Q, K // kv_block, kv_block).sum(dim=-1, dtype=torch.int32)
    counts = row_block.view(B, H, Q // q_block, q_block, K // kv_block).sum(dim=3, dtype=torch.int32)
    rows = row_block.sum(dim=-1, dtype=torch.int32)
    head_diff = (m != m[:, :1]).sum(dim=(2, 3)) if diff_h else None
    batch_diff = (m != m[:1]).sum(dim=(2, 3)) if diff_b else None
    return counts, rows, (head_diff, batch_diff)


def _tile_function(mask_mod, evaluator, b_idx, h_idx, q_len, kv_len, q_block, kv_block, tile_q, tile_kv,
                   device, use_compile, diff_b, diff_h):
    shape_bh = (len(b_idx), len(h_idx))

    if mask_mod is None:
        def full_tile(q0, k0):
            q1, k1 = min(q0 + tile_q, q_len), min(k0 + tile_kv, kv_len)
            m = torch.ones(*shape_bh, q1 - q0, k1 - k0, dtype=torch.bool, device=device)
            return _pad_and_reduce(m, q_block, kv_block, diff_b, diff_h)
        return full_tile, 0.0

    if not use_compile:

        def eager_tile(q0, k0):
            q1, k1 = min(q0 + tile_q, q_len), min(k0 + tile_kv, kv_len)
            q = torch.arange(q0, q1, device=device, dtype=torch.int32)
            kv = torch.arange(k0, k1, device=device, dtype=torch.int32)
            m = evaluate_mod(mask_mod, evaluator, b_idx, h_idx, q, kv)
            return _pad_and_reduce(m.to(torch.bool), q_block, kv_block, diff_b, diff_h)
        return eager_tile, 0.0

    # Compiled: one fixed tile shape; indices past the end are clamped (so captured tables are
    # never read out of range) and the pairs they give are masked out.
    compat.raise_recompile_limit()
    q_base = torch.arange(tile_q, device=device, dtype=torch.int32)
    kv_base = torch.arange(tile_kv, device=device, dtype=torch.int32)

    def tile_body(q0, k0):
        q = q0 + q_base
        kv = k0 + kv_base
        valid = (q < q_len).view(1, 1, -1, 1) & (kv < kv_len).view(1, 1, 1, -1)
        m = mask_mod(*broadcast_indices(b_idx, h_idx, q.clamp(max=q_len - 1), kv.clamp(max=kv_len - 1)))
        m = m & valid
        m = m.expand(*shape_bh, tile_q, tile_kv)
        return _reduce_tile(m, q_block, kv_block, diff_b, diff_h)

    compiled = torch.compile(tile_body, dynamic=False)
    t0 = time.perf_counter()
    as_tensor = lambda v: torch.tensor(v, device=device, dtype=torch.int32)  # noqa: E731
    compiled(as_tensor(0), as_tensor(0))  # compile now, so its cost is reported apart
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    compile_seconds = time.perf_counter() - t0

    def compiled_tile(q0, k0):
        return compiled(as_tensor(q0), as_tensor(k0))
    return compiled_tile, compile_seconds


def _pad_and_reduce(m, q_block, kv_block, diff_b, diff_h):
    Q, K = m.shape[-2:]
    pad_q, pad_k = (-Q) % q_block, (-K) % kv_block
    if pad_q or pad_k:  # masked padding, as torch pads: the last short block is never full
        m = torch.nn.functional.pad(m, (0, pad_k, 0, pad_q))
    return _reduce_tile(m.contiguous(), q_block, kv_block, diff_b, diff_h, packed=True)


# ---------------------------------------------------------------- BlockMask

EMPTY, PARTIAL, FULL = 0, 1, 2


def block_classes(scan: BlockScan) -> torch.Tensor:
    """[B', H', rows, cols] uint8 of EMPTY / PARTIAL / FULL."""
    if scan.counts is None:
        raise WorkbenchError("the scan kept no per-block table", "scan with keep_counts=True")
    full_count = scan.q_block * scan.kv_block
    classes = torch.full(scan.counts.shape, PARTIAL, dtype=torch.uint8, device=scan.counts.device)
    classes[scan.counts == 0] = EMPTY
    classes[scan.counts == full_count] = FULL
    return classes


def _ordered(classes: torch.Tensor, wanted: int, rows_per_chunk: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's (num_blocks, indices) encoding of the blocks of one class: per row, the columns of
    class `wanted` in ascending order, then all other columns in ascending order -- what torch's
    stable descending argsort of a 0/1 row gives. Written by a scatter (each column's place is
    known from a running count), in row chunks so temporaries stay a few tens of MiB."""
    *lead, n_rows, n_cols = classes.shape
    flat = classes.reshape(-1, n_cols)
    num = torch.empty(flat.shape[0], dtype=torch.int32, device=classes.device)
    out = torch.empty(flat.shape, dtype=torch.int32, device=classes.device)
    col = torch.arange(n_cols, dtype=torch.int32, device=classes.device)
    for r0 in range(0, flat.shape[0], rows_per_chunk):
        hit = flat[r0:r0 + rows_per_chunk] == wanted
        hits_upto = hit.cumsum(-1, dtype=torch.int32)  # hits at or before each column
        n_hit = hits_upto[:, -1:]
        place = torch.where(hit, hits_upto - 1, n_hit + col - hits_upto)
        num[r0:r0 + rows_per_chunk] = n_hit[:, 0]
        out[r0:r0 + rows_per_chunk].scatter_(-1, place.long(), col.expand_as(place))
    return num.view(*lead, n_rows), out.view(*lead, n_rows, n_cols)


def block_mask_from_scan(scan: BlockScan, mask_mod: Callable | None, compute_q_blocks: bool = True,
                         release_counts: bool = False, shrink: bool = False):
    """A torch BlockMask with exactly the tensors create_block_mask would give.

    compute_q_blocks=False leaves out the q-side tables (q_num_blocks, q_indices and their full_
    forms), which only FlexAttention's backward reads: half the memory at length.
    release_counts=True drops `scan.counts` once the block classes are known (lower peak memory).
    shrink=True gives the batch / head axes the mask does not depend on size 1 (FlexAttention
    broadcasts them): the same attention with a fraction of the index tables."""
    if scan.counts is None:
        raise WorkbenchError("this scan kept no per-block table (keep_counts=False)",
                             "scan again with keep_counts=True to build a BlockMask")
    batch = 1 if shrink and not scan.depends_on_batch else scan.batch
    heads = 1 if shrink and not scan.depends_on_head else scan.heads
    classes = block_classes(scan).expand(batch, heads, -1, -1)
    if release_counts:
        scan.counts = None
    kv_num, kv_idx = _ordered(classes, PARTIAL)
    full_kv_num, full_kv_idx = _ordered(classes, FULL)
    bm = compat.block_mask_from_kv_blocks(
        kv_num, kv_idx, full_kv_num, full_kv_idx, block_size=(scan.q_block, scan.kv_block),
        mask_mod=mask_mod if mask_mod is not None else _attend_all, seq_lengths=(scan.q_len, scan.kv_len),
        compute_q_blocks=False)
    if compute_q_blocks:
        by_column = classes.transpose(-2, -1)
        bm.q_num_blocks, bm.q_indices = _ordered(by_column, PARTIAL)
        bm.full_q_num_blocks, bm.full_q_indices = _ordered(by_column, FULL)
    return bm


def _attend_all(_b, _h, q_idx, _kv_idx):
    return q_idx >= 0


def build_block_mask(mask: Mask | Callable, q_len: int, kv_len: int, *, heads: int | None = None,
                     batch: int | None = None, block_size: int | tuple[int, int] = DEFAULT_BLOCK,
                     device: str | torch.device = "cpu", memory_budget: int | None = None,
                     engine: str | None = None, progress: bool | None = None,
                     compute_q_blocks: bool = True, shrink: bool = False):
    """Drop-in for `create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE)`:
    the same BlockMask, built in bounded memory. compute_q_blocks=False: forward-only (no q-side
    tables; FlexAttention's backward needs them). shrink=True: axes the mask does not depend on
    get size 1. heads / batch None (broadcast) are refused for a mod that reads h / b.

        >>> from workbench import make
        >>> bm = build_block_mask(make("causal"), 256, 256)
        >>> bm.kv_num_blocks[0, 0].tolist(), bm.full_kv_num_blocks[0, 0].tolist()   # partial, full per row
        ([1, 1], [0, 1])
    """
    scan = scan_blocks(mask, q_len, kv_len, heads=heads, batch=batch, block_size=block_size, device=device,
                       engine=engine, progress=progress,
                       options=ScanOptions(memory_budget=memory_budget, differences=False))
    mask_mod = mask.mask_mod if isinstance(mask, Mask) else mask
    return block_mask_from_scan(scan, mask_mod, compute_q_blocks=compute_q_blocks, release_counts=True,
                                shrink=shrink)
