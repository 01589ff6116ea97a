"""The benchmarks refuse arguments that name nothing before they touch a GPU."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_bench_port_refuses_a_hopper_loop_suffix_it_does_not_know(capsys):
    import bench_port

    with pytest.raises(SystemExit) as stop:
        bench_port.main(["--hopper", "--loops", "persistent", "persistent+q3"])
    assert stop.value.code == 2
    assert "--loops 'persistent+q3': after '+' only q2" in capsys.readouterr().err
