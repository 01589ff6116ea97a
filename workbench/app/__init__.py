"""The notebook front end (JupyterLab, Notebook 7, VS Code): it composes the stages, no logic here.

    workbench.py   Workbench: mask, parameters, lengths, heads; tabs Block map | Token zoom | Scores |
                   Stats | Verify | Invariance | Benchmark | Export
    widgets.py     the block map that answers the mouse (anywidget)
    magic.py       %%flexmask: your mods from a cell

    >>> from workbench import Workbench
    >>> app = Workbench("document", {"causal": True}, q_len=4096)   # displays itself in a notebook
"""

from workbench.app.magic import load_ipython_extension, mask_from_cell
from workbench.app.widgets import BlockMapWidget
from workbench.app.workbench import CUSTOM, TABS, Workbench

__all__ = ["Workbench", "load_ipython_extension", "mask_from_cell", "BlockMapWidget", "CUSTOM", "TABS"]
