"""target.chat_template: a Jinja file used instead of the tokenizer's template, as SGLang's and
vLLM's --chat-template (a target without one, or a tool-calling template served with the model):
the data is rendered with it, editing it renders the data anew, a bad file is refused before the
first stage, and the run's serve commands pass it to the servers."""
from __future__ import annotations

import json
import shutil

import pytest
from omegaconf import OmegaConf

from specforge.data import stage
from specforge.errors import InvalidInput, MissingInput
from specforge.pipeline import STAGES, run_pipeline, stage_fingerprint
from specforge.run_layout import RunLayout
from specforge.run_report import write_run_report
from specforge.targets.loader import load_tokenizer
from specforge.utils.io import read_jsonl, write_json, write_jsonl
from tests.test_data_stage import make_cfg
from tests.test_hostile_data import weather_rows

# ChatML with a marker the tokenizer's own template does not write
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} [custom]\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant [custom]\n{% endif %}")


@pytest.fixture
def untemplated(tmp_path, tiny_target_dir):
    """The tiny target with no chat template of its own (a base model's tokenizer)."""
    target = tmp_path / "base_target"
    shutil.copytree(tiny_target_dir, target)
    (target / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


def test_the_data_is_rendered_with_the_template_file(tmp_path, untemplated):
    train = tmp_path / "train.jsonl"
    write_jsonl(train, weather_rows(6))
    cfg = make_cfg(tmp_path, untemplated, train, None)
    with pytest.raises(InvalidInput, match=r"has no chat template; the data stage needs one: give it with "
                                           r"target.chat_template=FILE"):
        stage.run(cfg, tmp_path / "out" / "t")
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    cfg.target.chat_template = str(template)
    stage.run(cfg, tmp_path / "out" / "t")
    tokenizer = load_tokenizer(cfg.target)
    samples = list(read_jsonl(tmp_path / "out" / "t" / "data" / "train.jsonl"))
    text = tokenizer.decode(samples[0]["input_ids"])
    assert len(samples) == 6 and "user [custom]" in text and "assistant [custom]" in text

    before = stage_fingerprint(cfg, STAGES["data"], tmp_path / "out" / "t")
    template.write_text(TEMPLATE.replace("[custom]", "[edited]"))  # the same path, other contents
    assert stage_fingerprint(cfg, STAGES["data"], tmp_path / "out" / "t") != before


def test_a_missing_or_broken_template_is_refused_before_the_first_stage(tmp_path, tiny_target_dir):
    train = tmp_path / "train.jsonl"
    write_jsonl(train, weather_rows(2))
    cfg = make_cfg(tmp_path, tiny_target_dir, train, None)
    cfg.target.chat_template = str(tmp_path / "none.jinja")
    with pytest.raises(MissingInput, match=rf"target.chat_template: {tmp_path / 'none.jinja'} not found"):
        run_pipeline(cfg)
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
    cfg.target.chat_template = str(broken)
    with pytest.raises(InvalidInput, match=rf"target.chat_template: {broken}, line 2: not a Jinja template"):
        run_pipeline(cfg)
    assert not (tmp_path / "out").exists()  # not even the data stage ran


def test_the_serve_commands_pass_the_template_on(tmp_path):
    """The draft learned the token sequences the template renders: SGLang and vLLM serve it so."""
    layout = RunLayout(tmp_path)
    layout.config.write_text(OmegaConf.to_yaml({"target": {"path": "/models/target", "chat_template": "/t/tools.jinja"}}))
    write_json(layout.eval_choice, {"epoch": 2, "tree": "3_1_4", "speedup": 1.8,
                                    "chain": {"tree": "3_1_4", "accept_length": 2.5, "speedup": 1.8}})
    serve = write_run_report(tmp_path).read_text().split("## Serve it")[1]
    assert "python -m sglang.launch_server --model-path /models/target --chat-template /t/tools.jinja " in serve
    assert "vllm serve /models/target --speculative-config" in serve and serve.count("--chat-template /t/tools.jinja") == 2


def test_bench_renders_with_the_template_file_and_refuses_a_missing_one(tmp_path, tiny_target_dir):
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from specforge.eval.bench_client import file_requests

    prompts = tmp_path / "workload.jsonl"
    write_jsonl(prompts, [{"prompt": "weather in Oslo?"}])
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_target_dir))
    plain = file_requests(str(prompts), tokenizer, 1, 8)[0]
    tokenizer.chat_template = TEMPLATE
    custom = file_requests(str(prompts), tokenizer, 1, 8)[0]
    assert "[custom]" in tokenizer.decode(custom.prompt) and "[custom]" not in tokenizer.decode(plain.prompt)
    proc = subprocess.run([sys.executable, "-m", "specforge.cli", "bench", "--url", "http://127.0.0.1:9",
                           "--tokenizer", str(tiny_target_dir), "--chat-template", str(tmp_path / "none.jinja"),
                           "--prompts", str(prompts)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"bench: --chat-template: {tmp_path / 'none.jinja'} not found (a Jinja chat template file)"
