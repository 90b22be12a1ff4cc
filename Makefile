# Quick start: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.pipecc-installed

.PHONY: demo test test-fast bench clean

$(STAMP): pyproject.toml setup.cfg constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/pipecc cost models/gpt.py --model-arg n_layer=2 --model-arg n_embd=128 --model-arg n_head=4 --model-arg vocab_size=1000 --model-arg block_size=64 --batch-size 2

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --durations=15

test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 -m 'not slow'

clean:
	rm -rf $(VENV) build *.egg-info
