"""The embedded extractor and the extract stage on a tiny random Llama (real transformers model)."""
from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError
from safetensors import safe_open

from specforge.config import Config
from specforge.extract import stage
from specforge.extract.batching import plan_batches
from specforge.extract.embedded import EmbeddedExtractor
from specforge.extract.store import MANIFEST, HiddenStateStore
from specforge.pipeline import STAGES, stage_fingerprint
from specforge.launch.sglang_commands import SGLangVersionError
from specforge.targets.loader import target_fingerprint
from specforge.utils.io import write_jsonl

AUX = [0, 2, 3]  # includes the LAST decoder layer (N-1 = 3): the index convention's trap


@pytest.fixture(scope="module")
def tiny_dir(tiny_target_dir):
    """The session's tiny Llama (tests/conftest.py): 4 layers, hidden 64."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_target_dir)
    assert (cfg.num_hidden_layers, cfg.hidden_size) == (4, 64)
    return tiny_target_dir


@pytest.fixture(scope="module")
def tiny_model(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval().requires_grad_(False)


def random_seqs(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def test_plan_batches_respects_budget_and_covers_all():
    lengths = [5, 30, 7, 7, 12, 1, 64, 3, 30]
    batches = plan_batches(lengths, 32)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        padded = len(b) * max(lengths[i] for i in b)
        assert padded <= 32 or len(b) == 1  # the 64-token sample gets a batch of its own
    flat = [lengths[i] for b in batches for i in b]
    assert flat == sorted(flat, reverse=True)
    assert batches[0] == [6] and batches[1] == [1] and batches[2] == [8]
    assert plan_batches(lengths, 32) == batches
    with pytest.raises(ValueError, match="batch_tokens"):
        plan_batches(lengths, 0)


def capture(model, ids, mask=None):
    """Outputs of every decoder layer and of the final norm, from forward hooks."""
    base = model.model
    got = {}
    handles = [
        layer.register_forward_hook(lambda m, a, o, i=i: got.__setitem__(i, o[0] if isinstance(o, tuple) else o))
        for i, layer in enumerate(base.layers)
    ]
    handles.append(base.norm.register_forward_hook(lambda m, a, o: got.__setitem__("norm", o)))
    try:
        with torch.inference_mode():
            logits = model(input_ids=ids, attention_mask=mask).logits
    finally:
        for h in handles:
            h.remove()
    return got, logits


def test_aux_and_last_are_decoder_layer_outputs_and_final_norm(tiny_model):
    """Checked against hooks, not against transformers' hidden_states indexing."""
    vocab = tiny_model.config.vocab_size
    lengths = [9, 5, 1]
    seqs = random_seqs(lengths, vocab)
    ex = EmbeddedExtractor(tiny_model, AUX, batch_tokens=64, storage_dtype=torch.float32)

    # same padded batch through hooks: exact equality after stripping the padding
    hooks_in = []
    hooks = {}
    orig_forward = ex.base.forward

    def spy(*args, **kwargs):
        hooks_in.append(kwargs["input_ids"])
        return orig_forward(*args, **kwargs)

    ex.base.forward = spy
    try:
        handles = [ex.base.layers[i].register_forward_hook(
            lambda m, a, o, i=i: hooks.__setitem__(i, o[0] if isinstance(o, tuple) else o)) for i in range(4)]
        handles.append(ex.base.norm.register_forward_hook(lambda m, a, o: hooks.__setitem__("norm", o)))
        out = ex.forward(seqs)
    finally:
        del ex.base.forward
        for h in handles:
            h.remove()
    assert hooks_in[0].shape == (3, 9)  # one right-padded batch
    for r, n in enumerate(lengths):
        aux, last = out[r]
        assert aux.shape == (n, 3 * 64) and last.shape == (n, 64)
        want_aux = torch.cat([hooks[L][r, :n] for L in AUX], dim=-1)
        assert torch.equal(aux, want_aux)
        assert torch.equal(last, hooks["norm"][r, :n])
        # the last decoder layer's output is not the normed state (what hidden_states[N] holds)
        assert not torch.allclose(aux[:, 2 * 64 :], last)

    # and each sample alone, without padding: padding does not leak into real tokens;
    # the teacher logits are lm_head(last)
    for r, seq in enumerate(seqs):
        ref, logits = capture(tiny_model, torch.tensor([seq]))
        aux, last = out[r]
        torch.testing.assert_close(aux, torch.cat([ref[L][0] for L in AUX], -1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(last, ref["norm"][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tiny_model.lm_head(last), logits[0], rtol=1e-4, atol=1e-4)
    assert ex.stats["tokens"] == 15 and ex.stats["padded_tokens"] == 27


def test_bf16_target_bf16_storage(tiny_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16).eval()
    seqs = random_seqs([6, 4], model.config.vocab_size, seed=1)
    ex = EmbeddedExtractor(model, AUX, batch_tokens=64)
    out = ex.forward(seqs)
    ref, _ = capture(model, torch.tensor([seqs[0], seqs[1] + [0, 0]]), torch.tensor([[1] * 6, [1] * 4 + [0] * 2]))
    for r, n in enumerate([6, 4]):
        assert out[r][0].dtype == torch.bfloat16
        assert torch.equal(out[r][0], torch.cat([ref[L][r, :n] for L in AUX], -1))
        assert torch.equal(out[r][1], ref["norm"][r, :n])


def test_run_batches_never_cross_chunks(tiny_model):
    """With chunk = shard size, a resumed run does the very forwards of an uninterrupted one
    (padding changes float rounding, so batch composition must not depend on where it stopped)."""
    lengths = [3, 9, 4, 4, 8, 2, 7, 5, 6, 1, 9]
    samples = [{"id": str(i), "input_ids": s} for i, s in enumerate(random_seqs(lengths, 400))]
    batches = []

    class Spy(EmbeddedExtractor):
        def forward(self, seqs):
            batches.append([len(s) for s in seqs])
            return super().forward(seqs)

    def crosses_a_chunk(batches, k=4):
        pos, crossed = 0, False
        for b in batches:
            crossed |= pos // k != (pos + len(b) - 1) // k
            pos += len(b)
        return crossed

    ex = Spy(tiny_model, AUX, batch_tokens=40)
    order = [s["id"] for s, _ in ex.run(samples, chunk=4)]
    assert sorted(order, key=int) == [s["id"] for s in samples]
    assert [n for b in batches for n in b] == sorted(lengths, reverse=True)
    assert not crosses_a_chunk(batches)
    # without chunks the budget alone decides, and here a batch does cross a chunk boundary
    batches.clear()
    list(ex.run(samples))
    assert crosses_a_chunk(batches)


def test_extractor_rejects_out_of_vocab(tiny_model):
    ex = EmbeddedExtractor(tiny_model, AUX, batch_tokens=64)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 433\)"):
        ex.forward([[1, 2, 10_000]])


# ---------------------------------------------------------------------------- the stage


def make_rows(tok, n, prefix):
    rows = []
    for i in range(n):
        msgs = [
            {"role": "user", "content": f"What is the weather in city {i} today?" + " please" * (i % 5)},
            {"role": "assistant", "content": f"weather:\n  temp_c: {i * 3}\n  sky: sunny" + " windy" * i},
        ]
        prompt = tok.apply_chat_template(msgs[:1], add_generation_prompt=True, tokenize=False)
        full = tok.apply_chat_template(msgs, tokenize=False)
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        ids = tok(full, add_special_tokens=False)["input_ids"]
        rows.append({"id": f"{prefix}-{i}", "input_ids": ids, "loss_mask": [0] * len(p_ids) + [1] * (len(ids) - len(p_ids))})
    return rows


@pytest.fixture()
def run_setup(tiny_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    run_dir = tmp_path / "run"
    rows = {"train": make_rows(tok, 10, "tr"), "eval": make_rows(tok, 3, "ev")}
    for split, r in rows.items():
        write_jsonl(run_dir / "data" / f"{split}.jsonl", r)
    cfg = OmegaConf.structured(Config)
    cfg.run_name = "t"
    cfg.output_dir = str(tmp_path)
    cfg.target.name = "tiny"
    cfg.target.path = str(tiny_dir)
    cfg.target.dtype = "float32"
    cfg.target.aux_layer_ids = AUX
    cfg.extract.batch_tokens = 96
    cfg.extract.shard_samples = 4
    return cfg, run_dir, rows


def store_tensors(path):
    """{shard: {name: tensor}} plus the manifest, for exact comparisons of two stores."""
    manifest = json.loads((path / MANIFEST).read_text())
    out = {}
    for s in manifest["shards"]:
        with safe_open(str(path / s["name"]), framework="pt") as f:
            out[s["name"]] = {k: f.get_tensor(k) for k in f.keys()} | {"ids": f.metadata()["ids"]}
    return manifest, out


def assert_equal_stores(a, b):
    (ma, ta), (mb, tb) = store_tensors(a), store_tensors(b)
    assert ma == mb
    assert ta.keys() == tb.keys()
    for name in ta:
        for k in ta[name]:
            v = ta[name][k]
            assert (torch.equal(v, tb[name][k]) if isinstance(v, torch.Tensor) else v == tb[name][k]), (name, k)


def test_stage_end_to_end(run_setup, tiny_model):
    cfg, run_dir, rows = run_setup
    summary = stage.run(cfg, run_dir)
    assert set(summary["splits"]) == {"train", "eval"}
    tr = summary["splits"]["train"]
    n_tok = sum(len(r["input_ids"]) for r in rows["train"])
    assert tr["samples"] == 10 and tr["tokens"] == n_tok and tr["shards"] == 3 and tr["resumed_samples"] == 0
    assert tr["tokens_per_s"] > 0 and 0 < tr["padding_efficiency"] <= 1
    assert summary["tokens"] == n_tok + sum(len(r["input_ids"]) for r in rows["eval"])
    assert summary["bytes_per_token"] >= 4 * 64 * 2 + 5 and summary["aux_layer_ids"] == AUX

    store = HiddenStateStore(run_dir / "extract" / "train")
    meta = store.meta
    assert meta["aux_layer_ids"] == AUX and meta["hidden_size"] == 64 and meta["num_layers"] == 4
    assert meta["storage_dtype"] == "bfloat16" and meta["target_dtype"] == "float32"
    assert meta["target_fingerprint"] == target_fingerprint(cfg.target.path)
    by_id = {r["id"]: r for r in rows["train"]}
    assert sorted(store.ids) == sorted(by_id)
    for i, sid in enumerate(store.ids):
        got, row = store[i], by_id[sid]
        assert got["input_ids"].tolist() == row["input_ids"] and got["loss_mask"].tolist() == row["loss_mask"]
        assert store.lengths[i] == len(row["input_ids"])
        ref, _ = capture(tiny_model, torch.tensor([row["input_ids"]]))
        want_aux = torch.cat([ref[L][0] for L in AUX], -1).to(torch.bfloat16)
        torch.testing.assert_close(got["aux"], want_aux, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(got["last"], ref["norm"][0].to(torch.bfloat16), rtol=1e-2, atol=1e-2)
    assert len(HiddenStateStore(run_dir / "extract" / "eval")) == 3

    # the pipeline can fingerprint the stage (extra_inputs is JSON-able and names the target)
    assert stage.extra_inputs(cfg)["target"] == meta["target_fingerprint"]
    assert isinstance(stage_fingerprint(cfg, STAGES["extract"], run_dir), str)


def crash_extraction(monkeypatch, cfg, run_dir, at_forward: int = 6):
    """Run the extract stage until its `at_forward`-th target forward raises, as a crash would (the
    default: mid train shard 1, batches holding 1-2 samples and shards 4)."""
    real, calls = EmbeddedExtractor.forward, []

    def crash(self, seqs):
        calls.append(len(seqs))
        if len(calls) == at_forward:
            raise KeyboardInterrupt("simulated crash")
        return real(self, seqs)

    monkeypatch.setattr(EmbeddedExtractor, "forward", crash)
    with pytest.raises(KeyboardInterrupt):
        stage.run(cfg, run_dir)
    monkeypatch.setattr(EmbeddedExtractor, "forward", real)


def test_stage_crash_resume_equals_uninterrupted(run_setup, tmp_path, monkeypatch):
    cfg, run_dir, rows = run_setup
    ref_dir = tmp_path / "ref"
    for split in ("train", "eval"):
        write_jsonl(ref_dir / "data" / f"{split}.jsonl", rows[split])
    stage.run(cfg, ref_dir)

    crash_extraction(monkeypatch, cfg, run_dir)
    manifest = json.loads((run_dir / "extract" / "train" / MANIFEST).read_text())
    assert not manifest["complete"] and 1 <= len(manifest["shards"]) < 3

    summary = stage.run(cfg, run_dir)
    tr = summary["splits"]["train"]
    assert tr["resumed_samples"] == manifest["samples"] > 0
    assert tr["extracted_samples"] == 10 - manifest["samples"]
    for split in ("train", "eval"):
        assert_equal_stores(ref_dir / "extract" / split, run_dir / "extract" / split)

    # nothing left to do: a re-run keeps every shard as it is
    again = stage.run(cfg, run_dir)
    assert again["splits"]["train"]["extracted_samples"] == 0 and again["extracted_tokens"] == 0
    assert_equal_stores(ref_dir / "extract" / "train", run_dir / "extract" / "train")


def test_stage_changed_data_restarts_and_empty_eval_is_skipped(run_setup):
    cfg, run_dir, rows = run_setup
    stage.run(cfg, run_dir)
    assert (run_dir / "extract" / "eval" / MANIFEST).exists()
    write_jsonl(run_dir / "data" / "train.jsonl", rows["train"][:6])
    write_jsonl(run_dir / "data" / "eval.jsonl", [])
    summary = stage.run(cfg, run_dir)
    assert set(summary["splits"]) == {"train"}
    assert summary["splits"]["train"]["resumed_samples"] == 0  # different input: fresh store
    assert len(HiddenStateStore(run_dir / "extract" / "train")) == 6
    assert not (run_dir / "extract" / "eval").exists()  # no stale eval states


def test_stage_errors_name_the_problem(run_setup, tiny_dir):
    cfg, run_dir, rows = run_setup
    cfg.extract.backend = "sglang"  # SGLang needs CUDA: refused before anything starts
    with pytest.raises(SGLangVersionError, match="SGLang is not installed here"):
        stage.run(cfg, run_dir)
    cfg.extract.backend = "server"
    with pytest.raises(ValueError, match="needs extract.aux_url"):
        stage.run(cfg, run_dir)
    with pytest.raises(ValidationError, match="extract.backend"):  # a typed config refuses it (ExtractBackend)
        cfg.extract.backend = "vllm"
    untyped = OmegaConf.create(OmegaConf.to_container(cfg, enum_to_str=True))  # an untyped one reaches the stage
    untyped.extract.backend = "vllm"
    with pytest.raises(ValueError, match="unknown backend; known: embedded, server, sglang"):
        stage.run(untyped, run_dir)
    cfg.extract.backend = "embedded"

    bad = [dict(r) for r in rows["train"][:3]]
    bad[1]["input_ids"] = bad[1]["input_ids"][:-1] + [10_000]
    write_jsonl(run_dir / "data" / "train.jsonl", bad)
    with pytest.raises(ValueError, match=r"train\.jsonl:2: input_ids holds token 10000"):
        stage.run(cfg, run_dir)

    bad = [dict(r) for r in rows["train"][:3]]
    bad[2]["loss_mask"] = bad[2]["loss_mask"][:-1]
    bad[0]["id"] = "x"
    bad[1]["id"] = "x"
    path = run_dir / "data" / "train.jsonl"
    write_jsonl(path, bad)
    with pytest.raises(ValueError, match=r"train\.jsonl:2: duplicate id 'x' \(first at line 1\)"):
        stage.load_rows(path)
    bad[1]["id"] = "y"
    write_jsonl(path, bad)
    with pytest.raises(ValueError, match=r"train\.jsonl:3: field 'loss_mask'"):
        stage.load_rows(path)

    (run_dir / "data" / "train.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match="train.jsonl: not found; run the data stage"):
        stage.run(cfg, run_dir)


def overflowing_target():
    """A float32 tiny Llama whose token 5 carries a massive activation: its states (~5e5) are finite
    in float32 and bfloat16, past float16's 65504."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                             num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                             tie_word_embeddings=False)).eval().requires_grad_(False)
    with torch.no_grad():
        model.model.embed_tokens.weight[5] *= 1e7
    return model


OVERFLOW_ROWS = [{"id": "a", "input_ids": torch.tensor([1, 5, 7, 9], dtype=torch.int32),
                  "loss_mask": torch.tensor([0, 0, 1, 1], dtype=torch.uint8)}]
FLOAT16_OVERFLOW = (r"sample 'a': aux holds inf/nan in row 1 of 4: the target's values \(up to [0-9.e+]+\) overflow "
                    r"the storage dtype torch.float16: use extract.dtype=bfloat16")


def test_float16_states_past_its_range_name_extract_dtype_not_the_target(tmp_path):
    """The extractors hand float16 stores' states over in the target's dtype (store.handoff_dtype), so
    the writer sees the overflow and names the setting that fixes it; cast before, they arrived as
    inf and the message sent users to target.dtype."""
    from specforge.extract.store import handoff_dtype, store_layout

    ex = EmbeddedExtractor(overflowing_target(), [0, 1, 2], 64, storage_dtype=handoff_dtype("float16", torch.float32))
    meta = dict(hidden_size=32, aux_layer_ids=[0, 1, 2], target_dtype="float32", **store_layout("float16"))
    with pytest.raises(ValueError, match=FLOAT16_OVERFLOW):
        stage.extract_split(ex, OVERFLOW_ROWS, tmp_path / "train", meta, 256)


def test_a_rank_labels_its_progress_with_its_own_rank(run_setup, tiny_model, monkeypatch, capsys):
    from specforge.distributed.env import DistEnv

    cfg, run_dir, _ = run_setup
    monkeypatch.setattr(stage.dist, "current", lambda: DistEnv(rank=1, world_size=2))
    monkeypatch.setattr(stage.dist, "gather_objects", lambda part: [part])
    monkeypatch.setattr(stage.dist, "broadcast_object", lambda summary: summary)
    labels = []

    class Progress:
        def add_task(self, description, **kw):
            labels.append(description)

        def update(self, *a, **kw):
            pass

    rows = stage.load_rows(run_dir / "data" / "train.jsonl")
    for _ in range(2):  # the second resumes: its line names the rank too
        stage.extract_split_sharded(EmbeddedExtractor(tiny_model, AUX, 96), rows, run_dir / "extract" / "train",
                                    {"aux_layer_ids": AUX, "hidden_size": 64, **stage.store_layout("bfloat16")}, 4,
                                    Progress())
    assert labels == ["extract train (rank 1 of 2)"] * 2
    assert "[extract] train (rank 1 of 2): resuming, 4 samples already stored" in capsys.readouterr().out
