"""The benchmarks refuse arguments that name nothing before they touch a GPU."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def refused(main, argv, capsys) -> str:
    """What `main(argv)` printed to stderr on refusing argv (argparse's exit status 2)."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    return capsys.readouterr().err


def test_bench_port_refuses_a_hopper_loop_suffix_it_does_not_know(capsys):
    import bench_port

    err = refused(bench_port.main, ["--hopper", "--loops", "persistent", "persistent+q3"], capsys)
    assert "--loops 'persistent+q3': after '+' only q2, pv0, pv1, pv2, ti0, ti1, fs0, fs1, ls0, ls1 are known" in err
    err = refused(bench_port.main, ["--hopper", "--loops", "persistent+q2+pv2", "pingpong+pv3"], capsys)
    assert "--loops 'pingpong+pv3': after '+' only q2, pv0, pv1, pv2, ti0, ti1, fs0, fs1, ls0, ls1 are known" in err


@pytest.mark.parametrize("tile", ["16x64x4", "16x64x4x0", "16xAx4x3", "16x64x4x2@", "16x64x4x2@999", "16x64x4x2@x"])
def test_bench_paged_refuses_a_tile_that_is_not_four_whole_numbers(capsys, tile):
    import bench_paged

    assert f"{tile!r} is not a tile" in refused(bench_paged.main, ["--tiles", "16x64x4x3", tile], capsys)


def test_bench_paged_reads_tiles_and_knows_its_gpus_bandwidth(monkeypatch):
    import bench_paged

    assert bench_paged._tile("16X32x4x4") == (16, 32, 4, 4)
    assert bench_paged._tile("16x64x4x2@168") == (16, 64, 4, 2, 168)
    for name, tbs in (("NVIDIA H200", 4.8), ("NVIDIA H100 80GB HBM3", 3.35), ("NVIDIA A100-SXM4-80GB", None)):
        monkeypatch.setattr(bench_paged.torch.cuda, "get_device_name", lambda name=name: name)
        assert bench_paged.peak_tbs() == tbs
    assert bench_paged._share(2.9, 3.35) == "2.90 (87%)" and bench_paged._share(2.9, None) == "2.90"


@pytest.mark.parametrize("setting, says", [("HOPPER_BWD", "is not NAME=VALUE"), ("A=b c", "is not a Python literal"),
                                           ("1X=3", "is not NAME=VALUE")])
def test_bench_host_refuses_a_setting_it_cannot_read(capsys, setting, says):
    import bench_host

    assert says in refused(bench_host.main, ["--set", setting], capsys)
    assert bench_host._setting("HOPPER_BWD_PER_HEAD_MIN_PAIRS=0") == ("HOPPER_BWD_PER_HEAD_MIN_PAIRS", 0)


def test_bench_paged_names_each_kernels_time_per_call(monkeypatch):
    import bench_paged

    seen = []

    def kernel_times(step, steps=10):
        seen.append(steps)
        return 0.18, {"_paged_kernel_with_a_name_longer_than_28": 182.5, "_paged_fold": 2.7}

    monkeypatch.setattr(bench_paged, "kernel_times", kernel_times)
    assert bench_paged.kernel_split(None) == "_paged_kernel_with_a_name_lo 182.5, _paged_fold 2.7"
    assert bench_paged._sdpa_kernels(None) == "_paged_fold, _paged_kernel_with_a_name_longer_than_28"
    assert seen == [30, 1]


def test_bench_port_times_training_steps_in_turn_and_reports_medians(monkeypatch):
    """--backward's timing: every path timed once a round, one after another, for --rounds rounds,
    and each path's median reported (a host that drifts between timings reaches every path alike)."""
    import bench_port
    import triton.testing

    order, clock = [], iter([5.0, 9.0, 1.0, 6.0, 8.0, 2.0, 4.0, 7.0, 3.0])

    def fake_bench(fn, warmup, rep):
        order.append(fn())
        return next(clock)

    monkeypatch.setattr(triton.testing, "do_bench", fake_bench)
    got = bench_port.timed_in_turn({"port": lambda: "port", "flex": lambda: "flex", "flash": lambda: "flash"}, 3,
                                   timer=bench_port.step_ms)
    assert order == ["port", "flex", "flash"] * 3
    assert got == {"port": 5.0, "flex": 8.0, "flash": 2.0}


@pytest.mark.parametrize("rounds", ["0", "-2", "x", "2.5"])
def test_bench_port_refuses_rounds_that_are_not_a_whole_number_at_least_one(capsys, rounds):
    import bench_port

    err = refused(bench_port.main, ["--backward", "--rounds", rounds], capsys)
    assert f"{rounds!r} is not a number of rounds: give a whole number, at least 1" in err


def test_bench_paged_times_sdpas_flash_backend_only_where_it_agrees(monkeypatch):
    import bench_paged
    want = torch.ones(2, 3)
    monkeypatch.setattr(bench_paged, "graph_ms", lambda fn, kernels=False: (fn(), 12.5))
    assert bench_paged._flash_us(lambda: torch.ones(2, 3), want) == 12.5
    assert bench_paged._flash_us(lambda: torch.full((2, 3), float("nan")), want).startswith("differs")
    assert bench_paged._flash_us(lambda: torch.ones(2, 3) * 1.5, want).startswith("differs (5.0e-01)")

    def refuses():
        raise RuntimeError("No available kernel. Aborting execution.\nmore")
    assert bench_paged._flash_us(refuses, want) == "cannot run (No available kernel. Aborting execution.)"
    assert bench_paged._ratio(10.0, 12.5) == "0.800x" and bench_paged._ratio(10.0, "cannot run (x)") == "-"


def test_bench_backward_tiles_refuses_a_mask_bench_port_does_not_have(capsys):
    import bench_backward_tiles

    err = refused(bench_backward_tiles.main, ["--pairs", "--masks", "per-head window", "per head window"], capsys)
    assert "--masks 'per head window': not one of bench_port.py's masks" in err and "'per-head window'" in err


def test_bench_host_timeline_finds_the_idle_time_in_a_step(capsys):
    import bench_host

    # two steps of three kernels (µs); the second step waits 5 µs after the first, and 7 inside
    kernels = [("fwd", 0, 10), ("prep", 10, 12), ("bwd", 15, 40),
               ("fwd", 45, 55), ("prep", 62, 64), ("bwd", 64, 90)]
    rows, span, busy = bench_host.timeline(list(reversed(kernels)), 2)
    assert rows == [("fwd", 5, 10), ("prep", 7, 2), ("bwd", 0, 26)]
    assert (span, busy) == (45, 38)
    with pytest.raises(ValueError, match="did not run the same kernels"):
        bench_host.timeline(kernels[:5], 2)
    for steps in ("1", "-3"):
        assert f"--timeline {steps}: give at least 2 steps" in refused(bench_host.main, ["--timeline", steps], capsys)


def test_bench_port_counts_the_pairs_a_mask_keeps_over_its_heads():
    import bench_port
    from workbench import make

    assert bench_port.kept_pairs(make("causal"), 300, 300, 4, "cpu") == 4 * 300 * 301 // 2
    windows = make("per_head_window", {"windows": [16, 64]}, q_len=200, kv_len=200)
    assert bench_port.kept_pairs(windows, 200, 200, 2, "cpu") == sum(min(i + 1, w) for w in (16, 64) for i in range(200))


def test_bench_clocks_refuses_what_names_nothing_and_a_machine_without_a_gpu(capsys, monkeypatch):
    import bench_clocks
    import bench_port

    assert bench_clocks.MASKS == list(bench_port.masks_at(256, 4, "cpu"))  # (its choices: the masks bench_port builds)
    assert "invalid choice: 'causal 1024'" in refused(bench_clocks.main, ["--masks", "causal 1024"], capsys)
    assert "'0' is not a positive int" in refused(bench_clocks.main, ["--rounds", "0"], capsys)
    assert "'-1' is not a positive float" in refused(bench_clocks.main, ["--seconds", "-1"], capsys)
    assert "'x' is not a positive int" in refused(bench_clocks.main, ["--lengths", "x"], capsys)
    err = refused(bench_clocks.main, ["--port-variants", "default", "persistent+ls2"], capsys)
    assert "--port-variants 'persistent+ls2': after '+' only q2, pv0, pv1, pv2, ti0, ti1, fs0, fs1, ls0, ls1 are known" in err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = refused(bench_clocks.main, ["--masks", "causal"], capsys)
    assert "needs a CUDA GPU and nvidia-smi on the PATH" in err and "run it on the GPU machine" in err


class _File:
    """A generated file's Hopper settings, as the module carries them."""
    HOPPER, HOPPER_LOOP, HOPPER_TILE, HOPPER_NAMED, HOPPER_Q_BUFFERS = True, "auto", (128, 0, 8), 0, 1
    HOPPER_UNDER_PV, HOPPER_TILE_INFO, HOPPER_FAST_STORE, HOPPER_LANE_SUMS = 0, 1, 1, 0
    HOPPER_UNDER_PV_CHOSEN = False  # (the default place, or one that spills less where it spills)


def _settings(module):
    return (module.HOPPER_LOOP, module.HOPPER_TILE, module.HOPPER_NAMED, module.HOPPER_Q_BUFFERS,
            module.HOPPER_UNDER_PV, module.HOPPER_TILE_INFO, module.HOPPER_FAST_STORE, module.HOPPER_LANE_SUMS,
            module.HOPPER_UNDER_PV_CHOSEN)


@pytest.mark.parametrize("variant, inside", [
    ("default", ("auto", (128, 0, 8), 0, 1, 0, 1, 1, 0, False)),
    ("persistent+ls1", ("persistent", (128, 0, 8), 0, 1, 0, 1, 1, 1, False)),
    ("pingpong:3@7+pv1", ("pingpong", (128, 3, 8), 7, 1, 1, 1, 1, 0, True)),
    ("persistent+pv2", ("persistent", (128, 0, 8), 0, 1, 2, 1, 1, 0, True)),
    ("persistent+pv0", ("persistent", (128, 0, 8), 0, 1, 0, 1, 1, 0, True)),
    ("persistent@3+q2+ti0+fs0", ("persistent", (128, 0, 8), 3, 2, 0, 0, 0, 0, False)),
    ("+ls1", ("auto", (128, 0, 8), 0, 1, 0, 1, 1, 1, False)),
])
def test_a_hopper_variant_sets_what_it_names_and_puts_every_setting_back(variant, inside):
    import bench_port

    module = _File()
    before = _settings(module)
    with bench_port.hopper_variant(module, variant):
        assert _settings(module) == inside
    assert _settings(module) == before
    with pytest.raises(RuntimeError), bench_port.hopper_variant(module, variant):  # (put back after a failed call too)
        raise RuntimeError("the call failed")
    assert _settings(module) == before


def test_a_hopper_variant_reads_the_settings_a_generated_file_has(tmp_path):
    import bench_port

    from workbench import make, port

    module = port.load(port.build(make("causal"), 128, 128, out_dir=tmp_path))
    before = _settings(module)
    with bench_port.hopper_variant(module, "persistent@3+ls1+pv1"):
        assert (module.HOPPER_LOOP, module.HOPPER_NAMED, module.HOPPER_LANE_SUMS, module.HOPPER_UNDER_PV) == (
            "persistent", 3, 1, 1)
    assert _settings(module) == before


def test_sass_loops_refuses_a_setting_or_a_cubin_that_names_nothing(capsys, tmp_path):
    import sass_loops

    err = refused(sass_loops.main, ["--port", "causal", "--set", "LANE_SUMS=0"], capsys)
    assert "'LANE_SUMS=0' is not NAME=INTEGER with a HOPPER_ name (e.g. HOPPER_LANE_SUMS=0)" in err
    err = refused(sass_loops.main, ["--port", "--set", "HOPPER_NAMED=x"], capsys)
    assert "'HOPPER_NAMED=x' is not NAME=INTEGER" in err
    err = refused(sass_loops.main, ["--cubin", str(tmp_path / "missing.cubin")], capsys)
    assert "--cubin " in err and "missing.cubin: no such file" in err
    assert "one of the arguments --port --cubin is required" in refused(sass_loops.main, [], capsys)
    (tmp_path / "text.cubin").write_text("not a cubin")
    assert "nvdisasm could not read" in refused(sass_loops.main, ["--cubin", str(tmp_path / "text.cubin")], capsys)
    err = refused(sass_loops.main, ["--port", "no_such_mask"], capsys)
    assert "no library mask named 'no_such_mask'" in err and "python -m workbench list" in err
