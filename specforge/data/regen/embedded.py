"""Regeneration with the target loaded in-process through transformers.

Conversations are taken `batch_size` at a time; within a group, round k asks every conversation
its k-th assistant turn in one left-padded `generate` call (multi-turn replay needs the previous
answer first). Groups are cut by position in the full input, not among the pending ones, so a
resumed run batches exactly like an uninterrupted one and gives the same answers.
"""
from __future__ import annotations

import itertools
import warnings
from typing import Iterator

import jinja2
import torch

from specforge.data.regen.replay import Answer, RegenFailure, Replay
from specforge.utils.io import fingerprint


class EmbeddedBackend:
    name = "embedded"

    def __init__(self, cfg, target_cfg, seed: int = 0, device: str | None = None) -> None:
        from specforge.targets.loader import load_target, load_tokenizer, resolve_target_path, text_config

        if target_cfg is None:
            raise ValueError("data.regenerate.backend=embedded needs a target (target.path)")
        if getattr(target_cfg, "kind", "causal_lm") != "causal_lm":
            raise ValueError(f"data.regenerate.backend=embedded: text targets only (target.kind={target_cfg.kind}); "
                             "regenerate vision-language answers through a server that takes images: "
                             "data.regenerate.backend=openai data.regenerate.urls=[http://127.0.0.1:30000] (SGLang)")
        self.cfg, self.seed = cfg, seed
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = load_tokenizer(target_cfg)
        path = resolve_target_path(target_cfg)
        template = self.tokenizer.chat_template
        if not template:
            raise ValueError(f"target tokenizer at {path} has no chat template; regeneration needs one")
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.template_kwargs = {}
        if "enable_thinking" in str(template):
            self.template_kwargs["enable_thinking"] = bool(cfg.thinking)
        elif cfg.thinking:
            warnings.warn(f"data.regenerate.thinking=true but the chat template of {path} has no "
                          "enable_thinking switch; rendering without it", stacklevel=2)
        self.model = load_target(target_cfg, self.device)
        self.max_positions = getattr(text_config(self.model.config), "max_position_embeddings", None)
        eos = self.model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos]
        self.stop_ids = {int(i) for i in [*eos, self.tokenizer.eos_token_id] if i is not None}

    def run(self, replays: list[Replay]) -> Iterator[Replay]:
        """Yield each conversation once all its turns are answered (or it failed)."""
        bs = max(1, int(self.cfg.batch_size))
        for _, group in itertools.groupby(replays, key=lambda r: r.index // bs):
            group = list(group)
            self._run_group(group)
            yield from group

    def _run_group(self, group: list[Replay]) -> None:
        for round_ in itertools.count():
            live, prompts = [], []
            for r in group:
                messages = r.prompt()
                if messages is None:
                    continue
                try:
                    prompts.append(self._prompt_ids(messages))
                    live.append(r)
                except RegenFailure as e:
                    r.fail(e)
            if not live:
                return
            for r, answer in zip(live, self._generate(prompts, [r.key for r in live], round_)):
                r.answer(answer)

    def _prompt_ids(self, messages: list[dict]) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **self.template_kwargs)
        except (TypeError, ValueError, jinja2.TemplateError) as e:
            raise RegenFailure("regen_template_error", f"the chat template cannot render the prompt ({e})") from None
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if self.max_positions and len(ids) + self.cfg.max_new_tokens > self.max_positions:
            raise RegenFailure("regen_prompt_too_long", f"{len(ids)} prompt tokens + max_new_tokens "
                               f"{self.cfg.max_new_tokens} > the model's {self.max_positions} positions")
        return ids

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]], keys: list[str], round_: int) -> list[Answer]:
        enc = self.tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt").to(self.device)
        if self.cfg.temperature > 0:  # the target's own top_p/top_k (generation_config) still apply
            sampling = {"do_sample": True, "temperature": float(self.cfg.temperature)}
        else:
            sampling = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        # One seed per (group, round): the same samples whatever ran before in this process, and
        # the caller's RNG state left as it was.
        dev = self.model.device
        cuda = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(int(fingerprint(self.seed, keys, round_), 16) % (2**63))
            out = self.model.generate(
                **enc, **sampling,
                max_new_tokens=self.cfg.max_new_tokens,
                pad_token_id=self.tokenizer.pad_token_id,
                eos_token_id=sorted(self.stop_ids),
            )
        answers = []
        for row in out[:, enc["input_ids"].shape[1]:].tolist():
            end = next((i for i, t in enumerate(row) if t in self.stop_ids), None)
            content = row if end is None else row[:end]
            answers.append(Answer(
                text=self.tokenizer.decode(content, skip_special_tokens=True),
                tokens=len(row) if end is None else end + 1,
                truncated=end is None,
            ))
        return answers
