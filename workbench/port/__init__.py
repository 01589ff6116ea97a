"""The port: a standalone Triton attention kernel for any mask, generated from its mods.

    generate.py        the mods translated and filled into a template -> PortSource (text + tables)
    files.py           write / load / run_file (on a CPU under Triton's interpreter, in a fresh process)
    check.py           the pipeline the front ends share: generate -> write -> verify -> time
    runner.py          the fresh process run_file starts on a CPU
    layout.py          contiguous inputs as one serving step over a paged KV cache, and back
    templates/         forward.py: the FlashAttention-2-style forward kernel the port is made of

The generated file imports torch and triton only and exposes `attention(q, k, v, *, scale=None,
return_lse=False, cu_seqlens=None)` with FlexAttention's semantics, and `attention_paged(...)` for a
serving step over a paged KV cache; `verify(..., backend="port")` / `backend="port-paged"` judge them
against the float64 reference.

    >>> from workbench import make, port
    >>> source = port.generate(make("causal_sliding_window", {"window": 64}), 256, 256)
    >>> source.valid_for()
    'any Lq <= Lk (the factory refuses Lq > Lk) with len_offset = Lk - Lq computed per call; any heads; any batch'
"""

from workbench.port.check import PortResult, check
from workbench.port.files import (build, in_process, load, loaded, require_triton, run_file, run_file_backward,
                                 run_paged_file, triton_installed,
                                  write)
from workbench.port.generate import (CONFIGS, DTYPES, ENTRY, MAX_HEAD_DIM, SEGMENT_CONFIGS, TEMPLATE,
                                     WIDE_ROW_CONFIGS, PortSource, check_supported, generate, pinned_config)

__all__ = ["PortSource", "PortResult", "generate", "write", "build", "load", "loaded", "run_file", "run_file_backward", "run_paged_file", "check",
           "check_supported", "pinned_config", "in_process", "triton_installed", "require_triton", "CONFIGS",
           "SEGMENT_CONFIGS", "WIDE_ROW_CONFIGS", "DTYPES", "ENTRY", "MAX_HEAD_DIM", "TEMPLATE"]
