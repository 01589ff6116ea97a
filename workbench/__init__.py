"""flex-workbench: define FlexAttention masks, see their blocks, run and verify them, export them.

Data flows one way -- define -> blocks -> look -> run -> verify -> analyze -> export -- one stage
per module or folder; the front ends (cli, report, sweep, app) only compose stages. The layout,
with a line per module, is in docs/architecture.md.

    >>> from workbench import make
    >>> make("causal_sliding_window", {"window": 128}).name
    'causal_sliding_window_128'
"""

import importlib
import importlib.abc
import importlib.util
import sys

from workbench.define import Mask, WorkbenchError, bind, library, make, parse_params, probe, with_score

__all__ = ["Mask", "Workbench", "WorkbenchError", "bind", "library", "make", "parse_params", "probe", "with_score"]
__version__ = "0.1.0"


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


# Modules that moved into folders keep their old import paths (user code, older notebooks).
MOVED = {"workbench.triton_gen": "workbench.translate", "workbench.porting": "workbench.export.forms",
         "workbench.distribute": "workbench.verify.distribute", "workbench.port_runner": "workbench.port.runner",
         "workbench.widgets": "workbench.app.widgets", "workbench.lengths": "workbench.define.lengths"}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import workbench.triton_gen` gives the module at its new path (one module object)."""

    def find_spec(self, name, *_):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module):
        pass


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())
