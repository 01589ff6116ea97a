"""Stage: analyze -- what a block scan says about a mask, as numbers.

All counts are summed over every batch entry and head the mask was scanned for (a mask that
does not depend on b / h counts the same for each)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import pandas as pd
import torch

from workbench.blocks import BlockScan

__all__ = ["MaskStats", "mask_stats"]

MAX_LISTED_ROWS = 32


@dataclass
class MaskStats:
    """Sparsity and hazards of one mask at one size and block size."""

    q_len: int
    kv_len: int
    q_block: int
    kv_block: int
    batch: int
    heads: int
    kept_pairs: int
    total_pairs: int
    density: float                  # kept pairs / all pairs
    full_blocks: int
    partial_blocks: int
    empty_blocks: int
    block_sparsity: float           # empty blocks / all blocks: what a block-sparse kernel skips
    head_dim: int
    kernel_flops: float             # forward FLOPs of a block-sparse kernel (visits full + partial blocks)
    kept_flops: float               # forward FLOPs of the kept pairs alone
    partial_waste: float            # 1 - kept_flops / kernel_flops: work spent on masked pairs
    fully_masked_rows: int          # query rows with no kept key (output 0 in FlexAttention, NaN elsewhere)
    fully_masked_row_examples: list = field(default_factory=list)  # [(b, h, q), ...], first few
    differs_across_heads: bool = False
    differs_across_batch: bool = False
    head_pairs_differing: list = field(default_factory=list)   # per head, pairs unlike head 0 (batch 0)
    batch_pairs_differing: list = field(default_factory=list)  # per batch entry, pairs unlike entry 0 (head 0)
    engine: str = ""
    evaluator: str = ""
    seconds: float = 0.0

    @property
    def block_size(self) -> int | tuple[int, int]:
        return self.q_block if self.q_block == self.kv_block else (self.q_block, self.kv_block)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["block_size"] = self.block_size
        d["fully_masked_row_examples"] = [list(map(int, r)) for r in self.fully_masked_row_examples]
        return d

    def to_frame(self) -> pd.DataFrame:
        """One row per statistic, readable in a notebook or the report."""
        rows = [
            ("size (Lq x Lk)", f"{self.q_len:,} x {self.kv_len:,}"),
            ("batch x heads", f"{self.batch} x {self.heads}"),
            ("block size", f"{self.q_block} x {self.kv_block}"),
            ("kept pairs", f"{self.kept_pairs:,} of {self.total_pairs:,}"),
            ("density", f"{self.density:.4%}"),
            ("blocks full / partial / empty", f"{self.full_blocks:,} / {self.partial_blocks:,} / {self.empty_blocks:,}"),
            ("block sparsity", f"{self.block_sparsity:.4%}"),
            (f"kernel FLOPs (D={self.head_dim})", f"{self.kernel_flops:.4g}"),
            ("kept-pair FLOPs", f"{self.kept_flops:.4g}"),
            ("wasted in partial blocks", f"{self.partial_waste:.2%}"),
            ("fully masked query rows", f"{self.fully_masked_rows:,}"
             + (f"  e.g. (b, h, q) {self.fully_masked_row_examples[:4]}" if self.fully_masked_rows else "")),
            ("differs across heads", _yes_no(self.differs_across_heads, self.head_pairs_differing)),
            ("differs across batch", _yes_no(self.differs_across_batch, self.batch_pairs_differing)),
        ]
        return pd.DataFrame(rows, columns=["statistic", "value"]).set_index("statistic")


def _yes_no(flag: bool, per: list) -> str:
    if not flag:
        return "no"
    return "yes: pairs unlike the first, per entry " + ", ".join(f"{n:,}" for n in per[:16])


def mask_stats(scan: BlockScan, head_dim: int = 128) -> MaskStats:
    """Statistics of a scanned mask. FLOPs count the forward pass: 4 * head_dim per pair (QK^T and PV)."""
    repeat = (scan.batch // (scan.batch if scan.depends_on_batch else 1)) * \
             (scan.heads // (scan.heads if scan.depends_on_head else 1))
    n_blocks = scan.batch * scan.heads * scan.block_rows * scan.block_cols
    full_n, partial_n, empty_n = (scan.full_blocks * repeat, scan.partial_blocks * repeat, scan.empty_blocks * repeat)
    kept = scan.kept_pairs * repeat
    total = scan.batch * scan.heads * scan.q_len * scan.kv_len
    kernel_flops = 4.0 * head_dim * (full_n + partial_n) * scan.q_block * scan.kv_block
    kept_flops = 4.0 * head_dim * kept
    empty_rows = scan.row_kept == 0
    n_empty_rows = int(empty_rows.sum()) * repeat
    examples = torch.nonzero(empty_rows)[:MAX_LISTED_ROWS].tolist() if n_empty_rows else []
    head_diff = scan.head_pairs_differing
    batch_diff = scan.batch_pairs_differing
    return MaskStats(
        q_len=scan.q_len, kv_len=scan.kv_len, q_block=scan.q_block, kv_block=scan.kv_block,
        batch=scan.batch, heads=scan.heads, kept_pairs=kept, total_pairs=total, density=kept / total,
        full_blocks=full_n, partial_blocks=partial_n, empty_blocks=empty_n,
        block_sparsity=empty_n / n_blocks, head_dim=head_dim, kernel_flops=kernel_flops, kept_flops=kept_flops,
        partial_waste=(1 - kept_flops / kernel_flops) if kernel_flops else 0.0,
        fully_masked_rows=n_empty_rows, fully_masked_row_examples=examples,
        differs_across_heads=bool(head_diff is not None and int(head_diff.sum()) > 0),
        differs_across_batch=bool(batch_diff is not None and int(batch_diff.sum()) > 0),
        head_pairs_differing=head_diff[0].tolist() if head_diff is not None else [],
        batch_pairs_differing=batch_diff[:, 0].tolist() if batch_diff is not None else [],
        engine=scan.engine, evaluator=scan.evaluator, seconds=scan.seconds,
    )
