"""Hidden states from the target through plain transformers (the `embedded` extract backend).

Contract §2: aux layer id L is the OUTPUT of decoder layer L (0-based), the un-normed residual
stream; `last` is the FINAL POST-NORM hidden state (the teacher logits are lm_head(last)).

Why the decoder stack and selected hidden states: calling the base model (`get_decoder()`) skips
the 49152-wide lm_head, and asking `output_hidden_states` for the three indices L+1 only keeps
three [B, S, H] tensors instead of N+1 (transformers >= 5.23; `hidden_states_request` asks older
ones for all).

Why `tie_last_hidden_states = False`: transformers 5.x overwrites `hidden_states[N]` with the
post-norm `last_hidden_state`, so for L = N-1 the index L+1 would silently return the normed
state. tests/test_extract.py checks every index against forward hooks on the decoder layers and
the final norm.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch

from specforge.extract.batching import Extractor
from specforge.targets.layers import check_aux_layer_ids
from specforge.targets.loader import hidden_states_request, untied_last_hidden_state


def decoder_of(model):
    """The decoder stack (embeddings, layers, final norm) of a causal LM, without its lm_head."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(base, "norm"):
        raise TypeError(
            f"{type(model).__name__}: cannot find the decoder stack (expected .get_decoder() with "
            ".layers and .norm, as Llama-like causal LMs have)"
        )
    return base


class EmbeddedExtractor(Extractor):
    """Runs the target over token sequences and returns (aux [S, 3H], last [S, H]) per sample.
    With no aux layers (the embedded server's final-state mode) aux is [S, 0]."""

    def __init__(
        self,
        model,
        aux_layer_ids: Sequence[int],
        batch_tokens: int,
        storage_dtype: torch.dtype = torch.bfloat16,
        pad_token_id: int | None = None,
    ):
        super().__init__(batch_tokens, storage_dtype)
        self.model = model
        self.base = decoder_of(model)
        n = self.base.config.num_hidden_layers
        self.aux_layer_ids = check_aux_layer_ids(aux_layer_ids, n, what="aux_layer_ids")
        self.aux_request = hidden_states_request(layer + 1 for layer in self.aux_layer_ids)
        pad = pad_token_id if pad_token_id is not None else getattr(self.base.config, "pad_token_id", None)
        self.pad_token_id = 0 if pad is None else int(pad)
        self.vocab_size = getattr(self.base.config, "vocab_size", None)
        self.device = next(model.parameters()).device
        self.writes_behind = self.device.type != "cpu"

    def pad(self, sequences: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Right-padded ids [B, W], attention mask [B, W] and the lengths."""
        lens = [len(s) for s in sequences]
        if not sequences or min(lens) == 0:
            raise ValueError("forward: every sequence needs at least one token")
        ids = torch.full((len(sequences), max(lens)), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), max(lens)), dtype=torch.long)
        for r, s in enumerate(sequences):
            ids[r, : lens[r]] = torch.as_tensor(s, dtype=torch.long)
            mask[r, : lens[r]] = 1
        return ids, mask, lens

    @torch.inference_mode()
    def forward(self, sequences: Sequence[Sequence[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One right-padded forward over `sequences`; padding is stripped from the results."""
        t0 = time.perf_counter()
        ids, mask, lens = self.pad(sequences)
        width = ids.shape[1]
        if self.vocab_size is not None and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"input_ids: token ids must be in [0, {self.vocab_size}) for this target")
        # hidden_states[N] must stay the output of the last decoder layer (see module docstring)
        with untied_last_hidden_state(self.base.config):
            out = self.base(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                output_hidden_states=self.aux_request,
                use_cache=False,
            )
        last = out.last_hidden_state.to("cpu", self.storage_dtype)
        if self.aux_layer_ids:
            aux = torch.cat([out.hidden_states[layer + 1] for layer in self.aux_layer_ids], -1).to("cpu", self.storage_dtype)
        else:
            aux = last.new_zeros(*last.shape[:2], 0)
        # clone: a view would keep the whole padded batch alive in the writer's buffer
        result = [(aux[r, :n].clone(), last[r, :n].clone()) for r, n in enumerate(lens)]
        self.count(lens, width, t0)
        return result

    def forward_rows(self, rows: Sequence[dict]) -> list[dict]:
        """What the store keeps of each row: {"aux", "last"} (vision-language extractors add more)."""
        return [{"aux": aux, "last": last} for aux, last in self.forward([r["input_ids"] for r in rows])]
