"""The port's serving entry point, appended to forward.py by `port.generate`: one launch for a whole
engine step (prefill chunks and decodes) over a paged KV cache, in vLLM's layouts. Markers:
@@MASK_PTR_PARAMS@@ / @@MASK_PTR_ARGS@@ / @@SCORE_PTR_ARGS@@ / @@ALL_PTR_PARAMS@@ / @@ALL_PTR_ARGS@@
(the mods' table pointers), @@RANGE_PTR_PARAMS@@ / @@RANGE_PTR_ARGS@@ (each table's (sorted, min,
max), which mask_mod_bounds reads), @@HAS_BOUNDS@@."""

import torch
import triton
import triton.language as tl

# ---------------------------------------------------------------- serving: a paged KV cache

HAS_BOUNDS = @@HAS_BOUNDS@@  # mask_mod_bounds exists: tiles the mask decides are skipped or run unmasked
# a number that follows the sequence's length even when Lq = Lk (a prefix of Lk // 4) differs by
# request in a paged step: such masks take their values per request (tables=) or attention()
HAS_LENGTH_RULES_IN_PAGES = any(a + b != 0 for a, b, c, d in LENGTH_RULES.values())
# (queries per request at least, (BLOCK_M, BLOCK_N, num_warps, num_stages)) of fast mode: a
# program's rows are (token, head) pairs of one kv head's group (GQA packing); BLOCK_N keys per
# tile, each read through the block table. These were checked against the reference on an H200
# and chosen there by benchmarks/bench_paged.py --sweep (docs/benchmarks.md), the decode tile's
# depth and register budget (below) on H100s by --tiles; a depth the chip has no room for falls
# back to fewer stages (_launch_paged)
PAGED_TILES = ([(0, (16, 16, 4, 1))] if _INTERPRET else
               [(128, (128, 128, 8, 3)), (32, (64, 64, 4, 3)), (0, (16, 64, 4, 2))])
# a register budget per thread for a fast-mode tile (ptxas's .maxnreg), so that more programs share
# an SM: {(BLOCK_M, BLOCK_N, num_warps, num_stages): registers}. The decode tile compiles to 253
# registers a thread for sm_90a without one (two programs an SM, by registers), and to 168 with no
# spills under it: three programs an SM, each with one tile of keys and values loading ahead of
# the one it works on (40 KB of shared memory). On H100s that took 0.5-2 % off the decode kernels
# at page 16 against 16 x 64 with 3 stages, two programs an SM (within 0.6 % either way at page
# 128): docs/benchmarks.md, "the last 2 %"
PAGED_MAXNREG: dict = {(16, 64, 4, 2): 168}
PAGED_PIPELINE = True  # the key loop as a `for` loop with predicated loads (pipelined); False: `while`
# before the scan that narrows a piece to the tiles the mask's bounds may keep, one bounds test of
# the whole piece (a piece kept whole, as a causal decode's, or not at all, skips the scan)
PAGED_WHOLE_PIECE_TEST = True
PAGED_STAGES = None  # a pipeline depth for every tile (None: each tile's own)
INVARIANT_PAGED_STAGES = 3  # invariant mode's pipeline depth (stages never change a bit)
# fast mode's pieces (None: SPLIT_KEYS, invariant mode's); the interpreter's tests use longer ones
FAST_SPLIT_KEYS = 128 if _INTERPRET else None
FOLD_AT_ONCE = 64  # fast mode's _paged_fold sums up to this many pieces of a row in one tile
# fast mode's split-KV cut. Pieces of FAST_SPLIT_KEYS keys at fixed positions (invariant mode's cut
# in any case), except where those leave part of the GPU idle: when a step's programs of fixed
# pieces are fewer than the GPU's program slots (SMs x programs an SM holds), PAGED_BALANCE cuts
# each request's key tiles into near-equal runs, as many as fill one wave of slots, each at least
# PAGED_MIN_PIECE_KEYS keys (a short request in a wide block table takes fewer). On an H200 (bf16,
# 8 kv heads, D 128, the decode kernels' GPU time): one request against 131,072 keys, 33 even
# pieces against 32 fixed ones, 126.2-126.6 us against 128.1 at page 128 (SDPA's cuDNN kernel
# 126.7) and 128.7-129.5 against 129.9-130.2 at page 16; 8 requests against 32,768 keys (512 fixed
# programs, two waves) keep the fixed cut, which ran 1.02-1.03x SDPA there against 1.05-1.09x for
# 33 even pieces (benchmarks/bench_paged.py --pieces). PAGED_PIECES: that many even pieces per
# request (a whole number >= 1), whatever the GPU (for benchmarks and tests)
PAGED_BALANCE = True
PAGED_MIN_PIECE_KEYS = 48 if _INTERPRET else 512
PAGED_PIECES = None
# (under the interpreter every call has few programs: there only a forced split runs split-KV)
SPLIT_WHEN_PROGRAMS_BELOW = 0 if _INTERPRET else 512  # only calls with fewer (row block, kv head) programs than this split
# Programmatic dependent launch (sm_90 on): the fold of split-KV pieces (_paged_fold) is launched
# so that the GPU may start it while the last programs of _paged_kernel finish; its programs find
# their request (reading only cu_seqlens_q and seq_lens) and then wait (griddepcontrol.wait) until
# every program of _paged_kernel has finished and its partial sums are visible, so the bits are the
# same either way. PORT_PAGED_PDL=0 in the environment (or PAGED_PDL = False here) launches the
# fold after the kernel has finished, as on older GPUs and Triton builds without it.
PAGED_PDL = os.environ.get("PORT_PAGED_PDL", "1") != "0"
try:  # Triton's grid dependency control (griddepcontrol.wait / launch_dependents) and its launch option
    from triton.backends.nvidia.compiler import CUDAOptions as _CUDAOptions
    from triton.language.extra.cuda import gdc_launch_dependents as _gdc_launch_dependents
    from triton.language.extra.cuda import gdc_wait as _gdc_wait
    if "launch_pdl" not in getattr(_CUDAOptions, "__dataclass_fields__", {}):
        raise ImportError("no launch_pdl option")
except ImportError:
    _gdc_launch_dependents = _gdc_wait = None


def _paged_pdl(device) -> bool:
    """Whether the fold may be launched as a programmatic dependent of the kernel here: on an sm_90
    or newer GPU, with a Triton that has grid dependency control, unless PAGED_PDL is off."""
    return (PAGED_PDL and not _INTERPRET and _gdc_wait is not None and device.type == "cuda"
            and _capability(device)[0] >= 9)


def _table_ranges(tables: list) -> list:
    """Per table, int64 (sorted, min, max): what mask_mod_bounds reads to bound a table read at a
    varying index (1 = the entries never decrease). On the tables' device, without a sync."""
    out = []
    for t in tables:
        flat = t.reshape(-1)
        if flat.numel() == 0 or flat.is_floating_point() or flat.is_complex():
            out.append(torch.zeros(3, dtype=torch.int64, device=t.device))
            continue
        flat = flat.to(torch.int64)
        rising = (flat[1:] >= flat[:-1]).all() if flat.numel() > 1 else torch.ones((), dtype=torch.bool, device=t.device)
        out.append(torch.stack([rising.to(torch.int64), flat.min(), flat.max()]).contiguous())
    return out


_ranges_of: dict = {}  # device -> (the file's own mask tables, their _table_ranges)


def _mask_ranges(captured: dict, device, replaced: bool) -> list:
    """_table_ranges of the mask's tables. The file's own tables never change: their ranges are
    computed once per device. Tables a call passes (tables=) are ranged in that call, on the device,
    so a CUDA graph that captured the call ranges each replay's new contents."""
    mine = [captured[n] for n in MASK_POINTERS]
    if replaced:
        return _table_ranges(mine)
    saved = _ranges_of.get(str(device))
    if saved is None or len(saved[0]) != len(mine) or any(a is not b for a, b in zip(saved[0], mine)):
        saved = _ranges_of[str(device)] = (mine, _table_ranges(mine))
    return saved[1]


@triton.jit
def _tile_bounds(req, kv_h, group, q_lo, q_hi, kv_lo, kv_hi, @@MASK_PTR_PARAMS@@ @@RANGE_PTR_PARAMS@@
                 HEADS_DIFFER: tl.constexpr):
    # what the mask gives over rows q_lo..q_hi x keys kv_lo..kv_hi, for every query head of kv
    # head kv_h's group (one call when the mask does not read h): (all kept, any kept)
    all_kept, any_kept = mask_mod_bounds(req, kv_h * group, q_lo, q_hi, kv_lo, kv_hi@@MASK_PTR_ARGS@@@@RANGE_PTR_ARGS@@)
    if HEADS_DIFFER:
        g = kv_h * 0 + 1
        while g < group:
            all_g, any_g = mask_mod_bounds(req, kv_h * group + g, q_lo, q_hi, kv_lo, kv_hi@@MASK_PTR_ARGS@@@@RANGE_PTR_ARGS@@)
            all_kept = all_kept & all_g
            any_kept = any_kept | any_g
            g += 1
    return all_kept != 0, any_kept != 0


@triton.jit
def _paged_tile(acc, l_i, m_i, page_bad, pages, start, q, req, kv_h, group, q_lo, q_hi, q_pos, h, L, num_pages,
                K_cache, V_cache, s_kp, s_ks, s_kh, s_kd, s_vp, s_vs, s_vh, s_vd, offs_d, d_ok,
                sm_scale, qk_scale, @@ALL_PTR_PARAMS@@ @@RANGE_PTR_PARAMS@@
                HAS_SCORE: tl.constexpr, HAS_MASK: tl.constexpr, BOUNDS: tl.constexpr, HEADS_DIFFER: tl.constexpr,
                IEEE: tl.constexpr, WIDEN: tl.constexpr, SKIP: tl.constexpr, TAIL: tl.constexpr, EVEN_D: tl.constexpr,
                PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    # one tile of BLOCK_N keys from `start`, read through the block table (`pages`: the tile's page,
    # or each key's, from _tile_pages), into the online softmax. A tile the mask's bounds say keeps
    # nothing is skipped (SKIP: a branch around it; else its loads are predicated off and its scores
    # are -inf, which leaves (acc, l, m) as they are, bit for bit, and keeps the loads outside any
    # branch so Triton can pipeline them); one they say keeps everything runs without the mask.
    # TAIL: the request's last tile, whose keys may run past its end (only it checks keys against L)
    visit = start >= 0
    if HAS_MASK:  # (a tensor either way)
        masked = start >= 0
    else:
        masked = start < 0
    if BOUNDS:
        all_kept, any_kept = _tile_bounds(req, kv_h, group, q_lo, q_hi, start, tl.minimum(start + BLOCK_N, L) - 1,
                                          @@MASK_PTR_PARAMS@@@@RANGE_PTR_PARAMS@@HEADS_DIFFER=HEADS_DIFFER)
        visit = any_kept
        masked = all_kept.to(tl.int32) == 0
    if SKIP:
        if visit:
            acc, l_i, m_i, page_bad = _paged_tile_body(
                acc, l_i, m_i, page_bad, pages, visit, masked, start, q, req, q_pos, h, L, num_pages, K_cache, V_cache,
                s_kp, s_ks, s_kh, s_kd, s_vp, s_vs, s_vh, s_vd, kv_h, offs_d, d_ok, sm_scale, qk_scale,
                @@ALL_PTR_PARAMS@@HAS_SCORE=HAS_SCORE, HAS_MASK=HAS_MASK, IEEE=IEEE, WIDEN=WIDEN, TAIL=TAIL,
                EVEN_D=EVEN_D, PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N)
    else:
        acc, l_i, m_i, page_bad = _paged_tile_body(
            acc, l_i, m_i, page_bad, pages, visit, masked, start, q, req, q_pos, h, L, num_pages, K_cache, V_cache,
            s_kp, s_ks, s_kh, s_kd, s_vp, s_vs, s_vh, s_vd, kv_h, offs_d, d_ok, sm_scale, qk_scale,
            @@ALL_PTR_PARAMS@@HAS_SCORE=HAS_SCORE, HAS_MASK=HAS_MASK, IEEE=IEEE, WIDEN=WIDEN, TAIL=TAIL,
            EVEN_D=EVEN_D, PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N)
    return acc, l_i, m_i, page_bad


@triton.jit
def _tile_pages(start, stop, req, block_table, s_bt, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    # the physical page of the tile of BLOCK_N keys from `start` (tiles start at multiples of
    # BLOCK_N): one number when a page holds whole tiles, else each key's (those from `stop` on
    # read nothing: 0). The key loop loads the next tile's pages while it works on this one, so the
    # key and value loads, whose addresses need them, issue at once
    row = block_table + req.to(tl.int64) * s_bt
    if PAGE_SIZE % BLOCK_N == 0:
        return tl.load(row + tl.maximum(start, 0) // PAGE_SIZE, mask=start < stop, other=0)
    elif BLOCK_N % PAGE_SIZE == 0:
        # a tile of whole pages: its BLOCK_N // PAGE_SIZE page numbers, each repeated for its keys
        # (one load per page, not per key: 610 -> 445 instructions per 64-key decode tile at page 16,
        # and no spills in the 128 x 128 prefill tile, compiled for sm_90a). A page whose first key
        # is past `stop` reads nothing (0), as its keys would
        firsts = start + tl.arange(0, BLOCK_N // PAGE_SIZE) * PAGE_SIZE
        few = tl.load(row + tl.maximum(firsts, 0) // PAGE_SIZE, mask=firsts < stop, other=0)
        return tl.reshape(tl.broadcast_to(few[:, None], (BLOCK_N // PAGE_SIZE, PAGE_SIZE)), (BLOCK_N,))
    else:
        keys = start + tl.arange(0, BLOCK_N)
        return tl.load(row + tl.maximum(keys, 0) // PAGE_SIZE, mask=keys < stop, other=0)


@triton.jit
def _paged_tile_body(acc, l_i, m_i, page_bad, pages, visit, masked, start, q, req, q_pos, h, L, num_pages, K_cache,
                     V_cache, s_kp, s_ks, s_kh, s_kd, s_vp, s_vs, s_vh, s_vd, kv_h, offs_d, d_ok, sm_scale, qk_scale,
                     @@ALL_PTR_PARAMS@@
                     HAS_SCORE: tl.constexpr, HAS_MASK: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr,
                     TAIL: tl.constexpr, EVEN_D: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    keys = start + offs_n
    if TAIL:  # keys past the end read the last one again (a valid page), then are dropped
        keys_in = tl.minimum(keys, L - 1)
    else:
        keys_in = keys
    # pages outside the cache are read as page 0 and make the rows NaN (page_bad, reduced once
    # after the loop); pages of tiles the bounds skip are never read, and never judged
    page_ok = (pages >= 0) & (pages < num_pages)
    page_bad = page_bad | ((page_ok == 0) & visit).to(tl.int32)
    page = tl.where(page_ok, pages, 0).to(tl.int64)
    # each key's address, as (a part that changes with the tile) + (one that does not: computed once,
    # before the key loop). A page that holds whole tiles: one page per tile, its keys in a row;
    # tiles that hold whole pages: each key's page, its slot fixed by its place in the tile. Keys
    # load as k [D, BLOCK_N] (the dot's operand as it is), values as v [BLOCK_N, D]
    if PAGE_SIZE % BLOCK_N == 0:
        k_tile = page * s_kp + (start % PAGE_SIZE) * s_ks
        v_tile = page * s_vp + (start % PAGE_SIZE) * s_vs
        k_fixed = offs_n[None, :] * s_ks + kv_h * s_kh + offs_d[:, None] * s_kd
        v_fixed = offs_n[:, None] * s_vs + kv_h * s_vh + offs_d[None, :] * s_vd
    elif BLOCK_N % PAGE_SIZE == 0:
        k_tile = (page * s_kp)[None, :]
        v_tile = (page * s_vp)[:, None]
        k_fixed = (offs_n % PAGE_SIZE)[None, :] * s_ks + kv_h * s_kh + offs_d[:, None] * s_kd
        v_fixed = (offs_n % PAGE_SIZE)[:, None] * s_vs + kv_h * s_vh + offs_d[None, :] * s_vd
    else:
        k_tile = (page * s_kp + (keys_in % PAGE_SIZE) * s_ks)[None, :]
        v_tile = (page * s_vp + (keys_in % PAGE_SIZE) * s_vs)[:, None]
        k_fixed = kv_h * s_kh + offs_d[:, None] * s_kd
        v_fixed = kv_h * s_vh + offs_d[None, :] * s_vd
    # the loads' predicate: the tile is visited (a scalar), its keys inside the request (TAIL) and
    # the head dim inside D (unless D fills D_PAD)
    load_ok = visit
    if TAIL:
        load_ok = (keys < L) & visit
    if EVEN_D:
        k_ok = load_ok
        v_ok = load_ok
        if TAIL:
            k_ok = load_ok[None, :]
            v_ok = load_ok[:, None]
    else:
        k_ok = d_ok[:, None] & load_ok
        v_ok = d_ok[None, :] & load_ok
        if TAIL:
            k_ok = d_ok[:, None] & load_ok[None, :]
            v_ok = d_ok[None, :] & load_ok[:, None]
    k = tl.load(K_cache + k_tile + k_fixed, mask=k_ok, other=0.0)
    v = tl.load(V_cache + v_tile + v_fixed, mask=v_ok, other=0.0)
    qk = _qk_dot(q, k, IEEE=IEEE, WIDEN=WIDEN)  # (forward.py's)
    q_idx = q_pos[:, None]
    kv_idx = keys_in[None, :]
    h_idx = h[:, None]
    if HAS_SCORE:
        s = score_mod_triton(qk * sm_scale, req, h_idx, q_idx, kv_idx@@SCORE_PTR_ARGS@@) * 1.4426950408889634
    else:
        s = qk * qk_scale
    # only tiles that need it pay for the mask and the select: those the bounds leave partial, the
    # request's last (keys past its end) and the skipped ones (SKIP off: every score -inf)
    if TAIL:
        s = _kept_scores(s, req, h_idx, q_idx, kv_idx, keys, L, visit, masked, @@MASK_PTR_PARAMS@@HAS_MASK=HAS_MASK,
                         TAIL=True)
    elif masked | (visit == 0):
        s = _kept_scores(s, req, h_idx, q_idx, kv_idx, keys, L, visit, masked, @@MASK_PTR_PARAMS@@HAS_MASK=HAS_MASK,
                         TAIL=False)
    acc, l_i, m_i = _online_softmax_step(acc, l_i, m_i, s, v, IEEE=IEEE, WIDEN=WIDEN)  # (forward.py's)
    return acc, l_i, m_i, page_bad


@triton.jit
def _kept_scores(s, req, h_idx, q_idx, kv_idx, keys, L, visit, masked, @@MASK_PTR_PARAMS@@
                 HAS_MASK: tl.constexpr, TAIL: tl.constexpr):
    # s with the pairs the tile drops at -inf: all of a tile not visited, keys past the request's
    # end (TAIL), and the pairs the mask_mod drops (in tiles the bounds leave partial)
    keep = (q_idx >= 0) & visit & (kv_idx >= 0)  # (a full tile's shape)
    if TAIL:
        keep = keep & (keys < L)[None, :]
    if HAS_MASK:
        if masked:
            keep = keep & (mask_mod_triton(req, h_idx, q_idx, kv_idx@@MASK_PTR_ARGS@@) != 0)
    return tl.where(keep, s, float("-inf"))


# the step's counts change every step: compiled once for any value (no specialization on 1 or on
# multiples of 16), so an engine's steps do not compile new variants of the kernel
@triton.jit(do_not_specialize=["num_seqs", "total_q", "valid_q_len", "valid_kv_len", "num_pages", "max_keys"])
def _paged_kernel(Q, K_cache, V_cache, Out, Lse, Part_acc, Part_ml, block_table, cu_seqlens_q, seq_lens,
                  s_qt, s_qh, s_qd, s_kp, s_ks, s_kh, s_kd, s_vp, s_vs, s_vh, s_vd, s_bt,
                  num_seqs, Hq, group, tokens, D, sm_scale, total_q, split_keys, valid_q_len, valid_kv_len,
                  num_pages, max_keys, @@ALL_PTR_PARAMS@@
                  @@RANGE_PTR_PARAMS@@
                  D_PAD: tl.constexpr, HAS_SCORE: tl.constexpr, HAS_MASK: tl.constexpr, BOUNDS: tl.constexpr,
                  IEEE: tl.constexpr, WIDEN: tl.constexpr, RETURN_LSE: tl.constexpr, INTERPRET: tl.constexpr,
                  SPLIT: tl.constexpr, INVARIANT: tl.constexpr, PIPELINE: tl.constexpr, HEADS_DIFFER: tl.constexpr,
                  WHOLE_PIECE_TEST: tl.constexpr, BALANCED: tl.constexpr,
                  EVEN_D: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  PDL: tl.constexpr = False):
    # one program = `tokens` query tokens of one request times the `group` query heads that share
    # kv head kv_h (grouped-query attention: row r is token r // group, head kv_h * group + r % group,
    # so each K/V tile is read once for the whole group), over one piece of the request's keys
    # (SPLIT: keys [split * split_keys, (split + 1) * split_keys), else all of them). The grid's
    # first axis is an upper bound on the step's row blocks (from shapes only: a CUDA graph can
    # replay it); programs past the last block return at once. BALANCED (fast mode's split): piece
    # `split` of the request's tiles cut evenly (see 3.), not keys at fixed positions.
    pid = tl.program_id(0)
    kv_h = tl.program_id(1)
    split = tl.program_id(2)
    # 1. which request: request r owns the program slots from cu_seqlens_q[r] // tokens + r on (at
    # least as many as its row blocks, whatever its queries' alignment; a slot past them returns),
    # so the owner of slot pid is the last r whose first slot is <= pid: a binary search over
    # cu_seqlens_q itself, with nothing computed on the host or in another launch
    lo = pid * 0
    hi = lo + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        here = tl.load(cu_seqlens_q + mid) // tokens + mid <= pid
        lo = tl.where(here, mid, lo)
        hi = tl.where(here, hi, mid)
    req = lo
    q_start = tl.load(cu_seqlens_q + req)
    n_q = tl.load(cu_seqlens_q + req + 1) - q_start
    L = tl.load(seq_lens + req)
    # a mask whose tables are sized for fixed lengths is defined only for positions inside them: a
    # request past them reads nothing and gets NaN rows (check=True refuses it with the reason)
    inside = (L <= valid_kv_len) & (L - 1 < valid_q_len)
    # so do requests whose contents are inconsistent (check=True names them): queries past q's end,
    # more queries than the request's length, pages outside the cache
    inside = inside & (n_q >= 0) & (q_start >= 0) & (q_start + n_q <= total_q) & (n_q <= L) & (L <= max_keys)
    # 2. this program's rows: the request's queries are its last n_q tokens (positions L - n_q ..)
    first = (pid - (q_start // tokens + req)) * tokens
    if (first >= n_q) | (first < 0):  # a spare slot of the request
        return
    slot_r = tl.arange(0, BLOCK_M)
    rows = first + slot_r // group  # each row's token in the request
    h = kv_h * group + slot_r % group  # each row's query head
    row_ok = (rows < n_q) & (slot_r < tokens * group)
    rows_in = tl.maximum(tl.minimum(rows, n_q - 1), 0)  # rows past the end repeat the last one, never stored
    q_row = q_start + rows_in
    row_ok = row_ok & (q_row >= 0) & (q_row < total_q)
    q_row = tl.minimum(tl.maximum(q_row, 0), total_q - 1).to(tl.int64)
    q_pos = L - n_q + rows_in
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    q = tl.load(Q + q_row[:, None] * s_qt + h[:, None] * s_qh + offs_d[None, :] * s_qd,
                mask=d_ok[None, :], other=0.0)
    qk_scale = sm_scale * 1.4426950408889634  # log2(e): the softmax runs in base 2
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    q_lo = L - n_q + first
    q_hi = L - n_q + tl.minimum(first + tokens, n_q) - 1
    # 3. the request's keys in tiles of BLOCK_N, in ascending order, each read through the block
    # table. SPLIT: this program's piece of split_keys keys (folded by _paged_fold); else all of
    # them, and in invariant mode each piece is folded into the total as the next begins, with the
    # same _fold_piece as _paged_fold and the contiguous kernel (so splitting never changes a bit)
    if SPLIT and BALANCED:
        # fast mode: the request's key tiles cut into n_pieces runs whose lengths differ by at
        # most one tile (piece i: tiles [i T / n, (i + 1) T / n)), n_pieces = the grid's pieces, or
        # fewer for a request shorter than that many pieces of split_keys keys (_paged_fold counts
        # them the same way); the host chose the grid's pieces so that the programs fill the GPU's
        # program slots evenly (_fast_pieces)
        n_pieces = tl.minimum((L + split_keys - 1) // split_keys, tl.num_programs(2))
        if split >= n_pieces:
            return
        n_tiles = (L + BLOCK_N - 1) // BLOCK_N
        start = (split * n_tiles // n_pieces) * BLOCK_N
        stop = tl.minimum(L, ((split + 1) * n_tiles // n_pieces) * BLOCK_N)
    elif SPLIT:
        start = split * split_keys
        stop = tl.minimum(L, start + split_keys)
    else:
        start = L * 0
        stop = L
    stop = tl.where(inside, stop, start)
    t_acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    t_l = tl.zeros([BLOCK_M], tl.float32)
    t_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    piece = start // split_keys
    page_bad = tl.zeros([BLOCK_N], tl.int32)  # keys whose page number is outside the cache
    if BOUNDS:
        # narrow [start, stop) to the tiles the mask's bounds may keep (a window's, a causal row's),
        # a scalar pass over the tiles without loads; the tiles between may still be skipped below
        # (one test of the whole piece first: a piece it keeps whole, as a causal decode's are, or
        # keeps none of, needs no scan)
        first = stop
        last = start
        t = start
        if WHOLE_PIECE_TEST:
            all_p, any_p = _tile_bounds(req, kv_h, group, q_lo, q_hi, start, tl.minimum(stop, L) - 1,
                                        @@MASK_PTR_PARAMS@@@@RANGE_PTR_PARAMS@@HEADS_DIFFER=HEADS_DIFFER)
            first = tl.where(all_p & (start < stop), start, first)
            last = tl.where(all_p, stop, last)
            t = tl.where(all_p | ~any_p, stop, start)
        while t < stop:
            any_t = _tile_bounds(req, kv_h, group, q_lo, q_hi, t, tl.minimum(t + BLOCK_N, L) - 1,
                                 @@MASK_PTR_PARAMS@@@@RANGE_PTR_PARAMS@@HEADS_DIFFER=HEADS_DIFFER)[1]
            first = tl.where(any_t & (t < first), t, first)
            last = tl.where(any_t, t + BLOCK_N, last)
            t += BLOCK_N
        start = first
        stop = tl.maximum(last, first)
    # tiles wholly before the request's end need no key checks: the loop runs them; the request's
    # last tile, when its keys run past the end, runs after the loop with the checks (TAIL)
    full_end = L - L % BLOCK_N
    stop_even = tl.minimum(stop, full_end)
    has_tail = (stop > full_end) & (full_end >= start)
    fold = INVARIANT and not SPLIT
    # (the block table is read up to the request's length: the pages of keys up to L, never past)
    pages_end = tl.minimum(stop, L)
    pages = _tile_pages(start, pages_end, req, block_table, s_bt, PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N)
    if PIPELINE:  # a `for` loop (Triton pipelines its loads); the interpreter runs the `while` below
        for kv_start in range(start, stop_even, BLOCK_N):
            pages_next = _tile_pages(kv_start + BLOCK_N, pages_end, req, block_table, s_bt, PAGE_SIZE=PAGE_SIZE,
                                     BLOCK_N=BLOCK_N)
            acc, l_i, m_i, t_acc, t_l, t_m, piece = _next_piece(acc, l_i, m_i, t_acc, t_l, t_m, piece, kv_start,
                                                                split_keys, INVARIANT=fold)
            acc, l_i, m_i, page_bad = _paged_tile(
                acc, l_i, m_i, page_bad, pages, kv_start, q, req, kv_h, group, q_lo, q_hi, q_pos, h, L, num_pages,
                K_cache, V_cache, s_kp, s_ks, s_kh, s_kd, s_vp, s_vs, s_vh, s_vd, offs_d, d_ok, sm_scale, qk_scale,
                @@ALL_PTR_PARAMS@@@@RANGE_PTR_PARAMS@@HAS_SCORE=HAS_SCORE, HAS_MASK=HAS_MASK, BOUNDS=BOUNDS,
                HEADS_DIFFER=HEADS_DIFFER, IEEE=IEEE, WIDEN=WIDEN, SKIP=False, TAIL=False, EVEN_D=EVEN_D,
                PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N)
            pages = pages_next
    else:
        kv_start = start
        while kv_start < stop_even:
            pages = _tile_pages(kv_start, pages_end, req, block_table, s_bt, PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N)
            acc, l_i, m_i, t_acc, t_l, t_m, piece = _next_piece(acc, l_i, m_i, t_acc, t_l, t_m, piece, kv_start,
                                                                split_keys, INVARIANT=fold)
            acc, l_i, m_i, page_bad = _paged_tile(
                acc, l_i, m_i, page_bad, pages, kv_start, q, req, kv_h, group, q_lo, q_hi, q_pos, h, L, num_pages,
                K_cache, V_cache, s_kp, s_ks, s_kh, s_kd, s_vp, s_vs, s_vh, s_vd, offs_d, d_ok, sm_scale, qk_scale,
                @@ALL_PTR_PARAMS@@@@RANGE_PTR_PARAMS@@HAS_SCORE=HAS_SCORE, HAS_MASK=HAS_MASK, BOUNDS=BOUNDS,
                HEADS_DIFFER=HEADS_DIFFER, IEEE=IEEE, WIDEN=WIDEN, SKIP=True, TAIL=False, EVEN_D=EVEN_D,
                PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N)
            kv_start += BLOCK_N
        pages = _tile_pages(full_end, pages_end, req, block_table, s_bt, PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N)
    if has_tail:  # (the loop left `pages` at this tile's)
        acc, l_i, m_i, t_acc, t_l, t_m, piece = _next_piece(acc, l_i, m_i, t_acc, t_l, t_m, piece, full_end,
                                                            split_keys, INVARIANT=fold)
        acc, l_i, m_i, page_bad = _paged_tile(
            acc, l_i, m_i, page_bad, pages, full_end, q, req, kv_h, group, q_lo, q_hi, q_pos, h, L, num_pages,
            K_cache, V_cache, s_kp, s_ks, s_kh, s_kd, s_vp, s_vs, s_vh, s_vd, offs_d, d_ok, sm_scale, qk_scale,
            @@ALL_PTR_PARAMS@@@@RANGE_PTR_PARAMS@@HAS_SCORE=HAS_SCORE, HAS_MASK=HAS_MASK, BOUNDS=BOUNDS,
            HEADS_DIFFER=HEADS_DIFFER, IEEE=IEEE, WIDEN=WIDEN, SKIP=True, TAIL=True, EVEN_D=EVEN_D,
            PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N)
    if INVARIANT and not SPLIT:
        acc, l_i, m_i = _fold_piece(t_acc, t_l, t_m, acc, l_i, m_i)
    inside = inside & (tl.max(page_bad, 0) == 0)
    out_rows = q_row
    acc = tl.where(inside, acc, float("nan"))
    if SPLIT:  # this piece's (acc, m, l), folded by _paged_fold
        if PDL:  # (the fold may be scheduled once every program is here; it waits for their stores)
            _gdc_launch_dependents()
        at = (split * total_q + out_rows) * Hq + h
        tl.store(Part_acc + at[:, None] * D + offs_d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(Part_ml + at * 2, m_i, mask=row_ok)
        tl.store(Part_ml + at * 2 + 1, l_i, mask=row_ok)
        return
    # 4. rows that kept nothing: out 0 and lse -inf
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(Out + out_rows[:, None] * (Hq * D) + h[:, None] * D + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])
    if RETURN_LSE:
        lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
        lse = tl.where(inside, lse, float("nan"))
        tl.store(Lse + out_rows * Hq + h, lse, mask=row_ok)


@triton.jit(do_not_specialize=["num_seqs", "total_q", "num_splits"])
def _paged_fold(Out, Lse, Part_acc, Part_ml, seq_lens, cu_seqlens_q, num_seqs, total_q, Hq, D, num_splits, split_keys,
                D_PAD: tl.constexpr, RETURN_LSE: tl.constexpr, INTERPRET: tl.constexpr, ORDERED: tl.constexpr,
                PIECES: tl.constexpr, PDL: tl.constexpr = False):
    # one program = one (query token, head): the pieces of its keys folded with the online
    # softmax's rescaling (base 2): m = max m_s, l = sum l_s 2^(m_s - m), out = sum acc_s 2^(m_s - m)
    # / l. ORDERED (invariant mode): one piece after another from the first, with _fold_piece, the
    # arithmetic the kernels use where pieces meet in registers; else (fast mode) all PIECES at once,
    # a tree of sums: no chain of dependent loads. Pieces past the request's keys were never
    # written: skipped (the kernel counts a request's pieces with the same formula, in both of
    # fast mode's cuts).
    t = tl.program_id(0)
    h = tl.program_id(1)
    lo = t * 0
    hi = lo + num_seqs
    while hi - lo > 1:  # the token's request: the last r with cu_seqlens_q[r] <= t
        mid = (lo + hi) // 2
        here = tl.load(cu_seqlens_q + mid) <= t
        lo = tl.where(here, mid, lo)
        hi = tl.where(here, hi, mid)
    # (a seq_len past the block table, whose rows are NaN, still folds only the pieces there are)
    pieces = tl.minimum((tl.load(seq_lens + lo) + split_keys - 1) // split_keys, num_splits)
    if PDL:  # (launched as a dependent of _paged_kernel: its partial sums are complete from here on)
        _gdc_wait()
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    m = tl.full([1], float("-inf"), tl.float32)
    l_sum = tl.zeros([1], tl.float32)
    acc = tl.zeros([1, D_PAD], tl.float32)
    one = tl.zeros([1], tl.int32)
    if not ORDERED:
        s_i = tl.arange(0, PIECES)
        s_ok = s_i < pieces
        at = (s_i * total_q + t) * Hq + h
        m_s = tl.load(Part_ml + at * 2, mask=s_ok, other=float("-inf"))
        l_s = tl.load(Part_ml + at * 2 + 1, mask=s_ok, other=0.0)
        a_s = tl.load(Part_acc + at[:, None] * D + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        m = tl.zeros([1], tl.float32) + tl.max(m_s, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        w = tl.math.exp2(m_s[:, None] - m_safe[None, :])  # [PIECES, 1]: 0 for empty pieces
        l_sum = tl.sum(l_s[:, None] * w, 0)
        acc = tl.sum(a_s * w, 0)[None, :]
    elif INTERPRET:
        s = pieces * 0
        while s < pieces:
            at = (s * total_q + t) * Hq + h
            m_s = tl.load(Part_ml + at * 2 + one)
            l_s = tl.load(Part_ml + at * 2 + 1 + one)
            a_s = tl.load(Part_acc + at * D + offs_d[None, :], mask=d_ok[None, :], other=0.0)
            acc, l_sum, m = _fold_piece(acc, l_sum, m, a_s, l_s, m_s)  # (forward.py's)
            s += 1
    else:  # the same steps in a `for` loop, whose loads Triton issues ahead of the folds
        for s in range(0, pieces):
            at = (s * total_q + t) * Hq + h
            m_s = tl.load(Part_ml + at * 2 + one)
            l_s = tl.load(Part_ml + at * 2 + 1 + one)
            a_s = tl.load(Part_acc + at * D + offs_d[None, :], mask=d_ok[None, :], other=0.0)
            acc, l_sum, m = _fold_piece(acc, l_sum, m, a_s, l_s, m_s)
    l_safe = tl.where(l_sum == 0.0, 1.0, l_sum)
    out = acc / l_safe[:, None]
    tl.store(Out + (t.to(tl.int64) * Hq + h) * D + offs_d[None, :], out.to(Out.dtype.element_ty), mask=d_ok[None, :])
    if RETURN_LSE:
        lse = tl.where(l_sum == 0.0, float("-inf"), (m + tl.math.log2(l_safe)) * 0.6931471805599453)
        lse = tl.where(tl.sum(acc, 1) == tl.sum(acc, 1), lse, float("nan"))  # NaN rows (see _paged_kernel)
        tl.store(Lse + t.to(tl.int64) * Hq + h + one, lse)


def _fast_pieces(busy: int, capacity: int, tile: tuple, D_PAD: int, itemsize: int, device) -> int | None:
    """Fast mode's even pieces per request (PAGED_BALANCE), or None for the fixed cut: where busy x
    (the fixed cut's pieces) programs fill two waves of the GPU's program slots, or one and part of
    a second where even pieces could not be two, None; else as many pieces as fill one wave most
    nearly, at most FOLD_AT_ONCE and none under PAGED_MIN_PIECE_KEYS keys of the block table's
    capacity. From shapes and the GPU alone (a CUDA graph replays it). One request against 131,072
    keys, 8 kv heads, on 132 SMs x 3 decode programs: 49 pieces (392 programs for 396 slots), where
    fixed pieces of 4,096 keys give 32 (256 programs); eight requests against 32,768: 6 pieces (384
    programs) where the fixed cut's 512 would leave most of a second wave empty."""
    if PAGED_PIECES is not None:  # (past FOLD_AT_ONCE, _paged_fold folds them one after another)
        if isinstance(PAGED_PIECES, bool) or not isinstance(PAGED_PIECES, int) or PAGED_PIECES < 1:
            raise ValueError(f"PAGED_PIECES = {PAGED_PIECES!r} must be a whole number of pieces per request, at least "
                             "1, or None (the count that fills the GPU's program slots)")
        return PAGED_PIECES
    most = max(1, min(FOLD_AT_ONCE, capacity // PAGED_MIN_PIECE_KEYS))
    fixed = -(-capacity // (FAST_SPLIT_KEYS or SPLIT_KEYS))
    if _INTERPRET or device.type != "cuda":  # (the interpreter: the fixed cut's count, cut evenly)
        return min(most, fixed)
    slots = _sm_count(device) * _programs_per_sm(tile, D_PAD, itemsize, device)
    # (fixed pieces past one wave but short of two leave the second wave part-empty: even pieces,
    # two at least, in one wave instead)
    if busy * fixed >= 2 * slots or (busy * fixed >= slots and slots // max(busy, 1) < 2):
        return None
    return max(1, min(most, slots // max(busy, 1)))


def _paged_shape(total_q: int, num_seqs: int, Hq: int, Hkv: int, D: int, capacity: int, itemsize: int, device,
                 invariant: bool) -> tuple:
    """attention_paged's launch shape, from shapes alone (a CUDA graph replays it): (BLOCK_M,
    BLOCK_N, warps, stages, tokens per program, row-block slots, D_PAD, pieces per request, the
    pieces' keys (PAGED_BALANCE: the least piece), whether the pieces are cut evenly); capacity: the
    block table's keys per request."""
    # a program's rows are (token, head) pairs of one kv head's group: `tokens` tokens x `group` heads
    group = Hq // Hkv
    if invariant:
        block_m, block_n, warps = INVARIANT_TILE
        stages = INVARIANT_PAGED_STAGES
        if group > block_m:
            raise ValueError(f"invariant mode packs at most {block_m} query heads per kv head into its {block_m}-row "
                             f"tiles; Hq / Hkv = {group}: call with invariant=False")
        if SPLIT_KEYS % block_n:
            raise ValueError(f"SPLIT_KEYS = {SPLIT_KEYS} must be a multiple of {block_n} keys (invariant mode's key "
                             "tile)")
    else:
        # rows per program by the step's shape (never its contents): 16 for decode-heavy steps,
        # wider tiles when requests bring many queries on average (prefill chunks)
        per_request = total_q // max(num_seqs, 1)
        block_m, block_n, warps, stages = next((tile for least, tile in PAGED_TILES if per_request >= least),
                                               PAGED_TILES[-1][1])
        block_m = max(block_m, _next_pow2(group))
    tokens = block_m // group
    row_blocks = total_q // tokens + num_seqs  # the program slots (see _paged_kernel): from shapes alone
    D_PAD = max(16, _next_pow2(D))
    # split the keys when the call has too few programs to fill the GPU (decode, short chunks); the
    # number of pieces from the block table's capacity: a shape, not a content
    split_keys = SPLIT_KEYS if invariant else (FAST_SPLIT_KEYS or SPLIT_KEYS)
    splits = -(-capacity // split_keys) if row_blocks * Hkv < SPLIT_WHEN_PROGRAMS_BELOW else 1
    balanced = not invariant and PAGED_BALANCE and (splits > 1 or PAGED_PIECES is not None)
    if balanced:  # (pieces cut evenly; split_keys is now the least piece, see _paged_kernel)
        # (the programs that hold rows: a block per request at least, or per `tokens` queries)
        busy = max(num_seqs, -(-total_q // tokens)) * Hkv
        even = _fast_pieces(busy, capacity, (block_m, block_n, warps, PAGED_STAGES or stages), D_PAD, itemsize,
                            device)
        if even is None:  # (the fixed cut fills the GPU)
            balanced = False
        else:
            splits, split_keys = even, PAGED_MIN_PIECE_KEYS
    return block_m, block_n, warps, stages, tokens, row_blocks, D_PAD, splits, split_keys, balanced


_PER_SM: dict = {}


def _programs_per_sm(tile: tuple, D_PAD: int, itemsize: int, device) -> int:
    """How many programs of the decode tile (BLOCK_M, BLOCK_N, warps, stages) one SM holds at once:
    by shared memory (stages - 1 tiles of BLOCK_N x D_PAD keys and values), by registers (the
    tile's PAGED_MAXNREG budget, else 256 a thread: 253 compiled for sm_90a at D 128) and by warps
    (64 an SM), cached."""
    per_thread = PAGED_MAXNREG.get(tuple(tile), 256)
    key = (tile, D_PAD, itemsize, str(device), per_thread)
    if key not in _PER_SM:
        props = torch.cuda.get_device_properties(device)
        shared = getattr(props, "shared_memory_per_multiprocessor", 0) or 228 * 1024
        _, block_n, warps, stages = tile
        # (Triton keeps stages - 1 tiles of keys and values in shared memory; + the compiler's own
        # scratch and the 1 KB the GPU reserves per program: 39 KB for the 2-stage decode tile at D 128)
        need = max(1, stages - 1) * block_n * D_PAD * itemsize * 2 + 7 * 1024
        regs = getattr(props, "regs_per_multiprocessor", 0) or 65536
        _PER_SM[key] = max(1, min(shared // need, regs // (max(1, warps) * 32 * per_thread), 64 // max(1, warps)))
    return _PER_SM[key]


_paged_stages_for: dict = {}


def _launch_paged(grid, args, flags, stages, device, site=None):
    """Launch _paged_kernel with `stages` pipeline stages, or fewer where the chip has no room for
    them (shared memory: a mask's tables or a score_mod can need more than the causal kernel the
    tiles were measured with). Stages only move loads earlier: the arithmetic, and so the bits, are
    the same at any depth. The depth that fits is kept per kernel variant, and per call site
    (`site`, see _launch): a later call of the same kind goes straight to the compiled kernel."""
    if _INTERPRET:
        _paged_kernel[grid](*args, **flags)
        return
    if site is not None and site in _SITES:
        _launch(_paged_kernel, grid, args, flags, site)
        return
    key = (str(device), tuple(sorted((k, str(v)) for k, v in flags.items())), stages)
    if site is not None and key in _paged_stages_for:  # (the depth is known: bind the site to it)
        _launch(_paged_kernel, grid, args, {**flags, "num_stages": _paged_stages_for[key]}, site)
        return
    if _first_that_fits(range(stages, 0, -1), lambda depth: _paged_kernel[grid](*args, **flags, num_stages=depth),
                        _paged_stages_for, key) is not None:
        return
    raise RuntimeError(f"attention_paged's tile {flags['BLOCK_M']} x {flags['BLOCK_N']} ({flags['num_warps']} warps) "
                       f"does not fit {device} even without pipelining (shared memory / registers): put a smaller "
                       "tile first in this file's PAGED_TILES")


def _check_paged(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens):
    """Shapes, dtypes and devices of an attention_paged call, each refusal naming its argument."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_table", block_table),
                    ("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch tensor; got {type(t).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must be [total_q, Hq, D]; got {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must be [num_pages, page_size, Hkv, D] and equal; got "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    total_q, Hq, D = q.shape
    num_pages, page_size, Hkv, Dk = k_cache.shape
    if Dk != D:
        raise ValueError(f"k_cache's head dim {Dk} is not q's {D}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"Hq = {Hq} must be a multiple of Hkv = {Hkv} (k_cache's third axis)")
    if page_size % 16:
        raise ValueError(f"page_size = {page_size} (k_cache's second axis) must be a multiple of 16")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or k_cache.dtype != q.dtype or \
            v_cache.dtype != q.dtype:
        raise TypeError(f"q, k_cache, v_cache must share one dtype of bfloat16, float16, float32; got {q.dtype}, "
                        f"{k_cache.dtype}, {v_cache.dtype}")
    if D > 256:
        raise ValueError(f"head dimension {D} is over 256")
    for name, t in (("block_table", block_table), ("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must hold int32 (or int64) entries; got {t.dtype}")
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be [num_seqs, max_pages]; got {tuple(block_table.shape)}")
    num_seqs = block_table.shape[0]
    if cu_seqlens_q.shape != (num_seqs + 1,) or seq_lens.shape != (num_seqs,):
        raise ValueError(f"cu_seqlens_q must be [num_seqs + 1] and seq_lens [num_seqs] for num_seqs = {num_seqs} "
                         f"(block_table's rows); got {tuple(cu_seqlens_q.shape)}, {tuple(seq_lens.shape)}")
    devices = {t.device for t in (q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens)}
    if len(devices) != 1:
        raise ValueError(f"every tensor must be on one device; got {sorted(map(str, devices))}")
    if q.device.type == "cpu" and not _INTERPRET:
        raise RuntimeError("the tensors are on the CPU: this kernel runs on a CUDA GPU, or on a CPU under Triton's "
                           "interpreter (TRITON_INTERPRET=1 before this file is imported)")
    if torch.is_grad_enabled() and q.requires_grad:
        raise RuntimeError("q requires grad, but this kernel is forward only: call it under torch.no_grad()")
    if VALID_HEADS is not None and Hq > VALID_HEADS:
        raise ValueError(f"{NAME} is defined for {VALID_HEADS} query heads (a per-head table); q has {Hq}")
    if VALID_BATCH is not None and num_seqs > VALID_BATCH:
        raise ValueError(f"{NAME} is defined for {VALID_BATCH} batch entries (a per-sample table, read per "
                         f"request in a paged step); the step has {num_seqs} requests (block_table's rows)")
    if HAS_LENGTH_RULES_IN_PAGES:
        raise ValueError(f"{NAME}'s mask reads numbers that follow the sequence's length ({LENGTH_RULES}); in "
                         "paged calls every request has its own length: pass them per request with tables=, or "
                         "use attention() per request")
    return total_q, Hq, D, Hkv, page_size, num_seqs


def check_paged_contents(q, block_table, cu_seqlens_q, seq_lens, k_cache) -> None:
    """The checks that read the tensors' values (a device sync, so attention_paged leaves them out
    and a CUDA graph can replay it): cu_seqlens_q rises from 0 to total_q, each seq_len holds its
    queries, each request's pages exist, and (for a mask with tables sized for fixed lengths) each
    request fits in them; without it such a request's rows are NaN. Call it while testing an
    engine's integration."""
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    if cu[0] != 0 or cu[-1] != q.shape[0] or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens_q must rise from 0 to total_q = {q.shape[0]}; got {cu[:8]}")
    page_size, num_pages = k_cache.shape[1], k_cache.shape[0]
    for r, (n, length) in enumerate(zip([b - a for a, b in zip(cu, cu[1:])], lens)):
        if length < n:
            raise ValueError(f"seq_lens[{r}] = {length} is shorter than the request's {n} queries in this step")
        pages = -(-length // page_size)
        if pages > block_table.shape[1]:
            raise ValueError(f"block_table has {block_table.shape[1]} pages per request; request {r} needs {pages} "
                             f"for seq_len {length} at page_size {page_size}")
        if VALID_KV_LEN is not None and (length > VALID_KV_LEN or length > VALID_Q_LEN):
            raise ValueError(f"seq_lens[{r}] = {length}: {NAME} reads tables sized for Lq = {VALID_Q_LEN}, Lk = "
                             f"{VALID_KV_LEN} (captured per-token tables), so its positions stop there. Generate the "
                             "port for the longest request (python -m workbench port ... --q-len/--kv-len)")
        used = block_table[r, :pages]
        if pages and (int(used.min()) < 0 or int(used.max()) >= num_pages):
            raise ValueError(f"block_table[{r}, :{pages}] points outside the cache's {num_pages} pages")


def attention_paged(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, *, scale=None, return_lse=False,
                    invariant=False, tables=None, check=False):
    """One engine step through this file's mask and score, over a paged KV cache (vLLM's layouts).

    q:             [total_q, Hq, D]   the step's query tokens, request after request
    k_cache, v_cache: [num_pages, page_size, Hkv, D]   page_size a multiple of 16
    block_table:   [num_seqs, max_pages] int32   logical page -> physical page; entries past a
                   request's pages are never read
    cu_seqlens_q:  [num_seqs + 1] int32   where each request's queries start in q
    seq_lens:      [num_seqs] int32   each request's whole length (context + this step's queries)
    invariant:     a request's rows do not depend on anything but the request (the step's other
                   requests, their order, page size and placement, how its prompt was chunked) and
                   equal attention(q, k, v, invariant=True) over the request's own keys, bit for
                   bit: invariant mode's fixed tiling, ascending key tiles, pieces of SPLIT_KEYS
                   keys folded in order (see INVARIANT_TILE). Default: the fast tiling (a GQA
                   group's heads packed into 16-row programs), close to but not bitwise equal to
                   attention()
    tables:        {name: tensor} replacing the file's captured tensors for this call (same shapes)
    check:         also run check_paged_contents (a device sync; for tests, not for graphs)
    Returns out [total_q, Hq, D] in q's dtype (and lse [total_q, Hq] float32 with return_lse).

    The mods see b = the request's index in the step, q_idx = the query's position in its request
    (its queries are the last ones: seq_len - n_q + i) and kv_idx = the key's position. One launch,
    no device-to-host sync and no allocation whose size depends on the tensors' contents.

    Contents are not checked without `check=True` (that would sync). A request whose numbers do not
    hold together (queries past q's end, more queries than its seq_len, a seq_len past the block
    table, or a seq_len past the tables of a fixed-length mask) reads nothing out of bounds and gets
    NaN rows; so do the rows that would read a page outside the cache. Rows of q that no request
    covers are left unwritten.
    """
    total_q, Hq, D, Hkv, page_size, num_seqs = _check_paged(q, k_cache, v_cache, block_table, cu_seqlens_q,
                                                            seq_lens)
    if check:
        check_paged_contents(q, block_table, cu_seqlens_q, seq_lens, k_cache)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    captured = dict(_tables(q.device, 1, 1))
    if tables:
        for name, t in tables.items():
            if name not in captured:
                raise ValueError(f"tables: {NAME} reads no tensor named {name!r}; it reads {sorted(captured) or 'none'}")
            if not isinstance(t, torch.Tensor) or t.shape != captured[name].shape or t.dtype != captured[name].dtype:
                raise ValueError(f"tables[{name!r}] must be a {captured[name].dtype} tensor of shape "
                                 f"{tuple(captured[name].shape)}; got {getattr(t, 'dtype', type(t).__name__)} "
                                 f"{tuple(getattr(t, 'shape', ()))}")
            captured[name] = t.to(q.device).contiguous()
    pointers = [captured[n] for n in ALL_POINTERS]
    ranges = _mask_ranges(captured, q.device, replaced=bool(tables)) if HAS_BOUNDS else []
    out = torch.empty(total_q, Hq, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(total_q, Hq, dtype=torch.float32, device=q.device) if return_lse else out
    if total_q == 0 or num_seqs == 0:
        return (out, lse) if return_lse else out
    # prefill-heavy steps on an H100 / H200: the Hopper kernel (hopper_paged.py), when it can
    if not invariant and _hopper_paged_ready(q, k_cache, v_cache, total_q // num_seqs, scale) and \
            _attention_paged_hopper(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale, return_lse,
                                    pointers, ranges, out, lse):
        return (out, lse) if return_lse else out
    group = Hq // Hkv
    block_m, block_n, warps, stages, tokens, row_blocks, D_PAD, splits, split_keys, balanced = _paged_shape(
        total_q, num_seqs, Hq, Hkv, D, block_table.shape[1] * page_size, q.element_size(), q.device, invariant)
    split = splits > 1
    if split:
        part_acc = torch.empty(splits, total_q, Hq, D, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(splits, total_q, Hq, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # (not read)
    args = (q, k_cache, v_cache, out, lse, part_acc, part_ml, block_table, cu_seqlens_q, seq_lens,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), block_table.stride(0),
            num_seqs, Hq, group, tokens, D, scale, total_q, split_keys,
            VALID_Q_LEN if VALID_KV_LEN is not None else 1 << 30, VALID_KV_LEN if VALID_KV_LEN is not None else 1 << 30,
            k_cache.shape[0], block_table.shape[1] * page_size, *pointers, *ranges)
    flags = dict(D_PAD=D_PAD, HAS_SCORE=HAS_SCORE, HAS_MASK=HAS_MASK, BOUNDS=HAS_BOUNDS and HAS_MASK,
                 IEEE=q.dtype == torch.float32, WIDEN=_INTERPRET and q.dtype == torch.bfloat16,
                 RETURN_LSE=return_lse, INTERPRET=_INTERPRET, SPLIT=split, INVARIANT=bool(invariant),
                 PIPELINE=PAGED_PIPELINE and not _INTERPRET, HEADS_DIFFER=MASK_READS_HEAD and group > 1,
                 EVEN_D=D == D_PAD, PAGE_SIZE=page_size, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
                 WHOLE_PIECE_TEST=PAGED_WHOLE_PIECE_TEST, BALANCED=balanced and split,
                 **(_fusion() if invariant else {}))
    pdl = split and _paged_pdl(q.device)
    if pdl:
        flags["PDL"] = True
    regs = None if invariant or _INTERPRET else PAGED_MAXNREG.get((block_m, block_n, warps, PAGED_STAGES or stages))
    if regs:
        flags["maxnreg"] = regs
    # the launch's kind beyond the flags and the grid: every int argument the kernel specializes on
    # (strides, heads, group, D, the pieces' keys), the tensors' dtypes and 16-byte alignment
    site = None if _INTERPRET else (
        "paged", (row_blocks, Hkv, splits), tuple(flags.values()), PAGED_STAGES or stages, q.device, _current_device(q),
        q.stride(), k_cache.shape, k_cache.stride(), v_cache.stride(), block_table.shape[1], block_table.stride(0),
        Hq, group, tokens, D, split_keys,
        q.dtype, block_table.dtype, cu_seqlens_q.dtype, seq_lens.dtype,
        tuple((t.dtype, t.data_ptr() % 16 == 0) for t in (q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens,
                                                         *pointers, *ranges)))
    _launch_paged((row_blocks, Hkv, splits), args, flags, PAGED_STAGES or stages, q.device, site)
    if split:
        # fast mode folds up to FOLD_AT_ONCE pieces at once; invariant mode, and more pieces, in order
        ordered = bool(invariant) or splits > FOLD_AT_ONCE
        fold_args = (out, lse, part_acc, part_ml, seq_lens, cu_seqlens_q, num_seqs, total_q, Hq, D, splits, split_keys)
        fold_flags = dict(D_PAD=D_PAD, RETURN_LSE=return_lse, INTERPRET=_INTERPRET, ORDERED=ordered,
                          PIECES=1 if ordered else _next_pow2(splits), num_warps=1 if ordered else 4,
                          **({} if _INTERPRET else {"num_stages": 3}), **(_fusion() if invariant else {}),
                          **({"PDL": True, "launch_pdl": True} if pdl else {}))
        if _INTERPRET:
            _paged_fold[(total_q, Hq)](*fold_args, **fold_flags)
        else:
            _launch(_paged_fold, (total_q, Hq), fold_args, fold_flags,
                    ("fold", total_q, Hq, D, splits, split_keys, tuple(fold_flags.values()), q.device,
                     _current_device(q), q.dtype, seq_lens.dtype, cu_seqlens_q.dtype, seq_lens.data_ptr() % 16 == 0,
                     cu_seqlens_q.data_ptr() % 16 == 0))
    return (out, lse) if return_lse else out
