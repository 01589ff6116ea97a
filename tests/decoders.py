"""Dense readings of each porting-spec section, written from the targets' documented semantics
(docs/porting.md), independently of workbench.porting. torch, whole matrices: test sizes only."""

import torch


def _ij(q_len, kv_len):
    return torch.arange(q_len)[:, None], torch.arange(kv_len)[None, :]


def flash_attn(s, q_len, kv_len):
    l, r = s["window_size"]
    if s["causal"]:
        r = 0
    c = s["attention_chunk"]
    cu_q = s["cu_seqlens_q"] or [0, q_len]
    cu_k = s["cu_seqlens_k"] or [0, kv_len]
    out = torch.zeros(q_len, kv_len, dtype=torch.bool)
    for seg in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[seg], cu_q[seg + 1], cu_k[seg], cu_k[seg + 1]
        i, j = _ij(q1 - q0, k1 - k0)
        shift = i + (k1 - k0) - (q1 - q0)
        keep = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)
        if l >= 0:
            keep &= j >= shift - l
        if r >= 0:
            keep &= j <= shift + r
        if c > 0:
            first = torch.div(shift, c, rounding_mode="floor") * c
            keep &= (first <= j) & (j < first + c)
        out[q0:q1, k0:k1] = keep
    return out


def vllm_triton(s, q_len, kv_len):
    i, j = _ij(q_len, kv_len)
    a = i + kv_len - q_len
    w = s["sliding_window"]
    if s["attn_type"] == "decoder":
        keep = j <= a
        if w is not None:
            keep = keep & (a - j < w)
        if s["rswa"]:
            keep = keep & ((j < s["rswa"]["prefix_len"]) | (a - j < s["rswa"]["window"]))
    else:
        keep = torch.ones(q_len, kv_len, dtype=torch.bool) if w is None else (a - j).abs() < w
    for lo, hi in s["mm_prefix_ranges"] or []:
        keep = keep | ((lo <= a) & (a <= hi) & (lo <= j) & (j <= hi))
    return keep


def magi(s, q_len, kv_len):
    out = torch.zeros(q_len, kv_len, dtype=torch.bool)
    for (q0, q1), (k0, k1), t in zip(s["q_ranges"], s["k_ranges"], s["attn_type_map"]):
        a, b = _ij(q1 - q0, k1 - k0)
        keep = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)
        if t in (1, 3):
            keep &= b <= a + (k1 - k0) - (q1 - q0)
        if t in (2, 3):
            keep &= b >= a
        out[q0:q1, k0:k1] |= keep
    return out


def flashmask(s, arr, q_len, kv_len):
    arr = torch.as_tensor(arr).long()
    i, j = _ij(q_len, kv_len)
    n = arr.shape[1]
    col = [arr[:, c][None, :] for c in range(n)]
    if s["causal"]:
        keep = j <= i
        if n == 1:
            return keep & (i < col[0])
        return keep & ~((col[0] <= i) & (i < col[1]))
    if n == 2:
        return (col[1] <= i) & (i < col[0])
    return ~((col[0] <= i) & (i < col[1])) & ~((col[2] <= i) & (i < col[3]))


def row_intervals(rows, q_len, kv_len):
    out = torch.zeros(q_len, kv_len, dtype=torch.bool)
    for n, row in enumerate(rows):
        for lo, hi in torch.as_tensor(row).reshape(-1, 2).tolist():
            out[n, lo:hi] = True
    return out


def block_sparse(s, q_len, kv_len, true_mask):
    """Listed full blocks kept whole, listed partial blocks apply the mask, others dropped."""
    out = torch.zeros(q_len, kv_len, dtype=torch.bool)
    indptr, indices, partial = (torch.as_tensor(s[k]).long() for k in ("indptr", "indices", "partial"))
    R, C = s["R"], s["C"]
    for br in range(len(indptr) - 1):
        for n in range(int(indptr[br]), int(indptr[br + 1])):
            q0, k0 = br * R, int(indices[n]) * C
            block = true_mask[q0:q0 + R, k0:k0 + C]
            out[q0:q0 + R, k0:k0 + C] = block if partial[n] else True
    return out
