"""`%load_ext workbench` adds a `%%flexmask [--q-len N ...]` cell magic: the cell defines
`mask_mod(b, h, q_idx, kv_idx)` (and optionally `score_mod(score, b, h, q_idx, kv_idx)`) and
opens in the Workbench."""

from __future__ import annotations

import argparse
import shlex

import ipywidgets as w
from IPython.display import display

from workbench.define import Mask, WorkbenchError
from workbench.app.workbench import Workbench, _esc

__all__ = ["load_ipython_extension", "mask_from_cell"]


# ---------------------------------------------------------------- %%flexmask

def _magic_args(line: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="%%flexmask", add_help=False)
    p.add_argument("name", nargs="?", default="my_mask")
    p.add_argument("--q-len", type=int, default=1024)
    p.add_argument("--kv-len", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--device")
    return p.parse_args(shlex.split(line))


def mask_from_cell(name: str, cell: str, namespace: dict) -> Mask:
    """Run the cell in `namespace` and take `mask_mod` / `score_mod` from it."""
    code = compile(cell, f"<flexmask {name}>", "exec")
    exec(code, namespace)  # the user's own cell, as IPython would run it
    mask_mod, score_mod = namespace.get("mask_mod"), namespace.get("score_mod")
    if mask_mod is None and score_mod is None:
        raise WorkbenchError("the %%flexmask cell defines neither `mask_mod` nor `score_mod`",
                             "define def mask_mod(b, h, q_idx, kv_idx): ... in the cell")
    return Mask(name=name, mask_mod=mask_mod, score_mod=score_mod, source=cell,
                description=f"Defined in a %%flexmask cell ({name}).")


def load_ipython_extension(ipython):
    def flexmask(line, cell):
        try:
            args = _magic_args(line)
            mask = mask_from_cell(args.name, cell, ipython.user_ns)
            bench = Workbench(mask, q_len=args.q_len, kv_len=args.kv_len, heads=args.heads,
                              block_size=args.block_size, device=args.device)
        except WorkbenchError as exc:
            display(w.HTML(f"<div style='background:#fdecea;padding:6px 10px'>{_esc(exc.message)}</div>"))
            return None
        ipython.user_ns[f"{args.name}_workbench"] = bench
        return bench

    ipython.register_magic_function(flexmask, magic_kind="cell", magic_name="flexmask")
