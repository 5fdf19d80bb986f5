# Two commands do all the set-up: `make demo` and `make test`.
# Each creates .venv when missing and installs what it needs (fast when installed).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTEST_WORKERS ?= 2

.PHONY: demo test test-tensorflow test-torch install clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints/dev.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints/dev.txt -e ".[dev,torch,nvml,plot]" tensorflow-cpu
	touch $(STAMP)

demo: $(STAMP)
	KERAS_BACKEND=$${KERAS_BACKEND:-tensorflow} $(PY) examples/demo.py

test: test-tensorflow test-torch

test-tensorflow: $(STAMP)
	KERAS_BACKEND=tensorflow $(PY) -m pytest -n $(PYTEST_WORKERS) -q -p no:cacheprovider tests

test-torch: $(STAMP)
	KERAS_BACKEND=torch $(PY) -m pytest -n $(PYTEST_WORKERS) -q -p no:cacheprovider tests

clean:
	rm -rf $(VENV) build *.egg-info
