"""The one port pipeline every front end uses (cli `port`, the report, the app's Verify port, a
sweep's port backend): generate the port, write it, verify it against the float64 reference, and
on a GPU time it beside compiled FlexAttention."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from workbench.define import Mask, WorkbenchError
from workbench.port import files
from workbench.port.generate import PortSource, check_supported, generate

__all__ = ["PortResult", "check"]


@dataclass
class PortResult:
    """What `check` did: the generated port, where it was written, its verdict (None: not run) and
    timing (on a GPU, against compiled FlexAttention), and a note saying what was left out."""

    source: PortSource
    path: Path
    verdict: object = None  # verify.Verdict
    timing: dict | None = None
    note: str = ""

    @property
    def passed(self) -> bool | None:
        return None if self.verdict is None else self.verdict.passed

    @property
    def line(self) -> str:
        parts = [f"wrote {self.path}" + (f" and {self.source.tensor_file}" if self.source.tensor_file else ""),
                 f"valid for: {self.source.valid_for()}"]
        if self.verdict is not None:
            parts.append(self.verdict.line)
        if self.timing:
            t = self.timing
            parts.append(f"forward {t['dtype']}: port {t['port_ms']:.3f} ms, compiled FlexAttention {t['flex_ms']:.3f} "
                         f"ms: the port runs at {t['speed_vs_flex']:.2f}x Flex's speed")
        if self.note:
            parts.append(self.note)
        return "\n".join(parts)


def check(mask: Mask, shape, device: str | torch.device = "cpu", *, dtype: str | None = None,
          out_dir: str | Path | None = None, verify_it: bool = True, time_it: bool | None = None,
          seed: int | None = 0, progress: bool | None = False) -> PortResult:
    """Generate `mask`'s port at `shape`'s lengths (heads and batch for its tables), write it to
    `out_dir` (a temporary folder when None), verify it against the float64 reference in `dtype`
    (the device's default when None) and, on a GPU, time it beside compiled FlexAttention
    (`time_it`: default on a GPU when the verdict passed). Where Triton is missing the file is
    written and the note says it was not checked.

        >>> from workbench import make
        >>> from workbench.run import Shape
        >>> result = check(make("causal"), Shape(q_len=64, head_dim=16), "cpu", verify_it=False)
        >>> result.source.valid_for()
        'any Lq, Lk with len_offset = Lk - Lq computed per call; any heads; any batch'
    """
    from workbench.run import PortBackend, defaults_for, dtype_name
    from workbench.verify import verify

    device = str(device)
    on_gpu = device.startswith("cuda")
    dtype = dtype_name(dtype) if dtype else defaults_for(device).dtype
    check_supported(shape.head_dim, dtype if verify_it else None, mask.name)
    source = generate(mask, shape.q_len, shape.kv_len, heads=shape.q_heads, batch=shape.batch)
    folder = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="workbench_port_"))
    path = files.write(source, folder)
    result = PortResult(source, path)
    if not verify_it:
        return result
    if not files.triton_installed():
        result.note = "port not checked: Triton is not installed (pip install triton)"
        return result
    result.verdict = verify(mask, shape, dtype=dtype, device=device, seed=seed, 
                            progress=progress, backend=PortBackend(path))
    if (time_it if time_it is not None else on_gpu) and result.verdict.passed:
        if not on_gpu:
            raise WorkbenchError("timing the port needs a GPU", "drop time_it, or run on a CUDA device", mask.name)
        from workbench.run import time_port_and_flex

        try:
            result.timing = time_port_and_flex(mask, shape, path, dtype=dtype, device=device)
        except WorkbenchError as exc:  # e.g. FlexAttention cannot compile the mask: the port is still verified
            result.note = f"not timed: {exc.message}"
    return result
