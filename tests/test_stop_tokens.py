"""The ids that end an answer: the target's generation config may list more than its tokenizer's eos
(Llama-3-Instruct's <|eot_id|>, Phi-3's <|end|>). SGLang stops on all of them, and so do the data stage's
regeneration, `specforge serve`, the evaluation and the planner (targets/loader.py: stop_token_ids)."""
from __future__ import annotations

import json
import shutil

import torch
from omegaconf import OmegaConf

from specforge.engine.speculative import SpeculativeEngine
from specforge.eval.engine_eval import eval_with_engine, load_engine_inputs, load_run_config
from specforge.eval.tiny_run import build_tiny_run
from specforge.targets.loader import stop_token_ids


def test_the_generation_configs_ids_come_first_then_the_tokenizers_once_each(tiny_target_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_target_dir))
    eos = tiny_tokenizer.eos_token_id
    model.generation_config.eos_token_id = [7, eos]
    assert stop_token_ids(model, tiny_tokenizer) == [7, eos]
    model.generation_config.eos_token_id = 9
    assert stop_token_ids(model, tiny_tokenizer) == [9, eos]
    model.generation_config.eos_token_id = None
    assert stop_token_ids(model, tiny_tokenizer) == [eos]


def test_the_evaluation_stops_where_the_generation_config_says(tmp_path, tiny_target_dir):
    """The embedded evaluation and the planner stopped on the tokenizer's eos alone, decoding past the end
    of every answer up to eval.max_new_tokens: accept lengths and speed-ups of text SGLang never serves."""
    target = tmp_path / "target"
    shutil.copytree(tiny_target_dir, target)
    run = build_tiny_run(tmp_path / "outputs" / "tiny", target)
    run_cfg = load_run_config(run)
    ev = OmegaConf.merge(run_cfg.eval, {"num_prompts": 1, "max_new_tokens": 12, "trees": ["2_1_3"],
                                        "dtype": "float32"})
    _, _, tokenizer, suites, model = load_engine_inputs(run_cfg, ev)
    (prompt,) = suites["heldout"]
    tokens = SpeculativeEngine(model, None).generate_base(prompt["input_ids"], 12,
                                                          eos_token_id=tokenizer.eos_token_id)[0].tolist()
    assert len(tokens) == 12 and tokenizer.eos_token_id not in tokens  # the random target never ends
    stop = tokens[3]
    config = json.loads((target / "generation_config.json").read_text())
    config["eos_token_id"] = [tokenizer.eos_token_id, stop]
    (target / "generation_config.json").write_text(json.dumps(config))

    results = eval_with_engine(run_cfg, [run / "epoch_1"], ev)
    assert results["base"]["completion_tokens"] == tokens.index(stop) + 1
    assert results["configs"][0]["completion_tokens"] == tokens.index(stop) + 1
    assert results["configs"][0]["lossless"] == 1.0
