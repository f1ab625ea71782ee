# Quick start: `make run` (serve the built-in tiny model and send a sample chat), `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

HTTP_PORT ?= 8000
GRPC_PORT ?= 50051

.PHONY: setup test run proto lint clean

setup: $(STAMP)
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null)
	@command -v curl >/dev/null || (apt-get update -qq && apt-get install -y -qq curl >/dev/null)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest -q

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

proto: setup
	$(BIN)/python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. proto/tidepool/v1/*.proto

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
