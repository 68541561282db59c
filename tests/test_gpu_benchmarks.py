"""What benchmarks/gpu_check.sh runs on a GPU, run here on the CPU at the tiny target's geometry:
the extraction benchmark and the verify cost curve on random weights from a config, and the
summary that turns the parts' files into gpu.json (with a real pytest JUnit file and exit codes)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from tests.test_eval_profile import benchmark

ROOT = Path(__file__).resolve().parents[1]


def _config_only(tiny_target_dir: Path, tmp_path: Path) -> Path:
    """The tiny target's geometry without its weights, as benchmarks/targets/* hold them, with 8
    layers (the default aux layers [1, N//2-1, N-4] need N >= 8)."""
    folder = tmp_path / "geometry"
    folder.mkdir()
    config = json.loads((tiny_target_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 8}))
    return folder


def test_verify_cost_curve_from_a_config_runs_every_n_and_leaves_the_prefix(tiny_target_dir, tmp_path):
    bench = benchmark("verify_cost_bench")
    out = tmp_path / "verify.json"
    assert bench.main(["--config", str(_config_only(tiny_target_dir, tmp_path)), "--device", "cpu",
                       "--prefix", "40", "--ns", "1,3,8", "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["target"] == "geometry (random weights)" and report["device"].startswith("cpu")
    assert [r["n"] for r in report["rows"]] == [1, 3, 8] and report["prefix_len"] == 40
    assert all(r["t_verify_ms"] > 0 for r in report["rows"]) and report["t_decode_ms"] > 0
    assert report["command"].startswith("python benchmarks/verify_cost_bench.py --config ")

    # what it times is the engine's verify forward; the cache holds the prefix alone after each
    from specforge.engine.target import TargetRunner

    model = benchmark("geometry").random_target(tiny_target_dir, "float32", "cpu")
    runner = TargetRunner(model, [0, 1, 2])
    bench.verify_curve(runner, 17, [5], repeats=2)
    assert runner.length == 17


def test_extraction_benchmark_on_random_weights_at_a_geometry(tiny_target_dir, tmp_path):
    out = tmp_path / "extract.json"
    assert benchmark("extract_bench").main([
        "--config", str(_config_only(tiny_target_dir, tmp_path)), "--device", "cpu", "--dtypes", "float32",
        "--budgets", "256", "--samples", "6", "--min-len", "16", "--max-len", "64", "--threads", "1",
        "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["model"] == "geometry (random weights)" and report["device"].startswith("cpu")
    (row,) = report["results"]
    assert row["tokens"] == report["tokens"] and row["forward_tok_s"] > 0


def test_the_8b_geometries_are_8b():
    from transformers import AutoConfig, AutoModelForCausalLM

    for name, billions in (("llama-3.1-8b", 8.03), ("qwen3-8b", 8.19)):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ROOT / "benchmarks/targets" / name))
        assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == billions, name


def test_gpu_summary_gathers_the_parts_and_names_what_is_missing(tiny_target_dir, tmp_path):
    summary = benchmark("gpu_summary")
    first, second = tmp_path / "call1", tmp_path / "call2"
    first.mkdir(), second.mkdir()
    assert summary.main(["--env", str(first / "env.json")]) == 0
    assert benchmark("verify_cost_bench").main([
        "--config", str(_config_only(tiny_target_dir, tmp_path)), "--device", "cpu", "--prefix", "16",
        "--ns", "1,4", "--repeats", "1", "--out", str(second / "verify_cost_gpu.json")]) == 0
    (first / "verify.log").write_text("...\nrc=124\n")  # the first call ran out of time on it
    (second / "verify.log").write_text("| 1 | ...\nrc=0\n")
    (second / "extract.log").write_text("[bench] bfloat16 ...\n")  # cut off before its exit status
    # a real JUnit file: one test that passes, one that fails
    tests = tmp_path / "test_two.py"
    tests.write_text("def test_passes():\n    assert True\n\n\ndef test_fails():\n    assert 1 == 2\n")
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests),
                    f"--junitxml={second / 'test_cuda.xml'}"], capture_output=True, cwd=tmp_path)

    out = tmp_path / "gpu.json"
    assert summary.main([str(first), str(second), "--out", str(out)]) == 0
    gpu = json.loads(out.read_text())
    assert gpu["device"] == "cpu" and gpu["versions"]["torch"] == torch.__version__
    assert gpu["parts"]["verify"] == 0 and gpu["parts"]["extract"] is None and gpu["parts"]["stages"] is None
    assert [r["n"] for r in gpu["verify"]["rows"]] == [1, 4]
    assert gpu["tests"]["test_cuda"] == {"passed": 1, "failed": 1, "skipped": 0,
                                         "failures": ["test_two::test_fails"]}
    assert gpu["missing"] == ["extract", "train_length", "attention", "train_vs_peer", "stages"]
    assert gpu["extraction"] is None and gpu["training"] is None

    assert summary.main([str(tmp_path / "nowhere"), "--out", str(out)]) == 2


def test_gpu_summary_fills_what_did_not_come_back_from_the_machines_own_summary_and_a_cut_off_log(tmp_path):
    """Files can stay behind on the machine (gpu_check's gpu.json there has their figures), and a test
    part killed by its limit leaves no JUnit file (its -v log has the outcomes so far)."""
    summary = benchmark("gpu_summary")
    call = tmp_path / "call1"
    call.mkdir()
    assert summary.main(["--env", str(call / "env.json")]) == 0
    verify = {"target": "t", "dtype": "bfloat16", "prefix_len": 16, "t_decode_ms": 1.0,
              "rows": [{"n": 1, "t_verify_ms": 1.0, "vs_decode": 1.0}]}
    (call / "gpu.json").write_text(json.dumps({"verify": verify, "parts": {"verify": 0, "stages": None}}))
    (call / "stages.log").write_text(
        "[gw0] [ 10%] PASSED tests/test_a.py::test_one \n[gw1] [ 20%] FAILED tests/test_a.py::test_two[x-1] \n"
        "tests/test_b.py::test_three PASSED [ 30%]\n[gw2] [ 40%] SKIPPED tests/test_b.py::test_four \n"
        "tests/test_b.py::test_five[0] rc=124\n")  # test_five was running when the limit came
    out = tmp_path / "gpu.json"
    assert summary.main([str(call), "--out", str(out)]) == 0
    gpu = json.loads(out.read_text())
    assert gpu["verify"] == verify and gpu["parts"]["verify"] == 0 and gpu["parts"]["stages"] == 124
    assert gpu["tests"]["stages"] == {"passed": 2, "failed": 1, "skipped": 1, "cut_off": True,
                                      "failures": ["tests/test_a.py::test_two[x-1]"]}
    assert "verify" not in gpu["missing"] and "stages" not in gpu["missing"] and "extract" in gpu["missing"]


def test_a_training_step_timed_and_profiled_as_on_a_gpu(tiny_target_dir):
    """train_bench's --length-scaling step off the CPU (time_config), here on the CPU: its time,
    and with profile=True its top ops by own time, each with its share of the step."""
    from transformers import AutoConfig

    bench = benchmark("train_bench")
    r = bench.time_config(AutoConfig.from_pretrained(tiny_target_dir), "sdpa", "fp32", 3, 64, batch=2, seq=32,
                          repeats=1, profile=True)
    assert r["step_s"] > 0 and r["tokens_per_s"] > 0
    ops = r["top_ops"]
    assert 3 <= len(ops) <= 12 and all(op["ms"] >= 0 and op["calls"] >= 1 for op in ops)
    assert [op["ms"] for op in ops] == sorted((op["ms"] for op in ops), reverse=True)
    assert 0 < sum(op["share"] for op in ops) <= 1.001
    assert any(op["op"] in ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear") for op in ops)


def test_the_peer_worker_gives_a_geometry_random_verifier_weights_once(tiny_target_dir, tmp_path, monkeypatch):
    """benchmarks/peer_train_worker.py on a target that is a config alone (benchmarks/targets/*, as
    on a GPU machine): a folder with that config and the three tensors the peer's draft reads from
    its verifier, at the config's shapes, made once and reused; a target with weights is used as it
    is. Its kernels default per device: sdpa and the eager loss on a CPU, its own defaults on a GPU."""
    import tempfile

    from safetensors import safe_open

    worker = benchmark("peer_train_worker")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    geometry = _config_only(tiny_target_dir, tmp_path)
    made = Path(worker.verifier_dir(str(geometry)))
    assert made.parent == tmp_path and made != geometry
    config = json.loads((geometry / "config.json").read_text())
    with safe_open(str(made / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    assert shapes == {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
                      "model.norm.weight": (hidden,)}
    assert json.loads((made / "config.json").read_text())["hidden_size"] == hidden
    stamp = (made / "model.safetensors").stat().st_mtime_ns
    assert worker.verifier_dir(str(geometry)) == str(made)  # the next configuration's process: reused
    assert (made / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("peer_verifier_")] == [made.name]
    assert worker.verifier_dir(str(tiny_target_dir)) == str(tiny_target_dir)
    assert worker.verifier_eos(str(geometry)) in range(vocab)

    cpu, gpu = worker.parse_args([]), worker.parse_args(["--device", "cuda"])
    assert (cpu.attn_impl, cpu.loss_impl) == ("sdpa", "eager")
    assert (gpu.attn_impl, gpu.loss_impl) == ("simple_flex_attention", "fused")
    assert worker.parse_args(["--device", "cuda", "--attn-impl", "sdpa"]).attn_impl == "sdpa"
