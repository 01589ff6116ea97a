import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.fixture
def cuda():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return "cuda"


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """Each test that takes `device` runs on the CPU and, under `-m gpu`, on CUDA (skipped where
    there is none): one test body for both, sized by the device where it must be."""
    import torch

    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return request.param



# ---------------------------------------------------------------- interpreter scripts, started early
# Six test modules judge the port by scripts that run many cases under Triton's CPU interpreter
# in a fresh process (minutes each, single-threaded). They start together when collection ends, so
# they run on the cores the test process leaves idle; each module's fixture then waits for its own
# (the `early_run` fixture). Their output goes to files (a full pipe would stall them).
EARLY = {  # key: (test module, the fixture or test that reads it, the script and its arguments)
    "port_paged": ("test_port_paged.py", "paged_results", ["run_port_paged.py", "cpu", "3"]),
    "port_paged_corpus": ("test_port_paged.py", "corpus_results", ["run_port_paged.py", "cpu", "1", "corpus"]),
    "port_lengths": ("test_port_lengths.py", "calls", ["run_port_lengths.py", "cpu", "7"]),
    "port_backward": ("test_port_backward.py", "backward_results", ["run_port_backward.py", "cpu", "4"]),
    "port_corpus": ("test_port.py", "corpus_results", ["run_port_corpus.py", "cpu", "10", "float32", "conformance"]),
    "port_invariant": ("test_serving.py", "test_invariant_contiguous_calls_equal_the_reference",
                       ["run_port_invariant.py", "cpu"]),
    "triton_scan": ("test_blocks.py", "test_triton_scan_equals_eager_on_the_library_in_the_interpreter",
                    ["run_triton_scan.py", "cpu"]),
    "fa4_compile": ("test_fa4.py", "test_the_cute_dsl_compiles_in_fa4s_hopper_kernel", ["run_fa4_compile.py", "all"]),
}
_started: dict = {}


def _start(key: str):
    import subprocess
    import tempfile

    _, _, argv = EARLY[key]
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / argv[0]), *argv[1:]], stdout=out, stderr=err,
                            text=True, env=env)
    _started[key] = (proc, out, err)


# modules that take minutes on a 2-core machine (`pytest --durations=0`, summed per file), longest
# first. `make test` hands whole files to its two workers in collection order
# (--no-loadscope-reorder), so these start at once and the short ones fill in behind them; a long
# file left for last would keep one worker busy while the other sits idle
LONG_MODULES = ["test_port_paged.py", "test_port.py", "test_distribute.py", "test_bounds.py", "test_serving.py",
                "test_sweep.py", "test_hopper.py", "test_cli.py", "test_notebooks.py", "test_port_backward.py",
                "test_trust.py", "test_report.py", "test_browser.py", "test_invariance.py"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(rank)))  # (stable: a file's own order)


def pytest_collection_finish(session):
    if session.config.getoption("collectonly", False) or os.environ.get("PYTEST_XDIST_WORKER"):
        # (under pytest-xdist each worker collects every test: a script starts when a test asks; `make
        # test` runs --dist loadfile, so a module, its fixtures and its script stay on one worker)
        return
    for key, (test_file, reader, _) in EARLY.items():
        wanted = any(Path(str(item.fspath)).name == test_file and (reader in item.fixturenames
                                                                   or item.name.split("[")[0] == reader)
                     for item in session.items)
        if wanted and key not in _started:
            _start(key)


def _early_run(key: str, timeout: float = 2400):
    """The finished run of EARLY[key] (started at collection, or now): a CompletedProcess."""
    import subprocess

    if key not in _started:
        _start(key)
    proc, out, err = _started[key]
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    out.seek(0)
    err.seek(0)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())


@pytest.fixture(scope="session")
def early_run():
    """early_run(key) -> the CompletedProcess of EARLY[key]'s script (see above)."""
    return _early_run


def pytest_sessionfinish(session, exitstatus):  # noqa: ARG001 (a run that no test waited for is stopped)
    for proc, _, _ in _started.values():
        if proc.poll() is None:
            proc.kill()
