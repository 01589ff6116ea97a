"""Test harness: mask_mod_bounds of a list of boxes, appended to the translated mods by
`translate.triton.generate`. @@PTRS@@: the mod's table pointers (", t0_ptr, t1_ptr")."""

import triton
import triton.language as tl

@triton.jit
def bounds_grid_kernel(out_ptr, boxes_ptr, b, h@@PTRS@@):
    # mask_mod_bounds of box i = (q_lo, q_hi, kv_lo, kv_hi) as out[i] = (all, any): a test harness
    i = tl.program_id(0)
    q_lo = tl.load(boxes_ptr + 4 * i)
    q_hi = tl.load(boxes_ptr + 4 * i + 1)
    kv_lo = tl.load(boxes_ptr + 4 * i + 2)
    kv_hi = tl.load(boxes_ptr + 4 * i + 3)
    all_kept, any_kept = mask_mod_bounds(b, h, q_lo, q_hi, kv_lo, kv_hi@@PTRS@@)
    tl.store(out_ptr + 2 * i, all_kept)
    tl.store(out_ptr + 2 * i + 1, any_kept)
