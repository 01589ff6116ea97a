"""Contiguous attention inputs laid out as one serving step over a paged KV cache (vLLM's layouts),
and the step's output laid back: what `verify(..., backend="port-paged")` runs, and a way to test
an engine's integration of `attention_paged` against a contiguous call.

Each batch element b becomes request b of the step, its Lk keys in the cache. A request's queries
are its last positions, so there are two ways to place q [B, Hq, Lq, D]:

- `queries="all"` (a whole prefill): all Lk positions are queries, q's rows the first Lq of them,
  so query i sits at position i (FlexAttention's view of any mask); the other rows are drawn at
  random and dropped on the way back;
- `queries="last"` (a chunk or a decode): q's Lq rows are the request's last positions Lk - Lq ..
  Lk - 1 (FlexAttention's view of a bottom-right mask, whose offset Lk - Lq the port computes).

Pages are shuffled across the cache, a few spare pages and the tail of each request's last page
hold NaN (as an engine's cache may: slots never written, or freed), and the block table past each
request's pages holds an out-of-range page number: a kernel that reads any of them, even to weigh
it by zero, gives NaN or a wrong answer.

    >>> import torch
    >>> q, k, v = torch.randn(2, 4, 40, 16), torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)
    >>> step = paged_step(q, k, v, page_size=16, seed=0)
    >>> step.k_cache.shape[1:], step.block_table.shape, step.seq_lens.tolist(), step.cu_seqlens_q.tolist()
    (torch.Size([16, 2, 16]), torch.Size([2, 5]), [40, 40], [0, 40, 80])
    >>> out = torch.randn(80, 4, 16)
    >>> step.unpack(out).shape
    torch.Size([2, 4, 40, 16])
    >>> paged_step(q[:, :, :1], k, v, queries="last").cu_seqlens_q.tolist()  # a decode of each request
    [0, 1, 2]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.define import WorkbenchError

__all__ = ["PagedStep", "paged_step", "GARBAGE_PAGE"]

GARBAGE_PAGE = 1 << 30  # what the block table holds past each request's pages


@dataclass
class PagedStep:
    """One step's tensors (the arguments of `attention_paged`) and where each input row went."""

    q: torch.Tensor  # [total_q, Hq, D], total_q = B * Lk ("all") or B * Lq ("last")
    k_cache: torch.Tensor  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor  # [num_pages, page_size, Hkv, D]
    block_table: torch.Tensor  # [B, max_pages] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    q_len: int  # Lq of the contiguous inputs: rows kept by unpack

    def args(self) -> tuple:
        return self.q, self.k_cache, self.v_cache, self.block_table, self.cu_seqlens_q, self.seq_lens

    def unpack(self, out: torch.Tensor) -> torch.Tensor:
        """The step's out [total_q, Hq, D] (or lse [total_q, Hq]) back as [B, Hq, Lq, ...]."""
        batch = self.block_table.shape[0]
        per = out.reshape(batch, -1, *out.shape[1:])[:, :self.q_len]  # [B, Lq, Hq(, D)]
        return per.transpose(1, 2)


def paged_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, page_size: int = 16, seed: int = 0,
               queries: str = "all") -> PagedStep:
    """q [B, Hq, Lq, D], k / v [B, Hkv, Lk, D] (Lq <= Lk) as one step over a shuffled paged cache,
    q's rows placed as `queries` says ("all" or "last")."""
    batch, hq, lq, d = q.shape
    _, hkv, lk, _ = k.shape
    if lq > lk:
        raise WorkbenchError(f"q_len {lq} is over kv_len {lk}: in a paged step a request's queries are its last "
                             "positions, so there are never more queries than keys",
                             "verify the paged port with q_len <= kv_len")
    if page_size <= 0 or page_size % 16:
        raise WorkbenchError(f"page_size {page_size} is not a positive multiple of 16", "pass 16, 32, 64, 128 ...")
    if queries not in ("all", "last"):
        raise WorkbenchError(f"queries = {queries!r}", 'pass "all" (a whole prefill, q at the first positions) or '
                             '"last" (q at the request\'s last positions: a chunk or a decode)')
    gen = torch.Generator().manual_seed(seed)
    pages = -(-lk // page_size)
    spare = 3
    order = torch.randperm(batch * pages + spare, generator=gen)  # logical page -> physical page
    num_pages = order.numel()

    def cache(x):  # [B, Hkv, Lk, D] -> [num_pages, page_size, Hkv, D], NaN in every slot unused
        laid = torch.full((num_pages, page_size, hkv, d), float("nan"), dtype=x.dtype, device=x.device)
        padded = torch.full((batch, pages * page_size, hkv, d), float("nan"), dtype=x.dtype, device=x.device)
        padded[:, :lk] = x.transpose(1, 2)  # (the last page's tail stays NaN)
        laid[order[:batch * pages].to(x.device)] = padded.reshape(batch * pages, page_size, hkv, d)
        return laid

    table = torch.full((batch, pages + 2), GARBAGE_PAGE, dtype=torch.int32)
    table[:, :pages] = order[:batch * pages].reshape(batch, pages).to(torch.int32)
    if queries == "all":
        rows = torch.randn(batch, hq, lk, d, generator=gen).to(q.dtype).to(q.device)
        rows[:, :, :lq] = q
    else:
        rows = q
    n_q = rows.shape[2]
    device = q.device
    return PagedStep(q=rows.transpose(1, 2).reshape(batch * n_q, hq, d).contiguous(), k_cache=cache(k),
                     v_cache=cache(v), block_table=table.to(device),
                     cu_seqlens_q=torch.arange(0, batch * n_q + 1, n_q, dtype=torch.int32, device=device),
                     seq_lens=torch.full((batch,), lk, dtype=torch.int32, device=device), q_len=lq)
