"""Test harness: score_mod_triton applied to a float32 [Lq, Lk] score matrix, appended to the translated mods by
`translate.triton.generate`. @@PTRS@@: the mod's table pointers (", t0_ptr, t1_ptr")."""

import triton
import triton.language as tl

@triton.jit
def score_grid_kernel(score_ptr, out_ptr, b, h, Lq, Lk@@PTRS@@, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr):
    # applies score_mod_triton to a float32 [Lq, Lk] score matrix of (b, h): a test harness
    q_idx = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)[:, None]
    kv_idx = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
    inside = (q_idx < Lq) & (kv_idx < Lk)
    score = tl.load(score_ptr + q_idx * Lk + kv_idx, mask=inside, other=0.0)
    out = score_mod_triton(score, b, h, tl.minimum(q_idx, Lq - 1), tl.minimum(kv_idx, Lk - 1)@@PTRS@@)
    tl.store(out_ptr + q_idx * Lk + kv_idx, out.to(tl.float32), mask=inside)
