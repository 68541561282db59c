"""Shared fixtures: the tiny local target (built once per session; no model hub needed)."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tests use tiny tensors: one intra-op thread is faster, and immune to OpenMP threads spinning
    against each other on a busy 2-core machine (stages that set their own thread count still do)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    """A tiny random Llama + ChatML tokenizer saved as a normal Hugging Face model directory."""
    from specforge.targets.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny_target"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_target_dir))


@pytest.fixture(scope="session")
def tiny_vl_dir(tmp_path_factory):
    """A tiny random Qwen3-VL (8 layers, 2 deepstack layers) + tokenizer + image processor."""
    from specforge.targets.tiny import build_tiny_qwen3vl

    return build_tiny_qwen3vl(tmp_path_factory.mktemp("tiny_vl_target"))
