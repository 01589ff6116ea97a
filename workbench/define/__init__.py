"""Stage 1, define: a mask is a value.

A `Mask` bundles one attention variant: its FlexAttention mods (plain functions, unchanged), its
parameters, a description, the mods' source and the tensors they capture. Masks come from
factories -- the library in `masks/`, or any `file.py:function` of the user's -- and a factory may
ask for the sizes and device it is used at (`q_len`, `kv_len`, `device` keywords), so the same
pattern can be rebuilt for any length.

    mask.py      Mask, WorkbenchError, with_score, signature checks
    targets.py   targets and parameters: library, load_factory, make, bind, prepare
    trace.py     what a mod reads: captured tensors and numbers, make_fx traces, data flow,
                 per-structure facts (a knob being turned shares them)
    lift.py      a mod's closure numbers as 0-d tensors (kernel arguments)
    evaluate.py  evaluating a mod on index tensors, probe regions, `probe` (mistakes -> errors)
    lengths.py   how a factory's captured numbers follow (Lq, Lk) (for generated kernels)
    util.py      devices, time limits, output folders, cdiv

Example:

    >>> from workbench.define import make, prepare
    >>> mask = make("causal_sliding_window", {"window": 64}, q_len=256, kv_len=256)
    >>> mask.name
    'causal_sliding_window_64'
"""

from workbench.define.evaluate import (EvaluatorChoice, broadcast_indices, choose_evaluator, evaluate_mod,
                                       explain_mod_error, implied_size, probe, probe_grid, probe_regions)
from workbench.define.lift import lift_knobs, lift_scalars
from workbench.define.mask import (CONTEXT_KEYS, Mask, WorkbenchError, check_signature, mod_role, mod_source,
                                   positional_arity, returned_role, with_score)
from workbench.define.targets import (bind, check_captured_devices, factory_params, library, library_variants, load_factory, make,
                                      parse_params, prepare)
from workbench.define.trace import (MASK_ARGS, SCORE_ARGS, captured_scalars, captured_tensors, data_indices, elementwise,
                                    forget_structures, index_reads, op_name, structure_fact, structure_key,
                                    trace_mod, value_spans)
from workbench.define.util import TimedOut, call_with_timeout, cdiv, check_device, output_folder, same_device

__all__ = ["Mask", "WorkbenchError", "with_score", "make", "bind", "prepare", "probe", "library",
           "library_variants", "load_factory", "check_captured_devices", "parse_params", "factory_params", "CONTEXT_KEYS", "check_signature",
           "mod_role", "mod_source", "positional_arity", "returned_role", "captured_scalars", "captured_tensors",
           "trace_mod", "op_name", "index_reads", "data_indices", "elementwise", "value_spans", "structure_key", "structure_fact",
           "forget_structures", "lift_scalars", "lift_knobs", "MASK_ARGS", "SCORE_ARGS", "evaluate_mod", "broadcast_indices",
           "probe_grid", "probe_regions", "choose_evaluator", "EvaluatorChoice", "explain_mod_error", "implied_size",
           "check_device", "TimedOut", "call_with_timeout", "output_folder", "cdiv", "same_device"]
