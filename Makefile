# Quick start: `make run` (serve the built-in tiny model and send a sample chat), `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The gRPC stub generator, pinned: its version sets the oldest grpcio/protobuf the committed stubs run on
# (pyproject's lower bounds). This small environment holds exactly those versions, so the tests also
# import and call the stubs there.
PROTO_VENV := .venv-proto
PROTO_STAMP := $(PROTO_VENV)/.installed
PROTO_PINS := grpcio==1.66.2 protobuf==5.27.2 grpcio-tools==1.66.2

HTTP_PORT ?= 8000
GRPC_PORT ?= 50051

GPU_OUT ?= gpu-results

.PHONY: setup test run proto lint clean gpu-check gpu-sinks

setup: $(STAMP) $(PROTO_STAMP)
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null)
	@command -v curl >/dev/null || (apt-get update -qq && apt-get install -y -qq curl >/dev/null)
	@command -v promtool >/dev/null || (apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null)

# uv installs the package and its ~150 dependencies in seconds where pip takes a minute and a half; torch
# comes first from pip (the exact CPU build: the package accepts a range, which alone would pull a CUDA
# build) and uv keeps it, pinned again so that no dependency can ask for another build. uv compiles the
# bytecode as pip does: without it, where PYTHONDONTWRITEBYTECODE is set, every process (each Ray worker
# among them) would compile Ray's and transformers' sources again.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 uv
	$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python -e '.[test]' torch==2.13.0
	touch $(STAMP)

$(PROTO_STAMP): Makefile $(STAMP)
	test -x $(PROTO_VENV)/bin/python || $(PY) -m venv $(PROTO_VENV)
	$(BIN)/uv pip install -q --compile-bytecode --python $(PROTO_VENV)/bin/python $(PROTO_PINS)
	touch $(PROTO_STAMP)

# Two pytest-xdist workers: one runs every test of the shared Ray and Redis servers (they wait on those more than
# they compute), the other the compute-bound files beside it (tests/conftest.py makes the groups).
TEST_WORKERS ?= 2
test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

# Serve the built-in tiny model (1 prefill + 1 decode worker), send one streamed chat, keep serving.
run: setup
	@$(BIN)/tidepool serve --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) & pid=$$!; \
	trap 'kill -INT $$pid 2>/dev/null; wait $$pid' INT TERM; \
	until curl -sf http://127.0.0.1:$(HTTP_PORT)/health >/dev/null; do \
	  kill -0 $$pid 2>/dev/null || exit 1; sleep 1; done; \
	echo "--- a sample chat, streamed (the tiny model has random weights: expect noise) ---"; \
	curl -sN http://127.0.0.1:$(HTTP_PORT)/v1/chat/completions -H 'Content-Type: application/json' \
	  -d '{"model": "tiny", "messages": [{"role": "user", "content": "Hello, Tidepool!"}], "max_tokens": 24, "stream": true}'; \
	echo "--- serving on http://127.0.0.1:$(HTTP_PORT) and grpc 127.0.0.1:$(GRPC_PORT); Ctrl-C stops ---"; \
	wait $$pid

# On a CUDA machine, even a bare one (torch, triton, transformers, safetensors, grpcio, crc32c; no Ray,
# Redis or FastAPI needed): the GPU benchmarks and the `gpu` tests, each under its own time limit and run
# even when another failed, their logs and JSON into $(GPU_OUT)/ (benchmarks/gpu_check.sh lists the steps),
# then issues 12 and 13's goals against the figures (benchmarks/gpu_goals.py, also as goals.json).
# GPU_BUDGET_S=540 fits the whole run into that many seconds, the most valuable steps first.
gpu-check:
	PY=$(PY) benchmarks/gpu_check.sh $(GPU_OUT) engine-gpu transfer-gpu gpu-tests engine-gpu-async engine-gpu-long speculative-gpu moe-gpu lora-gpu engine-gpu-fp8 \
	  engine-gpu-int4 moe-gpu-int4 engine-gpu-int8 speculative-gpu-draft engine-gpu-w8a8 moe-gpu-w8a8; rc=$$?; \
	$(PY) benchmarks/gpu_goals.py $(GPU_OUT) --json $(GPU_OUT)/goals.json; exit $$rc

# On a CUDA machine, a second check (5-8 minutes): the attention-sink result needs a model that parks
# attention on its first tokens, which the 9-minute CPU training does not produce (the pretrained SmolLM2 of
# benchmarks/pretrained.py does, on any CPU). This trains the same model on the GPU with a large batch
# (hundreds of times the tokens), then measures where its attention goes and what window-only and
# sinks + window cost on it (kv_quality.py on the CPU engine).
SINKS_MINUTES ?= 4
gpu-sinks:
	PY=$(PY) SINKS_MINUTES=$(SINKS_MINUTES) benchmarks/gpu_check.sh $(GPU_OUT) sinks-train sinks-attention sinks-quality

proto: setup
	$(PROTO_VENV)/bin/python -m grpc_tools.protoc -I proto --python_out=proto --pyi_out=proto \
	  --grpc_python_out=proto proto/tidepool/v1/*.proto

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) $(PROTO_VENV) build *.egg-info
