"""Stage: look -- pictures of a mask. Every function returns a matplotlib Figure and writes
nothing; saving is the caller's choice (`fig.savefig(path)`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import matplotlib
import numpy as np
import torch
from matplotlib.colors import CenteredNorm, ListedColormap, Normalize
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator, NullLocator

from workbench import compat
from workbench.blocks import EMPTY, FULL, PARTIAL, BlockScan, block_classes, dense_mask, scan_blocks
from workbench.define import Mask, WorkbenchError

__all__ = ["png", "ShownFigure", "BlockGrid", "block_grid", "block_map", "token_view", "Focus", "focus", "overview",
           "overview_fractions", "score_view", "score_values", "diff_view", "diff_codes", "count_differences",
           "BLOCK_COLOURS", "BLOCK_LABELS"]

# Every figure the workbench writes or shows as a PNG (notebook, report, app, CLI, sweep summary)
# goes through `png`, at one resolution.
PNG_DPI = 90


def png(fig, path=None, close: bool = False) -> bytes:
    """The figure as PNG bytes (written to `path` too when given); `close`: free pyplot's copy."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=PNG_DPI, bbox_inches="tight", pad_inches=0.08)
    data = buf.getvalue()
    if path is not None:
        with open(path, "wb") as f:
            f.write(data)
    if close:
        import matplotlib.pyplot as plt

        plt.close(fig)
    return data


class ShownFigure(Figure):
    """A matplotlib Figure that shows itself as a PNG wherever a notebook displays it (JupyterLab,
    VS Code, nbclient), with or without `%matplotlib inline`: a bare Figure would print as
    `<Figure size 480x450 with 1 Axes>`."""

    def _repr_png_(self) -> bytes:
        return png(self)


# Block classes and their colours: empty (skipped), partial (mask_mod applied), full (no mask).
BLOCK_COLOURS = {EMPTY: "#f2f2f2", PARTIAL: "#f4a259", FULL: "#2a6f97"}
BLOCK_LABELS = {EMPTY: "empty (skipped)", PARTIAL: "partial (mask applied)", FULL: "full (no mask)"}
TOKEN_COLOURS = ("#f2f2f2", "#1d3557")  # masked, kept
MAX_TOKEN_VIEW = 4096
MAX_BLOCK_PIXELS = 1024
MAX_OUTLINED_BLOCKS = 96  # block boundaries are drawn while blocks are a few pixels wide or more


def _pool_classes(classes: torch.Tensor, max_pixels: int) -> tuple[torch.Tensor, int, int]:
    """Pool [rows, cols] classes into at most max_pixels per side: a cell is full (empty) only if
    all its blocks are, partial otherwise."""
    rows, cols = classes.shape
    fr, fc = math.ceil(rows / max_pixels), math.ceil(cols / max_pixels)
    if fr == 1 and fc == 1:
        return classes, 1, 1
    pad = (0, (-cols) % fc, 0, (-rows) % fr)
    c = classes.float()
    all_full = torch.nn.functional.pad((c == FULL).float(), pad, value=1.0)
    all_empty = torch.nn.functional.pad((c == EMPTY).float(), pad, value=1.0)
    pool = lambda x: torch.nn.functional.avg_pool2d(x[None, None], (fr, fc))[0, 0]  # noqa: E731
    out = torch.full(pool(all_full).shape, PARTIAL, dtype=torch.uint8)
    out[pool(all_full) == 1] = FULL
    out[pool(all_empty) == 1] = EMPTY
    return out, fr, fc


def _outline_blocks(ax, scan: BlockScan) -> None:
    """Thin white lines on block boundaries, so neighbouring partial blocks stay apart."""
    from matplotlib.collections import LineCollection

    width, height = scan.block_cols * scan.kv_block, scan.block_rows * scan.q_block
    lines = [[(x, 0), (x, height)] for x in range(scan.kv_block, width, scan.kv_block)]
    lines += [[(0, y), (width, y)] for y in range(scan.q_block, height, scan.q_block)]
    ax.add_collection(LineCollection(lines, colors="white", linewidths=0.6))


@dataclass
class BlockGrid:
    """One (b, h) panel of a block scan, pooled to at most max_cells per side, for an interactive
    view: `classes[r, c]` (EMPTY / PARTIAL / FULL) and `kept[r, c]` of each cell, each cell covering
    `pool_q` x `pool_kv` blocks."""

    classes: np.ndarray  # uint8 [rows, cols]
    kept: np.ndarray     # float64 [rows, cols], kept pairs
    pool_q: int
    pool_kv: int
    b: int
    h: int


def block_grid(scan: BlockScan, b: int = 0, h: int = 0, max_cells: int = 512) -> BlockGrid:
    """The data behind an interactive block map (see `workbench.app.widgets.BlockMapWidget`)."""
    if scan.counts is None:
        raise WorkbenchError("the scan kept no per-block table", "scan with keep_counts=True")
    bb, hh = min(b, scan.counts.shape[0] - 1), min(h, scan.counts.shape[1] - 1)
    classes, fr, fc = _pool_classes(block_classes(scan)[bb, hh].cpu(), max_cells)
    counts = scan.counts[bb, hh].double().cpu()
    if fr > 1 or fc > 1:
        pad = (0, (-counts.shape[1]) % fc, 0, (-counts.shape[0]) % fr)
        counts = torch.nn.functional.avg_pool2d(torch.nn.functional.pad(counts, pad)[None, None], (fr, fc))[0, 0] * fr * fc
    return BlockGrid(classes.numpy().astype(np.uint8), counts.numpy(), fr, fc, b, h)


def block_map(scan: BlockScan, title: str | None = None, max_panels: int = 16) -> Figure:
    """Full / partial / empty blocks in three colours, axes in tokens; one panel per head (and
    batch entry) when they differ."""
    classes = block_classes(scan).cpu()
    panels = [(b, h) for b in range(classes.shape[0]) for h in range(classes.shape[1])][:max_panels]
    ncols = min(4, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    aspect = scan.q_len / scan.kv_len
    # the constrained layout solver doubles the drawing time of a grid of heads: place those by hand
    many = len(panels) > 1
    side = 3.6 if len(panels) <= 4 else 2.6  # a 4 x 4 grid of heads stays ~11 inches wide, labels at 9 pt
    fig = ShownFigure(figsize=(side * ncols + 1.2, side * nrows * min(max(aspect, 0.4), 2.5) + 0.9),
                 layout=None if many else "constrained")
    # Every panel has the same extent, so only the outer panels get ticks: tick objects are most
    # of the drawing time of a grid of heads.
    axes = fig.subplots(nrows, ncols, squeeze=False)
    cmap = ListedColormap([BLOCK_COLOURS[k] for k in (EMPTY, PARTIAL, FULL)])
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    pooled_note = ""
    for ax, (b, h) in zip(axes.flat, panels):
        img, fr, fc = _pool_classes(classes[b, h], MAX_BLOCK_PIXELS)
        if fr > 1 or fc > 1:
            pooled_note = f" (each pixel {fr}x{fc} blocks)"
        ax.imshow(img.numpy(), cmap=cmap, vmin=0, vmax=2, interpolation="nearest", aspect="auto",
                  extent=(0, scan.block_cols * scan.kv_block, scan.block_rows * scan.q_block, 0))
        if fr == 1 and fc == 1 and max(scan.block_rows, scan.block_cols) <= MAX_OUTLINED_BLOCKS:
            _outline_blocks(ax, scan)
        index = panels.index((b, h))
        if not many or index + ncols >= len(panels):  # the lowest panel of its column
            ax.set_xlabel("kv token")
            ax.xaxis.set_major_locator(MaxNLocator(5))
        else:
            ax.xaxis.set_major_locator(NullLocator())
        if not many or index % ncols == 0:
            ax.set_ylabel("q token")
            ax.yaxis.set_major_locator(MaxNLocator(5))
        else:
            ax.yaxis.set_major_locator(NullLocator())
        label = []
        if scan.depends_on_batch:
            label.append(f"b={b}")
        if scan.depends_on_head:
            label.append(f"h={h}")
        if label and many:  # a tag inside the panel: titles cost a layout pass per panel
            ax.text(0.97, 0.97, ", ".join(label), transform=ax.transAxes, ha="right", va="top", fontsize=9,
                    bbox=dict(boxstyle="round,pad=0.2", facecolor="white", edgecolor="#c0c6cc"))
        elif label:
            ax.set_title(", ".join(label), fontsize=9)
    handles = [Patch(color=BLOCK_COLOURS[k], label=BLOCK_LABELS[k]) for k in (FULL, PARTIAL, EMPTY)]
    fig.legend(handles=handles, loc="lower center" if many else "outside lower center", ncols=3, fontsize=9,
               frameon=False)
    if many:
        height = fig.get_figheight()
        fig.subplots_adjust(left=0.95 / fig.get_figwidth(), right=0.98, top=1 - 0.55 / height, bottom=0.85 / height,
                            wspace=0.08, hspace=0.2 * side / max(1.0, height / nrows))
    fig.suptitle((title or "block map") + f"  ·  Lq {scan.q_len:,} x Lk {scan.kv_len:,}  ·  block size "
                 f"{scan.q_block} x {scan.kv_block}{pooled_note}", fontsize=10)
    return fig


def token_view(mask: Mask | Callable, q_range: tuple[int, int], kv_range: tuple[int, int], b: int = 0,
               h: int = 0, device="cpu", title: str | None = None, why: str | None = None) -> Figure:
    """The kept (dark) / masked (light) pairs of a window, one pixel per pair in the image data
    (the image array is the mask itself: `fig.axes[0].images[0].get_array()`). `why` says why the
    window is where it is (see `focus`) under the picture."""
    _check_window(q_range, kv_range)
    m = dense_mask(mask, q_range, kv_range, batch=[b], heads=[h], device=device)[0, 0].cpu().numpy()
    nq, nk = m.shape
    side = 6.0
    fig = ShownFigure(figsize=(side * min(1.0, nk / max(nq, nk)) + 1.0, side * min(1.0, nq / max(nq, nk)) + 1.1),
                      layout="constrained")
    ax = fig.subplots()
    ax.imshow(m.astype(np.uint8), cmap=ListedColormap([TOKEN_COLOURS[0], TOKEN_COLOURS[1]]), vmin=0, vmax=1,
              interpolation="nearest", aspect="auto", extent=(kv_range[0], kv_range[1], q_range[1], q_range[0]))
    ax.set_xlabel("kv token")
    ax.set_ylabel("q token")
    name = title or getattr(mask, "name", "mask")
    ax.set_title(f"{name}: q {q_range[0]}..{q_range[1] - 1}, kv {kv_range[0]}..{kv_range[1] - 1}"
                 f"  (b={b}, h={h}; {int(m.sum()):,} kept)", fontsize=9)
    handles = [Patch(facecolor=TOKEN_COLOURS[1], label="kept"),
               Patch(facecolor=TOKEN_COLOURS[0], edgecolor="#c0c6cc", label="masked")]
    fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize=8, frameon=False,
               title=_wrap(why, 90) if why else None, title_fontsize=7.5)
    return fig


def _wrap(text: str, width: int) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width))


@dataclass(frozen=True)
class Focus:
    """Where a zoomed view of a mask looks, and why there (the one rule report, app and CLI share)."""

    q_range: tuple[int, int]
    kv_range: tuple[int, int]
    reason: str
    block: tuple[int, int] | None = None  # the (q block, kv block) the view is centred on


def _causal_counts(scan: BlockScan, device) -> torch.Tensor:
    """Kept pairs per block of plain causal attention (queries are the last q_len tokens), in
    closed form: a row q keeps clamp(q + offset + 1 - kv_start, 0, block width) keys of a block."""
    off = scan.kv_len - scan.q_len
    qs = torch.arange(scan.block_rows, device=device, dtype=torch.int64)[:, None] * scan.q_block
    ks = torch.arange(scan.block_cols, device=device, dtype=torch.int64)[None, :] * scan.kv_block
    rows = (torch.clamp(qs + scan.q_block, max=scan.q_len) - qs)
    width = (torch.clamp(ks + scan.kv_block, max=scan.kv_len) - ks)

    def ramp(m):  # sum over u = 1..m of min(u, width), 0 for m <= 0
        m = m.clamp(min=0)
        return torch.where(m <= width, m * (m + 1) // 2, width * (width + 1) // 2 + (m - width) * width)

    first = qs + off + 1 - ks  # keys kept by the block's first row, before clamping
    return ramp(first + rows - 1) - ramp(first - 1)


def focus(scan: BlockScan, size: int = 512, b: int = 0, h: int = 0, mask: Mask | Callable | None = None,
          device="cpu") -> Focus:
    """The window of at most size x size tokens where a mask's structure is: centred on the first
    block (row by row) whose kept pairs differ from plain causal attention's -- a partial one if
    any differs, since that is where the mask_mod decides pair by pair -- so a window, a tree in the
    last tokens, a document boundary or an image span is in view. A mask equal to causal looks at
    the start of the diagonal. Given the mask, a difference confined to a few tokens of that block
    (a 15-token tree) gets a smaller window around it. `reason` says which rule applied."""
    if scan.counts is None:
        raise WorkbenchError("the scan kept no per-block table", "scan with keep_counts=True")
    counts = scan.counts[min(b, scan.counts.shape[0] - 1), min(h, scan.counts.shape[1] - 1)]
    causal = _causal_counts(scan, counts.device)
    differs = counts.to(torch.int64) != causal
    classes = block_classes(scan)[min(b, scan.counts.shape[0] - 1), min(h, scan.counts.shape[1] - 1)]
    partial_differs = differs & (classes == PARTIAL)
    nq, nk = min(size, scan.q_len), min(size, scan.kv_len)
    if bool(partial_differs.any()) or bool(differs.any()):
        pick = partial_differs if bool(partial_differs.any()) else differs
        r, c = (int(i) for i in pick.nonzero()[0])
        kind = "partial block" if pick is partial_differs else "block"
        reason = (f"centred on the first {kind} that differs from plain causal attention: q block {r}, kv block {c} "
                  f"(tokens q {r * scan.q_block}..{min(scan.q_len, (r + 1) * scan.q_block) - 1}, kv "
                  f"{c * scan.kv_block}..{min(scan.kv_len, (c + 1) * scan.kv_block) - 1})")
    else:
        off = scan.kv_len - scan.q_len
        r, c = 0, min(off // scan.kv_block, scan.block_cols - 1)
        reason = "the mask keeps what plain causal attention keeps, block for block: the start of the diagonal"

    def window(centre, n, length):
        start = min(max(0, centre - n // 2), length - n)
        return (start, start + n)

    q_centre = min(r * scan.q_block + scan.q_block // 2, scan.q_len - 1)
    kv_centre = min(c * scan.kv_block + scan.kv_block // 2, scan.kv_len - 1)
    if mask is not None and bool(differs[r, c]):
        box = _differing_box(mask, scan, r, c, b, h, device)
        if box is not None and max(box[1] - box[0], box[3] - box[2]) * 8 <= min(nq, nk):
            n = max(64, 4 * max(box[1] - box[0], box[3] - box[2]))
            nq, nk = min(n, scan.q_len), min(n, scan.kv_len)
            q_centre, kv_centre = (box[0] + box[1]) // 2, (box[2] + box[3]) // 2
            reason += f"; the difference spans only q {box[0]}..{box[1] - 1}, kv {box[2]}..{box[3] - 1}, so a closer view"
        elif box is not None and not (window(q_centre, nq, scan.q_len)[0] <= box[0] < window(q_centre, nq, scan.q_len)[1]
                                      and window(kv_centre, nk, scan.kv_len)[0] <= box[2]
                                      < window(kv_centre, nk, scan.kv_len)[1]):
            # the block's centre would miss where the difference starts (an image span's first token)
            q_centre, kv_centre = box[0] + nq // 2 - nq // 8, box[2] + nk // 2 - nk // 8
            reason += f"; the difference starts at q {box[0]}, kv {box[2]}"
    return Focus(window(q_centre, nq, scan.q_len), window(kv_centre, nk, scan.kv_len), reason, (r, c))


def _differing_box(mask, scan: BlockScan, r: int, c: int, b: int, h: int, device) -> tuple[int, int, int, int] | None:
    """Token bounds (q0, q1, kv0, kv1) of the pairs of block (r, c) that differ from causal."""
    q0, k0 = r * scan.q_block, c * scan.kv_block
    q1, k1 = min(q0 + scan.q_block, scan.q_len), min(k0 + scan.kv_block, scan.kv_len)
    kept = dense_mask(mask, (q0, q1), (k0, k1), batch=[b], heads=[h], device=device)[0, 0].cpu()
    q = torch.arange(q0, q1)[:, None] + (scan.kv_len - scan.q_len)
    diff = (kept != (torch.arange(k0, k1)[None, :] <= q)).nonzero()
    if not len(diff):
        return None
    return (q0 + int(diff[:, 0].min()), q0 + int(diff[:, 0].max()) + 1, k0 + int(diff[:, 1].min()),
            k0 + int(diff[:, 1].max()) + 1)


def _check_window(q_range, kv_range):
    nq, nk = q_range[1] - q_range[0], kv_range[1] - kv_range[0]
    if nq < 1 or nk < 1:
        raise WorkbenchError(f"empty window q {q_range} x kv {kv_range}", "give (start, stop) with stop > start")
    if nq > MAX_TOKEN_VIEW or nk > MAX_TOKEN_VIEW:
        raise WorkbenchError(f"window {nq} x {nk} is larger than {MAX_TOKEN_VIEW} x {MAX_TOKEN_VIEW}",
                             "use overview() for whole masks, or a smaller window")


def overview_fractions(mask: Mask | Callable, q_len: int, kv_len: int, pixels: int = 512, b: int = 0, h: int = 0,
                       device="cpu", **scan_kwargs) -> tuple[torch.Tensor, int, int]:
    """Exact down-sampling: fraction of kept pairs in each cell of a grid of at most
    pixels x pixels cells (cells of ceil(L / pixels) tokens). Returns (fractions, cell_q, cell_kv)."""
    cell_q, cell_kv = max(1, math.ceil(q_len / pixels)), max(1, math.ceil(kv_len / pixels))
    mask_mod = mask.mask_mod if isinstance(mask, Mask) else mask
    if mask_mod is not None and (b or h):
        inner = mask_mod

        def one_head(bb, hh, q_idx, kv_idx):  # pick the (b, h) to draw
            return inner(bb * 0 + b, hh * 0 + h, q_idx, kv_idx)
        mask_mod = one_head
    scan = scan_blocks(mask_mod, q_len, kv_len, block_size=(cell_q, cell_kv), device=device, **scan_kwargs)
    counts = scan.counts[0, 0].double()
    rows = torch.full((scan.block_rows,), float(cell_q), dtype=torch.float64, device=counts.device)
    cols = torch.full((scan.block_cols,), float(cell_kv), dtype=torch.float64, device=counts.device)
    rows[-1] = q_len - cell_q * (scan.block_rows - 1)
    cols[-1] = kv_len - cell_kv * (scan.block_cols - 1)
    return (counts / (rows[:, None] * cols[None, :])).cpu(), cell_q, cell_kv


def overview(mask: Mask | Callable, q_len: int, kv_len: int, pixels: int = 512, b: int = 0, h: int = 0,
             device="cpu", title: str | None = None, **scan_kwargs) -> Figure:
    """The whole mask at any length: each pixel is the exact fraction of kept pairs in its cell."""
    frac, cell_q, cell_kv = overview_fractions(mask, q_len, kv_len, pixels, b, h, device, **scan_kwargs)
    fig = ShownFigure(figsize=(6.4, 5.4), layout="constrained")
    ax = fig.subplots()
    im = ax.imshow(frac.numpy(), cmap="Blues", vmin=0, vmax=1, interpolation="nearest", aspect="auto",
                   extent=(0, kv_len, q_len, 0))
    fig.colorbar(im, ax=ax, label="fraction of pairs kept", shrink=0.8)
    ax.set_xlabel("kv token")
    ax.set_ylabel("q token")
    name = title or getattr(mask, "name", "mask")
    ax.set_title(f"{name}: {q_len:,} x {kv_len:,} tokens, each pixel {cell_q} x {cell_kv} tokens", fontsize=9)
    return fig


def score_values(mask: Mask, q_range, kv_range, b: int = 0, h: int = 0, device="cpu") -> torch.Tensor:
    """score_mod applied to a zero score (the probe where q.k = 0, so it shows the mod itself);
    masked pairs are NaN."""

    _check_window(q_range, kv_range)
    bb = torch.tensor([b], device=device, dtype=torch.int32)
    hh = torch.tensor([h], device=device, dtype=torch.int32)
    q = torch.arange(*q_range, device=device, dtype=torch.int32)
    kv = torch.arange(*kv_range, device=device, dtype=torch.int32)
    zeros = torch.zeros(1, 1, len(q), len(kv), device=device)
    with torch.no_grad():
        scores = zeros if mask.score_mod is None else compat.vmap_bhqkv(mask.score_mod, bb, hh, q, kv, score=zeros)
        kept = dense_mask(mask, q_range, kv_range, batch=[b], heads=[h], device=device)
    return torch.where(kept, scores.float(), torch.nan)[0, 0].cpu()


def score_view(mask: Mask, q_range, kv_range, b: int = 0, h: int = 0, device="cpu", title: str | None = None) -> Figure:
    """Score after score_mod on the zero probe, diverging colours around 0, masked cells blank."""
    values = score_values(mask, q_range, kv_range, b, h, device).numpy()
    fig = ShownFigure(figsize=(6.6, 5.4), layout="constrained")
    ax = fig.subplots()
    finite = values[np.isfinite(values)]
    low, high = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 0.0)
    # one-sided values (a bias that only lowers scores) get a one-sided scale, so their range
    # uses every colour; values of both signs diverge around 0
    if low < 0 < high or low == high:
        spread = max(abs(low), abs(high)) or 1.0
        cmap, norm = matplotlib.colormaps["RdBu_r"], CenteredNorm(0.0, spread)
    elif high <= 0:
        cmap, norm = matplotlib.colormaps["Blues_r"], Normalize(low, 0.0)
    else:
        cmap, norm = matplotlib.colormaps["Reds"], Normalize(0.0, high)
    im = ax.imshow(np.ma.masked_invalid(values), cmap=cmap.with_extremes(bad="white"), norm=norm,
                   interpolation="nearest", aspect="auto", extent=(kv_range[0], kv_range[1], q_range[1], q_range[0]))
    fig.colorbar(im, ax=ax, label="score_mod(0, b, h, q, kv)", shrink=0.8)
    ax.set_xlabel("kv token")
    ax.set_ylabel("q token")
    ax.set_title(f"{title or mask.name}: scores at q.k = 0 (b={b}, h={h}; blank = masked)", fontsize=9)
    return fig


DIFF_COLOURS = ["#ffffff", "#b8c4d0", "#d62828", "#1d70b8"]  # neither, both, only A, only B
NEITHER, BOTH, ONLY_A, ONLY_B = 0, 1, 2, 3


def diff_codes(mask_a, mask_b, q_range, kv_range, b: int = 0, h: int = 0, device="cpu") -> torch.Tensor:
    """Per pair: NEITHER, BOTH, ONLY_A or ONLY_B kept."""
    _check_window(q_range, kv_range)
    a = dense_mask(mask_a, q_range, kv_range, batch=[b], heads=[h], device=device)[0, 0].cpu()
    bm = dense_mask(mask_b, q_range, kv_range, batch=[b], heads=[h], device=device)[0, 0].cpu()
    codes = torch.zeros(a.shape, dtype=torch.uint8)
    codes[a & bm] = BOTH
    codes[a & ~bm] = ONLY_A
    codes[~a & bm] = ONLY_B
    return codes


def diff_view(mask_a, mask_b, q_range, kv_range, b: int = 0, h: int = 0, device="cpu",
              labels: tuple[str, str] | None = None) -> Figure:
    """Two masks overlaid: pairs only one keeps in red / blue, counted in the legend. For a
    draft and its port, or a mask and the mask a spec rebuilds."""
    codes = diff_codes(mask_a, mask_b, q_range, kv_range, b, h, device)
    la = labels[0] if labels else getattr(mask_a, "name", "A")
    lb = labels[1] if labels else getattr(mask_b, "name", "B")
    n_a, n_b = int((codes == ONLY_A).sum()), int((codes == ONLY_B).sum())
    fig = ShownFigure(figsize=(6.6, 6.0), layout="constrained")
    ax = fig.subplots()
    ax.imshow(codes.numpy(), cmap=ListedColormap(DIFF_COLOURS), vmin=0, vmax=3, interpolation="nearest", aspect="auto",
              extent=(kv_range[0], kv_range[1], q_range[1], q_range[0]))
    ax.set_xlabel("kv token")
    ax.set_ylabel("q token")
    verdict = "identical" if n_a + n_b == 0 else f"{n_a + n_b:,} pairs differ"
    ax.set_title(f"{la} vs {lb}: {verdict}", fontsize=9)
    handles = [Patch(color=DIFF_COLOURS[BOTH], label="both keep"),
               Patch(color=DIFF_COLOURS[ONLY_A], label=f"only {la}: {n_a:,}"),
               Patch(color=DIFF_COLOURS[ONLY_B], label=f"only {lb}: {n_b:,}")]
    fig.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=8, frameon=False)
    return fig


def count_differences(mask_a, mask_b, q_len: int, kv_len: int, heads: int | None = None, batch: int | None = None,
                      device="cpu") -> int:
    """Exact number of pairs where two masks disagree, at any length (a scan of a XOR b)."""
    mod_a = mask_a.mask_mod if isinstance(mask_a, Mask) else mask_a
    mod_b = mask_b.mask_mod if isinstance(mask_b, Mask) else mask_b

    def disagreement(b, h, q_idx, kv_idx):
        keep_a = mod_a(b, h, q_idx, kv_idx) if mod_a is not None else q_idx >= 0
        keep_b = mod_b(b, h, q_idx, kv_idx) if mod_b is not None else q_idx >= 0
        return keep_a != keep_b

    scan = scan_blocks(disagreement, q_len, kv_len, heads=heads, batch=batch, device=device, keep_counts=False)
    repeat = ((scan.batch if not scan.depends_on_batch else 1) * (scan.heads if not scan.depends_on_head else 1))
    return scan.kept_pairs * repeat
