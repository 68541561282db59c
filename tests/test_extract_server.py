"""The `server` extract backend: hidden states through SGLang's /generate protocol, exercised for
real against the embedded server (tiny target, fp32), and the extraction servers as processes.

SGLang itself needs CUDA; its launch commands are golden-tested in test_sglang_launch.py."""
from __future__ import annotations

from functools import partial

import pytest
import torch
from transformers import AutoModelForCausalLM

from specforge.extract import stage
from specforge.extract.embedded import EmbeddedExtractor
from specforge.extract.server_backend import ServerExtractor, extraction_servers, gpu_env, prompt_rows
from specforge.extract.store import HiddenStateStore
from specforge.launch.embedded_commands import embedded_extraction_command
from specforge.serving.app import EmbeddedServer
from specforge.serving.handler import HIDDEN_STATES_DISABLED
from specforge.serving.model import load_model
from specforge.launch.process import http_json, http_status
from test_extract import run_setup, tiny_dir  # noqa: F401 (fixtures)

AUX = [0, 1, 2]  # capturable by SGLang too (the last layer, 3, is not: test_sglang_launch.py)


@pytest.fixture(scope="module")
def servers(tiny_target_dir):
    """An aux server, a final server and a server without hidden states, in this process."""
    made = [EmbeddedServer(partial(load_model, tiny_target_dir, dtype="float32", **kw)).start() for kw in (
        {"return_hidden_states": True, "aux_hidden_state_layer_ids": AUX},
        {"return_hidden_states": True},
        {})]
    for s in made:
        s.wait_ready(120)
    yield made
    for s in made:
        s.close()


@pytest.fixture(scope="module")
def reference(tiny_target_dir):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_target_dir), dtype=torch.float32).eval()
    return model, EmbeddedExtractor(model, AUX, batch_tokens=1 << 20, storage_dtype=torch.float32)


def seqs(*lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 200, (n,), generator=g).tolist() for n in lengths]


def generate(url, prompts, **extra):
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_hidden_states": True, **extra}
    return http_json(url + "/generate", body)


def test_generate_returns_hidden_states_as_sglang(servers, reference):
    aux_server, final_server, _ = servers
    model, ref = reference
    batch = seqs(9, 4, 6)
    want = ref.forward(batch)
    finals = generate(final_server.url, batch)
    auxes = generate(aux_server.url, batch)
    assert isinstance(finals, list) and len(finals) == len(auxes) == 3
    for ids, (w_aux, w_last), f, a in zip(batch, want, finals, auxes):
        for result, expected in ((f, w_last), (a, w_aux)):
            meta = result["meta_info"]
            assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 1
            assert len(meta["hidden_states"]) == 1  # one prefill block: one row per prompt token
            assert torch.equal(torch.tensor(meta["hidden_states"][0]), expected)  # exact, as .tolist()
        greedy = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        assert f["output_ids"] == a["output_ids"] == [greedy]
    one = generate(final_server.url, batch[1])  # a single prompt: a single result, an unpadded forward
    (_, w_last), = ref.forward([batch[1]])
    assert isinstance(one, dict) and torch.equal(torch.tensor(one["meta_info"]["hidden_states"][0]), w_last)

    info = http_json(aux_server.url + "/server_info")
    assert info["enable_return_aux_hidden_states"] and info["return_aux_hidden_state_layer_ids"] == AUX
    info = http_json(final_server.url + "/server_info")
    assert info["enable_return_hidden_states"] and not info["enable_return_aux_hidden_states"]


@pytest.mark.parametrize("extra, message", [
    ({"sampling_params": {"max_new_tokens": 4}}, "send sampling_params.max_new_tokens=1"),
    ({"stream": True}, "with stream is not supported"),
    ({"input_ids": [[1, 2], [10**6]]}, "token ids must be in"),
])
def test_bad_hidden_state_requests_get_400(servers, extra, message):
    with pytest.raises(RuntimeError, match=f"HTTP 400: .*{message}"):
        generate(servers[1].url, extra.pop("input_ids", [[5, 6, 7]]), **extra)


def test_a_server_without_hidden_states_says_so(servers):
    with pytest.raises(RuntimeError, match=f"HTTP 400: {HIDDEN_STATES_DISABLED.split('.')[0]}"):
        generate(servers[2].url, [[5, 6, 7]])


@pytest.mark.parametrize("decode_workers", [1, 2])  # 2: batches in flight, decoded in worker processes
def test_server_extractor_equals_the_embedded_extractor(servers, reference, decode_workers):
    aux_server, final_server, _ = servers
    _, ref = reference
    rows = [{"id": f"s{i}", "input_ids": torch.tensor(s, dtype=torch.int32)} for i, s in enumerate(seqs(12, 3, 7, 7, 1))]
    ex = ServerExtractor(aux_server.url, final_server.url, AUX, 64, batch_tokens=24, storage_dtype=torch.float32,
                         decode_workers=decode_workers)
    ex.check_servers()
    order = [sample["id"] for sample, _ in ex.run(rows)]
    got = {sample["id"]: states for sample, states in ex.run(rows)}
    assert order == [s["id"] for b in ex.batches(rows) for s in b]  # the plan's order, whatever is in flight
    same_plan = EmbeddedExtractor(ref.model, AUX, batch_tokens=24, storage_dtype=torch.float32)
    want = {sample["id"]: states for sample, states in same_plan.run(rows)}  # the same padded batches
    assert got.keys() == want.keys()
    for sid, states in want.items():
        assert torch.equal(got[sid]["aux"], states["aux"]) and torch.equal(got[sid]["last"], states["last"])
    assert ex.stats["tokens"] == 60 and ex.tokens_per_s > 0  # two runs of 30 tokens
    ex.close()


def test_server_extractor_refuses_the_wrong_servers(servers):
    aux_server, final_server, plain = servers
    swapped = ServerExtractor(final_server.url, aux_server.url, AUX, 64, 64)
    with pytest.raises(ValueError, match=r"extract.aux_url=.*does not capture aux hidden states"):
        swapped.check_servers()
    with pytest.raises(ValueError, match=r"captures layers \[0, 1, 2\], this run needs \[0, 1, 3\]"):
        ServerExtractor(aux_server.url, final_server.url, [0, 1, 3], 64, 64).check_servers()
    with pytest.raises(ValueError, match=r"extract.final_url=.*captures aux hidden states, which replace"):
        ServerExtractor(aux_server.url, aux_server.url, AUX, 64, 64).check_servers()
    with pytest.raises(ValueError, match=r"extract.aux_url=.*does not return hidden states"):
        ServerExtractor(plain.url, final_server.url, AUX, 64, 64).check_servers()
    # a server that does not describe itself is caught by the width of its rows (also in a worker process)
    with pytest.raises(ValueError, match=r"sample 'x': rows of 64 values, expected 192"):
        swapped.forward_rows([{"id": "x", "input_ids": torch.tensor([5, 6, 7])}])
    in_workers = ServerExtractor(final_server.url, aux_server.url, AUX, 64, 64, decode_workers=2)
    with pytest.raises(ValueError, match=r"sample 'y': rows of 64 values, expected 192"):
        list(in_workers.run([{"id": "y", "input_ids": torch.tensor([5, 6, 7])}]))
    in_workers.close()


def test_prompt_rows_reads_chunked_prefill_and_names_problems():
    a, b = torch.randn(3, 4), torch.randn(2, 4)
    meta = {"hidden_states": [a.tolist(), b.tolist(), torch.randn(4).tolist()]}  # 2 prefill chunks, 1 decode row
    assert torch.equal(torch.from_numpy(prompt_rows(meta, 5, 4, "here")), torch.cat([a, b]))
    with pytest.raises(ValueError, match="here: 5 hidden-state rows for 7 prompt tokens.*--disable-radix-cache"):
        prompt_rows({"hidden_states": [a.tolist(), b.tolist()]}, 7, 4, "here")
    with pytest.raises(ValueError, match="here: rows of 4 values, expected 8"):
        prompt_rows(meta, 5, 8, "here")
    with pytest.raises(ValueError, match="here: the answer has no meta_info.hidden_states"):
        prompt_rows({"completion_tokens": 1}, 5, 4, "here")


def test_stage_through_servers_equals_the_embedded_stage(run_setup, servers, tmp_path):  # noqa: F811
    """The whole extract stage with backend=server writes the same tensors as backend=embedded."""
    cfg, run_dir, rows = run_setup
    cfg.target.aux_layer_ids = AUX
    stage.run(cfg, run_dir)
    ref = {s: HiddenStateStore(run_dir / "extract" / s) for s in ("train", "eval")}
    server_dir = tmp_path / "server_run"
    for split in ("train", "eval"):
        (server_dir / "data").mkdir(parents=True, exist_ok=True)
        (server_dir / "data" / f"{split}.jsonl").write_bytes((run_dir / "data" / f"{split}.jsonl").read_bytes())
    cfg.extract.backend, cfg.extract.aux_url, cfg.extract.final_url = "server", servers[0].url, servers[1].url
    summary = stage.run(cfg, server_dir)
    assert summary["backend"] == "server" and summary["splits"]["train"]["samples"] == 10
    for split, a in ref.items():
        b = HiddenStateStore(server_dir / "extract" / split)
        assert b.meta["backend"] == "server" and a.meta["backend"] == "embedded"
        assert {k: v for k, v in b.meta.items() if k != "backend"} == {k: v for k, v in a.meta.items() if k != "backend"}
        assert b.ids == a.ids
        for i in range(len(a)):
            for key, t in a[i].items():
                assert torch.equal(b[i][key], t), (split, i, key)
    again = stage.run(cfg, server_dir)  # resumable like any store: nothing left to do
    assert again["extracted_tokens"] == 0


def test_vision_language_targets_stay_on_the_embedded_backend(run_setup):  # noqa: F811
    cfg, run_dir, _ = run_setup
    cfg.target.kind = "qwen3_vl"
    cfg.extract.backend, cfg.extract.aux_url, cfg.extract.final_url = "server", "http://127.0.0.1:9", "http://127.0.0.1:9"
    with pytest.raises(ValueError, match="vision-language targets need the M-RoPE positions"):
        stage.run(cfg, run_dir)


def test_extraction_servers_are_processes_always_stopped(tiny_target_dir, tmp_path):
    """The launch path of backend=sglang, with `specforge serve` in SGLang's place: both servers
    start, answer with the states they were launched for, and are stopped when the block ends,
    also when it raises."""
    build = partial(embedded_extraction_command, dtype="float32")
    urls = None
    with pytest.raises(KeyError, match="boom"):
        with extraction_servers(build, tiny_target_dir, AUX, tmp_path / "logs", startup_timeout_s=300) as urls:
            ex = ServerExtractor(*urls, AUX, 64, 64, storage_dtype=torch.float32)
            ex.check_servers()
            out = ex.forward_rows([{"id": "a", "input_ids": torch.tensor([5, 6, 7, 8])}])
            assert out[0]["aux"].shape == (4, 192) and out[0]["last"].shape == (4, 64)
            raise KeyError("boom")
    assert urls is not None and all(http_status(u + "/health", timeout=2) is None for u in urls)
    for name in ("aux", "final"):
        log = (tmp_path / "logs" / f"{name}.log").read_text()
        assert log.startswith("$ ") and "--enable-return-hidden-states" in log.splitlines()[0]
    assert "--return-aux-hidden-state-layer-ids 0 1 2" in (tmp_path / "logs" / "aux.log").read_text()


def test_gpu_env_pins_one_gpu_per_local_rank(monkeypatch):
    assert gpu_env(0, 1) is None
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_env(1, 2) == {"CUDA_VISIBLE_DEVICES": "1"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    assert gpu_env(1, 2) == {"CUDA_VISIBLE_DEVICES": "5"}
    with pytest.raises(ValueError, match=r"only GPUs \['4', '5'\] are visible"):
        gpu_env(2, 3)
    # Slurm --gpus-per-task=1: each task sees its own GPU alone, whatever its local rank
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert gpu_env(1, 4) == gpu_env(3, 4) == {"CUDA_VISIBLE_DEVICES": "3"}


def test_two_ranks_share_the_servers_and_store_what_one_process_stores(tiny_target_dir, tmp_path_factory):
    """torchrun, 2 processes, backend=server: each rank sends its share of the chunks; the merged
    store holds exactly the embedded one-process extraction's tensors (dist_helpers' prepared run)."""
    from dist_helpers import launch, prepared

    prep = prepared(tmp_path_factory, tiny_target_dir)
    aux_ids = [0, 1, 3]  # the prepared run's (the embedded server can capture the last layer)
    load = partial(load_model, tiny_target_dir, dtype="float32", return_hidden_states=True)
    with EmbeddedServer(partial(load, aux_hidden_state_layer_ids=aux_ids)) as aux_server, \
            EmbeddedServer(load) as final_server:
        aux_server.wait_ready(120), final_server.wait_ready(120)
        out = launch(prep, "server2", 2, "extract.backend=server", f"extract.aux_url={aux_server.url}",
                     f"extract.final_url={final_server.url}", stages="[data,extract]")
    assert "extract: running on 2 processes" in out
    one, run = prep.outputs / "prepared", prep.outputs / "server2"
    for split in ("train", "eval"):
        a, b = HiddenStateStore(one / "extract" / split), HiddenStateStore(run / "extract" / split)
        assert b.meta == dict(a.meta, backend="server") and b.ids == a.ids
        for i in range(len(a)):
            for key, t in a[i].items():
                assert torch.equal(b[i][key], t), (split, i, key)


def test_sglang_backend_launches_both_servers_with_their_flags(run_setup):  # noqa: F811
    """extract=sglang for a given SGLang version: both launch commands run here as they would on a
    GPU machine; SGLang is not installed, so they exit, and the error shows the log (the command
    first). The aux server alone gets the aux capture flags and extract.sglang_aux_args."""
    from specforge.launch.process import ServerStartError

    cfg, run_dir, _ = run_setup
    cfg.target.aux_layer_ids = AUX
    cfg.extract.backend, cfg.extract.sglang_version = "sglang", "0.5.23"
    cfg.extract.sglang_args, cfg.extract.sglang_aux_args = ["--log-level", "debug"], ["--speculative-draft-model-path", "/d"]
    with pytest.raises(ServerStartError, match=r"(?s)exited with code 1 before it was healthy.*No module named 'sglang'"):
        stage.run(cfg, run_dir)
    logs = run_dir / "extract" / "logs" / "rank00000of00001"
    aux, final = ((logs / f"{name}.log").read_text().splitlines()[0] for name in ("aux", "final"))
    assert "-m sglang.launch_server --model-path" in aux and "-m sglang.launch_server --model-path" in final
    assert "--enable-return-aux-hidden-states --return-aux-hidden-state-layer-ids 0 1 2" in aux
    assert aux.endswith("--log-level debug --speculative-draft-model-path /d")
    assert final.endswith("--enable-return-hidden-states --chunked-prefill-size -1 --dtype float32 "
                          "--mem-fraction-static 0.4 --log-level debug")
