"""Translators: a traced mod (its aten graph) written in another kernel language.

    emitter.py        what every translator shares: the walk over the aten graph, fresh names, the
                      environment, captured tensors as pointer views, one hook per node kind
    triton_mask.py    Triton pair by pair: `mask_mod_triton`, `score_mod_triton` (a method per aten-op family)
    triton_bounds.py  Triton interval bounds of a mask over a block of pairs: `mask_mod_bounds`
    fast_mask.py      the mask's copy for the port's Hopper kernels: window checks as one unsigned compare
    triton.py         the assembly (mods + helpers + harness kernels), the spec's `triton` section

Generated text is data (it goes into specs and generated files); the port and the block-scan
kernel compile it.
"""

from workbench.translate.triton import (HELPERS, MAX_UNROLLED, Untranslatable, generate, load_source, mod_functions,
                                        range_pointers, run_bounds, run_grid, table_ranges, triton_section,
                                        unsupported_reason)

__all__ = ["Untranslatable", "generate", "mod_functions", "load_source", "range_pointers", "table_ranges",
           "run_bounds", "run_grid", "triton_section", "unsupported_reason", "HELPERS", "MAX_UNROLLED"]
