"""The disk check before an extraction: the stores' size estimated from the samples is what the
extraction then writes (every storage dtype, vision-language rows too), and a filesystem without
room for it is refused before the target runs, naming what stores less."""
from __future__ import annotations

import json

import pytest
import torch

from specforge.errors import InvalidInput
from specforge.extract import stage
from specforge.extract.disk import check_disk_space, store_bytes, written_bytes
from specforge.extract.store import HiddenStateStoreWriter, store_layout
from tests.test_extract import run_setup, tiny_dir, tiny_model  # noqa: F401
from tests.test_store import META, make_samples

HEADERS = 0.02  # what the estimate leaves out: each shard's safetensors header (its sample ids among them)


def shard_bytes(directory) -> int:
    return sum(p.stat().st_size for p in directory.rglob("shard_*.safetensors"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "fp8"])
def test_the_estimate_is_what_the_extraction_writes(run_setup, tiny_model, dtype, capsys):
    cfg, run_dir, _ = run_setup
    cfg.extract.dtype = dtype
    stage.run(cfg, run_dir)
    written = shard_bytes(run_dir / "extract")
    rows = [r for split in ("train", "eval") for r in stage.load_rows(run_dir / "data" / f"{split}.jsonl")]
    estimate = store_bytes(rows, 64, 3, dtype)
    assert estimate <= written <= estimate * (1 + HEADERS), (estimate, written)
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[extract] the stores take"))
    assert line.startswith(f"[extract] the stores take ~{estimate / 1e9:.2f} GB ({sum(len(r['input_ids']) for r in rows):,} "
                           f"tokens at extract.dtype={dtype}), 0.00 GB of it from an earlier run; ")
    assert written_bytes([run_dir / "extract"]) >= written


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
def test_the_estimate_counts_image_positions_and_embeddings(tmp_path, dtype):
    meta = dict(META, vl=True, image_token_id=7, **store_layout(dtype))
    g = torch.Generator().manual_seed(3)
    samples = make_samples(9)
    for k, s in enumerate(samples):
        s["input_ids"][: k % 3] = 7  # 0, 1 or 2 image tokens, one embedding each
        s["position_ids"] = torch.randint(0, 100, (3, len(s["input_ids"])), generator=g)
        s["image_embeds"] = torch.randn(int((s["input_ids"] == 7).sum()), META["hidden_size"], generator=g)
    with HiddenStateStoreWriter(tmp_path, meta, shard_samples=3) as w:
        for s in samples:
            w.add(s["id"], s["input_ids"], s["loss_mask"], s["aux"], s["last"], s["position_ids"], s["image_embeds"])
    estimate = store_bytes(samples, META["hidden_size"], 3, dtype, image_token_id=7)
    header = sum(8 + int.from_bytes(p.read_bytes()[:8], "little") for p in tmp_path.glob("shard_*.safetensors"))
    shards = 3  # each offsets tensor (of tokens, images, fp8's scored rows) closes a shard with one int64
    assert 0 <= shard_bytes(tmp_path) - header - estimate <= 3 * 8 * shards  # the tensors' bytes


def test_too_little_room_is_refused_naming_what_stores_less(tmp_path):
    gb = 10**9
    with pytest.raises(InvalidInput) as refused:
        check_disk_space(900 * gb, 0, 300 * gb, tmp_path, 12_000_000, "bfloat16", 430 * gb)
    assert str(refused.value) == (
        f"extract: the stores take ~900.00 GB (12,000,000 tokens at extract.dtype=bfloat16), 0.00 GB of it from an "
        f"earlier run; 300.00 GB free in {tmp_path}. Free space or move output_dir; extract.dtype=fp8 needs "
        "~430.00 GB; extract=online stores nothing (the target runs beside the draft during training). "
        "extract.disk_check=false skips this check")
    # resuming with 700 GB written: 200 more fit in 300
    assert check_disk_space(900 * gb, 700 * gb, 300 * gb, tmp_path, 12_000_000, "bfloat16", 430 * gb).startswith(
        "the stores take ~900.00 GB")
    with pytest.raises(InvalidInput, match=r"Free space or move output_dir; extract=online stores nothing"):
        check_disk_space(500 * gb, 0, 300 * gb, tmp_path, 12_000_000, "fp8", 500 * gb)


def test_the_check_can_be_switched_off_and_is_not_part_of_the_fingerprint(run_setup, tiny_model, capsys):
    from specforge.pipeline import STAGES, stage_fingerprint

    cfg, run_dir, _ = run_setup
    base = stage_fingerprint(cfg, STAGES["extract"], run_dir)
    cfg.extract.disk_check = False
    assert stage_fingerprint(cfg, STAGES["extract"], run_dir) == base
    stage.run(cfg, run_dir)
    assert "the stores take" not in capsys.readouterr().out
    assert json.loads((run_dir / "extract" / "train" / "manifest.json").read_text())["complete"]


def test_rank_stores_of_another_number_of_processes_are_not_counted_as_resumed(run_setup, monkeypatch):
    """A re-run with another number of processes reads none of the rank stores an interrupted run
    left (each rank reads only its own rank<r>of<W>), and they stay on disk until the merge: their
    bytes must not be subtracted from what the extraction needs."""
    from specforge.distributed.env import DistEnv
    from specforge.run_layout import RunLayout

    cfg, run_dir, _ = run_setup
    layout = RunLayout(run_dir)
    for name in ("rank00000of00003", "rank00002of00003"):  # sparse: 10 MB each, on no disk
        (layout.store("train") / name).mkdir(parents=True)
        with open(layout.store("train") / name / "shard_00000.safetensors", "wb") as f:
            f.truncate(10**7)
    meta, model_config = stage.config_meta(cfg)
    rows = stage.read_rows(stage.sample_files(layout), meta)

    def earlier(world_size: int) -> str:
        monkeypatch.setattr(stage.dist, "current", lambda: DistEnv(world_size=world_size))
        return stage.disk_check(cfg, layout, rows, meta, model_config).split(" of it from an earlier run")[0][-7:]

    assert earlier(2) == "0.00 GB" and earlier(1) == "0.00 GB"
    assert earlier(3) == "0.02 GB"  # the same number resumes from them
