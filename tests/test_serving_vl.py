"""The embedded server with a vision-language target: SGLang's `image_data` on /generate, measured
by the benchmark client with the requests a VL evaluation sends (rendered text + image paths)."""
from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from specforge.checkpoint import save_checkpoint
from specforge.config import TargetConfig
from specforge.data.vl_render import prompt_with_images
from specforge.engine.speculative import SpeculativeEngine
from specforge.models.draft import Eagle3Config, Eagle3Draft
from specforge.eval import bench_client as bc
from specforge.serving.app import EmbeddedServer
from specforge.serving.model import load_model
from specforge.serving.policy import ServePolicy
from specforge.targets.loader import load_target, load_tokenizer
from specforge.targets.vl import load_image_processor, vl_info

AUX = [2, 3, 4]
TREE = "3_2_6"
MAX_NEW = 12


@pytest.fixture(scope="module")
def setup(tiny_vl_dir, two_image_prompt, tmp_path_factory):
    """(model, tokenizer, draft checkpoint dir, messages with two images, their paths)."""
    cfg = TargetConfig(name="tiny-vl", path=str(tiny_vl_dir), kind="qwen3_vl", dtype="float32")
    model, tok = load_target(cfg, "cpu"), load_tokenizer(cfg)
    d = tmp_path_factory.mktemp("served_vl")
    paths, messages = two_image_prompt
    torch.manual_seed(0)
    draft = Eagle3Draft(Eagle3Config.from_target(model.config, AUX, draft_vocab_size=len(tok)))
    for p in draft.parameters():  # sharper than the default init: the draft proposes varied trees
        torch.nn.init.normal_(p, std=0.3)
    save_checkpoint(draft.eval(), d / "ckpt", dtype=torch.float32)
    return model, tok, d / "ckpt", messages, paths


@pytest.fixture(scope="module")
def servers(setup, tiny_vl_dir):
    _, _, ckpt, _, paths = setup
    policy = ServePolicy(image_roots=(Path(paths[0]).parent,))  # --image-root: the prompt's images
    eagle = EmbeddedServer(lambda: load_model(tiny_vl_dir, ckpt, TREE, dtype="float32"), policy=policy).start()
    base = EmbeddedServer(lambda: load_model(tiny_vl_dir, dtype="float32"), policy=policy).start()
    eagle.wait_ready(120), base.wait_ready(120)
    yield eagle, base
    eagle.close(), base.close()


def post(url, body):
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_image_data_gives_the_in_process_engines_tokens(setup, servers, tiny_vl_dir):
    """Rendered text + image paths (what the bench client sends for a VL prompt) decode exactly
    as the in-process engine decodes the evaluation's expanded prompt with its pixels; the EAGLE3
    server is lossless and reports its verify rounds."""
    model, tok, _, messages, paths = setup
    eagle, base = servers
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    ids, images = prompt_with_images(list(ids), paths, load_image_processor(tiny_vl_dir), vl_info(model.config))
    want, _ = SpeculativeEngine(model, None).generate_base(ids, MAX_NEW, images=images)

    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    body = {"text": text, "image_data": paths, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0,
                                                                   "ignore_eos": True}}
    for server in (base, eagle):
        status, out = post(server.url, body)
        assert status == 200, out
        assert out["output_ids"] == want.tolist()
        assert out["meta_info"]["prompt_tokens"] == len(ids)  # image tokens counted, as SGLang does
    assert out["meta_info"]["spec_verify_ct"] > 0

    request = bc.BenchRequest(text, len(ids), MAX_NEW, paths)
    result = bc.run_benchmark(eagle.url, [request, request], warmup=0, temperature=0.0)
    assert result.metrics["completed"] == 2 and result.metrics["failed"] == 0, result.metrics["errors"]
    verify = sum(r.spec_verify_ct for r in result.requests)
    assert 0 < verify < 2 * MAX_NEW  # a random draft: some drafts accepted, measured per request
    assert result.metrics["accept_length"] == pytest.approx(2 * MAX_NEW / verify)


@pytest.mark.parametrize("image_data, message", [
    (["/no/such.png"], "image_data\\[0\\]: '/no/such.png' is not an image file under the server's --image-root"),
    (["http://example.com/a.png"], "local image files only"),
    ("one", "1 image placeholder tokens .* but 2 images|2 image placeholder tokens .* but 1 images"),
])
def test_bad_image_data_gets_400(setup, servers, image_data, message):
    _, tok, _, messages, paths = setup
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    images = paths[:1] if image_data == "one" else image_data
    status, out = post(servers[1].url, {"text": text, "image_data": images})
    assert status == 400 and re.search(message, out["error"]["message"]), out


def test_a_text_server_refuses_image_data(tiny_target_dir):
    with EmbeddedServer(lambda: load_model(tiny_target_dir, dtype="float32")) as server:
        server.wait_ready(60)
        status, out = post(server.url, {"text": "hi", "image_data": ["x.png"]})
    assert status == 400 and "needs a vision-language target" in out["error"]["message"]
