"""Vision-language targets: the tiny Qwen3-VL, token expansion, M-RoPE positions, hidden states.

Everything runs the real tiny model (fp32) against what transformers itself computes: the
processor's token expansion, the positions the model builds internally, forward hooks on the
decoder layers, and the vision tower's own image features.
"""
from __future__ import annotations

import json

import pytest
import torch

from specforge.config import TargetConfig
from specforge.targets.loader import aux_layer_ids, load_target, load_tokenizer
from specforge.targets.vl import (
    VL_KINDS,
    capture_input_embeds,
    expand_image_tokens,
    image_inputs,
    image_token_counts,
    is_vl,
    is_vl_config,
    load_image_processor,
    mm_token_type_ids,
    open_images,
    rope_positions,
    vl_hidden_states,
    vl_info,
)


def _cfg(path, kind="qwen3_vl", aux=None, dtype="float32"):
    return TargetConfig(name="tiny-vl", path=str(path), kind=kind, dtype=dtype, aux_layer_ids=aux)


@pytest.fixture(scope="module")
def vl(tiny_vl_dir):
    """(model, tokenizer, image processor, info) of the tiny Qwen3-VL, loaded once."""
    cfg = _cfg(tiny_vl_dir)
    model = load_target(cfg, "cpu")
    return model, load_tokenizer(cfg), load_image_processor(tiny_vl_dir), vl_info(model.config)


@pytest.fixture(scope="module")
def pngs(tmp_path_factory):
    """Small real PNG files of different sizes drawn with Pillow."""
    from PIL import Image, ImageDraw

    d = tmp_path_factory.mktemp("images")
    paths = []
    for i, (w, h) in enumerate([(64, 64), (96, 64), (64, 128)]):
        im = Image.new("RGB", (w, h), (30 * i, 200 - 40 * i, 90))
        draw = ImageDraw.Draw(im)
        draw.rectangle([4, 4, w // 2, h // 3], fill=(255, 255 - 60 * i, 0))
        draw.ellipse([w // 3, h // 2, w - 4, h - 4], fill=(0, 40 * i, 255))
        p = d / f"img{i}.png"
        im.save(p)
        paths.append(p)
    return paths


def _messages(n_images, question="What is the weather in Paris?"):
    parts = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": question}]
    return [{"role": "user", "content": parts}, {"role": "assistant", "content": "sunny today"}]


def _encode(vl, images, question="What is the weather in Paris?"):
    """Our path: render -> tokenize -> expand placeholders; returns (ids [S], mask [S], inputs)."""
    model, tok, proc, info = vl
    text = tok.apply_chat_template(_messages(len(images), question), tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    mask = [1] * len(ids)
    inputs = image_inputs(images, proc) if images else {"pixel_values": None, "image_grid_thw": None}
    counts = image_token_counts(inputs["image_grid_thw"], info.spatial_merge_size) if images else []
    ids, mask = expand_image_tokens(ids, mask, counts, info.image_token_id)
    return torch.tensor(ids), torch.tensor(mask), inputs


def test_kinds(vl):
    assert VL_KINDS == ("qwen3_vl", "qwen2_5_vl")
    assert is_vl("qwen3_vl") and is_vl("qwen2_5_vl") and not is_vl("causal_lm")
    assert is_vl_config(vl[0].config) and not is_vl_config(vl[0].config.text_config)
    assert is_vl_config({"model_type": "qwen2_5_vl"})


def test_tiny_vl_loads_and_runs_with_one_and_two_images(vl, pngs, tiny_vl_dir):
    from transformers import Qwen3VLForConditionalGeneration

    model, tok, proc, info = vl
    assert isinstance(model, Qwen3VLForConditionalGeneration) and not model.training
    assert info.deepstack_layers == 2 and info.mrope_interleaved and sum(info.mrope_section) == 8
    assert info.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert info.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    assert vl_info(tiny_vl_dir) == info  # from config.json, without the model
    images = open_images(pngs)
    for n in (1, 2):
        ids, _, inputs = _encode(vl, images[:n])
        with torch.no_grad():
            out = model(
                input_ids=ids[None],
                pixel_values=inputs["pixel_values"],
                image_grid_thw=inputs["image_grid_thw"],
                mm_token_type_ids=mm_token_type_ids(ids[None], info),
            )
        assert out.logits.shape == (1, ids.numel(), model.config.text_config.vocab_size)
        assert torch.isfinite(out.logits).all()
    # a 64x64 image is 4 tokens with the tiny processor defaults
    assert image_token_counts(image_inputs(images[:1], proc)["image_grid_thw"], 2) == [4]


def test_load_target_kind_errors(tiny_vl_dir):
    with pytest.raises(ValueError, match="target.kind"):
        load_target(_cfg(tiny_vl_dir, kind="llava"))
    with pytest.raises(ValueError, match="target.kind.*model_type 'qwen3_vl'"):
        load_target(_cfg(tiny_vl_dir, kind="qwen2_5_vl"))


def _processor(tok, proc):
    """transformers' Qwen3VLProcessor without a video processor (torchvision is not usable here,
    and the processor refuses video_processor=None: skip that one check)."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    class NoVideoProcessor(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, name, arg):
            if name == "video_processor":
                return None
            return super().check_argument_for_proper_class(name, arg)

    return NoVideoProcessor(image_processor=proc, tokenizer=tok, video_processor=None, chat_template=tok.chat_template)


def test_expand_image_tokens_matches_qwen3vl_processor(vl, pngs):
    model, tok, proc, info = vl
    images = open_images(pngs)
    processor = _processor(tok, proc)
    for n in (1, 3):
        ids, mask, inputs = _encode(vl, images[:n])
        text = tok.apply_chat_template(_messages(n), tokenize=False)
        ref = processor(text=[text], images=images[:n], return_tensors="pt")
        assert ids.tolist() == ref["input_ids"][0].tolist()
        assert torch.equal(inputs["image_grid_thw"], ref["image_grid_thw"])
        assert torch.equal(inputs["pixel_values"], ref["pixel_values"])
        assert mm_token_type_ids(ids, info).tolist() == ref["mm_token_type_ids"][0].tolist()
        image = ids == info.image_token_id
        assert int(image.sum()) == sum(image_token_counts(inputs["image_grid_thw"], 2))
        assert mask[image].eq(0).all() and mask[~image].eq(1).all()


def test_expand_image_tokens_keeps_mask_and_checks_counts():
    ids, mask = expand_image_tokens([7, 5, 8, 5, 9], [1, 1, 0, 1, 1], [2, 3], image_token_id=5)
    assert ids == [7, 5, 5, 8, 5, 5, 5, 9]
    assert mask == [1, 0, 0, 0, 0, 0, 0, 1]
    t_ids, t_mask = expand_image_tokens(torch.tensor([5, 1]), torch.tensor([1, 1]), [2], 5)
    assert t_ids.tolist() == [5, 5, 1] and t_mask.tolist() == [0, 0, 1]
    with pytest.raises(ValueError, match="2 image placeholder tokens .* but 1 images"):
        expand_image_tokens([5, 5], [1, 1], [4], image_token_id=5)


def test_mm_token_type_ids_refuses_video(vl):
    info = vl[3]
    with pytest.raises(ValueError, match="video"):
        mm_token_type_ids(torch.tensor([1, info.video_token_id]), info)


def _lm_position_ids(model, **inputs):
    """The position ids the language model receives in a normal forward (the model builds them)."""
    seen = []
    handle = model.model.language_model.register_forward_pre_hook(
        lambda m, a, k: seen.append(k["position_ids"]), with_kwargs=True
    )
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        handle.remove()
    return seen[0]


def test_rope_positions_match_the_model(vl, pngs):
    model, tok, proc, info = vl
    images = open_images(pngs)
    ids, _, inputs = _encode(vl, images[:2])
    expected = _lm_position_ids(
        model, input_ids=ids[None], pixel_values=inputs["pixel_values"],
        image_grid_thw=inputs["image_grid_thw"], mm_token_type_ids=mm_token_type_ids(ids[None], info),
    )
    positions, deltas = rope_positions(model, ids, inputs["image_grid_thw"])  # 1-D ids: one row
    assert positions.shape == (3, 1, ids.numel()) and deltas.shape == (1,)
    assert torch.equal(positions, expected)
    # images compress positions: the last text position is below S-1 by the delta
    assert int(positions.max()) + 1 - ids.numel() == int(deltas[0]) < 0
    # text only: plain 0..S-1 on all three components
    t_ids, _, _ = _encode(vl, [])
    t_pos, t_delta = rope_positions(model, t_ids, None)
    assert torch.equal(t_pos, torch.arange(t_ids.numel()).expand(3, 1, -1)) and int(t_delta) == 0


def _batch(rows, pad_id):
    width = max(r.numel() for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : r.numel()] = r
        mask[i, : r.numel()] = 1
    return ids, mask


def test_vl_hidden_states_match_hooks_and_vision_tower(vl, pngs):
    model, tok, proc, info = vl
    images = open_images(pngs)
    ids, _, inputs = _encode(vl, images[:2])
    aux_ids = aux_layer_ids(_cfg("unused"), model.config)
    assert aux_ids == [2, 3, 4]
    aux_ids = [2, 4, 7]  # include the last layer: hidden_states[N] must be the raw layer output
    lm = model.model.language_model
    layer_out, norm_out = {}, []
    handles = [
        layer.register_forward_hook(lambda m, a, o, i=i: layer_out.__setitem__(i, o[0] if isinstance(o, tuple) else o))
        for i, layer in enumerate(lm.layers)
    ]
    handles.append(lm.norm.register_forward_hook(lambda m, a, o: norm_out.append(o)))
    try:
        res = vl_hidden_states(
            model, ids[None], torch.ones_like(ids)[None], inputs["pixel_values"], inputs["image_grid_thw"], aux_ids
        )
    finally:
        for h in handles:
            h.remove()
    s, h = ids.numel(), model.config.text_config.hidden_size
    assert res["aux"].shape == (1, s, 3 * h) and res["last"].shape == (1, s, h)
    assert torch.equal(res["aux"], torch.cat([layer_out[i] for i in aux_ids], dim=-1))
    assert torch.equal(res["last"], norm_out[-1])
    assert not torch.equal(res["aux"][..., 2 * h:], res["last"])
    assert torch.equal(res["position_ids"], rope_positions(model, ids, inputs["image_grid_thw"])[0])
    with torch.no_grad():
        feats = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    pooled = torch.cat(list(feats.pooler_output), dim=0)
    assert res["image_embeds"].shape == (int((ids == info.image_token_id).sum()), h)
    assert torch.equal(res["image_embeds"], pooled)
    # the config flag is restored after the call
    assert not hasattr(model.config.text_config, "tie_last_hidden_states")


def test_vl_hidden_states_right_padding_matches_single_rows(vl, pngs):
    model, tok, proc, info = vl
    images = open_images(pngs)
    # row 0: two images and a long question; row 1: one (taller) image and a short one
    row_images = [images[:2], images[2:3]]
    rows = [_encode(vl, row_images[0], "What is the weather in Oslo and Lima tomorrow?"),
            _encode(vl, row_images[1], "Rain?")]
    assert rows[0][0].numel() != rows[1][0].numel()
    aux_ids = [2, 3, 7]
    single = [
        vl_hidden_states(model, r[0][None], torch.ones_like(r[0])[None], r[2]["pixel_values"],
                         r[2]["image_grid_thw"], aux_ids)
        for r in rows
    ]
    ids, mask = _batch([r[0] for r in rows], model.config.text_config.pad_token_id)
    batch_inputs = image_inputs(row_images[0] + row_images[1], proc)
    res = vl_hidden_states(model, ids, mask, batch_inputs["pixel_values"], batch_inputs["image_grid_thw"], aux_ids)
    for i, r in enumerate(rows):
        n = r[0].numel()
        torch.testing.assert_close(res["aux"][i, :n], single[i]["aux"][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(res["last"][i, :n], single[i]["last"][0], atol=1e-5, rtol=1e-5)
        assert torch.equal(res["position_ids"][:, i, :n], single[i]["position_ids"][:, 0])
    torch.testing.assert_close(
        res["image_embeds"], torch.cat([single[0]["image_embeds"], single[1]["image_embeds"]]), atol=1e-5, rtol=1e-5
    )
    with pytest.raises(ValueError, match="image tokens"):
        vl_hidden_states(model, ids, mask, None, None, aux_ids)


def test_capture_input_embeds_records_merged_embeddings(vl, pngs):
    model, tok, proc, info = vl
    ids, _, inputs = _encode(vl, open_images(pngs[:1]))
    with capture_input_embeds(model) as captured, torch.no_grad():
        assert captured.embeds is None
        model(input_ids=ids[None], pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
              mm_token_type_ids=mm_token_type_ids(ids[None], info))
    assert len(captured.calls) == 1 and captured.embeds is captured.calls[0]
    text = ids != info.image_token_id
    token_embeds = model.get_input_embeddings()(ids)
    assert torch.equal(captured.embeds[0][text], token_embeds[text])
    assert not torch.equal(captured.embeds[0][~text], token_embeds[~text])
    assert not model.model.language_model._forward_pre_hooks  # removed on exit


def test_default_aux_layer_ids_skip_deepstack(vl):
    from transformers import Qwen3VLConfig

    model = vl[0]
    assert aux_layer_ids(_cfg("x"), model.config) == [2, 3, 4]
    big = Qwen3VLConfig(  # Qwen3-VL-2B-like: 28 text layers, 3 deepstack layers
        text_config={"num_hidden_layers": 28, "hidden_size": 2048},
        vision_config={"depth": 24, "deepstack_visual_indexes": [5, 11, 17]},
    )
    assert aux_layer_ids(_cfg("x"), big) == [3, 13, 24]
    assert aux_layer_ids(_cfg("x", aux=[2, 3, 4]), model.config) == [2, 3, 4]
    with pytest.raises(ValueError, match=r"target.aux_layer_ids: \[1, 3, 4\].*deepstack"):
        aux_layer_ids(_cfg("x", aux=[1, 3, 4]), model.config)
    # other kinds keep the text formula (Qwen2.5-VL has no deepstack)
    assert aux_layer_ids(_cfg("x", kind="qwen2_5_vl"), big) == [1, 13, 24]
    assert aux_layer_ids(_cfg("x", kind="causal_lm"), big.text_config) == [1, 13, 24]
    assert aux_layer_ids(_cfg("x", kind="causal_lm"), big, kind="qwen3_vl") == [3, 13, 24]


def test_load_image_processor_bounds_pixels(tiny_vl_dir, tmp_path):
    from PIL import Image

    big = Image.new("RGB", (512, 512), (10, 120, 200))
    default = load_image_processor(tiny_vl_dir)
    assert default.size.longest_edge == 128 * 128 and default.patch_size == 16 and default.merge_size == 2
    for proc, bound in ((default, 128 * 128), (load_image_processor(tiny_vl_dir, max_pixels=64 * 64), 64 * 64)):
        grid = image_inputs([big], proc)["image_grid_thw"][0]
        pixels = int(grid[1] * grid[2]) * 16 * 16
        assert pixels <= bound and pixels >= bound // 4
    small = load_image_processor(tiny_vl_dir, min_pixels=96 * 96)
    grid = image_inputs([Image.new("RGB", (32, 32))], small)["image_grid_thw"][0]
    assert int(grid[1] * grid[2]) * 16 * 16 >= 96 * 96
    with pytest.raises(ValueError, match="min"):
        load_image_processor(tiny_vl_dir, min_pixels=200 * 200)  # above the default max


def test_pixel_bounds_hold_for_a_qwen2_5_vl_processor_config(tmp_path):
    """Qwen2.5-VL checkpoints' preprocessor_config.json carries min_pixels / max_pixels, which transformers lets
    override `size`: data.image_max_pixels was dropped without a word, and a phone photo became ~15,500 image
    tokens in the data stage, the extraction and the engine alike."""
    from PIL import Image

    config = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
              "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
              "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor"}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    assert load_image_processor(tmp_path).size.longest_edge == 12845056
    bounded = load_image_processor(tmp_path, max_pixels=1003520)
    assert (bounded.size.shortest_edge, bounded.size.longest_edge) == (3136, 1003520)
    t, h, w = image_inputs([Image.new("RGB", (4032, 3024))], bounded)["image_grid_thw"][0].tolist()
    assert h * w * 14 * 14 <= 1003520


def test_open_images_errors_name_the_file(tmp_path, pngs):
    missing = tmp_path / "nope.png"
    with pytest.raises(FileNotFoundError, match="nope.png"):
        open_images([pngs[0], missing])
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not an image")
    with pytest.raises(ValueError, match="broken.png"):
        open_images([broken])
    gray = tmp_path / "gray.png"
    from PIL import Image

    Image.new("L", (8, 8)).save(gray)
    assert open_images([gray])[0].mode == "RGB"


def test_an_image_the_processor_refuses_is_quarantined_naming_it(vl, pngs, tmp_path):
    """Qwen-VL's resize refuses an aspect ratio past 200 (a server refuses the request alike): the row
    is quarantined as image_refused naming that image among the row's, not as an unreadable file."""
    from PIL import Image

    from specforge.data.formats import DataError
    from specforge.data.vl_render import render_vl

    _, tok, proc, info = vl
    strip = tmp_path / "strip.png"
    Image.new("RGB", (4000, 10)).save(strip)
    messages = [{"role": "user", "content": [{"type": "image", "image": str(pngs[0])},
                                             {"type": "image", "image": str(strip)},
                                             {"type": "text", "text": "Weather?"}]},
                {"role": "assistant", "content": "sunny"}]
    with pytest.raises(DataError, match=rf"^image_refused: {strip}: the target's image processor refuses it "
                                        r"\(.*aspect ratio"):
        render_vl(tok, messages, proc, info)


def test_qwen2_5_vl_positions_and_hidden_states(tmp_path):
    """Qwen2.5-VL (no deepstack, its own get_rope_index) through the same helpers, built in memory."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=None, eos_token_id=2, pad_token_id=0,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, window_size=56, fullatt_block_indexes=[1]),
        image_token_id=5, video_token_id=6, vision_start_token_id=3, vision_end_token_id=4,
    )
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(tmp_path)
    model = load_target(_cfg(tmp_path, kind="qwen2_5_vl"))
    assert isinstance(model, Qwen2_5_VLForConditionalGeneration)
    info = vl_info(model.config)
    assert info.deepstack_layers == 0 and not info.mrope_interleaved and info.mrope_section == (2, 3, 3)
    assert aux_layer_ids(_cfg("x", kind="qwen2_5_vl", aux=[0, 1, 3]), model.config) == [0, 1, 3]
    grid = torch.tensor([[1, 4, 6]])
    ids, _ = expand_image_tokens([1, 9, 3, 5, 4, 10, 11, 2], [0] * 8, image_token_counts(grid, 2), 5)
    ids = torch.tensor(ids)
    pixel_values = torch.randn(24, 3 * 2 * 14 * 14)
    expected = _lm_position_ids(model, input_ids=ids[None], pixel_values=pixel_values, image_grid_thw=grid,
                                mm_token_type_ids=mm_token_type_ids(ids[None], info))
    positions, _ = rope_positions(model, ids, grid)
    assert torch.equal(positions, expected)
    res = vl_hidden_states(model, ids[None], torch.ones_like(ids)[None], pixel_values, grid, [0, 1, 3])
    assert res["aux"].shape == (1, ids.numel(), 3 * 64) and res["image_embeds"].shape == (6, 64)
    with torch.no_grad():
        feats = model.model.get_image_features(pixel_values, grid)
    torch.testing.assert_close(res["image_embeds"], torch.cat(list(feats.pooler_output)), atol=1e-6, rtol=1e-6)


def test_vl_info_from_config_json_dicts():
    """Released config.json layouts: Qwen2.5-VL flat with top-level rope_scaling, Qwen3-VL nested."""
    flat = {"model_type": "qwen2_5_vl", "hidden_size": 2048, "num_hidden_layers": 36, "image_token_id": 151655,
            "video_token_id": 151656, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
            "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
            "vision_config": {"spatial_merge_size": 2, "depth": 32}}
    info = vl_info(flat)
    assert (info.hidden_size, info.num_hidden_layers, info.mrope_section, info.mrope_interleaved,
            info.deepstack_layers) == (2048, 36, (16, 24, 24), False, 0)
    nested = {"model_type": "qwen3_vl", "image_token_id": 151655,
              "text_config": {"hidden_size": 2048, "num_hidden_layers": 28,
                              "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20]}},
              "vision_config": {"spatial_merge_size": 2, "deepstack_visual_indexes": [5, 11, 17]}}
    info = vl_info(nested)
    assert (info.num_hidden_layers, info.deepstack_layers, info.mrope_interleaved) == (28, 3, True)
    with pytest.raises(ValueError, match="not a supported VL target"):
        vl_info({"model_type": "llama"})
