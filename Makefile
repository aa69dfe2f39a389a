# aiinfra-jax. Two commands on a fresh machine:
#   make train   create .venv, install, train the default tiny NSA model on the embedded corpus, evaluate it
#                (the dense baseline: make train CONFIG=configs/tiny.py)
#   make test    create .venv with the dev extras, run the whole test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
CONFIG ?= configs/nsa_tiny.py
ARGS   ?=

.PHONY: train test install install-dev install-bench bench-train bench-kernels bench-nsa bench-attnres bench-moe \
	bench-moe-quality bench-recurrent bench-recall bench-memory bench-generate bench-leapquant bench-gpu bench-surgery profile-step clean-venv

$(VENV)/.stamp-base: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	@touch $@

$(VENV)/.stamp-dev: $(VENV)/.stamp-base
	$(PY) -m pip install -q -e ".[dev]"
	@touch $@

$(VENV)/.stamp-bench: $(VENV)/.stamp-base
	$(PY) -m pip install -q -e ".[bench]"
	@touch $@

install: $(VENV)/.stamp-base
install-dev: $(VENV)/.stamp-dev
# The benchmarks' outside baselines (torch SDPA, lucidrains' PyTorch NSA); optional.
install-bench: $(VENV)/.stamp-bench

train: $(VENV)/.stamp-base
	$(PY) train.py --config $(CONFIG) $(ARGS)

# The whole suite; pytest-xdist spreads the test files over the two cores. The slowest tests are
# listed at the end, to keep the suite inside its 20-minute budget on a 2-core machine (8.1 min
# on a fresh clone on 2026-12-02, 687 tests, since tests/conftest.py compiles at -O0; 19.9 min
# before that).
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

# Dense vs MoE vs DeaMoE: five tiny runs (about 40 minutes on 2 cores; finished runs are read, not
# retrained), loss curves as a PNG, bytes per decode step and FFN times from the trained models.
bench-moe-quality: $(VENV)/.stamp-base
	$(PY) -m aiinfra_jax.eval.bench_moe --quality $(ARGS)

# Dense vs NSA vs GDN vs hybrid vs KDA, plus dense and NSA with a short conv: seven tiny runs (about
# 80 minutes; finished runs are read, not retrained), loss curves, loss past the training length.
bench-recurrent: $(VENV)/.stamp-base
	$(PY) -m aiinfra_jax.eval.bench_recurrent $(ARGS)

# Token-level associative recall (Zoology's MQAR): dense / GDN / KDA over learning rates and head
# sizes, 12 small runs (about 15 minutes); which settings let a recurrent mixer learn retrieval.
bench-recall: $(VENV)/.stamp-base
	$(PY) -m aiinfra_jax.eval.bench_recall $(ARGS)

# MSA: NIAH over a memory bank grown by appends to 32K, 128K and 1M tokens (exact match, router
# recall, encoding tokens/s, prefill / decode time, bytes per memory token); needs a trained MSA run:
#   make bench-memory ARGS="--checkpoint runs/msa_tiny --out-dir eval_runs/msa_niah"
bench-memory: $(VENV)/.stamp-base
	$(PY) -m aiinfra_jax.eval.memory niah $(ARGS)

# Prefill and decode tokens/s of generate (tiny dense, NSA and AttnRes presets, 1K/4K context,
# batch 1/8), beside the bytes one decode step moves.
bench-generate: $(VENV)/.stamp-base
	$(PY) -m aiinfra_jax.eval.bench_generate $(ARGS)

# LeapQuant: state error of per-step vs per-window 8/6/4-bit recurrent states, bytes per element.
bench-leapquant: $(VENV)/.stamp-base
	$(PY) -m aiinfra_jax.eval.bench_leapquant $(ARGS)

# Pallas GPU kernels: parity with their float32 references (native) and timings against cuDNN and
# the XLA path at 4K-64K tokens (eval/bench_gpu.py). Stops starting work after --budget-s (270 s),
# listing what did not fit: on the first H200 run everything took about 2 x 5 minutes. Uses the
# machine's own python3 and JAX: no venv, install or network (grain and datasets need not exist):
#   make bench-gpu [ARGS="--lengths 4k,16k,64k --budget-s 270"]
# On a CPU: make bench-gpu PYTHON=.venv/bin/python ARGS="--interpret --tiny"   (interpret mode)
#           make bench-gpu PYTHON=.venv/bin/python ARGS=--lower-only          (lower every row for cuda)
bench-gpu:
	$(PYTHON) eval/bench_gpu.py $(ARGS)

# NSA finetuned from a trained dense model (checkpoint.initialize_from=params:) vs NSA from scratch:
# three tiny runs on the embedded corpus (about 25 minutes on 2 cores), loss curves as a PNG.
bench-surgery: $(VENV)/.stamp-base
	$(PY) -m aiinfra_jax.eval.bench_surgery $(ARGS)

profile-step: $(VENV)/.stamp-base
	$(PY) -m aiinfra_jax.eval.profile_step --config $(CONFIG) $(ARGS)

clean-venv:
	rm -rf $(VENV)
