"""The command line, as a user runs it."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "workbench", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


def test_help_on_every_subcommand(capsys):
    import pytest

    from workbench.cli import main

    for sub in (["list"], ["report"], ["blocks"], ["verify"], ["export"], ["conformance"], ["diff"], ["port"]):
        with pytest.raises(SystemExit) as done:  # argparse prints the help and exits 0
            main([*sub, "--help"])
        assert done.value.code == 0 and "usage" in capsys.readouterr().out, sub
    out = run("--help")  # and once as a process, the way a user types it
    assert out.returncode == 0 and all(cmd in out.stdout for cmd in ("verify", "export", "conformance", "diff"))


def test_list():
    out = run("list")
    names = [line.split()[0] for line in out.stdout.splitlines()]
    assert out.returncode == 0 and {"causal", "document", "tree", "alibi"} <= set(names)


def test_blocks_json_keys():
    out = run("blocks", "causal_sliding_window", "--param", "window=100", "--q-len", "1000", "--kv-len", "1000",
              "--block-size", "64", "--device", "cpu", "--json")
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout)
    for key in ("q_len", "kv_len", "block_size", "full_blocks", "partial_blocks", "empty_blocks", "kept_pairs",
                "fully_masked_rows"):
        assert key in record
    assert record["kept_pairs"] == sum(min(i + 1, 100) for i in range(1000))
    assert record["engine"] == "eager" and record["evaluator"] == "broadcast"


def test_blocks_triton_engine_on_cpu_is_a_named_error():
    out = run("blocks", "causal", "--q-len", "256", "--device", "cpu", "--engine", "triton")
    assert out.returncode == 2 and "runs on CUDA" in out.stderr and "Fix:" in out.stderr


def test_blocks_writes_pictures(tmp_path):
    out = run("blocks", "document", "--q-len", "700", "--device", "cpu", "-o", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert {p.name for p in tmp_path.iterdir()} == {"block_map.png", "overview.png", "token_view.png"}
    assert "density" in out.stdout


def test_report_on_user_file_with_one_broken_mask(tmp_path):
    good = tmp_path / "my_masks.py"
    good.write_text("def banded(width=8):\n    def banded_mask(b, h, q_idx, kv_idx):\n"
                    "        return (q_idx - kv_idx).abs() <= width\n    return banded_mask\n")
    bad = tmp_path / "broken.py"
    bad.write_text("def f(:\n")
    out = run("report", f"{good}:banded", f"{bad}:f", "causal", "--param", "width=64", "--q-len", "512",
              "--device", "cpu", "-o", str(tmp_path / "out"))
    assert out.returncode == 1
    assert "broken.py" in out.stderr and "SyntaxError" in out.stderr and "Fix:" in out.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    by_target = {m["target"].split("/")[-1]: m for m in summary["masks"]}
    assert by_target["my_masks.py:banded"]["error"] is None
    assert by_target["my_masks.py:banded"]["params"] == {"width": 64}
    verdict = by_target["my_masks.py:banded"]["verify"]
    assert verdict["passed"] is True and verdict["q_len"] == 512 and verdict["rel_err"] < 1e-5
    html = (tmp_path / "out" / "report.html").read_text()
    assert "banded" in html and "SyntaxError" in html and "Verification" in html and "data:image/png;base64" in html


def test_unknown_param_exits_non_zero():
    out = run("blocks", "causal", "--param", "nope=1", "--q-len", "64", "--device", "cpu")
    assert out.returncode == 2 and "unknown parameter 'nope'" in out.stderr and "Fix:" in out.stderr


def test_list_shows_parameters_and_defaults():
    out = run("list")
    assert out.returncode == 0
    assert "parameters: window=256" in out.stdout and "doc_lengths=null (picked from the lengths)" in out.stdout
