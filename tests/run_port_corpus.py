"""Generate the Triton port of every mod of the corpus, plus random mods drawn from the trust
grammar, and run each from its files alone against the float64 reference. Usage:

    TRITON_INTERPRET=1 python tests/run_port_corpus.py cpu [N_RANDOM] [DTYPE ...] [conformance]
    python tests/run_port_corpus.py cuda [N_RANDOM] [DTYPE ...] [conformance] [shard=I/N]

`conformance` adds library specs run through `conformance` on their golden vectors (on a GPU in
bf16 and fp32 whatever DTYPEs say; in shard 0 only). `hopper` (an sm_90 GPU) runs N_RANDOM drawn
mods instead, at lengths and head dims the Hopper kernel takes (multiples of 128, D 64 / 128,
grouped-query heads), and fails a case whose call did not run that kernel; `hopper ragged` draws
lengths off the 128 grid (at least 128) and turns on the file's HOPPER_RAGGED. `shard=I/N` runs every N-th case from the I-th (the cases
compile one kernel each: N processes, one per GPU, share the work).

Prints `CASE <id> OK|FAIL detail` per mod and dtype (ids: `case_ids`), then a SUMMARY line; exits 1
on any failure."""

import os
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mod_corpus import corpus  # noqa: E402
from torch.nn.attention.flex_attention import and_masks, or_masks  # noqa: E402
from workbench import Mask  # noqa: E402
from workbench import port  # noqa: E402
from workbench.run import Shape, make_inputs  # noqa: E402
from workbench.verify import LSE_TOLERANCE, TOLERANCES, compare, reference_attention  # noqa: E402


def random_mod(rng: random.Random, q_len: int, kv_len: int, batch: int, heads: int) -> Mask:
    """A mod from the trust grammar: windows, per-head / per-batch tables, documents, spans
    (.any()), prefixes, combined with and_masks / or_masks, sometimes with a score mod."""
    d = kv_len - q_len

    def window():
        w = rng.randint(1, kv_len + 1)
        return lambda b, h, q, kv: (q + d - kv < w) & (kv <= q + d)

    def per_head_window():
        w = torch.tensor([rng.randint(1, kv_len + 1) for _ in range(heads)])
        return lambda b, h, q, kv: (q + d - kv < w[h]) & (kv <= q + d)

    def per_batch_length():
        n = torch.tensor([rng.randint(0, kv_len) for _ in range(batch)])
        return lambda b, h, q, kv: kv < n[b]

    def document():
        ids = torch.zeros(kv_len, dtype=torch.int64)
        for c in sorted(rng.sample(range(1, kv_len), min(3, kv_len - 1))):
            ids[c:] += 1
        return lambda b, h, q, kv: ids[q + d] == ids[kv]

    def spans():
        s = torch.tensor(sorted(rng.randint(0, kv_len - 1) for _ in range(rng.randint(1, 3))))
        e = torch.clamp(s + rng.randint(0, 20), max=kv_len - 1)
        return lambda b, h, q, kv: ((q + d >= s) & (q + d <= e) & (kv >= s) & (kv <= e)).any()

    def prefix():
        p = rng.randint(0, kv_len)
        return lambda b, h, q, kv: kv < p

    makers = [window, per_head_window, per_batch_length, document, spans, prefix]
    mod = rng.choice(makers)()
    for _ in range(rng.randint(0, 2)):
        mod = (and_masks if rng.random() < 0.5 else or_masks)(mod, rng.choice(makers)())
    score = None
    if rng.random() < 0.5:
        slopes = torch.tensor([rng.uniform(0.01, 0.5) for _ in range(heads)])
        score = rng.choice([lambda s, b, h, q, kv: s - slopes[h] * (q + d - kv).abs(),
                            lambda s, b, h, q, kv: 15.0 * torch.tanh(s / 15.0)])
    return Mask("drawn", mask_mod=mod, score_mod=score)


def check(mask, shape, dtype, device, folder, hopper: bool = False, ragged: bool = False) -> str | None:
    path = port.build(mask, shape.q_len, shape.kv_len, heads=shape.q_heads, batch=shape.batch, out_dir=folder)
    inputs = make_inputs(shape, dtype, device, seed=0)
    if hopper:  # the file's own attention(), watching that its Hopper kernel answered (not the fallback)
        module, ran = port.load(path), []
        real = module._attention_hopper

        def spy(*args, **kwargs):
            done = real(*args, **kwargs)
            ran.append(done is not None)
            return done

        module.HOPPER, module.HOPPER_RAGGED, module._attention_hopper = True, ragged, spy
        with torch.no_grad():
            out, lse = module.attention(inputs.q, inputs.k, inputs.v, return_lse=True)
        if not (ran and all(ran)):
            return f"the call did not run the Hopper kernel ({'it failed: ' + str(module._HOPPER_FAILED) if ran else 'not taken'})"
    else:
        out, lse = port.run_file(path, inputs.q, inputs.k, inputs.v)
    ref = reference_attention(mask, inputs, device="cpu")  # the mods' tables stay where they were made
    checks = [compare("out", out, ref.out, TOLERANCES[dtype]), compare("lse", lse, ref.lse, LSE_TOLERANCE[dtype])]
    bad = [c for c in checks if not c.passed]
    return None if not bad else "; ".join(f"{c.name}: max abs err {c.max_abs_err:.3g}, rel {c.rel_err:.3g}, "
                                          f"{c.bad_count} bad, {c.nan_count} NaN" for c in bad)


def cases(n_random: int) -> list[tuple[str, Mask, Shape]]:
    """(case id, mask, shape): the corpus at its lengths (GQA where the heads allow it), then
    n_random mods drawn from the trust grammar. Deterministic: the test collects the ids."""
    out = []
    for mask, batch, heads in corpus():
        n = mask.q_len or 96
        out.append((mask, Shape(batch=batch, q_heads=heads, kv_heads=1 if heads % 2 else heads // 2 or 1,
                                q_len=n, kv_len=mask.kv_len or n, head_dim=32)))
    rng = random.Random(1)
    for n in range(n_random):
        q_len = rng.randint(1, 200) if n else 256  # the first at whole blocks (no bounds checks compiled)
        kv_len = q_len + (rng.randint(0, 60) if n else 128)
        batch, heads = rng.randint(1, 3), rng.randint(1, 4)
        out.append((random_mod(rng, q_len, kv_len, batch, heads),
                    Shape(batch=batch, q_heads=heads, q_len=q_len, kv_len=kv_len, head_dim=rng.choice([16, 40, 64]))))
    return [(f"{n}-{mask.name}".replace(" ", ""), mask, shape) for n, (mask, shape) in enumerate(out)]


def hopper_cases(n_random: int, ragged: bool = False) -> list[tuple[str, Mask, Shape]]:
    """(case id, mask, shape): n_random mods of the trust grammar at lengths the Hopper kernel takes
    (multiples of 128 up to 512 queries, as many or more keys; `ragged`: any lengths from 128 to
    520 queries, up to 200 more keys), D 64 or 128, 2 or 4 query heads over 1, 2 or all kv heads.
    Deterministic."""
    rng = random.Random(11 if ragged else 7)
    out = []
    for n in range(n_random):
        if ragged:
            q_len = rng.randint(128, 520)
            kv_len = q_len + rng.randint(0, 200)
        else:
            q_len = 128 * rng.randint(1, 4)
            kv_len = q_len + 128 * rng.randint(0, 2)
        batch, heads = rng.randint(1, 2), rng.choice([2, 4])
        kv_heads = rng.choice([1, 2, heads])
        mask = random_mod(rng, q_len, kv_len, batch, heads)
        out.append((f"hopper{n}-{'score' if mask.score_mod else 'mask'}", mask,
                    Shape(batch=batch, q_heads=heads, kv_heads=kv_heads, q_len=q_len, kv_len=kv_len,
                          head_dim=rng.choice([64, 128]))))
    return out


def case_ids(n_random: int, dtypes: list[str], conformance: bool, device: str = "cpu") -> list[str]:
    ids = [f"{case}-{dtype}" for case, _, _ in cases(n_random) for dtype in dtypes]
    if conformance:
        golden = ["bfloat16", "float32"] if device == "cuda" else dtypes
        ids += [f"conformance-{name}{'+' + score if score else ''}-{dtype}"
                for name, _, score in CONFORMANCE_CASES for dtype in golden]
    return ids


def main(argv):
    device = argv[0] if argv else "cpu"
    n_random = int(argv[1]) if len(argv) > 1 else 10
    shard = next((tuple(map(int, a[6:].split("/"))) for a in argv[2:] if a.startswith("shard=")), (0, 1))
    hopper, ragged = "hopper" in argv[2:], "ragged" in argv[2:]
    dtypes = [a for a in argv[2:] if a not in ("conformance", "hopper", "ragged") and not a.startswith("shard=")] or (
        ["bfloat16"] if hopper else ["float32"] if device == "cpu" else ["bfloat16", "float32"])
    if hopper and not (device == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        print("SUMMARY 0/0: `hopper` needs an sm_90 GPU (H100 / H200) and device cuda")
        return 2
    folder = Path(tempfile.mkdtemp(prefix="port_corpus_"))
    failed = 0
    todo = [(n, case) for n, case in enumerate(hopper_cases(n_random, ragged) if hopper else cases(n_random))
            if n % shard[1] == shard[0]]
    for n, (case, mask, shape) in todo:
        for dtype in dtypes:
            sub = folder / f"case{n}{dtype}"
            # on a GPU each case pins one autotuning configuration, in turn: all of them get exercised
            os.environ["PORT_CONFIG"] = str(n)
            try:
                problem = check(mask, shape, dtype, device, sub, hopper=hopper, ragged=ragged)
            except Exception as exc:
                problem = f"raised {type(exc).__name__}: {str(exc)[:300]}"
            failed += problem is not None
            size = f"B={shape.batch} Hq={shape.q_heads} Hkv={shape.kv_heads} {shape.q_len}x{shape.kv_len} D={shape.head_dim}"
            print(f"CASE {case}-{dtype} {'OK' if problem is None else 'FAIL'} {size}" + (f": {problem}" if problem else ""),
                  flush=True)
    total = len(todo) * len(dtypes)
    if "conformance" in sys.argv and shard[0] == 0 and not hopper:  # (once, in the first shard)
        golden_dtypes = ["bfloat16", "float32"] if device == "cuda" else dtypes
        failed += conformance_of_the_library(device, golden_dtypes, folder)
        total += len(golden_dtypes) * len(CONFORMANCE_CASES)
    print(f"SUMMARY {total - failed}/{total} ports match the reference")
    return 1 if failed else 0


CONFORMANCE_CASES = [("causal", {}, None), ("document", {"doc_lengths": [60, 100, 96]}, None),
                     ("image_spans", {}, "softcap"), ("sliding_window", {"left": 20, "right": 8}, None),
                     ("per_head_window", {"windows": [4, 16, 64, 256]}, "alibi"), ("tree", {}, "relative_bias"),
                     ("neighborhood_2d", {"width": 16}, None), ("dilated_window", {}, "head_bias")]


def conformance_of_the_library(device, dtypes, folder) -> int:
    """Export specs (with their ports), then run each port on the spec's golden vectors through
    `conformance`, as a porting engineer would (with autotuning on)."""
    os.environ.pop("PORT_CONFIG", None)
    from workbench import make, with_score
    from workbench.export import build_spec, conformance, write_spec

    failed = 0
    for name, params, score in CONFORMANCE_CASES:
        n = 256
        mask = make(name, params, q_len=n, kv_len=n)
        if score:
            score_params = {"num_heads": mask.heads or 4} if score == "alibi" else {}
            mask = with_score(mask, make(score, score_params, q_len=n, kv_len=n))
        spec = build_spec(mask, n, n, heads=mask.heads or 4 if score == "alibi" else mask.heads, head_dim=32, seed=0,
                          generalize=False)
        json_path, _ = write_spec(spec, folder / f"spec_{name}")
        module = port.load(json_path.with_name(spec.doc["backends"]["triton_attention"]["file"]))
        for dtype in dtypes:
            real = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]

            def impl(q, k, v, spec_doc):
                return module.attention(q.to(device, real), k.to(device, real), v.to(device, real)).cpu()

            report = conformance(json_path, impl)
            case = f"conformance-{name}{'+' + score if score else ''}-{dtype}"
            print(f"CASE {case} {'OK' if report.passed else 'FAIL'} {report.line}", flush=True)
            failed += not report.passed
    return failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
