"""The mask's fast copy for the port's Hopper kernels: the pair-by-pair Triton walk
(`triton_mask.TritonMaskEmitter`), except that a window check in an and of comparisons,

    (x >= lo) & (x < lo + k)        k a literal (a NATTEN / 2-D neighbourhood window),

is written as one unsigned compare of x - lo (`_in_range_gluon`), and two windows of the same k as
one compare of the larger offset (`_in_ranges_gluon`: a 2-D neighbourhood's row and column). In the
kernel each comparison of a pair costs a compare and a select on every partially kept tile; the
2-D neighbourhood's four became a subtraction per axis, a max, one compare and one select (sm_90a,
`nvdisasm`: 6,200 instructions in the ping-pong forward, 5,384 with the fold).

Exact for every int32 value, with no condition on signs: x - lo is taken modulo 2^32, and a row
whose lo + k wraps past 2^31 - 1 (where `x < lo + k`, computed in int32 as the mask writes it, keeps
nothing) compares against 0. Other integer types keep the two compares (`_in_range_gluon` picks by
dtype when the kernel is compiled). The port's portable kernel, the block scan and the reference
keep the mask as written; the Gluon copy keeps the same pairs.

The text is Triton-spelled like the rest of the walk; the port turns it into Gluon and adds
RANGE_HELPERS (`workbench.port.generate`).
"""

from __future__ import annotations

import torch

from workbench.define import captured_tensors, trace_mod
from workbench.translate.triton_mask import TritonMaskEmitter, window_of

__all__ = ["FastMaskEmitter", "translate_fast_mask", "RANGE_HELPERS"]

_INT32_MAX = 2 ** 31 - 1

# Gluon; K is a literal (constexpr). The int32 test is decided when the kernel is compiled.
RANGE_HELPERS = '''@gluon.jit
def _in_range_gluon(x, lo, K: gl.constexpr):
    # lo <= x < lo + K, as the mask computes it in int32 (nothing kept where lo + K wraps), as one
    # unsigned compare of x - lo (mod 2^32); other integer types: the two compares as written
    if x.dtype == gl.int32 and lo.dtype == gl.int32:
        k = gl.where(lo <= 2147483647 - K, K, 0).to(gl.uint32, bitcast=True)
        return (x - lo).to(gl.uint32, bitcast=True) < k
    else:
        return (x >= lo) & (x < lo + K)


@gluon.jit
def _in_ranges_gluon(x1, lo1, x2, lo2, K: gl.constexpr):
    # _in_range_gluon(x1, lo1, K) & _in_range_gluon(x2, lo2, K): in int32, one compare of the larger
    # unsigned offset (a 2-D window's row and column)
    if x1.dtype == gl.int32 and lo1.dtype == gl.int32 and x2.dtype == gl.int32 and lo2.dtype == gl.int32:
        k = gl.where((lo1 <= 2147483647 - K) & (lo2 <= 2147483647 - K), K, 0).to(gl.uint32, bitcast=True)
        return gl.maximum((x1 - lo1).to(gl.uint32, bitcast=True), (x2 - lo2).to(gl.uint32, bitcast=True)) < k
    else:
        return _in_range_gluon(x1, lo1, K) & _in_range_gluon(x2, lo2, K)
'''


class FastMaskEmitter(TritonMaskEmitter):
    """TritonMaskEmitter with window checks folded (module docstring)."""

    def call(self, op, node):
        if op in ("bitwise_and", "logical_and") and len(node.args) == 2 and \
                getattr(node.meta.get("val"), "dtype", None) == torch.bool:
            folded = self._windows(node)
            if folded is not None:
                self.lines.append(f"    v_{node.name} = {folded}")
                return f"v_{node.name}"
        return super().call(op, node)

    def _windows(self, node) -> str | None:
        """The and at `node` with its windows folded, or None when it has none (fold_and)."""

        def spell(lower, upper):
            window = window_of(lower, upper)
            if window is None:
                return None
            x, lo, k = window
            x_text, lo_text = self.value(x), self.value(lo)
            if not (isinstance(x_text, str) and isinstance(lo_text, str)) or k > _INT32_MAX:
                return None
            return x_text, lo_text, k

        def merge(windows):  # two windows of one k: one compare
            by_k: dict[int, list] = {}
            for window in windows:
                by_k.setdefault(window[2], []).append(window)
            for k, same_k in by_k.items():
                for (x1, lo1, _), (x2, lo2, _) in zip(same_k[0::2], same_k[1::2]):
                    yield f"_in_ranges_gluon({x1}, {lo1}, {x2}, {lo2}, {k})"
                if len(same_k) % 2:
                    x, lo, _ = same_k[-1]
                    yield f"_in_range_gluon({x}, {lo}, {k})"

        return self.fold_and(node, spell, merge)


def translate_fast_mask(mask, lifted: frozenset = frozenset()) -> tuple[str, list[str]]:
    """`mask_mod_triton` written by FastMaskEmitter: (source, pointer argument names), the same
    pointers as the plain translation's. Raises Untranslatable as translate_mod does."""
    gm = trace_mod(mask.mask_mod, "mask")
    emitter = FastMaskEmitter(gm, ["b", "h", "q_idx", "kv_idx"], dict(captured_tensors(mask)), lifted)
    emitter.walk()
    return emitter.function("mask_mod_triton", ["b", "h", "q_idx", "kv_idx"] + emitter.pointers), emitter.pointers
