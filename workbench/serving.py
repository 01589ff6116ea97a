"""Stage: invariance, over serving layouts -- does a request get the same bits through the port's
`attention_paged` in any engine step, and the same bits as the trainer's contiguous call?

An RL trainer computes a sequence with the contiguous `attention`; its generator computed the same
tokens in engine steps: a prefill (whole or in chunks) next to other requests, then decodes, over
a paged KV cache whose pages sit anywhere. `check` runs one request of L tokens through those
layouts with the port's two modes and compares the request's rows bit for bit:

- invariant mode (`invariant=True`) against `attention(q, k, v, invariant=True)`: every layout must
  be bitwise (the mode's promise);
- fast mode (the default) against the same request alone in a step: it reports where it differs
  (its tiles follow the step's shape; e.g. a decode packs a GQA group into 16-row tiles).

    from workbench import serving
    result = serving.check("causal", q_len=2048, heads=32, kv_heads=8, head_dim=128, device="cuda")
    result.to_frame()

On a CPU the port runs under Triton's interpreter in a fresh process (`python -m workbench.serving`),
so the interpreter's dots are in use there; on a GPU in this process. This module composes port,
port.layout and invariance; it holds no kernel of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd
import torch

from workbench import port
from workbench.define import Mask, WorkbenchError, prepare
from workbench.invariance import TORCH_DTYPES, LayoutResult, _later_keys, _not_same, compare
from workbench.run import check_device_dtype

__all__ = ["check", "ServingResult", "SERVING_KEYS", "MODES"]

MODES = ("invariant", "fast")
SERVING_KEYS = ("contiguous", "step", "order", "pages_shuffled", "page_128", "split", "unsplit",
                "chunked_aligned", "chunked_unaligned", "decode")


@dataclass
class ServingResult:
    """Each mode's layouts of one request (LayoutResult rows, `key` one of SERVING_KEYS)."""

    name: str
    dtype: str
    device: str
    q_len: int
    heads: int
    kv_heads: int
    head_dim: int
    port_file: str
    modes: dict = field(default_factory=dict)  # mode -> [LayoutResult]
    notes: list = field(default_factory=list)  # layouts not run, and why

    def _counted(self, mode: str) -> list[LayoutResult]:
        return [r for r in self.modes.get(mode, []) if r.same_attention]

    @property
    def passed(self) -> bool:
        """Invariant mode is bitwise on every layout that computes the same attention (and one ran)."""
        held = self._counted("invariant")
        return bool(held) and all(r.bitwise for r in held)

    def differs(self, mode: str) -> list[str]:
        return [r.key for r in self._counted(mode) if not r.bitwise]

    @property
    def line(self) -> str:
        inv, fast = self._counted("invariant"), self._counted("fast")
        verdict = "INVARIANT" if self.passed else "NOT INVARIANT"
        text = (f"{verdict} {self.name} (port-paged, {self.dtype} on {self.device}, L={self.q_len} H={self.heads}/"
                f"{self.kv_heads} D={self.head_dim}): invariant mode {len(inv) - len(self.differs('invariant'))}/"
                f"{len(inv)} layouts bitwise" + (f" (differs under {', '.join(self.differs('invariant'))})"
                                                  if self.differs("invariant") else ""))
        if fast:
            text += (f"; fast mode {len(fast) - len(self.differs('fast'))}/{len(fast)} bitwise"
                     + (f" (differs under {', '.join(self.differs('fast'))})" if self.differs("fast") else ""))
        other = sorted({r.key for rows in self.modes.values() for r in rows if not r.same_attention})
        if other:
            text += f"; not the same attention (the mask keeps later keys): {', '.join(other)}"
        return text

    def to_frame(self) -> pd.DataFrame:
        rows = [{"mode": mode, **asdict(r)} for mode, results in self.modes.items() for r in results]
        return pd.DataFrame(rows).set_index(["mode", "layout"])

    def to_dict(self) -> dict:
        return {"passed": self.passed, "name": self.name, "dtype": self.dtype, "device": self.device,
                "q_len": self.q_len, "heads": self.heads, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                "port_file": self.port_file, "notes": self.notes,
                "modes": {m: [asdict(r) for r in rows] for m, rows in self.modes.items()}}


# ---------------------------------------------------------------- steps of requests

def _step(requests: list[tuple], page_size: int, gen: torch.Generator, shuffle: bool = True, spare: int = 3):
    """The six arguments of attention_paged for `requests` [(q [n_q, Hq, D], k [len, Hkv, D],
    v)], each request's keys in pages of `page_size` (shuffled across the cache, NaN in spare pages
    and page tails, an out-of-range page in the block table past each request's pages), and each
    request's row range."""
    q0, k0 = requests[0][0], requests[0][1]
    device, dtype = q0.device, q0.dtype
    hkv, d = k0.shape[1], k0.shape[2]
    pages_of = [-(-k.shape[0] // page_size) for _, k, _ in requests]
    num_pages = sum(pages_of) + spare
    order = torch.randperm(num_pages, generator=gen) if shuffle else torch.arange(num_pages)
    k_cache = torch.full((num_pages, page_size, hkv, d), float("nan"), dtype=dtype, device=device)
    v_cache = torch.full((num_pages, page_size, hkv, d), float("nan"), dtype=dtype, device=device)
    table = torch.full((len(requests), max(pages_of) + 2), 1 << 30, dtype=torch.int32)
    used = 0
    for r, ((_, k, v), n) in enumerate(zip(requests, pages_of)):
        pages = order[used:used + n]
        used += n
        table[r, :n] = pages.to(torch.int32)
        for i, page in enumerate(pages.tolist()):
            part = slice(i * page_size, min(k.shape[0], (i + 1) * page_size))
            k_cache[page, :part.stop - part.start] = k[part]
            v_cache[page, :part.stop - part.start] = v[part]
    q = torch.cat([r[0] for r in requests], 0).contiguous()
    counts = [r[0].shape[0] for r in requests]
    cu = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device=device)
    lens = torch.tensor([r[1].shape[0] for r in requests], dtype=torch.int32, device=device)
    rows = [(int(cu[i]), int(cu[i + 1])) for i in range(len(requests))]
    return (q, k_cache, v_cache, table.to(device), cu, lens), rows


def _others(n: int, L: int, hq: int, hkv: int, d: int, dtype, device, gen) -> list[tuple]:
    """n other requests of a step: two prefill chunks and decodes, contexts up to L."""
    out = []
    for i in range(n):
        length = int(torch.randint(max(2, L // 8), L + 1, (1,), generator=gen))
        n_q = [min(length, max(2, L // 4)), min(length, max(2, L // 10))][i] if i < 2 else 1
        out.append((torch.randn(n_q, hq, d, generator=gen).to(dtype).to(device),
                    torch.randn(length, hkv, d, generator=gen).to(dtype).to(device),
                    torch.randn(length, hkv, d, generator=gen).to(dtype).to(device)))
    return out


def _layouts(module, later: torch.Tensor, q, k, v, mode: str, seed: int, reads_batch: bool,
             others_max: int) -> tuple:
    """LayoutResults of one mode for the request q [1, Hq, L, D], k / v [1, Hkv, L, D] (in this
    process: the module's kernels must run here), and notes on layouts not run. later[q]: the last
    key the mask keeps for row q (invariance._later_keys)."""
    invariant = mode == "invariant"
    _, hq, L, d = q.shape
    hkv = k.shape[1]
    qr, kr, vr = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)  # [L, H, D]
    gen = torch.Generator().manual_seed(seed)
    others = _others(max(0, min(5, others_max)), L, hq, hkv, d, q.dtype, q.device, gen)
    notes = []
    base_split = module.SPLIT_WHEN_PROGRAMS_BELOW

    def paged(requests, page=16, shuffle=True, mine=0, split=None):
        args, rows = _step(requests, page, gen, shuffle)
        module.SPLIT_WHEN_PROGRAMS_BELOW = base_split if split is None else (1 << 30 if split else 0)
        try:
            with torch.no_grad():
                out = module.attention_paged(*args, invariant=invariant, check=True)
        finally:
            module.SPLIT_WHEN_PROGRAMS_BELOW = base_split
        a, b = rows[mine]
        return out[a:b].transpose(0, 1)  # [Hq, n_q, D]

    whole = (qr, kr, vr)
    with torch.no_grad():
        contiguous = module.attention(q, k, v, invariant=invariant)[0]  # [Hq, L, D]
    alone = paged([whole], shuffle=False)
    baseline = contiguous if invariant else alone
    results = []

    def add(key, layout, here, rows=(0, L), same="", differs="", not_same=""):
        bitwise, max_abs, max_ulp, first = compare(baseline[:, rows[0]:rows[1]], here, rows[0])
        results.append(LayoutResult(key, layout, bitwise, max_abs, max_ulp, first,
                                    not_same or (same if bitwise else differs), same_attention=not not_same))

    tiles = "invariant mode's fixed tiling, ascending key tiles and fixed-position pieces"
    add("contiguous", "attention(q, k, v" + (", invariant=True) against the request alone in a step" if invariant
                                              else ") against the request alone in a step"),
        contiguous if not invariant else alone,
        same="the contiguous call computes the same bits" if not invariant else
        "paged and contiguous kernels run one tiling, fold the same pieces, and are compiled without fused "
        "multiply-adds", differs=("fast mode's paged tiles (a GQA group packed into 16-row tiles) differ from "
                                  "attention()'s autotuned ones: expected; use invariant=True for the trainer's bits"
                                  if not invariant else "the paged kernel's tiles or folds differ from the contiguous "
                                  "kernel's (unexpected)"))
    add("step", f"in a step with {len(others)} other requests (prefill chunks and decodes), pages shuffled",
        paged([whole] + others), same=tiles if invariant else "the other requests only add programs",
        differs="the step's shape changed the request's tiles or its split of the keys")
    if reads_batch:
        notes.append("order: the mask reads b (the request's index in the step), so moving the request changes "
                     "what it computes; not run")
    else:
        add("order", "last of a step, after the other requests", paged(others + [whole], mine=len(others)),
            same="a request's programs do not depend on its place in the step",
            differs="the request's place changed its tiles")
    add("pages_shuffled", "pages shuffled across the cache, NaN in spare pages", paged([whole]),
        same="pages are addressed per key; the values are the same",
        differs="page placement changed the arithmetic (unexpected)")
    add("page_128", "page size 128", paged([whole], page=128, shuffle=True),
        same="the key tiles do not follow page boundaries", differs="the page size changed the key tiles")
    add("split", "split-KV forced (every piece its own program, folded by _paged_fold)", paged([whole], split=True),
        same="pieces are folded with _fold_piece in order, as one program folds them" if invariant else
        "split and unsplit agree here", differs="split-KV folds the pieces in other arithmetic than one program")
    add("unsplit", "split-KV off (one program per row block folds its own pieces)", paged([whole], split=False),
        same="pieces are folded with _fold_piece in order, as _paged_fold does" if invariant else
        "split and unsplit agree here", differs="fast mode's unsplit kernel runs the keys in one pass: another "
        "order of sums than split-KV's pieces")
    unit = 64 if L >= 192 else 16  # aligned chunks: whole tiles of queries (16 / 64 / 128 rows)
    for key, size in (("chunked_aligned", max(unit, (L // 3) // unit * unit)),
                      ("chunked_unaligned", max(1, L // 3 - 13))):
        starts = list(range(0, L, size))
        pieces = [paged([(qr[s:s + size], kr[:s + size], vr[:s + size])] + others) for s in starts]
        add(key, f"chunked prefill, chunks of {size} queries, each in a step with the others",
            torch.cat(pieces, 1), same="a query's keys are tiled from key 0 in every chunk",
            differs="a chunk's query count changed the tiling or the split",
            not_same=_not_same(later, [(s, min(L, s + size)) for s in starts]))
    first = max(0, L - 4)
    steps = [paged([(qr[t:t + 1], kr[:t + 1], vr[:t + 1])] + others) for t in range(first, L)]
    add("decode", f"decode of the last {L - first} tokens, one per step, next to the others", torch.cat(steps, 1),
        rows=(first, L), same="one query against the same key tiles and pieces",
        differs="the decode's tiles (a GQA group in 16 rows) or its split differ from a prefill's",
        not_same=_not_same(later, [(t, t + 1) for t in range(first, L)]))
    return results, notes


def _inputs(L: int, heads: int, kv_heads: int, head_dim: int, dtype: str, device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    tdt = TORCH_DTYPES[dtype]
    return tuple(torch.randn(1, h, L, head_dim, generator=gen).to(tdt).to(device)
                 for h in (heads, kv_heads, kv_heads))


def run_in_process(path: str | Path, later: torch.Tensor, *, q_len: int, heads: int, kv_heads: int, head_dim: int,
                   dtype: str, device, seed: int = 0, modes=MODES) -> tuple[dict, list]:
    """Both modes' layouts, with the port at `path` loaded in this process."""
    module = port.load(path)
    reads_batch = bool(module.MASK_READS_BATCH or module.VALID_BATCH is not None)
    others_max = (module.VALID_BATCH - 1) if module.VALID_BATCH is not None else 5
    q, k, v = _inputs(q_len, heads, kv_heads, head_dim, dtype, device, seed)
    out, notes = {}, []
    for mode in modes:
        try:
            out[mode], more = _layouts(module, later, q, k, v, mode, seed, reads_batch, others_max)
        except (ValueError, TypeError) as exc:  # the file's own refusals
            raise WorkbenchError(f"the port refused a serving step: {exc}",
                                 "check the mask at the request's length with verify(..., backend='port-paged')",
                                 module.NAME) from exc
        notes += [n for n in more if n not in notes]
    return out, notes


def check(target: str | Mask, params: dict | None = None, *, q_len: int, heads: int = 8, kv_heads: int | None = None,
          head_dim: int = 128, dtype: str = "bfloat16", device: str | None = None, seed: int = 0,
          out_dir: str | Path | None = None, timeout: float = 3600, modes: tuple = MODES) -> ServingResult:
    """One request of q_len tokens through attention_paged's serving layouts, in both modes.

    target: a library name, "file.py:factory", a mod or a Mask; the port is generated for it at
    q_len (written to out_dir, or a temporary folder). q [1, heads, q_len, head_dim], k / v
    [1, kv_heads, q_len, head_dim] in `dtype`, drawn from `seed`. `modes`: which of MODES to run.

        >>> result = check("causal", q_len=80, heads=2, head_dim=16, dtype="float32", device="cpu")
        >>> result.passed, result.differs("invariant")
        (True, [])
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype not in TORCH_DTYPES:
        raise WorkbenchError(f"the serving check compares {dtype!r} bits, which it cannot",
                             f"use one of {', '.join(TORCH_DTYPES)}")
    if q_len < 8:
        raise WorkbenchError(f"q_len = {q_len} is too short to chunk and decode", "use q_len >= 8")
    check_device_dtype(device, dtype)
    unknown = sorted(set(modes) - set(MODES))
    if unknown or not modes:
        raise WorkbenchError(f"modes {list(modes)}", f"name some of {', '.join(MODES)}")
    port.require_triton()
    kv_heads = kv_heads or heads
    if heads % kv_heads:
        raise WorkbenchError(f"heads = {heads} is not a multiple of kv_heads = {kv_heads}",
                             "pass kv heads that divide the query heads (grouped-query attention)")
    mask = prepare(target, params, q_len, q_len, device, heads=heads)
    folder = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="workbench_serving_"))
    path = port.build(mask, q_len, q_len, heads=heads, batch=6, out_dir=folder)
    result = ServingResult(mask.name, dtype, str(device), q_len, heads, kv_heads, head_dim, str(path))
    kwargs = dict(q_len=q_len, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, seed=seed,
                  modes=tuple(modes))
    later = _later_keys(mask, q_len, heads, device).cpu()
    if port.in_process(device):
        modes, notes = run_in_process(path, later, device=device, **kwargs)
    else:  # Triton's interpreter must be on before triton is imported: a fresh process
        job = folder / "serving_job.json"
        torch.save(later, folder / "serving_later.pt")
        job.write_text(json.dumps({"path": str(path), "later": str(folder / "serving_later.pt"), **kwargs}))
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
            [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
        done = subprocess.run([sys.executable, "-m", "workbench.serving", str(job)], capture_output=True, text=True,
                              env=env, timeout=timeout)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode == 3:
            raise WorkbenchError(done.stderr.strip().splitlines()[-1], "check the mask at the request's length with "
                                 "verify(..., backend='port-paged')", mask.name)
        if done.returncode != 0 or not lines:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise WorkbenchError(f"the serving check failed under Triton's interpreter: {last[:400]}",
                                 "run it on a GPU, or run the port file by hand (TRITON_INTERPRET=1)", mask.name)
        record = json.loads(lines[-1])
        modes = {m: [LayoutResult(**r) for r in rows] for m, rows in record["modes"].items()}
        notes = record["notes"]
    result.modes, result.notes = modes, notes
    return result


def _main(argv: list[str]) -> int:
    job = json.loads(Path(argv[0]).read_text())
    later = torch.load(job.pop("later"))
    job["modes"] = tuple(job["modes"])
    try:
        modes, notes = run_in_process(job.pop("path"), later, device=torch.device("cpu"), **job)
    except WorkbenchError as exc:
        print(str(exc).replace("\n", " "), file=sys.stderr)
        return 3
    print(json.dumps({"modes": {m: [asdict(r) for r in rows] for m, rows in modes.items()}, "notes": notes}))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
