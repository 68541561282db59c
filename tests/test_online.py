"""extract=online: no hidden-state store, the train stage computes each micro-batch's states with the
target. Trained from the same rows, it must be the same training as from an extracted store."""
from __future__ import annotations

import pytest
import torch

from specforge.checkpoint import read_checkpoint
from specforge.pipeline import run_pipeline
from specforge.utils.metrics_log import read_metrics
from tests.test_pipeline import compose_cfg, weather_files  # noqa: F401  (fixture)


@pytest.mark.parametrize("pack_tokens", [0, 1024])
def test_online_training_is_the_stored_states_training_without_a_store(weather_files, tiny_target_dir,  # noqa: F811
                                                                       pack_tokens):
    tmp = weather_files
    # AdamW: Muon orthogonalises in bf16 where the CPU has it (AVX-512 bf16), and the two runs' different
    # padding flips a few of its roundings: a few weights then differ by more than one bf16 step
    common = ["extract.dtype=float32", "train.optimizer=adamw", "train.epochs=2", f"train.pack_tokens={pack_tokens}"]
    offline = compose_cfg(tmp, tiny_target_dir, *common, "run_name=offline")
    online = compose_cfg(tmp, tiny_target_dir, *common, "run_name=online", "extract=online")
    run_pipeline(offline)
    summaries = run_pipeline(online)
    off_dir, on_dir = tmp / "outputs" / "offline", tmp / "outputs" / "online"

    assert summaries["extract"]["backend"] == "online" and summaries["extract"]["stored_bytes"] == 0
    assert summaries["extract"]["splits"]["train"]["samples"] == 24
    assert not (on_dir / "extract" / "train").exists() and (off_dir / "extract" / "train" / "manifest.json").exists()
    want, got = read_metrics(off_dir / "metrics.jsonl"), read_metrics(on_dir / "metrics.jsonl")
    assert [m["split"] for m in got] == [m["split"] for m in want]
    for a, b in zip(want, got):  # padding differs (a store's batches vs micro-batches): float32 rounding only
        assert b["loss" if "loss" in a else "sim_accept_length"] == pytest.approx(
            a["loss" if "loss" in a else "sim_accept_length"], rel=1e-4, abs=1e-5)
        assert b.get("positions") == a.get("positions")  # the same samples in the same batches
    (cfg_a, w_a), (cfg_b, w_b) = read_checkpoint(off_dir / "epoch_2"), read_checkpoint(on_dir / "epoch_2")
    assert cfg_a.aux_layer_ids == cfg_b.aux_layer_ids == [0, 1, 3]
    for key in w_a:  # saved in bf16: at most one rounding step apart
        torch.testing.assert_close(w_b[key].float(), w_a[key].float(), rtol=2 ** -7, atol=1e-4)
    assert "`extract=online`: nothing stored; " in (on_dir / "report.md").read_text()


def test_online_refuses_what_it_cannot_compute(tmp_path, tiny_target_dir):
    with pytest.raises(ValueError, match=r"extract.backend=online: fp8 is a storage format"):
        run_pipeline(compose_cfg(tmp_path, tiny_target_dir, "extract=online", "extract.dtype=fp8"))
    with pytest.raises(ValueError, match=r"extract.backend=online: text targets only \(target.kind=qwen3_vl\)"):
        run_pipeline(compose_cfg(tmp_path, tiny_target_dir, "extract=online", "target.kind=qwen3_vl"))


def test_a_micro_batch_is_computed_in_forwards_of_at_most_batch_tokens(tiny_target_dir):
    """A packed micro-batch can hold many samples: its forwards are planned as an extraction's, and
    each sample's states are what a forward of that sample alone gives."""
    from specforge.config import TargetConfig
    from specforge.extract.embedded import EmbeddedExtractor
    from specforge.extract.online import OnlineStates
    from specforge.targets.loader import load_target

    target = load_target(TargetConfig(name="tiny", path=str(tiny_target_dir), dtype="float32"))
    lengths = [30, 24, 20, 9, 5]
    rows = [{"id": f"r{i}", "input_ids": torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(i)),
             "loss_mask": torch.ones(n, dtype=torch.uint8)} for i, n in enumerate(lengths)]
    extractor = EmbeddedExtractor(target, [0, 1, 3], batch_tokens=48, storage_dtype=torch.float32)
    states = OnlineStates(rows, extractor, {"aux_layer_ids": [0, 1, 3]})
    states.prefetch(range(5))
    # longest first: [30], [24, 20] (2 x 24 = 48), [9, 5]: three forwards, none over 48 padded tokens
    assert extractor.stats["padded_tokens"] == 30 + 48 + 18 and extractor.stats["tokens"] == sum(lengths)
    alone = EmbeddedExtractor(target, [0, 1, 3], batch_tokens=48, storage_dtype=torch.float32)
    for i, row in enumerate(rows):
        aux, last = alone.forward([row["input_ids"]])[0]
        torch.testing.assert_close(states[i]["aux"], aux, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(states[i]["last"], last, rtol=1e-5, atol=1e-5)
    assert states.num_tokens == sum(lengths) and [r["id"] for r in states.rows] == [r["id"] for r in rows]
    assert extractor.stats["tokens"] == sum(lengths)  # read from what was prefetched, not computed again


def test_online_refuses_states_past_float16_as_a_store_does_naming_the_sample(tmp_path, tiny_target_dir):
    """extract.dtype=float16 with states past 65504: an extraction refuses the sample, naming it; online
    trained on inf (loss nan, steps skipped, stopped with "lower train.lr"). Now refused alike, before
    training reads it: the target's states are handed over in its own dtype and rounded as a store does."""
    from specforge.extract.embedded import EmbeddedExtractor
    from specforge.extract.online import OnlineStates
    from specforge.extract.store import handoff_dtype, store_layout
    from specforge.run_layout import RunLayout
    from specforge.train.loop import open_stores
    from specforge.utils.io import write_jsonl
    from tests.test_extract import FLOAT16_OVERFLOW, OVERFLOW_ROWS, overflowing_target

    extractor = EmbeddedExtractor(overflowing_target(), [0, 1, 2], 64, handoff_dtype("float16", torch.float32))
    states = OnlineStates(OVERFLOW_ROWS, extractor, {"aux_layer_ids": [0, 1, 2], **store_layout("float16")})
    with pytest.raises(ValueError, match=FLOAT16_OVERFLOW):
        states.prefetch([0])

    # the train stage's wiring: a float32 target hands over float32, read back as the float16 a store holds
    layout = RunLayout(tmp_path / "run")
    write_jsonl(layout.samples("train"), [{"id": "r", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}])
    cfg = compose_cfg(tmp_path, tiny_target_dir, "extract=online", "extract.dtype=float16")
    train, _ = open_stores(cfg, layout, "cpu")
    assert train.extractor.storage_dtype == torch.float32
    assert train[0]["aux"].dtype == train[0]["last"].dtype == torch.float16


def test_switching_a_run_to_online_keeps_its_store_unread(weather_files, tiny_target_dir, capsys):  # noqa: F811
    """A store is hours of target forwards: switching the same run to extract=online leaves it (and says
    so), training reruns from the target; switching back resumes the store, nothing extracted again."""
    tmp = weather_files
    run_pipeline(compose_cfg(tmp, tiny_target_dir, "train.epochs=1"))
    store = tmp / "outputs" / "smollm2_weather" / "extract" / "train"
    before = sorted(p.name for p in store.iterdir())
    summaries = run_pipeline(compose_cfg(tmp, tiny_target_dir, "train.epochs=1", "extract=online"))
    assert summaries["extract"]["backend"] == "online" and summaries["train"]["steps"] == 6
    assert "from an earlier extraction is kept but not read" in capsys.readouterr().out
    assert sorted(p.name for p in store.iterdir()) == before
    again = run_pipeline(compose_cfg(tmp, tiny_target_dir, "train.epochs=1"))
    assert again["extract"]["extracted_tokens"] == 0 and again["extract"]["splits"]["train"]["resumed_samples"] == 24

