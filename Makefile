# The two commands of the README. Both set everything up on a fresh machine:
#   make demo   virtualenv, torch pinned first, the package, the SmolLM2 target (fetched on first
#               use by the pipeline), the synthetic weather data, then data -> extract -> train
#   make test   the same set-up, then the test suite
#   make demo-vl  the vision-language pipeline on CPU: a tiny random Qwen3-VL, weather data with images
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export WANDB_MODE ?= offline
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
export DS_BUILD_OPS ?= 0  # DeepSpeed (a test dependency) installs without compiling its CUDA ops

.PHONY: setup demo demo-vl test data clean-demo

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: a package asking for a newer one would pull GB of CUDA wheels.
	$(BIN)/pip install -q -c constraints.txt torch
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

data/weather/train.jsonl: data_prep/weather.py | $(STAMP)
	$(BIN)/python data_prep/weather.py --out data/weather --train 300 --eval 40 --seed 0

data: data/weather/train.jsonl

demo: setup data
	$(BIN)/python train.py +exp=smollm2_weather

data/weather_vl/train.jsonl: data_prep/weather.py | $(STAMP)
	$(BIN)/python data_prep/weather.py --out data/weather_vl --train 48 --eval 8 --seed 0 --images 0.5

demo-vl: setup data/weather_vl/train.jsonl
	$(BIN)/python train.py +exp=qwen3vl_tiny

test: setup
	$(BIN)/python -m pytest -q

clean-demo:
	rm -rf outputs/smollm2_weather data/weather outputs/qwen3vl_tiny data/weather_vl
