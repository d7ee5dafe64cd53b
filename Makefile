# Libra-bench. `make` lists the targets; every target that needs the environment creates it.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
BENCH   := $(BIN)/libra-bench
# the make targets are the one writer of results/ (every command's default folder is under runs/):
# they replace a folder's previous run even when its config changed. A rerun that changes no number
# leaves the committed files as they are; `make check-results` recomputes a slice and compares.
RESULTS := --overwrite
PYTEST_ARGS ?=
# pytest caches its assertion-rewritten test modules as bytecode; a host that sets
# PYTHONDONTWRITEBYTECODE makes it rewrite all of them on every run (measured: make test 4-5 s slower,
# about 5%, on a 2-core host). The test targets let it write them (git-ignored __pycache__/, where
# numba's cache lives too).
PYTEST := PYTHONDONTWRITEBYTECODE= $(BIN)/pytest

.DEFAULT_GOAL := help
.PHONY: help setup test test-all check-results lint bench fig3 fig4 fig8 fig11 fig12 fig12-real fig12-synthetic tune-real known-speeds fig12-nojitter fig13 fig14 fig15 fig16 \
        plan-cost microbench multinode paper-inferred extensions robustness figures reproduction gpu-check gpu-smoke fig12-h200 clean

help:  ## list the targets
	@grep -hE '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,parquet]'
	touch $(STAMP)

setup: $(STAMP)  ## create .venv and install the project (CPU torch 2.13.0) with dev tools

test: $(STAMP)  ## the fast tier: every test not marked slow (CPU only, GPU tests skip), about 2 minutes on 2 cores
	$(PYTEST) -q $(PYTEST_ARGS)

test-all: $(STAMP)  ## every test: the fast tier plus the slow one (multi-process gloo, multi-node, measured runs)
	$(PYTEST) -q -m "slow or not slow" $(PYTEST_ARGS)

WORKLOADS := ../shared/workloads

check-results: $(STAMP)  ## recompute Figure 12's first window (libra-prod) and one Wikipedia point; fail on any difference from results/
	$(BIN)/python -m experiments.common.check_results --results results --workloads $(WORKLOADS)

lint: $(STAMP)  ## ruff
	$(BIN)/ruff check .

bench: $(STAMP)  ## pytest-benchmark suites (VRSP per window, TAP per pool, compile and prepare per worker); prints medians (JSON not committed)
	mkdir -p results/bench
	$(BIN)/pytest -q benchmarks --benchmark-only --benchmark-min-rounds=30 --benchmark-columns=min,median,iqr,rounds -p no:cacheprovider -p no:hypothesispytest --benchmark-json=results/bench/benchmarks.json

fig4: $(STAMP)  ## Figure 4: production-order R-1 vs P (256K and 1M, libra-prod)
	$(BENCH) lln --workload libra-prod --seq-len 262144 --gbs 128 --out results/lln/256k $(RESULTS)
	$(BENCH) lln --workload libra-prod --seq-len 1048576 --gbs 32 --out results/lln/1m $(RESULTS)

fig8: $(STAMP)  ## Figure 8: R-1 vs P for each grouping strategy and VRSP
	$(BENCH) vrsp --workload libra-prod --seq-len 262144 --gbs 128 --out results/vrsp/256k $(RESULTS)
	$(BENCH) vrsp --workload libra-prod --seq-len 1048576 --gbs 32 --out results/vrsp/1m $(RESULTS)

plan-cost: $(STAMP)  ## planning time per optimizer step / microbatch (sec. 5)
	$(BENCH) plan-cost --methods libra,libra-adaptive --out results/plan-cost $(RESULTS)

fig12: $(STAMP)  ## Figure 12: straggler comparison of all methods (the main job)
	$(BENCH) straggler --workload libra-prod --out results/straggler $(RESULTS)

fig12-real: $(STAMP)  ## Figure 12 on the two public length corpora (FlexSP Wikipedia, DistCA ProLong)
	$(BENCH) straggler --workload $(WORKLOADS)/flexsp_wikipedia.txt.gz --methods all --out results/straggler-wikipedia $(RESULTS)
	$(BENCH) straggler --workload $(WORKLOADS)/distca_dist_prolong.json --methods all --out results/straggler-prolong $(RESULTS)

fig12-synthetic: $(STAMP)  ## Figure 12 on DistCA's synthetic WLB-LLM lengths (a synthetic corpus, used in tuning libra-adaptive)
	$(BENCH) straggler --workload $(WORKLOADS)/distca_dist_wlbllm_synthetic.json --methods all --out results/straggler-wlbllm-synthetic $(RESULTS)

tune-real: $(STAMP)  ## tune's layout search at 1M on the two public corpora (the paper's P=8 is not their best)
	$(BENCH) tune --workload $(WORKLOADS)/flexsp_wikipedia.txt.gz --settings 1m --pool-sizes 2,4,8,16 --head-splits 2 --chunk-counts 4,8 --windows 4 --no-progress --out results/tune-wikipedia-1m $(RESULTS)
	$(BENCH) tune --workload $(WORKLOADS)/distca_dist_prolong.json --settings 1m --pool-sizes 2,4,8,16 --head-splits 2 --chunk-counts 4,8 --windows 4 --no-progress --out results/tune-prolong-1m $(RESULTS)

known-speeds: $(STAMP)  ## libra-adaptive told each GPU's persistent speed (straggler --known-speeds) on the four workloads
	$(BENCH) straggler --workload libra-prod --methods ulysses,libra,libra-adaptive --known-speeds --out results/straggler-known-speeds/libra-prod $(RESULTS)
	$(BENCH) straggler --workload $(WORKLOADS)/flexsp_wikipedia.txt.gz --methods ulysses,libra,libra-adaptive --known-speeds --out results/straggler-known-speeds/wikipedia $(RESULTS)
	$(BENCH) straggler --workload $(WORKLOADS)/distca_dist_prolong.json --methods ulysses,libra,libra-adaptive --known-speeds --out results/straggler-known-speeds/prolong $(RESULTS)
	$(BENCH) straggler --workload $(WORKLOADS)/distca_dist_wlbllm_synthetic.json --methods ulysses,libra,libra-adaptive --known-speeds --out results/straggler-known-speeds/wlbllm-synthetic $(RESULTS)

fig12-nojitter: $(STAMP)  ## Figure 12 with device jitter off: what the jitter model contributes
	$(BENCH) straggler --workload libra-prod --no-jitter --out results/straggler-nojitter $(RESULTS)

fig3: $(STAMP)  ## Figure 3: FLOPs- vs time-balanced spread as the pool grows
	$(BENCH) variability --out results/variability $(RESULTS)

fig15: $(STAMP)  ## Figure 15: pool-size sweep, compute vs communication
	$(BENCH) pool-sweep --workload libra-prod --out results/pool-sweep $(RESULTS)

fig16: $(STAMP)  ## Figure 16: TAP B x H grid search
	$(BENCH) grid-search --workload libra-prod --out results/grid-search $(RESULTS)

fig11: $(STAMP)  ## Figure 11: simulated end-to-end throughput
	$(BENCH) e2e --workload libra-prod --out results/e2e $(RESULTS)

fig13: $(STAMP)  ## Figure 13: simulated DP scaling
	$(BENCH) dp-scaling --workload libra-prod --out results/dp-scaling $(RESULTS)

fig14: $(STAMP)  ## Figure 14: per-microbatch forward time under PP
	$(BENCH) pp-balance --workload libra-prod --out results/pp-balance $(RESULTS)

microbench: $(STAMP)  ## measured core attention, 2 gloo ranks (one per core), skewed 8K windows, vs the measured ideal (run on a quiet host)
	$(BENCH) calibrate --device cpu --links --out results/microbench-cpu/calibrate-cpu $(RESULTS)
	$(BENCH) microbench --nproc 2 --dp 2 --cp 1 --pool-size 2 --seq-len 8192 --gbs 2 --block-size 1024 --head-split 2 --q-heads 8 --kv-heads 2 --head-dim 64 --methods ulysses,libra,libra-kt,libra-adaptive --profile results/microbench-cpu/calibrate-cpu/profile.json --workload workloads/skewed-8k.txt --repeats 3 --out results/microbench-cpu $(RESULTS)

multinode: $(STAMP)  ## two torchrun "nodes" x 2 gloo ranks on 127.0.0.1 run microbench and train (slow test, ~30 s)
	$(BIN)/pytest -q -m slow tests/test_multinode.py $(PYTEST_ARGS)

paper-inferred: $(STAMP)  ## profile sensitivity: fit the inter-supernode link to Fig. 15, rerun Figs. 15 and 12 with it
	$(BENCH) fit-links --out results/fit-links --overwrite
	$(BENCH) pool-sweep --workload libra-prod --profile paper-inferred-v1 --out results/pool-sweep-paper-inferred $(RESULTS)
	$(BENCH) straggler --workload libra-prod --profile paper-inferred-v1 --out results/straggler-paper-inferred $(RESULTS)

extensions: $(STAMP)  ## every registered method (adds libra-kt, libra-adaptive; not in the paper) on libra-prod
	$(BENCH) straggler --workload libra-prod --methods all --out results/straggler-extensions $(RESULTS)

robustness: $(STAMP)  ## every method's speedup over Ulysses and its range over the profile ensemble default-v2 (planned with the default profile vs each member's own) on libra-prod, Wikipedia and ProLong
	$(BENCH) robustness --workload libra-prod --out results/robustness/libra-prod $(RESULTS)
	$(BENCH) robustness --workload $(WORKLOADS)/flexsp_wikipedia.txt.gz --out results/robustness/wikipedia $(RESULTS)
	$(BENCH) robustness --workload $(WORKLOADS)/distca_dist_prolong.json --out results/robustness/prolong $(RESULTS)

reproduction: $(STAMP)  ## regenerate results/REPRODUCTION.md from results/ (after make figures: it reads the per-step CSVs that are not committed)
	$(BENCH) report --results results --out results/REPRODUCTION.md

figures: fig4 fig8 bench plan-cost fig12 fig12-real fig12-synthetic tune-real known-speeds fig12-nojitter fig3 fig15 fig16 fig11 fig13 fig14 paper-inferred extensions fig12-h200 robustness reproduction  ## every simulated figure

gpu-check:  ## on a CUDA machine: calibrate (Fig. 5), validate the simulator, check fidelity
	bash scripts/gpu_check.sh

H200 := results/gpu/nvidia-h200

fig12-h200: $(STAMP)  ## Figure 12 simulated with the H200-measured profile (libra, libra-adaptive vs Ulysses) on three corpora
	$(BENCH) straggler --workload libra-prod --methods ulysses,libra,libra-adaptive --profile $(H200)/calibrate/profile.json --out $(H200)/straggler-libra-prod $(RESULTS)
	$(BENCH) straggler --workload $(WORKLOADS)/flexsp_wikipedia.txt.gz --methods ulysses,libra,libra-adaptive --profile $(H200)/calibrate/profile.json --out $(H200)/straggler-wikipedia $(RESULTS)
	$(BENCH) straggler --workload $(WORKLOADS)/distca_dist_prolong.json --methods ulysses,libra,libra-adaptive --profile $(H200)/calibrate/profile.json --out $(H200)/straggler-prolong $(RESULTS)
	$(BENCH) gpu-summary $(H200) --title "GPU check (nvidia-h200)"

gpu-smoke: $(STAMP)  ## the same pipeline on CPU with tiny sizes (checks the script, not the GPU)
	PYTHON=$(BIN)/python bash scripts/gpu_check.sh --cpu-smoke results/gpu/cpu-smoke

clean:  ## remove the environment and caches
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis .benchmarks *.egg-info
