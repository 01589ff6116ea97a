"""Trust, round three: the entry points added last (the port, its generated `attention()`,
invariance, sweep, verify --workers, conformance with a port) claim only what holds, and bad input
gets an error that names the cause and the fix. Each test reproduces a reported case and fails on
the code before the fix. (The port at other lengths: test_port_lengths.py.)"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from helpers import cli
from workbench import Mask, invariance, make, port
from workbench.define import WorkbenchError
from workbench.run import Shape
from workbench.verify import verify

ROOT = Path(__file__).resolve().parents[1]


def refused(capsys, *argv, match):
    rc, text = cli(capsys, *argv)
    assert rc == 2, (rc, text[-2000:])
    assert "Traceback" not in text and "internal error" not in text, text[-2000:]
    assert match.lower() in text.lower(), text[-2000:]
    return text


# ---------------------------------------------------------------- the generated attention(), called badly

CALLS = textwrap.dedent('''
    import json, sys, torch
    sys.path.insert(0, sys.argv[2])
    from workbench import port
    module = port.load(sys.argv[1])
    q = torch.randn(1, 2, 128, 16); k = torch.randn(1, 2, 128, 16); v = torch.randn(1, 2, 128, 16)
    cases = {
        "float_cu_seqlens": lambda: module.attention(q, k, v, cu_seqlens=torch.tensor([0., 63.7, 128.])),
        "float_list_cu_seqlens": lambda: module.attention(q, k, v, cu_seqlens=[0, 63.7, 128]),
        "2d_cu_seqlens": lambda: module.attention(q, k, v, cu_seqlens=torch.tensor([[0, 64], [64, 128]])),
        "zero_kv_heads": lambda: module.attention(q, torch.randn(1, 0, 128, 16), torch.randn(1, 0, 128, 16)),
        "requires_grad": lambda: module.attention(q.clone().requires_grad_(), k, v),
        "no_grad_is_fine": lambda: torch.no_grad().__enter__() or module.attention(q.clone().requires_grad_(), k, v),
        "empty_batch": lambda: module.attention(q[:0], k[:0], v[:0], return_lse=True),
    }
    for name, call in cases.items():
        try:
            got = call()
            shape = [list(t.shape) for t in got] if isinstance(got, tuple) else list(got.shape)
            grad = bool(got.requires_grad) if isinstance(got, torch.Tensor) else False
            print(json.dumps({"case": name, "ok": True, "shape": shape, "grad": grad}))
        except Exception as exc:
            print(json.dumps({"case": name, "ok": False, "type": type(exc).__name__, "message": str(exc)}))
''')


@pytest.fixture(scope="module")
def bad_calls(tmp_path_factory):
    pytest.importorskip("triton")
    folder = tmp_path_factory.mktemp("port")
    path = port.build(make("causal"), 128, 128, out_dir=folder)
    script = folder / "calls.py"
    script.write_text(CALLS)
    done = subprocess.run([sys.executable, str(script), str(path), str(ROOT)], capture_output=True, text=True,
                          env=dict(os.environ, TRITON_INTERPRET="1"), timeout=600)
    records = {r["case"]: r for r in (json.loads(line) for line in done.stdout.splitlines() if line.startswith("{"))}
    assert records, done.stdout[-2000:] + done.stderr[-2000:]
    return records, path


def test_non_integer_cu_seqlens_are_refused(bad_calls):
    records, _ = bad_calls
    for case in ("float_cu_seqlens", "float_list_cu_seqlens"):
        r = records[case]
        assert not r["ok"] and r["type"] == "TypeError" and "integer" in r["message"], r
    r = records["2d_cu_seqlens"]
    assert not r["ok"] and "1-d" in r["message"] and "(2, 2)" in r["message"], r


def test_zero_kv_heads_name_the_heads(bad_calls):
    r = bad_calls[0]["zero_kv_heads"]
    assert not r["ok"] and r["type"] == "ValueError" and "Hkv = 0" in r["message"], r


def test_inputs_that_require_grad_give_an_output_that_carries_gradients(bad_calls):
    """The port has a backward (tests/test_port_backward.py judges it); under no_grad it runs the
    forward alone."""
    r = bad_calls[0]["requires_grad"]
    assert r["ok"] and r["grad"] and r["shape"] == [1, 2, 128, 16], r
    r = bad_calls[0]["no_grad_is_fine"]
    assert r["ok"] and not r["grad"], r


def test_an_empty_batch_gives_empty_outputs(bad_calls):
    r = bad_calls[0]["empty_batch"]
    assert r["ok"] and r["shape"] == [[0, 2, 128, 16], [0, 2, 128]], r


def test_cpu_tensors_without_the_interpreter_say_how(bad_calls):
    """In a process without TRITON_INTERPRET=1 the file loads, and a CPU call says what to set."""
    _, path = bad_calls
    code = ("import sys, torch; sys.path.insert(0, sys.argv[2]); from workbench import port; m = port.load(sys.argv[1])\n"
            "try:\n    m.attention(torch.randn(1, 1, 8, 16), torch.randn(1, 1, 8, 16), torch.randn(1, 1, 8, 16))\n"
            "except RuntimeError as e:\n    print('REFUSED', e)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code, str(path), str(ROOT)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert "REFUSED" in done.stdout and "TRITON_INTERPRET=1" in done.stdout, done.stdout + done.stderr[-2000:]
    assert "active drivers" not in done.stdout


# ---------------------------------------------------------------- port: what it supports, before writing

@pytest.mark.parametrize("flags, match", [(("--head-dim", "512"), "head dims up to 256"),
                                          (("--dtype", "float64"), "bfloat16, float16, float32")])
def test_port_refuses_what_it_cannot_run_before_writing(capsys, tmp_path, flags, match):
    text = refused(capsys, "port", "causal", "--q-len", "64", "--device", "cpu", "-o", tmp_path / "p", *flags,
                   match=match)
    assert "generate it again" not in text
    assert not (tmp_path / "p").exists() or not any((tmp_path / "p").iterdir())


def test_verify_port_refuses_a_head_dim_it_cannot_run():
    with pytest.raises(WorkbenchError, match="head dims up to 256"):
        verify(make("causal"), Shape(q_len=16, head_dim=320), dtype="float32", backend="port")


# ---------------------------------------------------------------- invariance: a check of nothing never passes

def test_invariance_hold_of_a_layout_that_is_not_run_is_an_error(capsys):
    refused(capsys, "invariance", "causal", "--q-len", "64", "--heads", "1", "--head-dim", "16", "--batch", "2",
            "--dtype", "float32", "--device", "cpu", "--layouts", "run", "--hold", "decode",
            match="--hold names decode, which --layouts does not run")


def test_invariance_result_with_nothing_held_does_not_pass():
    result = invariance.InvarianceResult("m", "flex", "float32", "cpu", Shape(q_len=8), (128, 128))
    assert not result.passed and "NOT CHECKED" in result.line
    result.layouts.append(invariance.LayoutResult("run", "again", True, 0.0, 0, None, "", held=False))
    assert not result.passed  # the only layout ran but was not held
    result.layouts.append(invariance.LayoutResult("batched", "batch", True, 0.0, 0, None, "", held=True))
    result.unrun = ["decode"]
    assert not result.passed and "held but not run: decode" in result.line
    result.unrun = []
    assert result.passed


# ---------------------------------------------------------------- memory the allocator holds counts as free

def test_device_memory_counts_the_allocators_cached_bytes(monkeypatch):
    from workbench.blocks import device_memory

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (4 << 30, 140 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 135 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 40 << 30)
    assert device_memory(torch.device("cuda")) == (4 + 95) << 30


# ---------------------------------------------------------------- devices

@pytest.mark.parametrize("command", ["blocks", "verify", "port", "invariance"])
def test_meta_device_is_a_clear_refusal(capsys, tmp_path, command):
    extra = ["-o", str(tmp_path)] if command == "port" else []
    refused(capsys, command, "causal", "--q-len", "64", "--device", "meta", *extra, match="meta holds shapes")


def test_a_meta_tensor_in_a_closure_is_named(capsys, tmp_path):
    (tmp_path / "metamods.py").write_text("import torch\nt = torch.ones(4, device='meta')\n"
                                          "def meta_table(b, h, q_idx, kv_idx):\n    return kv_idx < t[h] + q_idx\n")
    for command in ("verify", "port"):
        extra = ["-o", str(tmp_path / "o")] if command == "port" else []
        refused(capsys, command, f"{tmp_path / 'metamods.py'}:meta_table", "--q-len", "32", "--device", "cpu",
                *extra, match="'t' on meta")


# ---------------------------------------------------------------- sweeps

@pytest.mark.parametrize("body, match", [
    ('[defaults]\nq_len = []\n[[case]]\ntarget = "causal"\n', "q_len = [], an empty grid axis"),
    ('[defaults]\nq_len = 0\n[[case]]\ntarget = "causal"\n', "q_len = 0; sizes are positive"),
    ('[[case]]\ntarget = "causal"\nq_len = 64\nheads = [2, -1]\n', "heads = -1"),
    ('[[case]]\ntarget = "causal"\nq_len = 64\nparams = { window = [] }\n', "params.window = []"),
    ('[[case]]\ntarget = "causal"\nq_len = 64\nbackend = "fa9"\n', "backend = 'fa9'"),
    ('[[case]]\ntarget = "causal"\nq_len = 64\ndtype = "float8"\n', 'dtype = "float8"'),
])
def test_bad_sweep_axes_fail_before_ray(capsys, tmp_path, body, match):
    (tmp_path / "s.toml").write_text(body)
    refused(capsys, "sweep", tmp_path / "s.toml", "-o", tmp_path / "out", match=match)


def test_a_sweep_without_a_parquet_engine_names_the_extra(monkeypatch, tmp_path):
    import importlib.util

    from workbench import sweep

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("pyarrow", "fastparquet") else real(name, *a))
    with pytest.raises(WorkbenchError, match=r"pip install 'flex-workbench\[sweep\]'"):
        sweep.run(ROOT / "examples" / "sweep_small.toml", tmp_path)


def test_a_missing_optional_package_is_one_line_naming_the_extra(capsys, monkeypatch):
    from workbench import cli as cli_module

    def needs_ray(args):
        raise ModuleNotFoundError("No module named 'ray'", name="ray")

    monkeypatch.setattr(cli_module, "cmd_list", needs_ray)
    rc, text = cli(capsys, "list")
    assert rc == 2 and "pip install 'flex-workbench[sweep]'" in text and "bug" not in text, text


def test_ray_that_cannot_start_is_reported_with_what_to_do(capsys, monkeypatch):
    ray = pytest.importorskip("ray")
    from workbench import cluster

    tries = []

    def slow_node(*args, **kwargs):
        tries.append(1)
        raise Exception("The current node timed out during startup. This could happen because some of the raylet "
                        "failed to startup or the GCS has become overloaded.")

    monkeypatch.setattr(ray, "init", slow_node)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(cluster.time, "sleep", lambda s: None)
    text = refused(capsys, "verify", "causal", "--q-len", "64", "--head-dim", "16", "--dtype", "float32",
                   "--device", "cpu", "--workers", "2", match="Ray could not start on this machine")
    assert "timed out during startup" in text and "--address" in text
    assert len(tries) == cluster.RAY_START_TRIES


# ---------------------------------------------------------------- conformance runs the spec's own port

def test_conformance_runs_the_port_export_wrote(capsys, tmp_path):
    pytest.importorskip("triton")
    from workbench.export import build_spec, write_spec

    spec = build_spec(make("causal_sliding_window", {"window": 40}), 96, 96, heads=2, head_dim=16, seed=0,
                      generalize=False)
    json_path, _ = write_spec(spec, tmp_path)
    port_file = json_path.with_name(spec.doc["backends"]["triton_attention"]["file"])
    rc, text = cli(capsys, "conformance", json_path, "--impl", f"{port_file}:attention")
    assert rc == 0 and "2/2" in text, text[-2000:]


def test_conformance_calls_a_three_argument_attention_without_the_spec(tmp_path):
    from workbench.export import build_spec, conformance, write_spec
    from workbench.verify import reference_attention
    from workbench.run import Inputs

    mask = make("causal")
    spec = build_spec(mask, 32, 32, heads=1, head_dim=8, seed=0, generalize=False)
    json_path, _ = write_spec(spec, tmp_path)

    def attention(q, k, v):  # FlexAttention's signature, no spec
        shape = Shape(q_heads=q.shape[1], q_len=q.shape[2], kv_len=k.shape[2], head_dim=q.shape[3])
        return reference_attention(mask, Inputs(q=q, k=k, v=v, shape=shape, dtype="float32", seed=0)).out.float()

    report = conformance(json_path, attention)
    assert report.passed, report.rows


# ---------------------------------------------------------------- verify judges a mod that changes

def test_a_mod_that_drifts_between_calls_is_named_before_any_kernel_runs():
    calls = [0]

    def drifting(b, h, q_idx, kv_idx):
        calls[0] += 1
        return kv_idx <= q_idx + (calls[0] // 7) % 5

    for backend in ("eager", "port") if port.triton_installed() else ("eager",):
        calls[0] = 0
        with pytest.raises(WorkbenchError, match="gives other values when called again.*changes between calls"):
            verify(Mask("drifting", mask_mod=drifting), Shape(q_len=64, head_dim=16), dtype="float32",
                   backend=backend, seed=0)


def test_a_mod_that_changes_during_the_run_fails_with_its_cause():
    """A mod whose global is changed while the kernel runs (a slower drift than the probe sees):
    the verdict fails and names the cause, whatever the comparison says."""
    from workbench.verify import findings

    state = {"shift": 0}

    def shifting(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + state["shift"]

    mask = Mask("shifting", mask_mod=shifting)
    shape = Shape(q_len=64, head_dim=16)
    before = findings._mod_snapshot(mask, shape, "cpu")
    state["shift"] = 3  # what a run that changes it would leave
    assert findings._changed_roles(mask, before) == ["mask_mod"]
    state["shift"] = 0
    assert findings._changed_roles(mask, findings._mod_snapshot(mask, shape, "cpu")) == []


def test_a_pure_mod_has_no_stateful_finding():
    verdict = verify(make("causal"), Shape(q_len=32, head_dim=16), dtype="float32", seed=0)
    assert verdict.passed and not any(f.kind == "stateful_mod" for f in verdict.findings)


# ---------------------------------------------------------------- diff reads specs of older versions

def test_diff_reads_a_spec_whose_goldens_have_no_digests(capsys, tmp_path):
    from workbench.export import build_spec, write_spec

    spec = build_spec(make("causal"), 64, 64, heads=1, head_dim=8, seed=0, generalize=False)
    json_path, _ = write_spec(spec, tmp_path)
    doc = json.loads(json_path.read_text())
    del doc["golden"]["sha256"]  # as an older version wrote it
    json_path.write_text(json.dumps(doc))
    rc, text = cli(capsys, "diff", json_path, json_path)
    assert rc == 0 and "SAME" in text, text
    refused(capsys, "conformance", json_path, "--impl", "x.py:f", match="no sha256 digests")  # still checked there


# ---------------------------------------------------------------- no Triton installed

def test_report_without_triton_says_port_not_checked(monkeypatch, tmp_path):
    from workbench import report

    monkeypatch.setattr(port.files, "triton_installed", lambda: False)
    result = report.MaskResult(target="causal", params={})
    result.mask = make("causal")
    report.port_target(result, 1, "cpu", tmp_path)
    assert result.port_verdict is None and "port not checked: Triton is not installed" in result.port_note
    with pytest.raises(WorkbenchError, match="needs Triton"):
        port.run_file(tmp_path / "x.py", torch.zeros(1), torch.zeros(1), torch.zeros(1))


# ---------------------------------------------------------------- factory parameters

def test_a_parameter_of_the_wrong_type_is_named(capsys):
    refused(capsys, "blocks", "document", "--param", 'doc_lengths="abc"', "--q-len", "64",
            match='parameter doc_lengths takes list[int] | None, got "abc"')


def test_a_factory_out_of_memory_names_the_size(capsys):
    refused(capsys, "blocks", "document", "--q-len", "100000000000", match="ran out of memory building the mask at "
                                                                          "q_len=100,000,000,000")
