"""The one place that touches torch internals or differs between torch versions (>= 2.6)."""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch.nn.attention.flex_attention import BlockMask

__all__ = ["TORCH_VERSION", "getitem_as_index", "vmap_bhqkv", "block_mask_from_kv_blocks", "raise_recompile_limit",
           "flex_with_lse", "reset_compiled", "float32_matmul", "tensor_version", "expandable_segments",
           "make_fx_trace", "aten_op_name", "is_compile_error"]

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
if TORCH_VERSION < (2, 6):
    raise ImportError(f"flex-workbench needs torch >= 2.6 (FlexAttention), found {torch.__version__}")


class _GetItemAsIndex(torch.overrides.TorchFunctionMode):
    """`tensor[i, j]` whose indices are all tensors or ints (not bools) becomes `aten.index` with
    each int as a 0-d int64 tensor on the indexed tensor's device: what FlexAttention's tracer does
    to a mod's `table[h]` (a 0-d index tensor would otherwise be turned into a Python int, which
    vmap and make_fx cannot do). Slices, None, Ellipsis, bools and lists index as usual."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__ and isinstance(args[0], torch.Tensor):
            table, where = args[0], args[1]
            where = list(where) if isinstance(where, tuple) else [where]
            if where and all(isinstance(x, torch.Tensor) or (isinstance(x, int) and not isinstance(x, bool))
                             for x in where):
                return torch.ops.aten.index(table, [x if isinstance(x, torch.Tensor) else
                                                    torch.tensor(x, dtype=torch.int64, device=table.device)
                                                    for x in where])
        return func(*args, **(kwargs or {}))


def getitem_as_index():
    """`tensor[idx]` inside a vmapped or traced mod becomes aten.index, as FlexAttention does when
    it traces mods (_GetItemAsIndex: torch's own switch lives in torch._dynamo, a private module
    whose import alone takes 2 s)."""
    return _GetItemAsIndex()


def vmap_bhqkv(mod, b, h, q, kv, score=None):
    """Evaluate a mod over the grid b x h x q x kv the way FlexAttention's tracer does
    (nested torch.vmap over 0-d index tensors). Returns a [B, H, Q, KV] tensor."""
    fn = mod
    prefix = () if score is None else (0,)
    for dims in [(None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)]:
        fn = torch.vmap(fn, in_dims=prefix + dims)
    with getitem_as_index():
        return fn(b, h, q, kv) if score is None else fn(score, b, h, q, kv)


def block_mask_from_kv_blocks(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                              block_size: tuple[int, int], mask_mod, seq_lengths: tuple[int, int],
                              compute_q_blocks: bool = True) -> BlockMask:
    params = inspect.signature(BlockMask.from_kv_blocks).parameters
    kwargs = dict(BLOCK_SIZE=block_size, mask_mod=mask_mod)
    if "seq_lengths" in params:
        kwargs["seq_lengths"] = seq_lengths
    if "compute_q_blocks" in params:
        kwargs["compute_q_blocks"] = compute_q_blocks
    bm = BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, **kwargs)
    if "seq_lengths" not in params:  # torch 2.6 keeps lengths as an attribute only
        bm.seq_lengths = seq_lengths
    return bm


def raise_recompile_limit(limit: int = 512) -> None:
    """FlexAttention compiles once per distinct mod; past torch's recompile limit (8) it falls
    back to the unfused path silently, which runs out of memory at length. A workbench session
    tries many mods, so lift the limit."""
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(limit, getattr(dynamo_config, name)))
    if hasattr(dynamo_config, "accumulated_recompile_limit"):
        dynamo_config.accumulated_recompile_limit = max(limit * 4, dynamo_config.accumulated_recompile_limit)
    elif hasattr(dynamo_config, "accumulated_cache_size_limit"):
        dynamo_config.accumulated_cache_size_limit = max(limit * 4, dynamo_config.accumulated_cache_size_limit)


def flex_with_lse(flex_fn, q, k, v, score_mod, block_mask, scale, enable_gqa, want_lse=True):
    """(out, lse) from `flex_fn` (flex_attention, compiled or not). torch >= 2.9 asks for the
    log-sum-exp through `return_aux`; older versions through `return_lse`. lse is None when
    not wanted (compiled CPU FlexAttention cannot return it)."""
    if not want_lse:
        return flex_fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa), None
    if _HAS_RETURN_AUX:
        from torch.nn.attention.flex_attention import AuxRequest

        out, aux = flex_fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                           enable_gqa=enable_gqa, return_aux=AuxRequest(lse=True))
        return out, aux.lse
    return flex_fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                   enable_gqa=enable_gqa, return_lse=True)


def _flex_params():
    from torch.nn.attention.flex_attention import flex_attention

    return inspect.signature(flex_attention).parameters


_HAS_RETURN_AUX = "return_aux" in _flex_params()


def reset_compiled() -> None:
    """Forget every compiled graph (a fresh start when a session has compiled very many mods)."""
    torch._dynamo.reset()


@contextlib.contextmanager
def float32_matmul(precision: str):
    """'ieee' (full fp32) or 'tf32' for matmuls on CUDA, restored afterwards."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def tensor_version(t: torch.Tensor) -> int:
    """A counter torch bumps on every in-place write to `t` (autograd's version counter): a key
    that keeps a fact about a tensor's contents goes stale when it changes."""
    return getattr(t, "_version", 0)


@contextlib.contextmanager
def expandable_segments(device: torch.device):
    """While the block runs, PyTorch's CUDA caching allocator maps memory as growable segments
    (`expandable_segments:True`), so temporaries whose size changes from step to step reuse
    freed memory instead of mapping new blocks until the GPU is full. Private API
    (`torch._C._accelerator_setAllocatorSettings`, before torch 2.10
    `torch.cuda.memory._set_allocator_settings`): where it is missing, or the
    user already chose allocator settings (PYTORCH_CUDA_ALLOC_CONF), nothing changes."""
    import os

    # torch >= 2.10 names it torch._C._accelerator_setAllocatorSettings (the older name warns there)
    setter = (getattr(torch._C, "_accelerator_setAllocatorSettings", None)
              or getattr(torch.cuda.memory, "_set_allocator_settings", None))
    chosen = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if device.type != "cuda" or setter is None or "expandable_segments" in chosen or TORCH_VERSION < (2, 1):
        yield
        return
    try:
        setter("expandable_segments:True")
    except Exception:  # an allocator that does not take the setting
        yield
        return
    try:
        yield
    finally:
        setter("expandable_segments:False")


def make_fx_trace(fn, *args):
    """fn traced into an aten graph (`torch.fx.experimental.proxy_tensor.make_fx`, experimental
    since torch 1.13 and unchanged in signature through 2.13), the way FlexAttention's tracer sees
    a mod."""
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn)(*args)


def aten_op_name(target) -> str:
    """`aten.add.Tensor` -> 'add' (an OpOverload's private `_opname`, else its name)."""
    name = getattr(target, "_opname", None) or getattr(target, "__name__", str(target))
    return name.split(".")[0]


# torch.compile's own failures (dynamo, inductor, a C++ / Triton build), told from the mods' errors
# by the module their exception class lives in, or its name where torch re-raises it elsewhere
_COMPILE_MODULES = ("torch._dynamo", "torch._inductor", "torch._subclasses")
_COMPILE_ERRORS = ("InductorError", "BackendCompilerFailed", "CppCompileError", "Unsupported", "TorchRuntimeError",
                   "CompilationError", "LoweringException")


def is_compile_error(exc: BaseException) -> bool:
    """Raised by torch.compile itself, not by the mods' own logic."""
    for e in (exc, exc.__cause__, exc.__context__):
        if e is None:
            continue
        if (type(e).__module__ or "").startswith(_COMPILE_MODULES) or type(e).__name__ in _COMPILE_ERRORS:
            return True
    return False

