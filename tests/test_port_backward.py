"""The port's backward (#31): dq, dk, dv and learnable tables' gradients of the generated file,
against the float64 reference's autograd, under Triton's interpreter in a fresh process
(tests/run_port_backward.py: the corpus, random grammar mods, learnable tables, rows that keep
nothing, packed documents, a gradient into lse, Lq = 1, Lq > Lk, bf16 at D = 40, deterministic=True
bitwise, a finite-difference check, and
the calls it must refuse); and verify(backend="port", backward=True) end to end."""

import sys
from pathlib import Path

import pytest
import torch

from workbench import Mask, make
from workbench.cli import main
from workbench.run import Shape
from workbench.verify import verify

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from run_port_backward import REFUSALS, cases  # noqa: E402

N_RANDOM = 4
CASE_IDS = [f"{case}-{dtype}" for case, _, _, dtype, _ in cases(N_RANDOM)] + list(REFUSALS)


@pytest.fixture(scope="module")
def backward_results(early_run):
    done = early_run("port_backward")  # tests/run_port_backward.py cpu N_RANDOM, started at collection (conftest)
    results = {line.split()[1].rstrip(":"): line for line in done.stdout.splitlines() if line.startswith("CASE ")}
    assert results, done.stdout[-4000:] + done.stderr[-3000:]
    return results


@pytest.mark.slow
@pytest.mark.parametrize("case", CASE_IDS)
def test_the_ports_backward_equals_the_float64_reference(backward_results, case):
    line = backward_results.get(case)
    assert line is not None, f"{case} did not run"
    assert line.split()[2].rstrip(":") == "OK", line


def test_verify_judges_the_ports_gradients_and_a_learnable_tables(capsys):
    """A user's learnable relative-position bias (a leaf tensor captured by the score_mod): verify
    runs the port's backward and compares dq, dk, dv and dbias with the reference's."""
    bias = (torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 0.3).requires_grad_()

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def relative(score, b, h, q_idx, kv_idx):
        return score + bias[h, (q_idx - kv_idx).clamp(0, 63)]

    mask = Mask("learned_relative_bias", mask_mod=causal, score_mod=relative, data={"bias": bias})
    verdict = verify(mask, Shape(batch=1, q_heads=4, kv_heads=2, q_len=70, kv_len=70, head_dim=16), dtype="float32",
                     backend="port", backward=True, seed=0)
    checked = {c.name: c for c in verdict.checks}
    assert verdict.passed and {"dq", "dk", "dv", "dbias"} <= set(checked), verdict.line
    assert checked["dbias"].max_abs_err < 1e-4
    # the CLI, as a user types it on a laptop
    code = main(["verify", "causal_sliding_window", "--param", "window=20", "--q-len", "50", "--kv-len", "77",
                 "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--dtype", "float32", "--backend", "port",
                 "--backward", "--seed", "3"])
    out = capsys.readouterr().out
    assert code == 0 and "PASS" in out and "dk" in out, out


def test_a_wrong_port_backward_fails_verify(tmp_path):
    """The judge can fail: a port file whose backward is off by 10% in ds is caught."""
    from workbench import port
    from workbench.run import PortBackend

    path = port.build(make("causal"), 64, 64, out_dir=tmp_path)
    text = path.read_text()
    assert "    ds = p * (dp - delta)\n" in text
    path.write_text(text.replace("    ds = p * (dp - delta)\n", "    ds = 1.1 * p * (dp - delta)\n"))
    verdict = verify(make("causal"), Shape(q_heads=2, q_len=64, kv_len=64, head_dim=16), dtype="float32",
                     backend=PortBackend(path), backward=True, seed=0)
    failed = {c.name for c in verdict.checks if not c.passed}
    assert not verdict.passed and {"dq", "dk"} <= failed and "out" not in failed, verdict.line


def test_conformance_judges_a_backward_on_the_golden_gradients(tmp_path, capsys):
    """Golden vectors carry grad_out, dq, dk, dv: the spec's own port passes `conformance
    --backward`; the same port with a backward 10% off in ds fails on its gradients alone; an
    implementation that runs under no_grad is told it carries no gradient."""
    import json

    from workbench import with_score
    from workbench.export import build_spec, conformance, write_spec

    mask = with_score(make("causal_sliding_window", {"window": 40}, q_len=100, kv_len=100), make("softcap", {"cap": 5.0}))
    spec = build_spec(mask, 100, 100, heads=2, head_dim=16, seed=0, generalize=False)
    json_path, _ = write_spec(spec, tmp_path)
    port_file = json_path.with_name(spec.doc["backends"]["triton_attention"]["file"])
    code = main(["conformance", str(json_path), "--impl", f"{port_file}:attention", "--backward", "--json"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and summary["passed"] and all(r["dk_max_abs_err"] < 1e-4 for r in summary["vectors"]), summary

    text = port_file.read_text()
    port_file.write_text(text.replace("    ds = p * (dp - delta)\n", "    ds = 1.1 * p * (dp - delta)\n"))
    report = conformance(json_path, str(port_file), backward=True)
    # ("gradients wrong" is said only where the output itself passed: the forward is still right)
    assert not report.passed and all("gradients wrong" in r["message"] and "dq" in r["message"] for r in report.rows), \
        report.to_frame().to_string()

    def under_no_grad(q, k, v, spec):
        with torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    report = conformance(json_path, under_no_grad, backward=True)
    assert not report.passed and "carries no gradient" in report.rows[0]["message"], report.rows[0]

    doc = json.loads(json_path.read_text())  # a spec exported before golden gradients existed
    doc["golden"].pop("gradients")
    json_path.write_text(json.dumps(doc))
    from workbench.define import WorkbenchError

    with pytest.raises(WorkbenchError, match="carry no gradients"):
        conformance(json_path, str(port_file), backward=True)

