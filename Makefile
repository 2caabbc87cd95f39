# Two commands do all set-up on a fresh CPU machine (Python 3.11 + pip, no conda):
#   make demo   -> creates .venv, installs, runs the CPU demo
#   make test   -> creates .venv if needed, installs, runs the whole test suite
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.roundalign-installed
WORK    ?= work
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# torch on 2 cores: >1 thread made timings swing by 10x; the package defaults to 1 thread too.
export OMP_NUM_THREADS ?= 1

.PHONY: install test demo bench clean

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
	$(BIN)/roundalign make-tiny --arch qwen2 --out $(WORK)/models/tiny-qwen2 --hidden 64 --layers 2
	$(BIN)/roundalign make-tiny --arch qwen3 --out $(WORK)/models/tiny-qwen3 --hidden 64 --layers 2
	for m in tiny-qwen2 tiny-qwen3; do \
	  $(BIN)/roundalign probe --model $(WORK)/models/$$m --engine vllm-compiled --attn eager --engine-gemm same \
	    --prompts 8 --max-new-tokens 16 --seed 0 --out $(WORK)/probe/$$m-eager-same.csv || exit 1; \
	done

bench: $(STAMP)
	$(BIN)/python scripts/bench_numerics.py --out results/bench/numerics.txt
	$(BIN)/python scripts/bench_train.py --out results/bench/train.txt

clean:
	rm -rf $(VENV) $(WORK) .pytest_cache
