"""Checkpoints are served as-is by SGLang: the round trip is exact and every way a checkpoint can be
wrong is refused with a message naming what is wrong."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specforge.checkpoint import CheckpointError, load_draft, read_checkpoint, save_checkpoint
from tests.test_ttt import tiny_draft


@pytest.fixture
def ckpt(tmp_path):
    return save_checkpoint(tiny_draft(), tmp_path / "epoch_1")


def test_round_trip_is_bit_identical(ckpt, tmp_path):
    draft = load_draft(ckpt)
    again = save_checkpoint(draft, tmp_path / "again")
    assert (ckpt / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    assert (ckpt / "config.json").read_text() == (again / "config.json").read_text()
    a, b = load_file(ckpt / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_config_is_what_sglang_reads(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["tie_word_embeddings"] is False and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == 20 and cfg["vocab_size"] == 50
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True}
    # vLLM (0.33) reads the top-level key, numbering the input of each layer: the same layers
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    names = set(load_file(ckpt / "model.safetensors"))
    assert {"fc.weight", "midlayer.hidden_norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
    assert load_file(ckpt / "model.safetensors")["d2t"].dtype == torch.int64


def edit_config(ckpt, **changes):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(changes)
    (ckpt / "config.json").write_text(json.dumps(cfg))


def edit_weights(ckpt, fn):
    tensors = load_file(ckpt / "model.safetensors")
    fn(tensors)
    save_file(tensors, ckpt / "model.safetensors")


@pytest.mark.parametrize("changes, message", [
    ({"architectures": ["LlamaForCausalLM"]}, "architectures must be"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings must be false"),
    ({"num_hidden_layers": 2}, "num_hidden_layers must be 1"),
    ({"draft_vocab_size": None}, "draft_vocab_size must be a positive integer"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [3, 1, 2], "use_aux_hidden_state": True}},
     "3 ascending ids"),
    ({"model_type": "qwen2"}, "model_type must be 'llama'"),
    # transformers 5 writes RoPE as rope_parameters: without rope_theta we would have read 10000
    ({"rope_theta": None, "rope_parameters": {"rope_theta": 1e6}}, "rope_theta must be a positive number"),
    # both, disagreeing (a config edited across transformers versions): a server reads the second, we the first
    ({"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}},
     r"rope_theta 10000.0 and rope_parameters.rope_theta 1000000.0 disagree"),
    # the ids as SGLang numbers them, copied to the key vLLM reads: vLLM would take each layer one early
    ({"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}, r"must be eagle_config's ids \+ 1 = \[1, 2, 3\]"),
    # shapes a server and our engine cannot run, said naming the file instead of a shape error at the first step
    ({"num_key_value_heads": 3}, r"config.json: num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ({"head_dim": 7}, r"config.json: head_dim 7 is odd"),
])
def test_bad_config_is_refused(ckpt, changes, message):
    edit_config(ckpt, **changes)
    with pytest.raises(CheckpointError, match=message):
        read_checkpoint(ckpt)


def test_norm_before_residual_is_refused_where_vllm_would_serve_another_layer(ckpt):
    """vLLM's llama_eagle3 reads `norm_before_residual` from any config.json and then takes the layer's
    residual after hidden_norm, where SGLang and our engine take it before: the reader passed such a
    file untouched (kept as an unused key), so our evaluation measured another function than vLLM serves."""
    edit_config(ckpt, norm_before_residual=True)
    with pytest.raises(CheckpointError, match=r"epoch_1/config.json: norm_before_residual: true .* SGLang's "
                                              r"llama_eagle3 takes it before"):
        load_draft(ckpt)
    edit_config(ckpt, norm_before_residual=False)  # SGLang's layer, spelled out: reads
    assert load_draft(ckpt).config.extra["norm_before_residual"] is False


def test_a_checkpoint_without_vllm_ids_still_reads(ckpt, tmp_path):
    """Checkpoints written before the key are read as they are, and a re-save adds it."""
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["eagle_aux_hidden_state_layer_ids"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    again = save_checkpoint(load_draft(ckpt), tmp_path / "again")
    assert json.loads((again / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]


def test_invalid_json_names_the_file(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: invalid JSON"):
        read_checkpoint(ckpt)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("fc.weight"), r"missing weights \['fc.weight'\]"),
    (lambda t: t.update({"layers.0.mlp.up_proj.weight": torch.zeros(1)}), "unknown weights"),
    (lambda t: t.update({"lm_head.weight": torch.zeros(21, 32)}), r"lm_head.weight: \(21, 32\) != expected"),
    (lambda t: t.update({"d2t": t["d2t"].int()}), "d2t must be int64"),
    (lambda t: t.update({"d2t": t["d2t"].flip(0)}), "outside the target vocab|strictly increasing"),
    (lambda t: t["t2d"].__setitem__(1, True), "t2d does not mark exactly"),
])
def test_bad_weights_are_refused(ckpt, edit, message):
    edit_weights(ckpt, edit)
    with pytest.raises(CheckpointError, match=message):
        read_checkpoint(ckpt)


def test_missing_file_is_named(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors: missing"):
        read_checkpoint(ckpt)


def test_writer_refuses_an_invalid_draft(tmp_path):
    draft = tiny_draft()
    draft.d2t.zero_()  # every draft id maps to target id == draft id, but t2d marks even ids
    with pytest.raises(CheckpointError, match="t2d does not mark"):
        save_checkpoint(draft, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_writer_refuses_inf_and_nan_weights(tmp_path):
    """A diverged draft is not written: a server would load it and draft nothing."""
    draft = tiny_draft()
    with torch.no_grad():
        draft.fc.weight[0, 0] = float("nan")
        draft.lm_head.weight[1, 1] = float("inf")
    with pytest.raises(CheckpointError, match=r"bad: not written: fc.weight, lm_head.weight hold inf/nan \(training diverged\)"):
        save_checkpoint(draft, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_a_draft_loaded_in_bf16_keeps_its_rope_frequencies_in_float32(ckpt):
    """`.to(bfloat16)` rounded inv_freq by up to 0.3%, so the engine, the planner and `specforge serve` ran
    positions a thousand apart at a wrong angle (cos off by 0.87 at 1,024 for Llama-3's theta) where training
    and SGLang keep the frequencies in float32."""
    exact = load_draft(ckpt).inv_freq
    draft = load_draft(ckpt, dtype=torch.bfloat16)
    assert draft.fc.weight.dtype == torch.bfloat16 and draft.inv_freq.dtype == torch.float32
    assert torch.equal(draft.inv_freq, exact)
    positions = torch.arange(4096)[None]
    cos, _ = draft.rope(positions, torch.float32)
    assert torch.equal(cos, load_draft(ckpt).rope(positions, torch.float32)[0])
    assert draft.half().inv_freq.dtype == torch.float32
