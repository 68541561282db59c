"""A regeneration prompt as the target renders it: its chat template (target.chat_template, else
the tokenizer's), the generation prompt, and the thinking switch as data.regenerate.thinking says.
The in-process backend decodes from these tokens; the server backend checks that each server
renders a prompt to as many tokens, since its answers are only the target's if it does."""
from __future__ import annotations

import warnings

import jinja2

from specforge.data.formats import tools_entry
from specforge.data.regen.replay import RegenFailure
from specforge.data.template import THINKING_SWITCH, as_template_reads, has_thinking_switch
from specforge.errors import SpecForgeWarning


class PromptRenderer:
    def __init__(self, tokenizer, thinking: bool, source: str) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"target tokenizer at {source} has no chat template; regeneration needs one")
        self.tokenizer, self.source = tokenizer, source
        self.kwargs = {}
        if has_thinking_switch(tokenizer):
            self.kwargs[THINKING_SWITCH] = bool(thinking)
        elif thinking:
            warnings.warn(f"data.regenerate.thinking=true but the chat template of {source} has no "
                          f"{THINKING_SWITCH} switch; rendering without it", category=SpecForgeWarning,
                          stacklevel=3)

    def ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(  # earlier answers' reasoning where the template reads it
                as_template_reads(self.tokenizer, messages), tokenize=False, add_generation_prompt=True,
                **tools_entry(tools), **self.kwargs)
        except (TypeError, ValueError, jinja2.TemplateError) as e:
            raise RegenFailure("regen_template_error", f"the chat template cannot render the prompt ({e})") from None
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def target_renderer(cfg, target_cfg, required: bool = True) -> PromptRenderer | None:
    """The renderer of `target_cfg`'s tokenizer (with target.chat_template where set); None for a
    tokenizer without a template unless `required`."""
    from specforge.targets.loader import load_tokenizer, resolve_target_path

    template = getattr(target_cfg, "chat_template", None)
    source = f"target.chat_template={template}" if template else str(resolve_target_path(target_cfg))
    tokenizer = load_tokenizer(target_cfg)
    if not required and not getattr(tokenizer, "chat_template", None):
        return None
    return PromptRenderer(tokenizer, bool(cfg.thinking), source)
