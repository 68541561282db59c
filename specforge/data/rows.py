"""The data stage's per-row steps, one implementation each, called by the in-process loop
(data.num_proc=0) and by the `datasets.map` workers (specforge/data/parallel.py) alike, so both
give the same samples and the same reasons."""
from __future__ import annotations

from dataclasses import dataclass, field

from specforge.data.fix import Quarantine, fix_row
from specforge.data.fix.conversations import ImageChecker
from specforge.data.formats import DataError, RawRow
from specforge.data.template import render
from specforge.data.vl_render import render_vl


def normalise_row(raw: RawRow, fix_cfg, fmt: str, images: ImageChecker,
                  max_chars: int | None) -> tuple[dict, list[str]]:
    """(conversation {"id", "messages"}, fixes) or Quarantine. With data.fix.enabled=false the row
    is only parsed and length-checked, but its images are still checked and resolved."""
    conv, fixes = fix_row(raw, fix_cfg, fmt, images, max_chars)
    if not fix_cfg.enabled:
        conv["messages"] = images.resolve_images(conv["messages"], raw.file)
    return conv, fixes


@dataclass
class RowRender:
    """A rendered conversation, or the quarantine `reason` why it cannot be a sample."""

    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    truncated: bool = False
    reason: str | None = None
    images: dict = field(default_factory=dict)  # {"images", "image_grid_thw"} of a VL sample with images


def render_row(tokenizer, messages: list[dict], max_length: int, overlength: str, vl=None) -> RowRender:
    """Tokenize one conversation with the chat template (`vl`: (image processor, VLInfo) of a
    vision-language target); over-length and template errors become a reason, not a crash."""
    images = {}
    try:
        if vl is None:
            r = render(tokenizer, messages, max_length, overlength)
        else:
            r, paths, grids = render_vl(tokenizer, messages, *vl, max_length, overlength)
            images = {"images": paths, "image_grid_thw": grids} if paths else {}
    except DataError as e:  # TemplateError: the template cannot be mapped for this row
        reason = str(e) if str(e).startswith(("image_", "template_error")) else f"template_error: {e}"
        return RowRender(reason=reason)
    if r.drop_reason is not None:
        return RowRender(reason=f"{r.drop_reason}: {r.full_length} tokens > max_length {max_length}")
    return RowRender(r.input_ids, r.loss_mask, r.truncated, None, images)


__all__ = ["Quarantine", "RowRender", "normalise_row", "render_row"]
