"""flex-workbench: define FlexAttention masks, see their blocks, run and verify them, export them.

Stages, one module each: define -> blocks -> look -> run -> verify -> analyze (statistics) /
porting (backend forms) -> export (spec files, conformance, diff). `report`, `cli` and `app`
(the notebook UI) only compose them; `triton_gen` writes Triton source from traced mods.
"""

from workbench.define import Mask, WorkbenchError, bind, library, make, parse_params, probe, with_score

__all__ = ["Mask", "Workbench", "WorkbenchError", "bind", "library", "make", "parse_params", "probe", "with_score"]


def __getattr__(name):
    # the notebook app pulls in ipywidgets; load it only when asked for
    if name == "Workbench":
        from workbench.app import Workbench

        return Workbench
    raise AttributeError(f"module 'workbench' has no attribute {name!r}")


def load_ipython_extension(ipython):
    """`%load_ext workbench` registers the %%flexmask cell magic."""
    from workbench.app import load_ipython_extension as load

    load(ipython)
__version__ = "0.1.0"
