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


@pytest.fixture(scope="session")
def two_image_prompt(tmp_path_factory):
    """(image paths, messages): a user turn with two small drawn images (64x64, 96x64) and a question."""
    from PIL import Image, ImageDraw

    d = tmp_path_factory.mktemp("prompt_images")
    paths = []
    for i, size in enumerate([(64, 64), (96, 64)]):
        im = Image.new("RGB", size, (40 * i, 120, 200 - 50 * i))
        ImageDraw.Draw(im).ellipse([8, 8, 40, 40], fill=(250, 200, 0))
        im.save(d / f"{i}.png")
        paths.append(str(d / f"{i}.png"))
    messages = [{"role": "user", "content": [{"type": "image", "image": paths[0]}, {"type": "text", "text": "and"},
                                             {"type": "image", "image": paths[1]},
                                             {"type": "text", "text": "What is the weather in Oslo?"}]}]
    return paths, messages
