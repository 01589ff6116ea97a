"""The fused block-scan kernel (`kernels.scan`), a template in the @@ dialect of the port's.

It is appended to the translated mask_mod (`mask_mod_triton(b, h, q_idx, kv_idx, *tables)` and,
with bounds, `mask_mod_bounds`); the driver fills in:
    @@PTRS@@        the mod's table pointers (", t0_ptr, t1_ptr")
    @@RANGE_PTRS@@  each table's (sorted, min, max) pointers, read by mask_mod_bounds
    @@JIT@@         @triton.jit, with the lengths left unspecialised on a GPU
    @@INT@@         ": tl.constexpr" under Triton's CPU interpreter (it cannot loop to runtime ints)
    @@SALT@@        a comment that benchmarks change to time a never-seen kernel
"""

import triton
import triton.language as tl

@triton.jit
def _scan_block(b, h, r, c, q_idx, q_ok, Lq, Lk, kv_block, full_count, counts_ptr, bh, n_rows, n_cols,
                row_kept, full_blocks, empty_blocks, head_acc, batch_acc@@PTRS@@,
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
            keep = (mask_mod_triton(b, h, q_use, kv_use@@PTRS@@) != 0) & inside
        else:
            q_use = q_idx[:, None]
            kv_use = kv_idx[None, :]
            keep = mask_mod_triton(b, h, q_use, kv_use@@PTRS@@) != 0
        kept += keep.to(tl.int32)
        if DIFF_HEAD:
            other = mask_mod_triton(b, 0, q_use, kv_use@@PTRS@@) != 0
            if BOUNDED:
                other = other & inside
            head_acc += (keep != other).to(tl.int32)
        if DIFF_BATCH:
            other = mask_mod_triton(0, h, q_use, kv_use@@PTRS@@) != 0
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


@@JIT@@
def block_scan_kernel(counts_ptr, rows_ptr, stats_ptr, Lq@@INT@@, Lk@@INT@@, n_rows@@INT@@, n_cols@@INT@@, q_block@@INT@@,
                      kv_block@@INT@@@@PTRS@@@@RANGE_PTRS@@,
                      SUB_Q: tl.constexpr, SUB_K: tl.constexpr, N_SUB_Q: tl.constexpr,
                      KEEP_COUNTS: tl.constexpr, DIFF_HEAD: tl.constexpr, DIFF_BATCH: tl.constexpr,
                      INTERIOR: tl.constexpr, ROWS_AT_END: tl.constexpr, BOUNDS: tl.constexpr):
    # one program = one row of blocks r for one (b, h); the grid is (n_rows, heads, batch)
    r = tl.program_id(0)  # @@SALT@@
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
                                                             kv_lo + kv_block - 1@@PTRS@@@@RANGE_PTRS@@)
                        decided = all_kept == any_kept
                        if DIFF_HEAD:  # head 0 must be decided alike, or the block's differences count
                            all_0, any_0 = mask_mod_bounds(b, h * 0, q_lo, q_lo + SUB_Q - 1, kv_lo,
                                                           kv_lo + kv_block - 1@@PTRS@@@@RANGE_PTRS@@)
                            decided = decided & (all_0 == any_0) & (all_0 == all_kept)
                        if DIFF_BATCH:
                            all_0, any_0 = mask_mod_bounds(b * 0, h, q_lo, q_lo + SUB_Q - 1, kv_lo,
                                                           kv_lo + kv_block - 1@@PTRS@@@@RANGE_PTRS@@)
                            decided = decided & (all_0 == any_0) & (all_0 == all_kept)
                    if decided:
                        row_kept, full_blocks, empty_blocks = _decided_block(
                            all_kept, r, c, kv_block, full_count, counts_ptr, bh, n_rows, n_cols, row_kept,
                            full_blocks, empty_blocks, SUB_Q, SUB_K, N_SUB_Q, KEEP_COUNTS, ROWS_AT_END)
                    else:
                        row_kept, full_blocks, empty_blocks, head_acc, batch_acc = _scan_block(
                            b, h, r, c, q_idx, q_ok, Lq, Lk, kv_block, full_count, counts_ptr, bh, n_rows, n_cols,
                            row_kept, full_blocks, empty_blocks, head_acc, batch_acc@@PTRS@@, SUB_Q, SUB_K, N_SUB_Q,
                            KEEP_COUNTS, DIFF_HEAD, DIFF_BATCH, BOUNDED=edge == 1, ROWS_AT_END=ROWS_AT_END)
                    c += 1
        else:
            for c in range(0, n_cols):
                row_kept, full_blocks, empty_blocks, head_acc, batch_acc = _scan_block(
                    b, h, r, c, q_idx, q_ok, Lq, Lk, kv_block, full_count, counts_ptr, bh, n_rows, n_cols, row_kept,
                    full_blocks, empty_blocks, head_acc, batch_acc@@PTRS@@, SUB_Q, SUB_K, N_SUB_Q, KEEP_COUNTS,
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
