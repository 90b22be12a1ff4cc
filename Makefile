# Quick start: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.pipecc-installed
DEMO   := demo_out
# a GPT small enough for two CPU processes; --replicas 1 asks for pipeline stages (the CLI's
# `auto` may choose plain data parallelism, which is no pipeline: see the README)
DEMO_MODEL := models/gpt.py -b 8 --model-arg n_layer=4 --model-arg n_head=4 \
	--model-arg n_embd=128 --model-arg vocab_size=1000 --model-arg block_size=64 \
	--model-arg seq_len=32

.PHONY: demo test test-fast bench clean

# NOTE: no `pip -q`: the first install downloads torch for minutes, and a silent terminal
# looks hung; pip's own progress (one line per package, a bar per download) shows instead.
$(STAMP): pyproject.toml setup.cfg setup.py constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "== installing pipecc and its pinned dependencies into $(VENV) (first time: a few minutes; torch and its CUDA libraries are ~3 GB, ~6 GB installed)"
	$(PY) -m pip install --disable-pip-version-check --progress-bar on -c constraints.txt -e '.[test]'
	# FPGA C simulation: the Apache-2.0 ap_types headers ship in the hls4ml wheel; pipecc
	# only reads those headers, so none of hls4ml's own dependencies are needed.
	$(PY) -m pip install --disable-pip-version-check --progress-bar on --no-deps hls4ml==1.3.0
	touch $(STAMP)
	@echo "== installed; to type \`pipecc\` yourself: source $(VENV)/bin/activate"

demo: $(STAMP)
	@echo "== 1/4 cost: FLOPs, weights and activations per block of a small GPT"
	$(VENV)/bin/pipecc cost $(DEMO_MODEL) --by-module 2
	@echo "== 2/4 compile: cut it into pipeline stages over two CPU processes"
	$(VENV)/bin/pipecc compile $(DEMO_MODEL) --devices 2xcpu --replicas 1 --use-all-devices -m 4 -o $(DEMO)
	@echo "== 3/4 inspect: the stages, their nodes and the schedule"
	$(VENV)/bin/pipecc inspect $(DEMO)
	@echo "== 4/4 run: train 20 steps with torchrun, one process per rank; --verify checks outputs, loss and gradients"
	$(VENV)/bin/pipecc run $(DEMO) --steps 20 --verify
	@echo "== done: the report is $(CURDIR)/$(DEMO)/report.html (xdg-open $(DEMO)/report.html; macOS: open)"

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=15

test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "not slow and not real"

clean:
	rm -rf $(VENV) build *.egg-info $(DEMO)
