"""The vision-language pipeline (`+exp=qwen3vl_tiny`): data -> extract -> train -> eval with real
images on a tiny random Qwen3-VL, composed from the real conf/ through Hydra."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from data_prep.weather import main as weather_main
from specforge.config import register_configs
from specforge.extract.store import HiddenStateStore
from specforge.pipeline import run_pipeline
from specforge.targets.loader import load_target
from specforge.targets.vl import image_inputs, load_image_processor, open_images, rope_positions, vl_info
from specforge.train.batches import collate
from specforge.utils.io import read_json, read_jsonl

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def compose_cfg(tmp_path, target_dir, *overrides):
    register_configs()
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return compose("config", overrides=[
            "+exp=qwen3vl_tiny",
            f"output_dir={tmp_path / 'outputs'}",
            f"cache_dir={tmp_path / 'cache'}",
            f"target.path={target_dir}",
            "target.fetch=null",
            f"data.train_files=[{tmp_path / 'data' / 'train.jsonl'}]",
            f"data.eval_files=[{tmp_path / 'data' / 'eval.jsonl'}]",
            *overrides,
        ])


@pytest.fixture(scope="module")
def vl_run(tmp_path_factory, tiny_vl_dir):
    """One run of the whole pipeline; a row whose image is missing is appended to the train data."""
    tmp_path = tmp_path_factory.mktemp("vl")
    assert weather_main(["--out", str(tmp_path / "data"), "--train", "20", "--eval", "4", "--seed", "0",
                         "--images", "0.6", "--image-size", "160"]) == 0
    with open(tmp_path / "data" / "train.jsonl", "a") as f:
        f.write(json.dumps({"id": "lost", "messages": [
            {"role": "user", "content": [{"type": "image", "image": "images/nowhere.png"},
                                         {"type": "text", "text": "Weather?"}]},
            {"role": "assistant", "content": "city: Oslo"}]}) + "\n")
    cfg = compose_cfg(tmp_path, tiny_vl_dir)
    summaries = run_pipeline(cfg)
    return tmp_path / "outputs" / "qwen3vl_tiny", summaries, cfg


def test_every_stage_runs_with_images(vl_run):
    run_dir, summaries, _ = vl_run
    assert set(summaries) == {"data", "extract", "train", "eval"}
    rows = list(read_jsonl(run_dir / "data" / "train.jsonl"))
    assert sum(len(r.get("images", [])) for r in rows) == summaries["data"]["train"]["images"] > 0
    assert any(len(r.get("images", [])) == 2 for r in rows), "no multi-image sample"
    # the checkpoint carries the explicit aux ids (after the 2 deepstack layers) and the M-RoPE settings
    config = json.loads((run_dir / "epoch_2" / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]
    assert config["rope_scaling"] == {"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True}
    assert config["image_embeddings"] == "merged"
    # the evaluation ran on prompts with images and reports the same table as for text
    report = (run_dir / "eval" / "report.md").read_text()
    assert "| tree |" in report and "3_2_6" in report
    results = read_json(run_dir / "eval" / "results.json")
    assert all(row["lossless"] == 1.0 for row in results["configs"])  # fp32 tiny target, greedy


def test_missing_image_is_quarantined_with_its_path(vl_run):
    run_dir, summaries, _ = vl_run
    quarantine = list(read_jsonl(run_dir / "data" / "quarantine.jsonl"))
    lost = [q for q in quarantine if q["row"].get("id") == "lost"]
    assert len(lost) == 1 and lost[0]["reason"].startswith("image_missing: images/nowhere.png")
    assert summaries["data"]["train"]["by_reason"] == {"image_missing": 1}


def test_image_tokens_never_carry_loss(vl_run, tiny_vl_dir):
    run_dir, _, _ = vl_run
    info = vl_info(tiny_vl_dir)
    for row in read_jsonl(run_dir / "data" / "train.jsonl"):
        at_images = [m for t, m in zip(row["input_ids"], row["loss_mask"]) if t == info.image_token_id]
        assert len(at_images) == (16 * len(row.get("images", [])))  # a 160 px widget -> 128 px -> 8x8 patches -> 16 tokens
        assert not any(at_images)


def test_stored_positions_and_image_features_are_the_targets(vl_run, tiny_vl_dir):
    """The store holds the target's own 3-D positions and merged embeddings at image tokens, and
    a batch feeds those embeddings to the draft at exactly the image positions."""
    run_dir, _, cfg = vl_run
    store = HiddenStateStore(run_dir / "extract" / "train")
    rows = {r["id"]: r for r in read_jsonl(run_dir / "data" / "train.jsonl")}
    i = next(k for k, sid in enumerate(store.ids) if len(rows[sid].get("images", [])) == 2)
    sample, row = store[i], rows[store.ids[i]]
    model = load_target(cfg.target)
    ids = torch.tensor([row["input_ids"]])
    processor = load_image_processor(tiny_vl_dir, cfg.data.image_min_pixels, cfg.data.image_max_pixels)
    images = image_inputs(open_images(row["images"]), processor)
    positions, _ = rope_positions(model, ids, images["image_grid_thw"])
    assert torch.equal(sample["position_ids"], positions[:, 0])
    assert not torch.equal(positions[0, 0], positions[1, 0])  # really 3-D: images have 2-D grids
    with torch.no_grad():
        features = torch.cat(model.model.get_image_features(images["pixel_values"], images["image_grid_thw"]).pooler_output)
    torch.testing.assert_close(sample["image_embeds"].float(), features, atol=1e-2, rtol=1e-2)  # bf16 store
    image_token = vl_info(tiny_vl_dir).image_token_id
    batch = collate([sample], image_token_id=image_token)
    assert torch.equal(batch["embed_override_mask"][0], ids[0] == image_token)
    assert torch.equal(batch["embed_override"][0][ids[0] == image_token], sample["image_embeds"].float())
