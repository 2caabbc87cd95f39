# Two commands do all set-up on a fresh CPU machine (Python 3.11 + pip, no conda):
#   make demo     -> creates .venv, installs, runs the CPU smoke sweep end to end under the name "demo"
#                    (results/demo, figures/demo; the committed results/smoke came from `snakemake --cores 2`)
#   make test     -> creates .venv if needed, installs, runs the whole test suite
# and:
#   make figures  -> figures/ from the committed aggregate tables only (no training)
#   make report   -> report.html (snakemake --report) for the smoke sweep
#   make bench    -> the benchmarks whose output is recorded under results/bench/
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.roundalign-installed
WORK    ?= work
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# torch on 2 cores: >1 thread made timings swing by 10x; the package defaults to 1 thread too.
export OMP_NUM_THREADS ?= 1
# Snakemake's shell rules run `python -m roundalign` from PATH
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: install test demo figures report bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# CPU torch first, pinned: an unpinned torch would pull a multi-GB CUDA build
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

demo: $(STAMP)
	$(BIN)/snakemake --cores 2 --config sweep=demo

figures: $(STAMP)
	$(BIN)/snakemake -s workflow/figures.smk --cores 1 --forceall

report: $(STAMP)
	$(BIN)/snakemake --report report.html

bench: $(STAMP)
	$(BIN)/python scripts/bench_numerics.py --out results/bench/numerics.txt
	$(BIN)/python scripts/bench_train.py --out results/bench/train.txt
	$(BIN)/python scripts/bench_workflow.py --out results/bench/workflow.txt

clean:
	rm -rf $(VENV) $(WORK) .pytest_cache
