# aiinfra-jax. Two commands on a fresh machine:
#   make train   create .venv, install, train the default tiny NSA model on the embedded corpus, evaluate it
#                (the dense baseline: make train CONFIG=configs/tiny.py)
#   make test    create .venv with the dev extras, run the whole test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
CONFIG ?= configs/nsa_tiny.py
ARGS   ?=

.PHONY: train test install install-dev bench-train bench-kernels bench-nsa bench-attnres bench-moe profile-step clean-venv

$(VENV)/.stamp-base: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	@touch $@

$(VENV)/.stamp-dev: $(VENV)/.stamp-base
	$(PY) -m pip install -q -e ".[dev]"
	@touch $@

install: $(VENV)/.stamp-base
install-dev: $(VENV)/.stamp-dev

train: $(VENV)/.stamp-base
	$(PY) train.py --config $(CONFIG) $(ARGS)

# The whole suite; pytest-xdist spreads the test files over the two cores. The slowest tests are
# listed at the end, to keep the suite inside its 20-minute budget on a 2-core machine (17 min on
# 2026-12-02).
test: $(VENV)/.stamp-dev
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15 tests

bench-train: $(VENV)/.stamp-base
	$(PY) -m aiinfra_jax.eval.bench_train --config $(CONFIG) $(ARGS)

bench-kernels: $(VENV)/.stamp-base
	$(PY) -m aiinfra_jax.eval.bench_kernels $(ARGS)

# NSA layer vs dense layer (forward, forward+backward, decode); `make bench-nsa NSA_BENCH=quality`
# trains dense and NSA at matched parameters instead.
NSA_BENCH ?= layer
bench-nsa: $(VENV)/.stamp-base
	$(PY) -m aiinfra_jax.eval.bench_nsa $(NSA_BENCH) $(ARGS)

bench-attnres: $(VENV)/.stamp-base
	$(PY) -m aiinfra_jax.eval.bench_attnres $(ARGS)

# Expert-weight bytes per decode step, MoE vs DeaMoE, from routing traces of two runs (or presets).
MOE_RUN ?= runs/moe_tiny
DEAMOE_RUN ?= runs/deamoe_tiny
bench-moe: $(VENV)/.stamp-base
	$(PY) -m aiinfra_jax.eval.bench_moe --moe $(MOE_RUN) --deamoe $(DEAMOE_RUN) $(ARGS)

profile-step: $(VENV)/.stamp-base
	$(PY) -m aiinfra_jax.eval.profile_step --config $(CONFIG) $(ARGS)

clean-venv:
	rm -rf $(VENV)
