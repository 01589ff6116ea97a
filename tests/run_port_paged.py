"""attention_paged: one engine step (prefill chunks and decodes) over a paged KV cache, against the
float64 reference of each request. Usage:

    TRITON_INTERPRET=1 python tests/run_port_paged.py cpu [SEED] [corpus]
    python tests/run_port_paged.py cuda [SEED] [corpus]

For each case (a mask, a dtype, a page size) a random step is drawn: requests with other query
counts (decodes of 1, chunks of a few to ~100) and contexts, pages shuffled across the cache, NaN
in every cache slot that holds none of the step's keys, and garbage in the block table past each
request's pages. Request r's rows must equal the reference of
the mask seen from the request: b = r, q_idx = its positions seq_len - n_q + i, kv_idx = 0 ..
seq_len - 1. Page size 16 runs split-KV (pieces of SPLIT_KEYS keys folded by a second kernel),
the others one piece. `corpus`: every mod of the test corpus instead (corpus_cases), one step each.
PAGED_ONLY=a,b runs only the cases whose id holds a or b. Prints `CASE <id> OK|FAIL detail` per case (ids: `case_ids`), then a SUMMARY line."""

import os
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench import Mask, make, port, with_score  # noqa: E402
from workbench.define.lengths import rebuild, rebuildable  # noqa: E402
from workbench.run import Inputs, Shape  # noqa: E402
from workbench.verify import LSE_TOLERANCE, TOLERANCES, compare, reference_attention  # noqa: E402

W = torch.tensor([8, 40, 300, 1000])  # a user's per-head windows


def head_window(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx < W[h])


LENS = torch.tensor([50, 120, 500])  # a user's per-request lengths (the step's requests read lens[b])


def per_request_prefix(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) | (kv_idx < LENS[b])


W6 = torch.tensor([8, 40, 300, 1000, 3, 64])  # six heads' windows (three query heads per kv head)


def head_window6(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx < W6[h])


STARTS, ENDS = torch.tensor([100, 600, 1300]), torch.tensor([399, 899, 1699])  # a user's image spans


def spans_any(b, h, q_idx, kv_idx):  # spans with .any(): a query inside a span sees all of it
    inside = (q_idx >= STARTS) & (q_idx <= ENDS) & (kv_idx >= STARTS) & (kv_idx <= ENDS)
    return inside.any() | (kv_idx <= q_idx)


REL = torch.linspace(-1.0, 1.0, 4 * 16).reshape(4, 16)  # a user's per-head relative-position table


def relative_table(score, b, h, q_idx, kv_idx):  # read inside the table at every position: any length
    return score + REL[h, (q_idx - kv_idx).clamp(-8, 7) + 8]


def t5_bucket(score, b, h, q_idx, kv_idx):  # T5's bidirectional bucket as Hugging Face writes it
    rp = kv_idx - q_idx
    n = rp.abs()
    large = torch.minimum(4 + (torch.log(n.float() / 4) / 2.772588722239781 * 4).to(torch.int64),
                          torch.full_like(n, 7, dtype=torch.int64))
    return score + REL[h, (rp > 0).to(torch.int64) * 8 + torch.where(n < 4, n, large)]


def masks():
    """(name, mask, heads[, kv_heads]): library masks, score mods, users' mods; kv heads half the
    query heads unless given (GQA groups of 1, 2, 3 and 32 query heads per kv head)."""
    out = [(n, make(n), 4) for n in ("causal", "sinks_window", "prefix_lm", "dilated_window", "chunked_local")]
    out.append(("causal_sliding_window_50", make("causal_sliding_window", {"window": 50}), 4))
    out.append(("causal+alibi", with_score(make("causal"), make("alibi", {"num_heads": 4})), 4))
    out.append(("rswa+softcap", with_score(make("rswa", {"prefix_len": 16, "window": 64}), make("softcap")), 4))
    out.append(("full", make("full"), 2))
    out.append(("users_head_window", Mask("users_head_window", mask_mod=head_window), 4))
    out.append(("users_per_request_prefix", Mask("users_per_request_prefix", mask_mod=per_request_prefix), 2))
    out.append(("users_head_window_gqa3", Mask("users_head_window_gqa3", mask_mod=head_window6), 6, 2))
    out.append(("causal_mha", make("causal"), 3, 3))
    out.append(("sinks_window_mqa32", make("sinks_window"), 32, 1))
    # tables read inside their bounds: the port holds past the 256 tokens it is generated at
    # (requests of up to 500 here)
    out.append(("users_relative_table", with_score(make("causal"), Mask("relative_table", score_mod=relative_table)), 4))
    out.append(("users_t5_bucket", Mask("users_t5_bucket", score_mod=t5_bucket), 4))
    return out


# cases with 32-key tiles (the `-n32` ids): the kernel addresses a tile's keys three ways, by how
# the page size and the key tile divide (one page per tile; whole pages per tile; neither, each key
# its own page and slot); the interpreter's own 16-key tiles meet only the first
WIDE_KEY_TILE = (16, 32, 4, 1)
WIDE_KEY_MASKS = ("causal", "users_head_window", "rswa+softcap")
# cases whose caches are allocated [pages, Hkv, page, D] (each head's keys of a page in one run, as
# FlashInfer's HND layout) and passed as the [pages, page, Hkv, D] view the call takes: the kernel
# reads every cache through its strides
HEAD_MAJOR_MASKS = ("causal", "users_head_window_gqa3")


def cases():
    for name, mask, heads, *kv in masks():
        for dtype, page in (("float32", 16), ("float32", 64)) + ((("bfloat16", 32),) if name == "causal" else ()):
            yield f"{name}-{dtype}-p{page}", mask, heads, (kv[0] if kv else heads // 2), dtype, page
        if name in WIDE_KEY_MASKS:
            for page in (16, 48, 64):  # whole pages per tile; neither divides; one page per tile
                yield f"{name}-float32-p{page}-n32", mask, heads, (kv[0] if kv else heads // 2), "float32", page
        if name in HEAD_MAJOR_MASKS:  # caches allocated head-major, passed as [pages, page, Hkv, D] views
            for page in (16, 64):
                yield f"{name}-float32-p{page}-hnd", mask, heads, (kv[0] if kv else heads // 2), "float32", page


def case_ids():
    return [c[0] for c in cases()]


def corpus_cases():
    """Every mod of the test corpus (the library at 96 tokens, user-style and attention-gym-style
    mods: per-head and per-sample tables, spans with .any(), documents, and_masks / or_masks),
    float32, page 16: (id, mask, heads, kv_heads, batch, length). Requests stay within `length`
    (a per-token table's positions stop there)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from mod_corpus import LENGTH, corpus

    for n, (mask, batch, heads) in enumerate(corpus()):
        yield (f"corpus{n}-{mask.name}".replace(" ", ""), mask, heads, 1 if heads % 2 else heads // 2 or 1, batch,
               mask.q_len or LENGTH)


def draw_step(rng: random.Random, num_seqs: int, page: int, heads: int, kv_heads: int, d: int, dtype,
              longest: int | None = None):
    """q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens and each request's (n_q, seq_len)
    (seq_len at most `longest` when given)."""
    reqs = []
    for _ in range(num_seqs):
        n_q = rng.choice([1, 1, rng.randint(2, 40), rng.randint(40, 100)])
        length = n_q + rng.choice([0, rng.randint(0, 60), rng.randint(60, 400)])
        if longest is not None:
            length = rng.randint(1, longest)
            n_q = min(n_q, length)
        reqs.append((n_q, length))
    pages_of = [-(-length // page) for _, length in reqs]
    max_pages = max(pages_of) + 2
    physical = list(range(sum(pages_of) + 3))  # a few unused pages too
    rng.shuffle(physical)
    table = torch.full((num_seqs, max_pages), 10**6, dtype=torch.int32)  # garbage past each request's pages
    it = iter(physical)
    for r, n in enumerate(pages_of):
        table[r, :n] = torch.tensor([next(it) for _ in range(n)], dtype=torch.int32)
    gen = torch.Generator().manual_seed(rng.randint(0, 10**6))
    total_q = sum(n for n, _ in reqs)
    q = torch.randn(total_q, heads, d, generator=gen).to(dtype)
    k_cache = torch.randn(len(physical), page, kv_heads, d, generator=gen).to(dtype)
    v_cache = torch.randn(len(physical), page, kv_heads, d, generator=gen).to(dtype)
    poison_unused(k_cache, v_cache, table, reqs)
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor([n for n, _ in reqs]), 0)), dtype=torch.int32)
    lens = torch.tensor([length for _, length in reqs], dtype=torch.int32)
    return q, k_cache, v_cache, table, cu, lens, reqs


def poison_unused(k_cache, v_cache, table, reqs):
    """NaN in every slot of the caches that holds none of the step's keys (the pages no request
    names, and each request's last page past its end), as an engine's cache may hold there: a
    kernel that multiplies them by a zero weight, instead of never reading them, gives NaN rows."""
    page = k_cache.shape[1]
    used = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for r, (_, length) in enumerate(reqs):
        idx = torch.arange(length)
        used[table[r, idx // page].long(), idx % page] = True
    for cache in (k_cache, v_cache):
        cache[~used] = float("nan")


def request_view(mask: Mask, r: int, n_q: int, length: int, fixed: bool = False) -> Mask:
    """The mask seen from request r of a step, as a contiguous call of its n_q queries against its
    `length` keys: b -> r, q_idx -> its positions (length - n_q + i). `fixed`: the port holds at
    its generated lengths only (per-token data), so a request sees the mask as it was made, not
    rebuilt at the request's length."""
    base = rebuild(mask, length, length) if rebuildable(mask) and not fixed else mask
    off = length - n_q

    def mask_mod(b, h, q_idx, kv_idx, _m=base.mask_mod):
        return _m(b + r, h, q_idx + off, kv_idx)

    def score_mod(score, b, h, q_idx, kv_idx, _s=base.score_mod):
        return _s(score, b + r, h, q_idx + off, kv_idx)

    return Mask(f"{mask.name}@request{r}", mask_mod=mask_mod if base.mask_mod else None,
                score_mod=score_mod if base.score_mod else None)


def gather(cache, table_row, length):
    """A request's keys in order, read through its block table: [Hkv, length, D]."""
    page = cache.shape[1]
    idx = torch.arange(length)
    return cache[table_row[idx // page].long(), idx % page].permute(1, 0, 2)


def check(case, mask, heads, kv_heads, dtype, page, device, folder, rng, batch=None, length=None) -> str | None:
    real = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    # a corpus mod defined for one batch entry is served as 2-4 requests; one with per-sample
    # tables as one request per entry
    num_seqs = (batch if batch > 1 else rng.randint(2, 4)) if batch else (3 if "per_request" in case
                                                                          else rng.randint(2, 5))
    q, kc, vc, table, cu, lens, reqs = draw_step(rng, num_seqs, page, heads, kv_heads, 16, real, longest=length)
    source = port.generate(mask, length or 256, length or 256, heads=heads, batch=num_seqs)
    if case.startswith(("users_relative_table", "users_t5_bucket")):
        if source.valid_q_len is not None:
            return f"the port holds at its lengths only ({source.valid_for()})"
        q, kc, vc, table, cu, lens, reqs = draw_step(rng, num_seqs, page, heads, kv_heads, 16, real)
        while max(length for _, length in reqs) <= 256:  # (a request past the port's lengths)
            q, kc, vc, table, cu, lens, reqs = draw_step(rng, num_seqs, page, heads, kv_heads, 16, real)
    module = port.load(port.write(source, folder / case.replace("+", "_")))
    # half the cases with split-KV (pieces of the keys folded by a second kernel), half without
    module.SPLIT_WHEN_PROGRAMS_BELOW = 1 << 30 if "-p16" in case or "bfloat16" in case or "-p48" in case else 0
    # the split cases cut each request's key tiles into near-equal pieces (PAGED_BALANCE): 3 (bf16)
    # or 5 pieces of at least 48 keys, on a GPU too (where these short requests would take one), so
    # the cuts fall inside tiles' runs, not at fixed positions; the page-48 cases keep the fixed cut
    # (pieces of FAST_SPLIT_KEYS keys)
    if module.SPLIT_WHEN_PROGRAMS_BELOW:
        module.PAGED_MIN_PIECE_KEYS = 48
        module.PAGED_PIECES = 3 if "bfloat16" in case else 5
        module.PAGED_BALANCE = "-p48" not in case
    if case.endswith("-hnd"):  # (the same values, head-major in memory)
        kc, vc = (c.transpose(1, 2).contiguous().transpose(1, 2) for c in (kc, vc))
        assert kc.stride(2) == page * kc.shape[3], kc.stride()
    if case.endswith("-n32") and device == "cpu":
        module.PAGED_TILES = [(0, WIDE_KEY_TILE)]
    with torch.no_grad():
        out, lse = module.attention_paged(*(t.to(device) for t in (q, kc, vc, table, cu, lens)), return_lse=True,
                                          check=True)
    out, lse = out.cpu(), lse.cpu()
    problems = []
    for r, (n_q, length) in enumerate(reqs):
        start = int(cu[r])
        shape = Shape(batch=1, q_heads=heads, kv_heads=kv_heads, q_len=n_q, kv_len=length, head_dim=16)
        qr = q[start:start + n_q].permute(1, 0, 2)[None].float()
        kr, vr = gather(kc, table[r], length)[None].float(), gather(vc, table[r], length)[None].float()
        ref = reference_attention(request_view(mask, r, n_q, length, fixed=source.valid_q_len is not None),
                                  Inputs(q=qr, k=kr, v=vr, shape=shape, dtype="float32", seed=0), progress=False)
        got = out[start:start + n_q].permute(1, 0, 2)[None]
        checks = [compare("out", got, ref.out, TOLERANCES[dtype]),
                  compare("lse", lse[start:start + n_q].permute(1, 0)[None], ref.lse, LSE_TOLERANCE[dtype])]
        bad = [c for c in checks if not c.passed]
        if bad:
            problems.append(f"request {r} (n_q {n_q}, seq_len {length}): " + "; ".join(
                f"{c.name} max abs err {c.max_abs_err:.3g}, {c.bad_count} bad, {c.nan_count} NaN" for c in bad))
    return "; ".join(problems) or None


def main(argv) -> int:
    device = argv[0] if argv else "cpu"
    seeds = [int(a) for a in argv[1:] if a.isdigit()]
    rng = random.Random(seeds[0] if seeds else 0)
    folder = Path(tempfile.mkdtemp(prefix="port_paged_"))
    failed = total = 0
    todo = ([(case, mask, heads, kv, "float32", 16, batch, length)
             for case, mask, heads, kv, batch, length in corpus_cases()] if "corpus" in argv
            else [(*c, None, None) for c in cases()])
    only = [w for w in os.environ.get("PAGED_ONLY", "").split(",") if w]  # cases whose id holds one of these
    todo = [c for c in todo if not only or any(w in c[0] for w in only)]
    for case, mask, heads, kv_heads, dtype, page, batch, length in todo:
        total += 1
        try:
            problem = check(case, mask, heads, kv_heads, dtype, page, device, folder, rng, batch, length)
        except Exception as exc:
            problem = f"raised {type(exc).__name__}: {str(exc)[:300]}"
        failed += problem is not None
        print(f"CASE {case} {'OK' if problem is None else 'FAIL'}" + (f" {problem}" if problem else ""), flush=True)
    print(f"SUMMARY {total - failed}/{total} paged steps equal the reference")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
