import torch

from workbench import Mask
from masks._positions import query_offset, sequence_length

# A 15-node binary draft tree: node n's parent is (n - 1) // 2.
DEFAULT_PARENTS = [-1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]


def tree(parents: list[int] | None = None, q_len=None, kv_len=None, device=None) -> Mask:
    """Tree attention for speculative decoding (SpecInfer, Medusa, EAGLE): the last T tokens are
    a draft tree given by `parents` (parents[n] < n, -1 for a root); a tree token sees the
    context before the tree, itself and its ancestors. Earlier tokens are causal context."""
    parents = list(DEFAULT_PARENTS if parents is None else parents)
    size = len(parents)
    for n, p in enumerate(parents):
        if not -1 <= p < n:
            raise ValueError(f"parents[{n}] = {p}: each parent must be -1 (root) or an earlier node")
    length = sequence_length(q_len, kv_len, size)
    if length < size:
        raise ValueError(f"the tree has {size} nodes but the sequence only {length} tokens")
    context = length - size
    ancestor = torch.eye(size, dtype=torch.bool)
    for n, p in enumerate(parents):
        if p >= 0:
            ancestor[n] |= ancestor[p]
    ancestor = ancestor.to(device or "cpu")
    offset = query_offset(q_len, kv_len)

    def tree_mask(b, h, q_idx, kv_idx):
        pos = q_idx + offset
        in_context = (kv_idx < context) & (kv_idx <= pos)
        q_node = (pos - context).clamp(min=0)
        kv_node = (kv_idx - context).clamp(min=0)
        in_tree = (pos >= context) & (kv_idx >= context) & ancestor[q_node, kv_node]
        return in_context | in_tree

    return Mask(name=f"tree_{size}nodes", mask_mod=tree_mask, params=dict(parents=parents),
                description=tree.__doc__, data=dict(ancestor=ancestor), q_len=q_len, kv_len=kv_len)
