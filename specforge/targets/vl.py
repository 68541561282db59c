"""Vision-language targets (Qwen3-VL, Qwen2.5-VL): what the data, extract and engine stages need.

The pieces, and why they are here rather than in transformers' processor:
- The data stage renders a chat with the target's template (one `<|image_pad|>` per image) and
  expands each placeholder to the image's token count itself (`expand_image_tokens`), so the loss
  mask stays aligned token by token. Qwen's processor does the same expansion on the text, but
  it cannot be loaded here without torchvision (its video processor) and knows nothing of masks.
- Positions are M-RoPE: [3, B, S] (temporal, height, width) from the model's own `get_rope_index`
  (`rope_positions`), so the draft can be trained with the positions the target uses.
- Extraction (`vl_hidden_states`) runs the target once per batch and returns the aux states
  (docs/contract.md §2: outputs of decoder layers L, `hidden_states[L + 1]`), the final post-norm state,
  the positions, and the merged input embeddings at image positions: newer SGLang feeds those to
  the draft for multimodal prompts (text embeddings with the vision features at image tokens).

Video inputs are not supported (no video processor without torchvision): `mm_token_type_ids`
refuses sequences with video tokens.
"""
from __future__ import annotations

import inspect
import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from specforge.targets.layers import check_aux_layer_ids
from specforge.targets.loader import deepstack_layers, hidden_states_request, untied_last_hidden_state
from specforge.utils.images import (RemoteImage, data_uri_bytes, decode_image, describe, is_data_uri, is_remote,
                                    load_image)

VL_KINDS = ("qwen3_vl", "qwen2_5_vl")


def is_vl(kind: str | None) -> bool:
    """Whether `target.kind` names a vision-language target."""
    return kind in VL_KINDS


def is_vl_config(model_config) -> bool:
    """Whether a transformers config (or config.json dict) is a supported VL target; for code
    that holds a loaded model but not the run's `target.kind`."""
    return _get(model_config, "model_type") in VL_KINDS


@dataclass(frozen=True)
class VLInfo:
    """The facts about a VL target that token handling and positions depend on."""

    model_type: str
    image_token_id: int
    video_token_id: int | None
    vision_start_token_id: int | None
    vision_end_token_id: int | None
    spatial_merge_size: int
    deepstack_layers: int  # first decoder layers whose output gets visual features (0: none)
    mrope_section: tuple[int, ...]
    mrope_interleaved: bool
    hidden_size: int
    num_hidden_layers: int


def _get(obj, key, default=None):
    if obj is None:
        return default
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)


def vl_info(model_config) -> VLInfo:
    """VLInfo from a transformers config, a config.json dict, or a model directory.

    Reading config.json directly lets the data stage count image tokens without loading weights.
    Both nestings are accepted: Qwen3-VL keeps text settings under `text_config`, older Qwen2.5-VL
    files keep them at the top level; the rope settings are `rope_parameters` (transformers 5) or
    `rope_scaling` (files written by older versions).
    """
    if isinstance(model_config, (str, Path)):
        path = Path(model_config)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(f"target.path: {path} not found")
        model_config = json.loads(path.read_text())
    model_type = _get(model_config, "model_type")
    if model_type not in VL_KINDS:
        raise ValueError(f"target: model_type {model_type!r} is not a supported VL target ({', '.join(VL_KINDS)})")
    text = _get(model_config, "text_config") or model_config
    vision = _get(model_config, "vision_config")
    rope = None
    for holder in (text, model_config):
        for key in ("rope_parameters", "rope_scaling"):
            value = _get(holder, key)
            if value and _get(value, "mrope_section") is not None:
                rope = value
                break
        if rope is not None:
            break
    if rope is None:
        raise ValueError(f"target: {model_type} config has no mrope_section in rope_parameters/rope_scaling")

    def text_value(key):
        value = _get(text, key)
        return _get(model_config, key) if value is None else value

    image_token_id = _get(model_config, "image_token_id")
    if image_token_id is None:
        raise ValueError(f"target: {model_type} config has no image_token_id")
    deepstack = deepstack_layers(model_config) if model_type == "qwen3_vl" else 0
    interleaved = _get(rope, "mrope_interleaved")
    return VLInfo(
        model_type=model_type,
        image_token_id=int(image_token_id),
        video_token_id=_get(model_config, "video_token_id"),
        vision_start_token_id=_get(model_config, "vision_start_token_id"),
        vision_end_token_id=_get(model_config, "vision_end_token_id"),
        spatial_merge_size=int(_get(vision, "spatial_merge_size", 2)),
        deepstack_layers=deepstack,
        mrope_section=tuple(int(x) for x in _get(rope, "mrope_section")),
        # transformers' Qwen3-VL always interleaves the sections; Qwen2.5-VL never does
        mrope_interleaved=bool(interleaved) if interleaved is not None else model_type == "qwen3_vl",
        hidden_size=int(text_value("hidden_size")),
        num_hidden_layers=int(text_value("num_hidden_layers")),
    )


# ---------------------------------------------------------------- images


def load_image_processor(target_path, min_pixels: int | None = None, max_pixels: int | None = None):
    """The target's image processor (PIL backend: torchvision is not usable here), with the pixel
    bounds applied. Images are resized (aspect kept, sides multiples of patch*merge) so their
    pixel count lies in [min_pixels, max_pixels]; fewer pixels, fewer image tokens.

    transformers 5.23 spells the bounds `size={"shortest_edge": min_pixels, "longest_edge":
    max_pixels}` (pixel counts, not edge lengths); `min_pixels`/`max_pixels` keywords are a
    deprecated alias.
    """
    from transformers import AutoImageProcessor

    for name, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
        if value is not None and value < 1:
            raise ValueError(f"data.image_{name}: must be >= 1, got {value}")
    if min_pixels is not None and max_pixels is not None and min_pixels > max_pixels:
        raise ValueError(f"data.image_min_pixels ({min_pixels}) > data.image_max_pixels ({max_pixels})")
    path = Path(target_path)
    if not (path / "preprocessor_config.json").is_file():
        raise FileNotFoundError(f"target.path: {path}/preprocessor_config.json not found (no image processor)")
    processor = AutoImageProcessor.from_pretrained(str(path), backend="pil")
    if min_pixels is not None or max_pixels is not None:
        size = {"shortest_edge": processor.size.shortest_edge, "longest_edge": processor.size.longest_edge}
        if min_pixels is not None:
            size["shortest_edge"] = int(min_pixels)
        if max_pixels is not None:
            size["longest_edge"] = int(max_pixels)
        if size["shortest_edge"] > size["longest_edge"]:
            raise ValueError(
                f"data.image_min_pixels/max_pixels: min {size['shortest_edge']} > max {size['longest_edge']} "
                "(one of them comes from the target's image processor)"
            )
        # Qwen2.5-VL configs also carry min_pixels / max_pixels, which transformers lets override `size`
        low, high = size["shortest_edge"], size["longest_edge"]
        processor = AutoImageProcessor.from_pretrained(str(path), backend="pil", size=size, min_pixels=low,
                                                       max_pixels=high)
        got = (processor.size.shortest_edge, processor.size.longest_edge)
        if got != (low, high):
            raise ValueError(f"data.image_min_pixels/max_pixels: the image processor of {path} kept {got[0]}..{got[1]} "
                             f"pixels where {low}..{high} were asked")
    return processor


def image_pixel_bounds(data_cfg) -> dict[str, int]:
    """{"min_pixels", "max_pixels"} the run resizes images to (data.image_min_pixels / max_pixels, the set
    ones), {} for the target's own. A server must be given them too, or it serves other image tokens than
    the draft trained on: SGLang's --mm-process-config '{"image": ...}', vLLM's --mm-processor-kwargs,
    `specforge serve --image-min-pixels / --image-max-pixels`."""
    bounds = {"min_pixels": getattr(data_cfg, "image_min_pixels", None),
              "max_pixels": getattr(data_cfg, "image_max_pixels", None)}
    return {k: int(v) for k, v in bounds.items() if v is not None}


def open_images(refs: Sequence[str | Path]) -> list:
    """Open images as RGB PIL images, decoded now so that a broken one fails here, by name: files, or
    base64 `data:` URIs (what an eval prompt file may embed). A URL raises RemoteImage: nothing here
    fetches from the network."""
    out = []
    for ref in map(str, refs):
        if is_data_uri(ref):
            try:
                out.append(decode_image(data_uri_bytes(ref)))
            except ValueError as e:
                raise ValueError(f"image {describe(ref)}: {e}") from None
            continue
        if is_remote(ref):
            raise RemoteImage(f"{ref}: a URL; images are read from files or data: URIs here, never fetched: "
                              "download them and name the files")
        p = Path(ref)
        if not p.is_file():
            raise FileNotFoundError(f"image {p}: file not found")
        try:
            out.append(load_image(p))
        except ValueError as e:
            raise ValueError(f"image {p}: {e}") from None
    return out


def image_inputs(images: Sequence, image_processor) -> dict:
    """pixel_values [patches, C*T*P*P] and image_grid_thw [n, 3] (long) for the model."""
    if not images:
        raise ValueError("image_inputs: no images")
    out = image_processor(images=list(images), return_tensors="pt")
    return {
        "pixel_values": out["pixel_values"],
        "image_grid_thw": torch.as_tensor(out["image_grid_thw"], dtype=torch.long).reshape(-1, 3),
    }


def image_token_counts(grid_thw, merge_size: int) -> list[int]:
    """Tokens per image in the language model: t*h*w patches merged merge x merge into one."""
    grid = torch.as_tensor(grid_thw, dtype=torch.long).reshape(-1, 3)
    return [int(n) // (merge_size * merge_size) for n in grid.prod(-1).tolist()]


# ---------------------------------------------------------------- tokens


def expand_image_tokens(input_ids, loss_mask, counts: Sequence[int], image_token_id: int):
    """Replace the i-th single image placeholder by counts[i] copies (loss 0 on all of them).

    The chat template emits one placeholder per image; the model needs one token per merged
    vision patch, as Qwen's processor produces. Lists in, lists out; tensors in, tensors out.
    """
    as_tensor = isinstance(input_ids, torch.Tensor)
    ids = input_ids.tolist() if as_tensor else list(input_ids)
    mask = loss_mask.tolist() if isinstance(loss_mask, torch.Tensor) else list(loss_mask)
    if len(ids) != len(mask):
        raise ValueError(f"expand_image_tokens: {len(ids)} input_ids but {len(mask)} loss_mask values")
    n_placeholders = sum(1 for t in ids if t == image_token_id)
    if n_placeholders != len(counts):
        raise ValueError(
            f"expand_image_tokens: {n_placeholders} image placeholder tokens (id {image_token_id}) in the "
            f"sequence but {len(counts)} images"
        )
    out_ids, out_mask, i = [], [], 0
    for t, m in zip(ids, mask):
        if t == image_token_id:
            out_ids.extend([t] * counts[i])
            out_mask.extend([0] * counts[i])
            i += 1
        else:
            out_ids.append(t)
            out_mask.append(m)
    if as_tensor:
        return (torch.tensor(out_ids, dtype=input_ids.dtype),
                torch.tensor(out_mask, dtype=loss_mask.dtype if isinstance(loss_mask, torch.Tensor) else torch.long))
    return out_ids, out_mask


def mm_token_type_ids(input_ids: torch.Tensor, info: VLInfo) -> torch.Tensor:
    """1 at image tokens, 0 elsewhere (what Qwen's processor returns; transformers 5 needs it for
    M-RoPE). Video is not supported: a video token raises."""
    input_ids = torch.as_tensor(input_ids)
    if info.video_token_id is not None and bool((input_ids == info.video_token_id).any()):
        raise ValueError("video inputs are not supported (found video tokens in input_ids)")
    return (input_ids == info.image_token_id).long()


def _vl_base(model):
    """The VL base model (vision tower + language model), below the lm_head."""
    base = getattr(model, "model", model)
    if not hasattr(base, "get_rope_index") or not hasattr(base, "language_model"):
        raise TypeError(f"{type(model).__name__}: not a Qwen-VL conditional-generation model")
    return base


def rope_positions(model, input_ids: torch.Tensor, image_grid_thw=None, attention_mask=None):
    """M-RoPE positions [3, B, S] and rope deltas [B] from the model's own `get_rope_index`.

    Text tokens advance all three components together; an image's tokens get (t, row, col)
    offsets from where it starts, and the text after it continues at max + 1. With
    `attention_mask`, padded positions are 0. `input_ids` may be [S] (taken as one row).
    """
    base = _vl_base(model)
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 1:
        ids = ids[None]
        if attention_mask is not None:
            attention_mask = torch.as_tensor(attention_mask).reshape(1, -1)
    grid = None
    if image_grid_thw is not None:
        grid = torch.as_tensor(image_grid_thw, dtype=torch.long).reshape(-1, 3).to(ids.device)
        if grid.shape[0] == 0:
            grid = None
    kwargs = {"image_grid_thw": grid, "attention_mask": attention_mask}
    params = inspect.signature(base.get_rope_index).parameters
    if "mm_token_type_ids" in params:  # transformers 5.x; older Qwen2.5-VL finds images by token id
        kwargs["mm_token_type_ids"] = mm_token_type_ids(ids, vl_info(model.config))
    positions, deltas = base.get_rope_index(ids, **kwargs)
    return positions, deltas.reshape(-1)


# ---------------------------------------------------------------- forward


class CapturedEmbeds:
    """What `capture_input_embeds` recorded: `calls`, the inputs_embeds [B, S, H] of each
    language-model call in order; `embeds`, those of the latest call (None before any)."""

    def __init__(self):
        self.calls: list[torch.Tensor] = []

    @property
    def embeds(self) -> torch.Tensor | None:
        return self.calls[-1] if self.calls else None


@contextmanager
def capture_input_embeds(model) -> Iterator[CapturedEmbeds]:
    """Record the `inputs_embeds` the language model receives: the text embeddings with the
    vision features scattered in at image tokens, which SGLang feeds to the draft for multimodal
    prompts. A forward pre-hook on the language model, removed on exit."""
    captured = CapturedEmbeds()

    def hook(module, args, kwargs):
        emb = kwargs.get("inputs_embeds")
        if emb is None:
            raise RuntimeError("capture_input_embeds: the language model was called without inputs_embeds")
        captured.calls.append(emb)

    handle = _vl_base(model).language_model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield captured
    finally:
        handle.remove()


@torch.inference_mode()
def vl_hidden_states(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    pixel_values: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    aux_layer_ids: Sequence[int],
) -> dict:
    """One forward of a VL target over a right-padded batch.

    Returns aux [B, S, 3H] (outputs of decoder layers L = hidden_states[L + 1], ascending),
    last [B, S, H] (final post-norm state; teacher logits = lm_head(last)), position_ids
    [3, B, S] (M-RoPE, as the model used them) and image_embeds [I, H] (merged input embeddings
    at the image tokens, in row-major sequence order; I = all image tokens of the batch).

    The base model is called (not the conditional-generation wrapper) to skip the lm_head.
    Selecting hidden states by index also makes transformers record the vision tower's block
    outputs at the same indices (it forwards the kwarg); they are small and dropped.
    """
    base = _vl_base(model)
    info = vl_info(model.config)
    text_cfg = getattr(model.config, "text_config", model.config)
    n = text_cfg.num_hidden_layers
    ids_l = check_aux_layer_ids(aux_layer_ids, n, what="aux_layer_ids")
    device = next(model.parameters()).device
    input_ids = torch.as_tensor(input_ids).to(device)
    attention_mask = torch.as_tensor(attention_mask).to(device)
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(f"vl_hidden_states: input_ids {tuple(input_ids.shape)} and attention_mask "
                         f"{tuple(attention_mask.shape)} must both be [B, S]")
    n_image_tokens = int((input_ids == info.image_token_id).sum())
    if image_grid_thw is not None:
        image_grid_thw = torch.as_tensor(image_grid_thw, dtype=torch.long).reshape(-1, 3).to(device)
    expected = sum(image_token_counts(image_grid_thw, info.spatial_merge_size)) if image_grid_thw is not None else 0
    if n_image_tokens != expected:
        raise ValueError(
            f"vl_hidden_states: {n_image_tokens} image tokens in input_ids but the images need {expected} "
            "(expand the placeholders with expand_image_tokens)"
        )
    if pixel_values is not None and image_grid_thw is not None and image_grid_thw.shape[0] > 0:
        pixel_values = pixel_values.to(device)
    else:
        pixel_values = image_grid_thw = None
    position_ids, _ = rope_positions(model, input_ids, image_grid_thw, attention_mask)
    with capture_input_embeds(model) as embeds, untied_last_hidden_state(text_cfg):
        out = base(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
            mm_token_type_ids=mm_token_type_ids(input_ids, info),
            output_hidden_states=hidden_states_request(i + 1 for i in ids_l),
            use_cache=False,
        )
    hs = out.hidden_states
    aux = torch.cat([hs[i + 1] for i in ids_l], dim=-1)
    image_embeds = embeds.embeds[input_ids == info.image_token_id]
    return {"aux": aux, "last": out.last_hidden_state, "position_ids": position_ids, "image_embeds": image_embeds}
