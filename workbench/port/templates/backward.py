"""The port's backward, appended to forward.py by `port.generate`: dq, dk, dv of `attention` over
the forward's block structure, and the autograd Function that `attention` runs through when q, k
or v requires grad. Markers: @@ALL_PTR_PARAMS@@ / @@MASK_PTR_ARGS@@ / @@SCORE_PTR_ARGS@@ /
@@GRAD_PTR_ARGS@@ (the tables score_grad_triton reads), @@TGRAD_PTR_ARGS@@ (those
score_table_grad_triton reads), @@DTABLE_PTR_PARAMS@@ / @@DTABLE_PTR_ARGS@@ (the tables'
gradients), @@GRAD_TABLES@@, @@HAS_SCORE_GRAD@@, @@NO_SCORE_GRAD@@."""

import torch
import triton
import triton.language as tl

# ---------------------------------------------------------------- backward
# FlashAttention-2's backward. With the forward's lse per row, a pair's probability is
# p = exp(s - lse) (s the pair's score after the score_mod; p = 0 where the mask drops it), and
# for the upstream gradients dO (of out) and dlse (of lse, 0 unless the caller used it):
#     dv_j = sum_i p_ij dO_i                   dp_ij = dO_i . v_j
#     ds_ij = p_ij (dp_ij - delta_i)           delta_i = dO_i . O_i - dlse_i
#     dx_ij = ds_ij * score_grad(x_ij)         x = q . k * scale, the score_mod's input
#     dq_i = scale * sum_j dx_ij k_j           dk_j = scale * sum_i dx_ij q_i
# score_grad is d score_mod / d score, generated from the score_mod's traced graph
# (workbench.translate.derivative), never written per mod. Two kinds of program, with no atomics
# for dq, dk and dv (every call gives them the same bits): dq, one program per block of queries
# over the forward's block lists; dk and dv, one program per block of keys over the *column* lists
# (the same classes read down the columns) and every query head of its kv head's group, which
# sums GQA's heads in registers. One launch runs both (_bwd_kernel). A row that keeps nothing has
# lse = -inf; it is read as +inf, so its p is 0 and its gradients are exactly 0, never NaN.

HAS_SCORE_GRAD = @@HAS_SCORE_GRAD@@  # the score_mod's derivative was generated (or there is no score_mod)
NO_SCORE_GRAD = @@NO_SCORE_GRAD@@  # why not, when it was not
# the score_mod's tables that can learn (tables={name: a tensor that requires grad}): their
# gradient is added where the score_mod reads them (score_table_grad_triton; bit t of its LEARN
# turns table t's adds on). A float atomic add per kept pair and read: their order varies, so
# these gradients differ in the last bits run to run (dk and dv never do; dq only in the Hopper
# backward's fused form, hopper_backward.py), unless the call
# asks for deterministic=True: then they are integer adds in units of 2^-32 (rounded to nearest;
# the same sum in any order; tables' gradients up to 2^31 in size)
GRAD_TABLES = @@GRAD_TABLES@@
# (BLOCK_M, BLOCK_N, num_warps, num_stages) of the dq kernel and of the dk / dv kernel: [bf16 / fp16 at
# D <= 128, float32 or D > 128 (whose tiles need twice the registers)]. The dq kernel keeps BLOCK_M
# queries and walks keys; the dk / dv kernel keeps BLOCK_N keys and walks queries: each keeps the
# wider side. Both walk 128-key (128-query) blocks of the lists in sub-tiles of their other side.
# The first entries were chosen on an H200 by benchmarks/bench_backward_tiles.py (causal, 8K and 32K,
# bf16, D 128; dk / dv re-chosen for its keys-down tiles: 64 queries x 128 keys, 8 warps, 2 stages,
# 10% faster than 64 x 64 on causal at 8K; dq re-chosen in one launch with it (--pairs): 128 x 128,
# 2-3.5% faster than 128 x 64 on causal and a window; docs/benchmarks.md); the float32 / wide ones
# are the small tiles every head dim fits.
BWD_DQ_TILES = [(32, 32, 4, 1), (32, 32, 4, 1)] if _INTERPRET else [(128, 128, 8, 2), (32, 32, 4, 1)]
BWD_DKDV_TILES = [(32, 32, 4, 1), (32, 32, 4, 1)] if _INTERPRET else [(64, 128, 8, 2), (32, 32, 4, 1)]
# dq and dk / dv in one launch (_bwd_kernel) when their tiles share warps and stages; False: two
BWD_FUSED = True

@triton.jit
def _dot32(a, b, IEEE: tl.constexpr, WIDEN: tl.constexpr):
    # a [M, K] . b [K, N] accumulated in float32 (WIDEN: the interpreter's bf16 dots, see the
    # attention kernel)
    if WIDEN:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _bwd_tile(qk, dp, q_pos, kv_pos, lse2, delta, b, h, Lq, Lk, sm_scale, q_off, kv_off,
              @@ALL_PTR_PARAMS@@ @@DTABLE_PTR_PARAMS@@
              MASKED: tl.constexpr, HAS_SCORE: tl.constexpr, LEARN: tl.constexpr, DETERMINISTIC: tl.constexpr):
    # one tile of pairs, either way round: queries down and keys across (the dq kernel: qk = q . k^T
    # [M, N], q_pos [M, 1], kv_pos [1, N]) or keys down and queries across (the dk / dv kernel:
    # qk = k . q^T [N, M], q_pos [1, M], kv_pos [N, 1]), so that each kernel's p and ds come out of
    # its first dots already in the shape its last dots take them in (no transpose of a register
    # tile). dp = dO . v^T in qk's shape; lse2 = lse * log2(e) (+inf for rows that keep nothing) and
    # delta broadcast like q_pos. Returns p and dx = ds * score_grad * scale in qk's shape, both 0
    # outside the kept pairs (and outside the lengths: the clamped rows and keys). LEARN: also add
    # ds into the gradients of the learnable tables the score_mod reads
    q_idx = tl.minimum(q_pos, Lq - 1) + q_off
    kv_idx = tl.minimum(kv_pos, Lk - 1) + kv_off
    x = qk * sm_scale
    if HAS_SCORE:
        s = score_mod_triton(x, b, h, q_idx, kv_idx@@SCORE_PTR_ARGS@@) * 1.4426950408889634
    else:
        s = x * 1.4426950408889634
    keep = (q_pos < Lq) & (kv_pos < Lk)
    if MASKED:
        keep = keep & (mask_mod_triton(b, h, q_idx, kv_idx@@MASK_PTR_ARGS@@) != 0)
    p = tl.where(keep, tl.math.exp2(s - lse2), 0.0)
    ds = p * (dp - delta)
    if LEARN != 0:
        score_table_grad_triton(x, b, h, q_idx, kv_idx, ds@@TGRAD_PTR_ARGS@@@@DTABLE_PTR_ARGS@@, LEARN=LEARN,
                                DETERMINISTIC=DETERMINISTIC)
    if HAS_SCORE:
        # where p is 0 the pair adds nothing, whatever the derivative is there (a score_mod that
        # sends a pair to -inf may have an infinite or NaN derivative at it)
        ds = tl.where(p == 0.0, 0.0, ds * score_grad_triton(x, b, h, q_idx, kv_idx@@GRAD_PTR_ARGS@@))
    return p, ds * sm_scale


@triton.jit
def _bwd_dq_block(dq, q, do, lse2, delta, at, K_bh, V_bh, s_kn, s_kd, s_vn, s_vd, offs_m, offs_d, d_ok, b, h, Lq, Lk,
                  sm_scale, @@ALL_PTR_PARAMS@@ @@DTABLE_PTR_PARAMS@@
                  MASKED: tl.constexpr, HAS_SCORE: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr,
                  LEARN: tl.constexpr, DETERMINISTIC: tl.constexpr, TABLE_N: tl.constexpr, BLOCK_N: tl.constexpr):
    # dq of one listed block of 128 keys (its index at `at`), in tiles of BLOCK_N keys
    # (a sub-tile wholly past the last key reads the last key again and drops every pair: no branch
    # around the loads, so the loop stays one that Triton can pipeline)
    c = tl.load(at)
    for sub in tl.static_range(TABLE_N // BLOCK_N):
        offs_n = c * TABLE_N + sub * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.minimum(offs_n, Lk - 1)
        k = tl.load(K_bh + cols[:, None] * s_kn + offs_d[None, :] * s_kd, mask=d_ok[None, :], other=0.0)
        v = tl.load(V_bh + cols[:, None] * s_vn + offs_d[None, :] * s_vd, mask=d_ok[None, :], other=0.0)
        qk = _dot32(q, tl.trans(k), IEEE=IEEE, WIDEN=WIDEN)  # [M, N]
        dp = _dot32(do, tl.trans(v), IEEE=IEEE, WIDEN=WIDEN)
        p, dx = _bwd_tile(qk, dp, offs_m[:, None], offs_n[None, :], lse2[:, None], delta[:, None], b, h, Lq, Lk,
                          sm_scale, 0, 0@@ALL_PTR_ARGS@@@@DTABLE_PTR_ARGS@@, MASKED=MASKED, HAS_SCORE=HAS_SCORE,
                          LEARN=LEARN, DETERMINISTIC=DETERMINISTIC)
        dq += _dot32(dx if IEEE else dx.to(k.dtype), k, IEEE=IEEE, WIDEN=WIDEN)
    return dq


@triton.jit
def _bwd_dkdv_block(dk, dv, k, v, at, Q_bh, DO_bh, Lse2, Delta, bh, s_qm, s_qd, s_om, s_od, offs_n, offs_d, d_ok, b,
                    h, Lq, Lk, sm_scale, @@ALL_PTR_PARAMS@@ @@DTABLE_PTR_PARAMS@@
                    MASKED: tl.constexpr, HAS_SCORE: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr,
                    TABLE_M: tl.constexpr, BLOCK_M: tl.constexpr):
    # dk and dv of one listed block of 128 queries (its index at `at`), in tiles of BLOCK_M queries
    # (a sub-tile wholly past the last query reads the last row again and drops every pair: no
    # branch around the loads, so the loop stays one that Triton can pipeline)
    r = tl.load(at)
    for sub in tl.static_range(TABLE_M // BLOCK_M):
        offs_m = r * TABLE_M + sub * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = tl.minimum(offs_m, Lq - 1)
        q = tl.load(Q_bh + rows[:, None] * s_qm + offs_d[None, :] * s_qd, mask=d_ok[None, :], other=0.0)
        do = tl.load(DO_bh + rows[:, None] * s_om + offs_d[None, :] * s_od, mask=d_ok[None, :], other=0.0)
        lse2 = tl.load(Lse2 + bh.to(tl.int64) * Lq + rows)
        delta = tl.load(Delta + bh.to(tl.int64) * Lq + rows)
        # keys down, queries across: pT and dxT come out of these dots as the next dots take them
        qkT = _dot32(k, tl.trans(q), IEEE=IEEE, WIDEN=WIDEN)  # [N, M]
        dpT = _dot32(v, tl.trans(do), IEEE=IEEE, WIDEN=WIDEN)
        pT, dxT = _bwd_tile(qkT, dpT, offs_m[None, :], offs_n[:, None], lse2[None, :], delta[None, :], b, h, Lq, Lk,
                            sm_scale, 0, 0@@ALL_PTR_ARGS@@@@DTABLE_PTR_ARGS@@, MASKED=MASKED, HAS_SCORE=HAS_SCORE,
                            LEARN=0, DETERMINISTIC=False)
        dv += _dot32(pT if IEEE else pT.to(do.dtype), do, IEEE=IEEE, WIDEN=WIDEN)
        dk += _dot32(dxT if IEEE else dxT.to(q.dtype), q, IEEE=IEEE, WIDEN=WIDEN)
    return dk, dv


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, Lse2, Delta, DQ, partial_num, partial_idx, full_num, full_idx,
                   s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
                   s_ob, s_oh, s_om, s_od, s_tb, s_th, n_cols, Hq, group, Lq, Lk, D, sm_scale,
                   @@ALL_PTR_PARAMS@@ @@DTABLE_PTR_PARAMS@@
                   LEARN: tl.constexpr, DETERMINISTIC: tl.constexpr, D_PAD: tl.constexpr, HAS_SCORE: tl.constexpr,
                   IEEE: tl.constexpr, WIDEN: tl.constexpr, INTERPRET: tl.constexpr, TABLE_M: tl.constexpr,
                   TABLE_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    _bwd_dq_program(tl.program_id(0), tl.program_id(1), Q, K, V, DO, Lse2, Delta, DQ, partial_num, partial_idx,
                    full_num, full_idx, s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
                    s_ob, s_oh, s_om, s_od, s_tb, s_th, n_cols, Hq, group, Lq, Lk, D,
                    sm_scale@@ALL_PTR_ARGS@@@@DTABLE_PTR_ARGS@@, LEARN=LEARN, DETERMINISTIC=DETERMINISTIC, D_PAD=D_PAD,
                    HAS_SCORE=HAS_SCORE, IEEE=IEEE, WIDEN=WIDEN, INTERPRET=INTERPRET, TABLE_M=TABLE_M,
                    TABLE_N=TABLE_N, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)


@triton.jit
def _bwd_dq_program(pid_m, bh, Q, K, V, DO, Lse2, Delta, DQ, partial_num, partial_idx, full_num, full_idx,
                    s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
                    s_ob, s_oh, s_om, s_od, s_tb, s_th, n_cols, Hq, group, Lq, Lk, D, sm_scale,
                    @@ALL_PTR_PARAMS@@ @@DTABLE_PTR_PARAMS@@
                    LEARN: tl.constexpr, DETERMINISTIC: tl.constexpr, D_PAD: tl.constexpr, HAS_SCORE: tl.constexpr,
                    IEEE: tl.constexpr, WIDEN: tl.constexpr, INTERPRET: tl.constexpr, TABLE_M: tl.constexpr,
                    TABLE_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # one program = BLOCK_M queries (block pid_m) of one (batch, query head) bh: dq over the kv
    # blocks the forward visited (its full and partial lists; the mask is evaluated in partial
    # blocks only)
    b = bh // Hq
    h = bh % Hq
    kv_h = h // group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.minimum(offs_m, Lq - 1)  # rows past the end repeat the last one and are not stored
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    q = tl.load(Q + b.to(tl.int64) * s_qb + h * s_qh + rows[:, None] * s_qm + offs_d[None, :] * s_qd,
                mask=d_ok[None, :], other=0.0)
    do = tl.load(DO + b.to(tl.int64) * s_ob + h * s_oh + rows[:, None] * s_om + offs_d[None, :] * s_od,
                 mask=d_ok[None, :], other=0.0)
    lse2 = tl.load(Lse2 + bh.to(tl.int64) * Lq + rows)
    delta = tl.load(Delta + bh.to(tl.int64) * Lq + rows)
    K_bh = K + b.to(tl.int64) * s_kb + kv_h * s_kh
    V_bh = V + b.to(tl.int64) * s_vb + kv_h * s_vh
    dq = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    row = b * s_tb + h * s_th + (pid_m * BLOCK_M) // TABLE_M
    for visit in tl.static_range(2):  # visit 0: the FULL blocks, visit 1: the PARTIAL ones
        masked = visit == 1
        num = full_num if not masked else partial_num
        idx = full_idx if not masked else partial_idx
        n_blocks = tl.load(num + row)
        if INTERPRET:  # Triton's CPU interpreter cannot run `range` to a runtime bound
            j = 0
            while j < n_blocks:
                dq = _bwd_dq_block(dq, q, do, lse2, delta, idx + row * n_cols + j, K_bh, V_bh, s_kn, s_kd, s_vn, s_vd,
                                   offs_m, offs_d, d_ok, b, h, Lq, Lk, sm_scale@@ALL_PTR_ARGS@@@@DTABLE_PTR_ARGS@@,
                                   MASKED=masked, HAS_SCORE=HAS_SCORE, IEEE=IEEE, WIDEN=WIDEN, LEARN=LEARN,
                                   DETERMINISTIC=DETERMINISTIC, TABLE_N=TABLE_N, BLOCK_N=BLOCK_N)
                j += 1
        else:  # a `for` loop: Triton pipelines its loads (num_stages)
            for j in range(0, n_blocks):
                dq = _bwd_dq_block(dq, q, do, lse2, delta, idx + row * n_cols + j, K_bh, V_bh, s_kn, s_kd, s_vn, s_vd,
                                   offs_m, offs_d, d_ok, b, h, Lq, Lk, sm_scale@@ALL_PTR_ARGS@@@@DTABLE_PTR_ARGS@@,
                                   MASKED=masked, HAS_SCORE=HAS_SCORE, IEEE=IEEE, WIDEN=WIDEN, LEARN=LEARN,
                                   DETERMINISTIC=DETERMINISTIC, TABLE_N=TABLE_N, BLOCK_N=BLOCK_N)
    tl.store(DQ + bh.to(tl.int64) * Lq * D + offs_m[:, None] * D + offs_d[None, :], dq.to(DQ.dtype.element_ty),
             mask=(offs_m < Lq)[:, None] & d_ok[None, :])


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, Lse2, Delta, DK, DV, partial_num, partial_idx, full_num, full_idx,
                     s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
                     s_ob, s_oh, s_om, s_od, s_tb, s_th, n_rows, Hq, Hkv, group, Lq, Lk, D, sm_scale,
                     @@ALL_PTR_PARAMS@@ @@DTABLE_PTR_PARAMS@@
                     D_PAD: tl.constexpr, HAS_SCORE: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr,
                     INTERPRET: tl.constexpr, TABLE_M: tl.constexpr, TABLE_N: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    _bwd_dkdv_program(tl.program_id(0), tl.program_id(1), Q, K, V, DO, Lse2, Delta, DK, DV, partial_num, partial_idx,
                      full_num, full_idx, s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
                      s_ob, s_oh, s_om, s_od, s_tb, s_th, n_rows, Hq, Hkv, group, Lq, Lk, D,
                      sm_scale@@ALL_PTR_ARGS@@@@DTABLE_PTR_ARGS@@, D_PAD=D_PAD, HAS_SCORE=HAS_SCORE, IEEE=IEEE,
                      WIDEN=WIDEN, INTERPRET=INTERPRET, TABLE_M=TABLE_M, TABLE_N=TABLE_N, BLOCK_M=BLOCK_M,
                      BLOCK_N=BLOCK_N)


@triton.jit
def _bwd_dkdv_program(pid_n, bkh, Q, K, V, DO, Lse2, Delta, DK, DV, partial_num, partial_idx, full_num, full_idx,
                      s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
                      s_ob, s_oh, s_om, s_od, s_tb, s_th, n_rows, Hq, Hkv, group, Lq, Lk, D, sm_scale,
                      @@ALL_PTR_PARAMS@@ @@DTABLE_PTR_PARAMS@@
                      D_PAD: tl.constexpr, HAS_SCORE: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr,
                      INTERPRET: tl.constexpr, TABLE_M: tl.constexpr, TABLE_N: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    # one program = BLOCK_N keys (block pid_n) of one (batch, kv head) bkh: dk and dv summed over
    # the query heads of its group (in order) and over the query blocks of the column lists
    b = bkh // Hkv
    kv_h = bkh % Hkv
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.minimum(offs_n, Lk - 1)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    k = tl.load(K + b.to(tl.int64) * s_kb + kv_h * s_kh + cols[:, None] * s_kn + offs_d[None, :] * s_kd,
                mask=d_ok[None, :], other=0.0)
    v = tl.load(V + b.to(tl.int64) * s_vb + kv_h * s_vh + cols[:, None] * s_vn + offs_d[None, :] * s_vd,
                mask=d_ok[None, :], other=0.0)
    dk = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    dv = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    col = (pid_n * BLOCK_N) // TABLE_N
    g = 0
    while g < group:
        h = kv_h * group + g
        bh = b * Hq + h
        Q_bh = Q + b.to(tl.int64) * s_qb + h * s_qh
        DO_bh = DO + b.to(tl.int64) * s_ob + h * s_oh
        line = b * s_tb + h * s_th + col  # this column's line of the column lists
        for visit in tl.static_range(2):
            masked = visit == 1
            num = full_num if not masked else partial_num
            idx = full_idx if not masked else partial_idx
            n_blocks = tl.load(num + line)
            if INTERPRET:  # Triton's CPU interpreter cannot run `range` to a runtime bound
                j = 0
                while j < n_blocks:
                    dk, dv = _bwd_dkdv_block(dk, dv, k, v, idx + line * n_rows + j, Q_bh, DO_bh, Lse2, Delta, bh, s_qm,
                                             s_qd, s_om, s_od, offs_n, offs_d, d_ok, b, h, Lq, Lk,
                                             sm_scale@@ALL_PTR_ARGS@@@@DTABLE_PTR_ARGS@@, MASKED=masked,
                                             HAS_SCORE=HAS_SCORE, IEEE=IEEE, WIDEN=WIDEN, TABLE_M=TABLE_M,
                                             BLOCK_M=BLOCK_M)
                    j += 1
            else:  # a `for` loop: Triton pipelines its loads (num_stages)
                for j in range(0, n_blocks):
                    dk, dv = _bwd_dkdv_block(dk, dv, k, v, idx + line * n_rows + j, Q_bh, DO_bh, Lse2, Delta, bh, s_qm,
                                             s_qd, s_om, s_od, offs_n, offs_d, d_ok, b, h, Lq, Lk,
                                             sm_scale@@ALL_PTR_ARGS@@@@DTABLE_PTR_ARGS@@, MASKED=masked,
                                             HAS_SCORE=HAS_SCORE, IEEE=IEEE, WIDEN=WIDEN, TABLE_M=TABLE_M,
                                             BLOCK_M=BLOCK_M)
        g += 1
    out = bkh.to(tl.int64) * Lk * D + offs_n[:, None] * D + offs_d[None, :]
    ok = (offs_n < Lk)[:, None] & d_ok[None, :]
    tl.store(DK + out, dk.to(DK.dtype.element_ty), mask=ok)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=ok)


@triton.jit
def _bwd_kernel(Q, K, V, DO, Lse2, Delta, DQ, DK, DV, r_partial_num, r_partial_idx, r_full_num, r_full_idx,
                c_partial_num, c_partial_idx, c_full_num, c_full_idx,
                s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
                s_ob, s_oh, s_om, s_od, s_tb, s_th, c_tb, c_th, n_rows, n_cols, Hq, Hkv, group, Lq, Lk, D, sm_scale,
                kv_programs, kv_blocks, q_blocks, @@ALL_PTR_PARAMS@@ @@DTABLE_PTR_PARAMS@@
                LEARN: tl.constexpr, DETERMINISTIC: tl.constexpr, D_PAD: tl.constexpr, HAS_SCORE: tl.constexpr,
                IEEE: tl.constexpr, WIDEN: tl.constexpr, INTERPRET: tl.constexpr, TABLE_M: tl.constexpr,
                TABLE_N: tl.constexpr, DQ_M: tl.constexpr, DQ_N: tl.constexpr, KV_M: tl.constexpr,
                KV_N: tl.constexpr):
    # both kernels in one launch (when their tiles share warps and stages): the first kv_programs
    # (= kv_blocks * B * Hkv) programs are the dk / dv kernel's, the rest the dq kernel's. The
    # dk / dv programs, the longer ones, start first and the dq programs fill the GPU behind them,
    # so neither kernel's last wave runs alone, and a training step has one launch less. Each
    # program computes exactly what it computes in its own kernel: the same bits
    pid = tl.program_id(0)
    if pid < kv_programs:
        _bwd_dkdv_program(pid % kv_blocks, pid // kv_blocks, Q, K, V, DO, Lse2, Delta, DK, DV, c_partial_num,
                          c_partial_idx, c_full_num, c_full_idx, s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd,
                          s_vb, s_vh, s_vn, s_vd, s_ob, s_oh, s_om, s_od, c_tb, c_th, n_rows, Hq, Hkv, group, Lq, Lk,
                          D, sm_scale@@ALL_PTR_ARGS@@@@DTABLE_PTR_ARGS@@, D_PAD=D_PAD, HAS_SCORE=HAS_SCORE, IEEE=IEEE,
                          WIDEN=WIDEN, INTERPRET=INTERPRET, TABLE_M=TABLE_M, TABLE_N=TABLE_N, BLOCK_M=KV_M,
                          BLOCK_N=KV_N)
    else:
        p = pid - kv_programs
        _bwd_dq_program(p % q_blocks, p // q_blocks, Q, K, V, DO, Lse2, Delta, DQ, r_partial_num, r_partial_idx,
                        r_full_num, r_full_idx, s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn,
                        s_vd, s_ob, s_oh, s_om, s_od, s_tb, s_th, n_cols, Hq, group, Lq, Lk, D,
                        sm_scale@@ALL_PTR_ARGS@@@@DTABLE_PTR_ARGS@@, LEARN=LEARN, DETERMINISTIC=DETERMINISTIC,
                        D_PAD=D_PAD, HAS_SCORE=HAS_SCORE, IEEE=IEEE, WIDEN=WIDEN, INTERPRET=INTERPRET,
                        TABLE_M=TABLE_M, TABLE_N=TABLE_N, BLOCK_M=DQ_M, BLOCK_N=DQ_N)


_column_lists: dict = {}


def column_lists(batch: int, heads: int, q_len: int, kv_len: int, device, lengths: tuple | None = None) -> tuple:
    """block_lists read down the columns: (partial_num, partial_idx, full_num, full_idx), each
    [B', H', cols, rows] int32: per column of 128 keys, how many blocks of 128 queries of each kind
    hold its kept pairs and which, ascending (what the dk / dv kernel visits)."""
    b_tab = batch if MASK_READS_BATCH else 1
    h_tab = heads if MASK_READS_HEAD else 1
    lengths = (q_len, kv_len) if lengths is None else tuple(lengths)
    key = (b_tab, h_tab, q_len, kv_len, str(device), lengths if LENGTH_RULES else None)
    return _remember(_column_lists, key, lambda: _lists_of(_block_classes(b_tab, h_tab, q_len, kv_len, device, 0, 0,
                                                                           lengths).transpose(-1, -2)))


@triton.jit
def _bwd_prep_kernel(O, DO, Lse, Dlse, Delta, Lse2, Zero, s_ob, s_oh, s_om, s_od, s_db, s_dh, s_dm, s_dd,
                     s_lb, s_lh, s_lm, Hq, Lq, D, HAS_DLSE: tl.constexpr, BLOCK_M: tl.constexpr,
                     D_PAD: tl.constexpr, ZERO: tl.constexpr = False):
    # what both backward kernels read per query row, in one pass over out and dO: delta =
    # dO . O - dlse (float32; a dlse that is +-inf or NaN counts as 0) and lse2 = lse * log2(e),
    # +inf where lse = -inf (a row that keeps nothing: every p is then exp2(s - inf) = 0).
    # ZERO: also zero Zero, [B * Hq * Lq * D + 4] float32 (the keys-down Hopper backward's flat
    # dq sum and its item counter), D words a row, so that needs no memset launch of its own
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    ok = rows < Lq
    both = ok[:, None] & (offs_d[None, :] < D)
    rows64 = rows.to(tl.int64)
    o = tl.load(O + b.to(tl.int64) * s_ob + h.to(tl.int64) * s_oh + rows64[:, None] * s_om + offs_d[None, :] * s_od,
                mask=both, other=0.0).to(tl.float32)
    do = tl.load(DO + b.to(tl.int64) * s_db + h.to(tl.int64) * s_dh + rows64[:, None] * s_dm + offs_d[None, :] * s_dd,
                 mask=both, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    if HAS_DLSE:
        dl = tl.load(Dlse + bh.to(tl.int64) * Lq + rows, mask=ok, other=0.0).to(tl.float32)
        delta = delta - tl.where((dl == dl) & (tl.abs(dl) != float("inf")), dl, 0.0)
    lse = tl.load(Lse + b.to(tl.int64) * s_lb + h.to(tl.int64) * s_lh + rows64 * s_lm, mask=ok, other=0.0)
    tl.store(Delta + bh.to(tl.int64) * Lq + rows, delta, mask=ok)
    tl.store(Lse2 + bh.to(tl.int64) * Lq + rows, tl.where(lse == float("-inf"), float("inf"),
                                                          lse * 1.4426950408889634), mask=ok)
    if ZERO:
        flat = (bh.to(tl.int64) * Lq + rows64[:, None]) * D + offs_d[None, :]
        tl.store(Zero + flat, tl.zeros([BLOCK_M, D_PAD], tl.float32), mask=both)
        if tl.program_id(0) + bh == 0:  # (the 4 words after the sum)
            tl.store(Zero + tl.num_programs(1).to(tl.int64) * Lq * D + tl.arange(0, 4), tl.zeros([4], tl.float32))


def _backward_tiles(dtype, D_PAD):
    """(dq tile, dk / dv tile) for this dtype and padded head dim."""
    wide = dtype == torch.float32 or D_PAD > 128
    return BWD_DQ_TILES[int(wide)], BWD_DKDV_TILES[int(wide)]


_bwd_tile_for: dict = {}  # (kernel, tile asked for, device, dtype, D_PAD, learning tables, deterministic) -> tile


def _launch_backward(kernel, grid_of, args, kwargs, tile, key):
    """kernel[grid_of(tile)](*args, **kwargs, tile) with `tile` (BLOCK_M, BLOCK_N, warps, stages),
    or, where the chip has no room for it (shared memory: a score_mod's tables and their gradients
    add to the tile's), with fewer stages, then the small tile every head dim fits. Stages only move
    loads earlier, and the tile only changes which sums the registers hold: the gradients are the
    reference's either way. The tile that fits is kept per key."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"

    def launch(t):
        m, n, w, stages = t
        kernel[grid_of(t)](*args, **kwargs, BLOCK_M=m, BLOCK_N=n, num_warps=w,
                           **({} if interpret else {"num_stages": stages}))

    if interpret:
        return launch(tile)
    m, n, w, stages = tile
    small = BWD_DQ_TILES[1] if kernel is _bwd_dq_kernel else BWD_DKDV_TILES[1]
    candidates = [(m, n, w, depth) for depth in range(stages, 0, -1)] + [small]
    if _first_that_fits(candidates, launch, _bwd_tile_for, key) is None:
        raise RuntimeError(f"{NAME}: no backward tile of {candidates} (BLOCK_M, BLOCK_N, warps, stages) fits "
                           f"{key[2]} for head dim {key[4]} in {key[3]} (shared memory / registers): put a smaller "
                           "tile in this file's BWD_DQ_TILES / BWD_DKDV_TILES")


def _attention_backward(q, k, v, out, lse, dout, dlse, scale, tables=None, learn=(), deterministic=False):
    """(dq, dk, dv, {name: gradient}) of attention(q, k, v) for the upstream gradients dout
    [B, Hq, Lq, D] and dlse [B, Hq, Lq] (or None), from the forward's out and lse; `tables`: the
    call's replaced tables, `learn`: the names of GRAD_TABLES whose gradient is wanted. Two
    launches (the prep, then dq and dk / dv together; three where they cannot share one); atomics
    only for the tables' gradients (integer ones with `deterministic`)."""
    if not HAS_SCORE_GRAD:
        raise RuntimeError(f"{NAME}: the score_mod's derivative could not be generated ({NO_SCORE_GRAD}), so this "
                           "file has no backward; call attention() under torch.no_grad(), or train with "
                           "FlexAttention")
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    captured = {**_tables(q.device, Lq, Lk), **(tables or {})}
    dout = dout if dout is not None else torch.zeros_like(out)
    D_PAD = max(16, _next_pow2(D))
    # delta and lse2 per row, in one launch (see _bwd_prep_kernel)
    delta = torch.empty(B, Hq, Lq, dtype=torch.float32, device=q.device)
    lse2 = torch.empty(B, Hq, Lq, dtype=torch.float32, device=q.device)
    dlse_rows = dlse.contiguous() if dlse is not None else delta
    prep_m = 16 if D_PAD > 128 else 32
    hopper = _hopper_bwd_ready(q, k, v, learn, deterministic)  # (hopper_backward.py's: sm_90, bf16 / fp16, ...)
    # (the Hopper backward's keys-down form sums dq flat in a float32 buffer the prep zeroes)
    zeroed = _hopper_bwd_zeroed(q, deterministic) if hopper else None
    prep_strides = (*out.stride(), *dout.stride(), *lse.stride())
    _launch(_bwd_prep_kernel, (_cdiv(Lq, prep_m), B * Hq),
            (out, dout, lse, dlse_rows, delta, lse2, delta if zeroed is None else zeroed, *prep_strides, Hq, Lq, D),
            dict(HAS_DLSE=dlse is not None, BLOCK_M=prep_m, D_PAD=D_PAD, ZERO=zeroed is not None, num_warps=4),
            ("prep", q.shape, prep_strides, out.dtype, dout.dtype, q.device, _current_device(q), dlse is not None,
             zeroed is not None, *[t.data_ptr() % 16 == 0 for t in (out, dout, lse, dlse_rows)]))
    if hopper:
        done = _hopper_bwd_launch(q, k, v, dout, lse2, delta, scale, captured, deterministic, zeroed)
        if done is not None:
            return (*done, {})
    dq_tile, dkdv_tile = _backward_tiles(q.dtype, D_PAD)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    flags = dict(D_PAD=D_PAD, HAS_SCORE=HAS_SCORE, IEEE=q.dtype == torch.float32,
                 WIDEN=interpret and q.dtype == torch.bfloat16, INTERPRET=interpret, TABLE_M=TABLE_M, TABLE_N=TABLE_N)
    pointers = [captured[name] for name in ALL_POINTERS]
    # the tables' gradients in float32 (a 1-element stand-in for tables that do not learn now)
    d_tables = [torch.zeros(captured[name].shape if name in learn else (1,),
                            dtype=torch.int64 if deterministic else torch.float32, device=q.device)
                for name in GRAD_TABLES]
    bits = sum(1 << i for i, name in enumerate(GRAD_TABLES) if name in learn)
    strides = (*q.stride(), *k.stride(), *v.stride(), *dout.stride())
    dq = torch.empty(B, Hq, Lq, D, dtype=q.dtype, device=q.device)
    dk = torch.empty(B, Hkv, Lk, D, dtype=k.dtype, device=q.device)
    dv = torch.empty(B, Hkv, Lk, D, dtype=v.dtype, device=q.device)
    rows_lists = block_lists(B, Hq, Lq, Lk, q.device)
    n_rows, n_cols = _cdiv(Lq, TABLE_M), _cdiv(Lk, TABLE_N)
    s_tb, s_th = _list_strides(Hq, n_rows)
    key = (str(q.device), q.dtype, D_PAD, bits, bool(deterministic))
    col_lists = column_lists(B, Hq, Lq, Lk, q.device)
    c_tb, c_th = _list_strides(Hq, n_cols)
    if BWD_FUSED and dq_tile[2:] == dkdv_tile[2:]:  # one launch for both, where a depth fits (see _bwd_kernel)
        kv_blocks, q_blocks = _cdiv(Lk, dkdv_tile[1]), _cdiv(Lq, dq_tile[0])
        args = (q, k, v, dout, lse2, delta, dq, dk, dv, *rows_lists, *col_lists, *strides, s_tb, s_th, c_tb, c_th,
                n_rows, n_cols, Hq, Hkv, Hq // Hkv, Lq, Lk, D, scale, kv_blocks * B * Hkv, kv_blocks, q_blocks,
                *pointers, *d_tables)
        grid = (kv_blocks * B * Hkv + q_blocks * B * Hq,)

        # (_launch's site: what decides the grid, the options and every argument's kind)
        site = ("portable backward", q.shape, k.shape, q.dtype, q.device, _current_device(q), strides, bits,
                bool(deterministic), dq_tile, dkdv_tile,
                tuple(t.data_ptr() % 16 == 0 for t in (q, k, v, dout, *pointers)))

        def fused(stages):
            _launch(_bwd_kernel, grid, args,
                    dict(LEARN=bits, DETERMINISTIC=bool(deterministic), **flags, DQ_M=dq_tile[0], DQ_N=dq_tile[1],
                         KV_M=dkdv_tile[0], KV_N=dkdv_tile[1], num_warps=dq_tile[2],
                         **({} if interpret else {"num_stages": stages})), site + (stages, ))

        depths = [dq_tile[3]] if interpret else list(range(min(dq_tile[3], dkdv_tile[3]), 0, -1))
        if _first_that_fits(depths, fused, _bwd_tile_for, ("fused", dq_tile, dkdv_tile, *key)) is not None:
            return _backward_result(dq, dk, dv, d_tables, captured, learn, deterministic)
    _launch_backward(_bwd_dq_kernel, lambda t: (_cdiv(Lq, t[0]), B * Hq),
                     (q, k, v, dout, lse2, delta, dq, *rows_lists, *strides, s_tb, s_th, n_cols, Hq, Hq // Hkv, Lq, Lk,
                      D, scale, *pointers, *d_tables),
                     dict(LEARN=bits, DETERMINISTIC=bool(deterministic), **flags), dq_tile, ("dq", dq_tile, *key))
    _launch_backward(_bwd_dkdv_kernel, lambda t: (_cdiv(Lk, t[1]), B * Hkv),
                     (q, k, v, dout, lse2, delta, dk, dv, *col_lists, *strides, c_tb, c_th, n_rows, Hq, Hkv, Hq // Hkv,
                      Lq, Lk, D, scale, *pointers, *d_tables), flags, dkdv_tile, ("dkdv", dkdv_tile, *key))
    return _backward_result(dq, dk, dv, d_tables, captured, learn, deterministic)


def _backward_result(dq, dk, dv, d_tables, captured, learn, deterministic):
    """(dq, dk, dv, {name: the learning table's gradient, in its dtype})."""
    if deterministic:
        d_tables = [d.double() / 4294967296.0 for d in d_tables]
    grads = {name: d.to(captured[name].dtype) for name, d in zip(GRAD_TABLES, d_tables) if name in learn}
    return dq, dk, dv, grads


def _call_tables(tables, device) -> dict:
    """attention()'s `tables=`, checked: {name: tensor} replacing the file's captured tensors that
    only the score_mod reads (the mask's tables decide the block lists, scanned once per size)."""
    if not tables:
        return {}
    if not isinstance(tables, dict):
        raise TypeError(f"tables must be a dict {{name: tensor}}; got {type(tables).__name__}")
    captured = _tables(device, 1, 1)
    replaceable = [n for n in ALL_POINTERS if n not in MASK_POINTERS and n in captured and n not in LENGTH_RULES]
    out = {}
    for name, t in tables.items():
        if name in MASK_POINTERS:
            raise ValueError(f"tables: {name!r} is read by the mask_mod, whose block lists are scanned once per size "
                             "from the file's tables; generate the port again with the new table (or pass it to "
                             "attention_paged, which scans no lists)")
        if name not in replaceable:
            raise ValueError(f"tables: {NAME}'s score_mod reads no tensor named {name!r}; it reads "
                             f"{replaceable or 'none'}")
        if not isinstance(t, torch.Tensor) or t.shape != captured[name].shape or t.dtype != captured[name].dtype:
            raise ValueError(f"tables[{name!r}] must be a {captured[name].dtype} tensor of shape "
                             f"{tuple(captured[name].shape)}; got {getattr(t, 'dtype', type(t).__name__)} "
                             f"{tuple(getattr(t, 'shape', ()))}")
        if t.device != torch.device(device) and not (t.device.type == torch.device(device).type == "cuda"):
            raise ValueError(f"tables[{name!r}] is on {t.device}; q is on {device}")
        if t.requires_grad and name not in GRAD_TABLES:
            raise ValueError(f"tables[{name!r}] requires grad, but this file has no gradient for it (the score_mod "
                             f"uses it other than entry by entry, or it is a 0-d number that did not require grad "
                             f"when the port was generated); tables with a gradient here: {GRAD_TABLES or 'none'}")
        out[name] = t
    return out


class _Attention(torch.autograd.Function):
    """attention() with a backward: the forward saves q, k, v, out, lse and the call's tables. A
    packed forward (cu_seqlens: each segment tiled from its start) has the plain backward: the
    gradients need only out and lse, and the mask keeps no pair across segments, so the whole
    sequence's block lists skip the same pairs."""

    @staticmethod
    def forward(ctx, q, k, v, scale, invariant, deterministic, bounds, names, *values):
        tables = {n: t.detach().contiguous() for n, t in zip(names, values)}
        out, lse = _attention(q, k, v, scale, True, bounds, invariant, tables=tables)
        ctx.save_for_backward(q, k, v, out, lse, *values)
        ctx.scale, ctx.names, ctx.deterministic = scale, names, deterministic
        # an output the caller did not use (lse, most often) comes to backward as None, not as a
        # tensor of zeros made and read every step
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *values = ctx.saved_tensors
        learn = [n for i, n in enumerate(ctx.names) if ctx.needs_input_grad[8 + i]]
        tables = {n: t.detach().contiguous() for n, t in zip(ctx.names, values)}
        dq, dk, dv, grads = _attention_backward(q, k, v, out, lse, dout, dlse, ctx.scale, tables, learn,
                                                ctx.deterministic)
        return (dq, dk, dv, None, None, None, None, None, *[grads.get(n) for n in ctx.names])
