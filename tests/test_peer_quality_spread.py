"""benchmarks/peer_quality.py --spread: ours / peer per seed and over seeds, from the runs' own
result files (the training runs need the peer's virtualenv; the spread does not)."""
import json
import sys

import pytest

from tests.test_eval_profile import benchmark, tiny_run  # noqa: F401 - the fixture: a run dir


def result(seed, ours, peer, **budget):
    return {"rows": [{"tree": t, "ours": o, "peer": p} for t, o, p in zip(("2_1_3", "4_2_8"), ours, peer)],
            "seed": seed, "samples": 238, "tokens": 45692, "steps": 180, "epochs": 3, "prompts": 30,
            "max_new_tokens": 128, "dtype": "float32", "ours_overrides": [], **budget}


def write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def test_spread_over_seeds(tmp_path, capsys):
    module = benchmark("peer_quality")
    files = [write(tmp_path, "s0.json", result(0, (2.2, 2.5), (2.0, 2.5))),
             write(tmp_path, "s1.json", result(1, (2.0, 2.6), (2.0, 2.0)))]
    out = tmp_path / "seeds.json"
    assert module.main(["--spread", *files, "--spread-out", str(out)]) == 0
    spread = json.loads(out.read_text())
    assert spread["seeds"] == [0, 1] and spread["steps"] == 180
    first, second = spread["rows"]
    assert first["tree"] == "2_1_3" and first["ratio"] == pytest.approx([1.1, 1.0])
    assert first["ratio_mean"] == pytest.approx(1.05) and first["ratio_min"] == pytest.approx(1.0)
    assert second["ratio"] == pytest.approx([1.0, 1.3]) and second["ratio_max"] == pytest.approx(1.3)
    assert "--spread" in spread["command"]
    assert "| 2_1_3 | 1.100 | 1.000 | **1.050** |" in capsys.readouterr().out


@pytest.mark.parametrize("other, message", [(result(1, (2.0, 2.0), (2.0, 2.0), steps=120), "steps differ"),
                                            (result(0, (2.0, 2.0), (2.0, 2.0)), "two different seeds"),
                                            (result(1, (2.0, 2.0), (2.0, 2.0), ours_overrides=["train.step_weight=1"]),
                                             "ours_overrides differ"),
                                            (result(1, (2.0, 2.0), (2.0, 2.0), ttt_length=7), "ttt_length differ")])
def test_spread_refuses_runs_that_differ_in_more_than_the_seed(tmp_path, other, message):
    module = benchmark("peer_quality")
    files = [write(tmp_path, "s0.json", result(0, (2.2, 2.5), (2.0, 2.5))), write(tmp_path, "other.json", other)]
    with pytest.raises(SystemExit, match=message):
        module.main(["--spread", *files, "--spread-out", str(tmp_path / "seeds.json")])
    assert not (tmp_path / "seeds.json").exists()


def test_a_ttt_length_for_ours_alone_is_refused(tiny_run, tmp_path):
    """Both trainers unroll the same TTT steps: --ttt-length sets both, --set would change ours only."""
    module = benchmark("peer_quality")
    with pytest.raises(SystemExit, match="use --ttt-length"):
        module.main(["--run", str(tiny_run), "--peer-python", sys.executable, "--work", str(tmp_path / "w"),
                     "--set", "train.ttt_length=7"])


def test_a_draft_option_for_ours_alone_is_refused(tiny_run, tmp_path):
    """Both trainers train one architecture: --draft sets both, --set draft.<option> would change ours only."""
    module = benchmark("peer_quality")
    with pytest.raises(SystemExit, match="use --draft"):
        module.main(["--run", str(tiny_run), "--peer-python", sys.executable, "--work", str(tmp_path / "w"),
                     "--set", "draft.fc_norm=true"])


@pytest.mark.parametrize("peer, shift", [("speculators", "2"), ("specforge", "-1")])
def test_a_mask_shift_is_an_ablation_of_specforge_alone(tiny_run, tmp_path, peer, shift):
    """--peer-mask-shift moves SpecForge's loss positions; it means nothing for another peer, nor backwards."""
    module = benchmark("peer_quality")
    with pytest.raises(SystemExit, match="--peer-mask-shift: an ablation of SpecForge's loss positions"):
        module.main(["--run", str(tiny_run), "--peer", peer, "--peer-python", sys.executable,
                     "--work", str(tmp_path / "w"), "--peer-mask-shift", shift])


def test_a_peer_trained_with_another_mask_shift_is_not_reused(tiny_run, tmp_path):
    """A SpecForge draft in --peer-work is reused only where it was trained with the --peer-mask-shift asked
    for (one from before the flag: as released), or the result would name a shift its peer never had."""
    from specforge.run_layout import RunLayout
    from tests.test_store_fp8 import BF16_META, make_samples, write_all

    write_all(RunLayout(tiny_run).store("train"), make_samples(4), BF16_META)
    raw = tmp_path / "w" / "specforge" / "raw"
    raw.mkdir(parents=True)
    (raw / "check.safetensors").write_bytes(b"")
    module = benchmark("peer_quality")
    with pytest.raises(SystemExit, match=r"trained with --peer-mask-shift 0, not 2: give another --peer-work"):
        module.main(["--run", str(tiny_run), "--peer", "specforge", "--peer-python", sys.executable,
                     "--work", str(tmp_path / "w"), "--peer-mask-shift", "2"])
    (raw.parent / "trained_with.json").write_text('{"mask_shift": 2}')
    with pytest.raises(SystemExit, match=r"trained with --peer-mask-shift 2, not 0"):
        module.main(["--run", str(tiny_run), "--peer", "specforge", "--peer-python", sys.executable,
                     "--work", str(tmp_path / "w")])


def test_a_peer_without_its_virtualenv_names_the_make_target(tiny_run, tmp_path):
    module = benchmark("peer_quality")
    missing = tmp_path / "no-venv" / "python"
    with pytest.raises(SystemExit, match=r"not found: run `make specforge-venv` first \(specforge in its own"):
        module.main(["--run", str(tiny_run), "--peer", "specforge", "--peer-python", str(missing),
                     "--work", str(tmp_path / "w")])


def test_an_ablation_row_trains_the_architecture_of_its_baseline(tiny_run, tmp_path):
    """A row against a peer run of EAGLE 3.1 options must train ours with them: --draft, as that run did."""
    module = benchmark("peer_quality")
    baseline = write(tmp_path, "base.json", {"epochs": 3, "prompts": 1, "rows": [],
                                             "draft_options": {"fc_norm": True, "norm_output": True,
                                                               "norm_before_fc": False}})
    with pytest.raises(SystemExit, match="pass that run's --draft"):
        module.main(["--run", str(tiny_run), "--ablate", "x", "--draft", "eagle3", "--out", baseline,
                     "--ablation-out", str(tmp_path / "rows.json"), "--work", str(tmp_path / "w")])
    assert not (tmp_path / "rows.json").exists()


def test_a_peer_run_refuses_an_fp8_store(tiny_run, tmp_path):
    """An fp8 store keeps `last` only at the rows our loss reads; the peers' losses read others (zeros there)."""
    from specforge.run_layout import RunLayout
    from tests.test_store_fp8 import FP8_META, make_samples, write_all

    write_all(RunLayout(tiny_run).store("train"), make_samples(4), FP8_META)
    module = benchmark("peer_quality")
    with pytest.raises(SystemExit, match="an fp8 store keeps the target's final state only where our loss"):
        module.main(["--run", str(tiny_run), "--peer-python", sys.executable, "--work", str(tmp_path / "w")])
    assert not (tmp_path / "w").exists()
