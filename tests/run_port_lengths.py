"""A port generated at one length, called at others: it must equal the factory rebuilt at the call's
lengths (float64 reference), or refuse the call. Usage:

    TRITON_INTERPRET=1 python tests/run_port_lengths.py cpu [SEED]
    python tests/run_port_lengths.py cuda [SEED] [only=CASE,CASE]

Every library mask (and a score mod on a bottom-right mask, and users' factories: and_masks of two
length-following mods, an attention-gym-style factory, a prefix given as a fraction) is generated at
128 x 128 and called at random (Lq, Lk) pairs with Lq < Lk, Lq > Lk and Lq = 1, plus fixed ones.
Prints one JSON line per (mask, Lq, Lk): {"case", "q_len", "kv_len", "outcome", "detail"} with
outcome "equal" (within the dtype's tolerance of the rebuilt factory's reference), "refused" (the
port said no, with its message) or "wrong"; then a SUMMARY line. Exits 1 on any "wrong", and on a
refusal where the factory builds the mask at those lengths and the port claims those lengths."""

import json
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch.nn.attention.flex_attention import and_masks  # noqa: E402
from workbench import make, port, with_score  # noqa: E402
from workbench.define import library  # noqa: E402
from workbench.run import Shape, make_inputs  # noqa: E402
from workbench.verify import LSE_TOLERANCE, TOLERANCES, compare, reference_attention  # noqa: E402

BASE = 128


def users_offset_and(q_len=None, kv_len=None):
    """A user's factory: and_masks of two closures that each capture the bottom-right offset."""
    offset = (kv_len or 0) - (q_len or 0)

    def causal(b, h, q_idx, kv_idx):
        return q_idx + offset >= kv_idx

    def window(b, h, q_idx, kv_idx):
        return q_idx + offset - kv_idx < 48

    return and_masks(causal, window)


def users_prefix_fraction(q_len=None, kv_len=None):
    """A prefix that is a quarter of the sequence (a number that follows Lk // 4)."""
    prefix = (kv_len or 1024) // 4
    offset = (kv_len or 0) - (q_len or 0)

    def quarter_prefix(b, h, q_idx, kv_idx):
        return (kv_idx < prefix) | (q_idx + offset >= kv_idx)

    return quarter_prefix


def users_gym_factory(q_len=None, kv_len=None):
    """attention-gym's style: a generate_* function returning an inner mod, with a name set."""
    def generate_offset_sliding_window(window_size, offset):
        def sliding_window(b, h, q_idx, kv_idx):
            return (q_idx + offset - kv_idx <= window_size) & (q_idx + offset >= kv_idx)

        sliding_window.__name__ = f"sliding_window_{window_size}"
        return sliding_window

    return generate_offset_sliding_window(30, (kv_len or 0) - (q_len or 0))


def users_fixed_table(q_len=None, kv_len=None):
    """A table sized by the sequence: valid at the built lengths only (the port must refuse others)."""
    n = kv_len or 128
    ids = (torch.arange(n) // 40).to(torch.int32)
    offset = n - (q_len or n)

    def docs(b, h, q_idx, kv_idx):
        return ids[q_idx + offset] == ids[kv_idx]

    return docs


def users_relative_table(q_len=None, kv_len=None):
    """A score_mod reading a per-head table at a clamped distance and at a remainder: indices inside
    the table at every position, so the port holds at any length."""
    table = torch.linspace(-1.0, 1.0, 2 * 16).reshape(2, 16)

    def relative_table(score, b, h, q_idx, kv_idx):
        return score + table[h, (q_idx - kv_idx).clamp(-8, 7) + 8] + 0.5 * table[h, (kv_idx - q_idx) % 16]

    return relative_table


def users_t5_bucket(q_len=None, kv_len=None):
    """T5's bidirectional relative bucket as Hugging Face writes it (exact up to 4, then a log
    bucket up to 64 positions, 16 buckets a direction) into a per-head table: proved inside the
    table at every position, so the port holds at any length."""
    import math

    table = torch.linspace(-2.0, 2.0, 2 * 16).reshape(2, 16)

    def t5_bucket(score, b, h, q_idx, kv_idx):
        rp = kv_idx - q_idx
        ret = (rp > 0).to(torch.int64) * 8
        n = rp.abs()
        large = 4 + (torch.log(n.float() / 4) / math.log(64 / 4) * 4).to(torch.int64)
        large = torch.minimum(large, torch.full_like(large, 7))
        return score + table[h, ret + torch.where(n < 4, n, large)]

    return t5_bucket


USERS = [users_offset_and, users_prefix_fraction, users_gym_factory, users_fixed_table]


def cases():
    """(case name, target, score target, the (Lq, Lk) the port is generated at)."""
    for name in sorted(library()):
        yield name, name, None, (BASE, BASE)
    yield "causal_sliding_window+alibi", "causal_sliding_window", "alibi", (BASE, BASE)
    yield "prefix_lm+relative_bias", "prefix_lm", "relative_bias", (BASE, BASE)
    yield "causal+users_relative_table", "causal", users_relative_table, (BASE, BASE)
    yield "full+users_t5_bucket", "full", users_t5_bucket, (BASE, BASE)
    for factory in USERS:
        yield factory.__name__, factory, None, (BASE, BASE)
    # generated at Lq < Lk (a decode-shaped call), called at Lq = Lk and others
    for name in ("causal", "sinks_window", "prefix_lm"):
        yield f"{name}@64x200", name, None, (64, 200)
    yield "users_offset_and@64x200", users_offset_and, None, (64, 200)
    yield "relative_bias@64x200", "causal", "relative_bias", (64, 200)


CASE_NAMES = [c[0] for c in cases()]


def build(target, score, q_len, kv_len):
    mask = make(target, {"num_heads": 2} if target == "alibi" else None, q_len=q_len, kv_len=kv_len)
    if score:
        mask = with_score(mask, make(score, {"num_heads": 2} if score == "alibi" else None, q_len=q_len, kv_len=kv_len))
    return mask


def pairs(rng: random.Random):
    out = [(1, 200), (64, 200), (200, 64), (1, 1), (131, 131), (128, 128)]
    out += [(rng.randint(2, 150), rng.randint(151, 330)), (rng.randint(151, 330), rng.randint(2, 150)),
            (1, rng.randint(2, 330))]
    return out


def main(argv) -> int:
    device = argv[0] if argv else "cpu"
    rng = random.Random(int(argv[1]) if len(argv) > 1 else 0)
    only = next((a[5:].split(",") for a in argv[2:] if a.startswith("only=")), None)
    dtype = "float32"
    folder = Path(tempfile.mkdtemp(prefix="port_lengths_"))
    wrong = total = 0
    for case, target, score, (q0, k0) in cases():
        if only is not None and case not in only:
            continue
        mask = build(target, score, q0, k0)
        heads = mask.heads or 2
        generated = port.generate(mask, q0, k0, heads=heads, batch=1)
        path = port.write(generated, folder / case.replace("+", "_").replace("@", "_"))
        module = port.load(path)
        for lq, lk in pairs(rng):
            total += 1
            record = {"case": case, "q_len": lq, "kv_len": lk, "valid_for": generated.valid_for()}
            inputs = make_inputs(Shape(q_heads=heads, q_len=lq, kv_len=lk, head_dim=16), dtype, device, seed=lq * 1000 + lk)
            try:
                out, lse = module.attention(inputs.q, inputs.k, inputs.v, return_lse=True)
            except (ValueError, TypeError) as exc:
                record.update(outcome="refused", detail=str(exc)[:300])
                try:
                    build(target, score, lq, lk)
                    factory_builds = True
                except Exception:
                    factory_builds = False
                # a port that claims these lengths must not refuse them
                claims = generated.valid_q_len is None and (
                    ("lt" if lq < lk else "eq" if lq == lk else "gt") in generated.relations)
                if factory_builds and claims:
                    record["outcome"] = "wrong"
                    record["detail"] = "refused lengths it claims: " + record["detail"]
            else:
                try:
                    rebuilt = build(target, score, lq, lk)
                except Exception as exc:
                    record.update(outcome="wrong", detail=f"ran where the factory refuses: {exc}"[:300])
                else:
                    ref = reference_attention(rebuilt, inputs, device="cpu")
                    checks = [compare("out", out.cpu(), ref.out, TOLERANCES[dtype]),
                              compare("lse", lse.cpu(), ref.lse, LSE_TOLERANCE[dtype])]
                    bad = [c for c in checks if not c.passed]
                    record.update(outcome="wrong" if bad else "equal",
                                  detail="; ".join(f"{c.name}: max abs err {c.max_abs_err:.3g}" for c in checks))
            wrong += record["outcome"] == "wrong"
            print(json.dumps(record), flush=True)
    print(f"SUMMARY {total - wrong}/{total} calls equal the rebuilt factory or are refused")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
