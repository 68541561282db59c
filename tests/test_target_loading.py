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
