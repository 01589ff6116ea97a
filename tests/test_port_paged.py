"""attention_paged, the port's serving entry point: a whole engine step (prefill chunks and decodes)
in one launch over a paged KV cache in vLLM's layouts. Every case of tests/run_port_paged.py (one
fresh interpreter process), and every mod of the test corpus served in a step (its corpus mode),
is judged on its own; bad calls are refused naming the argument."""

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
from run_port_paged import case_ids, corpus_cases  # noqa: E402


@pytest.fixture(scope="module")
def paged_results(early_run):
    done = early_run("port_paged")  # tests/run_port_paged.py cpu 3, started at collection (conftest)
    results = {line.split()[1]: line for line in done.stdout.splitlines() if line.startswith("CASE ")}
    assert results, done.stdout[-3000:] + done.stderr[-3000:]
    return results


@pytest.mark.slow
@pytest.mark.parametrize("case", case_ids())
def test_a_paged_step_equals_each_requests_reference(paged_results, case):
    line = paged_results.get(case)
    assert line is not None, f"{case} did not run"
    assert line.split()[2] == "OK", line


@pytest.fixture(scope="module")
def corpus_results(early_run):
    done = early_run("port_paged_corpus")  # tests/run_port_paged.py cpu 1 corpus, started at collection
    results = {line.split()[1]: line for line in done.stdout.splitlines() if line.startswith("CASE ")}
    assert results, done.stdout[-3000:] + done.stderr[-3000:]
    return results


@pytest.mark.parametrize("case", [c[0] for c in corpus_cases()])
def test_every_corpus_mod_served_in_a_paged_step_equals_the_reference(corpus_results, case):
    """The library at 96 tokens and users' mods (per-head and per-sample tables, spans with .any(),
    documents, and_masks / or_masks, score mods): one step of requests over shuffled pages each."""
    line = corpus_results.get(case)
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
        args = dict(q=q, k_cache=kc, v_cache=vc, block_table=table, cu_seqlens_q=cu, seq_lens=lens, check=True)
        args.update(changes)
        return m.attention_paged(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), args.pop("block_table"),
                                 args.pop("cu_seqlens_q"), args.pop("seq_lens"), **args)
    def nan_rows(**changes):  # without check=True: which of the 5 rows come back NaN
        with torch.no_grad():
            out = call(check=False, **changes)
        return out.isnan().any(-1).any(-1).tolist()
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
        "invariant_group": lambda: call(q=torch.randn(5, 130, 16), invariant=True),
        "invariant_split": lambda: split_at(100),
    }
    def split_at(keys):
        before = m.SPLIT_KEYS
        m.SPLIT_KEYS = keys
        try:
            return call(invariant=True)
        finally:
            m.SPLIT_KEYS = before
    unchecked = {
        "nan_bad_page": lambda: nan_rows(block_table=torch.tensor([[0, 1, 2], [3, 4, 99]], dtype=torch.int32)),
        "nan_narrow_table": lambda: nan_rows(seq_lens=torch.tensor([20, 60], dtype=torch.int32)),
        "nan_short_seq": lambda: nan_rows(seq_lens=torch.tensor([3, 40], dtype=torch.int32)),
        "nan_cu_past_q": lambda: nan_rows(cu_seqlens_q=torch.tensor([0, 4, 9], dtype=torch.int32)),
        "nan_none": lambda: nan_rows(),
    }
    for name, fn in unchecked.items():
        print(json.dumps({"case": name, "ok": True, "nan_rows": fn()}))
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
    ("invariant_group", "invariant mode packs at most 64 query heads per kv head"),
    ("invariant_split", "SPLIT_KEYS = 100 must be a multiple of 16 keys (invariant mode's key tile)"),
])
def test_bad_paged_calls_name_the_argument(bad_calls, case, match):
    r = bad_calls[case]
    assert not r["ok"] and match in r["message"], r
    assert bad_calls["ok"]["ok"] and bad_calls["ok"]["shape"] == [5, 4, 16]


@pytest.mark.parametrize("case, rows", [
    ("nan_none", [False] * 5),
    ("nan_bad_page", [False] * 4 + [True]),  # request 1's last page points outside the cache
    ("nan_narrow_table", [False] * 4 + [True]),  # its seq_len runs past its block table row
    ("nan_short_seq", [True] * 4 + [False]),  # request 0: 4 queries, seq_len 3
    ("nan_cu_past_q", [False] * 4 + [True]),  # request 1 claims rows 4..8 of a 5-row q
])
def test_inconsistent_contents_without_check_give_nan_rows_and_read_nothing_out_of_bounds(bad_calls, case, rows):
    """Without check=True (a sync), the kernel cannot raise: a request whose numbers do not hold
    together must come back NaN, never as a plausible number, and never fault. Requests that are
    fine are untouched."""
    record = bad_calls[case]
    assert record["nan_rows"] == rows, record


FIXED = textwrap.dedent('''
    import json, sys, torch
    sys.path.insert(0, sys.argv[2])
    from workbench import port
    from workbench.port.layout import paged_step
    m = port.load(sys.argv[1])
    g = torch.Generator().manual_seed(2)
    out = {}
    q, k, v = (torch.randn(2, 2, 96, 16, generator=g) for _ in range(3))
    step = paged_step(q, k, v, page_size=16, seed=3)
    with torch.no_grad():
        out["equal_to_attention"] = (step.unpack(m.attention_paged(*step.args(), check=True))
                                     - m.attention(q, k, v)).abs().max().item()
        long = paged_step(*(torch.randn(1, 2, 120, 16, generator=g) for _ in range(3)), page_size=16)
        out["long_nan"] = bool(m.attention_paged(*long.args()).isnan().all())
        for name, call in (("long_checked", lambda: m.attention_paged(*long.args(), check=True)),
                           ("more_heads", lambda: m.attention_paged(torch.randn(192, 4, 16), *step.args()[1:]))):
            try:
                call()
                out[name] = "ran"
            except ValueError as exc:
                out[name] = str(exc)
    print(json.dumps(out))
''')

DOC = None
W = None


def test_a_fixed_length_mask_in_paged_calls_holds_inside_its_tables_and_refuses_past_them(tmp_path):
    """A user's per-token document table and per-head windows: the port is valid at its lengths
    and heads only. Requests inside them equal attention(); a longer request is refused with
    check=True and NaN without; more heads than the table are refused (a shape, no sync)."""
    import torch

    from workbench import Mask, port

    global DOC, W
    DOC, W = torch.tensor([0] * 30 + [1] * 40 + [2] * 26), torch.tensor([7, 50])

    def docs_by_head(b, h, q_idx, kv_idx):
        return (DOC[q_idx] == DOC[kv_idx]) & (kv_idx <= q_idx) & (q_idx - kv_idx < W[h])

    source = port.generate(Mask("docs_by_head", mask_mod=docs_by_head), 96, 96, heads=2, batch=2)
    assert source.valid_q_len == 96 and source.valid_heads == 2, source.valid_for()
    path = port.write(source, tmp_path)
    script = tmp_path / "fixed.py"
    script.write_text(FIXED)
    done = subprocess.run([sys.executable, str(script), str(path), str(ROOT.parent)], capture_output=True, text=True,
                          env=dict(os.environ, TRITON_INTERPRET="1"), timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.stdout[-2000:] + done.stderr[-3000:]
    out = json.loads(lines[-1])
    assert out["equal_to_attention"] < 1e-5, out
    assert out["long_nan"] is True, out
    assert "seq_lens[0] = 120" in out["long_checked"] and "Generate the port for the longest request" in \
        out["long_checked"], out
    assert "defined for 2 query heads" in out["more_heads"], out


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


PIECES = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, sys.argv[2])
    from workbench import port
    m = port.load(sys.argv[1])
    W = torch.tensor([300, 40, 7, 1000])  # the file's per-head windows (the mask's captured table)
    g = torch.Generator().manual_seed(3)
    reqs = [(1, 300), (3, 77), (1, 16)]  # (queries, seq_len): 19, 5 and 1 tiles of 16 keys
    page, Hq, Hkv, D = 16, 4, 2, 16
    pages = sum(-(-n // page) for _, n in reqs)
    kc = torch.randn(pages, page, Hkv, D, generator=g); vc = torch.randn(pages, page, Hkv, D, generator=g)
    order = torch.randperm(pages, generator=g).to(torch.int32)
    table = torch.full((len(reqs), 20), 10 ** 6, dtype=torch.int32)  # garbage past each request's pages
    at = 0
    for r, (_, n) in enumerate(reqs):
        table[r, :-(-n // page)] = order[at:at - (-n // page)]
        at -= -n // page
    cu = torch.tensor([0, 1, 4, 5], dtype=torch.int32); lens = torch.tensor([n for _, n in reqs], dtype=torch.int32)
    q = torch.randn(5, Hq, D, generator=g)
    # the float64 reference, request by request, from the keys gathered in order
    want, want_lse = torch.empty(5, Hq, D, dtype=torch.float64), torch.empty(5, Hq, dtype=torch.float64)
    for r, (n_q, n) in enumerate(reqs):
        idx = torch.arange(n)
        k = kc[table[r, idx // page].long(), idx % page].double()  # [n, Hkv, D]
        v = vc[table[r, idx // page].long(), idx % page].double()
        for i in range(n_q):
            row, pos = int(cu[r]) + i, n - n_q + i
            for h in range(Hq):
                s = (k[:, h // 2] @ q[row, h].double()) / D ** 0.5
                keep = (idx <= pos) & (pos - idx < W[h])
                s = torch.where(keep, s, float("-inf"))
                want[row, h] = torch.softmax(s, 0) @ v[:, h // 2]
                want_lse[row, h] = torch.logsumexp(s, 0)
    m.SPLIT_WHEN_PROGRAMS_BELOW = 1 << 30  # (the interpreter splits only when told to)
    m.PAGED_MIN_PIECE_KEYS = 16
    for pieces in ("fixed", 2, 7, 25):
        m.PAGED_BALANCE = pieces != "fixed"
        m.PAGED_PIECES = None if pieces == "fixed" else pieces
        m.FAST_SPLIT_KEYS = 64
        with torch.no_grad():
            out, lse = m.attention_paged(q, kc, vc, table, cu, lens, return_lse=True)
        print(json.dumps({"pieces": pieces, "err": float((out.double() - want).abs().max()),
                          "lse_err": float((lse.double() - want_lse).abs().max()),
                          "nan": bool(out.isnan().any() or lse.isnan().any()),
                          "bits": out.view(torch.int32).sum().item()}))
    # invariant mode keeps its fixed cut (its bits must not follow the GPU): the same bits with the
    # even cut asked for
    same = []
    for balance in (False, True):
        m.PAGED_BALANCE, m.PAGED_PIECES = balance, 7 if balance else None
        with torch.no_grad():
            same.append(m.attention_paged(q, kc, vc, table, cu, lens, invariant=True))
    print("INVARIANT", "SAME" if torch.equal(same[0], same[1]) else "DIFFERENT")
""")


def test_fast_modes_even_pieces_cover_each_requests_keys_once(tmp_path):
    """Fast mode's split-KV cuts a request's key tiles into near-equal pieces (PAGED_BALANCE; on a
    GPU as many as fill its program slots): 19 tiles in 2 or 7 pieces, or 25 asked of a request
    that has fewer tiles, with a user's per-head window narrowing each piece. Every cut
    equals the float64 reference (a key read twice or skipped would not), and the cuts are really
    different: their outputs' bits differ. Invariant mode keeps its fixed cut when PAGED_BALANCE
    is on."""
    from workbench import Mask, port

    global W
    import torch

    W = torch.tensor([300, 40, 7, 1000])

    def head_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < W[h])

    path = port.write(port.generate(Mask("head_window", mask_mod=head_window), 300, 300, heads=4), tmp_path / "w")
    script = tmp_path / "pieces.py"
    script.write_text(PIECES)
    done = subprocess.run([sys.executable, str(script), str(path), str(ROOT.parent)], capture_output=True,
                          text=True, env=dict(os.environ, TRITON_INTERPRET="1"), timeout=600)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 4, done.stdout[-2000:] + done.stderr[-3000:]
    for row in rows:
        assert not row["nan"] and row["err"] < 1e-5 and row["lse_err"] < 1e-5, row
    assert len({row["bits"] for row in rows}) >= 3, rows  # the cuts fold different partial sums
    assert "INVARIANT SAME" in done.stdout, done.stdout[-2000:]  # invariant mode ignores PAGED_BALANCE


def test_the_fold_is_a_dependent_launch_only_where_the_gpu_and_triton_have_one(tmp_path, monkeypatch):
    """PAGED_PDL: the fold of split-KV pieces is launched as a programmatic dependent of the kernel
    only on a CUDA GPU of sm_90 or newer, with a Triton that has grid dependency control, never under
    the interpreter or with the switch off (then it is launched after the kernel, as before)."""
    import torch

    from workbench import make, port

    module = port.load(port.build(make("causal"), 64, 64, out_dir=tmp_path))
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(module, "_INTERPRET", False)
    has_gdc = module._gdc_wait is not None
    for capability, want in (((9, 0), has_gdc), ((10, 0), has_gdc), ((8, 0), False), ((8, 9), False)):
        monkeypatch.setattr(module, "_capability", lambda device, c=capability: c)
        assert module._paged_pdl(cuda) == want, capability
        assert module._paged_pdl(cpu) is False
    monkeypatch.setattr(module, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(module, "PAGED_PDL", False)
    assert module._paged_pdl(cuda) is False
    monkeypatch.setattr(module, "PAGED_PDL", True)
    monkeypatch.setattr(module, "_INTERPRET", True)
    assert module._paged_pdl(cuda) is False


def test_fast_modes_pieces_fill_the_gpus_program_slots(tmp_path, monkeypatch):
    """_fast_pieces (PAGED_BALANCE) on a GPU of 132 SMs holding two decode programs each: where the
    fixed cut's programs fill fewer than the 264 slots, or fill one wave and part of a second while
    even pieces can be two at least, as many even pieces per request as fill one wave (never more
    than FOLD_AT_ONCE, nor pieces under PAGED_MIN_PIECE_KEYS keys); else None, the fixed cut, which
    attention_paged then takes; PAGED_PIECES overrides."""
    import torch

    from workbench import make, port

    module = port.load(port.build(make("causal"), 64, 64, out_dir=tmp_path))
    monkeypatch.setattr(module, "_INTERPRET", False)
    monkeypatch.setattr(module, "_sm_count", lambda device: 132)
    monkeypatch.setattr(module, "_programs_per_sm", lambda *args: 2)
    monkeypatch.setattr(module, "FAST_SPLIT_KEYS", 4096)
    cuda = torch.device("cuda", 0)

    def pieces(busy, capacity):
        return module._fast_pieces(busy, capacity, (16, 64, 4, 3), 128, 2, cuda)

    assert pieces(8, 131072) == 33  # one request, 8 kv heads: 264 programs, where 4,096-key pieces give 256
    assert pieces(64, 32768) == 4  # 8 requests x 8 kv heads: 8 fixed pieces each would be 512 programs
    assert pieces(100, 16384) == 2 and pieces(200, 16384) is None  # 400 (two even pieces instead); 800: the fixed cut
    assert pieces(140, 32768) is None  # 1,120 programs of fixed pieces, and one even piece would not split
    assert pieces(64, 8192) == 4  # 2 fixed pieces each (128 programs): 4 fill one wave (256 of 264)
    assert pieces(1, 131072) == 64  # a lone kv head: FOLD_AT_ONCE pieces at most
    assert pieces(8, 1024) == 2  # pieces of at least 512 keys
    assert pieces(300, 131072) is None  # 9,600 programs of fixed pieces
    assert pieces(264, 8192) is None and pieces(263, 2048) == 1  # (one fixed piece each: no split)
    # the launch follows: even pieces for one long request and for eight, the fixed cut for forty
    shape = module._paged_shape(1, 1, 32, 8, 128, 131072, 2, cuda, False)
    assert shape[-3:] == (33, module.PAGED_MIN_PIECE_KEYS, True), shape
    shape = module._paged_shape(8, 8, 32, 8, 128, 32768, 2, cuda, False)
    assert shape[-3:] == (4, module.PAGED_MIN_PIECE_KEYS, True), shape
    shape = module._paged_shape(40, 40, 32, 8, 128, 32768, 2, cuda, False)
    assert shape[-3:] == (8, 4096, False), shape
    monkeypatch.setattr(module, "PAGED_PIECES", 5)
    assert pieces(8, 131072) == 5
    monkeypatch.setattr(module, "PAGED_PIECES", 100)  # (past FOLD_AT_ONCE the fold takes them in turn)
    assert pieces(8, 131072) == 100
    for bad in (0, -3, 2.5, "33", True):
        monkeypatch.setattr(module, "PAGED_PIECES", bad)
        with pytest.raises(ValueError, match=r"PAGED_PIECES = .* must be a whole number of pieces per request, "
                                              r"at least 1, or None"):
            pieces(8, 131072)


# ---------------------------------------------------------------- verify(..., backend="port-paged")

PW = None
PLENS = None


def _users_mods():
    import torch

    from workbench import Mask

    global PW, PLENS
    PW, PLENS = torch.tensor([8, 40, 3, 100]), torch.tensor([20, 50])

    def head_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < PW[h])

    def lens_prefix(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < PLENS[b])

    return {"users_head_window": Mask("users_head_window", mask_mod=head_window),
            "users_lens_prefix": Mask("users_lens_prefix", mask_mod=lens_prefix)}


def _paged_case(name):
    from workbench import make, with_score

    if name == "sinks_window":
        return make("sinks_window"), 40, 100, "float32", "all"
    if name == "causal_decode":  # built for (1, 100): bottom-right, a decode at position 99
        return make("causal", q_len=1, kv_len=100), 1, 100, "float32", "last"
    if name == "causal_top_left":  # built without lengths: offset 0, query 0 sees key 0 alone
        return make("causal"), 1, 100, "float32", "all"
    if name == "sliding_window_chunk_bf16":
        return make("causal_sliding_window", {"window": 20}, q_len=30, kv_len=100), 30, 100, "bfloat16", "last"
    if name == "causal+alibi":
        return with_score(make("causal"), make("alibi", {"num_heads": 4})), 17, 50, "float32", "all"
    return _users_mods()[name], {"users_head_window": 33, "users_lens_prefix": 70}[name], 70, "float32", "all"


@pytest.mark.parametrize("name", ["sinks_window", "causal_decode", "causal_top_left", "sliding_window_chunk_bf16",
                                  "causal+alibi", "users_head_window", "users_lens_prefix"])
def test_verify_judges_the_paged_port_against_the_float64_reference(monkeypatch, name):
    """verify(..., backend="port-paged") lays the inputs over a shuffled paged cache, runs
    attention_paged and compares each request with FlexAttention's view of the mask. A bottom-right
    mask runs as a real chunk / decode (Lq queries at the request's end), others as a whole prefill."""
    from workbench import port
    from workbench.run import Shape
    from workbench.verify import verify

    mask, lq, lk, dtype, queries = _paged_case(name)
    seen = []
    real = port.run_paged_file

    def spy(path, step, **kw):
        seen.append(step)
        return real(path, step, **kw)

    monkeypatch.setattr(port, "run_paged_file", spy)
    verdict = verify(mask, Shape(batch=2, q_heads=4, kv_heads=2, q_len=lq, kv_len=lk, head_dim=16), dtype=dtype,
                     backend="port-paged", seed=5, progress=False)
    assert verdict.passed, verdict.line
    assert all(c.nan_count == 0 for c in verdict.checks)
    assert len(seen) == 1 and seen[0].cu_seqlens_q.tolist() == [0, (lq if queries == "last" else lk),
                                                                2 * (lq if queries == "last" else lk)]
    assert seen[0].block_table[:, -1].tolist() == [1 << 30] * 2  # garbage past the pages: never read
    import torch

    assert torch.isnan(seen[0].k_cache).any() and torch.isnan(seen[0].v_cache).any()  # NaN in unused slots


def test_the_paged_verdict_can_fail():
    """Judged against another mask (a window the port does not have), the same run fails."""
    from workbench import make
    from workbench.run import Shape
    from workbench.verify import verify

    verdict = verify(make("causal", q_len=1, kv_len=100), Shape(batch=1, q_heads=2, kv_heads=2, q_len=1, kv_len=100,
                                                                head_dim=16),
                     dtype="float32", backend="port-paged", seed=0, progress=False,
                     expected=make("causal_sliding_window", {"window": 10}, q_len=1, kv_len=100))
    assert not verdict.passed
    assert max(c.max_abs_err for c in verdict.checks) > 1e-2


def test_paged_verify_refuses_more_queries_than_keys():
    from workbench import WorkbenchError, make
    from workbench.run import Shape
    from workbench.verify import verify

    with pytest.raises(WorkbenchError, match="never more queries than keys"):
        verify(make("full"), Shape(q_len=64, kv_len=32, head_dim=16), dtype="float32", backend="port-paged",
               progress=False)


def test_the_cli_verifies_the_paged_port():
    done = subprocess.run([sys.executable, "-m", "workbench", "verify", "causal_sliding_window", "--param", "window=9",
                           "--q-len", "3", "--kv-len", "80", "--heads", "2", "--head-dim", "16", "--dtype", "float32",
                           "--backend", "port-paged", "--seed", "1"], capture_output=True, text=True, timeout=600,
                          cwd=ROOT.parent)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "PASS" in done.stdout.splitlines()[0], done.stdout


def test_a_register_budget_lets_more_decode_programs_share_an_sm(tmp_path, monkeypatch):
    """_programs_per_sm on an H100's SM (228 KB of shared memory, 65,536 registers): the file's
    decode tile (16 x 64, 4 warps, 2 stages, 168 registers a thread) fits three programs; 16 x 64 of
    3 stages (70 KB of shared memory compiled for sm_90a) fits two by its 253 registers a thread,
    three under a budget of 168; the 16 x 32 tile of 4 stages fits four under 128; and the launch
    asks ptxas for the budget (tests/run_paged_compile.py checks that it keeps it without
    spilling)."""
    import types

    import torch

    from workbench import make, port

    module = port.load(port.build(make("causal"), 64, 64, out_dir=tmp_path))
    props = types.SimpleNamespace(shared_memory_per_multiprocessor=233_472, regs_per_multiprocessor=65_536)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    cuda = torch.device("cuda", 0)
    decode, narrow = (16, 64, 4, 3), (16, 32, 4, 4)
    assert module._programs_per_sm((16, 64, 4, 2), 128, 2, cuda) == 3  # the file's decode tile and budget
    assert module._programs_per_sm(decode, 128, 2, cuda) == 2
    assert module._programs_per_sm(narrow, 128, 2, cuda) == 2
    monkeypatch.setattr(module, "PAGED_MAXNREG", {decode: 168, narrow: 128})
    assert module._programs_per_sm(decode, 128, 2, cuda) == 3
    assert module._programs_per_sm(narrow, 128, 2, cuda) == 4
    assert module._programs_per_sm((16, 64, 4, 4), 128, 2, cuda) == 2  # (no budget; 102 KB: two by shared memory too)
    # the launch: the budget goes with the decode tile's flags, never with invariant mode's
    seen = []
    monkeypatch.setattr(module, "_INTERPRET", False)
    monkeypatch.setattr(module, "_check_paged", lambda *args: (1, 8, 16, 2, 16, 1))
    monkeypatch.setattr(module, "_launch_paged", lambda grid, args, flags, *rest: seen.append(flags))
    monkeypatch.setattr(module, "_paged_shape", lambda *args: (16, 64, 4, 3, 4, 2, 16, 1, 4096, False))
    monkeypatch.setattr(module, "_hopper_paged_ready", lambda *args: False)
    monkeypatch.setattr(module, "_current_device", lambda t: 0)
    q, cache = torch.randn(1, 8, 16), torch.randn(4, 16, 2, 16)
    table, cu, lens = torch.zeros(1, 4, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), torch.tensor([9])
    module.attention_paged(q, cache, cache, table, cu, lens)
    module.attention_paged(q, cache, cache, table, cu, lens, invariant=True)
    assert seen[0]["maxnreg"] == 168 and "maxnreg" not in seen[1], seen


def test_a_tile_the_chip_has_no_room_for_falls_back_to_fewer_stages(tmp_path):
    """_launch_paged on a GPU (the kernel stubbed here): a depth the chip has no room for (Triton's
    OutOfResources) gives way to fewer stages, the depth that ran is kept for the next call, and
    when no depth fits the error names the fix."""
    import importlib.util

    import triton

    from workbench import make, port

    path = port.build(make("causal"), 64, 64, out_dir=tmp_path)
    spec = importlib.util.spec_from_file_location("paged_fallback", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # no interpreter: the GPU path of the launcher
    room, tried = [2], []

    class Kernel:
        def __getitem__(self, grid):
            def launch(*args, num_stages, **flags):
                tried.append(num_stages)
                if num_stages > room[0]:
                    raise triton.runtime.errors.OutOfResources(num_stages * 100_000, 232_448, "shared memory")
            return launch

    module._INTERPRET = False
    module._paged_kernel = Kernel()
    flags = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8)
    module._launch_paged((1, 1, 1), (), flags, 4, "cuda:0")
    assert tried == [4, 3, 2]
    module._launch_paged((1, 1, 1), (), flags, 4, "cuda:0")
    assert tried == [4, 3, 2, 2]  # the depth that ran, alone
    room[0] = 0
    with pytest.raises(RuntimeError, match="put a smaller tile first in this file's PAGED_TILES"):
        module._launch_paged((1, 1, 1), (), dict(flags, BLOCK_N=64), 4, "cuda:0")


def test_the_paged_kernel_compiles_for_sm90_at_decode_and_prefill():
    # Triton's compiler (not the interpreter, which never type-checks a branch it does not take):
    # a decode step that splits its keys (its pieces stored for _paged_fold) and a prefill step,
    # in bf16 (the decode tile under its register budget, PAGED_MAXNREG, kept without spills); the
    # decode step again without the budget
    done = subprocess.run([sys.executable, str(ROOT / "run_paged_compile.py")], capture_output=True, text=True,
                          timeout=900, env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert done.returncode == 0 and "SUMMARY 3/3" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
