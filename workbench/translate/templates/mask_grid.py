"""Test harness: the mask of (b, h) over a grid of pairs, as int8 [Lq, Lk], appended to the translated mods by
`translate.triton.generate`. @@PTRS@@: the mod's table pointers (", t0_ptr, t1_ptr")."""

import triton
import triton.language as tl

@triton.jit
def mask_grid_kernel(out_ptr, b, h, Lq, Lk@@PTRS@@, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr):
    # writes the mask of (b, h) as int8 [Lq, Lk]: a test harness and an example call
    q_idx = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)[:, None]
    kv_idx = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
    inside = (q_idx < Lq) & (kv_idx < Lk)
    # indices past the end are clamped so table reads stay in bounds; they are not stored
    keep = mask_mod_triton(b, h, tl.minimum(q_idx, Lq - 1), tl.minimum(kv_idx, Lk - 1)@@PTRS@@)
    tl.store(out_ptr + q_idx * Lk + kv_idx, keep.to(tl.int8), mask=inside)
