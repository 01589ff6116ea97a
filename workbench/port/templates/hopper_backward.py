"""The port's Hopper backward, appended after hopper.py by `port.generate`: dq, dk and dv of
`attention` on sm_90 in Gluon, over the same block lists (rows for dq, columns for dk / dv) and the
same Gluon mask as the Hopper forward. Markers: @@ALL_PTR_PARAMS@@ / @@MASK_PTR_ARGS@@."""

import torch

# ---------------------------------------------------------------- Hopper backward (sm_90)

# FlashAttention-2's backward (see the portable kernels' comment above: p = exp2(s * c - lse2),
# ds = p (dp - delta), dq = scale ds k, dk = scale ds^T q, dv = p^T dO) as two Gluon kernels, with
# no atomics, so every call gives the same bits, like the portable backward (by default the dk / dv
# kernel computes dq too and sums it by TMA reduce-adds, and the dq kernel does not run:
# HOPPER_BWD_FUSED_DQ below):
#   dk / dv: one program per 128 keys of a (batch entry, kv head), its K and V in shared memory
#            for the whole program; a load warp brings the tiles of Q and dO that the column
#            lists name (every query head of the group, in order) into a ring of buffers; two
#            math warpgroups, 64 keys each, compute S^T = K Q^T and dP^T = V dO^T (wgmma), then
#            P^T and dS^T in registers, then dV += P^T dO and dK += dS^T Q (wgmma, P^T and dS^T as
#            register operands): keys down, queries across, so no register tile is transposed.
#            (Form 3's keys-down split runs persistent: HOPPER_BWD_PERSISTENT below.)
#   dq:      one program per 128 queries, Q and dO in shared memory; the load warp brings the
#            tiles of K and V its row of the block lists names (the forward's own loader);
#            S = Q K^T and dP = dO V^T, then dQ += dS K.
# It takes the calls the Hopper forward takes at whole blocks (Lq, Lk multiples of 128), without
# a score_mod and without learning tables (the portable backward runs those: their derivative and
# gradient translations are Triton's), at the head dims of HOPPER_BWD_HEAD_DIMS (the two kernels)
# and HOPPER_BWD_FUSED_HEAD_DIMS (the fused forms), for masks that do not read the head or do on
# long calls (HOPPER_BWD_PER_HEAD_MIN_PAIRS). On an H200 (bf16, B 1, H 16, 32K tokens, backward
# alone) the two kernels are 1.11x the portable backward on causal at D 64, 1.10x on prefix-LM
# and 1.03x on a window and on documents, but 0.92-1.01x at D 128 (docs/benchmarks.md: both
# kernels together run seven matmuls per pair, as the portable ones do, and are near the tensor
# cores' rate there), so a deterministic backward at D 128 runs the portable one.
# PORT_HOPPER_BWD=0 (or HOPPER_BWD = False) turns the Hopper backward off.
HOPPER_BWD = os.environ.get("PORT_HOPPER_BWD", "1") != "0"
HOPPER_BWD_HEAD_DIMS = (64, )
# masks that read the head (per-head lists: per-head windows, users' w[h] tables) take the Hopper
# backward on calls of at least HOPPER_BWD_PER_HEAD_MIN_PAIRS (batch x query heads x Lq x Lk) and
# run the portable one below that: per-head windows (64 to 2,048 keys, B 1, H 16) took 1.17 ms
# against 1.74 at 32K (D 128; D 64 0.80 against 1.11). At 8K (2^30 pairs) the step's GPU kernels
# take 0.472 ms on it against 0.583 on the portable one (compiled Flex's: 0.546; an H100, D 128,
# with the lean launch), for about 0.1 ms more host time a step (its plan, descriptors and one more
# launch): a step bound by a slow host runs 4% slower, one bound by the GPU 19% faster. Below 2^30
# pairs the host's share grows. False sends every such mask to the portable backward
HOPPER_BWD_PER_HEAD = True


def _count_setting(name: str, default: int) -> int:
    """A whole-number setting from the environment (PORT_<name>), else `default`."""
    text = os.environ.get(f"PORT_{name}", "").strip()
    if not text:
        return default
    if not text.isdecimal():  # (not isdigit: '²' is a digit int() cannot read)
        raise ValueError(f"PORT_{name}={text!r} is not a whole number: set it to one (0 sends every call of the "
                         f"Hopper backward's kind to it) or unset it (the default, {default})")
    return int(text)


HOPPER_BWD_PER_HEAD_MIN_PAIRS = _count_setting("HOPPER_BWD_PER_HEAD_MIN_PAIRS", 1 << 30)
# a call whose mask keeps fewer than HOPPER_BWD_MIN_BLOCKS blocks of 128 x 128 pairs (over its batch
# entries and query heads; counted once per shape from the block lists) runs the portable backward:
# there a step is bound by the host, and the Hopper backward's plan, TMA descriptors and extra
# launches cost more host time a step, by how much depends on the host (0.29-0.32 against
# 0.41-0.43 ms on one H100 host, 0.319 against 0.328 on another), while its kernels save about 20 ns a kept block (0.34 against 0.45 ms on the per-head
# window at 8K). On that host (bf16, B 1, H 16, D 128, forward + backward, tensor maps kept):
# 8 documents at 8K (4,608 blocks) took 0.456 ms a step on the Hopper backward against 0.533 on
# the portable one, per-head windows (5,243) 0.472 against 0.586; at 2K (a few hundred blocks) the
# portable one won, 0.255 against 0.351 and 0.216 against 0.287. A slower host moves the crossing
# up (before the tensor maps were kept, 8 documents at 8K took 0.715 ms on the Hopper backward
# against 0.538). 0 lets every call of the Hopper backward's kind take it
# (PORT_HOPPER_BWD_MIN_BLOCKS and PORT_HOPPER_BWD_PER_HEAD_MIN_PAIRS set both from the environment)
HOPPER_BWD_MIN_BLOCKS = _count_setting("HOPPER_BWD_MIN_BLOCKS", 4096)
# HOPPER_BWD_SCORE (PORT_HOPPER_BWD_SCORE=0 turns it off): a score_mod takes the Hopper backward in
# its keys-down form (the default at D 64 and 128, not deterministic, no learning table): each
# tile's scores through score_mod_gluon and dS through its derivative, score_grad_gluon (generated
# from the traced score_mod; HOPPER_GRAD says why there is none). On an H200 (bf16, B 1, H 16,
# D 128, image spans + softcap, forward + backward): 3.05 ms against the portable backward's 4.54 at
# 8K, 43.1-43.7 against 64.6 at 32K (Flex FLASH 3.06 and 41.6-41.9), with the Gluon copies' fast
# forms (generate.py's _fast_scores; before them 4.46 and 61.6); D 128 spills 0.3-0.5 KB
HOPPER_BWD_SCORE = os.environ.get("PORT_HOPPER_BWD_SCORE", "1") != "0"
HOPPER_GRAD = @@HOPPER_GRAD@@  # None: the score_mod's derivative has a Gluon copy; else why not
# per head dim: (query tile of the dk / dv kernel, key tile of the dq kernel, buffers of each ring,
# overlap: each tile's last matmuls issued behind the next tile's first ones, FlashAttention-3's
# order). Tiles and orders change the speed, not the bits (sums in the same order)
HOPPER_BWD_TILES = {64: (64, 64, 4, True), 128: (32, 64, 4, True)}
# FlashAttention-2 / 3's five matmuls per pair instead of seven: the dk / dv programs also compute
# dq (dS K over their keys) and add it into a float32 dq, and the dq kernel does not run. The adds'
# order varies, so dq's last bits vary run to run (deterministic=True runs the two kernels above at
# D 64 and the portable backward at D 128, whose bits never vary). 0: off. 1: each math warpgroup
# adds its 64 keys' dq by atomic adds (on an H200 slower than the two kernels: causal 32K 17.7 vs
# 16.8 ms at D 64). 2: both warpgroups write dS^T into one shared tile of the program's 128 keys and
# one of them, in turn, computes dQ over all 128 and adds it by atomic adds: half the atomic
# traffic. 3 (the default): form 2 with each dQ tile summed by the copy engine (the warpgroup's dQ
# tile into shared memory, one TMA reduce-add of the tile: FlashAttention-3's way), where Triton's
# op builder has it (_HAS_TMA_REDUCE; else form 2 runs). At D 128 (HOPPER_BWD_DQ_SPLIT_HEAD_DIMS)
# forms 2 and 3 split dQ's matmul between the warpgroups: form 3 keys down (_hopper_bwd_keys_consumer,
# HOPPER_BWD_SPLIT_KEYS_DOWN), form 2 queries down (_hopper_bwd_split_consumer).
# On an H200 (bf16, B 1, H 16, 32K tokens, backward alone, ms; docs/benchmarks.md):
#   D 64,  causal:              two kernels 16.75, form 2 14.96, form 3 13.69 (13.37 with HOPPER_BWD_EARLY_P)
#   D 64,  window 1024 / 8 docs: form 2 1.33 / 2.34, form 3 1.24 / 2.13
#   D 128, causal:              portable 27.57, two kernels 28.24, split form 2 34.26, split form 3 queries
#                               down 24.06-25.33, keys down 22.26
#   D 128, window 1024 / 8 docs: portable 2.36 / 4.00, split form 3 queries down 2.13 / 3.82-4.07,
#                               keys down 2.21 / 3.60
# (at D 128 form 2 spills 1 KB of registers keys down, and its atomic adds of a [64, 128] dQ a tile
# cost more than they save; a keys-down form with 32-query tiles took 39.3 ms: not kept).
# At the head dims of HOPPER_BWD_FUSED_HEAD_DIMS; the dk / dv tile is (64 queries,
# HOPPER_BWD_FUSED_BUFFERS buffers or as many as fit, in turn).
HOPPER_BWD_FUSED_FORMS = (0, 1, 2, 3)
_fused_env = os.environ.get("PORT_HOPPER_BWD_FUSED_DQ", "3").strip() or "0"
if _fused_env not in {str(f) for f in HOPPER_BWD_FUSED_FORMS}:
    raise ValueError(f"PORT_HOPPER_BWD_FUSED_DQ={_fused_env!r} names no form of the Hopper backward: set it to 0 (two "
                     "kernels, no atomics), 1, 2 or 3 (the default), or unset it")
HOPPER_BWD_FUSED_DQ = int(_fused_env)
HOPPER_BWD_FUSED_HEAD_DIMS = (64, 128)
HOPPER_BWD_FUSED_BUFFERS = 3
# head dims at which forms 2 and 3 split dQ's matmul between the math warpgroups (FlashAttention-3's
# backward): every tile each computes dQ for its half of the head dim over the program's 128 keys
# (a [64, D / 2] dQ tile beside dK and dV). Form 3 keys down (below); form 2 queries down (a row's
# lse in two registers, P and dS read from shared memory: _hopper_bwd_split_consumer). At D 64 the
# queries-down split took 17.4 (form 2) and 14.9 ms (form 3) against the unsplit form 3's 13.7, the
# keys-down one 12.63 against 13.38 (causal 32K on an H200; a window's 4 % slower there).
HOPPER_BWD_DQ_SPLIT_HEAD_DIMS = (64, 128)
# form 3's split keys down (FlashAttention-3's and FA4's layout: S^T, P^T and dS^T in registers, P^T
# and dS^T the register operands of dV and dK, only dS^T through shared memory), with their hand-off:
# named barriers between the warpgroups, a dQ warp issuing the reduce-adds, dQ staged in its
# registers' order (_hopper_bwd_keys_consumer). False: queries down. On an H200 (causal 32K, D 128,
# backward alone): 22.26 ms against 24.89-25.33 queries down (earlier runs); the same split with
# mbarriers, dQ staged by the math warpgroups and its reduce-adds issued there took 25.61 in the same
# run. At D 64: 12.63 against 13.38 for the unsplit keys-down form 3 (docs/benchmarks.md).
HOPPER_BWD_SPLIT_KEYS_DOWN = True
# the keys-down split persistent: one program per SM takes work items (128 keys of a (batch entry,
# kv head), head by head) from the call's counter, and its load warp loads an item's K and V while
# the math warpgroups still store the last item's dK and dV. On an H200 (backward alone, 32K, ms,
# persistent against one item a program, one run): D 128 causal 19.52 / 19.61, 8 docs 2.92 / 3.07,
# window 1024 1.86 / 1.96; D 64 causal 12.78 / 12.94, 8 docs 2.02 / 2.11, window 1.26 / 1.33. Items
# dealt round robin instead of from the counter: D 128 causal 23.13, 8 docs 3.34 (docs/benchmarks.md).
HOPPER_BWD_PERSISTENT = True
# the keys-down forms compute P^T as soon as S^T is done, while dP^T still runs (FA4's order). On an
# H200 (causal 32K, backward alone): D 64 form 3 13.37 ms against 13.86 without it. (The same order
# in the queries-down split at D 128 was slower: 25.44-26.51 against 24.94; not there.)
HOPPER_BWD_EARLY_P = True
_HOPPER_BWD_FAILED: dict = {}
# A TMA reduce-add (cp.reduce.async.bulk.tensor ... .add: a shared-memory tile added into global
# memory by the copy engine, FlashAttention-3's way of summing dq). Gluon 3.6 has no public call for
# it on Hopper; its op builder does (`create_async_tma_reduce`, what Triton's descriptor atomic_add
# lowers to). Used only by HOPPER_BWD_FUSED_DQ = 3, and only where that builder call exists.
_HAS_TMA_REDUCE = False
if _HAS_GLUON:
    try:
        from triton._C.libtriton import ir as _triton_ir
        from triton.experimental.gluon.language._core import builtin as _gluon_builtin

        _HAS_TMA_REDUCE = hasattr(_triton_ir, "DESCRIPTOR_REDUCE_KIND")
    except ImportError:
        pass
if _HAS_TMA_REDUCE:

    @_gluon_builtin
    def _tma_reduce_add(desc, coord, src, _semantic=None):
        # src (a shared-memory tile) added into desc's tile at coord, asynchronously (tma.store_wait)
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(_triton_ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, coord, src.handle)

if _HAS_GLUON and HOPPER_MODS is None:

    @gluon.jit
    def _bwd_stage_stats(Lse2, Delta, lse_smem, dl_smem, slot, row0):
        # the load warp: a tile's lse2 and delta (flat rows row0 .. row0 + BLOCK_M) into ring slot `slot`
        BLOCK_M: gl.constexpr = lse_smem.type.shape[1]
        offs = row0 + gl.arange(0, BLOCK_M, layout=gl.BlockedLayout([2], [32], [1], [0]))
        lse_smem.index(slot).store(gl.load(Lse2 + offs))
        dl_smem.index(slot).store(gl.load(Delta + offs))

    @gluon.jit
    def _bwd_column(b, h, col, c_tb, c_th, full_num, partial_num):
        # the column lists' line of keys block `col` of (batch entry b, head h): (line, full query
        # blocks, all query blocks)
        line = b * c_tb + h * c_th + col
        n_f = gl.load(full_num + line)
        return line, n_f, n_f + gl.load(partial_num + line)

    @gluon.jit
    def _bwd_column_row(j, n_f, line, n_rows, full_idx, partial_idx):
        # the j-th query block of a column lists' line: its n_f full blocks first, then its partial ones
        return gl.load(gl.where(j < n_f, full_idx + line * n_rows + j, partial_idx + line * n_rows + (j - n_f)))

    @gluon.jit
    def _hopper_bwd_qdo_producer(q_desc, do_desc, q_smem, do_smem, ready, empty, b, kv_h, col, Hq, group, Lq,
                                 c_tb, c_th, n_rows, partial_num, partial_idx, full_num, full_idx,
                                 TABLE_M: gl.constexpr):
        # the load warp of the dk / dv kernel: for every query head of the group and every block
        # of queries its column lists name (full ones, then partial ones), that block's tiles of Q
        # and dO into the next buffer of the ring, once the math warps have released it
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
        SUB: gl.constexpr = TABLE_M // BLOCK_M
        NUM_BUF: gl.constexpr = q_smem.type.shape[0]
        nbytes: gl.constexpr = 2 * q_desc.block_type.nbytes
        count = 0
        for g in range(0, group):
            h = kv_h * group + g
            line, n_f, n_blocks = _bwd_column(b, h, col, c_tb, c_th, full_num, partial_num)
            for j in range(0, n_blocks):
                r = _bwd_column_row(j, n_f, line, n_rows, full_idx, partial_idx)
                row = (b * Hq + h) * Lq + r * TABLE_M
                for sub in gl.static_range(SUB):
                    slot = count % NUM_BUF
                    mbarrier.wait(empty.index(slot), ((count // NUM_BUF) & 1) ^ 1)
                    mbarrier.expect(ready.index(slot), nbytes)
                    tma.async_copy_global_to_shared(q_desc, [row + sub * BLOCK_M, 0], ready.index(slot),
                                                    q_smem.index(slot))
                    tma.async_copy_global_to_shared(do_desc, [row + sub * BLOCK_M, 0], ready.index(slot),
                                                    do_smem.index(slot))
                    count += 1

    # Named barriers (_bar_sync / _bar_arrive, templates/hopper.py: how FlashAttention-3 hands
    # tiles between warpgroups without an mbarrier round trip), for the keys-down split; this
    # kernel's own ids (the forward's are another kernel's).
    _BAR_PDS = gl.constexpr(8)  # both math warpgroups' halves of dS^T written (256 threads)
    _BAR_DQ_EMPTY = gl.constexpr(9)  # + WG: the warpgroup's dQ staging tile read by its reduce-add (128 + 32)
    _BAR_DQ_FULL = gl.constexpr(11)  # + WG: the warpgroup's dQ staged (128 + 32)

    @gluon.jit
    def _hopper_bwd_keys_producer(k_desc, v_desc, q_desc, do_desc, kv_smem, kv_bar, kv_free, q_smem, do_smem, ready,
                                  empty, meta_smem, counter, first, total, n_cols, Hkv, Hq, group, Lq, Lk, c_tb, c_th,
                                  n_rows, partial_num, partial_idx, full_num, full_idx, Lse2, Delta, lse_smem,
                                  dl_smem, TABLE_M: gl.constexpr, TABLE_N: gl.constexpr, PERSISTENT: gl.constexpr):
        # the load warp of the keys-down split: for each of the program's work items (128 keys of a
        # (batch entry, kv head)), that item's tiles of Q and dO (and their lse and delta) into the
        # ring as the math warps release slots, and, right after its first tile's, the item's K and
        # V, once both math warpgroups have released the last item's (`kv_free`). An item with no
        # tile takes a slot of its own, with no copy and dQ chunk -1. Each slot also carries its
        # item's number and its dQ chunk (`meta_smem`: the math warpgroups and the dQ warp read them);
        # past the last item a slot carries `total` and no tile. PERSISTENT: items come from the call's
        # counter (an atomic add: programs that finish early take more); else the one item `first`.
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
        SUB: gl.constexpr = TABLE_M // BLOCK_M
        NUM_BUF: gl.constexpr = q_smem.type.shape[0]
        nbytes: gl.constexpr = 2 * q_desc.block_type.nbytes
        kv_bytes: gl.constexpr = 2 * k_desc.block_type.nbytes
        meta_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        count = 0
        kv_count = 0
        if PERSISTENT:
            it = gl.atomic_add(counter, 1)
        else:
            it = first
        while it < total:
            col = it % n_cols  # (items head by head, each head's first keys first)
            bkh = it // n_cols
            b = bkh // Hkv
            kv_h = bkh % Hkv
            pending = 1
            for g in range(0, group):
                h = kv_h * group + g
                line, n_f, n_blocks = _bwd_column(b, h, col, c_tb, c_th, full_num, partial_num)
                for j in range(0, n_blocks):
                    r = _bwd_column_row(j, n_f, line, n_rows, full_idx, partial_idx)
                    row = (b * Hq + h) * Lq + r * TABLE_M
                    for sub in gl.static_range(SUB):
                        slot = count % NUM_BUF
                        mbarrier.wait(empty.index(slot), ((count // NUM_BUF) & 1) ^ 1)
                        _bwd_stage_stats(Lse2, Delta, lse_smem, dl_smem, slot, row + sub * BLOCK_M)
                        meta_smem.index(slot).store(gl.full([32], it, gl.int32, layout=meta_layout))
                        meta_smem.index(NUM_BUF + slot).store(gl.full([32], (row + sub * BLOCK_M) // BLOCK_M * 2,
                                                                      gl.int32, layout=meta_layout))
                        gl.thread_barrier()
                        mbarrier.expect(ready.index(slot), nbytes)
                        tma.async_copy_global_to_shared(q_desc, [row + sub * BLOCK_M, 0], ready.index(slot),
                                                        q_smem.index(slot))
                        tma.async_copy_global_to_shared(do_desc, [row + sub * BLOCK_M, 0], ready.index(slot),
                                                        do_smem.index(slot))
                        if pending != 0:
                            mbarrier.wait(kv_free, (kv_count & 1) ^ 1)
                            mbarrier.expect(kv_bar, kv_bytes)
                            tma.async_copy_global_to_shared(k_desc, [bkh * Lk + col * TABLE_N, 0], kv_bar,
                                                            kv_smem.index(0))
                            tma.async_copy_global_to_shared(v_desc, [bkh * Lk + col * TABLE_N, 0], kv_bar,
                                                            kv_smem.index(1))
                            pending = 0
                            kv_count += 1
                        count += 1
            if pending != 0:  # (no tile: the item goes alone in a slot with chunk -1, for its zeros)
                slot = count % NUM_BUF
                mbarrier.wait(empty.index(slot), ((count // NUM_BUF) & 1) ^ 1)
                meta_smem.index(slot).store(gl.full([32], it, gl.int32, layout=meta_layout))
                meta_smem.index(NUM_BUF + slot).store(gl.full([32], -1, gl.int32, layout=meta_layout))
                gl.thread_barrier()
                mbarrier.arrive(ready.index(slot), count=1)
                count += 1
            if PERSISTENT:
                it = gl.atomic_add(counter, 1)
            else:
                it = total
        slot = count % NUM_BUF  # (the end: `total` and no tile)
        mbarrier.wait(empty.index(slot), ((count // NUM_BUF) & 1) ^ 1)
        meta_smem.index(slot).store(gl.full([32], total, gl.int32, layout=meta_layout))
        gl.thread_barrier()
        mbarrier.arrive(ready.index(slot), count=1)

    @gluon.jit
    def _hopper_bwd_dq_writer(dq_desc, dq_smem, ready, meta_smem, total):
        # the dQ warp of the keys-down split: the tiles in the consumers' order, each one's dQ chunk
        # read from its ring slot (the slot cannot be loaded again before this warp hands the tile's
        # staging tiles over); each tile, each math warpgroup's staged dQ (flat, in its registers'
        # order) added into the float32 dq by one reduce-add of the copy engine, and both staging
        # tiles handed back once the engine has read them
        ROWS: gl.constexpr = dq_desc.block_type.shape[0]
        NUM_BUF: gl.constexpr = ready.type.shape[0]
        meta_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        count = 0
        mbarrier.wait(ready.index(0), 0)
        it = gl.max(meta_smem.index(0).load(meta_layout), 0)
        while it < total:
            slot = count % NUM_BUF
            chunk = gl.max(meta_smem.index(NUM_BUF + slot).load(meta_layout), 0)
            if chunk >= 0:  # (-1: an item with no tile)
                tma.store_wait(0)  # (the last tile's reduce-adds have read both staging tiles)
                _bar_arrive(_BAR_DQ_EMPTY, 160)
                _bar_arrive(_BAR_DQ_EMPTY + 1, 160)
                _bar_sync(_BAR_DQ_FULL, 160)
                _tma_reduce_add(dq_desc, [chunk * ROWS, 0], dq_smem.index(0))
                _bar_sync(_BAR_DQ_FULL + 1, 160)
                _tma_reduce_add(dq_desc, [(chunk + 1) * ROWS, 0], dq_smem.index(1))
            count += 1
            slot = count % NUM_BUF
            mbarrier.wait(ready.index(slot), (count // NUM_BUF) & 1)
            it = gl.max(meta_smem.index(slot).load(meta_layout), 0)
        tma.store_wait(0)

    @gluon.jit
    def _hopper_bwd_store_dkdv(DK, DV, dk, dv, bkh, n0, Lk):
        # a math warpgroup's dK and dV (keys n0 .. n0 + 64 of kv head row bkh, float32 in its
        # matmul layout) into DK and DV in their dtype
        BLOCK_N: gl.constexpr = dk.shape[0]
        HEAD_D: gl.constexpr = dk.shape[1]
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, dk.type.layout))
        offs_d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, dk.type.layout))
        out = (bkh.to(gl.int64) * Lk + offs_n)[:, None] * HEAD_D + offs_d[None, :]
        gl.store(DK + out, dk.to(DK.dtype.element_ty))
        gl.store(DV + out, dv.to(DV.dtype.element_ty))

    @gluon.jit
    def _hopper_bwd_keys_consumer(kv_smem, kv_bar, kv_free, q_smem, do_smem, ready, empty, ds_smem, dq_smem, lse_smem,
                                  dl_smem, meta_smem, DK, DV, total, n_cols, Hkv, Hq, group, Lq, Lk, c_tb, c_th,
                                  n_rows, partial_num, partial_idx, full_num, full_idx, sm_scale, @@ALL_PTR_PARAMS@@
                                  TABLE_M: gl.constexpr, TABLE_N: gl.constexpr, WG: gl.constexpr,
                                  HAS_SCORE: gl.constexpr):
        # A math warpgroup of the keys-down split (FlashAttention-3's and FA4's Hopper backward; form
        # 3's default at D 64 and 128): keys WG * 64 .. WG * 64 + 64 of the program's 128 down the
        # rows, queries across; dK and dV (64 x D each, float32) stay in registers. Per tile of 64
        # queries (Q, dO, lse and delta in ring slot `slot`, from the load warp):
        #   S^T = K Q^T, dP^T = V dO^T (wgmma from shared memory); the tile's lse is read while they run
        #   P^T = exp2(S^T * c - lse2) (the mask on partial blocks), as soon as S^T is done
        #   dS^T = P^T (dP^T - delta) * scale
        #   (HAS_SCORE: P^T = exp2(score_mod(S^T * scale) * log2(e) - lse2), and dS^T takes the
        #   score_mod's derivative at S^T * scale, 0 where P^T is)
        #   dS^T into this warpgroup's half of the [128 keys, 64 queries] tile of parity count % 2
        #   dV += P^T dO (P^T a register operand), then one named barrier: both halves written
        #   dQ[:, half] = dS K[:, half] over all 128 keys (this warpgroup's half of the head dim), then
        #   dK += dS^T Q (dS^T a register operand); once dQ is done it is staged flat for the dQ warp,
        #   which adds it into the float32 dq, while dK still runs
        # No wait guards the dS^T tile: a warpgroup reaches tile i + 2's write of that parity only
        # after both passed tile i + 1's barrier, which each reaches after its tile-i dQ matmul ended.
        # K's and V's views are made again each tile from an index the compiler cannot prove is 0
        # (it is): else it holds their matmuls' 16 descriptors across the loop and spills them (on an
        # H200 the reloads before each matmul cost 1.25 of 23.96 ms on causal 32K).
        # Work items come through the ring: each item's number in `meta_smem` with its first tile
        # (`total` past the last); after an item, its dK and dV are stored and `kv_free` released.
        BLOCK_N: gl.constexpr = kv_smem.type.shape[1] // 2
        HEAD_D: gl.constexpr = kv_smem.type.shape[2]
        HALF_D: gl.constexpr = HEAD_D // 2
        J: gl.constexpr = HALF_D // 8
        num_warps: gl.constexpr = 4
        BLOCK_M: gl.constexpr = q_smem.type.shape[1]
        NUM_BUF: gl.constexpr = q_smem.type.shape[0]
        SUB: gl.constexpr = TABLE_M // BLOCK_M
        dtype: gl.constexpr = kv_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_M, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, HEAD_D, 16])
        h_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, HALF_D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        c = sm_scale * 1.4426950408889634
        zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
        zero_h = gl.zeros([BLOCK_M, HALF_D], gl.float32, layout=h_layout)
        meta_layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        count = 0
        kv_count = 0
        mbarrier.wait(ready.index(0), 0)  # (the items come with their first tiles: `meta_smem`)
        it = gl.max(meta_smem.index(0).load(meta_layout), 0)
        while it < total:
            col = it % n_cols  # (items head by head, each head's first keys first)
            bkh = it // n_cols
            b = bkh // Hkv
            kv_h = bkh % Hkv
            dk = gl.zeros([BLOCK_N, HEAD_D], gl.float32, layout=o_layout)
            dv = gl.zeros([BLOCK_N, HEAD_D], gl.float32, layout=o_layout)
            n0 = col * TABLE_N + WG * BLOCK_N
            kv_idx = (n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout)))[:, None]
            start = count
            for g in range(0, group):
                h = kv_h * group + g
                line, n_f, n_blocks = _bwd_column(b, h, col, c_tb, c_th, full_num, partial_num)
                for j in range(0, n_blocks):
                    full = j < n_f
                    r = _bwd_column_row(j, n_f, line, n_rows, full_idx, partial_idx)
                    for sub in gl.static_range(SUB):
                        slot = count % NUM_BUF
                        buf = count % 2
                        zero = count >> 30
                        k_live = kv_smem.index(zero)
                        k_part = k_live.slice(WG * BLOCK_N, BLOCK_N)
                        v_part = kv_smem.index(zero + 1).slice(WG * BLOCK_N, BLOCK_N)
                        k_half = k_live.slice(WG * HALF_D, HALF_D, dim=1)
                        if count == start:  # (the item's K and V, loaded with its first tile)
                            mbarrier.wait(kv_bar, kv_count & 1)
                        mbarrier.wait(ready.index(slot), (count // NUM_BUF) & 1)
                        st = warpgroup_mma(k_part, q_smem.index(slot).permute((1, 0)), zero_s, use_acc=False,
                                           is_async=True)
                        dpt = warpgroup_mma(v_part, do_smem.index(slot).permute((1, 0)), zero_s, use_acc=False,
                                            is_async=True)
                        lse2 = lse_smem.index(slot).load(gl.SliceLayout(0, s_layout))
                        st = warpgroup_mma_wait(num_outstanding=1, deps=(st, ))  # dP^T may still run
                        # rows that keep nothing have lse2 = +inf: their p is exactly 0
                        if HAS_SCORE:  # (the score_mod sees every pair: the query indices of each tile)
                            q_idx = (r * TABLE_M + sub * BLOCK_M
                                     + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout)))[None, :]
                            x = st * sm_scale
                            s = score_mod_gluon(x, b, h, q_idx, kv_idx@@SCORE_PTR_ARGS@@)
                            pt = gl.exp2(s * 1.4426950408889634 - lse2[None, :])
                        else:
                            pt = gl.exp2(gl.fma(st, c, -lse2[None, :]))
                        if not full:  # (the columns' query indices made here, not held over the loop)
                            rows = (r * TABLE_M + sub * BLOCK_M
                                    + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout)))
                            keep = mask_mod_gluon(b, h, rows[None, :], kv_idx@@MASK_PTR_ARGS@@) != 0
                            pt = gl.where(keep, pt, 0.0)
                        if HAS_SCORE:  # p times the derivative while dP^T runs (where p is 0 the pair adds
                            # nothing, whatever the derivative is there: a score_mod that sends a pair
                            # to -inf may have an infinite one)
                            grad = score_grad_gluon(x, b, h, q_idx, kv_idx@@GRAD_PTR_ARGS@@)
                            pg = gl.where(pt == 0.0, 0.0, pt * grad * sm_scale)
                        dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt, ))
                        delta = dl_smem.index(slot).load(gl.SliceLayout(0, s_layout))
                        if HAS_SCORE:
                            dst = pg * (dpt - delta[None, :])
                        else:
                            dst = pt * (dpt - delta[None, :]) * sm_scale
                        pt_op = gl.convert_layout(pt.to(dtype), p_layout)
                        dst_op = gl.convert_layout(dst.to(dtype), p_layout)
                        ds_smem.index(buf).slice(WG * BLOCK_N, BLOCK_N).store(dst.to(dtype))
                        fence_async_shared()
                        dv = warpgroup_mma(pt_op, do_smem.index(slot), dv, is_async=True)
                        _bar_sync(_BAR_PDS, 256)
                        dq = warpgroup_mma(ds_smem.index(buf).permute((1, 0)), k_half, zero_h, use_acc=False,
                                           is_async=True)
                        dk = warpgroup_mma(dst_op, q_smem.index(slot), dk, is_async=True)
                        dq = warpgroup_mma_wait(num_outstanding=1, deps=(dq, ))  # dV and dQ done; dK may run
                        # dQ in its registers' order: element (row, col), row = 16 w + 8 h + lh (warp w,
                        # lane 4 lh + ll), col = 8 j + 2 ll + p, goes to j * 512 + (32 w + 4 lh + ll) * 4
                        # + 2 h + p of a flat chunk: a thread's four values of a column group side by side
                        # (one 16-byte store each), no shuffle (_dq_unflat puts the sum back in order)
                        flat = gl.reshape(gl.permute(gl.reshape(dq, [4, 2, 8, J, 4, 2]), [3, 0, 2, 4, 1, 5]),
                                          [2 * J, 256])
                        _bar_sync(_BAR_DQ_EMPTY + WG, 160)
                        dq_smem.index(WG).store(flat)
                        fence_async_shared()
                        _bar_arrive(_BAR_DQ_FULL + WG, 160)
                        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
                        mbarrier.arrive(empty.index(slot), count=1)
                        count += 1
            if count > start:  # (this warpgroup is done with the item's K and V)
                mbarrier.arrive(kv_free, count=1)
                kv_count += 1
            else:  # (an item with no tile came alone in a slot: hand the slot back, store zeros)
                mbarrier.arrive(empty.index(count % NUM_BUF), count=1)
                count += 1
            _hopper_bwd_store_dkdv(DK, DV, dk, dv, bkh, n0, Lk)
            slot = count % NUM_BUF  # (the next item's first tile, or the end)
            mbarrier.wait(ready.index(slot), (count // NUM_BUF) & 1)
            it = gl.max(meta_smem.index(slot).load(meta_layout), 0)

    @gluon.jit
    def _hopper_bwd_dkdv_consumer(k_smem, v_smem, kv_bar, q_smem, do_smem, ready, empty, ds_smem, ds_full, ds_free,
                                  dq_smem, dq_desc, DK, DV, DQ_acc,
                                  Lse2, Delta, b, kv_h, bkh, col, Hq, group, Lq, Lk, c_tb, c_th, n_rows,
                                  partial_num, partial_idx, full_num, full_idx, sm_scale, @@ALL_PTR_PARAMS@@
                                  TABLE_M: gl.constexpr, TABLE_N: gl.constexpr, WG: gl.constexpr,
                                  OVERLAP: gl.constexpr, FUSED_DQ: gl.constexpr, EARLY_P: gl.constexpr = False):
        # one of the dk / dv kernel's two math warpgroups: keys WG * 64 .. WG * 64 + 64 of the
        # program's 128 (each warpgroup keeps its own dK and dV, 64 x D each, in registers). Per
        # tile of BLOCK_M queries: S^T = K Q^T and dP^T = V dO^T, P^T = exp2(S^T * c - lse2) (the
        # mask on partial blocks), dS^T = P^T (dP^T - delta) * scale, then dV += P^T dO and
        # dK += dS^T Q, issued behind the next tile's S^T and dP^T (FlashAttention-3's overlap); a
        # buffer goes back to the load warp when both warpgroups' dV and dK have read it, a tile
        # later (so the ring needs three buffers or more to load ahead). FUSED_DQ (in turn only):
        # also dQ += dS K for this warpgroup's 64 keys, dS^T written to shared memory and read back
        # transposed by the matmul, the product added into a float32 dQ with atomic adds. FUSED_DQ 2:
        # both warpgroups write their dS^T into the two halves of one [128 keys, 64 queries] tile
        # (two such tiles, one per tile parity: `ds_full` when both halves are written, `ds_free`
        # when its dQ matmul has read it), and warpgroup `count % 2` computes dQ = dS K over the 128
        # keys and adds it. EARLY_P (without OVERLAP): P^T is computed as soon as S^T is done, while
        # dP^T still runs.
        BLOCK_N: gl.constexpr = k_smem.type.shape[0] // 2
        HEAD_D: gl.constexpr = k_smem.type.shape[1]
        num_warps: gl.constexpr = 4
        BLOCK_M: gl.constexpr = q_smem.type.shape[1]
        NUM_BUF: gl.constexpr = q_smem.type.shape[0]
        SUB: gl.constexpr = TABLE_M // BLOCK_M
        dtype: gl.constexpr = k_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_M, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, HEAD_D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        c = sm_scale * 1.4426950408889634
        dk = gl.zeros([BLOCK_N, HEAD_D], gl.float32, layout=o_layout)
        dv = gl.zeros([BLOCK_N, HEAD_D], gl.float32, layout=o_layout)
        zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
        zero_q = gl.zeros([BLOCK_M, HEAD_D], gl.float32, layout=o_layout)  # (FUSED_DQ: BLOCK_M = BLOCK_N = 64)
        offs_d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))
        k_part = k_smem.slice(WG * BLOCK_N, BLOCK_N)
        v_part = v_smem.slice(WG * BLOCK_N, BLOCK_N)
        n0 = col * TABLE_N + WG * BLOCK_N
        kv_idx = (n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout)))[:, None]
        cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
        # the first tile's dV / dK step multiplies zeros (there is no tile before it): + 0 changes no bit
        pt_op = gl.zeros([BLOCK_N, BLOCK_M], dtype, layout=p_layout)
        dst_op = gl.zeros([BLOCK_N, BLOCK_M], dtype, layout=p_layout)
        prev = 0
        mbarrier.wait(kv_bar, 0)
        count = 0
        for g in range(0, group):
            h = kv_h * group + g
            bh = b * Hq + h
            line, n_f, n_blocks = _bwd_column(b, h, col, c_tb, c_th, full_num, partial_num)
            for j in range(0, n_blocks):
                full = j < n_f
                r = _bwd_column_row(j, n_f, line, n_rows, full_idx, partial_idx)
                for sub in gl.static_range(SUB):
                    slot = count % NUM_BUF
                    rows = r * TABLE_M + sub * BLOCK_M + cols
                    lse2 = gl.load(Lse2 + bh.to(gl.int64) * Lq + rows)
                    delta = gl.load(Delta + bh.to(gl.int64) * Lq + rows)
                    mbarrier.wait(ready.index(slot), (count // NUM_BUF) & 1)
                    # this tile's S^T and dP^T, then the previous tile's dV and dK behind them: the
                    # softmax part below runs while those two matmuls hold the tensor cores
                    st = warpgroup_mma(k_part, q_smem.index(slot).permute((1, 0)), zero_s, use_acc=False,
                                       is_async=True)
                    dpt = warpgroup_mma(v_part, do_smem.index(slot).permute((1, 0)), zero_s, use_acc=False,
                                        is_async=True)
                    if OVERLAP:
                        dv = warpgroup_mma(pt_op, do_smem.index(prev), dv, is_async=True)
                        dk = warpgroup_mma(dst_op, q_smem.index(prev), dk, is_async=True)
                        st, dpt = warpgroup_mma_wait(num_outstanding=2, deps=(st, dpt))
                    elif EARLY_P:
                        st = warpgroup_mma_wait(num_outstanding=1, deps=(st, ))  # dP^T may still run
                    else:
                        st, dpt = warpgroup_mma_wait(num_outstanding=0, deps=(st, dpt))
                    # rows that keep nothing have lse2 = +inf: their p is exactly 0
                    pt = gl.exp2(gl.fma(st, c, -lse2[None, :]))
                    if not full:
                        keep = mask_mod_gluon(b, h, rows[None, :], kv_idx@@MASK_PTR_ARGS@@) != 0
                        pt = gl.where(keep, pt, 0.0)
                    if EARLY_P and not OVERLAP:
                        dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt, ))
                    dst = pt * (dpt - delta[None, :]) * sm_scale
                    pt_op = gl.convert_layout(pt.to(dtype), p_layout)
                    dst_op = gl.convert_layout(dst.to(dtype), p_layout)
                    if OVERLAP:
                        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
                        mbarrier.arrive(empty.index(prev), count=1, pred=count > 0)  # the previous tile's buffer
                    elif FUSED_DQ >= 2:
                        buf = count % 2
                        mbarrier.wait(ds_free.index(buf), ((count // 2) & 1) ^ 1)
                        ds_smem.index(buf).slice(WG * BLOCK_N, BLOCK_N).store(dst.to(dtype))
                        fence_async_shared()
                        gl.thread_barrier()
                        mbarrier.arrive(ds_full.index(buf), count=1)
                        if buf == WG:  # (this warpgroup's turn: both halves of dS^T written first)
                            mbarrier.wait(ds_full.index(buf), (count // 2) & 1)
                            dv = warpgroup_mma(pt_op, do_smem.index(slot), dv, is_async=True)
                            dk = warpgroup_mma(dst_op, q_smem.index(slot), dk, is_async=True)
                            dq = warpgroup_mma(ds_smem.index(buf).permute((1, 0)), k_smem, zero_q, use_acc=False,
                                               is_async=True)
                            dv, dk, dq = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, dq))
                            mbarrier.arrive(ds_free.index(buf), count=1)
                            mbarrier.arrive(empty.index(slot), count=1)
                            if FUSED_DQ == 3:
                                # the sum by the copy engine: dQ into this warpgroup's staging tile,
                                # then one TMA reduce-add of the tile into the float32 dq
                                staging = dq_smem.index(WG)
                                tma.store_wait(0)  # (this warpgroup's previous reduce has read its staging tile)
                                gl.thread_barrier()
                                staging.store(dq)
                                fence_async_shared()
                                gl.thread_barrier()
                                _tma_reduce_add(dq_desc, [bh * Lq + r * TABLE_M + sub * BLOCK_M, 0], staging)
                            else:
                                q_rows = r * TABLE_M + sub * BLOCK_M + gl.arange(0, BLOCK_M,
                                                                               layout=gl.SliceLayout(1, o_layout))
                                gl.atomic_add(DQ_acc + (bh.to(gl.int64) * Lq + q_rows)[:, None] * HEAD_D
                                              + offs_d[None, :], dq, sem="relaxed")
                        else:
                            dv = warpgroup_mma(pt_op, do_smem.index(slot), dv, is_async=True)
                            dk = warpgroup_mma(dst_op, q_smem.index(slot), dk, is_async=True)
                            dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
                            mbarrier.arrive(empty.index(slot), count=1)
                    elif FUSED_DQ:
                        ds_part = ds_smem.index(WG)
                        ds_part.store(dst.to(dtype))
                        fence_async_shared()
                        dv = warpgroup_mma(pt_op, do_smem.index(slot), dv, is_async=True)
                        dk = warpgroup_mma(dst_op, q_smem.index(slot), dk, is_async=True)
                        dq = warpgroup_mma(ds_part.permute((1, 0)), k_part, zero_q, use_acc=False, is_async=True)
                        dv, dk, dq = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, dq))
                        mbarrier.arrive(empty.index(slot), count=1)
                        q_rows = r * TABLE_M + sub * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
                        gl.atomic_add(DQ_acc + (bh.to(gl.int64) * Lq + q_rows)[:, None] * HEAD_D + offs_d[None, :], dq,
                                      sem="relaxed")
                    else:
                        dv = warpgroup_mma(pt_op, do_smem.index(slot), dv, is_async=True)
                        dk = warpgroup_mma(dst_op, q_smem.index(slot), dk, is_async=True)
                        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
                        mbarrier.arrive(empty.index(slot), count=1)
                    prev = slot
                    count += 1
        if OVERLAP and count > 0:  # the last tile's dV and dK
            dv = warpgroup_mma(pt_op, do_smem.index(prev), dv, is_async=True)
            dk = warpgroup_mma(dst_op, q_smem.index(prev), dk, is_async=True)
            dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
        if FUSED_DQ == 3:
            tma.store_wait(0)  # (the last reduce has read its staging tile)
        _hopper_bwd_store_dkdv(DK, DV, dk, dv, bkh, n0, Lk)

    @gluon.jit
    def _hopper_bwd_split_consumer(k_smem, v_smem, kv_bar, q_smem, do_smem, ready, empty, ds_smem, ds_full, ds_free,
                                   p_smem, dq_smem, dq_desc, DK, DV, DQ_acc,
                                   Lse2, Delta, b, kv_h, bkh, col, Hq, group, Lq, Lk, c_tb, c_th, n_rows,
                                   partial_num, partial_idx, full_num, full_idx, sm_scale, @@ALL_PTR_PARAMS@@
                                   TABLE_M: gl.constexpr, TABLE_N: gl.constexpr, WG: gl.constexpr,
                                   FUSED_DQ: gl.constexpr):
        # A math warpgroup of the fused forms with dQ's matmul split (DQ_SPLIT, FlashAttention-3's
        # backward at D 128): keys WG * 64 .. WG * 64 + 64 of the program's 128, dK and dV (64 x D
        # each) in registers. Queries down, keys across, so a row's lse and delta are two registers
        # a thread (keys down they are sixteen each, and a warpgroup's registers do not hold them
        # beside dK and dV at D 128). Per tile of 64 queries:
        #   S = Q K^T and dP = dO V^T (wgmma), P = exp2(S * c - lse2) (the mask on partial blocks),
        #   dS = P (dP - delta) * scale;
        #   P and dS into shared memory (P into this warpgroup's tile, dS into its half of the columns
        #   of the tile both warpgroups share: [64 queries, 128 keys]), then dV += P^T dO and
        #   dK += dS^T Q, read transposed from shared memory;
        #   once both halves of dS are written (`ds_full`), dQ[:, half] = dS K[:, half]: each warpgroup
        #   computes its half of the head dim over all 128 keys, and adds it into the float32 dq
        #   (atomic adds; FUSED_DQ 3: one TMA reduce-add of a staged tile). `ds_free` when both
        #   warpgroups' dQ matmuls have read the tile; two such tiles, alternating.
        BLOCK_N: gl.constexpr = k_smem.type.shape[0] // 2
        HEAD_D: gl.constexpr = k_smem.type.shape[1]
        HALF_D: gl.constexpr = HEAD_D // 2
        num_warps: gl.constexpr = 4
        BLOCK_M: gl.constexpr = q_smem.type.shape[1]
        NUM_BUF: gl.constexpr = q_smem.type.shape[0]
        SUB: gl.constexpr = TABLE_M // BLOCK_M
        dtype: gl.constexpr = k_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, HEAD_D, 16])
        h_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, HALF_D, 16])
        c = sm_scale * 1.4426950408889634
        dk = gl.zeros([BLOCK_N, HEAD_D], gl.float32, layout=o_layout)
        dv = gl.zeros([BLOCK_N, HEAD_D], gl.float32, layout=o_layout)
        zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        zero_h = gl.zeros([BLOCK_M, HALF_D], gl.float32, layout=h_layout)
        k_part = k_smem.slice(WG * BLOCK_N, BLOCK_N)
        v_part = v_smem.slice(WG * BLOCK_N, BLOCK_N)
        k_half = k_smem.slice(WG * HALF_D, HALF_D, dim=1)
        p_part = p_smem.index(WG)
        n0 = col * TABLE_N + WG * BLOCK_N
        kv_idx = (n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)))[None, :]
        cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        mbarrier.wait(kv_bar, 0)
        count = 0
        for g in range(0, group):
            h = kv_h * group + g
            bh = b * Hq + h
            line, n_f, n_blocks = _bwd_column(b, h, col, c_tb, c_th, full_num, partial_num)
            for j in range(0, n_blocks):
                full = j < n_f
                r = _bwd_column_row(j, n_f, line, n_rows, full_idx, partial_idx)
                for sub in gl.static_range(SUB):
                    slot = count % NUM_BUF
                    buf = count % 2
                    q0 = r * TABLE_M + sub * BLOCK_M
                    rows = q0 + cols
                    lse2 = gl.load(Lse2 + bh.to(gl.int64) * Lq + rows)
                    delta = gl.load(Delta + bh.to(gl.int64) * Lq + rows)
                    mbarrier.wait(ready.index(slot), (count // NUM_BUF) & 1)
                    s = warpgroup_mma(q_smem.index(slot), k_part.permute((1, 0)), zero_s, use_acc=False, is_async=True)
                    dp = warpgroup_mma(do_smem.index(slot), v_part.permute((1, 0)), zero_s, use_acc=False,
                                       is_async=True)
                    s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp))
                    # rows that keep nothing have lse2 = +inf: their p is exactly 0
                    p = gl.exp2(gl.fma(s, c, -lse2[:, None]))
                    if not full:
                        keep = mask_mod_gluon(b, h, rows[:, None], kv_idx@@MASK_PTR_ARGS@@) != 0
                        p = gl.where(keep, p, 0.0)
                    ds = p * (dp - delta[:, None]) * sm_scale
                    p_part.store(p.to(dtype))  # (this warpgroup's dV matmul of the last tile has read it)
                    mbarrier.wait(ds_free.index(buf), ((count // 2) & 1) ^ 1)
                    ds_part = ds_smem.index(buf).slice(WG * BLOCK_N, BLOCK_N, dim=1)
                    ds_part.store(ds.to(dtype))
                    fence_async_shared()
                    gl.thread_barrier()
                    mbarrier.arrive(ds_full.index(buf), count=1)
                    # dV and dK first: the tensor cores run them while the other warpgroup writes
                    # its half of dS
                    dv = warpgroup_mma(p_part.permute((1, 0)), do_smem.index(slot), dv, is_async=True)
                    dk = warpgroup_mma(ds_part.permute((1, 0)), q_smem.index(slot), dk, is_async=True)
                    mbarrier.wait(ds_full.index(buf), (count // 2) & 1)
                    dq = warpgroup_mma(ds_smem.index(buf), k_half, zero_h, use_acc=False, is_async=True)
                    dv, dk, dq = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, dq))
                    mbarrier.arrive(ds_free.index(buf), count=1)
                    mbarrier.arrive(empty.index(slot), count=1)
                    q_row = bh * Lq + q0
                    if FUSED_DQ == 3:
                        staging = dq_smem.index(WG)
                        tma.store_wait(0)  # (this warpgroup's last reduce has read its staging tile)
                        gl.thread_barrier()
                        staging.store(dq)
                        fence_async_shared()
                        gl.thread_barrier()
                        _tma_reduce_add(dq_desc, [q_row, WG * HALF_D], staging)
                    else:
                        q_rows = q_row.to(gl.int64) + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, h_layout))
                        offs_h = WG * HALF_D + gl.arange(0, HALF_D, layout=gl.SliceLayout(0, h_layout))
                        gl.atomic_add(DQ_acc + q_rows[:, None] * HEAD_D + offs_h[None, :], dq, sem="relaxed")
                    count += 1
        if FUSED_DQ == 3:
            tma.store_wait(0)  # (the last reduce has read its staging tile)
        _hopper_bwd_store_dkdv(DK, DV, dk, dv, bkh, n0, Lk)

    @gluon.jit
    def _hopper_bwd_dkdv_kernel(k_desc, v_desc, q_desc, do_desc, dq_desc, DK, DV, DQ_acc, Lse2, Delta, partial_num,
                                partial_idx, full_num, full_idx, c_tb, c_th, n_rows, Hq, Hkv, group, Lq, Lk, sm_scale,
                                BHkv, counter, @@ALL_PTR_PARAMS@@
                                TABLE_M: gl.constexpr, TABLE_N: gl.constexpr, NUM_BUF: gl.constexpr,
                                num_warps: gl.constexpr, OVERLAP: gl.constexpr, FUSED_DQ: gl.constexpr = 0,
                                DS_LAYOUT: gl.constexpr = None, DQ_SPLIT: gl.constexpr = False,
                                EARLY_P: gl.constexpr = False, KEYS_SPLIT: gl.constexpr = False,
                                PERSISTENT: gl.constexpr = False, HAS_SCORE: gl.constexpr = False):
        # one program = the 128 keys of column pid_n of one (batch entry, kv head) (KEYS_SPLIT with
        # PERSISTENT: one program per SM taking such work items in turn): their K and V once, then
        # the query tiles of its column lists through a ring (see above), two math warpgroups (the
        # kernel's own 4 warps are the first) and a load warp. Programs run the first keys first:
        # under a causal mask they meet the most queries.
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        HEAD_D: gl.constexpr = k_desc.block_type.shape[1]
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
        dtype: gl.constexpr = k_desc.dtype
        col = gl.program_id(0)
        bkh = gl.program_id(1)
        b = bkh // Hkv
        kv_h = bkh % Hkv
        if KEYS_SPLIT:  # (K and V as one [2, 128, D] buffer: the consumer indexes it each tile)
            kv_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_D], k_desc.layout)
            k_smem = kv_smem.index(0)
            v_smem = kv_smem.index(1)
        else:
            k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_D], k_desc.layout)
            v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_D], v_desc.layout)
        q_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_M, HEAD_D], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_M, HEAD_D], do_desc.layout)
        if KEYS_SPLIT:  # each math warpgroup's dQ, flat in its registers' order; each slot's lse and delta
            dq_smem = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape, dq_desc.layout)
            stats_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
            lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_BUF, BLOCK_M], stats_layout)
            dl_smem = gl.allocate_shared_memory(gl.float32, [NUM_BUF, BLOCK_M], stats_layout)
            # each slot's item and dQ chunk (from the load warp)
            meta_smem = gl.allocate_shared_memory(gl.int32, [2 * NUM_BUF, 32], stats_layout)
        elif FUSED_DQ == 3:  # each math warpgroup's float32 dQ tile (DQ_SPLIT: half), read by its TMA reduce-add
            dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, dq_desc.block_type.shape[1]],
                                                dq_desc.layout)
        else:
            dq_smem = k_smem  # (not used)
        if DQ_SPLIT:  # dS of the program's 128 keys ([queries, keys]), one tile per tile parity; each
            # warpgroup's P
            ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N], DS_LAYOUT)
            p_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N // 2], DS_LAYOUT)
        elif FUSED_DQ >= 2:  # dS^T of the program's 128 keys, one tile per tile parity
            ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], DS_LAYOUT)
        elif FUSED_DQ:  # each math warpgroup's dS^T, read back by its dQ matmul
            ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N // 2, BLOCK_M], DS_LAYOUT)
        else:
            ds_smem = k_smem  # (not used)
        ds_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(ds_full.index(i), count=2)  # both warpgroups' halves
            mbarrier.init(ds_free.index(i), count=2 if DQ_SPLIT else 1)  # (DQ_SPLIT: both warpgroups read it)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(NUM_BUF):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # both math warpgroups release a buffer
        if KEYS_SPLIT:
            # work items (128 keys of a (batch entry, kv head)) numbered head by head, each head's
            # first keys first (under a causal mask they meet the most queries). PERSISTENT: one
            # program per SM takes items from the counter until none is left; else one item
            kv_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            mbarrier.init(kv_free, count=2)  # both math warpgroups done with an item's K and V
            n_cols = gl.cdiv(Lk, TABLE_N)
            if PERSISTENT:
                first = 0  # (not read: items come from the counter)
                total = n_cols * BHkv
            else:
                first = bkh * n_cols + col
                total = first + 1
            gl.warp_specialize([
                (_hopper_bwd_keys_consumer, (kv_smem, kv_bar, kv_free, q_smem, do_smem, ready, empty, ds_smem,
                                             dq_smem, lse_smem, dl_smem, meta_smem, DK, DV, total, n_cols, Hkv, Hq,
                                             group, Lq, Lk, c_tb, c_th, n_rows, partial_num, partial_idx, full_num,
                                             full_idx, sm_scale, @@ALL_PTR_PARAMS@@TABLE_M, TABLE_N, 0,
                                             HAS_SCORE)),
                (_hopper_bwd_keys_consumer, (kv_smem, kv_bar, kv_free, q_smem, do_smem, ready, empty, ds_smem,
                                             dq_smem, lse_smem, dl_smem, meta_smem, DK, DV, total, n_cols, Hkv, Hq,
                                             group, Lq, Lk, c_tb, c_th, n_rows, partial_num, partial_idx, full_num,
                                             full_idx, sm_scale, @@ALL_PTR_PARAMS@@TABLE_M, TABLE_N, 1,
                                             HAS_SCORE)),
                (_hopper_bwd_keys_producer, (k_desc, v_desc, q_desc, do_desc, kv_smem, kv_bar, kv_free, q_smem,
                                             do_smem, ready, empty, meta_smem, counter, first, total, n_cols, Hkv, Hq,
                                             group, Lq, Lk, c_tb, c_th, n_rows, partial_num, partial_idx, full_num,
                                             full_idx, Lse2, Delta, lse_smem, dl_smem, TABLE_M, TABLE_N, PERSISTENT)),
                (_hopper_bwd_dq_writer, (dq_desc, dq_smem, ready, meta_smem, total)),
            ], [4, 1, 1], [240, 32, 32])
        else:  # (K and V of the program's one item, before the partitions start)
            mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [bkh * Lk + col * TABLE_N, 0], kv_bar, k_smem)
            tma.async_copy_global_to_shared(v_desc, [bkh * Lk + col * TABLE_N, 0], kv_bar, v_smem)
            if DQ_SPLIT:
                gl.warp_specialize([
                    (_hopper_bwd_split_consumer, (k_smem, v_smem, kv_bar, q_smem, do_smem, ready, empty, ds_smem,
                                                  ds_full, ds_free, p_smem, dq_smem, dq_desc, DK, DV, DQ_acc, Lse2,
                                                  Delta, b, kv_h, bkh, col, Hq, group, Lq, Lk, c_tb, c_th, n_rows,
                                                  partial_num, partial_idx, full_num, full_idx, sm_scale,
                                                  @@ALL_PTR_PARAMS@@TABLE_M, TABLE_N, 0, FUSED_DQ)),
                    (_hopper_bwd_split_consumer, (k_smem, v_smem, kv_bar, q_smem, do_smem, ready, empty, ds_smem,
                                                  ds_full, ds_free, p_smem, dq_smem, dq_desc, DK, DV, DQ_acc, Lse2,
                                                  Delta, b, kv_h, bkh, col, Hq, group, Lq, Lk, c_tb, c_th, n_rows,
                                                  partial_num, partial_idx, full_num, full_idx, sm_scale,
                                                  @@ALL_PTR_PARAMS@@TABLE_M, TABLE_N, 1, FUSED_DQ)),
                    (_hopper_bwd_qdo_producer, (q_desc, do_desc, q_smem, do_smem, ready, empty, b, kv_h, col, Hq,
                                                group, Lq, c_tb, c_th, n_rows, partial_num, partial_idx, full_num,
                                                full_idx, TABLE_M)),
                ], [4, 1], [240, 24])
            else:
                gl.warp_specialize([
                    (_hopper_bwd_dkdv_consumer, (k_smem, v_smem, kv_bar, q_smem, do_smem, ready, empty, ds_smem,
                                                 ds_full, ds_free, dq_smem, dq_desc, DK, DV, DQ_acc, Lse2, Delta, b,
                                                 kv_h, bkh, col, Hq, group, Lq, Lk, c_tb, c_th, n_rows, partial_num,
                                                 partial_idx, full_num, full_idx, sm_scale,
                                                 @@ALL_PTR_PARAMS@@TABLE_M, TABLE_N, 0, OVERLAP, FUSED_DQ, EARLY_P)),
                    (_hopper_bwd_dkdv_consumer, (k_smem, v_smem, kv_bar, q_smem, do_smem, ready, empty, ds_smem,
                                                 ds_full, ds_free, dq_smem, dq_desc, DK, DV, DQ_acc, Lse2, Delta, b,
                                                 kv_h, bkh, col, Hq, group, Lq, Lk, c_tb, c_th, n_rows, partial_num,
                                                 partial_idx, full_num, full_idx, sm_scale,
                                                 @@ALL_PTR_PARAMS@@TABLE_M, TABLE_N, 1, OVERLAP, FUSED_DQ, EARLY_P)),
                    (_hopper_bwd_qdo_producer, (q_desc, do_desc, q_smem, do_smem, ready, empty, b, kv_h, col, Hq,
                                                group, Lq, c_tb, c_th, n_rows, partial_num, partial_idx, full_num,
                                                full_idx, TABLE_M)),
                ], [4, 1], [240, 24])

    @gluon.jit
    def _hopper_bwd_dq_consumer(q_smem, do_smem, q_bar, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, DQ,
                                Lse2, Delta, b, h, bh, pid_m, Lq, Lk, n_f, n_tiles, idx_f, idx_p, sm_scale,
                                @@ALL_PTR_PARAMS@@
                                SUB: gl.constexpr, TABLE_N: gl.constexpr, num_warps: gl.constexpr,
                                OVERLAP: gl.constexpr):
        # the math warps of the dq kernel. Per tile of BLOCK_N keys: S = Q K^T and dP = dO V^T,
        # P = exp2(S * c - lse2) (the mask on partial blocks), dS = P (dP - delta) * scale, then
        # dQ += dS K, issued behind the next tile's S and dP. V's buffer goes back once dP is done,
        # K's once dQ's matmul has read it, a tile later.
        BLOCK_M: gl.constexpr = q_smem.type.shape[0]
        HEAD_D: gl.constexpr = q_smem.type.shape[1]
        BLOCK_N: gl.constexpr = k_smem.type.shape[1]
        NUM_BUF: gl.constexpr = k_smem.type.shape[0]
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, HEAD_D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        c = sm_scale * 1.4426950408889634
        rows = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        lse2 = gl.load(Lse2 + bh.to(gl.int64) * Lq + rows)[:, None]
        delta = gl.load(Delta + bh.to(gl.int64) * Lq + rows)[:, None]
        q_idx = rows[:, None]
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))[None, :]
        dq = gl.zeros([BLOCK_M, HEAD_D], gl.float32, layout=o_layout)
        zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        ds_op = gl.zeros([BLOCK_M, BLOCK_N], dtype, layout=p_layout)  # the first tile's dQ step adds 0
        prev = 0
        mbarrier.wait(q_bar, 0)
        for t in range(0, n_tiles):
            slot = t % NUM_BUF
            phase = (t // NUM_BUF) & 1
            start, first, full = _hopper_tile_start(t, n_f, idx_f, idx_p, Lk, SUB, TABLE_N, BLOCK_N, True)
            mbarrier.wait(k_ready.index(slot), phase)
            s = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(slot), phase)
            dp = warpgroup_mma(do_smem, v_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            if OVERLAP:
                dq = warpgroup_mma(ds_op, k_smem.index(prev), dq, is_async=True)  # the previous tile's
                s, dp = warpgroup_mma_wait(num_outstanding=1, deps=(s, dp))
            else:
                s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp))
            mbarrier.arrive(v_empty.index(slot), count=1)
            p = gl.exp2(gl.fma(s, c, -lse2))
            if not full:
                keep = mask_mod_gluon(b, h, q_idx, start + cols@@MASK_PTR_ARGS@@) != 0
                p = gl.where(keep, p, 0.0)
            ds = p * (dp - delta) * sm_scale
            ds_op = gl.convert_layout(ds.to(dtype), p_layout)
            if OVERLAP:
                dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
                mbarrier.arrive(k_empty.index(prev), count=1, pred=t > 0)
            else:
                dq = warpgroup_mma(ds_op, k_smem.index(slot), dq, is_async=True)
                dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
                mbarrier.arrive(k_empty.index(slot), count=1)
            prev = slot
        if OVERLAP and n_tiles > 0:
            dq = warpgroup_mma(ds_op, k_smem.index(prev), dq, is_async=True)
            dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
        offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
        offs_d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))
        gl.store(DQ + (bh.to(gl.int64) * Lq + offs_m)[:, None] * HEAD_D + offs_d[None, :], dq.to(DQ.dtype.element_ty))

    @gluon.jit
    def _hopper_bwd_dq_kernel(q_desc, do_desc, k_desc, v_desc, DQ, Lse2, Delta, partial_num, partial_idx, full_num,
                              full_idx, s_tb, s_th, n_cols, Hq, group, Lq, Lk, sm_scale, @@ALL_PTR_PARAMS@@
                              TABLE_M: gl.constexpr, TABLE_N: gl.constexpr, NUM_BUF: gl.constexpr,
                              num_warps: gl.constexpr, OVERLAP: gl.constexpr):
        # one program = 128 queries of one (batch entry, head), Q and dO loaded once; the tiles
        # of keys and values its row of the block lists names come through the forward's loader
        # (_hopper_producer). The last rows first, as in the forward.
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        HEAD_D: gl.constexpr = q_desc.block_type.shape[1]
        SUB: gl.constexpr = TABLE_N // BLOCK_N
        dtype: gl.constexpr = q_desc.dtype
        pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
        bh = gl.program_id(1)
        b = bh // Hq
        h = bh % Hq
        kv_row0 = (b * (Hq // group) + h // group) * Lk
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_D], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_D], do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, HEAD_D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, HEAD_D], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(NUM_BUF):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=1)
            mbarrier.init(v_empty.index(i), count=1)
        mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [bh * Lq + pid_m * BLOCK_M, 0], q_bar, q_smem)
        tma.async_copy_global_to_shared(do_desc, [bh * Lq + pid_m * BLOCK_M, 0], q_bar, do_smem)
        row = b * s_tb + h * s_th + (pid_m * BLOCK_M) // TABLE_M
        n_f = gl.load(full_num + row)
        n_tiles = (n_f + gl.load(partial_num + row)) * SUB
        idx_f = full_idx + row * n_cols
        idx_p = partial_idx + row * n_cols
        gl.warp_specialize([
            (_hopper_bwd_dq_consumer, (q_smem, do_smem, q_bar, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                                       DQ, Lse2, Delta, b, h, bh, pid_m, Lq, Lk, n_f, n_tiles, idx_f, idx_p,
                                       sm_scale, @@ALL_PTR_PARAMS@@SUB, TABLE_N, num_warps, OVERLAP)),
            (_hopper_producer, (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, kv_row0, n_f,
                                n_tiles, idx_f, idx_p, Lk, SUB, TABLE_N, True)),
        ], [1], [24])


def _hopper_bwd_ready(q, k, v, learn, deterministic=False) -> bool:
    """Whether this backward runs the Hopper kernels: HOPPER_BWD on, the Hopper forward's
    conditions at whole blocks (sm_90, bf16 / fp16, Lq and Lk multiples of 128), a head dim of
    HOPPER_BWD_HEAD_DIMS (the two kernels) or, unless deterministic, of HOPPER_BWD_FUSED_HEAD_DIMS
    with a fused form on, a mask that does not read the head (or HOPPER_BWD_PER_HEAD on a call of
    at least HOPPER_BWD_PER_HEAD_MIN_PAIRS pairs), no learning tables, and a score_mod only with
    HOPPER_BWD_SCORE, its derivative in Gluon and the keys-down form. Any other backward runs the
    portable kernels."""
    if not (HOPPER_BWD and _HAS_GLUON and HOPPER_MODS is None) or learn or _INTERPRET:
        return False
    B, Hq, Lq, D = q.shape
    if HAS_SCORE and not (HOPPER_BWD_SCORE and HOPPER_GRAD is None and _hopper_bwd_keys_down(D, deterministic)):
        return False
    Lk = k.shape[2]
    if MASK_READS_HEAD and not (HOPPER_BWD_PER_HEAD and B * Hq * Lq * Lk >= HOPPER_BWD_PER_HEAD_MIN_PAIRS):
        return False
    if q.device.type != "cuda" or _capability(q.device) != (9, 0):
        return False
    fused = not deterministic and HOPPER_BWD_FUSED_DQ and D in HOPPER_BWD_FUSED_HEAD_DIMS
    if not (q.dtype in (torch.bfloat16, torch.float16) and (D in HOPPER_BWD_HEAD_DIMS or fused) and D in HOPPER_BWD_TILES
            and Lq % 128 == 0 and Lk % 128 == 0
            and TABLE_M == 128 and TABLE_N == 128 and (q.dtype, D) not in _HOPPER_BWD_FAILED
            and all(t.is_contiguous() and t.data_ptr() % 16 == 0 and t.dtype == q.dtype for t in (q, k, v))):
        return False
    kept = _kept_blocks(B, Hq, Lq, Lk, q.device) if HOPPER_BWD_MIN_BLOCKS else None
    return kept is None or kept >= HOPPER_BWD_MIN_BLOCKS


_KEPT_BLOCKS: dict = {}


def _kept_blocks(B: int, Hq: int, Lq: int, Lk: int, device) -> int | None:
    """How many blocks of 128 x 128 pairs the mask keeps (partial or full) over B batch entries and
    Hq query heads at Lq x Lk, from the block lists: counted once per shape (one device sync, the
    first call's), None while a CUDA graph is being captured (no sync there: the caller then
    decides without it)."""
    key = (B, Hq, Lq, Lk, str(device))
    if key not in _KEPT_BLOCKS and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None

    def count():
        partial_num, _, full_num, _ = block_lists(B, Hq, Lq, Lk, device)
        # (lists of masks that do not read the batch entry / head hold one entry for all of them)
        per = int((partial_num.sum(dtype=torch.int64) + full_num.sum(dtype=torch.int64)).item())
        return per * (B // partial_num.shape[0]) * (Hq // partial_num.shape[1])

    return _remember(_KEPT_BLOCKS, key, count)


_HOPPER_BWD_PLANS: dict = {}


def _hopper_bwd_plan(q, k, v, dout, lse2, delta, scale, tables, fused=False, zeroed=None):
    """(dq, dk, dv, launches): the gradients' tensors and [(kernel, grid, arguments, options, site)]
    of the kernels for this call (dk / dv first). `fused` (HOPPER_BWD_FUSED_DQ): one kernel, and dq
    a float32 sum of atomic adds, to be cast to q's dtype; `zeroed`: the keys-down form's buffer,
    zeroed already (else zeroed here). What calls of one kind share (grids, options, lists, integer
    arguments: _hopper_bwd_shape) is made once per site (_launch's key)."""
    B, Hq, Lq, D = q.shape
    pointers = [tables[name] for name in ALL_POINTERS]
    site = ("backward", q.shape, k.shape, q.dtype, q.device, _current_device(q), fused,
            HOPPER_BWD_TILES.get(D), HOPPER_BWD_FUSED_BUFFERS, HOPPER_BWD_DQ_SPLIT_HEAD_DIMS,
            HOPPER_BWD_SPLIT_KEYS_DOWN, HOPPER_BWD_PERSISTENT, HOPPER_BWD_EARLY_P,
            tuple(t.data_ptr() % 16 == 0 for t in pointers))
    shape = _remember(_HOPPER_BWD_PLANS, site, lambda: _hopper_bwd_shape(q, k, fused))
    (grid, options, ints), dq_launch, keys_split, split, block_m = shape
    dout = dout.contiguous() if dout.dtype == q.dtype else dout.to(q.dtype).contiguous()
    if dout.data_ptr() % 16:  # (a slice off TMA's 16-byte alignment: a copy of it)
        dout = dout.clone()
    counter = lse2  # (not read unless keys_split)
    if keys_split:  # (dq summed flat in the warpgroups' register order, put back in order after: _dq_unflat;
        # the persistent form's item counter is an int32 view of a zeroed word after it: zeroed together)
        if zeroed is None:
            zeroed = torch.zeros(q.numel() + 4, dtype=torch.float32, device=q.device)
        dq, counter = zeroed[:q.numel()], zeroed[q.numel():q.numel() + 1].view(torch.int32)
    else:
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if fused else torch.empty_like(q)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dkdv = (_hopper_bwd_dkdv_kernel, grid,
            (_hopper_descriptor(k, TABLE_N), _hopper_descriptor(v, TABLE_N), _hopper_descriptor(q, block_m),
             _hopper_descriptor(dout, block_m),
             (_dq_flat_descriptor(dq, D) if keys_split else _dq_descriptor(dq, block_m, D // 2 if split else D))
             if fused == 3 else _hopper_descriptor(q, block_m),
             dk, dv, dq, lse2, delta, *ints, scale, B * k.shape[1], counter, *pointers),
            options, site)
    if fused:
        return dq, dk, dv, [dkdv]
    (grid, options, ints), block_n = dq_launch
    dq_launch = (_hopper_bwd_dq_kernel, grid,
                 (_hopper_descriptor(q, TABLE_M), _hopper_descriptor(dout, TABLE_M), _hopper_descriptor(k, block_n),
                  _hopper_descriptor(v, block_n), dq, lse2, delta, *ints, scale, *pointers), options, site + ("dq", ))
    return dq, dk, dv, [dkdv, dq_launch]


def _hopper_bwd_shape(q, k, fused):
    """What a Hopper backward call of this kind shares with every call like it: the dk / dv
    kernel's (grid, options, lists and integers), the dq kernel's with its key tile (or None:
    fused forms), keys_split, split and the tiles' queries."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    block_m, block_n, buffers, overlap = (64, 64, HOPPER_BWD_FUSED_BUFFERS, False) if fused else HOPPER_BWD_TILES[D]
    split = fused >= 2 and D in HOPPER_BWD_DQ_SPLIT_HEAD_DIMS
    keys_split = split and fused == 3 and HOPPER_BWD_SPLIT_KEYS_DOWN
    if split:  # (as many buffers as fit: K, V, the ring of Q and dO (keys down: and their lse and
        # delta), dS (queries down: and P) tiles, form 3's staging)
        fixed = (2 * 128 * D * 2 + 2 * 64 * 128 * 2 + (0 if keys_split else 2 * 64 * 64 * 2)
                 + (2 * 64 * (D // 2) * 4 if fused == 3 else 0))
        per_buffer = 2 * 64 * D * 2 + (2 * 64 * 4 if keys_split else 0)
        while buffers > 2 and fixed + buffers * per_buffer > 227 * 1024:
            buffers -= 1
    n_rows, n_cols = _cdiv(Lq, TABLE_M), _cdiv(Lk, TABLE_N)
    c_tb, c_th = _list_strides(Hq, n_cols)
    s_tb, s_th = _list_strides(Hq, n_rows)
    options = dict(TABLE_M=TABLE_M, TABLE_N=TABLE_N, NUM_BUF=buffers, OVERLAP=bool(overlap))
    dkdv_options = {**options, "num_warps": 4,
                    **({"FUSED_DQ": int(fused), "DQ_SPLIT": split and not keys_split, "KEYS_SPLIT": keys_split,
                        "EARLY_P": HOPPER_BWD_EARLY_P, "PERSISTENT": keys_split and HOPPER_BWD_PERSISTENT,
                        "HAS_SCORE": HAS_SCORE and keys_split,
                        "DS_LAYOUT": _bwd_ds_layout(q.dtype, 128 if fused >= 2 else 64, split and not keys_split)}
                       if fused else {})}
    grid = (n_cols, B * Hkv)
    if keys_split and HOPPER_BWD_PERSISTENT:  # (one program per SM, at most one per item)
        grid = (min(n_cols * B * Hkv, _sm_count(q.device)), 1)
    dkdv = (grid, dkdv_options,
            (*column_lists(B, Hq, Lq, Lk, q.device), c_tb, c_th, n_rows, Hq, Hkv, Hq // Hkv, Lq, Lk))
    dq = None if fused else (((n_rows, B * Hq), {**options, "num_warps": 8},
                              (*block_lists(B, Hq, Lq, Lk, q.device), s_tb, s_th, n_cols, Hq, Hq // Hkv, Lq, Lk)), block_n)
    return dkdv, dq, keys_split, split, block_m


def _dq_flat_descriptor(dq, head_dim: int):
    """A TMA descriptor over the keys-down split's flat float32 dq as [N / 256, 256], unswizzled, in
    chunks of head_dim / 8 rows: one chunk is one warpgroup's [64, head_dim / 2] dQ tile in its
    registers' order (64 queries x half the head dim)."""
    key = ("dq_flat", head_dim)
    if key not in _SHARED_LAYOUTS:
        _SHARED_LAYOUTS[key] = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return _descriptor(dq, dq.numel() // 256, 256, [head_dim // 8, 256], _SHARED_LAYOUTS[key])


@triton.jit
def _dq_unflat_kernel(Acc, Out, D: tl.constexpr):
    # one program per 64 queries of a (batch entry, head): the tile's two chunks (the halves of the
    # head dim, 32 D floats each, one after the other) become its 64 rows of D. The chunks hold
    # (half, j, w, lh, ll, h2, p) in that order (see _dq_unflat), so the tile is read in order,
    # reshaped and permuted in registers to (w, h2, lh, half, j, ll, p) = (row, column), and
    # stored as rows: on an H200 about 4 TB/s, 2.6x the strided torch copy
    base = tl.program_id(0).to(tl.int64) * 64 * D
    x = tl.load(Acc + base + tl.arange(0, 64 * D))
    x = tl.reshape(tl.permute(tl.reshape(x, [2, D // 16, 4, 8, 4, 2, 2]), [2, 5, 3, 0, 1, 4, 6]), [64, D])
    rows = tl.arange(0, 64)[:, None]
    cols = tl.arange(0, D)[None, :]
    tl.store(Out + base + rows * D + cols, x.to(Out.dtype.element_ty))


def _dq_unflat(acc, shape, dtype):
    """The keys-down split's flat float32 dq sum as a [B, Hq, Lq, D] tensor of `dtype`, in one pass:
    chunk (b, h, tile of 64 queries, half of the head dim) holds j (column group of 8), w (warp),
    lh (lane // 4), ll (lane % 4), h2 (row half of the warp's 16 rows), p (column pair), for row
    16 w + 8 h2 + lh of the tile and column half * D / 2 + 8 j + 2 ll + p (_dq_unflat_kernel on a
    GPU or under the interpreter, a strided copy elsewhere)."""
    B, Hq, Lq, D = shape
    out = torch.empty(shape, dtype=dtype, device=acc.device)
    if acc.is_cuda or _INTERPRET:
        _launch(_dq_unflat_kernel, (B * Hq * Lq // 64,), (acc, out), dict(D=D, num_warps=4),
                ("unflat", shape, dtype, acc.device, _current_device(acc)))
        return out
    # out's view by (b, h, tile, w, h2, lh, half, j, ll, p), put in the chunks' order
    view = out.view(B, Hq, Lq // 64, 4, 2, 8, 2, D // 16, 4, 2).permute(0, 1, 2, 6, 7, 3, 5, 8, 4, 9)
    view.copy_(acc.view(B, Hq, Lq // 64, 2, D // 16, 4, 8, 4, 2, 2))
    return out


def _dq_descriptor(dq, rows: int, cols: int):
    """A TMA descriptor over the float32 dq's [B * Hq * Lq, D] view, in tiles of `rows` queries x
    `cols` of the head dim (the fused form 3's reduce-adds; DQ_SPLIT: half the head dim)."""
    key = ("dq", rows, cols)
    if key not in _SHARED_LAYOUTS:
        _SHARED_LAYOUTS[key] = gl.NVMMASharedLayout.get_default_for([rows, cols], gl.float32)
    return _descriptor(dq, dq.numel() // dq.shape[-1], dq.shape[-1], [rows, cols], _SHARED_LAYOUTS[key])


def _bwd_ds_layout(dtype, keys=64, split=False):
    """The shared-memory layout of a dS^T tile (`keys` keys x 64 queries) in the fused forms (split:
    of a dS tile, 64 queries x `keys` keys, and of a P tile)."""
    key = ("ds", dtype, keys, split)
    if key not in _SHARED_LAYOUTS:
        _SHARED_LAYOUTS[key] = gl.NVMMASharedLayout.get_default_for(
            [64, keys] if split else [keys, 64], gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)
    return _SHARED_LAYOUTS[key]


def _hopper_bwd_form(D: int, deterministic: bool) -> int:
    """The Hopper backward's form for a call: 0 (two kernels, no atomics) or HOPPER_BWD_FUSED_DQ's
    fused form (form 3 where Triton's builder has no TMA reduce-adds: form 2)."""
    if HOPPER_BWD_FUSED_DQ not in HOPPER_BWD_FUSED_FORMS:
        raise ValueError(f"HOPPER_BWD_FUSED_DQ = {HOPPER_BWD_FUSED_DQ!r} names no form of the Hopper backward: set it "
                         f"to one of {HOPPER_BWD_FUSED_FORMS} (0: two kernels, no atomics; 2: the default)")
    fused = 0 if deterministic or D not in HOPPER_BWD_FUSED_HEAD_DIMS else HOPPER_BWD_FUSED_DQ
    return 2 if fused == 3 and not _HAS_TMA_REDUCE else fused


def _hopper_bwd_keys_down(D: int, deterministic: bool) -> bool:
    """Whether a call of head dim D takes the keys-down split (form 3 at HOPPER_BWD_DQ_SPLIT_HEAD_DIMS)."""
    return _hopper_bwd_form(D, deterministic) == 3 and D in HOPPER_BWD_DQ_SPLIT_HEAD_DIMS and HOPPER_BWD_SPLIT_KEYS_DOWN


def _hopper_bwd_zeroed(q, deterministic: bool):
    """Where the call takes the keys-down split: its flat float32 dq sum and item counter,
    [q.numel() + 4] words, not yet zeroed (the backward's prep kernel zeroes them on its way);
    else None."""
    if _hopper_bwd_keys_down(q.shape[-1], deterministic):
        return torch.empty(q.numel() + 4, dtype=torch.float32, device=q.device)
    return None


def _hopper_bwd_launch(q, k, v, dout, lse2, delta, scale, tables, deterministic=False, zeroed=None):
    """(dq, dk, dv) of this call from the Hopper kernels (dk / dv, then dq), or None when they
    failed to compile or launch here (the first failure warns; later calls of that kind skip).
    `zeroed`: the keys-down form's buffer, zeroed by the prep kernel (_hopper_bwd_zeroed), or None."""
    D = q.shape[-1]
    fused = _hopper_bwd_form(D, deterministic)
    try:
        dq, dk, dv, launches = _hopper_bwd_plan(q, k, v, dout, lse2, delta, scale, tables, fused=fused,
                                                zeroed=zeroed)
        for kernel, grid, args, options, *site in launches:
            _launch(kernel, grid, args, options, *site)
        if dq.dim() == 1:  # (the keys-down split's flat sum)
            dq = _dq_unflat(dq, q.shape, q.dtype)
        if dq.dtype != q.dtype:  # (the fused forms' float32 sum)
            dq = dq.to(q.dtype)
    except Exception as exc:
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            raise
        _HOPPER_BWD_FAILED[(q.dtype, D)] = f"{type(exc).__name__}: {str(exc)[:300]}"
        warnings.warn(f"{NAME}: the Hopper backward ({q.dtype}, D {D}) failed here "
                      f"({_HOPPER_BWD_FAILED[(q.dtype, D)]}); these calls run the portable backward instead. Set "
                      "PORT_HOPPER_BWD=0 to run it from the start, and please report the cause", RuntimeWarning,
                      stacklevel=3)
        return None
    return dq, dk, dv
