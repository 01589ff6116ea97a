"""Stage 5, verify: a kernel against an eager float64 reference that shares none of its code.

    verdict.py      verify(): the kernel (FlexAttention, or the generated port) on fresh random
                    inputs against the reference, judged per tensor -> Verdict
    reference.py    the fast reference: chunked, sparse over kept keys, at any length
    oracle.py       the plain oracle the fast reference must equal (small problems)
    compare.py      tolerances per dtype, TensorCheck, merging checks computed in pieces
    findings.py     the traps a verdict explains
    distribute.py   the reference split by query rows across Ray workers

Example (any device; on a CPU FlexAttention runs uncompiled):

    >>> from workbench import make
    >>> from workbench.run import Shape
    >>> verdict = verify(make("causal"), Shape(q_len=64, head_dim=16), dtype="float32", seed=0)
    >>> verdict.passed
    True
"""

from workbench.verify.compare import AXES, LSE_TOLERANCE, TOLERANCES, TensorCheck, Tolerance, compare, merge_checks
from workbench.verify.findings import Finding, block_mask_findings, mod_findings
from workbench.verify.oracle import oracle_attention
from workbench.verify.reference import (
                                        COMPILED_MASK_ABOVE_PAIRS,
                                        Reference,
                                        ReferenceState,
                                        default_reference_budget,
                                        reference_attention,
                                        reference_budget,
                                        reference_bytes_per_row,
)
from workbench.verify.verdict import ReferenceOptions, Verdict, verify

__all__ = ["verify", "Verdict", "ReferenceOptions", "reference_attention", "oracle_attention", "Reference", "ReferenceState",
           "reference_budget", "reference_bytes_per_row", "default_reference_budget", "COMPILED_MASK_ABOVE_PAIRS",
           "compare", "merge_checks", "TensorCheck", "Tolerance", "TOLERANCES", "LSE_TOLERANCE", "AXES", "Finding",
           "block_mask_findings", "mod_findings"]
