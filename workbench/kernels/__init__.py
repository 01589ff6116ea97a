"""The workbench's own Triton kernels, kept apart from the analysis that uses them.

    scan.py              the driver of the fused block scan (`blocks.scan_blocks` on a GPU)
    templates/scan.py    its kernel, a template in the same @@ dialect as the port's

The mask_mod is translated to Triton (`workbench.translate`) and each program walks one row of
blocks for one (b, h), evaluating the mask on register tiles and keeping only sums, so a new
mask_mod costs one Triton compile instead of a torch.compile.
"""

from workbench.kernels import scan
from workbench.kernels.scan import (ScanKernel, _namespaces, _requests, available, background_compiles, block_scan,
                                    compile_in_background, compiling, forget, interpreting, is_compiled,
                                    scan_kernel, tile_shape, times_requested)

# The kernel's settings (TILE_ELEMENTS, SCAN_WARPS, SCAN_INTERIOR, SCAN_ROWS_AT_END, SCAN_BOUNDS) are
# globals of `workbench.kernels.scan`, read at each launch: set them there (benchmarks and tests do).

__all__ = ["ScanKernel", "scan_kernel", "block_scan", "available", "interpreting", "forget", "is_compiled",
           "compile_in_background", "background_compiles", "compiling", "times_requested", "tile_shape", "scan",
           "_namespaces", "_requests"]
