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
                             PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, NAMED: gl.constexpr = 0,
                             UNDER_PV: gl.constexpr = 0, LANE: gl.constexpr = 0):
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
                                             RETURN_LSE, 1, BLOCK_N, 0, False, True, True, NAMED, UNDER_PV, LANE)),
                (_hopper_pingpong_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn,
                                             Out, Lse, req, h, q_pos0, n_valid, o_off, Hq * HEAD_D, l_off, Hq, poison,
                                             L, n_f, n_tiles, idx_f, idx_p, sm_scale, @@ALL_PTR_PARAMS@@HAS_SCORE,
                                             RETURN_LSE, 1, BLOCK_N, 1, False, True, True, NAMED, UNDER_PV, LANE)),
                (_hopper_paged_producer, (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, pages,
                                          kv_col, L, n_f, n_tiles, idx_f, idx_p, PAGE_SIZE)),
            ], [4, 1], [240, 32])
        else:
            gl.warp_specialize([
                (_hopper_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, Out, Lse, req, h,
                                    q_pos0, n_valid, o_off, Hq * HEAD_D, l_off, Hq, poison, L, n_f, n_tiles, idx_f,
                                    idx_p, sm_scale, @@ALL_PTR_PARAMS@@HAS_SCORE, RETURN_LSE, 1, BLOCK_N, num_warps,
                                    False, True, True, UNDER_PV, LANE)),
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
            and (q.dtype, D, _hopper_paged_loop()) not in _HOPPER_PAGED_FAILED
            and per_request >= HOPPER_PAGED_QUERIES and (page_size in (16, 32, 64) or page_size % 128 == 0)
            and num_pages * page_size < 2 ** 31 and all(t.is_contiguous() for t in (q, k_cache, v_cache)))


def _hopper_paged_loop() -> str:
    """The paged kernel's tile loop: the contiguous kernel's (_hopper_loop), with "persistent" (which
    has no paged form) run as the ping-pong loop it is built from."""
    loop = _hopper_loop()
    return "pingpong" if loop == "persistent" else loop


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
    loop = _hopper_paged_loop()
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
    if loop == "pingpong" and HOPPER_NAMED & 1:  # (_hopper_plan's named turns only: compiled for sm_90a,
        options["NAMED"] = HOPPER_NAMED & 5  # named releases made this kernel spill 12-20 bytes at pages of 16
        # where it did not; 4: the turn before the tile's waits
    if HOPPER_UNDER_PV:  # (the wait for the previous tile's P V after the softmax or its row max)
        options["UNDER_PV"] = HOPPER_UNDER_PV
    if HOPPER_LANE_SUMS:  # (the row sums by thread, as the contiguous kernel's)
        options["LANE"] = 1
    grid = (Slots.shape[0], Hq)
    if options.get("UNDER_PV") == 2 and not HOPPER_UNDER_PV_CHOSEN and q.device.type == "cuda":
        key = (q.dtype, D, tuple(options.items()))  # (a kind's first call: the place that spills less,
        if key not in _PAGED_UNDER_PV:  # _under_pv_by_spills)
            _PAGED_UNDER_PV[key] = _under_pv_by_spills(_hopper_paged_kernel, grid, args, options).get("UNDER_PV", 0)
            while len(_PAGED_UNDER_PV) > _KEPT:
                _PAGED_UNDER_PV.pop(next(iter(_PAGED_UNDER_PV)))
        if not _PAGED_UNDER_PV[key]:
            del options["UNDER_PV"]
    return grid, args, options


_PAGED_UNDER_PV: dict = {}  # (dtype, D, options) -> the paged kernel's UNDER_PV there


def _attention_paged_hopper(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale, return_lse, pointers,
                            ranges, out, lse) -> bool:
    """attention_paged's fast mode through the Hopper kernel (see _hopper_paged_ready), into out
    (and lse): True, or False when that kernel failed to compile or launch for this kind of call
    (the caller runs the portable one; the first failure warns with its cause). Two launches: the
    lists (_hopper_paged_lists), then the kernel."""
    loop = _hopper_paged_loop()
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
