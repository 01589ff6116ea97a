"""mask_mod_bounds (workbench.translate): over a box of pairs, `all` = 1 only where every pair is kept and
`any` = 0 only where none is -- checked pair by pair against the eager mod on the library and
on mods written the way users write them -- and it does decide the boxes it should (else the
block scan gains nothing from it). Runs the generated Triton under the CPU interpreter."""

import pytest
import torch

from workbench import Mask, library, make
from workbench.define import choose_evaluator, evaluate_mod, index_reads
from workbench.translate import generate, run_bounds

from user_mods import USER_MODS, combined, per_head_table, scrambled_table, wraps_in_int32

L = 300


def boxes(seed: int) -> torch.Tensor:
    """Random boxes of every size inside L x L, and a 32 x 32 block grid with its edges."""
    g = torch.Generator().manual_seed(seed)
    lo = torch.randint(0, L, (120, 2), generator=g)
    size = torch.randint(0, 90, (120, 2), generator=g)
    hi = torch.minimum(lo + size, torch.tensor(L - 1))
    rand = torch.stack([lo[:, 0], hi[:, 0], lo[:, 1], hi[:, 1]], 1)
    edges = torch.arange(0, L, 32)
    grid = torch.tensor([[q, min(q + 31, L - 1), k, min(k + 31, L - 1)] for q in edges for k in edges])
    return torch.cat([rand, grid])


def dense(mask: Mask, batch: int, heads: int) -> torch.Tensor:
    how = choose_evaluator(mask.mask_mod, L, L, batch, heads, "cpu").how
    ar = lambda n: torch.arange(n, dtype=torch.int32)  # noqa: E731
    return evaluate_mod(mask.mask_mod, how, ar(batch), ar(heads), ar(L), ar(L)).to(torch.bool).expand(batch, heads, L, L)


def check_sound(mask: Mask, batch: int, heads: int, seed: int = 0) -> torch.Tensor:
    """Bounds of every box for each (b, h), checked against the eager mod; returns them [B, H, n, 2]."""
    src, ptrs, _, captured = generate(mask, bounds=True)
    keep = dense(mask, batch, heads)
    bx = boxes(seed)
    got = torch.stack([torch.stack([run_bounds(src, b, h, bx, [captured[p[:-4]] for p in ptrs], device="cpu")
                                    for h in range(heads)]) for b in range(batch)])
    for b in range(batch):
        for h in range(heads):
            for (q0, q1, k0, k1), (all_kept, any_kept) in zip(bx.tolist(), got[b, h].tolist()):
                pairs = keep[b, h, q0:q1 + 1, k0:k1 + 1]
                assert all_kept in (0, 1) and any_kept in (0, 1) and all_kept <= any_kept
                assert not all_kept or bool(pairs.all()), f"{mask.name} b={b} h={h} box {q0, q1, k0, k1}: all?"
                assert any_kept or not bool(pairs.any()), f"{mask.name} b={b} h={h} box {q0, q1, k0, k1}: none?"
    return got


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("mod", USER_MODS, ids=lambda m: m.__name__)
def test_bounds_are_sound_on_mods_written_the_way_users_write_them(mod):
    reads = index_reads(mod)
    check_sound(Mask(mod.__name__, mask_mod=mod), 2 if "b" in reads else 1, 4 if "h" in reads else 1)


def test_bounds_are_sound_on_the_library():
    for name in sorted(library()):
        mask = make(name, q_len=L, kv_len=L)
        if mask.mask_mod is None:  # a score_mod only
            continue
        reads = index_reads(mask.mask_mod)
        heads = min(mask.heads or 2, 2) if "h" in reads else 1
        check_sound(mask, 2 if "b" in reads else 1, heads, seed=len(name))


def test_bounds_decide_the_blocks_a_reader_can_decide():
    """Causal: every 32-block off the diagonal is decided (full below, empty above); a window:
    the blocks past it are empty; int32 wrap-around and a table read at q_idx are not decided."""
    bx = boxes(0)
    grid = bx[120:]
    causal = check_sound(make("causal", q_len=L, kv_len=L), 1, 1)[0, 0, 120:]
    below, above = grid[:, 0] > grid[:, 3], grid[:, 1] < grid[:, 2]
    assert causal[below].tolist() == [[1, 1]] * int(below.sum())
    assert causal[above].tolist() == [[0, 0]] * int(above.sum())
    assert (causal[~below & ~above] == torch.tensor([0, 1])).all()  # the diagonal blocks: evaluated pair by pair
    window = check_sound(make("causal_sliding_window", {"window": 40}, q_len=L, kv_len=L), 1, 1)[0, 0, 120:]
    far = grid[:, 0] - grid[:, 3] >= 40
    assert far.sum() > 20 and window[far].tolist() == [[0, 0]] * int(far.sum())
    per_head = check_sound(Mask("w", mask_mod=per_head_table), 1, 4)[0, :, 120:]
    assert (per_head[:, above] == 0).all()  # w[h] is read at an exact index: decided
    both = check_sound(Mask("and_or", mask_mod=combined()), 1, 4)[0, :, 120:]
    assert (both[:, above] == 0).all()  # and_masks with a causal part: decided above the diagonal
    wraps = check_sound(Mask("wraps", mask_mod=wraps_in_int32), 1, 1)[0, 0]
    big = bx[:, 1] * 10_000_000 >= 2 ** 31
    assert big.any() and (wraps[big] == torch.tensor([0, 1])).all()
    doc = check_sound(make("document", {"doc_lengths": [70, 130, 100]}, q_len=L, kv_len=L), 1, 1)[0, 0, 120:]
    assert doc[above].tolist() == [[0, 0]] * int(above.sum())
    # its sorted document table bounds doc[q] over a block: blocks below the diagonal inside one
    # document are full, those across two documents empty; only blocks on a boundary are left
    inside = [(q0 >= 70 and q1 < 200 and k0 >= 70) or (q0 >= 200 and k0 >= 200) or q1 < 70 for q0, q1, k0, k1 in
              grid.tolist()]
    for (all_kept, any_kept), full, low in zip(doc.tolist(), inside, below.tolist()):
        if low and full:
            assert (all_kept, any_kept) == (1, 1)
    across = [(q0 >= 200 and k1 < 200) or (q0 >= 70 and k1 < 70) for q0, q1, k0, k1 in grid.tolist()]
    assert all(tuple(d) == (0, 0) for d, x in zip(doc.tolist(), across) if x) and any(across)
    scrambled = check_sound(Mask("scrambled", mask_mod=scrambled_table), 1, 1)[0, 0, 120:]
    assert scrambled[above].tolist() == [[0, 0]] * int(above.sum())  # q >= kv decides; the table's range does not


def _random_mod(seed: int):
    """A random mask_mod over q_idx, kv_idx, b, h: integer arithmetic (with floor division and
    modulo by either sign, products large enough to wrap int32), comparisons, boolean logic and
    where -- the rules of mask_mod_bounds all meet here."""
    import random

    rng = random.Random(seed)

    def integer(depth):
        if depth == 0 or rng.random() < 0.25:
            return rng.choice([lambda a: a["q"], lambda a: a["kv"], lambda a: a["b"], lambda a: a["h"],
                               (lambda c: lambda a: a["q"] * 0 + c)(rng.randint(-40, 320))])
        x, y = integer(depth - 1), integer(depth - 1)
        c = rng.choice([rng.randint(1, 70), -rng.randint(1, 9), 3_000_000])
        d = rng.choice([rng.randint(1, 70), -rng.randint(1, 9)])
        return rng.choice([
            lambda a: x(a) + y(a), lambda a: x(a) - y(a), lambda a: x(a) * c, lambda a: x(a) * y(a),
            lambda a: x(a) // d, lambda a: x(a) % d, lambda a: torch.minimum(x(a), y(a)),
            lambda a: torch.maximum(x(a), y(a)), lambda a: x(a).abs(), lambda a: -x(a),
            lambda a: torch.clamp(x(a), min=rng_min, max=rng_min + 90),
            (lambda p: lambda a: torch.where(p(a), x(a), y(a)))(boolean(0))])

    def boolean(depth):
        if depth == 0 or rng.random() < 0.3:
            x, y = integer(max(depth, 1)), integer(max(depth - 1, 0))
            k = rng.randint(-3, 3)  # (small numbers: the edges of intervals that cross zero)
            return rng.choice([lambda a: x(a) >= y(a), lambda a: x(a) > y(a), lambda a: x(a) <= y(a),
                               lambda a: x(a) < y(a), lambda a: x(a) == y(a), lambda a: x(a) != y(a),
                               lambda a: x(a) <= k, lambda a: x(a) == k, lambda a: x(a) > k])
        p, r = boolean(depth - 1), boolean(depth - 1)
        return rng.choice([lambda a: p(a) & r(a), lambda a: p(a) | r(a), lambda a: ~p(a), lambda a: p(a) ^ r(a),
                           lambda a: torch.where(p(a), r(a), ~r(a))])

    rng_min = rng.randint(-20, 200)
    expr = boolean(3)

    def random_mod(b, h, q_idx, kv_idx):
        return expr({"b": b, "h": h, "q": q_idx, "kv": kv_idx})
    return random_mod


@pytest.mark.parametrize("seeds", [range(4), pytest.param(range(4, 12), marks=pytest.mark.slow)],
                         ids=["first_4", "next_8"])
def test_bounds_are_sound_on_random_mods(seeds):
    """Twelve random mods (see _random_mod; `make test` draws the first four, `make test-slow` the
    rest), each checked box by box against its eager values; a share of the boxes must be decided,
    or the rules would be sound only by giving up."""
    decided = total = 0
    for seed in seeds:
        mod = _random_mod(seed)
        got = check_sound(Mask(f"random_{seed}", mask_mod=mod), 1, 2, seed=seed)
        decided += int((got[..., 0] == got[..., 1]).sum())
        total += got[..., 0].numel()
    print(f"decided {decided} of {total} boxes")
    assert decided > total // 4, (decided, total)
