"""Triton source for a mask_mod / score_mod, generated from the traced mod.

The mod is traced with make_fx on 0-d index tensors (the way FlexAttention sees it) into an
aten graph; each aten op becomes one line of Triton. Captured tensors become pointer
arguments read with tl.load. Python semantics are kept where Triton's differ: integer `//`
and `%` round toward minus infinity in Python and toward zero in Triton, so both get helpers.

The generated text is data in the spec. Nothing here runs it; tests compile it with Triton
(on the GPU, and on the CPU through TRITON_INTERPRET=1).
"""

from __future__ import annotations

import operator
from typing import Callable

import torch

from workbench.define import Mask, captured_tensors, trace_mod

_BINARY = {
    "add": "({a} + {b})", "sub": "({a} - {b})", "mul": "({a} * {b})", "div": "({a} / {b})",
    "ge": "({a} >= {b})", "gt": "({a} > {b})", "le": "({a} <= {b})", "lt": "({a} < {b})",
    "eq": "({a} == {b})", "ne": "({a} != {b})",
    "bitwise_and": "({a} & {b})", "bitwise_or": "({a} | {b})", "bitwise_xor": "({a} ^ {b})",
    "logical_and": "({a} & {b})", "logical_or": "({a} | {b})",
    "minimum": "tl.minimum({a}, {b})", "maximum": "tl.maximum({a}, {b})",
    "floor_divide": "_py_floordiv({a}, {b})", "remainder": "_py_mod({a}, {b})",
    "pow": "tl.exp(tl.log({a}) * {b})",
}
_UNARY = {
    "abs": "tl.abs({a})", "neg": "(-{a})", "bitwise_not": "(~{a})", "logical_not": "({a} == 0)",
    "exp": "tl.exp({a})", "log": "tl.log({a})", "sqrt": "tl.sqrt({a})", "sigmoid": "tl.sigmoid({a})",
    "tanh": "(2.0 * tl.sigmoid(2.0 * {a}) - 1.0)",  # portable tanh
    "sin": "tl.sin({a})", "cos": "tl.cos({a})", "floor": "tl.floor({a})", "ceil": "tl.ceil({a})",
}
_IDENTITY = {"clone", "alias", "view", "expand", "lift_fresh_copy", "detach", "contiguous", "_unsafe_view",
             "reshape", "squeeze", "unsqueeze"}
_TL_DTYPES = {torch.int32: "tl.int32", torch.int64: "tl.int64", torch.float32: "tl.float32", torch.bool: "tl.int1",
              torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16", torch.float64: "tl.float64",
              torch.int8: "tl.int8", torch.int16: "tl.int16", torch.uint8: "tl.uint8"}

HELPERS = '''@triton.jit
def _py_floordiv(a, b):
    # Python floor division (Triton's // truncates toward zero)
    q = a // b
    return q - ((a % b != 0) & ((a < 0) != (b < 0))).to(q.dtype)


@triton.jit
def _py_mod(a, b):
    # Python modulo: the result takes the sign of b (Triton's % takes the sign of a)
    r = a % b
    return r + b * ((r != 0) & ((r < 0) != (b < 0))).to(r.dtype)
'''


class Untranslatable(Exception):
    pass


def _literal(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return repr(value) if value == value and abs(value) != float("inf") else f"float('{value}')"
    return repr(value)


def _translate(gm, fn_name: str, arg_names: list[str], captured: dict[str, torch.Tensor]) -> tuple[str, list[str]]:
    """Triton source of one traced mod; returns (source, pointer argument names in order)."""
    lines, env, pointers = [], {}, []
    placeholders = iter(arg_names)
    by_ptr = {(t.data_ptr(), tuple(t.shape)): n for n, t in captured.items()}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node.name] = next(placeholders)
        elif node.op == "get_attr":
            tensor = getattr(gm, node.target)
            if tensor.dim() == 0:
                env[node.name] = _literal(tensor.item())
                continue
            name = by_ptr.get((tensor.data_ptr(), tuple(tensor.shape)), node.target.lstrip("_"))
            if name not in captured:
                captured[name] = tensor
            ptr = f"{name}_ptr"
            if ptr not in pointers:
                pointers.append(ptr)
            # pointers address the tensor as stored in the spec: contiguous, row-major
            strides = torch.empty(tensor.shape).stride()
            env[node.name] = ("ptr", ptr, strides)
        elif node.op == "call_function":
            target = node.target
            if target is operator.getitem:
                raise Untranslatable("Python indexing survived tracing")
            op = getattr(target, "_opname", None) or getattr(target, "__name__", str(target))
            op = op.split(".")[0]
            if op == "index":
                base, idx = node.args[0], node.args[1]
                _, ptr, strides = env[base.name]
                if len(idx) != len(strides) or any(i is None for i in idx):
                    raise Untranslatable("a captured tensor is indexed with fewer indices than it has dimensions")
                offset = " + ".join(f"({_arg(i, env)}) * {st}" if st != 1 else f"({_arg(i, env)})"
                                    for i, st in zip(idx, strides))
                expr = f"tl.load({ptr} + {offset})"
            elif (args := [_arg(a, env) for a in node.args]) is None:
                pass
            elif op in _IDENTITY:
                expr = args[0]
            elif op in ("_to_copy", "to", "type_as", "convert_element_type"):
                dtype = node.kwargs.get("dtype") or (node.args[1] if len(node.args) > 1 else None)
                expr = f"({args[0]}).to({_TL_DTYPES[dtype]})" if dtype in _TL_DTYPES else args[0]
            elif op in ("where",):
                expr = f"tl.where({args[0]}, {args[1]}, {args[2]})"
            elif op in ("clamp", "clip"):
                lo = node.args[1] if len(node.args) > 1 else node.kwargs.get("min")
                hi = node.args[2] if len(node.args) > 2 else node.kwargs.get("max")
                expr = args[0]
                if lo is not None:
                    expr = f"tl.maximum({expr}, {_arg(lo, env)})"
                if hi is not None:
                    expr = f"tl.minimum({expr}, {_arg(hi, env)})"
            elif op == "scalar_tensor" or op == "full":
                expr = _literal(node.args[-1] if op == "scalar_tensor" else node.args[1])
            elif op == "rsub":
                expr = f"({args[1]} - {args[0]})"
            elif op in _BINARY and len(args) >= 2:
                expr = _BINARY[op].format(a=args[0], b=args[1])
            elif op in _UNARY:
                expr = _UNARY[op].format(a=args[0])
            else:
                raise Untranslatable(f"aten op `{op}` has no Triton translation here")
            env[node.name] = f"v_{node.name}"
            lines.append(f"    v_{node.name} = {expr}")
        elif node.op == "output":
            out = node.args[0]
            out = out[0] if isinstance(out, (tuple, list)) else out
            lines.append(f"    return {_arg(out, env)}")
    params = ", ".join(arg_names + pointers)
    return f"@triton.jit\ndef {fn_name}({params}):\n" + "\n".join(lines) + "\n", pointers


def _arg(a, env):
    if hasattr(a, "name") and a.name in env:
        value = env[a.name]
        if isinstance(value, tuple):
            raise Untranslatable("a captured tensor is used other than by indexing")
        return value
    if isinstance(a, (int, float, bool)):
        return _literal(a)
    if isinstance(a, torch.dtype):
        return _TL_DTYPES.get(a, "tl.float32")
    if a is None:
        return "None"
    raise Untranslatable(f"argument {a!r} of type {type(a).__name__}")


def generate(mask: Mask) -> tuple[str, list[str], list[str], dict[str, torch.Tensor]]:
    """(source, mask pointer args, score pointer args, captured tensors by name)."""
    captured = dict(captured_tensors(mask))
    parts, mask_ptrs, score_ptrs = [HELPERS], [], []
    if mask.mask_mod is not None:
        src, mask_ptrs = _translate(trace_mod(mask.mask_mod, "mask"), "mask_mod_triton", ["b", "h", "q_idx", "kv_idx"],
                                    captured)
        parts.append(src)
    if mask.score_mod is not None:
        src, score_ptrs = _translate(trace_mod(mask.score_mod, "score"), "score_mod_triton",
                                     ["score", "b", "h", "q_idx", "kv_idx"], captured)
        parts.append(src)
    if mask.mask_mod is not None:
        ptr_params = "".join(f", {p}" for p in mask_ptrs)
        parts.append(f'''@triton.jit
def mask_grid_kernel(out_ptr, b, h, Lq, Lk{ptr_params}, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr):
    # writes the mask of (b, h) as int8 [Lq, Lk]: a test harness and an example call
    q_idx = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)[:, None]
    kv_idx = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
    inside = (q_idx < Lq) & (kv_idx < Lk)
    # indices past the end are clamped so table reads stay in bounds; they are not stored
    keep = mask_mod_triton(b, h, tl.minimum(q_idx, Lq - 1), tl.minimum(kv_idx, Lk - 1){ptr_params})
    tl.store(out_ptr + q_idx * Lk + kv_idx, keep.to(tl.int8), mask=inside)
''')
    if mask.score_mod is not None:
        ptr_params = "".join(f", {p}" for p in score_ptrs)
        parts.append(f'''@triton.jit
def score_grid_kernel(score_ptr, out_ptr, b, h, Lq, Lk{ptr_params}, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr):
    # applies score_mod_triton to a float32 [Lq, Lk] score matrix of (b, h): a test harness
    q_idx = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)[:, None]
    kv_idx = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
    inside = (q_idx < Lq) & (kv_idx < Lk)
    score = tl.load(score_ptr + q_idx * Lk + kv_idx, mask=inside, other=0.0)
    out = score_mod_triton(score, b, h, tl.minimum(q_idx, Lq - 1), tl.minimum(kv_idx, Lk - 1){ptr_params})
    tl.store(out_ptr + q_idx * Lk + kv_idx, out.to(tl.float32), mask=inside)
''')
    used = {p[:-4] for p in mask_ptrs + score_ptrs}
    return "import triton\nimport triton.language as tl\n\n\n" + "\n\n".join(parts), mask_ptrs, score_ptrs, \
        {k: v for k, v in captured.items() if k in used}


def unsupported_reason(mask: Mask) -> str | None:
    try:
        generate(mask)
    except Untranslatable as exc:
        return f"the traced mod cannot be written as Triton: {exc}"
    except Exception as exc:
        return f"the mod could not be traced for Triton: {type(exc).__name__}: {str(exc)[:200]}"
    return None


def triton_section(mask: Mask, tensors: dict | None = None) -> dict:
    """The spec's `backends.triton`: source text, function names and pointer arguments (the
    captured tensors, stored in the tensor file as triton.NAME)."""
    source, mask_ptrs, score_ptrs, captured = generate(mask)
    if tensors is not None:
        for name, t in captured.items():
            tensors[f"triton.{name}"] = t.detach().cpu().numpy()
    return {
        "source": source,
        "mask_fn": "mask_mod_triton" if mask.mask_mod is not None else None,
        "score_fn": "score_mod_triton" if mask.score_mod is not None else None,
        "grid_kernel": "mask_grid_kernel" if mask.mask_mod is not None else None,
        "score_grid_kernel": "score_grid_kernel" if mask.score_mod is not None else None,
        "mask_args": ["b", "h", "q_idx", "kv_idx"] + mask_ptrs,
        "score_args": ["score", "b", "h", "q_idx", "kv_idx"] + score_ptrs if mask.score_mod is not None else None,
        "pointers": {p: {"$tensor": f"triton.{p[:-4]}"} for p in dict.fromkeys(mask_ptrs + score_ptrs)},
    }


def load_source(source: str) -> dict:
    """Compile generated source into a namespace (for tests and harnesses; never on spec load)."""
    import importlib.util
    import sys
    import tempfile

    # triton.jit reads the function's source from a file, so the text must live in one
    handle = tempfile.NamedTemporaryFile("w", suffix="_flexwb_triton.py", delete=False)
    handle.write(source)
    handle.close()
    name = f"flexwb_triton_{abs(hash(source))}"
    spec = importlib.util.spec_from_file_location(name, handle.name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return vars(module)


def run_grid(source: str, b: int, h: int, q_len: int, kv_len: int, pointers: list, device="cuda",
             block: int = 32, score: torch.Tensor | None = None) -> torch.Tensor:
    """Evaluate the generated mask (or, given `score` [q_len, kv_len] float32, the generated
    score_mod) over [q_len, kv_len] with the generated grid kernels."""
    ns = load_source(source)
    grid = (-(-q_len // block), -(-kv_len // block))
    pointers = [p.contiguous() for p in pointers]
    if score is not None:
        out = torch.empty(q_len, kv_len, dtype=torch.float32, device=device)
        ns["score_grid_kernel"][grid](score.contiguous(), out, b, h, q_len, kv_len, *pointers, BLOCK_Q=block,
                                      BLOCK_K=block)
        return out
    out = torch.zeros(q_len, kv_len, dtype=torch.int8, device=device)
    ns["mask_grid_kernel"][grid](out, b, h, q_len, kv_len, *pointers, BLOCK_Q=block, BLOCK_K=block)
    return out.bool()
