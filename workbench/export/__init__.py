"""Stage 7, export: the porting spec -- a mask in the terms of every backend that can run it.

    spec.py           build_spec: fit every target form, keep the exact ones, attach the port
    forms.py          the target forms (FlashAttention, vLLM Triton, MagiAttention, FlashMask, row
                      intervals, block-sparse) fitted from a mask, and their decoders
    golden.py         golden vectors from the float64 reference
    files.py          PortingSpec, write_spec / load_spec (JSON + safetensors; loading runs no code)
    conformance.py    an implementation (or the spec's own port) on the golden vectors
    diff.py           whether two specs describe the same attention
    spec.schema.json  the JSON schema every spec is validated against

What each section means and how it is checked: docs/porting.md.

    >>> from workbench import make
    >>> spec = build_spec(make("causal"), 256, 256, golden=False)
    >>> spec.doc["backends"]["flash_attn"]["causal"]
    True
"""

from workbench.export.conformance import ConformanceReport, conformance, load_impl
from workbench.export.diff import SpecDiff, diff_specs
from workbench.export.files import (
                                    SPEC_VERSION,
                                    TARGETS,
                                    PortingSpec,
                                    check_golden,
                                    check_shapes,
                                    doc_file,
                                    load_spec,
                                    spec_stem,
                                    tensor_digest,
                                    validate_doc,
                                    write_spec,
)
from workbench.export.golden import GOLDEN_VECTORS, add_golden
from workbench.export.spec import build_spec, triton_reason

__all__ = ["build_spec", "write_spec", "load_spec", "conformance", "diff_specs", "PortingSpec", "SpecDiff",
           "ConformanceReport", "load_impl", "add_golden", "check_golden", "check_shapes", "validate_doc",
           "tensor_digest", "spec_stem", "doc_file", "triton_reason", "SPEC_VERSION", "TARGETS", "GOLDEN_VECTORS"]
