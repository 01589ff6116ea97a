"""Stage: analyze for porting -- a mask in the terms of other kernels, each form checked exactly.

Every form starts from the mask's kept intervals (rows or columns, in CSR form) and is then
decoded back to a dense mask with the target's own semantics and compared bit for bit with the
mask_mod (`check_section`). A form that does not reproduce the mask is not returned; the
reason is. The decoders here follow the semantics written in docs/porting.md; the tests decode
again with code of their own.

Notation: i query index, j key index, Lq/Lk lengths, D = Lk - Lq, a = i + D (the query's
position among the keys).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from workbench.blocks import dense_mask
from workbench.compat import getitem_as_index
from workbench.define import Mask

__all__ = ["Intervals", "mask_intervals", "check_section", "fit_flash_attn", "decode_flash_attn", "fit_vllm_triton",
           "decode_vllm_triton", "fit_magi", "decode_magi", "fit_flashmask", "decode_flashmask",
           "decode_row_intervals", "row_intervals_table", "decode_block_sparse", "probe_score"]

ROW_CHUNK_PAIRS = 1 << 24  # pairs per dense chunk while reading intervals or checking a form
MAX_SLICES = 1 << 16


# ---------------------------------------------------------------- intervals

@dataclass
class Intervals:
    """Kept runs of one (b, h) mask along rows (or columns): line n keeps
    [starts[k], ends[k]) for k in indptr[n] .. indptr[n+1]-1, in increasing order."""

    indptr: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    length: int  # positions along a line (Lk for rows, Lq for columns)

    @property
    def lines(self) -> int:
        return len(self.indptr) - 1

    @property
    def counts(self) -> np.ndarray:
        return np.diff(self.indptr)

    def line(self, n: int) -> list[tuple[int, int]]:
        a, b = self.indptr[n], self.indptr[n + 1]
        return list(zip(self.starts[a:b].tolist(), self.ends[a:b].tolist()))

    def single(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(lo, hi, empty) for masks with at most one run per line (lo = hi = 0 where empty)."""
        counts = self.counts
        empty = counts == 0
        lo = np.zeros(self.lines, dtype=np.int64)
        hi = np.zeros(self.lines, dtype=np.int64)
        lo[~empty] = self.starts[self.indptr[:-1][~empty]]
        hi[~empty] = self.ends[self.indptr[:-1][~empty]]
        return lo, hi, empty

    def dense(self, rows: tuple[int, int]) -> np.ndarray:
        r0, r1 = rows
        out = np.zeros((r1 - r0, self.length), dtype=bool)
        for n in range(r0, r1):
            for s, e in self.line(n):
                out[n - r0, s:e] = True
        return out


def _runs(chunk: torch.Tensor):
    """Run starts/ends of each line of a [n, L] bool tensor: (line, start) and (line, end) lists."""
    n, length = chunk.shape
    pad = torch.zeros(n, 1, dtype=torch.bool, device=chunk.device)
    padded = torch.cat([pad, chunk, pad], dim=1)
    rise = (~padded[:, :-1]) & padded[:, 1:]
    fall = padded[:, :-1] & (~padded[:, 1:])
    return rise.nonzero().cpu().numpy(), fall.nonzero().cpu().numpy()


def mask_intervals(mask: Mask, q_len: int, kv_len: int, b: int = 0, h: int = 0, axis: str = "rows",
                   device="cpu") -> Intervals:
    """The kept runs of mask (b, h) along rows (per query) or columns (per key), read in chunks."""
    lines, length = (q_len, kv_len) if axis == "rows" else (kv_len, q_len)
    step = max(1, ROW_CHUNK_PAIRS // max(1, length))
    counts = np.zeros(lines, dtype=np.int64)
    starts, ends = [], []
    for n0 in range(0, lines, step):
        n1 = min(lines, n0 + step)
        if axis == "rows":
            chunk = dense_mask(mask, (n0, n1), (0, kv_len), batch=[b], heads=[h], device=device)[0, 0]
        else:
            chunk = dense_mask(mask, (0, q_len), (n0, n1), batch=[b], heads=[h], device=device)[0, 0].T
        rise, fall = _runs(chunk)
        np.add.at(counts, rise[:, 0] + n0, 1)
        starts.append(rise[:, 1])
        ends.append(fall[:, 1])
    indptr = np.concatenate([[0], np.cumsum(counts)])
    return Intervals(indptr, np.concatenate(starts).astype(np.int64), np.concatenate(ends).astype(np.int64), length)


def check_section(decode: Callable[[int, int], np.ndarray], iv: Intervals) -> str | None:
    """Compare `decode(r0, r1)` ([r1 - r0, Lk] bool, the target's reading) with the mask, chunk by
    chunk. None if equal, else where they first differ."""
    step = max(1, ROW_CHUNK_PAIRS // max(1, iv.length))
    for r0 in range(0, iv.lines, step):
        r1 = min(iv.lines, r0 + step)
        got = decode(r0, r1)
        want = iv.dense((r0, r1))
        if not np.array_equal(got, want):
            bad = np.argwhere(got != want)
            r, c = bad[0]
            return (f"{len(bad)} pairs differ in rows {r0}..{r1 - 1}, first at (q={r0 + r}, kv={c}): the form "
                    f"{'keeps' if got[r, c] else 'drops'} it")
    return None


def _mode(values: np.ndarray):
    if len(values) == 0:
        return None
    return Counter(values.tolist()).most_common(1)[0][0]


# ---------------------------------------------------------------- flash_attn

def decode_flash_attn(section: dict, q_len: int, kv_len: int) -> Callable[[int, int], np.ndarray]:
    """FlashAttention's reading: inside each segment, local i, j, D = seg Lk - seg Lq; keep iff
    (l < 0 or j >= i + D - l) and (r < 0 or j <= i + D + r); causal means r = 0; a chunk C > 0
    also needs floor((i+D)/C)*C <= j < floor((i+D)/C)*C + C."""
    l, r = section["window_size"]
    if section["causal"]:
        r = 0
    chunk = section.get("attention_chunk") or 0
    cu_q = section["cu_seqlens_q"] or [0, q_len]
    cu_k = section["cu_seqlens_k"] or [0, kv_len]

    def decode(r0, r1):
        out = np.zeros((r1 - r0, kv_len), dtype=bool)
        for s in range(len(cu_q) - 1):
            qs, qe, ks, ke = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
            lo, hi = max(qs, r0), min(qe, r1)
            if lo >= hi:
                continue
            i = np.arange(lo, hi)[:, None] - qs
            j = np.arange(ks, ke)[None, :] - ks
            a = i + (ke - ks) - (qe - qs)
            keep = np.ones((hi - lo, ke - ks), dtype=bool)
            if l >= 0:
                keep &= j >= a - l
            if r >= 0:
                keep &= j <= a + r
            if chunk > 0:
                start = np.floor_divide(a, chunk) * chunk
                keep &= (j >= start) & (j < start + chunk)
            out[lo - r0:hi - r0, ks:ke] = keep
        return out
    return decode


def _fit_window(lo, hi, empty, a, kv_len):
    """Candidate (l, r, chunk) triples for single-interval rows at positions a; kv_len is the
    (segment) key length, a number or one per row."""
    live = ~empty
    left = lo[live] > 0
    l = _mode((a[live] - lo[live])[left]) if left.any() else -1
    right = hi[live] < np.broadcast_to(kv_len, hi.shape)[live]
    r = _mode((hi[live] - 1 - a[live])[right]) if right.any() else -1
    cands = [(l, r, 0)]
    positive = lo[live][lo[live] > 0]
    if len(positive):
        c = int(positive.min())
        cands += [(-1, r, c), (-1, -1, c), (l, r, c)]
    return [(int(x), int(y), int(z)) for x, y, z in cands if x is not None and y is not None]


def _predict(a, seg_kv, l, r, c):
    lo = np.zeros_like(a) if l < 0 else np.maximum(0, a - l)
    hi = np.full_like(a, seg_kv) if r < 0 else np.minimum(seg_kv, a + r + 1)
    if c > 0:
        start = np.floor_divide(a, c) * c
        lo, hi = np.maximum(lo, start), np.minimum(hi, start + c)
    hi = np.minimum(hi, seg_kv)
    lo = np.maximum(lo, 0)
    empty = lo >= hi
    return np.where(empty, 0, lo), np.where(empty, 0, hi), empty


def _segments(lo, hi, empty, q_len, kv_len):
    """Segment boundaries where no kept pair crosses: a query row starts a new segment when its
    first key lies at or past every key used before it."""
    cu_q, cu_k = [0], [0]
    reach = 0
    for i in range(q_len):
        if empty[i]:
            continue
        if i > 0 and lo[i] >= reach and cu_q[-1] != i and reach > 0:
            cu_q.append(i)
            cu_k.append(int(lo[i]))
        reach = max(reach, int(hi[i]))
    cu_q.append(q_len)
    cu_k.append(kv_len)
    return cu_q, cu_k


def _window(l, r):
    """FA's window_size for a fitted (l, r): with causal (r == 0) FA wants (-1, -1) or (l, 0)."""
    return [-1, -1] if (r == 0 and l < 0) else [l, r]


def fit_flash_attn(iv: Intervals, q_len: int, kv_len: int) -> tuple[dict | None, str]:
    counts = iv.counts
    if (counts > 1).any():
        n = int((counts > 1).sum())
        first = int(np.argmax(counts > 1))
        return None, (f"{n} query rows keep more than one run of keys (first: q={first}, {iv.line(first)[:3]}); "
                      "FlashAttention keeps one contiguous window per row")
    lo, hi, empty = iv.single()
    base = dict(causal=False, window_size=[-1, -1], softcap=0.0, alibi_slopes=None, attention_chunk=0,
                cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=q_len, max_seqlen_k=kv_len)
    a = np.arange(q_len) + (kv_len - q_len)
    closest = None  # (rows that differ, first differing row, l, r, c, predicted lo, hi)
    candidates = _fit_window(lo, hi, empty, a, kv_len)
    # A mask of a few unequal documents can also read as one attention_chunk that happens to fit
    # at this length; prefer chunks only when at least two whole chunks repeat, else segments.
    chunk = next((c for _, _, c in candidates if c), 0)
    repeats = chunk > 0 and kv_len // chunk >= 2
    first = [x for x in candidates if x[2] == 0 or repeats]
    for l, r, c in first:
        p_lo, p_hi, p_empty = _predict(a, kv_len, l, r, c)
        if np.array_equal(p_empty, empty) and np.array_equal(p_lo, lo) and np.array_equal(p_hi, hi):
            return dict(base, causal=(r == 0), window_size=_window(l, r), attention_chunk=c), ""
        differ = (p_empty != empty) | (p_lo != lo) | (p_hi != hi)
        if closest is None or differ.sum() < closest[0]:
            row = int(np.argmax(differ))
            closest = (int(differ.sum()), row, l, r, c, int(p_lo[row]), int(p_hi[row]))
    late_chunks = [x for x in candidates if x not in first]
    cu_q, cu_k = _segments(lo, hi, empty, q_len, kv_len)
    if len(cu_q) > 2:
        seg_of_row = np.searchsorted(np.array(cu_q), np.arange(q_len), side="right") - 1
        qs, ks = np.array(cu_q)[seg_of_row], np.array(cu_k)[seg_of_row]
        seg_q = np.diff(cu_q)[seg_of_row]
        seg_k = np.diff(cu_k)[seg_of_row]
        a_loc = np.arange(q_len) - qs + seg_k - seg_q
        lo_loc, hi_loc = lo - ks, hi - ks
        for l, r, c in _fit_window(lo_loc, hi_loc, empty, a_loc, seg_k):
            p_lo, p_hi, p_empty = _predict(a_loc, seg_k, l, r, c)
            if np.array_equal(p_empty, empty) and np.array_equal(np.where(empty, 0, p_lo), np.where(empty, 0, lo_loc)) \
                    and np.array_equal(np.where(empty, 0, p_hi), np.where(empty, 0, hi_loc)):
                return dict(base, causal=(r == 0), window_size=_window(l, r), attention_chunk=c,
                            cu_seqlens_q=[int(x) for x in cu_q], cu_seqlens_k=[int(x) for x in cu_k],
                            max_seqlen_q=int(np.diff(cu_q).max()), max_seqlen_k=int(np.diff(cu_k).max())), ""
    for l, r, c in late_chunks:
        p_lo, p_hi, p_empty = _predict(a, kv_len, l, r, c)
        if np.array_equal(p_empty, empty) and np.array_equal(p_lo, lo) and np.array_equal(p_hi, hi):
            return dict(base, causal=(r == 0), window_size=_window(l, r), attention_chunk=c), ""
    why = "no causal flag, window_size, attention_chunk or cu_seqlens segmentation reproduces the mask"
    if closest is not None:
        n, row, l, r, c, p_lo, p_hi = closest
        keeps = f"kv {lo[row]}..{hi[row] - 1}" if not empty[row] else "nothing"
        fa = f"kv {p_lo}..{p_hi - 1}" if p_hi > p_lo else "nothing"
        why += (f"; the closest, causal={r == 0} window_size={_window(l, r)} attention_chunk={c}, differs on {n} rows, "
                f"first q={row}: the mask keeps {keeps}, FA would keep {fa}")
    return None, why


# ---------------------------------------------------------------- vLLM TritonAttention

def decode_vllm_triton(section: dict, q_len: int, kv_len: int) -> Callable[[int, int], np.ndarray]:
    """vLLM TritonAttention's reading, a = i + D: decoder base j <= a and (W null or a - j < W),
    with rswa also (j < P or a - j < R); encoder_only base W null or |a - j| < W; keep iff base
    or some inclusive range [s, e] holds both a and j."""
    w = section["sliding_window"]
    rswa = section["rswa"]
    ranges = section["mm_prefix_ranges"] or []

    def decode(r0, r1):
        a = (np.arange(r0, r1) + kv_len - q_len)[:, None]
        j = np.arange(kv_len)[None, :]
        if section["attn_type"] == "decoder":
            keep = j <= a
            if w is not None:
                keep = keep & (a - j < w)
            if rswa is not None:
                keep = keep & ((j < rswa["prefix_len"]) | (a - j < rswa["window"]))
        else:
            keep = np.ones((r1 - r0, kv_len), dtype=bool) if w is None else np.abs(a - j) < w
        for s, e in ranges:
            keep = keep | ((a >= s) & (a <= e) & (j >= s) & (j <= e))
        return keep
    return decode


def _vllm_ranges(iv: Intervals, base_decode, q_len, kv_len) -> tuple[list | None, str]:
    """Pairs the mask keeps beyond `base` must form bidirectional squares [s, e]."""
    d = kv_len - q_len
    runs, current = [], None
    step = max(1, ROW_CHUNK_PAIRS // max(1, kv_len))
    for r0 in range(0, q_len, step):
        r1 = min(q_len, r0 + step)
        want = iv.dense((r0, r1))
        base = base_decode(r0, r1)
        if (base & ~want).any():
            return None, "the base keeps pairs the mask drops"
        extra = want & ~base
        for n in range(r1 - r0):
            cols = np.flatnonzero(extra[n])
            a = r0 + n + d
            if len(cols):
                lo, hi = min(a, int(cols.min())), max(a, int(cols.max()))
                if current is None:
                    current = [a, lo, hi]
                else:
                    current[1], current[2] = min(current[1], lo), max(current[2], hi)
            elif current is not None:
                runs.append([current[1], current[2]])
                current = None
    if current is not None:
        runs.append([current[1], current[2]])
    return runs, ""


def fit_vllm_triton(iv: Intervals, q_len: int, kv_len: int) -> tuple[dict | None, str]:
    a = np.arange(q_len) + (kv_len - q_len)
    counts = iv.counts
    if not len(iv.starts):
        return None, "the mask keeps no pair"
    firsts = np.where(counts > 0, iv.starts[np.minimum(iv.indptr[:-1], len(iv.starts) - 1)], 0)
    cands = [dict(attn_type="decoder", sliding_window=None, rswa=None),
             dict(attn_type="encoder_only", sliding_window=None, rswa=None)]
    lower = firsts > 0
    if lower.any():
        w = _mode((a - firsts + 1)[lower])
        if w and w > 0:
            cands.insert(1, dict(attn_type="decoder", sliding_window=int(w), rswa=None))
            cands.append(dict(attn_type="encoder_only", sliding_window=int(w), rswa=None))
    two = counts == 2
    if two.any():
        idx = iv.indptr[:-1][two]
        p = _mode(iv.ends[idx][iv.starts[idx] == 0])
        r = _mode((a[two] - iv.starts[idx + 1] + 1))
        if p and r:
            cands.append(dict(attn_type="decoder", sliding_window=None, rswa=dict(prefix_len=int(p), window=int(r))))
    best = None  # the exact candidate with the fewest ranges
    for cand in cands:
        section = dict(cand, mm_prefix_ranges=None, logits_soft_cap=None, alibi_slopes=None)
        ranges, _ = _vllm_ranges(iv, decode_vllm_triton(section, q_len, kv_len), q_len, kv_len)
        if ranges is None or (best is not None and len(ranges) >= len(best["mm_prefix_ranges"] or [])):
            continue
        section["mm_prefix_ranges"] = ranges or None
        if check_section(decode_vllm_triton(section, q_len, kv_len), iv) is None:
            best = section
    if best is not None:
        return best, ""
    return None, ("no decoder/encoder_only base with sliding_window, rswa and mm_prefix_ranges reproduces the mask "
                  "(pairs beyond the base must form squares [s, e] on the diagonal)")


# ---------------------------------------------------------------- MagiAttention

FULL, CAUSAL, INVCAUSAL, BICAUSAL = 0, 1, 2, 3


def decode_magi(section: dict, q_len: int, kv_len: int) -> Callable[[int, int], np.ndarray]:  # noqa: ARG001 (every decoder takes the lengths)
    """MagiAttention's reading: half-open slices; local a, b and slice lengths Lq_s, Lk_s: FULL
    keeps all; CAUSAL b <= a + Lk_s - Lq_s; INVCAUSAL b >= a; BICAUSAL both."""
    slices = list(zip(section["q_ranges"], section["k_ranges"], section["attn_type_map"]))

    def decode(r0, r1):
        out = np.zeros((r1 - r0, kv_len), dtype=bool)
        for (qs, qe), (ks, ke), kind in slices:
            lo, hi = max(qs, r0), min(qe, r1)
            if lo >= hi:
                continue
            a = np.arange(lo, hi)[:, None] - qs
            b = np.arange(ks, ke)[None, :] - ks
            keep = np.ones((hi - lo, ke - ks), dtype=bool)
            if kind in (CAUSAL, BICAUSAL):
                keep &= b <= a + (ke - ks) - (qe - qs)
            if kind in (INVCAUSAL, BICAUSAL):
                keep &= b >= a
            out[lo - r0:hi - r0, ks:ke] |= keep
        return out
    return decode


def fit_magi(iv: Intervals, q_len: int, kv_len: int) -> tuple[dict | None, str]:
    """Follow each run of keys from row to row; while its start and end each move by 0 or 1 per
    row in a steady way, the rows form one slice (FULL, CAUSAL, INVCAUSAL or BICAUSAL)."""
    q_ranges, k_ranges, types = [], [], []
    open_runs: list[list] = []  # [row0, lo0, hi0, dlo, dhi, last_lo, last_hi]

    def close(run, row_end):
        r0, lo0, hi0, dlo, dhi, last_lo, last_hi = run
        n = row_end - r0
        kind = {(0, 0): FULL, (0, 1): CAUSAL, (1, 0): INVCAUSAL, (1, 1): BICAUSAL}[(dlo or 0, dhi or 0)] if n > 1 else FULL
        if kind in (FULL, INVCAUSAL):
            k_range = [lo0, hi0]
        else:
            k_range = [lo0, last_hi]
        q_ranges.append([r0, row_end])
        k_ranges.append(k_range)
        types.append(kind)

    for row in range(iv.lines):
        line = iv.line(row)
        if len(line) != len(open_runs):
            for run in open_runs:
                close(run, row)
            open_runs = [[row, s, e, None, None, s, e] for s, e in line]
        else:
            for k, (s, e) in enumerate(line):
                run = open_runs[k]
                dlo, dhi = s - run[5], e - run[6]
                ok = dlo in (0, 1) and dhi in (0, 1)
                if ok and run[3] is None:
                    run[3], run[4] = dlo, dhi
                elif not ok or (dlo, dhi) != (run[3], run[4]):
                    close(run, row)
                    open_runs[k] = run = [row, s, e, None, None, s, e]
                    continue
                run[5], run[6] = s, e
        if len(q_ranges) > MAX_SLICES:
            return None, f"needs more than {MAX_SLICES} slices"
    for run in open_runs:
        close(run, iv.lines)
    section = dict(q_ranges=q_ranges, k_ranges=k_ranges, attn_type_map=types)
    why = check_section(decode_magi(section, q_len, kv_len), iv)
    return (section, "") if why is None else (None, f"slice decomposition did not reproduce the mask: {why}")


# ---------------------------------------------------------------- FlashMask

def decode_flashmask(section: dict, q_len: int, kv_len: int, indices: np.ndarray) -> Callable[[int, int], np.ndarray]:  # noqa: ARG001 (the lengths, as every decoder)
    """FlashMask's reading of startend_row_indices [Lk, n] per key column j:
    causal n=1 [LTS]: keep iff j <= i < LTS; causal n=2 [LTS, LTE]: j <= i and not LTS <= i < LTE;
    non-causal n=2 [LTS, UTE]: UTE <= i < LTS; n=4 [LTS, LTE, UTS, UTE]: not in either range."""
    n = indices.shape[1]
    causal = section["causal"]

    def decode(r0, r1):
        i = np.arange(r0, r1)[:, None]
        j = np.arange(kv_len)[None, :]
        col = [indices[:, c][None, :] for c in range(n)]
        if causal and n == 1:
            return (j <= i) & (i < col[0])
        if causal and n == 2:
            return (j <= i) & ~((col[0] <= i) & (i < col[1]))
        if n == 2:
            return (col[1] <= i) & (i < col[0])
        return ~((col[0] <= i) & (i < col[1])) & ~((col[2] <= i) & (i < col[3]))
    return decode


def fit_flashmask(cols: Intervals, iv: Intervals, q_len: int, kv_len: int) -> tuple[dict | None, np.ndarray | None, str]:
    if q_len != kv_len:
        return None, None, "FlashMask needs Lq == Lk"
    counts = cols.counts
    j = np.arange(kv_len)
    lo, hi, empty = cols.single() if (counts <= 1).all() else (None, None, None)
    below = True
    for c in range(kv_len):
        line = cols.line(c)
        if line and line[0][0] < c:
            below = False
            break
    tries = []
    if below and lo is not None:
        # column j keeps rows [j, LTS) (n=1) ...
        starts_ok = np.all(empty | (lo == j))
        if starts_ok:
            lts = np.where(empty, j, hi)
            tries.append((True, lts[:, None]))
    if below:
        # ... or [j, LTS) and [LTE, Lq): masked rows form one gap
        arr = np.zeros((kv_len, 2), dtype=np.int64)
        ok = True
        for c in range(kv_len):
            line = cols.line(c)
            if not line:
                arr[c] = [c, q_len]
            elif len(line) == 1:
                s, e = line[0]
                arr[c] = [c, s] if e == q_len else ([e, q_len] if s == c else [-1, -1])
                if s != c and e != q_len:
                    ok = False
            elif len(line) == 2 and line[0][0] == c and line[1][1] == q_len:
                arr[c] = [line[0][1], line[1][0]]
            else:
                ok = False
            if not ok:
                break
        if ok:
            tries.append((True, arr))
    if lo is not None:
        tries.append((False, np.stack([np.where(empty, 0, hi), np.where(empty, 0, lo)], axis=1)))
    arr4 = np.zeros((kv_len, 4), dtype=np.int64)
    ok = True
    for c in range(kv_len):
        kept = cols.line(c)
        gaps, prev = [], 0
        for s, e in kept:
            if s > prev:
                gaps.append((prev, s))
            prev = e
        if prev < q_len:
            gaps.append((prev, q_len))
        if len(gaps) > 2:
            ok = False
            break
        gaps += [(q_len, q_len)] * (2 - len(gaps))
        (a0, a1), (b0, b1) = gaps
        arr4[c] = [b0, b1, a0, a1]  # second gap as LT, first as UT
    if ok:
        tries.append((False, arr4))
    for causal, arr in tries:
        section = dict(causal=causal)
        if check_section(decode_flashmask(section, q_len, kv_len, arr), iv) is None:
            return section, arr.astype(np.int32), ""
    return None, None, "some key column keeps its query rows in more than the two gaps FlashMask's four bounds can cut"


# ---------------------------------------------------------------- row intervals and blocks

def decode_row_intervals(rows: list, kv_len: int) -> Callable[[int, int], np.ndarray]:
    def decode(r0, r1):
        out = np.zeros((r1 - r0, kv_len), dtype=bool)
        for n in range(r0, r1):
            for s, e in rows[n]:
                if e > s:
                    out[n - r0, s:e] = True
        return out
    return decode


def row_intervals_table(iv: Intervals) -> tuple[int, np.ndarray]:
    """[Lq, k, 2] int32 table of each row's runs, padded with empty [0, 0) runs."""
    k = int(iv.counts.max()) if iv.lines else 0
    table = np.zeros((iv.lines, max(k, 1), 2), dtype=np.int32)
    for n in range(iv.lines):
        for m, (s, e) in enumerate(iv.line(n)):
            table[n, m] = (s, e)
    return k, table


def decode_block_sparse(bsr: dict, q_len: int, kv_len: int, mask_mod_dense: Callable[[int, int], np.ndarray]):
    """A BSR block list reproduces the mask when the mask is evaluated inside listed partial
    blocks, listed full blocks are kept whole and unlisted blocks are dropped."""
    R, C = bsr["R"], bsr["C"]
    indptr, indices, partial = (np.asarray(x) for x in (bsr["indptr"], bsr["indices"], bsr["partial"]))

    def decode(r0, r1):
        out = np.zeros((r1 - r0, kv_len), dtype=bool)
        dense = None
        for br in range(r0 // R, (r1 - 1) // R + 1):
            for n in range(indptr[br], indptr[br + 1]):
                bc = int(indices[n])
                q_lo, q_hi = max(br * R, r0), min((br + 1) * R, r1, q_len)
                k_lo, k_hi = bc * C, min((bc + 1) * C, kv_len)
                if partial[n]:
                    if dense is None:
                        dense = mask_mod_dense(r0, r1)
                    out[q_lo - r0:q_hi - r0, k_lo:k_hi] = dense[q_lo - r0:q_hi - r0, k_lo:k_hi]
                else:
                    out[q_lo - r0:q_hi - r0, k_lo:k_hi] = True
        return out
    return decode


# ---------------------------------------------------------------- score_mod probing

SCORE_ATOL = 1e-4


def _kept_samples(mask: Mask, q_len: int, kv_len: int, heads: int, batch: int, n: int, g: torch.Generator,
                  device) -> tuple[torch.Tensor, ...]:
    """About n random (b, h, q, kv) pairs the mask keeps (all pairs when it has no mask_mod), the
    diagonal's edges among them: a score_mod only matters where the mask keeps a pair."""

    def draw(m):
        b = torch.randint(0, batch, (m,), generator=g, dtype=torch.int32)
        h = torch.randint(0, heads, (m,), generator=g, dtype=torch.int32)
        q = torch.randint(0, q_len, (m,), generator=g, dtype=torch.int32)
        k = torch.randint(0, kv_len, (m,), generator=g, dtype=torch.int32)
        return b, h, q, k

    b, h, q, k = draw(n)
    # edges too: first rows and the diagonal (where windows and causal masks keep pairs)
    edge = min(64, n)
    q[:edge] = torch.arange(edge, dtype=torch.int32) % q_len
    k[:edge] = (q[:edge] + (kv_len - q_len)).clamp(0, kv_len - 1)
    if mask.mask_mod is None:
        return b, h, q, k
    keep_fn = torch.vmap(mask.mask_mod, in_dims=(0, 0, 0, 0))
    picked = [[], [], [], []]
    total = 0
    for _ in range(16):  # sparse masks keep few random pairs: draw again until n are found
        with getitem_as_index(), torch.no_grad():
            keep = keep_fn(*(t.to(device) for t in (b, h, q, k))).bool().cpu()
        for acc, t in zip(picked, (b, h, q, k)):
            acc.append(t[keep])
        total += int(keep.sum())
        if total >= n:
            break
        b, h, q, k = draw(4 * n)
    return tuple(torch.cat(acc)[:n] for acc in picked)


def probe_score(mask: Mask, q_len: int, kv_len: int, heads: int, device="cpu", samples: int = 4096,
                seed: int = 0, batch: int = 1) -> tuple[dict, dict[str, np.ndarray]]:
    """What the score_mod does on the pairs the mask keeps, found numerically and checked on
    random kept pairs over every batch entry and head: none, softcap {cap}, alibi {slopes},
    relative_bias {table by i + D - j}, head_bias {biases}, or opaque {reason}. Returns the
    section and the arrays it references. Pairs the mask drops are never probed (attention-gym's
    alibi, `score + slope * (kv - q)`, is FlashAttention's `-slope * |i - j|` under a causal
    mask). A score that varies by batch entry fails the checks and comes out opaque."""
    if mask.score_mod is None:
        return {"kind": "none"}, {}
    g = torch.Generator().manual_seed(seed)
    b_all, h, qi, kj = _kept_samples(mask, q_len, kv_len, heads, batch, samples, g, device)
    n = len(h)
    if n == 0:
        return {"kind": "none", "note": "the mask keeps no pair, so the score_mod is never applied"}, {}
    s = torch.randn(n, generator=g, dtype=torch.float32) * 4

    def mod(score, hh=h, qq=qi, kk=kj, bb=None):

        fn = torch.vmap(mask.score_mod, in_dims=(0, 0, 0, 0, 0))
        with getitem_as_index(), torch.no_grad():
            bb = torch.zeros(len(score), dtype=torch.int32) if bb is None else bb
            return fn(score.to(device), bb.to(device), hh.to(device), qq.to(device), kk.to(device)).float().cpu()

    try:
        out = mod(s, bb=b_all)
    except Exception as exc:
        return {"kind": "opaque", "reason": f"score_mod failed on probes: {type(exc).__name__}: {exc}"}, {}
    if not torch.isfinite(out).all():
        return {"kind": "opaque", "reason": "the score_mod gives NaN or inf on kept pairs"}, {}
    if torch.allclose(out, s, atol=SCORE_ATOL, rtol=0):
        return {"kind": "none"}, {}
    big = mod(torch.full((n,), 1e4), bb=b_all)
    cap = float(big.median())
    if math.isfinite(cap) and cap > 0 and torch.allclose(out, cap * torch.tanh(s / cap), atol=SCORE_ATOL, rtol=1e-5):
        return {"kind": "softcap", "cap": cap}, {}
    zero = mod(torch.zeros(n), bb=b_all)
    if not torch.allclose(out, s + zero, atol=SCORE_ATOL, rtol=1e-5):
        return {"kind": "opaque", "reason": "the score_mod is neither additive (score + bias) nor a softcap"}, {}
    dist = (qi + (kv_len - q_len) - kj).to(torch.float64)
    hl = h.long()
    # head_bias: a constant per head (read as each head's median over its probes)
    per_head = torch.zeros(heads, dtype=torch.float64)
    for hh in range(heads):
        sel = zero[hl == hh]
        if len(sel):
            per_head[hh] = float(sel.double().median())
    if torch.allclose(zero.double(), per_head[hl], atol=SCORE_ATOL, rtol=1e-5):
        return {"kind": "head_bias", "biases": [float(x) for x in per_head]}, {}
    # alibi: -slope[h] * |i + D - j|, slopes by least squares per head
    slopes = torch.zeros(heads, dtype=torch.float64)
    for hh in range(heads):
        sel = hl == hh
        d = dist[sel].abs()
        if float((d * d).sum()) > 0:
            slopes[hh] = -float((zero[sel].double() * d).sum() / (d * d).sum())
    if torch.allclose(zero.double(), -slopes[hl] * dist.abs(), atol=SCORE_ATOL, rtol=1e-5):
        return {"kind": "alibi", "slopes": [float(x) for x in slopes]}, {}
    # relative_bias: a table indexed by i + D - j (same for every head)
    # d = i + D - j runs over [1 - Lq, Lk - 1]; read each d once, at i = clip(d - D, 0, Lq - 1)
    lo_d, shift = 1 - q_len, kv_len - q_len
    ds = torch.arange(lo_d, kv_len, dtype=torch.int64)
    q_for = (ds - shift).clamp(0, q_len - 1)
    k_for = q_for + shift - ds
    table_full = mod(torch.zeros(len(ds)), hh=torch.zeros(len(ds), dtype=torch.int32),
                     qq=q_for.to(torch.int32), kk=k_for.to(torch.int32))
    # distances the mask never keeps may read as anything: they are never used
    table_full = torch.where(torch.isfinite(table_full), table_full, torch.zeros_like(table_full))
    predicted = table_full[(dist - lo_d).long()]
    if torch.allclose(zero, predicted, atol=SCORE_ATOL, rtol=1e-5):
        return ({"kind": "relative_bias", "offset": int(-lo_d), "table": {"$tensor": "relative_bias_table"},
                 "index": "table[i + D - j + offset]"}, {"relative_bias_table": table_full.numpy()})
    return {"kind": "opaque", "reason": "an additive bias that depends on (h, i, j) in no form listed "
            "(head_bias, alibi, relative_bias)"}, {}
