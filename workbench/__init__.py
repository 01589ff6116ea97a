"""flex-workbench: define FlexAttention masks, see their blocks, run and verify them, export them.

Stages, one module each: define -> blocks -> look -> (run -> verify) -> analyze -> export.
"""

from workbench.define import Mask, WorkbenchError, bind, library, make, parse_params, probe, with_score

__all__ = ["Mask", "WorkbenchError", "bind", "library", "make", "parse_params", "probe", "with_score"]
__version__ = "0.1.0"
