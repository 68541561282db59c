"""`vllm serve` command lines for an EAGLE3 draft (docs/contract.md §7b).

Why its own module: vLLM drafts a chain of `num_speculative_tokens`, not SGLang's tree, and takes
its speculative options as one JSON value. Spelled as in vLLM 0.33.0 (read from its source, not run
here: vLLM needs a GPU).
"""
from __future__ import annotations

import json

from specforge.engine.tree_spec import TreeSpec

VLLM_CHECKED = "0.33.0"


def vllm_serve_command(target_path, draft_path, chain: TreeSpec | str, *,
                       trust_remote_code: bool = False, chat_template: str | None = None,
                       image_pixels: dict | None = None) -> list[str]:
    """`vllm serve TARGET --speculative-config {...}` drafting the chain `T_1_(T+1)` (a TreeSpec or its
    name): T tokens per round, the tree our engine measures under that name; `chat_template`: the
    file the draft's data was rendered with (target.chat_template); `image_pixels`: the run's image
    bounds ({"min_pixels", "max_pixels"}, targets/vl.py image_pixel_bounds) as processor kwargs."""
    spec = TreeSpec.parse(chain) if isinstance(chain, str) else chain
    if spec.topk != 1:
        raise ValueError(f"tree {spec.name}: vLLM drafts a chain (topk 1, e.g. '{spec.steps}_1_{spec.steps + 1}'), "
                         f"not topk {spec.topk}")
    config = {"method": "eagle3", "model": str(draft_path), "num_speculative_tokens": spec.steps}
    return ["vllm", "serve", str(target_path), "--speculative-config", json.dumps(config),
            *(["--trust-remote-code"] if trust_remote_code else []),
            *(["--chat-template", str(chat_template)] if chat_template else []),
            *(["--mm-processor-kwargs", json.dumps(image_pixels)] if image_pixels else [])]
