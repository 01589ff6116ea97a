"""`diff_specs`: whether two specs describe the same attention, compared row by row on their kept
runs (never a dense matrix), and where they differ."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from workbench.define import WorkbenchError
from workbench.export import forms
from workbench.export.files import PortingSpec, _resolve, load_spec

__all__ = ["SpecDiff", "diff_specs", "spec_rows"]


# ---------------------------------------------------------------- reading a spec back as a mask

DECODERS = ("flash_attn", "vllm_triton", "magi", "flashmask")  # exact sections a diff can read rows from
MAX_DENSE_KV = 1 << 26


def spec_rows(spec: PortingSpec, b: int, h: int) -> Callable[[int, int], list[list[tuple[int, int]]]]:
    """The spec's kept runs [s, e) of rows r0..r1-1 for (b, h): read from `row_intervals` (no dense
    matrix, any length), or decoded from another exact section when that one is missing."""
    kv_len = spec.doc["shape"]["kv_len"]
    q_len = spec.doc["shape"]["q_len"]

    def pick(section):
        if "by_batch" in section:
            section = section["by_batch"][min(b, len(section["by_batch"]) - 1)]
        if "by_head" in section:
            section = section["by_head"][min(h, len(section["by_head"]) - 1)]
        return _resolve(section, spec.tensors)

    backends = spec.doc["backends"]
    if "row_intervals" in backends:
        table = pick(backends["row_intervals"])["rows"]

        def from_table(r0, r1):
            out = []
            for n in range(r0, r1):
                runs = [(int(s), int(e)) for s, e in table[n] if e > s]
                if any(s < 0 or e > kv_len for s, e in runs):
                    raise WorkbenchError(f"row_intervals row {n} holds a run outside 0..{kv_len}",
                                         "export the spec again")
                out.append(runs)
            return out
        return from_table
    target = next((t for t in DECODERS if t in backends), None)
    if target is None:
        raise WorkbenchError(f"{spec.name} has no section a diff can read rows from (row_intervals, "
                             f"{', '.join(DECODERS)})", "export the spec again (row_intervals is always written)")
    if kv_len > MAX_DENSE_KV:
        raise WorkbenchError(f"{spec.name} has no row_intervals and kv_len = {kv_len:,} is too long to decode its "
                             f"{target} section densely", "export the spec again (it writes row_intervals)")
    section = pick(backends[target])
    decode = {"flash_attn": lambda: forms.decode_flash_attn(section, q_len, kv_len),
              "vllm_triton": lambda: forms.decode_vllm_triton(section, q_len, kv_len),
              "magi": lambda: forms.decode_magi(section, q_len, kv_len),
              "flashmask": lambda: forms.decode_flashmask(section, q_len, kv_len,
                                                            np.asarray(section["startend_row_indices"]))}[target]()

    def from_dense(r0, r1):
        dense = torch.from_numpy(decode(r0, r1))
        rise, fall = forms._runs(dense)
        out = [[] for _ in range(r1 - r0)]
        for (n, s), (_, e) in zip(rise, fall):
            out[n].append((int(s), int(e)))
        return out
    return from_dense


def _row_difference(ra: list, rb: list) -> list[tuple[int, int, bool]]:
    """Where two rows' kept runs differ: (start, end, kept by a) pieces, in order."""
    points = sorted({p for s, e in ra + rb for p in (s, e)})
    out = []
    for lo, hi in zip(points, points[1:]):
        in_a = any(s <= lo and hi <= e for s, e in ra)
        in_b = any(s <= lo and hi <= e for s, e in rb)
        if in_a != in_b:
            if out and out[-1][1] == lo and out[-1][2] == in_a:
                out[-1] = (out[-1][0], hi, in_a)
            else:
                out.append((lo, hi, in_a))
    return out


# ---------------------------------------------------------------- diff

@dataclass
class SpecDiff:
    a: str
    b: str
    same: bool
    shape_a: dict
    shape_b: dict
    score_same: bool
    differing_pairs: int | None  # None when the specs cannot be compared pair by pair (other sizes)
    examples: list[dict]  # first differences: b, h, rows q [q0, q1), keys kv [kv0, kv1), which spec keeps them
    notes: list[str]

    @property
    def line(self) -> str:
        if self.same:
            return f"SAME {self.a} and {self.b}: identical masks and scores"
        pairs = ("not comparable pair by pair" if self.differing_pairs is None
                 else f"{self.differing_pairs:,} pairs differ")
        return (f"DIFFERENT {self.a} vs {self.b}: {pairs}"
                + ("" if self.score_same else "; scores differ") + ("; " + "; ".join(self.notes) if self.notes else ""))


def diff_specs(path_a: str | Path, path_b: str | Path, max_examples: int = 10) -> SpecDiff:
    """Whether two specs describe the same attention: their masks compared row by row on their
    kept runs (no dense matrix, so any length), and their scores. Differences come back as
    ranges: rows [q0, q1) where keys [kv0, kv1) are kept by only one of the two."""
    a, b = load_spec(path_a, golden=False), load_spec(path_b, golden=False)  # (diff never reads golden vectors)
    name_a, name_b = _spec_label(a, path_a), _spec_label(b, path_b)
    sa, sb = a.doc["shape"], b.doc["shape"]
    notes = []
    score_same = a.doc["score"] == b.doc["score"] or _score_close(a, b)
    if (sa["q_len"], sa["kv_len"]) != (sb["q_len"], sb["kv_len"]):
        notes.append(f"lengths differ: {name_a} is {sa['q_len']} x {sa['kv_len']} (q_len x kv_len), {name_b} is "
                     f"{sb['q_len']} x {sb['kv_len']}; pairs can only be compared at one size: export both with the "
                     "same --q-len / --kv-len")
        return SpecDiff(name_a, name_b, False, sa, sb, score_same, None, [], notes)
    for key in ("B", "H"):
        if sa[key] and sb[key] and sa[key] != sb[key]:
            notes.append(f"{key} differs: {sa[key]} vs {sb[key]}; export both with the same --batch / --heads")
            return SpecDiff(name_a, name_b, False, sa, sb, score_same, None, [], notes)
    B = max(sa["B"] or 1, sb["B"] or 1)
    H = max(sa["H"] or 1, sb["H"] or 1)
    q_len = sa["q_len"]
    step = 4096
    differing, examples = 0, []
    for bb in range(B):
        for hh in range(H):
            rows_a, rows_b = spec_rows(a, bb, hh), spec_rows(b, bb, hh)
            for r0 in range(0, q_len, step):
                r1 = min(q_len, r0 + step)
                for n, (ra, rb) in enumerate(zip(rows_a(r0, r1), rows_b(r0, r1))):
                    if ra == rb:
                        continue
                    for lo, hi, in_a in _row_difference(ra, rb):
                        differing += hi - lo
                        q = r0 + n
                        last = examples[-1] if examples else None
                        if last and (last["b"], last["h"], last["q"][1], last["kv"], last["kept_by"]) == (
                                bb, hh, q, [lo, hi], name_a if in_a else name_b):
                            last["q"][1] = q + 1  # the same keys differ on the next row too: one range
                        elif len(examples) < max_examples:
                            examples.append({"b": bb, "h": hh, "q": [q, q + 1], "kv": [lo, hi],
                                             "kept_by": name_a if in_a else name_b})
    if not score_same:
        notes.append(f"score {a.doc['score'].get('kind')} vs {b.doc['score'].get('kind')}")
    return SpecDiff(name_a, name_b, differing == 0 and score_same, sa, sb, score_same, differing, examples, notes)


def _spec_label(spec: PortingSpec, path) -> str:
    """The file name, with the parameters when they tell two exports apart."""
    params = spec.doc.get("params") or {}
    shown = ", ".join(f"{k}={json.dumps(v)}" for k, v in params.items())
    return f"{Path(path).name} ({shown})" if shown and len(shown) < 80 else Path(path).name


def _score_close(a: PortingSpec, b: PortingSpec) -> bool:
    sa, sb = a.doc["score"], b.doc["score"]
    if sa.get("kind") != sb.get("kind"):
        return False
    ra, rb = _resolve(sa, a.tensors), _resolve(sb, b.tensors)
    for key in set(ra) | set(rb):
        va, vb = ra.get(key), rb.get(key)
        if isinstance(va, (list, np.ndarray, float, int)) and isinstance(vb, (list, np.ndarray, float, int)):
            va, vb = np.asarray(va, dtype=float), np.asarray(vb, dtype=float)
            if va.shape != vb.shape or not np.allclose(va, vb, rtol=1e-6, atol=1e-7):
                return False
        elif va != vb:
            return False
    return True
