"""Held-out prompts for evaluation: each conversation up to its first assistant turn, rendered with
the target's chat template and its generation prompt, as a user request would arrive."""
from __future__ import annotations

from pathlib import Path

from specforge.data.vl_render import image_paths, prompt_with_images
from specforge.utils.io import read_jsonl


def heldout_prompts(conversations_file: str | Path, tokenizer, limit: int, vl=None) -> list[dict]:
    """[{"id", "input_ids", "messages"}] for up to `limit` conversations that have a user turn. With `vl`
    (image processor, VLInfo) of a vision-language target, prompts with images also carry
    "images": {"pixel_values", "image_grid_thw"} and their placeholders are expanded."""
    path = Path(conversations_file)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no held-out conversations; the data stage writes it when "
                                "data.eval_files is set")
    prompts = []
    for row in read_jsonl(path):
        head = []
        for message in row["messages"]:
            if message["role"] == "assistant":
                break
            head.append(message)
        if not any(m["role"] == "user" for m in head):
            continue
        ids = tokenizer.apply_chat_template(head, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # BatchEncoding from newer transformers
            ids = ids["input_ids"]
        prompt = {"id": row["id"], "input_ids": list(ids), "messages": head}
        paths = image_paths(head)
        if paths and vl is not None:
            prompt["input_ids"], prompt["images"] = prompt_with_images(prompt["input_ids"], paths, *vl)
        prompts.append(prompt)
        if len(prompts) >= limit:
            break
    if not prompts:
        raise ValueError(f"{path}: no conversation with a user turn to use as a prompt")
    return prompts
