# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# A CPU build of torch, so no install ever pulls a CUDA build on a machine without a GPU.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: demo test test-slow lint test-gpu bench-gpu lab venv clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

## the main job: the whole built-in library on the default device -> out/report.html, out/summary.{json,csv}
demo: $(STAMP)
	$(PY) -m workbench report -o out

## the test suite (CPU); GPU tests run with `make test-gpu` on a CUDA machine
test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder

## the exhaustive CPU sweeps left out of `make test` (marked slow: every case of the interpreter
## scripts, minute-long end-to-end runs); CI runs them after `make test`
test-slow: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder -m "slow and not gpu"

## pyflakes and unused-argument rules over the tree (configured in pyproject.toml)
lint: $(STAMP)
	$(VENV)/bin/ruff check .

test-gpu: $(STAMP)
	$(PY) -m pytest -m gpu

## every benchmark on a CUDA machine, with its own torch (not the venv's CPU build); logs in out/bench/
BENCH := out/bench
bench-gpu:
	mkdir -p $(BENCH)
	$(PYTHON) benchmarks/bench_blocks.py --lengths 8192 32768 131072 1048576 > $(BENCH)/blocks.md
	$(PYTHON) benchmarks/bench_blocks.py --knob > $(BENCH)/knob.md
	$(PYTHON) benchmarks/bench_blocks.py --tune --lengths 1048576 > $(BENCH)/tune.md
	$(PYTHON) benchmarks/bench_app.py --length 32768 > $(BENCH)/app.md
	$(PYTHON) benchmarks/bench_attention.py > $(BENCH)/attention.md
	$(PYTHON) benchmarks/bench_port.py --lengths 8192 32768 --decode > $(BENCH)/port.md
	$(PYTHON) benchmarks/bench_port.py --segments > $(BENCH)/segments.md
	$(PYTHON) benchmarks/bench_port.py --serving > $(BENCH)/serving.md
	$(PYTHON) benchmarks/bench_paged.py > $(BENCH)/paged.md
	$(PYTHON) benchmarks/bench_port.py --backward --lengths 8192 32768 > $(BENCH)/backward.md
	$(PYTHON) benchmarks/bench_port.py --fa4 --lengths 8192 32768 > $(BENCH)/fa4.md
	$(PYTHON) benchmarks/bench_port.py --hopper --loops auto --lengths 8192 32768 --rounds 3 > $(BENCH)/hopper.md
	$(PYTHON) benchmarks/bench_clocks.py --masks causal "sliding window 1024" "document (8 docs)" > $(BENCH)/clocks.md
	$(PYTHON) benchmarks/bench_verify.py --lengths 262144 1048576 > $(BENCH)/verify.md

## JupyterLab on notebooks/
lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/ $$( [ "$$(id -u)" = 0 ] && echo --allow-root )

clean:
	rm -rf out .pytest_cache
