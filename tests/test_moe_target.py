"""Sparse-MoE targets (Qwen3-Coder-30B-A3B): a tiny Qwen3-MoE through every stage, its embedding and
head read alone, and the draft the real model's config gives, as SGLang serves it."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig

from specforge.checkpoint import expected_shapes, load_draft, validate_config
from specforge.config import TargetConfig
from specforge.models.draft import Eagle3Config
from specforge.pipeline import run_pipeline
from specforge.targets.loader import aux_layer_ids, load_embedding_and_head, load_target
from specforge.utils.io import read_json
from tests.test_pipeline import CONF, compose_cfg, weather_files  # noqa: F401 (fixture)

# Qwen/Qwen3-Coder-30B-A3B-Instruct's config.json (the fields that shape a draft)
QWEN3_CODER_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "intermediate_size": 5472, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936, "max_position_embeddings": 262144,
    "rope_theta": 10000000, "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "eos_token_id": 151645,
    "hidden_act": "silu", "torch_dtype": "bfloat16",
}


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    from specforge.targets.tiny import build_tiny_qwen3_moe

    return build_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny_moe"))


def test_a_moe_target_goes_through_every_stage(weather_files, tiny_moe_dir):  # noqa: F811
    """data -> extract -> train -> eval on a Qwen3-MoE target: the draft takes its attention geometry
    (heads x head_dim = 128, not the hidden 64), and greedy speculative decoding stays lossless."""
    cfg = compose_cfg(weather_files, tiny_moe_dir, "stages=[data,extract,train,eval]", "eval.num_prompts=2",
                      "eval.max_new_tokens=8", "eval.trees=['2_2_4']")
    run_pipeline(cfg)
    run_dir = weather_files / "outputs" / "smollm2_weather"
    draft = load_draft(run_dir / "epoch_2")
    c = draft.config
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size) == (
        64, 4, 2, 32, 192)
    assert draft.midlayer.self_attn.q_proj.weight.shape == (128, 128)
    results = read_json(run_dir / "eval" / "results.json")
    assert [r["lossless"] for r in results["configs"]] == [1.0, 1.0]
    assert all(r["requests"] == 2 and r["completion_tokens"] == 16 for r in results["configs"])


def test_the_embedding_and_head_of_a_moe_target_are_read_alone(tiny_moe_dir, capsys):
    cfg = TargetConfig(name="moe", path=str(tiny_moe_dir), dtype="float32")
    embed, head, _ = load_embedding_and_head(cfg)
    model = load_target(cfg)
    assert torch.equal(embed, model.get_input_embeddings().weight)
    assert torch.equal(head, model.get_output_embeddings().weight)
    assert not torch.equal(embed, head)  # untied, as Qwen3-Coder's
    assert "loading the whole target" not in capsys.readouterr().out


def test_qwen3_coder_30b_a3b_gets_the_draft_sglang_serves_for_it(tmp_path):
    """From the real config (no weights): conf/target/qwen3_coder_30b_a3b.yaml composes, the aux
    layers are [1, 23, 44] (vLLM: [2, 24, 45]), and the draft is one dense layer of 32 x 128 query
    heads over hidden 2,048, with the 32K draft vocab SGLang's Qwen3-30B-A3B drafts use."""
    from hydra import compose, initialize_config_dir

    from specforge.config import register_configs

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_CODER_30B_A3B))
    register_configs()
    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = compose("config", overrides=["+exp=smollm2_weather", "target=qwen3_coder_30b_a3b",
                                           f"target.path={tmp_path}"])
    assert (cfg.target.name, cfg.target.kind, cfg.target.dtype) == ("qwen3_coder_30b_a3b", "causal_lm", "bfloat16")
    target_config = AutoConfig.from_pretrained(tmp_path)
    ids = aux_layer_ids(cfg.target, target_config)
    assert ids == [1, 23, 44]
    draft = Eagle3Config.from_target(target_config, ids, draft_vocab_size=32000)
    served = draft.to_json_dict()
    validate_config(served)  # what the checkpoint writer and reader accept
    assert {k: served[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                   "intermediate_size", "vocab_size", "draft_vocab_size", "rope_theta",
                                   "target_hidden_size")} == {
        "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "intermediate_size": 5472, "vocab_size": 151936, "draft_vocab_size": 32000, "rope_theta": 1e7,
        "target_hidden_size": 2048}
    assert served["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 23, 44]
    assert served["eagle_aux_hidden_state_layer_ids"] == [2, 24, 45]
    shapes = expected_shapes(draft)
    assert shapes["midlayer.self_attn.q_proj.weight"] == (4096, 4096)  # 32 x 128 heads from [embedding, fc(aux)]
    assert shapes["midlayer.self_attn.k_proj.weight"] == (512, 4096)
    assert shapes["fc.weight"] == (2048, 6144)
