"""Every library pattern against an independent formula written here with numpy loops-free
broadcasting over (query position, key) grids -- not the library's code."""

import math

import numpy as np
import pytest
import torch

from workbench import make, with_score
from workbench.blocks import dense_mask
from workbench.look import score_values

# (q_len, kv_len): a multiple of 128, odd lengths, Lq != Lk.
SIZES = [(256, 256), (203, 203), (77, 301), (130, 130)]


def grids(q_len, kv_len):
    """Query positions (bottom-right: the last q_len tokens) and key indices, as [Lq, Lk] grids."""
    p = np.arange(q_len)[:, None] + (kv_len - q_len)
    j = np.arange(kv_len)[None, :]
    return p, j


def doc_ids(lengths):
    return np.repeat(np.arange(len(lengths)), lengths)


def expected(name, params, q_len, kv_len, h=0):
    p, j = grids(q_len, kv_len)
    L = kv_len
    if name == "full":
        return np.ones((q_len, kv_len), bool)
    if name == "causal":
        if params.get("align") == "top_left":
            return np.arange(q_len)[:, None] >= j
        return j <= p
    if name == "sliding_window":
        return (j >= p - params["left"]) & (j <= p + params["right"])
    if name == "causal_sliding_window":
        return (p - j >= 0) & (p - j < params["window"])
    if name == "prefix_lm":
        return (j < params["prefix_len"]) | (j <= p)
    if name == "document":
        lengths = params.get("doc_lengths")
        if lengths is None:
            cuts = [round(L * f) for f in np.cumsum([0, .1, .3, .15, .25, .2])]
            lengths = [b - a for a, b in zip(cuts, cuts[1:]) if b > a]
        ids = doc_ids(lengths)
        same = ids[p] == ids[j]
        return same & (j <= p) if params.get("causal", True) else same
    if name == "chunked_local":
        c = params["chunk"]
        return (p // c == j // c) & (j <= p)
    if name in ("sinks_window", "rswa"):
        s = params.get("sinks", params.get("prefix_len"))
        return (j <= p) & ((j < s) | (p - j < params["window"]))
    if name == "longformer":
        g, w = params["global_tokens"], params["window"]
        return (np.abs(p - j) <= w) | (j < g) | (p < g)
    if name == "dilated_window":
        d = p - j
        return (d >= 0) & (d < params["window"] * params["dilation"]) & (d % params["dilation"] == 0)
    if name == "image_spans":
        keep = j <= p
        for s, e in params["spans"]:
            keep |= (s <= p) & (p <= e) & (s <= j) & (j <= e)
        return keep
    if name == "neighborhood_2d":
        width = params.get("width") or math.isqrt(L - 1) + 1
        height = -(-L // width)
        k = params["kernel"]
        out = np.zeros((q_len, kv_len), bool)
        for qi in range(q_len):  # loops: NATTEN's rule written out directly
            pos = qi + kv_len - q_len
            r, c = divmod(pos, width)
            r0 = min(max(r - k // 2, 0), height - k)
            c0 = min(max(c - k // 2, 0), width - k)
            for r2 in range(r0, r0 + k):
                for c2 in range(c0, c0 + k):
                    t = r2 * width + c2
                    if t < kv_len:
                        out[qi, t] = True
        return out
    if name == "block_diffusion":
        return j // params["block"] <= p // params["block"]
    if name == "tree":
        parents = params["parents"]
        T = len(parents)
        ctx = L - T
        out = (j < ctx) & (j <= p)
        for qi in range(q_len):
            node = qi + kv_len - q_len - ctx
            while node >= 0:  # walk up to the root
                out[qi, ctx + node] = True
                node = parents[node]
        return out
    if name == "per_head_window":
        w = params["windows"][h]
        return (p - j >= 0) & (p - j < w)
    raise KeyError(name)


CASES = [
    ("full", {}), ("causal", {}), ("causal", {"align": "top_left"}),
    ("sliding_window", {"left": 17, "right": 5}), ("causal_sliding_window", {"window": 33}),
    ("prefix_lm", {"prefix_len": 40}), ("document", {}), ("document", {"causal": False}),
    ("chunked_local", {"chunk": 48}), ("sinks_window", {"sinks": 3, "window": 20}),
    ("rswa", {"prefix_len": 25, "window": 16}), ("longformer", {"global_tokens": 5, "window": 9}),
    ("dilated_window", {"window": 6, "dilation": 3}), ("block_diffusion", {"block": 32}),
    ("neighborhood_2d", {"kernel": 5}), ("neighborhood_2d", {"kernel": 3, "width": 9}),
    ("tree", {"parents": [-1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]}),
    ("tree", {"parents": [-1, 0, 1, 1, -1, 4, 5]}),
    ("per_head_window", {"windows": [3, 17, 64]}),
]


@pytest.mark.parametrize("q_len,kv_len", SIZES)
@pytest.mark.parametrize("name,params", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_mask_matches_formula(name, params, q_len, kv_len):
    mask = make(name, params, q_len=q_len, kv_len=kv_len)
    heads = len(params["windows"]) if name == "per_head_window" else 1
    got = dense_mask(mask, (0, q_len), (0, kv_len), heads=heads).numpy()
    for h in range(heads):
        want = expected(name, params, q_len, kv_len, h)
        assert want.any(), "formula keeps nothing: the test would prove little"
        np.testing.assert_array_equal(got[0, h], want, err_msg=f"{name} head {h}")


@pytest.mark.parametrize("q_len,kv_len", [(203, 203), (64, 300)])
def test_image_spans_matches_formula(q_len, kv_len):
    spans = [[10, 40], [100, 150], [200, 202]]
    mask = make("image_spans", {"spans": spans}, q_len=q_len, kv_len=kv_len)
    got = dense_mask(mask, (0, q_len), (0, kv_len))[0, 0].numpy()
    np.testing.assert_array_equal(got, expected("image_spans", {"spans": spans}, q_len, kv_len))


def test_image_spans_default_spans_inside_sequence():
    mask = make("image_spans", q_len=1000, kv_len=1000)
    assert mask.params["spans"] == [[100, 349], [550, 699]]


def test_document_explicit_lengths():
    mask = make("document", {"doc_lengths": [50, 100, 53]}, q_len=203, kv_len=203)
    got = dense_mask(mask, (0, 203), (0, 203))[0, 0].numpy()
    np.testing.assert_array_equal(got, expected("document", {"doc_lengths": [50, 100, 53]}, 203, 203))


# ---------------------------------------------------------------- score mods

def score_formula(name, params, q_len, kv_len, h):
    p, j = grids(q_len, kv_len)
    if name == "softcap":
        return np.zeros((q_len, kv_len))  # cap * tanh(0 / cap) == 0
    if name == "alibi":
        H = params["num_heads"]
        slope = 2.0 ** (-8.0 * (h + 1) / H)
        return -slope * np.abs(p - j)
    if name == "relative_bias":
        M = params["max_distance"]
        table = torch.randn(2 * M + 1, generator=torch.Generator().manual_seed(params["seed"])).numpy()
        return table[np.clip(p - j, -M, M) + M]
    if name == "head_bias":
        return np.full((q_len, kv_len), params["biases"][h])
    raise KeyError(name)


@pytest.mark.parametrize("q_len,kv_len", [(70, 70), (33, 90)])
@pytest.mark.parametrize("name,params,h", [
    ("alibi", {"num_heads": 8}, 0), ("alibi", {"num_heads": 8}, 5), ("alibi", {"num_heads": 4}, 3),
    ("relative_bias", {"max_distance": 12, "seed": 3}, 0), ("head_bias", {"biases": [0.5, -2.0, 3.25]}, 1),
    ("softcap", {"cap": 20.0}, 0),
])
def test_score_mod_matches_formula(name, params, h, q_len, kv_len):
    mask = with_score(make("full"), make(name, params, q_len=q_len, kv_len=kv_len))
    got = score_values(mask, (0, q_len), (0, kv_len), h=h).double().numpy()
    np.testing.assert_allclose(got, score_formula(name, params, q_len, kv_len, h), rtol=1e-6, atol=1e-6)


def test_softcap_on_large_scores():
    mask = make("softcap", {"cap": 5.0})
    s = torch.linspace(-100, 100, 41).view(1, 1, 1, -1)
    out = mask.score_mod(s, 0, 0, 0, 0)
    np.testing.assert_allclose(out.numpy(), 5.0 * np.tanh(s.numpy() / 5.0), rtol=1e-6)
    assert out.abs().max() <= 5.0  # tanh saturates to exactly 1 in float32


def test_every_library_pattern_has_a_test():
    from workbench import library

    tested = {n for n, _ in CASES} | {"image_spans", "softcap", "alibi", "relative_bias", "head_bias"}
    assert set(library()) <= tested, set(library()) - tested


def test_library_factories_document_their_origin():
    from workbench import library

    for name, factory in library().items():
        mask = make(factory)
        assert factory.__doc__ and len(factory.__doc__) > 60, name
        assert mask.source.strip().startswith("def "), name
        assert mask.name.startswith(name.split("_")[0][:4]) or name in ("sinks_window",), (name, mask.name)
