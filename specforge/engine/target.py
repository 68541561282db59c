"""The target side of the engine: a transformers causal LM run with a KV cache we control.

`TreeKVLayer` is a transformers cache layer over preallocated buffers: `update` writes the new
keys at the end (no torch.cat of the whole cache per forward) and `keep` compacts the last
forward's entries to the accepted path. `TargetRunner` runs the prompt (causal), a tree of N
nodes (4D boolean mask: whole prefix + ancestors + self, positions S + depth) or a single decode
token, and returns logits plus the aux hidden states the draft reads (docs/contract.md §2: outputs of
decoder layers [a, b, c], i.e. `hidden_states[L + 1]`, concatenated in ascending order).

Vision-language targets (Qwen3-VL): the prompt may carry images; its M-RoPE positions come from
the target's own rope index, and every later token sits at its text position + `rope_delta`
in all three components, as the target's generate() does.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from specforge.engine.few_rows import choose_kernels, few_rows_linear, few_rows_linears, plain_linears
from specforge.targets.layers import check_aux_layer_ids
from specforge.targets.loader import (hidden_states_request, last_position, text_config, untied_last_hidden_state,
                                      with_cache)
from specforge.targets.vl import capture_input_embeds, is_vl_config, mm_token_type_ids, rope_positions, vl_info


_FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"


@contextmanager
def _forward_settings(config, force_gqa: bool):
    """Per-call settings, restored afterwards (the model may be shared):

    - `tie_last_hidden_states = False`: transformers 5 replaces hidden_states[N] by the post-norm
      state; aux layer N-1 must be the raw output of the last layer (as extract/embedded.py reads it).
    - forced GQA when a mask is passed: otherwise the sdpa path copies the KV heads of the whole
      cache (repeat_kv) in every layer; same maths, less memory traffic.
    """
    old_env = os.environ.get(_FORCE_GQA)
    if force_gqa:
        os.environ[_FORCE_GQA] = "1"
    try:
        with untied_last_hidden_state(config):
            yield
    finally:
        if old_env is None:
            os.environ.pop(_FORCE_GQA, None)
        else:
            os.environ[_FORCE_GQA] = old_env


class TreeKVLayer(CacheLayerMixin):
    """One layer's keys/values in buffers [B, kv_heads, capacity, head_dim]; `length` are valid."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, capacity: int = 256):
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states, value_states):
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, _ = key_states.shape
        self.keys = key_states.new_empty((b, h, self.capacity, key_states.shape[-1]))
        self.values = value_states.new_empty((b, h, self.capacity, value_states.shape[-1]))
        self.is_initialized = True

    def _grow(self, needed: int):
        cap = max(needed, 2 * self.capacity)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_empty((*old.shape[:2], cap, old.shape[-1]))
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)
        self.capacity = cap

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        end = self.length + n
        if end > self.capacity:
            self._grow(end)
        self.keys[:, :, self.length : end] = key_states
        self.values[:, :, self.length : end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def keep(self, start: int, index: torch.Tensor):
        """Keep entries `start + index` (in that order) at `start...`, drop everything after."""
        m = index.shape[0]
        src = index + start
        self.keys[:, :, start : start + m] = self.keys[:, :, src]
        self.values[:, :, start : start + m] = self.values[:, :, src]
        self.length = start + m

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        self.length = max(0, self.length - abs(tokens_to_remove))

    def reset(self) -> None:
        self.length = 0


class Fp32Head(torch.nn.Module):
    """The target's output projection in fp32. bf16 logits are coarse (a step of 0.125 near 24), so
    a tree forward and a one-token decode, which round differently, flip the argmax at near-ties;
    fp32 logits make greedy verification agree with plain decoding. Costs ~2% of a forward."""

    def __init__(self, head: torch.nn.Linear):
        super().__init__()
        self.register_buffer("weight", head.weight.detach().float(), persistent=False)
        self.bias = None if head.bias is None else head.bias.detach().float()
        self.kernels = {}  # {rows: kernel} of engine/few_rows.py, chosen by TargetRunner
        self.few_rows_packed = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return few_rows_linear(hidden.float(), self.weight, self.bias, self.kernels, self.few_rows_packed)


class TargetRunner:
    """Forward passes of the target over a cache it owns (batch size 1)."""

    def __init__(self, model, aux_layer_ids):
        cfg = text_config(model.config)
        layer_types = getattr(cfg, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(f"target: only full-attention layers are supported, got {set(layer_types)}")
        impl = getattr(model.config, "_attn_implementation", None)
        if impl not in ("sdpa", "eager"):
            # Flash/flex kernels would ignore or rebuild our boolean tree mask.
            model.set_attn_implementation("sdpa")
        if not isinstance(model.get_output_embeddings(), Fp32Head):
            model.set_output_embeddings(Fp32Head(model.get_output_embeddings()))
        self.linears = plain_linears(model)  # run as FewRowsLinear: decode and verify multiply 1-N rows
        head = model.get_output_embeddings()
        self.kernel_modules = self.linears + [head]
        self.kernels = choose_kernels(self.kernel_modules)  # timed once per weight geometry and process
        head.kernels = self.kernels
        self.model = model
        self.num_layers = cfg.num_hidden_layers
        check_aux_layer_ids(aux_layer_ids, self.num_layers, what="aux_layer_ids", ascending=False)
        self.aux_index = [i + 1 for i in aux_layer_ids]
        self.aux_request = hidden_states_request(self.aux_index)  # output_hidden_states when aux is needed
        self.cache: Cache | None = None
        self.vl = vl_info(model.config) if is_vl_config(model.config) else None
        self.rope_delta = 0  # M-RoPE: position of a text token after the prompt minus its index
        self.prompt_positions = None  # [3, P] M-RoPE positions of the last prompt
        self.prompt_embeds = None  # [P, H] its merged input embeddings (vision features at image tokens)

    @property
    def device(self):
        return self.model.device

    @property
    def length(self) -> int:
        """Tokens whose keys/values are in the cache (the committed prefix after `keep`)."""
        return self.cache.layers[0].length if self.cache is not None else 0

    def reset(self, capacity: int):
        self.cache = Cache(layers=[TreeKVLayer(capacity) for _ in range(self.num_layers)])

    def positions(self, pos: torch.Tensor) -> torch.Tensor:
        """Text positions [1, n] as the target reads them ([3, 1, n] M-RoPE for VL targets)."""
        if self.vl is None:
            return pos
        return (pos + self.rope_delta)[None].expand(3, -1, -1)

    def _run(self, input_ids, position_ids, mask, logits_to_keep=0, need_aux=True, **inputs):
        logits, aux = self.rows(input_ids, position_ids, mask, logits_to_keep, need_aux, **inputs)
        return logits[0], None if aux is None else aux[0]

    def rows(self, input_ids, position_ids, mask, logits_to_keep=0, need_aux=True, **inputs):
        """One forward of [B, n] tokens over the cache: (logits [B, n', V], aux [B, n, 3H] or None).
        B > 1 only for the planner's batched greedy decoding (text targets, a 4D `mask`)."""
        with _forward_settings(text_config(self.model.config), force_gqa=mask is not None), \
                few_rows_linears(self.linears, self.kernels):
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=mask,
                **with_cache(self.model, self.cache),
                use_cache=True,
                output_hidden_states=self.aux_request if need_aux else False,
                logits_to_keep=logits_to_keep,
                **inputs,
            )
        aux = None
        if need_aux:
            aux = torch.cat([out.hidden_states[i] for i in self.aux_index], dim=-1)
        return out.logits, aux

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, need_aux: bool = True, images: dict | None = None):
        """Causal forward over the prompt [P]; returns (logits of the last position [V], aux [P, 3H]).

        `images` ({"pixel_values", "image_grid_thw"}, vision-language targets): the prompt's
        images; `prompt_positions` and `prompt_embeds` then hold what the draft needs."""
        ids = input_ids.reshape(1, -1).to(self.device)
        if self.vl is None:
            if images:
                raise ValueError("prefill: images given, but the target is not a vision-language model")
            pos = torch.arange(self.length, self.length + ids.shape[1], device=self.device)[None]
            logits, aux = self._run(ids, pos, None, logits_to_keep=last_position(ids), need_aux=need_aux)
            return logits[-1], aux
        if self.length:
            raise ValueError("prefill: a vision-language prompt must start an empty cache")
        grid = images["image_grid_thw"].to(self.device) if images else None
        pos, delta = rope_positions(self.model, ids, grid)
        self.rope_delta = int(delta.reshape(-1)[0])
        inputs = {}
        if images:
            inputs = {"pixel_values": images["pixel_values"].to(self.device, self.model.dtype),
                      "image_grid_thw": grid, "mm_token_type_ids": mm_token_type_ids(ids, self.vl)}
        with capture_input_embeds(self.model) as captured:
            logits, aux = self._run(ids, pos, None, logits_to_keep=last_position(ids), need_aux=need_aux, **inputs)
        self.prompt_positions, self.prompt_embeds = pos[:, 0], captured.embeds[0]
        return logits[-1], aux

    @torch.inference_mode()
    def extend(self, input_ids: torch.Tensor, need_aux: bool = True):
        """Causal forward over text tokens [n] after the cache (a prompt's continuation, at the text
        positions of a vision-language target too); returns (logits [n, V], aux [n, 3H])."""
        ids = input_ids.reshape(1, -1).to(self.device)
        pos = self.positions(torch.arange(self.length, self.length + ids.shape[1], device=self.device)[None])
        return self._run(ids, pos, None, need_aux=need_aux)

    @torch.inference_mode()
    def decode(self, token: torch.Tensor, need_aux: bool = False):
        """One token after the cache; returns (logits [V], aux [1, 3H] or None)."""
        ids = token.reshape(1, 1).to(self.device)
        pos = self.positions(torch.full((1, 1), self.length, device=self.device))
        logits, aux = self._run(ids, pos, None, need_aux=need_aux)
        return logits[-1], aux

    @torch.inference_mode()
    def tree(self, tokens: torch.Tensor, depth: torch.Tensor, tree_mask: torch.Tensor):
        """Verify forward over the N tree nodes: positions S + depth, mask = prefix + ancestors + self.

        Returns (logits [N, V], aux [N, 3H]); the cache then holds the prefix plus all N nodes
        until `keep` compacts it.
        """
        s, n = self.length, tokens.shape[0]
        mask = torch.ones((1, 1, n, s + n), dtype=torch.bool, device=self.device)
        mask[0, 0, :, s:] = tree_mask
        return self._run(tokens.reshape(1, n), self.positions((depth + s).reshape(1, n)), mask)

    @torch.inference_mode()
    def keep(self, start: int, index: torch.Tensor):
        """Compact every layer to the prefix [0, start) + entries `start + index` (ascending)."""
        m = index.shape[0]
        in_place = bool(index[-1] == m - 1)  # ascending and ending at m-1: exactly 0..m-1
        for layer in self.cache.layers:
            if in_place:
                layer.length = start + m
            else:
                layer.keep(start, index)
