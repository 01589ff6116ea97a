"""Trust at length on the GPU: mods drawn from the trust grammar at 32K tokens, judged compiled in
bf16, with block masks equal to torch's (compiled create_block_mask). Run with `pytest -m gpu`."""

import random
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run_port_corpus import random_mod  # noqa: E402
from helpers import same_block_mask  # noqa: E402
from workbench.blocks import build_block_mask  # noqa: E402
from workbench.run import Shape  # noqa: E402
from workbench.verify import verify  # noqa: E402


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(4))
def test_drawn_mods_at_32k(cuda, seed):
    rng = random.Random(100 + seed)
    q_len = 32768 - rng.randint(0, 300)
    kv_len = q_len + rng.randint(0, 300)
    batch, heads = rng.randint(1, 2), rng.randint(1, 4)
    mask = random_mod(rng, q_len, kv_len, batch, heads)
    mask = mask.replace(mask_mod=_on_cuda(mask.mask_mod),
                        score_mod=_on_cuda(mask.score_mod) if mask.score_mod is not None else None)
    ref = torch.compile(create_block_mask)(mask.mask_mod, batch, heads, q_len, kv_len, device=cuda)
    problems = []
    for engine in ("eager", None):  # the exact tiles, and whatever the default picks (the fused kernel)
        ours = build_block_mask(mask, q_len, kv_len, heads=heads, batch=batch, device=cuda, engine=engine)
        try:
            same_block_mask(ours, ref)
        except AssertionError as exc:
            diff = (ours.kv_num_blocks != ref.kv_num_blocks).nonzero()[:3].tolist()
            problems.append(f"engine {engine}: {exc} first at (b, h, row) {diff}")
    assert not problems, problems
    verdict = verify(mask, Shape(batch=batch, q_heads=heads, q_len=q_len, kv_len=kv_len, head_dim=64),
                     dtype="bfloat16", device=cuda, seed=seed)
    assert verdict.passed, verdict.line


def _on_cuda(mod):
    """The drawn mod with its captured tensors moved to the GPU (closures are rebuilt by value)."""
    import types

    cells = []
    for cell in mod.__closure__ or ():
        value = cell.cell_contents
        if isinstance(value, torch.Tensor):
            value = value.cuda()
        elif callable(value) and getattr(value, "__closure__", None):
            value = _on_cuda(value)
        elif isinstance(value, tuple):
            value = tuple(_on_cuda(v) if callable(v) and getattr(v, "__closure__", None) else v for v in value)
        cells.append(types.CellType(value))
    return types.FunctionType(mod.__code__, mod.__globals__, mod.__name__, mod.__defaults__, tuple(cells) or None)


@pytest.mark.gpu
def test_memory_the_caching_allocator_holds_counts_as_free(cuda):
    """Freed tensors stay reserved in PyTorch's cache: the driver calls them taken, the next
    allocation gets them. device_memory counts them, so a second verification is not refused."""
    from workbench.blocks import device_memory

    x = torch.empty(40 << 30, dtype=torch.uint8, device=cuda)
    del x
    driver_free, _ = torch.cuda.mem_get_info()
    assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() >= 40 << 30
    assert device_memory(torch.device(cuda)) >= driver_free + (40 << 30)
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_two_verifications_at_length_in_one_process(cuda):
    """The issue's case at 256K tokens: causal, then a 1,024 window, in one process (4 heads, D 128,
    bf16). The reference's temporaries reuse freed memory (growable segments), what the cache
    keeps counts as free, and the second verification is not refused for memory."""
    from workbench import make
    from workbench.blocks import device_memory

    shape = Shape(q_heads=4, q_len=262144, kv_len=262144, head_dim=128)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    first = verify(make("causal"), shape, dtype="bfloat16", device=cuda, seed=0)
    peak, reserved_peak = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    print(f"causal 256K: peak allocated {peak / 2**30:.1f} GiB, peak reserved {reserved_peak / 2**30:.1f} GiB, "
          f"cached after {cached / 2**30:.2f} GiB")
    assert first.passed, first.line
    assert reserved_peak < 1.5 * peak, (reserved_peak / 2**30, peak / 2**30)
    assert device_memory(torch.device(cuda)) >= torch.cuda.mem_get_info()[0] + cached
    second = verify(make("causal_sliding_window", {"window": 1024}), shape, dtype="bfloat16", device=cuda, seed=1)
    assert second.passed, second.line
