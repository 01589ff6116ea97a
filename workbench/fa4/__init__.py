"""The mask on FlashAttention-4: a standalone file that runs the mods, translated to CuTe DSL, on
FA4's own forward kernel (`flash_attn.cute`) with block-sparse tensors from the exact scan.

    generate.py        the mods translated and filled into a template -> Fa4Source (text + tensors)
    templates/         attention.py: the file (checks, aux tensors, block lists, the FA4 call)

The file imports torch and flash_attn.cute only and exposes `attention(q, k, v, *, scale=None,
return_lse=False, scalars=None)` with FlexAttention's semantics and layout; `verify(...,
backend="fa4")` judges it against the float64 reference on a GPU with FA4 installed. Numbers the
mods capture: those that follow the lengths are run-time values (FA4's aux_scalars), computed per
call; knobs (a window) run written into the mods at their generated values, and `scalars=` turns
them through copies of the mods that read them as aux_scalars (compiled once, on the first turn).

    >>> from workbench import make, fa4
    >>> source = fa4.generate(make("causal_sliding_window", {"window": 64}), 256, 256)
    >>> source.section()["aux_scalars"], source.section()["length_rules"]
    ({'knob_window': 64}, {'len_offset': [-1, 1, 0, 1]})
"""

from __future__ import annotations

from pathlib import Path

from workbench.fa4.generate import BLOCK, FA4_VERSION, HEAD_DIMS, Fa4Source, block_tensors, generate, unsupported_reason

__all__ = ["Fa4Source", "generate", "write", "load", "unsupported_reason", "installed", "block_tensors", "BLOCK",
           "FA4_VERSION", "HEAD_DIMS"]


def write(src: Fa4Source, out_dir: str | Path) -> Path:
    """Write NAME_KEY_fa4.py (and NAME_KEY_fa4.safetensors with its aux tensors and block lists)."""
    from workbench.define.util import output_folder

    out = output_folder(out_dir, src.name)
    path = out / src.file_name
    path.write_text(src.source)
    if src.tensors:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in src.tensors.items()}, str(out / src.tensor_file),
                  metadata={"fa4": src.file_name})
    return path


def installed() -> str | None:
    """The installed flash-attn-4's version, or None."""
    import importlib.metadata

    try:
        return importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return None


def load(path: str | Path):
    """Import a generated FA4 file (needs flash_attn.cute: flash-attn-4 and its cutlass DSL)."""
    from workbench.define.util import load_module

    path = Path(path)
    return load_module(path, path.stem)
