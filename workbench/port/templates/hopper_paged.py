"""attention_paged's prefill on Hopper, appended to forward.py by `port.generate` after hopper.py:
the Hopper forward's tile loop (its consumers, its mask / score translation) over keys and values
read through the block table, and the Triton kernel that plans a step's tiles on the device.
Markers: @@ALL_PTR_PARAMS@@ / @@MASK_PTR_PARAMS@@ / @@RANGE_PTR_PARAMS@@ (the mods' tables and
their ranges)."""

import torch
import triton
import triton.language as tl

# ---------------------------------------------------------------- Hopper (sm_90): paged prefill

# On: attention_paged's fast mode runs steps whose requests bring at least HOPPER_PAGED_QUERIES
# queries on average (prefill chunks) through the Hopper kernel where _hopper_paged_ready says it
# can; PORT_HOPPER_PAGED=0 (or HOPPER_PAGED = False, or PORT_HOPPER=0) keeps them on the portable
# paged kernel. Steps of decodes, invariant mode and other GPUs always run the portable one.
HOPPER_PAGED = os.environ.get("PORT_HOPPER_PAGED", "1") != "0"
HOPPER_PAGED_QUERIES = 128
# (dtype, D, loop) whose paged Hopper kernel failed to build or launch here (see _attention_paged_hopper)
_HOPPER_PAGED_FAILED: dict = {}


# one program = one slot of 128 query tokens of the step (request r owns the slots from
# cu_seqlens_q[r] // 128 + r on, as in _paged_kernel) and one head of the lists (program_id(1): a
# query head when the mask reads h, else 0). It writes what the Hopper kernel needs, so nothing is
# planned on the host and a CUDA graph can replay the step:
#   Slots[slot] = (request, its first row in q, the mods' q_idx of that row, rows to store, the
#                  request's length, 1 when the request's numbers do not hold together)
#   Rows[row] = (full tiles, partial tiles, 1 when a tile to visit names a page outside the cache),
#   full_idx / partial_idx[row] = those tiles of 128 keys, ascending.
# A tile is full when the mask's bounds say it keeps every pair and it ends inside the request;
# partial when they say it may keep one (the last tile, past the request's end, is partial).
@triton.jit(do_not_specialize=["num_seqs", "total_q", "valid_q_len", "valid_kv_len", "max_keys", "num_pages"])
def _hopper_paged_lists(cu_seqlens_q, seq_lens, block_table, s_bt, Slots, Rows, full_idx, partial_idx, n_cols,
                        num_seqs, total_q, valid_q_len, valid_kv_len, max_keys, num_pages, @@ALL_PTR_PARAMS@@
                        @@RANGE_PTR_PARAMS@@
                        BOUNDS: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGES: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    row = pid * tl.num_programs(1) + h
    lo = pid * 0
    hi = lo + num_seqs
    while hi - lo > 1:  # the slot's request: the last r whose first slot is <= pid
        mid = (lo + hi) // 2
        here = tl.load(cu_seqlens_q + mid) // BLOCK + mid <= pid
        lo = tl.where(here, mid, lo)
        hi = tl.where(here, hi, mid)
    req = lo
    q_start = tl.load(cu_seqlens_q + req)
    n_q = tl.load(cu_seqlens_q + req + 1) - q_start
    L = tl.load(seq_lens + req)
    first = (pid - (q_start // BLOCK + req)) * BLOCK
    used = (first < n_q) & (first >= 0)
    # the same tests as _paged_kernel's: a request past a fixed-length mask's tables, or whose
    # numbers do not hold together, gets NaN rows
    inside = (L <= valid_kv_len) & (L - 1 < valid_q_len) & (n_q >= 0) & (q_start >= 0) & (q_start + n_q <= total_q)
    inside = inside & (n_q <= L) & (L <= max_keys)
    q_row = tl.where(used, q_start + first, 0)
    n_valid = tl.where(used, tl.minimum(tl.minimum(n_q - first, BLOCK), total_q - q_row), 0)
    n_valid = tl.where(q_row >= 0, tl.maximum(n_valid, 0), 0)
    n_f = pid * 0
    n_p = pid * 0
    bad = pid * 0
    if used & inside:
        q_lo = L - n_q + first
        q_hi = L - n_q + tl.minimum(first + BLOCK, n_q) - 1
        pages = block_table + req.to(tl.int64) * s_bt
        last_page = (L - 1) // PAGE_SIZE
        t = pid * 0
        while t * BLOCK < L:
            kv_lo = t * BLOCK
            if BOUNDS:
                all_kept, any_kept = _tile_bounds(req, h, 1, q_lo, q_hi, kv_lo, tl.minimum(kv_lo + BLOCK, L) - 1,
                                                  @@MASK_PTR_PARAMS@@@@RANGE_PTR_PARAMS@@HEADS_DIFFER=False)
                full = all_kept & (kv_lo + BLOCK <= L)
                part = any_kept & (full == 0)
            else:  # nothing decided over a tile: every tile is partial
                full = kv_lo < 0
                part = kv_lo >= 0
            tl.store(full_idx + row.to(tl.int64) * n_cols + n_f, t, mask=full)
            tl.store(partial_idx + row.to(tl.int64) * n_cols + n_p, t, mask=part)
            n_f += full.to(tl.int32)
            n_p += part.to(tl.int32)
            if full | part:  # the pages the tile reads (the last page again past the request's end)
                page = tl.load(pages + tl.minimum(kv_lo // PAGE_SIZE + tl.arange(0, PAGES), last_page))
                bad = bad | tl.max(((page < 0) | (page >= num_pages)).to(tl.int32), 0)
            t += 1
    tl.store(Rows + row * 3, n_f)
    tl.store(Rows + row * 3 + 1, n_p)
    tl.store(Rows + row * 3 + 2, bad)
    if h == 0:
        tl.store(Slots + pid * 8, req)
        tl.store(Slots + pid * 8 + 1, q_row)
        tl.store(Slots + pid * 8 + 2, L - n_q + first)
        tl.store(Slots + pid * 8 + 3, n_valid)
        tl.store(Slots + pid * 8 + 4, L)
        tl.store(Slots + pid * 8 + 5, (inside == 0).to(tl.int32))


if _HAS_GLUON and HOPPER_MODS is None:

    @gluon.jit
    def _hopper_paged_load(desc, buf, bar, pages, first, last_page, kv_col, PAGE_SIZE: gl.constexpr,
                           PARTS: gl.constexpr):
        # the 128 keys (or values) from key `first` of one request into `buf`, through its block table
        # row `pages`: one TMA copy when a page holds the tile (PAGE_SIZE a multiple of 128), else
        # one per page into its rows of the buffer (PARTS pages of PAGE_SIZE keys; past the
        # request's last page the last one again, whose keys the mask drops). Rows of the
        # [num_pages * page_size, Hkv * D] view, columns kv_col .. kv_col + D (the kv head's).
        ROWS: gl.constexpr = desc.block_type.shape[0]
        mbarrier.expect(bar, desc.block_type.nbytes * PARTS)
        if PARTS == 1:
            page = gl.load(pages + first // PAGE_SIZE).to(gl.int32)  # (a TMA coordinate; an int64 table too)
            tma.async_copy_global_to_shared(desc, [page * PAGE_SIZE + first % PAGE_SIZE, kv_col], bar, buf)
        else:
            for j in gl.static_range(PARTS):
                page = gl.load(pages + gl.minimum(first // PAGE_SIZE + j, last_page)).to(gl.int32)
                tma.async_copy_global_to_shared(desc, [page * PAGE_SIZE, kv_col], bar, buf.slice(j * ROWS, ROWS))

    @gluon.jit
    def _hopper_paged_producer(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, pages, kv_col, L,
                               n_f, n_tiles, idx_f, idx_p, PAGE_SIZE: gl.constexpr):
        # the load warp: as _hopper_producer, each tile's keys then its values, read through the pages
        BLOCK_N: gl.constexpr = k_smem.type.shape[1]
        NUM_BUF: gl.constexpr = k_smem.type.shape[0]
        PARTS: gl.constexpr = BLOCK_N // k_desc.block_type.shape[0]
        last_page = (L - 1) // PAGE_SIZE
        for t in range(0, n_tiles):
            slot = t % NUM_BUF
            phase = (t // NUM_BUF) & 1
            _, first, _ = _hopper_tile_start(t, n_f, idx_f, idx_p, L, 1, BLOCK_N, BLOCK_N, True)
            mbarrier.wait(k_empty.index(slot), phase ^ 1)
            _hopper_paged_load(k_desc, k_smem.index(slot), k_ready.index(slot), pages, first, last_page, kv_col,
                               PAGE_SIZE, PARTS)
            mbarrier.wait(v_empty.index(slot), phase ^ 1)
            _hopper_paged_load(v_desc, v_smem.index(slot), v_ready.index(slot), pages, first, last_page, kv_col,
                               PAGE_SIZE, PARTS)

    @gluon.jit
    def _hopper_paged_kernel(q_desc, k_desc, v_desc, Out, Lse, Slots, Rows, full_idx, partial_idx, n_cols, block_table,
                             s_bt, Hq, group, sm_scale, @@ALL_PTR_PARAMS@@
                             HAS_SCORE: gl.constexpr, RETURN_LSE: gl.constexpr, NUM_BUF: gl.constexpr,
                             num_warps: gl.constexpr, PINGPONG: gl.constexpr, PER_HEAD: gl.constexpr,
                             PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr):
        # one program = one slot of 128 query tokens of a request (_hopper_paged_lists) and one
        # query head, over the tiles its row of the lists names: _hopper_specialized_kernel's loop
        # (the same consumers) with b = the request, q_idx = the queries' positions in it, and a load
        # warp that reads keys and values through the block table. Out / lse rows are q's tokens.
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
        HEAD_D: gl.constexpr = q_desc.block_type.shape[1]
        dtype: gl.constexpr = q_desc.dtype
        slot = gl.program_id(0)
        h = gl.program_id(1)
        req = gl.load(Slots + slot * 8)
        q_row = gl.load(Slots + slot * 8 + 1)
        q_pos0 = gl.load(Slots + slot * 8 + 2)
        n_valid = gl.load(Slots + slot * 8 + 3)
        L = gl.load(Slots + slot * 8 + 4)
        if PER_HEAD:
            row = slot * Hq + h
        else:
            row = slot
        n_f = gl.load(Rows + row * 3)
        n_tiles = n_f + gl.load(Rows + row * 3 + 1)
        poison = gl.load(Slots + slot * 8 + 5) | gl.load(Rows + row * 3 + 2)
        idx_f = full_idx + row.to(gl.int64) * n_cols
        idx_p = partial_idx + row.to(gl.int64) * n_cols
        pages = block_table + req.to(gl.int64) * s_bt
        kv_col = (h // group) * HEAD_D
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_D], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, HEAD_D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, HEAD_D], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(NUM_BUF):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            if PINGPONG:  # both warpgroups release a buffer
                mbarrier.init(k_empty.index(i), count=2)
                mbarrier.init(v_empty.index(i), count=2)
            else:
                mbarrier.init(k_empty.index(i), count=1)
                mbarrier.init(v_empty.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row, h * HEAD_D], q_bar, q_smem)
        # the rows' place (_hopper_consumer): token q_row on, rows Hq * D elements apart in out
        l_off = q_row.to(gl.int64) * Hq + h
        o_off = l_off * HEAD_D
        if PINGPONG:
            gl.warp_specialize([
                (_hopper_pingpong_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn,
                                             Out, Lse, req, h, q_pos0, n_valid, o_off, Hq * HEAD_D, l_off, Hq, poison,
                                             L, n_f, n_tiles, idx_f, idx_p, sm_scale, @@ALL_PTR_PARAMS@@HAS_SCORE,
                                             RETURN_LSE, 1, BLOCK_N, 0, False, True, True)),
                (_hopper_pingpong_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn,
                                             Out, Lse, req, h, q_pos0, n_valid, o_off, Hq * HEAD_D, l_off, Hq, poison,
                                             L, n_f, n_tiles, idx_f, idx_p, sm_scale, @@ALL_PTR_PARAMS@@HAS_SCORE,
                                             RETURN_LSE, 1, BLOCK_N, 1, False, True, True)),
                (_hopper_paged_producer, (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, pages,
                                          kv_col, L, n_f, n_tiles, idx_f, idx_p, PAGE_SIZE)),
            ], [4, 1], [240, 32])
        else:
            gl.warp_specialize([
                (_hopper_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, Out, Lse, req, h,
                                    q_pos0, n_valid, o_off, Hq * HEAD_D, l_off, Hq, poison, L, n_f, n_tiles, idx_f,
                                    idx_p, sm_scale, @@ALL_PTR_PARAMS@@HAS_SCORE, RETURN_LSE, 1, BLOCK_N, num_warps,
                                    False, True, True)),
                (_hopper_paged_producer, (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, pages,
                                          kv_col, L, n_f, n_tiles, idx_f, idx_p, PAGE_SIZE)),
            ], [1], [32])


def _hopper_paged_ready(q, k_cache, v_cache, per_request: int, scale: float) -> bool:
    """Whether this attention_paged call (fast mode) runs the Hopper kernel: HOPPER and HOPPER_PAGED
    on, Gluon there and the mods translated, an sm_90 GPU, bf16 / fp16, D 64 or 128, the step's
    requests bringing at least HOPPER_PAGED_QUERIES queries each on average, pages of 16, 32 or 64
    keys or a multiple of 128, contiguous q and caches, and a positive scale."""
    if not (HOPPER and HOPPER_PAGED and _HAS_GLUON and HOPPER_MODS is None) or _INTERPRET or not scale > 0:
        return False
    if q.device.type != "cuda" or _capability(q.device) != (9, 0):
        return False
    num_pages, page_size = k_cache.shape[:2]
    D = q.shape[-1]
    return (q.dtype in (torch.bfloat16, torch.float16) and D in (64, 128)
            and (q.dtype, D, _hopper_loop()) not in _HOPPER_PAGED_FAILED
            and per_request >= HOPPER_PAGED_QUERIES and (page_size in (16, 32, 64) or page_size % 128 == 0)
            and num_pages * page_size < 2 ** 31 and all(t.is_contiguous() for t in (q, k_cache, v_cache)))


def _hopper_paged_plan(q, k_cache, block_table, cu_seqlens_q, seq_lens, pointers, ranges):
    """(Slots, Rows, full_idx, partial_idx) of this step, from _hopper_paged_lists on the device: sized
    by the shapes alone (slots = total_q // 128 + num_seqs, heads of the lists, tiles of the block
    table's capacity)."""
    total_q, Hq, D = q.shape
    num_pages, page_size = k_cache.shape[:2]
    num_seqs = block_table.shape[0]
    slots = total_q // 128 + num_seqs
    heads = Hq if MASK_READS_HEAD else 1
    n_cols = max(1, _cdiv(block_table.shape[1] * page_size, 128))
    dev = q.device
    Slots = torch.empty(slots, 8, dtype=torch.int32, device=dev)
    Rows = torch.empty(slots * heads, 3, dtype=torch.int32, device=dev)
    full_idx = torch.empty(slots * heads, n_cols, dtype=torch.int32, device=dev)
    partial_idx = torch.empty(slots * heads, n_cols, dtype=torch.int32, device=dev)
    _hopper_paged_lists[(slots, heads)](
        cu_seqlens_q, seq_lens, block_table, block_table.stride(0), Slots, Rows, full_idx, partial_idx, n_cols,
        num_seqs, total_q, VALID_Q_LEN if VALID_KV_LEN is not None else 1 << 30,
        VALID_KV_LEN if VALID_KV_LEN is not None else 1 << 30, block_table.shape[1] * page_size, num_pages,
        *pointers, *ranges, BOUNDS=HAS_BOUNDS and HAS_MASK, PAGE_SIZE=page_size, PAGES=max(1, 128 // page_size),
        BLOCK=128)
    return Slots, Rows, full_idx, partial_idx


def _hopper_paged_launch(q, k_cache, v_cache, block_table, scale, return_lse, pointers, plan, out, lse):
    """(grid, arguments, options) of _hopper_paged_kernel for this step, given its _hopper_paged_plan."""
    total_q, Hq, D = q.shape
    num_pages, page_size, Hkv, _ = k_cache.shape
    Slots, Rows, full_idx, partial_idx = plan
    loop = _hopper_loop()
    rows = min(page_size, 128)
    key = ("paged", D, q.dtype)
    if key not in _SHARED_LAYOUTS:  # the 128-key buffers' layout; a page of fewer keys lands in a slice of one
        _SHARED_LAYOUTS[key] = gl.NVMMASharedLayout.get_default_for(
            [128, D], gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16)
    layout = _SHARED_LAYOUTS[key]
    caches = [c.view(num_pages * page_size, Hkv * D) for c in (k_cache, v_cache)]
    k_desc, v_desc = (_GluonDescriptor(c, list(c.shape), list(c.stride()), [rows, D], layout) for c in caches)
    q_flat = q.view(total_q, Hq * D)
    q_desc = _GluonDescriptor(q_flat, list(q_flat.shape), list(q_flat.stride()), [128, D], layout)
    block_n, buffers, warps = HOPPER_TILE
    args = (q_desc, k_desc, v_desc, out, lse, Slots, Rows, full_idx, partial_idx, full_idx.shape[1], block_table,
            block_table.stride(0), Hq, Hq // Hkv, scale, *pointers)
    options = dict(HAS_SCORE=HAS_SCORE, RETURN_LSE=return_lse, NUM_BUF=buffers or (3 if loop == "pingpong" else 2),
                   num_warps=4 if loop == "pingpong" else warps, PINGPONG=loop == "pingpong",
                   PER_HEAD=MASK_READS_HEAD, PAGE_SIZE=page_size, BLOCK_N=128)
    return (Slots.shape[0], Hq), args, options


def _attention_paged_hopper(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale, return_lse, pointers,
                            ranges, out, lse) -> bool:
    """attention_paged's fast mode through the Hopper kernel (see _hopper_paged_ready), into out
    (and lse): True, or False when that kernel failed to compile or launch for this kind of call
    (the caller runs the portable one; the first failure warns with its cause). Two launches: the
    lists (_hopper_paged_lists), then the kernel."""
    loop = _hopper_loop()
    kind = (q.dtype, q.shape[-1], loop)
    try:
        plan = _hopper_paged_plan(q, k_cache, block_table, cu_seqlens_q, seq_lens, pointers, ranges)
        grid, args, options = _hopper_paged_launch(q, k_cache, v_cache, block_table, scale, return_lse, pointers,
                                                   plan, out, lse)
        _hopper_paged_kernel[grid](*args, **options)
    except Exception as exc:
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            raise
        _HOPPER_PAGED_FAILED[kind] = f"{type(exc).__name__}: {str(exc)[:300]}"
        warnings.warn(f"{NAME}: attention_paged's Hopper kernel ({loop} loop, {q.dtype}, D {q.shape[-1]}) failed "
                      f"here ({_HOPPER_PAGED_FAILED[kind]}); these calls run the portable paged kernel instead. Set "
                      "PORT_HOPPER_PAGED=0 to run it from the start, and please report the cause", RuntimeWarning,
                      stacklevel=3)
        return False
    return True


# ---------------------------------------------------------------- Hopper (sm_90): paged decode

# On: attention_paged's fast mode runs steps of decodes and short chunks (fewer than
# HOPPER_PAGED_QUERIES queries per request on average) through _hopper_decode_kernel where
# _hopper_decode_ready says it can; PORT_HOPPER_DECODE=0 (or HOPPER_DECODE = False, or PORT_HOPPER=0)
# keeps them on the portable paged kernel.
HOPPER_DECODE = os.environ.get("PORT_HOPPER_DECODE", "1") != "0"
# (BLOCK_N keys per tile, K / V buffers, keys per split-KV piece (None: SPLIT_KEYS), registers per
# thread at launch (None: the compiler's)). A program's 64 rows are (token, head) pairs of one kv
# head's group; at D 128 a 64-key tile's K and V take 32 KB of shared memory a buffer, so 3 buffers
# (112 KB with Q's tile) and 128 registers a thread (the math warpgroup takes 232 of the load
# warpgroup's, compiled for sm_90a without spills) leave room for two programs an SM
HOPPER_DECODE_TILE = (64, 3, None, 128)
# (dtype, D) whose decode kernel failed to build or launch here (see _attention_paged_hopper_decode)
_HOPPER_DECODE_FAILED: dict = {}

if _HAS_GLUON and HOPPER_MODS is None:

    @gluon.jit
    def _hopper_tile_bounds(req, kv_h, group, q_lo, q_hi, kv_lo, kv_hi, @@MASK_PTR_PARAMS@@ @@RANGE_PTR_PARAMS@@
                            HEADS_DIFFER: gl.constexpr):
        # _tile_bounds in Gluon: what the mask gives over rows q_lo..q_hi x keys kv_lo..kv_hi for
        # every query head of kv head kv_h's group, (all kept, any kept)
        all_kept, any_kept = mask_mod_bounds_gluon(req, kv_h * group, q_lo, q_hi, kv_lo, kv_hi@@MASK_PTR_ARGS@@@@RANGE_PTR_ARGS@@)
        if HEADS_DIFFER:
            for g in range(1, group):
                all_g, any_g = mask_mod_bounds_gluon(req, kv_h * group + g, q_lo, q_hi, kv_lo, kv_hi@@MASK_PTR_ARGS@@@@RANGE_PTR_ARGS@@)
                all_kept = all_kept & all_g
                any_kept = any_kept | any_g
        return all_kept != 0, any_kept != 0

    @gluon.jit
    def _hopper_decode_producer(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, pages, kv_col, L,
                                start, n_tiles, PAGE_SIZE: gl.constexpr):
        # the load warp: the piece's tiles from `start`, in order, each tile's keys then its values,
        # read through the request's block table row into the ring as the consumers release it
        BLOCK_N: gl.constexpr = k_smem.type.shape[1]
        NUM_BUF: gl.constexpr = k_smem.type.shape[0]
        PARTS: gl.constexpr = BLOCK_N // k_desc.block_type.shape[0]
        last_page = (L - 1) // PAGE_SIZE
        for t in range(0, n_tiles):
            slot = t % NUM_BUF
            phase = (t // NUM_BUF) & 1
            first = start + t * BLOCK_N
            mbarrier.wait(k_empty.index(slot), phase ^ 1)
            _hopper_paged_load(k_desc, k_smem.index(slot), k_ready.index(slot), pages, first, last_page, kv_col,
                               PAGE_SIZE, PARTS)
            mbarrier.wait(v_empty.index(slot), phase ^ 1)
            _hopper_paged_load(v_desc, v_smem.index(slot), v_ready.index(slot), pages, first, last_page, kv_col,
                               PAGE_SIZE, PARTS)

    @gluon.jit
    def _hopper_decode_consumer(q_smem, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, Out, Lse, Part_acc, Part_ml,
                                req, kv_h, group, q_row0, n_tok, q_pos0, L, start, n_tiles, whole, poison, pages,
                                num_pages, split, total_q, Hq, sm_scale, @@ALL_PTR_PARAMS@@
                                HAS_SCORE: gl.constexpr, RETURN_LSE: gl.constexpr, SPLIT: gl.constexpr,
                                PAGE_SIZE: gl.constexpr):
        # the math warpgroup over the program's 64 rows: row r is token r // group of the program
        # (q's row q_row0 + r // group, the mods' q_idx q_pos0 + r // group) and query head
        # kv_h * group + r % group; rows past n_tok tokens are computed (as the last token) and
        # never stored. Per tile: S = Q K^T (wgmma), the score_mod, the mask unless the tile is
        # full, the online softmax (_hopper_softmax), O = O * alpha + P V (wgmma, P from
        # registers), tile t's S issued with tile t-1's P V as in _hopper_consumer. A tile is full
        # when the bounds kept the piece whole (`whole`) and it ends inside the request. Each tile's
        # page numbers are checked against the cache: a page outside it makes the rows NaN.
        # SPLIT: (acc, m, l) of this piece into Part_acc / Part_ml (folded by _paged_fold), else
        # out = acc / l (and lse).
        BLOCK_M: gl.constexpr = q_smem.type.shape[0]
        HEAD_D: gl.constexpr = q_smem.type.shape[1]
        BLOCK_N: gl.constexpr = k_smem.type.shape[1]
        NUM_BUF: gl.constexpr = k_smem.type.shape[0]
        PARTS: gl.constexpr = (BLOCK_N + PAGE_SIZE - 1) // PAGE_SIZE
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
        acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, layout=o_layout)
        zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        r_s = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        q_idx = (q_pos0 + gl.minimum(r_s // group, gl.maximum(n_tok - 1, 0)))[:, None]
        h_idx = (kv_h * group + r_s % group)[:, None]
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))[None, :]
        last_page = gl.maximum(L - 1, 0) // PAGE_SIZE
        bad = poison
        if n_tiles > 0:
            first = start
            mbarrier.wait(k_ready.index(0), 0)
            qk = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk, ))
            mbarrier.arrive(k_empty.index(0), count=1)
            for j in gl.static_range(PARTS):
                page = gl.load(pages + gl.minimum(first // PAGE_SIZE + j, last_page))
                bad = bad | ((page < 0) | (page >= num_pages)).to(gl.int32)
            full = whole & (first + BLOCK_N <= L)
            p, alpha, m_i, l_i = _hopper_softmax(qk, m_i, l_i, req, h_idx, q_idx, first + cols, first, L, full,
                                                 sm_scale, @@ALL_PTR_PARAMS@@HAS_SCORE, dtype, p_layout, True, True)
            for t in range(1, n_tiles):
                slot = t % NUM_BUF
                prev = (t - 1) % NUM_BUF
                first = start + t * BLOCK_N
                for j in gl.static_range(PARTS):
                    page = gl.load(pages + gl.minimum(first // PAGE_SIZE + j, last_page))
                    bad = bad | ((page < 0) | (page >= num_pages)).to(gl.int32)
                mbarrier.wait(k_ready.index(slot), (t // NUM_BUF) & 1)
                qk = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
                mbarrier.wait(v_ready.index(prev), ((t - 1) // NUM_BUF) & 1)
                acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
                qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk, ))  # S is done; P V may still run
                mbarrier.arrive(k_empty.index(slot), count=1)
                full = whole & (first + BLOCK_N <= L)
                p, alpha, m_i, l_i = _hopper_softmax(qk, m_i, l_i, req, h_idx, q_idx, first + cols, first, L, full,
                                                     sm_scale, @@ALL_PTR_PARAMS@@HAS_SCORE, dtype, p_layout, True,
                                                     True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                mbarrier.arrive(v_empty.index(prev), count=1)
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            final = (n_tiles - 1) % NUM_BUF
            mbarrier.wait(v_ready.index(final), ((n_tiles - 1) // NUM_BUF) & 1)
            last = start + (n_tiles - 1) * BLOCK_N
            if last + BLOCK_N > L:
                # the request's last tile: the cache's slots past its end hold anything (NaN
                # included, and 0 * NaN is NaN): their values are zeroed before P V
                TPW_D: gl.constexpr = HEAD_D // 8
                v_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_D, TPW_D], [4, 1], [1, 0])
                v_tile = v_smem.index(final)
                vals = v_tile.load(v_layout)
                rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, v_layout))
                v_tile.store(gl.where((rows < L - last)[:, None], vals, 0.0).to(dtype))
                fence_async_shared()
                gl.thread_barrier()
            acc = warpgroup_mma(p, v_smem.index(final), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(v_empty.index(final), count=1)
        # the rows' places: token r // group of the program, head kv_h * group + r % group
        r_o = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
        offs_d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))
        row_ok = r_o // group < n_tok
        at = (q_row0 + r_o // group).to(gl.int64) * Hq + kv_h * group + r_o % group  # (token, head) of q
        m_o = gl.convert_layout(m_i, gl.SliceLayout(1, o_layout))
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        if bad != 0:
            acc = acc * float("nan")
        if SPLIT:
            at = at + split.to(gl.int64) * total_q * Hq
            gl.store(Part_acc + at[:, None] * HEAD_D + offs_d[None, :], acc, mask=row_ok[:, None])
            gl.store(Part_ml + at * 2, m_o, mask=row_ok)
            gl.store(Part_ml + at * 2 + 1, l_o, mask=row_ok)
        else:
            l_safe = gl.where(l_o == 0.0, 1.0, l_o)
            out = acc / l_safe[:, None]
            gl.store(Out + at[:, None] * HEAD_D + offs_d[None, :], out.to(Out.dtype.element_ty), mask=row_ok[:, None])
            if RETURN_LSE:
                lse = gl.where(l_o == 0.0, float("-inf"), (m_o + gl.log2(l_safe)) * 0.6931471805599453)
                if bad != 0:
                    lse = lse * float("nan")
                gl.store(Lse + at, lse, mask=row_ok)

    @gluon.jit
    def _hopper_decode_kernel(Q, k_desc, v_desc, Out, Lse, Part_acc, Part_ml, block_table, cu_seqlens_q, seq_lens, s_bt,
                              num_seqs, Hq, group, tokens, sm_scale, total_q, split_keys, valid_q_len, valid_kv_len,
                              num_pages, max_keys, @@ALL_PTR_PARAMS@@
                              @@RANGE_PTR_PARAMS@@
                              HAS_SCORE: gl.constexpr, HAS_MASK: gl.constexpr, BOUNDS: gl.constexpr,
                              RETURN_LSE: gl.constexpr, SPLIT: gl.constexpr, HEADS_DIFFER: gl.constexpr,
                              PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr,
                              num_warps: gl.constexpr):
        # one program = `tokens` query tokens of one request times the `group` query heads of kv
        # head kv_h (64 rows, GQA packed as in _paged_kernel), over one piece of the request's keys
        # (SPLIT: keys [split * split_keys, (split + 1) * split_keys), else all of them): the same
        # grid, the same pieces and the same partial sums as _paged_kernel, so _paged_fold folds
        # them. Before the loop (every warp): which request (a binary search over cu_seqlens_q), the
        # rows, the piece narrowed to the tiles the mask's bounds may keep (one test of the whole
        # piece first), Q's rows into shared memory. Then one warp brings K and V by TMA through the
        # block table (_hopper_decode_producer) while the warpgroup computes
        # (_hopper_decode_consumer).
        BLOCK_M: gl.constexpr = 64
        HEAD_D: gl.constexpr = k_desc.block_type.shape[1]
        dtype: gl.constexpr = k_desc.dtype
        pid = gl.program_id(0)
        kv_h = gl.program_id(1)
        split = gl.program_id(2)
        lo = pid * 0
        hi = lo + num_seqs
        while hi - lo > 1:  # the slot's request: the last r whose first slot is <= pid
            mid = (lo + hi) // 2
            here = gl.load(cu_seqlens_q + mid) // tokens + mid <= pid
            lo = gl.where(here, mid, lo)
            hi = gl.where(here, hi, mid)
        req = lo
        q_start = gl.load(cu_seqlens_q + req)
        n_q = gl.load(cu_seqlens_q + req + 1) - q_start
        L = gl.load(seq_lens + req)
        # (_paged_kernel's tests: a request whose numbers do not hold together gets NaN rows)
        inside = (L <= valid_kv_len) & (L - 1 < valid_q_len) & (n_q >= 0) & (q_start >= 0) & (q_start + n_q <= total_q)
        inside = inside & (n_q <= L) & (L <= max_keys)
        first_tok = (pid - (q_start // tokens + req)) * tokens
        used = (first_tok < n_q) & (first_tok >= 0)  # else a spare slot: it stores nothing
        n_tok = gl.where(used, gl.minimum(n_q - first_tok, tokens), 0)
        q_row0 = gl.where(used, q_start + first_tok, 0)
        q_pos0 = L - n_q + first_tok
        q_lo = q_pos0
        q_hi = q_pos0 + n_tok - 1
        if SPLIT:
            start = split * split_keys
            stop = gl.minimum(L, start + split_keys)
        else:
            start = L * 0
            stop = L
        stop = gl.where(inside & used, stop, start)
        whole = start < 0
        if not HAS_MASK:
            whole = start >= 0
        if BOUNDS:
            # narrow [start, stop) to the tiles the bounds may keep, as _paged_kernel does
            all_p, any_p = _hopper_tile_bounds(req, kv_h, group, q_lo, q_hi, start, gl.minimum(stop, L) - 1,
                                               @@MASK_PTR_PARAMS@@@@RANGE_PTR_PARAMS@@HEADS_DIFFER)
            whole = all_p & (start < stop)
            kept_lo = gl.where(whole, start, stop)
            kept_hi = gl.where(all_p, stop, start)
            t = gl.where(all_p | (any_p == 0), stop, start)
            while t < stop:
                any_t = _hopper_tile_bounds(req, kv_h, group, q_lo, q_hi, t, gl.minimum(t + BLOCK_N, L) - 1,
                                            @@MASK_PTR_PARAMS@@@@RANGE_PTR_PARAMS@@HEADS_DIFFER)[1]
                kept_lo = gl.where(any_t & (t < kept_lo), t, kept_lo)
                kept_hi = gl.where(any_t, t + BLOCK_N, kept_hi)
                t += BLOCK_N
            start = kept_lo
            stop = gl.maximum(kept_hi, kept_lo)
        n_tiles = gl.maximum(stop - start + BLOCK_N - 1, 0) // BLOCK_N
        poison = (inside == 0).to(gl.int32)
        # Q's rows (a few tokens x the group's heads; rows past them repeat the last token)
        TPW_D: gl.constexpr = HEAD_D // 8
        q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_D, TPW_D], [num_warps, 1], [1, 0])
        r_q = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_layout))
        d_q = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, q_layout))
        tok_q = q_row0 + gl.minimum(r_q // group, gl.maximum(n_tok - 1, 0))
        q_at = (tok_q.to(gl.int64) * Hq + kv_h * group + r_q % group) * HEAD_D
        q_regs = gl.load(Q + q_at[:, None] + d_q[None, :])
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_D], gl.NVMMASharedLayout.get_default_for(
            [BLOCK_M, HEAD_D], dtype), q_regs)
        k_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, HEAD_D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, HEAD_D], v_desc.layout)
        k_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_BUF):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=1)
            mbarrier.init(v_empty.index(i), count=1)
        fence_async_shared()  # (Q's rows, written by every thread, are read by the tensor cores)
        gl.thread_barrier()
        pages = block_table + req.to(gl.int64) * s_bt
        kv_col = kv_h * HEAD_D
        gl.warp_specialize([
            (_hopper_decode_consumer, (q_smem, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, Out, Lse, Part_acc,
                                       Part_ml, req, kv_h, group, q_row0, n_tok, q_pos0, L, start, n_tiles, whole,
                                       poison, pages, num_pages, split, total_q, Hq, sm_scale, @@ALL_PTR_PARAMS@@
                                       HAS_SCORE, RETURN_LSE, SPLIT, PAGE_SIZE)),
            (_hopper_decode_producer, (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, pages,
                                       kv_col, L, start, n_tiles, PAGE_SIZE)),
        ], [1], [32])


def _hopper_decode_ready(q, k_cache, v_cache, per_request: int, scale: float) -> bool:
    """Whether this attention_paged call (fast mode) runs the Hopper decode kernel: HOPPER and
    HOPPER_DECODE on, Gluon there and the mods translated, an sm_90 GPU, bf16 / fp16, D 64 or 128,
    fewer than HOPPER_PAGED_QUERIES queries per request on average, a GQA group that divides 64
    rows, pages that hold whole tiles or tiles of whole pages, contiguous tensors, a positive scale."""
    if not (HOPPER and HOPPER_DECODE and _HAS_GLUON and HOPPER_MODS is None) or _INTERPRET or not scale > 0:
        return False
    if q.device.type != "cuda" or _capability(q.device) != (9, 0):
        return False
    num_pages, page_size, Hkv, D = k_cache.shape
    group = q.shape[1] // Hkv
    block_n = HOPPER_DECODE_TILE[0]
    return (q.dtype in (torch.bfloat16, torch.float16) and D in (64, 128)
            and (q.dtype, D) not in _HOPPER_DECODE_FAILED and per_request < HOPPER_PAGED_QUERIES
            and 64 % group == 0 and (page_size % block_n == 0 or block_n % page_size == 0)
            and num_pages * page_size < 2 ** 31 and all(t.is_contiguous() for t in (q, k_cache, v_cache)))


def _hopper_decode_launch(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale, return_lse, pointers,
                          ranges, out, lse):
    """(grid, arguments, options, (splits, split_keys, part_acc, part_ml)) of _hopper_decode_kernel for
    this step: sizes from shapes alone, as in attention_paged's portable path."""
    total_q, Hq, D = q.shape
    num_pages, page_size, Hkv, _ = k_cache.shape
    num_seqs = block_table.shape[0]
    block_n, buffers, piece, regs = HOPPER_DECODE_TILE
    group = Hq // Hkv
    tokens = 64 // group
    row_blocks = total_q // tokens + num_seqs
    split_keys = piece or SPLIT_KEYS
    if split_keys % block_n:
        raise ValueError(f"HOPPER_DECODE_TILE's pieces of {split_keys} keys must be a multiple of its {block_n}-key "
                         "tiles")
    capacity = block_table.shape[1] * page_size
    splits = -(-capacity // split_keys) if row_blocks * Hkv < SPLIT_WHEN_PROGRAMS_BELOW else 1
    if splits > 1:
        part_acc = torch.empty(splits, total_q, Hq, D, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(splits, total_q, Hq, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # (not read)
    rows = min(page_size, block_n)
    key = ("decode", block_n, D, q.dtype)
    if key not in _SHARED_LAYOUTS:  # the tiles' layout; a page of fewer keys lands in a slice of one
        _SHARED_LAYOUTS[key] = gl.NVMMASharedLayout.get_default_for(
            [block_n, D], gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16)
    caches = [c.view(num_pages * page_size, Hkv * D) for c in (k_cache, v_cache)]
    k_desc, v_desc = (_GluonDescriptor(c, list(c.shape), list(c.stride()), [rows, D], _SHARED_LAYOUTS[key])
                      for c in caches)
    args = (q, k_desc, v_desc, out, lse, part_acc, part_ml, block_table, cu_seqlens_q, seq_lens, block_table.stride(0),
            num_seqs, Hq, group, tokens, scale, total_q, split_keys,
            VALID_Q_LEN if VALID_KV_LEN is not None else 1 << 30, VALID_KV_LEN if VALID_KV_LEN is not None else 1 << 30,
            num_pages, capacity, *pointers, *ranges)
    options = dict(HAS_SCORE=HAS_SCORE, HAS_MASK=HAS_MASK, BOUNDS=HAS_BOUNDS and HAS_MASK, RETURN_LSE=return_lse,
                   SPLIT=splits > 1, HEADS_DIFFER=MASK_READS_HEAD and group > 1, PAGE_SIZE=page_size,
                   BLOCK_N=block_n, NUM_BUF=buffers, num_warps=4, **({"maxnreg": regs} if regs else {}))
    return (row_blocks, Hkv, splits), args, options, (splits, split_keys, part_acc, part_ml)


def _attention_paged_hopper_decode(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale, return_lse,
                                   pointers, ranges, out, lse) -> bool:
    """attention_paged's fast mode through the Hopper decode kernel (see _hopper_decode_ready), into
    out (and lse): True, or False when it failed to compile or launch for this kind of call (the
    caller runs the portable kernel; the first failure warns with its cause). One launch, and
    _paged_fold after it when the keys are split."""
    kind = (q.dtype, q.shape[-1])
    try:
        grid, args, options, (splits, split_keys, part_acc, part_ml) = _hopper_decode_launch(
            q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale, return_lse, pointers, ranges, out, lse)
        _hopper_decode_kernel[grid](*args, **options)
    except Exception as exc:
        if isinstance(exc, (torch.cuda.OutOfMemoryError, ValueError)):
            raise
        _HOPPER_DECODE_FAILED[kind] = f"{type(exc).__name__}: {str(exc)[:300]}"
        warnings.warn(f"{NAME}: attention_paged's Hopper decode kernel ({q.dtype}, D {q.shape[-1]}) failed here "
                      f"({_HOPPER_DECODE_FAILED[kind]}); these calls run the portable paged kernel instead. Set "
                      "PORT_HOPPER_DECODE=0 to run it from the start, and please report the cause", RuntimeWarning,
                      stacklevel=3)
        return False
    if splits > 1:
        total_q, Hq, D = q.shape
        _paged_fold[(total_q, Hq)](out, lse, part_acc, part_ml, seq_lens, cu_seqlens_q, block_table.shape[0], total_q,
                                   Hq, D, splits, split_keys, D_PAD=D, RETURN_LSE=return_lse, INTERPRET=False,
                                   ORDERED=splits > FOLD_AT_ONCE, PIECES=1 if splits > FOLD_AT_ONCE else
                                   _next_pow2(splits), num_warps=1 if splits > FOLD_AT_ONCE else 4, num_stages=3)
    return True
