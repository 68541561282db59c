"""Conversation with images -> input_ids + loss_mask as a vision-language target sees them.

The chat template renders one placeholder per image (`<|image_pad|>` for Qwen-VL); the target's
processor replaces it by as many tokens as the image yields after resizing (grid t*h*w / merge²).
We render and mask the text exactly as for text targets (template.render) and then expand each
placeholder, so image tokens never carry loss. The image grids are stored with the row: the
extract stage and the engine recompute them from the files and refuse a mismatch.
"""
from __future__ import annotations

from specforge.data.formats import DataError
from specforge.data.template import OVERLENGTH, Rendered, render
from specforge.targets.vl import expand_image_tokens, image_inputs, image_token_counts, open_images
from specforge.utils.images import RemoteImage, describe


def image_paths(messages: list[dict]) -> list[str]:
    """Image references in the order the chat template renders them."""
    return [p["image"] for m in messages if isinstance(m["content"], list)
            for p in m["content"] if p.get("type") == "image"]


def prompt_with_images(input_ids: list[int], paths: list[str], image_processor, info) -> tuple[list[int], dict]:
    """A prompt rendered with one placeholder per image -> (expanded ids, {"pixel_values",
    "image_grid_thw"}): what the engine's prefill takes."""
    return prompt_with_pictures(input_ids, open_images(paths), image_processor, info)


def prompt_with_pictures(input_ids: list[int], pictures: list, image_processor, info) -> tuple[list[int], dict]:
    """prompt_with_images from images already opened (PIL), e.g. decoded from a request."""
    images = image_inputs(pictures, image_processor)
    counts = image_token_counts(images["image_grid_thw"].tolist(), info.spatial_merge_size)
    ids, _ = expand_image_tokens(list(input_ids), [0] * len(input_ids), counts, info.image_token_id)
    return ids, images


def refused(paths: list[str], pictures: list, image_processor) -> str:
    """Which of the images the processor refuses (it says only why), for the quarantine reason."""
    for path, picture in zip(paths, pictures):
        try:
            image_inputs([picture], image_processor)
        except ValueError:
            return describe(path)
    return ", ".join(map(describe, paths))  # refused together only


def render_vl(tokenizer, messages: list[dict], image_processor, info, max_length: int | None = None,
              overlength: str = "truncate",
              tools: list[dict] | None = None) -> tuple[Rendered, list[str], list[list[int]]]:
    """(rendered sample, image paths, image grids [t, h, w]) of one conversation.

    Truncation never cuts through an image: the sample ends before the first image that does not
    fit whole, and the images after the cut are dropped with it."""
    if overlength not in OVERLENGTH:
        raise ValueError(f"data.overlength: {overlength!r} is not one of {list(OVERLENGTH)}")
    text = render(tokenizer, messages, tools=tools)
    paths = image_paths(messages)
    try:
        pictures = open_images(paths)
    except RemoteImage as e:
        raise DataError(f"image_remote: {e}") from None
    except (OSError, ValueError) as e:
        raise DataError(f"image_unreadable: {e}") from None
    try:
        images = image_inputs(pictures, image_processor) if paths else None
    except ValueError as e:  # Qwen-VL's resize: an aspect ratio past 200, ... (a server refuses it alike)
        raise DataError(f"image_refused: {refused(paths, pictures, image_processor)}: the target's image "
                        f"processor refuses it ({e})") from None
    grids = images["image_grid_thw"].tolist() if images else []
    counts = image_token_counts(grids, info.spatial_merge_size)
    try:
        ids, mask = expand_image_tokens(text.input_ids, text.loss_mask, counts, info.image_token_id)
    except ValueError as e:
        raise DataError(f"template_error: {e}") from None
    n = len(ids)
    result = Rendered(ids, mask, full_length=n, turns=text.turns)
    if max_length is None or n <= max_length:
        return result, paths, grids
    if overlength == "drop":
        return Rendered([], [], full_length=n, drop_reason="overlength", turns=text.turns), [], []
    placeholders = [j for j, t in enumerate(text.input_ids) if t == info.image_token_id]
    starts = [j + sum(counts[:i]) - i for i, j in enumerate(placeholders)]  # in the expanded ids
    cut, kept = max_length, 0
    for i, at in enumerate(starts):
        if at + counts[i] > max_length:  # this image does not fit whole: end before it
            cut = min(cut, at)
            break
        kept = i + 1
    result = Rendered(ids[:cut], mask[:cut], full_length=n, truncated=True, turns=text.turns)
    if any(mask) and not any(result.loss_mask):
        return Rendered([], [], full_length=n, truncated=True, drop_reason="no_loss_tokens_after_truncation",
                        turns=text.turns), [], []
    return result, paths[:kept], grids[:kept]
