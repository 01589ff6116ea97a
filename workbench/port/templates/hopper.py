"""The port's Hopper forward, appended to forward.py by `port.generate`: the same block lists and
the same mask / score translation as the portable kernel, written in Gluon (Triton's layout-explicit
language) for sm_90: keys and values arrive by TMA into a ring of shared-memory buffers a few tiles
ahead, and both matmuls are warpgroup MMAs (wgmma). Markers: @@HOPPER_MODS@@ (None, or why the
mods have no Gluon copy), @@GLUON_MODS@@ (mask_mod_gluon / score_mod_gluon, the Triton mods with
Gluon's names, indented), @@HOPPER_TABLE_READS@@ (the table reads in their forward mods),
@@ALL_PTR_PARAMS@@ / @@MASK_PTR_ARGS@@ / @@SCORE_PTR_ARGS@@."""

import torch

# ---------------------------------------------------------------- Hopper (sm_90): TMA + warpgroup MMA

# On: attention() runs this kernel where _hopper_ready says it can (an H100 / H200, bf16 / fp16, ...)
# and the portable kernel elsewhere; PORT_HOPPER=0 in the environment (or HOPPER = False) turns it
# off. Checked against the float64 reference by tests/test_gpu_port.py, timed by
# benchmarks/bench_port.py --hopper (docs/benchmarks.md).
HOPPER = os.environ.get("PORT_HOPPER", "1") != "0"


def _hopper_setting(name: str, default: str, allowed: tuple, refusal: str) -> int:
    """A Hopper switch read from the environment: unset or empty gives `default`; any value not in
    `allowed` stops the file's load with an error naming the variable, the value and the choices."""
    value = os.environ.get(name, "").strip() or default
    if value not in allowed:
        raise ValueError(f"{name}={value!r} {refusal}")
    return int(value)


# (BLOCK_N, K / V buffers, warps): 128 query rows per program, BLOCK_N keys per tile; buffers 0 =
# the loop's own choice (3 for "pingpong", whose two warpgroups release a buffer half a tile apart;
# 2 for "specialized"); warps: the math warps of "specialized" ("pingpong" has two warpgroups of 4).
# At D 128, 2 buffers take 160 KB of shared memory and 3 take 224 KB. Compiled for sm_90a
# (tests/run_hopper_compile.py), the library's masks and the users' mods there do not spill at
# whole blocks; at ragged lengths a user's .any() spans spills 92 bytes, and heavier drawn mods
# (several tables and'ed / or'ed) spill 116-228 bytes of scalars (table pointers, indices)
HOPPER_TILE = (128, 0, 8)
# the tile loop, both forms warp-specialized (one warp only issues the TMA loads) and both with
# FlashAttention-3's order within a warpgroup (tile t's S = Q K^T issued with tile t-1's P V, and
# t's softmax before the wait for that P V; compiled, the wait comes first unless HOPPER_UNDER_PV,
# below): "specialized" (one group of math warps over the 128 rows) or
# "pingpong" (two warpgroups of 64 rows take turns on the tensor cores, so one's softmax runs
# under the other's matmuls); the same arithmetic. "persistent": pingpong's roles in one program
# per SM that takes (row block, head) tiles from a counter (an atomic add: programs that finish
# early take more), so a program's start and end no longer sit between short rows (windows,
# documents). "auto": "persistent", except "pingpong" with a score_mod at D 128 (since the score
# functions' Gluon copies take the chip's tanh; H200, bf16 D 128, 32K: image spans + softcap 10.2 ms
# in both, "specialized" 11.7; causal + ALiBi 9.69, persistent 10.06, specialized 11.44; at D 64
# the persistent form is the faster with one too: H100, fp16, 32K, ALiBi 7.65 ms against 8.16,
# image spans + softcap 8.09 against 8.37). Measured
# on an H200 (docs/benchmarks.md, bf16 D 128, 32K): persistent against pingpong 0.619 / 0.645 ms
# on a 1,024 window, 1.060 / 1.072 on 8 documents, 7.087 / 7.088 on causal; fp16 D 64: 0.429 /
# 0.475 (window), 0.317 / 0.374 (per-head windows). One-warpgroup loops without a load warp, and a
# persistent form that dealt tiles round robin (20% slower on causal 32K), were measured slower
# and are not kept.
HOPPER_LOOP = "auto"
HOPPER_LOOPS = ("auto", "specialized", "pingpong", "persistent")
# lengths that are not multiples of 128 (at least 128 queries and 128 keys) take the Hopper kernel
# too: the last block of queries is masked at the store, the last tile of keys is loaded from
# Lk - BLOCK_N and masked to its own keys (checked on an H200 with drawn users' mods,
# tests/test_gpu_port.py::test_the_hopper_kernel_runs_drawn_mods_like_the_reference);
# PORT_HOPPER_RAGGED=0 (or False here) sends those calls to the portable kernel
HOPPER_RAGGED = os.environ.get("PORT_HOPPER_RAGGED", "1") != "0"
# The persistent loop's buffers of queries: 1 (the next tile's 128 queries load once both
# warpgroups have done this tile's last S, under its last P V and store) or 2 (tile j's queries in
# buffer j % 2, brought while tile j - 1 runs: no wait for them between tiles, where short rows
# (windows, documents) paid it once per ~9 key tiles; at D 128 the K / V ring then has 2 buffers, the
# shared memory of 3). PORT_HOPPER_Q_BUFFERS=2 in the environment chooses 2. On an H100 (bf16, D 128,
# 8K and 32K) it gave the same bits and no gain: the short masks' kernels moved by under 1 %, the
# long ones lost up to 7 % to the shorter ring; so 1 stays.
HOPPER_Q_BUFFERS = _hopper_setting(
    "PORT_HOPPER_Q_BUFFERS", "1", ("1", "2"),
    "names no number of the persistent loop's buffers of queries: set 1 (the default) or 2, or unset it")
# How the ping-pong and persistent loops' warpgroups hand work over (bits): 1, the turns on the tensor
# cores through named barriers; 2, K / V buffers given back to the load warp through named barriers;
# 0, both through mbarriers. Gluon's mbarrier.arrive is one thread's arrive after a bar.sync of its
# whole warpgroup, so every hand-off through an mbarrier held the warpgroup until its four warps
# met (compiled for sm_90a: three bar.sync a tile; Nsight Compute put 21% of the math warps' stall
# samples of causal 8K on them, FlashAttention-4's kernel 10% on its barriers). A named barrier's
# arrive (bar.arrive) does not wait; its sync waits for the other side's threads, FlashAttention-3's
# ping-pong. PORT_HOPPER_NAMED=0 / 1 / 3 / 5 / 7 in the environment chooses. On an H200 (32K, bf16,
# D 128) 3 gave the same bits and was within 1.4 % of 0 either way (causal faster, documents and
# prefix-LM slower), so the barrier's wait moved rather than went away.
# 4 (with 1): a warpgroup waits for its turn before it waits for the tile's keys and values, not
# after. Triton puts a barrier of the warpgroup's 128 threads before each wait on an mbarrier of
# the loop (its analysis of shared memory counts a wait as a write of the barrier): after the
# named turn's sync of both warpgroups that barrier finds its four warps already together. On an
# H100 (32K, bf16, D 128) 7 gave the same bits, the window's and documents' kernels 1-6 % faster and
# causal's 1-5 % slower. 7 is the default with the wait for P V after the row max (HOPPER_UNDER_PV =
# 2): on an H200 (bf16, D 128, 32K; benchmarks/bench_clocks.py at the power cap, two runs) the two
# together took 0.9-1.1 % fewer cycles a call than 0 with ptxas's own wait on causal, 2.5-3.3 % on
# prefix-LM and 3.9 % on 8 documents, 1.3 % more on a 1,024 window; either alone was within 0.6 %.
# On an H100 (the same shapes at 8K and 32K, do_bench) the pair's calls were 1.4-7 % faster than 0's
# on causal and prefix-LM.
HOPPER_NAMED = _hopper_setting(
    "PORT_HOPPER_NAMED", "7", ("0", "1", "3", "5", "7"),
    "names no hand-off of the Hopper kernel's warpgroups: set 0 (mbarriers), 1 (named turns), 3 (named "
    "turns and K / V releases), 5 or 7 (1 or 3, the turn taken before the tile's waits; 7 is the default), or "
    "unset it")
# The softmax under the previous tile's P V (FlashAttention-3's overlap within a warpgroup): in the
# source, tile t's exponentials come before the wait for tile t-1's P V, but ptxas schedules the
# wait (WARPGROUP.DEPBAR) as early as its block allows, so compiled for sm_90a every loop waits for
# P V before its first exponential. 1: a branch that is never taken (_end_block) ends the
# softmax's block, so the wait stays after the exponentials and only the conversion of P to 16 bits,
# which overwrites the registers P V reads, comes after it (tests/run_hopper_compile.py checks the
# SASS). The same bits; on an H100 (bf16, D 128) no gain: the kernels moved by -4 % to +4 % at 8K
# and 32K, the calls were 0-3 % slower (the ping-pong between warpgroups already runs one's softmax
# under the other's matmuls). PORT_HOPPER_UNDER_PV=1 in the environment chooses the overlap.
# 2: the wait after the row max and the rows' rescale alpha, before the exponentials (FlashAttention-
# 4's Hopper loop, as its SASS has it): a never-taken branch on the tile's first key ends the block
# there (_end_block), so the max runs under P V and O's rescale is issued among the
# exponentials (compiled for sm_90a: 15 instructions after the last exponential, none of them O's
# multiplies, against 71). The same bits. Alone, with mbarrier hand-offs, on an H100 (bf16 D 128,
# 32K): sustained cycles a call within 0.6 % of 0 both ways (causal, prefix-LM); with the named
# turns taken first (HOPPER_NAMED = 7) it is the default, see there. PORT_HOPPER_UNDER_PV=0 chooses
# ptxas's own place (the wait before the row max). 2 keeps the previous tile's P (32 registers a
# thread) alive through the max, where a consumer warpgroup already holds S and O (64 + 64), so it is
# the default only where it was measured and compiles without new spills: masks without a
# score_mod whose mods read at most 3 table entries (HOPPER_TABLE_READS: the distinct loads of
# their forward Gluon copy, whose values and the compares on them stay in registers); others keep
# 0. Compiled for sm_90a at whole blocks (tests/run_hopper_compile.py), with 2 and not with 0: two
# .any() spans (4 entries) spilled 40-164 bytes, four tables 20 bytes in the persistent loop, a
# score_mod's bias tables in their fast form (PORT_FAST_SCORE=1) 280-572 bytes; one span (2) and
# three tables (3) spilled the same with either (0 and 12 bytes), two tables (2) 4 bytes with 2.
HOPPER_TABLE_READS = @@HOPPER_TABLE_READS@@
HOPPER_UNDER_PV = _hopper_setting(
    "PORT_HOPPER_UNDER_PV", "2" if HOPPER_TABLE_READS <= 3 and not HAS_SCORE else "0", ("0", "1", "2"),
    "is not a place of the Hopper softmax's wait for P V: set 1 (after the exponentials), 2 (after the row "
    "max, the default for masks without a score_mod reading at most 3 table entries) or 0 (where ptxas puts "
    "it, the others' default), or unset it")
# ... and where 2 is the default (not chosen in the environment) and the kernel compiled with it
# spills anyway (local memory, the driver's count when it loads the kernel: a mod heavier than its
# table reads say), the first call of that kind compiles the 0 form too and runs whichever spills
# less (_under_pv_by_spills): the same bits either way, one more compile only where 2 spilled.
HOPPER_UNDER_PV_CHOSEN = bool(os.environ.get("PORT_HOPPER_UNDER_PV", "").strip())
# The softmax's row sums l (1, the default): each thread keeps the sum of its own share of a row's
# scores (a row's 128 keys of a tile lie with four threads of a warp, 32 each), and the four shares
# are added once, at the store, as FlashAttention-2 and -3 do; 0: the row's whole sum every tile,
# gathered across its four threads (two shuffles and two adds a row, four rows' worth a thread a
# tile). The same online softmax; the sum is added in another order, so the bits of out and lse may
# differ in the last place between the two. Compiled for sm_90a: 480 instructions a thread in a full
# tile's loop instead of 488, registers unchanged. On an H100 (bf16 D 128, 32K; benchmarks/
# bench_clocks.py, two runs, both at the power cap) it took 1.0-2.2 % fewer cycles a call on causal
# and prefix-LM and 1.6 % fewer on a 1,024 window, and do_bench's medians were 0.6-4.4 % lower in
# all five comparisons; an H200's profiler once had causal's kernel 7.9 % slower, which no later
# timing repeated. PORT_HOPPER_LANE_SUMS=0 in the environment chooses 0.
HOPPER_LANE_SUMS = _hopper_setting(
    "PORT_HOPPER_LANE_SUMS", "1", ("0", "1"),
    "is not a switch of the softmax's row sums: set 1 (the default, each thread's share, added across a row's "
    "threads at the store) or 0 (the whole row's sum every tile), or unset it")
# The persistent loop's tile counts from the load warp (1, the default): it writes a tile's
# full-block and tile counts beside its number in shared memory, so the warpgroups start the tile's
# first S without loading them from global memory (one load's latency per tile of 128 queries);
# 0: the warpgroups load them too. PORT_HOPPER_TILE_INFO=0 in the environment chooses 0.
HOPPER_TILE_INFO = _hopper_setting(
    "PORT_HOPPER_TILE_INFO", "1", ("0", "1"),
    "is not a switch of the persistent loop's tile counts: set 1 (the default, handed over by the load "
    "warp) or 0 (loaded by the warpgroups), or unset it")
# The persistent loop's store of a tile's out rows (1, the default): acc times a reciprocal per row,
# and at whole blocks the elements' places as 32-bit offsets from one pointer (_hopper_store's FAST:
# compiled for sm_90a, 180 fewer instructions in each warpgroup's store of a causal tile); 0: acc / l
# per element through a 64-bit pointer per element. PORT_HOPPER_FAST_STORE=0 in the environment
# chooses 0. Measured on an H100 (32K, kernel times, both switches against neither, two runs):
# bf16 D 128, 1,024 window 0.555 / 0.571 and 0.593 / 0.641 ms, per-head windows 0.399 / 0.418
# and 0.409 / 0.435, 8 documents 0.970 / 0.975 and 1.003 / 1.040; fp16 D 64, 0.413 / 0.420
# (window), 0.299 / 0.311 (per-head), 0.701 / 0.716 (documents); causal and prefix-LM within the
# runs' noise (causal 7.010 / 6.635 and 7.077 / 7.070).
HOPPER_FAST_STORE = _hopper_setting(
    "PORT_HOPPER_FAST_STORE", "1", ("0", "1"),
    "is not a switch of the persistent loop's store: set 1 (the default, a reciprocal per row) or 0 (a "
    "division per element), or unset it")
HOPPER_MODS = @@HOPPER_MODS@@  # None: the mods have a Gluon copy below; else why not

# Gluon and its Hopper module: this kernel is written against Triton 3.6's (Gluon's API moved
# between 3.4, 3.5 and 3.6: warp_specialize's arguments, the descriptors); with an older Triton the
# portable kernel runs everywhere
_HAS_GLUON = tuple(int(x) for x in triton.__version__.split(".")[:2] if x.isdigit()) >= (3, 6)
if _HAS_GLUON:
    try:
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                        warpgroup_mma, warpgroup_mma_wait)
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _GluonDescriptor
    except ImportError:  # a build without Gluon
        _HAS_GLUON = False
# (dtype, D, loop) whose Hopper kernel failed to build or launch here: those calls run the portable
# kernel, after one warning that names the cause (see _attention_hopper)
_HOPPER_FAILED: dict = {}

if _HAS_GLUON and HOPPER_MODS is None:
@@GLUON_MODS@@

    @gluon.jit
    def _hopper_tile_start(t, n_f, idx_f, idx_p, Lk, SUB: gl.constexpr, TABLE_N: gl.constexpr,
                           BLOCK_N: gl.constexpr, EVEN_N: gl.constexpr):
        # a row's t-th tile: (the first key loaded, the tile's first key, whether its block is
        # full). The full blocks come first, then the partial ones, each block TABLE_N keys in SUB
        # tiles of BLOCK_N. EVEN_N off (Lk not a multiple of TABLE_N): a tile running past the last
        # key is loaded from Lk - BLOCK_N instead, so every key it holds is this sequence's (the
        # flat [B * Hkv * Lk, D] view would hand it the next head's); the keys before its own
        # first are dropped by the mask (the block is never full: _block_class_kernel)
        j = t // SUB
        full = j < n_f
        c = gl.load(gl.where(full, idx_f + j, idx_p + (j - n_f)))
        first = c * TABLE_N + (t % SUB) * BLOCK_N
        if EVEN_N:
            return first, first, full
        else:
            return gl.minimum(first, Lk - BLOCK_N), first, full

    @gluon.jit
    def _hopper_load(desc, smem, bars, slot, row, pred):
        # one tile of keys or values (rows row .. row + BLOCK_N of the [B * Hkv * Lk, D] view) into
        # buffer `slot`, which signals its barrier when the bytes have landed
        mbarrier.expect(bars.index(slot), desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(desc, [row, 0], bars.index(slot), smem.index(slot), pred=pred)

    # Named barriers: bar.sync / bar.arrive on a hardware barrier id with a thread count (a multiple
    # of 32: whole warps), written as inline PTX. A barrier completes when that many threads have
    # arrived, the syncing ones included; a thread that only arrives goes on at once. Ids 8 and up
    # stay clear of the ones Triton's partitions use (0 to 3). The forward's ids (HOPPER_NAMED):
    # 8 + WG, warpgroup WG's turn on the tensor cores (its 128 threads sync, the other's 128 arrive);
    # 10 + slot and 13 + slot, ring buffer slot's keys / values read by both warpgroups (2 x 128
    # arrive, the load warp's 32 sync before it loads the slot again; a ring of at most 3).
    _BAR_TURN = gl.constexpr(8)
    _BAR_K_FREE = gl.constexpr(10)
    _BAR_V_FREE = gl.constexpr(13)

    @gluon.jit
    def _bar_sync(bar_id, threads: gl.constexpr):
        # wait at barrier `bar_id` until `threads` threads have arrived (this warp's 32 included)
        gl.inline_asm_elementwise("bar.sync $1, $2;\n\tmov.u32 $0, 0;", "=r,r,r", [bar_id, threads], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _bar_arrive(bar_id, threads: gl.constexpr):
        # count this warp's 32 threads in at barrier `bar_id` and go on
        gl.inline_asm_elementwise("bar.arrive $1, $2;\n\tmov.u32 $0, 0;", "=r,r,r", [bar_id, threads],
                                  dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _turn_wait(mine, parity, WG: gl.constexpr, NAMED: gl.constexpr):
        # (ping-pong) wait for this warpgroup's turn to issue its matmuls
        if NAMED % 2 == 1:
            _bar_sync(_BAR_TURN + WG, 256)
        else:
            mbarrier.wait(mine, parity)

    @gluon.jit
    def _turn_pass(other, WG: gl.constexpr, NAMED: gl.constexpr):
        # (ping-pong) this warpgroup's matmuls are issued: the other's turn
        if NAMED % 2 == 1:
            _bar_arrive(_BAR_TURN + 1 - WG, 256)
        else:
            mbarrier.arrive(other)

    @gluon.jit
    def _tile_waits(k_ready, k_slot, k_phase, v_ready, v_slot, v_phase, mine, parity, WG: gl.constexpr,
                    NAMED: gl.constexpr, HAS_K: gl.constexpr = True, HAS_V: gl.constexpr = True):
        # (ping-pong) before a turn's matmuls: the tile's keys (HAS_K) and the previous tile's values
        # (HAS_V) landed, and this warpgroup's turn; NAMED >= 4: the turn first (see HOPPER_NAMED)
        if NAMED >= 4:
            _turn_wait(mine, parity, WG, NAMED)
        if HAS_K:
            mbarrier.wait(k_ready.index(k_slot), k_phase)
        if HAS_V:
            mbarrier.wait(v_ready.index(v_slot), v_phase)
        if NAMED < 4:
            _turn_wait(mine, parity, WG, NAMED)

    @gluon.jit
    def _turn_start(WG: gl.constexpr, NAMED: gl.constexpr):
        # (ping-pong, named turns) warpgroup 0 goes first: warpgroup 1 arrives at its barrier once
        if NAMED % 2 == 1:
            if WG == 1:
                _bar_arrive(_BAR_TURN, 256)

    @gluon.jit
    def _turn_end(WG: gl.constexpr, NAMED: gl.constexpr):
        # (ping-pong, named turns) warpgroup 1's last pass left one arrival at warpgroup 0's barrier
        # (one more than warpgroup 0's turns): warpgroup 0 takes it, so no barrier is left half done
        if NAMED % 2 == 1:
            if WG == 0:
                _bar_sync(_BAR_TURN, 256)

    @gluon.jit
    def _release(empty, slot, FIRST: gl.constexpr, NAMED: gl.constexpr):
        # (ping-pong) this warpgroup has read ring slot `slot` (its matmul is done): give it back
        if (NAMED // 2) % 2 == 1:
            _bar_arrive(FIRST + slot, 288)
        else:
            mbarrier.arrive(empty.index(slot))

    @gluon.jit
    def _acquire(empty, slot, c, FIRST: gl.constexpr, NAMED: gl.constexpr, NUM_BUF: gl.constexpr):
        # (the load warp) wait until ring slot `slot` may take its c-th tile (c counts the ring's
        # tiles: the first NUM_BUF find it free)
        if (NAMED // 2) % 2 == 1:
            if c >= NUM_BUF:
                _bar_sync(FIRST + slot, 288)
        else:
            mbarrier.wait(empty.index(slot), ((c // NUM_BUF) & 1) ^ 1)

    @gluon.jit
    def _acquire_end(c, NAMED: gl.constexpr, NUM_BUF: gl.constexpr):
        # (the load warp, named releases) the ring's last NUM_BUF tiles are given back after the
        # last load: take those arrivals too, so no barrier is left half done
        if (NAMED // 2) % 2 == 1:
            for i in range(gl.maximum(c - NUM_BUF, 0), c):
                _bar_sync(_BAR_K_FREE + i % NUM_BUF, 288)
                _bar_sync(_BAR_V_FREE + i % NUM_BUF, 288)

    @gluon.jit
    def _end_block(x, ON: gl.constexpr):
        # (HOPPER_UNDER_PV) the end of a basic block: a branch on x (the row's full-block count or the
        # tile's first key, never negative, so never taken) around one side-effecting instruction,
        # which neither LLVM nor ptxas can fold away; ptxas does not hoist the wait for the previous
        # tile's P V out of its own block. After the softmax (1) the exponentials run while P V does;
        # after the row max and alpha (2) the max does, and O's rescale is issued among the
        # exponentials that follow
        if ON:
            if x < 0:
                gl.inline_asm_elementwise("nanosleep.u32 1;\n\tmov.u32 $0, 0;", "=r,r", [x], dtype=gl.int32,
                                          is_pure=False, pack=1)

    @gluon.jit
    def _row_sums(x, LANE: gl.constexpr):
        # the rows' sums of a tile x [rows, BLOCK_N] in the NVMMA layout: LANE, each thread's own
        # share, [rows, 4] (a row's column c lies with thread c // 2 % 4 of its quad, so the split
        # [BLOCK_N // 8, 4, 2] puts the quad's threads on the middle axis and the sums over the other
        # two stay within a thread); else the whole rows', [rows]
        if LANE:
            return gl.sum(gl.sum(gl.reshape(x, [x.shape[0], x.shape[1] // 8, 4, 2]), 3), 1)
        else:
            return gl.sum(x, 1)

    @gluon.jit
    def _row_total(l_i):
        # the rows' sums l from _row_sums's form: [rows, 4] shares added across a row's threads
        if len(l_i.shape) == 2:
            return gl.sum(l_i, 1)
        else:
            return l_i

    @gluon.jit
    def _hopper_softmax(qk, m_i, l_i, b, h, q_idx, kv_idx, first, Lk, full, sm_scale, @@ALL_PTR_PARAMS@@
                        HAS_SCORE: gl.constexpr, dtype: gl.constexpr, p_layout: gl.constexpr,
                        EVEN_N: gl.constexpr, PAGED: gl.constexpr, HOLD: gl.constexpr = False):
        # one tile's scores (score_mod, then the mask unless the block is full) into the online
        # softmax, base 2, the steps of _online_softmax_step: (P as the P V matmul's register
        # operand, the rows' rescale alpha, the new max, the new sum). Without a score_mod the
        # scale folds into the exponent: the row max is taken over the raw scores and times
        # c = scale * log2(e) (c > 0, _hopper_ready), and P = exp2(qk * c - max), one fused
        # multiply-add per score.
        if HAS_SCORE:
            s = score_log2_gluon(qk, sm_scale, b, h, q_idx, kv_idx@@SCORE_PTR_ARGS@@)  # (score_mod * log2(e))
        else:
            s = qk
        if not full:
            keep = mask_mod_gluon(b, h, q_idx, kv_idx@@MASK_PTR_ARGS@@) != 0
            if not EVEN_N:  # a tile loaded from Lk - BLOCK_N: the keys before its own first are another tile's
                keep = keep & (kv_idx >= first)
            if PAGED:  # (attention_paged) a request's last tile: the keys from Lk on are another's or nobody's
                keep = keep & (kv_idx < Lk)
            s = gl.where(keep, s, float("-inf"))
        if HAS_SCORE:
            m_new = gl.maximum(m_i, gl.max(s, 1))
        else:
            c = sm_scale * 1.4426950408889634
            m_new = gl.maximum(m_i, gl.max(s, 1) * c)
        # rows with nothing kept yet stay at -inf; shift them by 0 so exp2 gives 0, not NaN
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        _end_block(first, HOLD)  # (HOPPER_UNDER_PV = 2: the wait for P V after the max)
        if HAS_SCORE:
            p = gl.exp2(s - m_safe[:, None])
        else:
            p = gl.exp2(gl.fma(s, c, -m_safe[:, None]))
        if len(l_i.shape) == 2:  # (each thread's share of its rows' sums, see _row_sums)
            l_i = l_i * gl.convert_layout(alpha, gl.SliceLayout(1, l_i.type.layout))[:, None] + _row_sums(p, True)
        else:
            l_i = l_i * alpha + gl.sum(p, 1)
        return gl.convert_layout(p.to(dtype), p_layout), alpha, m_new, l_i

    @gluon.jit
    def _hopper_zero_tail(v_buf, keep, num_warps: gl.constexpr):
        # (attention_paged) rows keep .. BLOCK_N of a request's last tile of values set to 0 in
        # shared memory before its P V: they are the cache's slots past the request's end (another
        # request's, or never written), whose P is 0 but where a NaN would still give 0 * NaN. The
        # warps' stores are made visible to the tensor cores (fence, then a barrier of these warps)
        # before the matmul reads the tile. (In the ping-pong kernel both warpgroups zero the same
        # rows of the shared tile: they store the same values, so the order does not matter.)
        BLOCK_N: gl.constexpr = v_buf.type.shape[0]
        ROWS: gl.constexpr = 32
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        for i in gl.static_range(BLOCK_N // ROWS):
            if i * ROWS + ROWS > keep:
                part = v_buf.slice(i * ROWS, ROWS)
                rows = i * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
                v = part.load(layout)
                part.store(gl.where((rows < keep)[:, None], v, gl.zeros_like(v)))
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def _hopper_store(Out, Lse, acc, m_i, l_i, o_off, o_stride, l_off, l_stride, n_valid, poison,
                      RETURN_LSE: gl.constexpr, o_layout: gl.constexpr, EVEN_M: gl.constexpr, PAGED: gl.constexpr,
                      FAST: gl.constexpr = False):
        # out = acc / l (rows that kept nothing: 0, lse -inf) for the warpgroup's rows: row r at
        # element o_off + r * o_stride of Out and o_off's row of Lse (l_off + r * l_stride).
        # EVEN_M off: only the first n_valid rows are stored (the others, computed alongside, are
        # the next head's or request's queries). PAGED: poison != 0 makes the rows NaN (a request
        # of attention_paged whose numbers do not hold together). FAST: acc times 1 / l, a reciprocal
        # per row (a division per element takes several instructions), and at whole blocks the
        # elements' places as 32-bit offsets from one pointer (two instructions a store, not three
        # or four)
        BLOCK_M: gl.constexpr = acc.shape[0]
        HEAD_D: gl.constexpr = acc.shape[1]
        l_i = _row_total(l_i)
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        l_safe = gl.where(l_o == 0.0, 1.0, l_o)
        if FAST:
            out = acc * (1.0 / l_safe)[:, None]
        else:
            out = acc / l_safe[:, None]
        if PAGED:
            if poison != 0:
                out = out * float("nan")
        rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
        offs_d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))
        if FAST and EVEN_M:
            out_ptrs = (Out + o_off) + (rows[:, None] * o_stride + offs_d[None, :])
        else:  # (off the 128 grid the 32-bit form made ptxas spill more where a mask is heavy)
            out_ptrs = Out + o_off + rows.to(gl.int64)[:, None] * o_stride + offs_d[None, :]
        if EVEN_M:
            gl.store(out_ptrs, out.to(Out.dtype.element_ty))
        else:
            gl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=(rows < n_valid)[:, None])
        if RETURN_LSE:
            m_o = gl.convert_layout(m_i, gl.SliceLayout(1, o_layout))
            lse = gl.where(l_o == 0.0, float("-inf"), (m_o + gl.log2(l_safe)) * 0.6931471805599453)
            if PAGED:
                if poison != 0:
                    lse = lse * float("nan")
            if EVEN_M:
                gl.store(Lse + l_off + rows * l_stride, lse)
            else:
                gl.store(Lse + l_off + rows * l_stride, lse, mask=rows < n_valid)

    @gluon.jit
    def _hopper_producer(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, kv_row0, n_f, n_tiles,
                         idx_f, idx_p, Lk, SUB: gl.constexpr, TABLE_N: gl.constexpr, EVEN_N: gl.constexpr,
                         NAMED: gl.constexpr = 0):
        # the load warp of the specialized kernel: each tile's keys, then its values, into the
        # ring as soon as the consumers have released the buffer (its `empty` barrier; they start
        # released: a fresh barrier's phase 1 counts as complete)
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        NUM_BUF: gl.constexpr = k_smem.type.shape[0]
        for t in range(0, n_tiles):
            slot = t % NUM_BUF
            start, _, _ = _hopper_tile_start(t, n_f, idx_f, idx_p, Lk, SUB, TABLE_N, BLOCK_N, EVEN_N)
            _acquire(k_empty, slot, t, _BAR_K_FREE, NAMED, NUM_BUF)
            _hopper_load(k_desc, k_smem, k_ready, slot, kv_row0 + start, True)
            _acquire(v_empty, slot, t, _BAR_V_FREE, NAMED, NUM_BUF)
            _hopper_load(v_desc, v_smem, v_ready, slot, kv_row0 + start, True)
        _acquire_end(n_tiles, NAMED, NUM_BUF)

    @gluon.jit
    def _hopper_consumer(q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, Out, Lse, b, h,
                         q_pos0, n_valid, o_off, o_stride, l_off, l_stride, poison, Lk, n_f, n_tiles, idx_f, idx_p,
                         sm_scale, @@ALL_PTR_PARAMS@@
                         HAS_SCORE: gl.constexpr, RETURN_LSE: gl.constexpr, SUB: gl.constexpr,
                         TABLE_N: gl.constexpr, num_warps: gl.constexpr, EVEN_M: gl.constexpr,
                         EVEN_N: gl.constexpr, PAGED: gl.constexpr, UNDER_PV: gl.constexpr = 0,
                         LANE: gl.constexpr = 0):
        # the math warps of the specialized kernel, over the program's BLOCK_M queries. Per tile t:
        # S = Q K^T (wgmma, Q and K from shared memory), then the score_mod, the mask and the online
        # softmax (_hopper_softmax), then O = O * alpha + P V (wgmma, P from registers). Overlapped
        # as in FlashAttention-3: tile t's S is issued together with tile t-1's P V, and t's
        # softmax comes before the wait for that P V (O is rescaled after; ptxas runs the softmax
        # under P V only with HOPPER_UNDER_PV, see _end_block). Each buffer goes back to the load warp
        # (its `empty` barrier) as soon as the matmul reading it has finished. The rows' place:
        # q_pos0 = the mods' q_idx of the first row, n_valid = the rows that are queries of this
        # sequence, (o_off, o_stride, l_off, l_stride) where they are stored (_hopper_store)
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
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = _row_sums(gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout), LANE)
        acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, layout=o_layout)
        zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        q_idx = (q_pos0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout)))[:, None]
        if not EVEN_M:  # rows past the sequence's queries are computed, never stored: the mods see its last one
            q_idx = gl.minimum(q_idx, q_pos0 + n_valid - 1)
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))[None, :]
        mbarrier.wait(q_bar, 0)
        if n_tiles > 0:
            start, first, full = _hopper_tile_start(0, n_f, idx_f, idx_p, Lk, SUB, TABLE_N, BLOCK_N, EVEN_N)
            mbarrier.wait(k_ready.index(0), 0)
            qk = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk, ))
            mbarrier.arrive(k_empty.index(0), count=1)
            p, alpha, m_i, l_i = _hopper_softmax(qk, m_i, l_i, b, h, q_idx, start + cols, first, Lk, full, sm_scale,
                                                 @@ALL_PTR_PARAMS@@HAS_SCORE, dtype, p_layout, EVEN_N, PAGED)
            for t in range(1, n_tiles):
                slot = t % NUM_BUF
                prev = (t - 1) % NUM_BUF
                start, first, full = _hopper_tile_start(t, n_f, idx_f, idx_p, Lk, SUB, TABLE_N, BLOCK_N, EVEN_N)
                mbarrier.wait(k_ready.index(slot), (t // NUM_BUF) & 1)
                qk = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
                mbarrier.wait(v_ready.index(prev), ((t - 1) // NUM_BUF) & 1)
                acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
                qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk, ))  # S is done; P V may still run
                mbarrier.arrive(k_empty.index(slot), count=1)
                p, alpha, m_i, l_i = _hopper_softmax(qk, m_i, l_i, b, h, q_idx, start + cols, first, Lk, full,
                                                     sm_scale, @@ALL_PTR_PARAMS@@HAS_SCORE, dtype, p_layout, EVEN_N,
                                                     PAGED, UNDER_PV == 2)
                _end_block(n_f, UNDER_PV == 1)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                mbarrier.arrive(v_empty.index(prev), count=1)
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            final = (n_tiles - 1) % NUM_BUF
            mbarrier.wait(v_ready.index(final), ((n_tiles - 1) // NUM_BUF) & 1)
            if PAGED:  # (a request's last tile, the only one that may run past its end)
                if first + BLOCK_N > Lk:
                    _hopper_zero_tail(v_smem.index(final), Lk - first, num_warps)
            acc = warpgroup_mma(p, v_smem.index(final), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(v_empty.index(final), count=1)
        _hopper_store(Out, Lse, acc, m_i, l_i, o_off, o_stride, l_off, l_stride, n_valid, poison, RETURN_LSE, o_layout,
                      EVEN_M, PAGED)

    @gluon.jit
    def _hopper_specialized_kernel(q_desc, k_desc, v_desc, Out, Lse, partial_num, partial_idx, full_num, full_idx,
                                   s_tb, s_th, n_cols, Hq, group, Lq, Lk, sm_scale, @@ALL_PTR_PARAMS@@
                                   HAS_SCORE: gl.constexpr, RETURN_LSE: gl.constexpr, TABLE_M: gl.constexpr,
                                   TABLE_N: gl.constexpr, NUM_BUF: gl.constexpr, num_warps: gl.constexpr,
                                   PINGPONG: gl.constexpr = False, EVEN_M: gl.constexpr = True,
                                   EVEN_N: gl.constexpr = True, NAMED: gl.constexpr = 0, UNDER_PV: gl.constexpr = 0,
                                   LANE: gl.constexpr = 0):
        # one program = BLOCK_M queries of one (batch entry, head) over the blocks its row of the
        # lists names (full ones without the mask, then partial ones with it). EVEN_M / EVEN_N:
        # Lq / Lk are multiples of BLOCK_M / TABLE_N. Otherwise (HOPPER_RAGGED) the last block of
        # queries reads rows past Lq (the next head's; computed, never stored, the mods see the last
        # row there), and a tile of keys past Lk is loaded from Lk - BLOCK_N (_hopper_tile_start). The
        # work is split by role: one warp issues the TMA loads of keys and values into rings of
        # NUM_BUF buffers (_hopper_producer); `ready` / `empty` barriers per buffer pass each
        # buffer back and forth. HOPPER_LOOP = "specialized": the kernel's warps do the matmuls and
        # the softmax (_hopper_consumer). "pingpong" (PINGPONG, FlashAttention-3's schedule): two
        # warpgroups each own 64 of the 128 rows and run the same overlapped loop, issuing their
        # matmuls in turn (_hopper_pingpong_consumer, the `turn` barriers), so the tensor cores
        # work on one's while the other computes its softmax; a buffer is released when both have
        # read it; the kernel's own warps (num_warps = 4) are warpgroup 0.
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        HEAD_D: gl.constexpr = q_desc.block_type.shape[1]
        SUB: gl.constexpr = TABLE_N // BLOCK_N
        dtype: gl.constexpr = q_desc.dtype
        pid_m = gl.num_programs(0) - 1 - gl.program_id(0)  # the last rows first: under a causal mask the heaviest
        bh = gl.program_id(1)
        b = bh // Hq
        h = bh % Hq
        kv_row0 = (b * (Hq // group) + h // group) * Lk
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_D], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, HEAD_D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, HEAD_D], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        if PINGPONG:
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
        if PINGPONG:
            for i in gl.static_range(2):
                mbarrier.init(turn.index(i), count=1)
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [bh * Lq + pid_m * BLOCK_M, 0], q_bar, q_smem)
        row = b * s_tb + h * s_th + (pid_m * BLOCK_M) // TABLE_M
        n_f = gl.load(full_num + row)
        n_tiles = (n_f + gl.load(partial_num + row)) * SUB
        idx_f = full_idx + row * n_cols
        idx_p = partial_idx + row * n_cols
        # the rows' place (_hopper_consumer): query pid_m * BLOCK_M on, [B * Hq * Lq, D] rows of out / lse
        row0 = pid_m * BLOCK_M
        l_off = bh.to(gl.int64) * Lq + row0
        o_off = l_off * HEAD_D
        n_valid = Lq - row0
        if PINGPONG:
            gl.warp_specialize([
                (_hopper_pingpong_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn,
                                             Out, Lse, b, h, row0, n_valid, o_off, HEAD_D, l_off, 1, 0, Lk, n_f,
                                             n_tiles, idx_f, idx_p, sm_scale, @@ALL_PTR_PARAMS@@HAS_SCORE, RETURN_LSE,
                                             SUB, TABLE_N, 0, EVEN_M, EVEN_N, False, NAMED, UNDER_PV,
                                             LANE)),
                (_hopper_pingpong_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn,
                                             Out, Lse, b, h, row0, n_valid, o_off, HEAD_D, l_off, 1, 0, Lk, n_f,
                                             n_tiles, idx_f, idx_p, sm_scale, @@ALL_PTR_PARAMS@@HAS_SCORE, RETURN_LSE,
                                             SUB, TABLE_N, 1, EVEN_M, EVEN_N, False, NAMED, UNDER_PV,
                                             LANE)),
                (_hopper_producer, (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, kv_row0, n_f,
                                    n_tiles, idx_f, idx_p, Lk, SUB, TABLE_N, EVEN_N, NAMED)),
            ], [4, 1], [240, 24])
        else:
            gl.warp_specialize([
                (_hopper_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, Out, Lse, b, h,
                                    row0, n_valid, o_off, HEAD_D, l_off, 1, 0, Lk, n_f, n_tiles, idx_f, idx_p, sm_scale,
                                    @@ALL_PTR_PARAMS@@HAS_SCORE, RETURN_LSE, SUB, TABLE_N, num_warps, EVEN_M, EVEN_N,
                                    False, UNDER_PV, LANE)),
                (_hopper_producer, (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, kv_row0, n_f,
                                    n_tiles, idx_f, idx_p, Lk, SUB, TABLE_N, EVEN_N)),
            ], [1], [24])

    @gluon.jit
    def _hopper_pingpong_consumer(q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn, Out, Lse,
                                  b, h, q_pos0, n_valid, o_off, o_stride, l_off, l_stride, poison, Lk, n_f, n_tiles,
                                  idx_f, idx_p, sm_scale, @@ALL_PTR_PARAMS@@
                                  HAS_SCORE: gl.constexpr, RETURN_LSE: gl.constexpr, SUB: gl.constexpr,
                                  TABLE_N: gl.constexpr, WG: gl.constexpr, EVEN_M: gl.constexpr,
                                  EVEN_N: gl.constexpr, PAGED: gl.constexpr, NAMED: gl.constexpr = 0,
                                  UNDER_PV: gl.constexpr = 0, LANE: gl.constexpr = 0):
        # one warpgroup (4 warps) of the ping-pong kernel: query rows WG * 64 .. WG * 64 + 64 of the
        # program's 128, the overlapped loop (tile t's S = Q K^T issued with tile t-1's P V, the
        # softmax before the wait for it: _end_block). The two warpgroups take turns to issue their matmuls (`turn`, one
        # barrier each: a warpgroup waits for its own, issues, then signals the other's), so one's
        # softmax runs while the other's matmuls hold the tensor cores. Warpgroup 0 goes first: its
        # first wait is for parity 1, which a fresh barrier counts as complete.
        HALF: gl.constexpr = q_smem.type.shape[0] // 2
        HEAD_D: gl.constexpr = q_smem.type.shape[1]
        BLOCK_N: gl.constexpr = k_smem.type.shape[1]
        NUM_BUF: gl.constexpr = k_smem.type.shape[0]
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        q_part = q_smem.slice(WG * HALF, HALF)
        mine = turn.index(WG)
        other = turn.index(1 - WG)
        row0 = q_pos0 + WG * HALF  # (the place of the program's rows: see _hopper_consumer)
        m_i = gl.full([HALF], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = _row_sums(gl.zeros([HALF, BLOCK_N], gl.float32, layout=s_layout), LANE)
        acc = gl.zeros([HALF, HEAD_D], gl.float32, layout=o_layout)
        zero_s = gl.zeros([HALF, BLOCK_N], gl.float32, layout=s_layout)
        q_idx = (row0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout)))[:, None]
        if not EVEN_M:  # rows past the sequence's queries are computed, never stored: the mods see its last one
            q_idx = gl.minimum(q_idx, q_pos0 + n_valid - 1)
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))[None, :]
        _turn_start(WG, NAMED)
        mbarrier.wait(q_bar, 0)
        if n_tiles > 0:
            # turn 0: tile 0's S alone
            start, first, full = _hopper_tile_start(0, n_f, idx_f, idx_p, Lk, SUB, TABLE_N, BLOCK_N, EVEN_N)
            _tile_waits(k_ready, 0, 0, v_ready, 0, 0, mine, 1 - WG, WG, NAMED, HAS_V=False)
            qk = warpgroup_mma(q_part, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            _turn_pass(other, WG, NAMED)
            qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk, ))
            _release(k_empty, 0, _BAR_K_FREE, NAMED)
            p, alpha, m_i, l_i = _hopper_softmax(qk, m_i, l_i, b, h, q_idx, start + cols, first, Lk, full, sm_scale,
                                                 @@ALL_PTR_PARAMS@@HAS_SCORE, dtype, p_layout, EVEN_N, PAGED)
            for t in range(1, n_tiles):  # turn t: tile t's S with tile t-1's P V
                slot = t % NUM_BUF
                prev = (t - 1) % NUM_BUF
                start, first, full = _hopper_tile_start(t, n_f, idx_f, idx_p, Lk, SUB, TABLE_N, BLOCK_N, EVEN_N)
                _tile_waits(k_ready, slot, (t // NUM_BUF) & 1, v_ready, prev, ((t - 1) // NUM_BUF) & 1, mine,
                            (t & 1) ^ (1 - WG), WG, NAMED)
                qk = warpgroup_mma(q_part, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
                acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
                _turn_pass(other, WG, NAMED)
                qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk, ))  # S is done; P V may still run
                _release(k_empty, slot, _BAR_K_FREE, NAMED)
                p, alpha, m_i, l_i = _hopper_softmax(qk, m_i, l_i, b, h, q_idx, start + cols, first, Lk, full,
                                                     sm_scale, @@ALL_PTR_PARAMS@@HAS_SCORE, dtype, p_layout, EVEN_N,
                                                     PAGED, UNDER_PV == 2)
                _end_block(n_f, UNDER_PV == 1)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                _release(v_empty, prev, _BAR_V_FREE, NAMED)
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            # turn n_tiles: the last tile's P V
            final = (n_tiles - 1) % NUM_BUF
            if PAGED:  # (a request's last tile, the only one that may run past its end)
                mbarrier.wait(v_ready.index(final), ((n_tiles - 1) // NUM_BUF) & 1)
                if first + BLOCK_N > Lk:
                    _hopper_zero_tail(v_smem.index(final), Lk - first, 4)
                _turn_wait(mine, (n_tiles & 1) ^ (1 - WG), WG, NAMED)
            else:
                _tile_waits(k_ready, 0, 0, v_ready, final, ((n_tiles - 1) // NUM_BUF) & 1, mine,
                            (n_tiles & 1) ^ (1 - WG), WG, NAMED, HAS_K=False)
            acc = warpgroup_mma(p, v_smem.index(final), acc, is_async=True)
            _turn_pass(other, WG, NAMED)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            _release(v_empty, final, _BAR_V_FREE, NAMED)
        _turn_end(WG, NAMED)
        _hopper_store(Out, Lse, acc, m_i, l_i, o_off + WG * HALF * o_stride, o_stride, l_off + WG * HALF * l_stride,
                      l_stride, n_valid - WG * HALF, poison, RETURN_LSE, o_layout, EVEN_M, PAGED)

    @gluon.jit
    def _hopper_tile_of(tile, num_m, BH, Hq, s_tb, s_th, n_cols, full_num, partial_num, full_idx, partial_idx,
                        TABLE_M: gl.constexpr, BLOCK_M: gl.constexpr, SUB: gl.constexpr, n_f_known=0,
                        n_tiles_known=0, KNOWN: gl.constexpr = False):
        # the persistent kernel's tile number -> (pid_m, bh, b, h, the row's full-block count, its
        # tile count, its lists); KNOWN: the two counts as the load warp read them (_tile_info), so
        # the warpgroups' first S of a tile does not wait for a load from global memory.
        # Tiles are numbered head by head, each head's last row block first:
        # under a causal mask a head's heaviest rows are taken first, and the programs at work share
        # a few heads' keys and values in L2. (Numbered every head's last row first, the working set
        # is every head's: causal 32K ran 7.52 ms against the ping-pong kernel's 7.11 in one H200 run,
        # 7.55 against 7.61 in another; head by head, 7.087 against 7.088)
        bh = tile // num_m
        pid_m = num_m - 1 - tile % num_m
        b = bh // Hq
        h = bh % Hq
        row = b * s_tb + h * s_th + (pid_m * BLOCK_M) // TABLE_M
        if KNOWN:
            n_f = n_f_known
            n_tiles = n_tiles_known
        else:
            n_f = gl.load(full_num + row)
            n_tiles = (n_f + gl.load(partial_num + row)) * SUB
        return pid_m, bh, b, h, n_f, n_tiles, full_idx + row * n_cols, partial_idx + row * n_cols

    @gluon.jit
    def _tile_info(buf, INFO: gl.constexpr):
        # the warpgroups' read of the load warp's note on the next tile (buf: 32 int32 of shared
        # memory, read after its q_ready phase): (tile number, full-block count, tile count) in lanes
        # 0, 1, 2 (INFO), else the tile number in every lane (counts 0: _hopper_tile_of loads them)
        if INFO:
            layout: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])  # (every thread reads all 4)
            v = buf.slice(0, 4).load(layout)
            lane = gl.arange(0, 4, layout=layout)
            return (gl.max(gl.where(lane == 0, v, -1), 0), gl.max(gl.where(lane == 1, v, -1), 0),
                    gl.max(gl.where(lane == 2, v, -1), 0))
        else:
            layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
            return gl.max(buf.load(layout), 0), 0, 0

    @gluon.jit
    def _hopper_persistent_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, tile_smem, q_ready, q_empty,
                                    k_ready, v_ready, k_empty, v_empty, counter, num_m, BH, Hq, group, Lq, Lk,
                                    s_tb, s_th, n_cols, full_num, partial_num, full_idx, partial_idx,
                                    TABLE_M: gl.constexpr, SUB: gl.constexpr, TABLE_N: gl.constexpr,
                                    EVEN_N: gl.constexpr, NAMED: gl.constexpr = 0, INFO: gl.constexpr = 0):
        # the load warp of the persistent kernel. It takes the next tile from the call's counter
        # (an atomic add: programs that finish early take more), waits until both warpgroups are
        # done with the queries of the tile before, writes the tile's number into `tile_smem` and
        # brings its 128 queries (one `q_ready` phase per tile), then its keys and values through
        # the ring (`c` counts K / V tiles over all of the program's tiles, as the warpgroups do).
        # Past the last tile it writes num_m * BH and completes `q_ready` without a copy: the
        # warpgroups stop there. With two buffers of queries (HOPPER_Q_BUFFERS) tile j takes buffer
        # j % 2: the next tile's queries load while this tile's keys still run.
        QB: gl.constexpr = q_smem.type.shape[0]
        BLOCK_M: gl.constexpr = q_smem.type.shape[1]
        BLOCK_N: gl.constexpr = k_smem.type.shape[1]
        NUM_BUF: gl.constexpr = k_smem.type.shape[0]
        id_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        total = num_m * BH
        c = 0
        j = 0
        tile = gl.atomic_add(counter, 1)
        while tile < total:
            pid_m, bh, b, h, n_f, n_tiles, idx_f, idx_p = _hopper_tile_of(
                tile, num_m, BH, Hq, s_tb, s_th, n_cols, full_num, partial_num, full_idx, partial_idx, TABLE_M,
                BLOCK_M, SUB)
            kv_row0 = (b * (Hq // group) + h // group) * Lk
            qs = j % QB
            mbarrier.wait(q_empty.index(qs), ((j // QB) & 1) ^ 1)
            if INFO:  # (lanes 1 and 2: the counts, so the warpgroups need not load them: _tile_info)
                lane = gl.arange(0, 32, layout=id_layout)
                tile_smem.index(qs).store(gl.where(lane == 1, n_f, gl.where(lane == 2, n_tiles, tile)))
                gl.thread_barrier()  # (the warp's stores ordered before one thread's arrive below releases them)
            else:
                tile_smem.index(qs).store(gl.full([32], tile, gl.int32, layout=id_layout))
            mbarrier.expect(q_ready.index(qs), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [bh * Lq + pid_m * BLOCK_M, 0], q_ready.index(qs),
                                            q_smem.index(qs))
            for t in range(0, n_tiles):
                slot = c % NUM_BUF
                start, _, _ = _hopper_tile_start(t, n_f, idx_f, idx_p, Lk, SUB, TABLE_N, BLOCK_N, EVEN_N)
                _acquire(k_empty, slot, c, _BAR_K_FREE, NAMED, NUM_BUF)
                _hopper_load(k_desc, k_smem, k_ready, slot, kv_row0 + start, True)
                _acquire(v_empty, slot, c, _BAR_V_FREE, NAMED, NUM_BUF)
                _hopper_load(v_desc, v_smem, v_ready, slot, kv_row0 + start, True)
                c += 1
            j += 1
            tile = gl.atomic_add(counter, 1)
        # every program takes one number past the last tile, so the call's fetches are total +
        # programs: the program whose fetch was the last one puts the counter back to 0 for the next
        # call (no other program of this call touches it again; the next call on this stream starts
        # after this one ends), so the host zeroes nothing per call
        if tile == total + gl.num_programs(0) - 1:
            gl.atomic_xchg(counter, 0)
        qs = j % QB
        mbarrier.wait(q_empty.index(qs), ((j // QB) & 1) ^ 1)
        tile_smem.index(qs).store(gl.full([32], total, gl.int32, layout=id_layout))
        mbarrier.arrive(q_ready.index(qs), count=1)
        _acquire_end(c, NAMED, NUM_BUF)

    @gluon.jit
    def _hopper_persistent_consumer(q_smem, k_smem, v_smem, tile_smem, q_ready, q_empty, k_ready, v_ready, k_empty,
                                    v_empty, turn, Out, Lse, num_m, BH, Hq, Lq, Lk, s_tb, s_th, n_cols, full_num,
                                    partial_num, full_idx, partial_idx, sm_scale, @@ALL_PTR_PARAMS@@
                                    HAS_SCORE: gl.constexpr, RETURN_LSE: gl.constexpr, TABLE_M: gl.constexpr,
                                    SUB: gl.constexpr, TABLE_N: gl.constexpr, WG: gl.constexpr,
                                    EVEN_M: gl.constexpr, EVEN_N: gl.constexpr, NAMED: gl.constexpr = 0,
                                    UNDER_PV: gl.constexpr = 0, INFO: gl.constexpr = 0,
                                    FAST_STORE: gl.constexpr = False, LANE: gl.constexpr = 0):
        # one warpgroup of the persistent kernel: _hopper_pingpong_consumer's loop (rows WG * 64 ..
        # + 64 of each tile's 128) over the tiles the load warp hands over, until it hands over
        # num_m * BH. The K / V slots and their phases follow `c`, and the turns `u`, counted over
        # all of the program's tiles exactly as the load warp and the other warpgroup count them.
        # Both warpgroups release the queries (`q_empty`) once their last S is done, so the next
        # tile's queries load under this tile's last P V and its store (with two buffers of queries,
        # under the whole tile: tile j's are buffer j % 2).
        QB: gl.constexpr = q_smem.type.shape[0]
        BLOCK_M: gl.constexpr = q_smem.type.shape[1]
        HALF: gl.constexpr = BLOCK_M // 2
        HEAD_D: gl.constexpr = q_smem.type.shape[2]
        BLOCK_N: gl.constexpr = k_smem.type.shape[1]
        NUM_BUF: gl.constexpr = k_smem.type.shape[0]
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        mine = turn.index(WG)
        other = turn.index(1 - WG)
        zero_s = gl.zeros([HALF, BLOCK_N], gl.float32, layout=s_layout)
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))[None, :]
        total = num_m * BH
        c = 0
        u = 0
        j = 0
        _turn_start(WG, NAMED)
        mbarrier.wait(q_ready.index(0), 0)
        tile, n_f_in, n_tiles_in = _tile_info(tile_smem.index(0), INFO)
        while tile < total:
            qs = j % QB
            q_part = q_smem.index(qs).slice(WG * HALF, HALF)
            pid_m, bh, b, h, n_f, n_tiles, idx_f, idx_p = _hopper_tile_of(
                tile, num_m, BH, Hq, s_tb, s_th, n_cols, full_num, partial_num, full_idx, partial_idx, TABLE_M,
                BLOCK_M, SUB, n_f_in, n_tiles_in, INFO)
            row0 = pid_m * BLOCK_M
            n_valid = Lq - row0
            l_off = bh.to(gl.int64) * Lq + row0
            m_i = gl.full([HALF], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
            l_i = _row_sums(zero_s, LANE)
            acc = gl.zeros([HALF, HEAD_D], gl.float32, layout=o_layout)
            q_idx = (row0 + WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout)))[:, None]
            if not EVEN_M:  # rows past the sequence's queries are computed, never stored: the mods see its last one
                q_idx = gl.minimum(q_idx, row0 + n_valid - 1)
            if n_tiles > 0:
                start, first, full = _hopper_tile_start(0, n_f, idx_f, idx_p, Lk, SUB, TABLE_N, BLOCK_N, EVEN_N)
                slot = c % NUM_BUF
                _tile_waits(k_ready, slot, (c // NUM_BUF) & 1, v_ready, 0, 0, mine, (u & 1) ^ (1 - WG), WG, NAMED,
                            HAS_V=False)
                qk = warpgroup_mma(q_part, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
                _turn_pass(other, WG, NAMED)
                u += 1
                qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk, ))
                _release(k_empty, slot, _BAR_K_FREE, NAMED)
                p, alpha, m_i, l_i = _hopper_softmax(qk, m_i, l_i, b, h, q_idx, start + cols, first, Lk, full,
                                                     sm_scale, @@ALL_PTR_PARAMS@@HAS_SCORE, dtype, p_layout, EVEN_N,
                                                     False)
                for t in range(1, n_tiles):  # tile t's S with tile t-1's P V
                    prev = c % NUM_BUF
                    prev_phase = (c // NUM_BUF) & 1
                    c += 1
                    slot = c % NUM_BUF
                    start, first, full = _hopper_tile_start(t, n_f, idx_f, idx_p, Lk, SUB, TABLE_N, BLOCK_N, EVEN_N)
                    _tile_waits(k_ready, slot, (c // NUM_BUF) & 1, v_ready, prev, prev_phase, mine,
                                (u & 1) ^ (1 - WG), WG, NAMED)
                    qk = warpgroup_mma(q_part, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False,
                                       is_async=True)
                    acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
                    _turn_pass(other, WG, NAMED)
                    u += 1
                    qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk, ))  # S is done; P V may still run
                    _release(k_empty, slot, _BAR_K_FREE, NAMED)
                    p, alpha, m_i, l_i = _hopper_softmax(qk, m_i, l_i, b, h, q_idx, start + cols, first, Lk, full,
                                                         sm_scale, @@ALL_PTR_PARAMS@@HAS_SCORE, dtype, p_layout,
                                                         EVEN_N, False, UNDER_PV == 2)
                    _end_block(n_f, UNDER_PV == 1)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                    _release(v_empty, prev, _BAR_V_FREE, NAMED)
                    # (O's rescale here, after its P V, as FlashAttention-3 and -4 do at D <= 128; held
                    # under the next tile's S instead, where they put it above D 128, it gave no gain on
                    # an H100: docs/benchmarks.md)
                    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
                mbarrier.arrive(q_empty.index(qs))  # (this warpgroup's last S is done: the next queries may load)
                final = c % NUM_BUF
                _tile_waits(k_ready, 0, 0, v_ready, final, (c // NUM_BUF) & 1, mine, (u & 1) ^ (1 - WG), WG, NAMED,
                            HAS_K=False)
                acc = warpgroup_mma(p, v_smem.index(final), acc, is_async=True)
                _turn_pass(other, WG, NAMED)
                u += 1
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                _release(v_empty, final, _BAR_V_FREE, NAMED)
                c += 1
            else:
                mbarrier.arrive(q_empty.index(qs))
            _hopper_store(Out, Lse, acc, m_i, l_i, (l_off + WG * HALF) * HEAD_D, HEAD_D, l_off + WG * HALF, 1,
                          n_valid - WG * HALF, 0, RETURN_LSE, o_layout, EVEN_M, False, FAST_STORE)
            j += 1
            mbarrier.wait(q_ready.index(j % QB), (j // QB) & 1)
            tile, n_f_in, n_tiles_in = _tile_info(tile_smem.index(j % QB), INFO)
        _turn_end(WG, NAMED)

    @gluon.jit
    def _hopper_persistent_kernel(q_desc, k_desc, v_desc, Out, Lse, partial_num, partial_idx, full_num, full_idx,
                                  s_tb, s_th, n_cols, Hq, group, Lq, Lk, sm_scale, counter, BH, @@ALL_PTR_PARAMS@@
                                  HAS_SCORE: gl.constexpr, RETURN_LSE: gl.constexpr, TABLE_M: gl.constexpr,
                                  TABLE_N: gl.constexpr, NUM_BUF: gl.constexpr, num_warps: gl.constexpr,
                                  EVEN_M: gl.constexpr = True, EVEN_N: gl.constexpr = True,
                                  NAMED: gl.constexpr = 0, Q_BUF: gl.constexpr = 1, UNDER_PV: gl.constexpr = 0,
                                  INFO: gl.constexpr = 0, FAST_STORE: gl.constexpr = False, LANE: gl.constexpr = 0):
        # HOPPER_LOOP = "persistent": the ping-pong kernel's roles in one program per SM, each
        # taking (row block, head) tiles from the call's counter until none is left, heaviest first
        # (_hopper_tile_of). Q_BUF = 1 buffer of queries (so the ring keeps its three K / V
        # buffers): the load warp brings the next tile's queries under this tile's last P V and its
        # store, and its keys and values right behind; Q_BUF = 2 (HOPPER_Q_BUFFERS): tile j's queries
        # in buffer j % 2, brought while tile j - 1 still runs. Where a row's work is short
        # (windows, documents) the program's start and end no longer sit between tiles.
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        HEAD_D: gl.constexpr = q_desc.block_type.shape[1]
        SUB: gl.constexpr = TABLE_N // BLOCK_N
        dtype: gl.constexpr = q_desc.dtype
        num_m = gl.cdiv(Lq, BLOCK_M)
        q_smem = gl.allocate_shared_memory(dtype, [Q_BUF, BLOCK_M, HEAD_D], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, HEAD_D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, HEAD_D], v_desc.layout)
        tile_smem = gl.allocate_shared_memory(gl.int32, [Q_BUF, 32], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        q_ready = gl.allocate_shared_memory(gl.int64, [Q_BUF, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUF, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(Q_BUF):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)  # both warpgroups release the queries
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        for i in gl.static_range(NUM_BUF):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)
            mbarrier.init(v_empty.index(i), count=2)
        gl.warp_specialize([
            (_hopper_persistent_consumer, (q_smem, k_smem, v_smem, tile_smem, q_ready, q_empty, k_ready, v_ready,
                                           k_empty, v_empty, turn, Out, Lse, num_m, BH, Hq, Lq, Lk, s_tb, s_th, n_cols,
                                           full_num, partial_num, full_idx, partial_idx, sm_scale,
                                           @@ALL_PTR_PARAMS@@HAS_SCORE, RETURN_LSE, TABLE_M, SUB, TABLE_N, 0, EVEN_M,
                                           EVEN_N, NAMED, UNDER_PV, INFO, FAST_STORE, LANE)),
            (_hopper_persistent_consumer, (q_smem, k_smem, v_smem, tile_smem, q_ready, q_empty, k_ready, v_ready,
                                           k_empty, v_empty, turn, Out, Lse, num_m, BH, Hq, Lq, Lk, s_tb, s_th, n_cols,
                                           full_num, partial_num, full_idx, partial_idx, sm_scale,
                                           @@ALL_PTR_PARAMS@@HAS_SCORE, RETURN_LSE, TABLE_M, SUB, TABLE_N, 1, EVEN_M,
                                           EVEN_N, NAMED, UNDER_PV, INFO, FAST_STORE, LANE)),
            (_hopper_persistent_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, tile_smem, q_ready,
                                           q_empty, k_ready, v_ready, k_empty, v_empty, counter, num_m, BH, Hq, group,
                                           Lq, Lk, s_tb, s_th, n_cols, full_num, partial_num, full_idx, partial_idx,
                                           TABLE_M, SUB, TABLE_N, EVEN_N, NAMED, INFO)),
        ], [4, 1], [240, 24])  # (the load warp walks the tiles too)


def _hopper_ready(q, k, v, bounds, invariant, scale=None) -> bool:
    """Whether this call runs the Hopper kernel: HOPPER on, Gluon there and the mods translated,
    an sm_90 GPU, bf16 / fp16, D 64 or 128, contiguous q, k, v on 16 bytes (TMA's alignment: a
    slice that starts elsewhere runs the portable kernel), Lq and Lk at least 128 each (and
    multiples of 128 with HOPPER_RAGGED off), not packed (cu_seqlens), not invariant mode and a
    positive scale. Any other call runs the portable kernel."""
    if not (HOPPER and _HAS_GLUON and HOPPER_MODS is None) or _INTERPRET or bounds is not None or invariant:
        return False
    if scale is not None and not scale > 0:
        return False
    if q.device.type != "cuda" or _capability(q.device) != (9, 0):
        return False
    B, Hq, Lq, D = q.shape
    if (q.dtype, D, _hopper_loop(D)) in _HOPPER_FAILED:
        return False
    Lk = k.shape[2]
    even = Lq % 128 == 0 and Lk % 128 == 0
    return (q.dtype in (torch.bfloat16, torch.float16) and D in (64, 128)
            and (even or (HOPPER_RAGGED and Lq >= 128 and Lk >= max(128, HOPPER_TILE[0])))
            and TABLE_M == 128 and TABLE_N % HOPPER_TILE[0] == 0
            and all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (q, k, v)))


# per-call host work is a short call's cost (8K tokens of 1,024-token documents: about 0.11 ms
# of kernel), so what does not change between calls is computed once: the GPU's compute
# capability, each tile shape's shared-memory layout
_CAPABILITIES: dict = {}
_SHARED_LAYOUTS: dict = {}


def _capability(device) -> tuple:
    """torch.cuda.get_device_capability(device), cached (the query costs microseconds a call)."""
    if device not in _CAPABILITIES:
        _CAPABILITIES[device] = torch.cuda.get_device_capability(device)
    return _CAPABILITIES[device]


_SM_COUNTS: dict = {}


def _sm_count(device) -> int:
    """The GPU's number of SMs (the persistent form's programs), cached."""
    if device not in _SM_COUNTS:
        _SM_COUNTS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNTS[device]


_DESCRIPTORS: dict = {}  # (rows, cols, block, layout, dtype) -> a checked descriptor, its tensor dropped


def _descriptor(t, rows: int, cols: int, block: list, layout):
    """A TMA descriptor over the contiguous t read as a [rows, cols] matrix (no reshaped view), in
    tiles of `block`. Its constructor's checks (alignment, strides, block, dtype: most of its 13 us
    on the host) run once per kind; later ones copy that checked descriptor's fields and hold t."""
    if t.data_ptr() % 16:  # (the constructor names what is wrong)
        return _GluonDescriptor(t, [rows, cols], [cols, 1], list(block), layout)
    proto = _remember(_DESCRIPTORS, (rows, cols, block[0], block[1], id(layout), t.dtype),
                      lambda: _checked_descriptor(t, rows, cols, block, layout))
    desc = object.__new__(_GluonDescriptor)
    desc.__dict__.update(proto.__dict__, base=t)
    return desc


def _checked_descriptor(t, rows, cols, block, layout):
    """A descriptor of that kind built by its constructor (which checks it), its tensor dropped."""
    desc = _GluonDescriptor(t, [rows, cols], [cols, 1], list(block), layout)
    desc.base = None
    return desc


def _hopper_descriptor(t, rows: int):
    """A TMA descriptor over the contiguous t's [B * H * L, D] view, in tiles of `rows` rows (a new
    one per call: it holds the tensor; its checks and shared-memory layout are reused)."""
    D = t.shape[-1]
    key = (rows, D, t.dtype)
    if key not in _SHARED_LAYOUTS:
        dtype = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
        _SHARED_LAYOUTS[key] = gl.NVMMASharedLayout.get_default_for([rows, D], dtype)
    return _descriptor(t, t.numel() // D, D, [rows, D], _SHARED_LAYOUTS[key])


_HOPPER_PLANS: dict = {}
# A new kind of call compiles the Hopper kernel (about 3 s on an H200's host) in a second thread
# while this one builds the block lists (the scan kernel's own compile and its launch, 0.3-0.6 s
# at 32K): the compile needs only what each argument specializes to, never the lists' contents.
# PORT_HOPPER_EARLY_COMPILE=0 (or False here) compiles at the launch instead, one after the other.
HOPPER_EARLY_COMPILE = os.environ.get("PORT_HOPPER_EARLY_COMPILE", "1") != "0"


def _hopper_launch(q, k, v, scale, return_lse, tables):
    """(grid, arguments, options, out, lse, site) of this call's Hopper kernel (_hopper_kernel);
    what calls of one kind share (grid, options, block lists, the integer arguments) is made once
    per `site` (_launch's key: shapes, dtype, device, the loop and tile switches, the tables'
    alignment)."""
    if HOPPER_LOOP not in HOPPER_LOOPS:
        raise ValueError(f"HOPPER_LOOP = {HOPPER_LOOP!r} names no form of the Hopper kernel's tile loop: set it to "
                         f"one of {', '.join(map(repr, HOPPER_LOOPS))}")
    pointers = [tables[n] for n in ALL_POINTERS]
    site = ("forward", q.shape, k.shape, q.dtype, q.device, _current_device(q), return_lse, HOPPER_LOOP,
            HOPPER_TILE, HOPPER_NAMED, HOPPER_Q_BUFFERS, HOPPER_UNDER_PV, HOPPER_UNDER_PV_CHOSEN, HOPPER_LANE_SUMS,
            HOPPER_TILE_INFO, HOPPER_FAST_STORE, tuple(t.data_ptr() % 16 == 0 for t in pointers))
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device) if return_lse else out
    plan = _remember(_HOPPER_PLANS, site, lambda: _hopper_plan(q, k, v, scale, out, lse, pointers))
    grid, options, block_n, persistent, lists = plan
    return grid, _hopper_args(q, k, v, out, lse, lists, scale, block_n, persistent, pointers), options, out, lse, site


_TILE_COUNTERS: dict = {}  # (device, stream) -> the persistent kernel's tile counter there


def _tile_counter(device):
    """The persistent kernel's tile counter for calls on this device's current stream: an int32
    zeroed once, which each call leaves at 0 when it ends (its last fetch puts it back), so a call
    starts from tile 0 with no zeroing launch of its own. One per stream: calls on one stream run
    one after another, calls on two streams may overlap."""
    if device.type != "cuda":  # (a compile without a GPU: tests/run_hopper_compile.py)
        return torch.zeros(1, dtype=torch.int32, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, triton.runtime.driver.active.get_current_stream(index))
    counter = _TILE_COUNTERS.get(key)
    if counter is None:
        # (made while its stream is current, so the allocator reuses its memory only after that
        # stream's work: dropping the least recently made one is safe)
        counter = _TILE_COUNTERS[key] = torch.zeros(1, dtype=torch.int32, device=device)
        while len(_TILE_COUNTERS) > 4 * _KEPT:
            _TILE_COUNTERS.pop(next(iter(_TILE_COUNTERS)))
    return counter


def _hopper_args(q, k, v, out, lse, lists, scale, block_n, persistent, pointers) -> tuple:
    """The Hopper kernel's arguments, in its order."""
    # (persistent: the tile counter of this stream, at 0, so a program takes tile 0 first)
    extra = (_tile_counter(q.device), q.shape[0] * q.shape[1]) if persistent else ()
    return (_hopper_descriptor(q, 128), _hopper_descriptor(k, block_n), _hopper_descriptor(v, block_n), out, lse,
            *lists, scale, *extra, *pointers)


def _hopper_plan(q, k, v, scale, out, lse, pointers):
    """(grid, options, block_n, persistent, the block lists and integer arguments) of a Hopper call;
    with HOPPER_EARLY_COMPILE, the kernel compiles in a second thread while the lists are built."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    loop = _hopper_loop(D)
    block_n, buffers, warps = HOPPER_TILE
    buffers = buffers or (3 if loop in ("pingpong", "persistent") else 2)
    n_rows, n_cols = _cdiv(Lq, TABLE_M), _cdiv(Lk, TABLE_N)
    s_tb, s_th = _list_strides(Hq, n_rows)
    persistent = loop == "persistent"
    if persistent and HOPPER_Q_BUFFERS == 2:  # (two buffers of queries and the ring in the shared memory of one)
        while buffers > 2 and (2 * 128 + 2 * buffers * block_n) * D * q.element_size() > 224 * 1024:
            buffers -= 1
    options = dict(HAS_SCORE=HAS_SCORE, RETURN_LSE=lse is not out, TABLE_M=TABLE_M, TABLE_N=TABLE_N, NUM_BUF=buffers,
                   num_warps=4 if loop in ("pingpong", "persistent") else warps)
    if not persistent:
        options["PINGPONG"] = loop == "pingpong"
    if loop in ("pingpong", "persistent") and HOPPER_NAMED:  # (named releases: a ring of at most 3 slots)
        options["NAMED"] = HOPPER_NAMED if buffers <= 3 else HOPPER_NAMED & 5
    if persistent and HOPPER_Q_BUFFERS == 2:
        options["Q_BUF"] = 2
    if HOPPER_UNDER_PV:
        options["UNDER_PV"] = HOPPER_UNDER_PV
    if HOPPER_LANE_SUMS:
        options["LANE"] = 1
    if persistent and HOPPER_TILE_INFO:
        options["INFO"] = 1
    if persistent and HOPPER_FAST_STORE:
        options["FAST_STORE"] = True
    if Lq % 128:  # (HOPPER_RAGGED) the last block of queries runs past Lq
        options["EVEN_M"] = False
    if Lk % TABLE_N:  # (HOPPER_RAGGED) the last tile of keys runs past Lk
        options["EVEN_N"] = False
    grid = (_cdiv(Lq, 128), B * Hq)
    if persistent:  # one program per SM, or per tile where there are fewer
        grid = (min(grid[0] * grid[1], _sm_count(q.device)), )
    ints = (s_tb, s_th, n_cols, Hq, Hq // Hkv, Lq, Lk)
    early, chosen = None, []
    if HOPPER_EARLY_COMPILE:
        # the lists' stand-ins: int32 tensors on 16 bytes, as the lists are, so the launch below
        # finds this compile (an argument's kind: _arg_kind)
        stand_in = [torch.empty(4, dtype=torch.int32, device=q.device) for _ in range(4)]
        args = _hopper_args(q, k, v, out, lse, (*stand_in, *ints), scale, block_n, persistent, pointers)
        early = _compile_early(_hopper_kernel(D), grid, args, options, q.device, chosen)
    try:
        lists = block_lists(B, Hq, Lq, Lk, q.device)
    finally:
        if early is not None:
            early.join()
    if chosen:
        options = chosen[0]
    elif early is None and q.device.type == "cuda":  # (no early compile: the spill check here)
        args = _hopper_args(q, k, v, out, lse, (*lists, *ints), scale, block_n, persistent, pointers)
        try:  # (a failure is the launch's to report)
            options = _under_pv_by_spills(_hopper_kernel(D), grid, args, options)
        except Exception:
            pass
    return grid, options, block_n, persistent, (*lists, *ints)


def _spill_bytes(compiled):
    """The bytes of local memory (ptxas's spills) of a compiled kernel, loaded on the current
    device for the count; None where this Triton does not say."""
    try:
        compiled._init_handles()
        return 4 * int(compiled.n_spills)  # (CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, in words)
    except Exception:
        return None


def _under_pv_by_spills(kernel, grid, args, options) -> dict:
    """options, or options with the wait for P V where ptxas puts it (UNDER_PV 0) where the default
    place after the row max (2) made this kernel spill and 0 spills less (HOPPER_UNDER_PV_CHOSEN).
    Compiles (Triton's warmup: nothing launches, the launch then finds the compiled kernel)."""
    if options.get("UNDER_PV") != 2 or HOPPER_UNDER_PV_CHOSEN:
        return options
    spilled = _spill_bytes(kernel.warmup(*args, grid=grid, **options))
    if not spilled:
        return options
    other = {name: value for name, value in options.items() if name != "UNDER_PV"}
    spilled_other = _spill_bytes(kernel.warmup(*args, grid=grid, **other))
    return other if spilled_other is not None and spilled_other < spilled else options


def _compile_early(kernel, grid, args, options, device, chosen=None):
    """A started thread that compiles kernel for these arguments' kinds (Triton's warmup: nothing
    launches), or None where that cannot help; `chosen` (a list) gets the options the launch should
    take (_under_pv_by_spills). A failure here is left to the launch, which meets it again and says
    why (_attention_hopper)."""
    import threading

    if device.type != "cuda":
        return None

    def compile_():
        try:
            with torch.cuda.device(device):  # (the JIT keeps a compiled kernel per device)
                picked = _under_pv_by_spills(kernel, grid, args, options)
                kernel.warmup(*args, grid=grid, **picked)
                if chosen is not None:
                    chosen.append(picked)
        except Exception:
            pass

    triton.runtime.driver.active.get_current_target()  # (the driver made here, not in two threads at once)
    thread = threading.Thread(target=compile_, name=f"{NAME}: Hopper compile", daemon=True)
    thread.start()
    return thread


def _hopper_kernel(head_dim: int = 128):
    """The Hopper kernel of this call's loop form (_hopper_loop)."""
    return _hopper_persistent_kernel if _hopper_loop(head_dim) == "persistent" else _hopper_specialized_kernel


def _hopper_loop(head_dim: int = 128) -> str:
    """The form of the tile loop a call at this head dim runs: HOPPER_LOOP, with "auto" resolved
    (persistent, except with a score_mod at D 128: ping-pong, see HOPPER_LOOP)."""
    if HOPPER_LOOP == "auto":
        return "pingpong" if HAS_SCORE and head_dim != 64 else "persistent"
    return HOPPER_LOOP


def _attention_hopper(q, k, v, scale, return_lse, tables):
    """attention()'s forward through the Hopper kernel (see _hopper_ready), or None when that
    kernel failed to compile or launch for this kind of call (then the caller runs the portable
    one): the first failure warns with its cause, later calls of the same kind skip the attempt."""
    grid, args, options, out, lse, site = _hopper_launch(q, k, v, scale, return_lse, tables)
    D = q.shape[-1]
    kind = (q.dtype, D, _hopper_loop(D))
    try:
        _launch(_hopper_kernel(D), grid, args, options, site)
    except Exception as exc:
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            raise
        _HOPPER_FAILED[kind] = f"{type(exc).__name__}: {str(exc)[:300]}"
        warnings.warn(f"{NAME}: the Hopper kernel ({_hopper_loop(D)} loop, {q.dtype}, D {D}) failed here "
                      f"({_HOPPER_FAILED[kind]}); these calls run the portable kernel instead. Set PORT_HOPPER=0 "
                      "to run it from the start, and please report the cause", RuntimeWarning, stacklevel=3)
        return None
    return (out, lse) if return_lse else out
