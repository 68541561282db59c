"""What is loaded as the target is a whole target: transformers starts missing or wrongly shaped
weights at random and only warns, and a draft checkpoint named as the target would load so."""
from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file

from specforge.checkpoint import save_checkpoint
from specforge.config import TargetConfig
from specforge.serving.model import load_model
from specforge.targets.loader import load_target, resolve_target_path
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
