# Two entry points on a fresh machine: `make demo` and `make test`.
# Both create .venv and install on first use.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# torch is pinned here, installed first, so pip takes the CPU build already on the
# machine instead of resolving an open range to the newest CUDA build (several GB).
TORCH_PIN := torch==2.13.0

.PHONY: demo test test-all test-torchrl bench lint clean bytecode

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q $(TORCH_PIN) -e ".[dev]"
	touch $(STAMP)

# Every Ray worker process imports raysync (and a test module, for a test's actor) anew:
# where PYTHONDONTWRITEBYTECODE is set, each compiled them from source (~0.5 s of CPU
# per process on a 2-core machine; a test run starts over a thousand). Compiled once.
COMPILED := raysync actors tests examples benchmarks

bytecode: $(STAMP)
	$(PY) -m compileall -q $(COMPILED) > /dev/null

demo: bytecode
	$(PY) examples/demo.py

test: bytecode
	$(PY) -m pytest -m "not gpu and not slow" --durations=25 $(PYTEST_ARGS)

# Also the long runs: soak, and the fault runs through every transport.
test-all: bytecode
	$(PY) -m pytest -m "not gpu" $(PYTEST_ARGS)

# The TorchRL integration in an environment of its own: TorchRL 0.14 pins tensordict<0.15,
# and the oldest tensordict raysync supports (0.14.3) is the one tested there.
TORCHRL_VENV := .venv-torchrl
TORCHRL_PY := $(TORCHRL_VENV)/bin/python
TORCHRL_STAMP := $(TORCHRL_VENV)/.installed

$(TORCHRL_STAMP): pyproject.toml Makefile
	test -x $(TORCHRL_PY) || python3 -m venv $(TORCHRL_VENV)
	$(TORCHRL_PY) -m pip install -q --upgrade pip
	$(TORCHRL_PY) -m pip install -q $(TORCH_PIN)
	$(TORCHRL_PY) -m pip install -q $(TORCH_PIN) tensordict==0.14.3 -e ".[torchrl,test]"
	touch $(TORCHRL_STAMP)

test-torchrl: $(TORCHRL_STAMP)
	$(TORCHRL_PY) -m compileall -q $(COMPILED) > /dev/null  # as `bytecode` does
	$(TORCHRL_PY) -m pytest tests/torchrl --durations=10 $(PYTEST_ARGS)

bench: bytecode
	$(PY) benchmarks/broadcast.py

lint: $(STAMP)
	$(VENV)/bin/ruff check raysync actors tests benchmarks examples
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) $(TORCHRL_VENV)
