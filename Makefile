# Quick start: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.pipecc-installed

.PHONY: demo test test-fast bench clean

$(STAMP): pyproject.toml setup.cfg constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[test]'
	# FPGA C simulation: the Apache-2.0 ap_types headers ship in the hls4ml wheel; pipecc
	# only reads those headers, so none of hls4ml's own dependencies are needed.
	$(PY) -m pip install -q --disable-pip-version-check --no-deps hls4ml==1.3.0
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/pipecc cost models/gpt.py --batch-size 8 --by-module 2
	$(VENV)/bin/pipecc plan models/gpt.py --batch-size 8 --devices 4xa100 --compare -v

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=15

test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "not slow and not real"

clean:
	rm -rf $(VENV) build *.egg-info
