"""attention_paged, the port's serving entry point: a whole engine step (prefill chunks and decodes)
in one launch over a paged KV cache in vLLM's layouts. Every case of tests/run_port_paged.py (one
fresh interpreter process) is judged on its own; bad calls are refused naming the argument."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from run_port_paged import case_ids  # noqa: E402


@pytest.fixture(scope="module")
def paged_results():
    done = subprocess.run([sys.executable, str(ROOT / "run_port_paged.py"), "cpu", "3"], capture_output=True,
                          text=True, env=dict(os.environ, TRITON_INTERPRET="1"), timeout=1200)
    results = {line.split()[1]: line for line in done.stdout.splitlines() if line.startswith("CASE ")}
    assert results, done.stdout[-3000:] + done.stderr[-3000:]
    return results


@pytest.mark.parametrize("case", case_ids())
def test_a_paged_step_equals_each_requests_reference(paged_results, case):
    line = paged_results.get(case)
    assert line is not None, f"{case} did not run"
    assert line.split()[2] == "OK", line


CALLS = textwrap.dedent('''
    import json, sys, torch
    sys.path.insert(0, sys.argv[2])
    from workbench import port
    m = port.load(sys.argv[1])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, 16, generator=g)
    kc = torch.randn(6, 16, 2, 16, generator=g); vc = torch.randn(6, 16, 2, 16, generator=g)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    cu = torch.tensor([0, 4, 5], dtype=torch.int32); lens = torch.tensor([20, 40], dtype=torch.int32)
    def call(**changes):
        args = dict(q=q, k_cache=kc, v_cache=vc, block_table=table, cu_seqlens_q=cu, seq_lens=lens)
        args.update(changes)
        return m.attention_paged(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), args.pop("block_table"),
                                 args.pop("cu_seqlens_q"), args.pop("seq_lens"), check=True, **args)
    cases = {
        "ok": lambda: call(),
        "q_rank": lambda: call(q=q[None]),
        "dtype": lambda: call(k_cache=kc.double(), v_cache=vc.double()),
        "heads": lambda: call(q=torch.randn(5, 3, 16)),
        "page16": lambda: call(k_cache=kc[:, :8], v_cache=vc[:, :8]),
        "cu_float": lambda: call(cu_seqlens_q=cu.float()),
        "cu_falls": lambda: call(cu_seqlens_q=torch.tensor([0, 4, 3], dtype=torch.int32)),
        "short_seq": lambda: call(seq_lens=torch.tensor([3, 40], dtype=torch.int32)),
        "narrow_table": lambda: call(seq_lens=torch.tensor([20, 60], dtype=torch.int32)),
        "bad_page": lambda: call(block_table=torch.tensor([[0, 1, 2], [3, 4, 99]], dtype=torch.int32)),
        "tables_name": lambda: call(tables={"nope": torch.zeros(3)}),
    }
    for name, fn in cases.items():
        try:
            out = fn()
            print(json.dumps({"case": name, "ok": True, "shape": list(out.shape)}))
        except Exception as exc:
            print(json.dumps({"case": name, "ok": False, "type": type(exc).__name__, "message": str(exc)}))
''')


@pytest.fixture(scope="module")
def bad_calls(tmp_path_factory):
    from workbench import make, port

    folder = tmp_path_factory.mktemp("paged")
    path = port.build(make("causal"), 128, 128, out_dir=folder)
    script = folder / "calls.py"
    script.write_text(CALLS)
    done = subprocess.run([sys.executable, str(script), str(path), str(ROOT.parent)], capture_output=True, text=True,
                          env=dict(os.environ, TRITON_INTERPRET="1"), timeout=600)
    records = {r["case"]: r for r in (json.loads(line) for line in done.stdout.splitlines() if line.startswith("{"))}
    assert records, done.stdout[-2000:] + done.stderr[-2000:]
    return records


@pytest.mark.parametrize("case, match", [
    ("q_rank", "q must be [total_q, Hq, D]"), ("dtype", "share one dtype"), ("heads", "multiple of Hkv"),
    ("page16", "page_size = 8"), ("cu_float", "cu_seqlens_q must hold int32"),
    ("cu_falls", "must rise from 0 to total_q"), ("short_seq", "seq_lens[0] = 3 is shorter"),
    ("narrow_table", "block_table has 3 pages per request; request 1 needs 4"),
    ("bad_page", "points outside the cache's 6 pages"), ("tables_name", "reads no tensor named 'nope'"),
])
def test_bad_paged_calls_name_the_argument(bad_calls, case, match):
    r = bad_calls[case]
    assert not r["ok"] and match in r["message"], r
    assert bad_calls["ok"]["ok"] and bad_calls["ok"]["shape"] == [5, 4, 16]


def test_a_mask_whose_numbers_follow_each_requests_length_is_refused_in_paged_calls(tmp_path):
    """A prefix of Lk // 4 differs by request: the file says so instead of using one value."""
    from workbench import Mask, port
    from workbench.define.mask import Mask as _  # noqa: F401

    def quarter_prefix_factory(q_len=None, kv_len=None):
        prefix = (kv_len or 1024) // 4

        def quarter_prefix(b, h, q_idx, kv_idx):
            return (kv_idx < prefix) | (q_idx >= kv_idx)

        return Mask("quarter_prefix", mask_mod=quarter_prefix, factory=quarter_prefix_factory)

    from workbench import make

    source = port.generate(make(quarter_prefix_factory, q_len=256, kv_len=256), 256, 256)
    assert "HAS_LENGTH_RULES_IN_PAGES = any(" in source.source and source.length_rules
    path = port.write(source, tmp_path)
    code = ("import sys, torch; sys.path.insert(0, sys.argv[2]); from workbench import port; m = port.load(sys.argv[1])\n"
            "z = torch.zeros(2, 1, 16); c = torch.zeros(2, 16, 1, 16); t = torch.zeros(1, 1, dtype=torch.int32)\n"
            "try:\n    m.attention_paged(z, c, c, t, torch.tensor([0, 2], dtype=torch.int32), torch.tensor([2], dtype=torch.int32))\n"
            "except ValueError as e:\n    print('REFUSED', e)")
    done = subprocess.run([sys.executable, "-c", code, str(path), str(ROOT.parent)], capture_output=True, text=True,
                          env=dict(os.environ, TRITON_INTERPRET="1"), timeout=300)
    assert "REFUSED" in done.stdout and "follow the sequence's length" in done.stdout, done.stdout + done.stderr[-2000:]


TABLES = textwrap.dedent('''
    import sys, torch
    sys.path.insert(0, sys.argv[3])
    from workbench import port
    a, b = port.load(sys.argv[1]), port.load(sys.argv[2])
    g = torch.Generator().manual_seed(1)
    q = torch.randn(6, 2, 16, generator=g)
    kc = torch.randn(8, 16, 2, 16, generator=g); vc = torch.randn(8, 16, 2, 16, generator=g)
    table = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
    cu = torch.tensor([0, 5, 6], dtype=torch.int32); lens = torch.tensor([60, 64], dtype=torch.int32)
    with torch.no_grad():
        mine = a.attention_paged(q, kc, vc, table, cu, lens)
        swapped = a.attention_paged(q, kc, vc, table, cu, lens, tables={"LENS": torch.tensor([3, 50])})
        other = b.attention_paged(q, kc, vc, table, cu, lens)
    print("SAME" if torch.equal(swapped, other) else "DIFF", "CHANGED" if not torch.equal(mine, swapped) else "UNCHANGED")
''')

LENS = None
OTHER = None


def test_tables_replace_the_captured_tensors_per_call(tmp_path):
    """An engine passes each step's per-request data (tables=): the file's own table is replaced,
    and the result equals a port generated with that table."""
    import torch

    from workbench import Mask, port

    global LENS, OTHER
    LENS, OTHER = torch.tensor([60, 64]), torch.tensor([3, 50])  # 60: request 0 sees every key

    def by_lens(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < LENS[b])

    def by_other(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < OTHER[b])

    a = port.write(port.generate(Mask("by_lens", mask_mod=by_lens), 64, 64, batch=2), tmp_path / "a")
    b = port.write(port.generate(Mask("by_other", mask_mod=by_other), 64, 64, batch=2), tmp_path / "b")
    script = tmp_path / "tables.py"
    script.write_text(TABLES)
    done = subprocess.run([sys.executable, str(script), str(a), str(b), str(ROOT.parent)], capture_output=True,
                          text=True, env=dict(os.environ, TRITON_INTERPRET="1"), timeout=600)
    assert "SAME CHANGED" in done.stdout, done.stdout + done.stderr[-3000:]
