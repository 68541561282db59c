"""The EAGLE3 draft head (docs/contract.md §3): one Llama decoder layer that reads the target's features.

Weight names are the checkpoint's names (`fc`, `midlayer.*`, `norm`, `lm_head`, `embed_tokens`,
`d2t`, `t2d`; EAGLE 3.1 adds `input_norm` or `fc_norm.{0,1,2}`), so saving and loading is a plain
state_dict with no renaming.

EAGLE 3.1 (docs/contract.md §3) is EAGLE3 with up to three options, all off by default (then nothing
differs from EAGLE3: config.json, weights and numbers):
- `norm_before_fc`: one RMSNorm over the concatenated 3*H_target target states before `fc`
  (`input_norm.weight`);
- `fc_norm`: one RMSNorm per captured target state before the concatenation and `fc`
  (`fc_norm.{0,1,2}.weight`); exclusive with `norm_before_fc`;
- `norm_output`: the next step's feature is the post-final-norm output `norm(out)`, not `out`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from specforge.config import EAGLE31_OPTIONS, check_eagle31_options
from specforge.models.attention import TTTMask, attend, causal_mask, take
from specforge.models.head_loss import DraftHead

ARCHITECTURE = "LlamaForCausalLMEagle3"
# Top-level config key that vLLM reads the aux layers from (docs/contract.md §2)
VLLM_IDS_KEY = "eagle_aux_hidden_state_layer_ids"


def vllm_layer_ids(ids: list[int]) -> list[int]:
    """Our aux ids (id L = the output of decoder layer L, as SGLang reads eagle_config) in vLLM's
    numbering (id L = the input of decoder layer L): the same layers, each id one higher."""
    return [int(i) + 1 for i in ids]


@dataclass
class Eagle3Config:
    vocab_size: int
    draft_vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    target_hidden_size: int
    aux_layer_ids: list[int]
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 4096
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None
    # EAGLE 3.1 options (module docstring); all False is EAGLE3
    fc_norm: bool = False
    norm_output: bool = False
    norm_before_fc: bool = False
    extra: dict = field(default_factory=dict)  # other keys of config.json, kept on round trip

    def __post_init__(self):
        check_eagle31_options(self.eagle31_options)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of num_key_value_heads "
                             f"{self.num_key_value_heads}: each key/value head serves an equal group of query heads")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} is odd: RoPE rotates pairs of dimensions")
        section = self.mrope_section
        if section is None:
            return
        if len(section) != 3 or sum(section) != self.head_dim // 2:
            raise ValueError(
                f"rope_scaling.mrope_section: {section} must be 3 sections (T, H, W) summing to "
                f"head_dim // 2 = {self.head_dim // 2} (head_dim {self.head_dim}); a draft head_dim "
                f"different from the target's cannot use the target's M-RoPE sections")
        rope_type = self.rope_scaling.get("rope_type", "default")
        if rope_type != "default":  # SGLang's llama_eagle3 forces "default" when mrope_section is set
            raise ValueError(f"rope_scaling.rope_type: {rope_type!r} with mrope_section is not supported "
                             "(SGLang serves an M-RoPE draft with default RoPE)")

    @property
    def eagle31_options(self) -> dict[str, bool]:
        """The EAGLE 3.1 options, e.g. {"fc_norm": True, "norm_output": True, "norm_before_fc": False}."""
        return {key: getattr(self, key) for key in EAGLE31_OPTIONS}

    @property
    def mrope_section(self) -> Optional[list[int]]:
        return (self.rope_scaling or {}).get("mrope_section")

    @property
    def uses_mrope(self) -> bool:
        """Vision-language targets: positions are 3-D (temporal, height, width) per token."""
        return self.mrope_section is not None

    @classmethod
    def from_target(cls, target_config, aux_layer_ids, draft_cfg=None, draft_vocab_size=None):
        """Draft geometry copied from the target's text config unless `draft_cfg` overrides it."""
        from specforge.targets.loader import text_config

        t = text_config(target_config)

        def pick(name, default):
            value = getattr(draft_cfg, name, None) if draft_cfg is not None else None
            return default if value is None else value

        # transformers 5 keeps theta and scaling together in `rope_parameters`; 4.x split them.
        rope = dict(getattr(t, "rope_parameters", None) or getattr(t, "rope_scaling", None) or {})
        rope_theta = rope.pop("rope_theta", getattr(t, "rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if "mrope_section" in rope:
            # Vision-language targets (M-RoPE): keep the sections so the draft, and the server
            # reading its config.json, use the target's 3-D positions. Qwen2.5-VL's "mrope" is
            # plain default RoPE per component.
            rope_scaling = {"rope_type": "default" if rope_type == "mrope" else rope_type,
                            **{k: v for k, v in rope.items() if k not in ("type", "rope_type")},
                            "mrope_section": [int(x) for x in rope["mrope_section"]]}
        else:
            rope_scaling = rope if rope_type != "default" else None
        heads = pick("num_attention_heads", t.num_attention_heads)
        hidden = pick("hidden_size", t.hidden_size)
        vocab_size = t.vocab_size
        dvs = draft_vocab_size or pick("draft_vocab_size", vocab_size)
        return cls(
            vocab_size=vocab_size,
            draft_vocab_size=min(dvs, vocab_size),
            hidden_size=hidden,
            intermediate_size=pick("intermediate_size", t.intermediate_size),
            num_attention_heads=heads,
            num_key_value_heads=pick("num_key_value_heads", t.num_key_value_heads),
            head_dim=pick("head_dim", getattr(t, "head_dim", None) or hidden // heads),
            target_hidden_size=t.hidden_size,
            aux_layer_ids=list(aux_layer_ids),
            hidden_act=getattr(t, "hidden_act", "silu"),
            rms_norm_eps=getattr(t, "rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=pick("max_position_embeddings", t.max_position_embeddings),
            bos_token_id=getattr(t, "bos_token_id", None),
            eos_token_id=getattr(t, "eos_token_id", None),
            pad_token_id=getattr(t, "pad_token_id", None),
            **{key: bool(pick(key, False)) for key in EAGLE31_OPTIONS},
        )

    def to_json_dict(self) -> dict:
        """config.json as SGLang and vLLM read it (docs/contract.md §1)."""
        d = asdict(self)
        ids = d.pop("aux_layer_ids")
        extra = d.pop("extra")
        if not any(d[key] for key in EAGLE31_OPTIONS):  # EAGLE3: config.json as it always was
            for key in EAGLE31_OPTIONS:
                del d[key]
        return {
            **extra,
            **d,
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "bfloat16",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
            # the same layers in vLLM's numbering, which SGLang does not read (docs/contract.md §2)
            VLLM_IDS_KEY: vllm_layer_ids(ids),
        }

    @classmethod
    def from_json_dict(cls, d: dict) -> "Eagle3Config":
        known = set(cls.__dataclass_fields__) - {"aux_layer_ids", "extra"}
        fixed = {"architectures", "model_type", "num_hidden_layers", "tie_word_embeddings",
                 "attention_bias", "mlp_bias", "torch_dtype", "eagle_config", VLLM_IDS_KEY}
        return cls(
            **{k: d[k] for k in known if k in d},
            aux_layer_ids=list(d["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
            extra={k: v for k, v in d.items() if k not in known and k not in fixed},
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def inverse_frequencies(cfg: Eagle3Config) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies (and attention scaling) of the draft, as the target computes them."""
    scaling = cfg.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        exponent = torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim
        return 1.0 / (cfg.rope_theta ** exponent), 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_scaling.rope_type: {rope_type!r} is not supported")
    hf = LlamaConfig(
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_theta": cfg.rope_theta, **scaling, "rope_type": rope_type},
    )
    return ROPE_INIT_FUNCTIONS[rope_type](hf)


def mrope_frequencies(freqs: torch.Tensor, section: list[int], interleaved: bool) -> torch.Tensor:
    """Per-component frequencies [3, ..., d/2] (T, H, W) -> [..., d/2], recomposed as the target
    does (transformers' Qwen3-VL / Qwen2.5-VL text rotary embeddings)."""
    if interleaved:  # Qwen3-VL: T everywhere, then H at 1::3 and W at 2::3 within their sections
        out = freqs[0].clone()
        for c in (1, 2):
            idx = slice(c, section[c] * 3, 3)
            out[..., idx] = freqs[c, ..., idx]
        return out
    # Qwen2.5-VL: contiguous chunks of sizes section[0], section[1], section[2] from T, H, W
    return torch.cat([chunk[c] for c, chunk in enumerate(freqs.split(section, dim=-1))], dim=-1)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class DraftAttention(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        # Input is [embedding ; feature], twice the hidden width (docs/contract.md §3).
        self.q_proj = nn.Linear(2 * h, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.n_kv * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.n_kv * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=False)

    def forward(self, x, cos, sin, past_kv, mask, impl, queries=None):
        """`queries` [B, m]: the positions that query (keys and values at all n); None: all."""
        b, n, _ = x.shape
        m = n if queries is None else queries.shape[1]
        q = self.q_proj(take(x, queries)).view(b, m, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.n_kv, self.head_dim).transpose(1, 2)
        q_cos, q_sin = take(cos, queries, 2), take(sin, queries, 2)
        q = (q * q_cos + rotate_half(q) * q_sin).to(v.dtype)
        k = (k * cos + rotate_half(k) * sin).to(v.dtype)
        keys, values = k, v
        if isinstance(past_kv, tuple) and isinstance(past_kv[0], list):  # TTT: the earlier steps' keys, per step
            keys, values = [*past_kv[0], k], [*past_kv[1], v]
        elif past_kv is not None:
            keys = torch.cat([past_kv[0].to(k.dtype), k], dim=2)
            values = torch.cat([past_kv[1].to(v.dtype), v], dim=2)
        out = attend(q, keys, values, mask, impl)
        return self.o_proj(out.transpose(1, 2).reshape(b, m, -1)), (k, v)


class DraftMLP(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"hidden_act: {cfg.hidden_act!r} is not supported (silu only)")
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """The single decoder layer; names match SGLang's `midlayer.*`."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.mlp = DraftMLP(cfg)

    def forward(self, emb, feat, cos, sin, past_kv, mask, impl, queries=None):
        residual = take(feat, queries)
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(feat)], dim=-1)
        attn_out, kv = self.self_attn(x, cos, sin, past_kv, mask, impl, queries)
        h = residual + attn_out
        return h + self.mlp(self.post_attention_layernorm(h)), kv


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: Eagle3Config, attention: str = "sdpa"):
        super().__init__()
        self.config = cfg
        self.attention = attention
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        # EAGLE 3.1: created only when enabled, so an EAGLE3 state dict has no such names
        self.input_norm = RMSNorm(3 * cfg.target_hidden_size, cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc_norm = (nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(3))
                        if cfg.fc_norm else None)
        self.midlayer = DraftLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = DraftHead(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        inv_freq, self.rope_scale = inverse_frequencies(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _apply(self, fn, recurse=True):
        """Casts and moves (`.to(bfloat16)`, DeepSpeed's bf16 module) keep inv_freq in float32, as training
        under autocast and SGLang's cos/sin cache have it: rounded to bf16 (0.3% off) it turns a query and a
        key a thousand positions apart by a wrong angle."""
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(self.inv_freq.device)
        return self

    def set_vocab_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @property
    def uses_mrope(self) -> bool:
        return self.config.uses_mrope

    def rope(self, position_ids: torch.Tensor, dtype):
        """cos, sin [B, 1, n, d] for position_ids [B, n] or, with M-RoPE, [B, 3, n] (T, H, W).

        [B, n] under M-RoPE means text tokens (all three components equal), for which every
        recomposition is exactly the plain 1-D RoPE, so it takes the plain path."""
        inv_freq = self.inv_freq.to(position_ids.device)
        if position_ids.dim() == 3:
            if not self.uses_mrope:
                raise ValueError(f"position_ids of shape {tuple(position_ids.shape)} are M-RoPE "
                                 "positions, but the draft config has no rope_scaling.mrope_section")
            if position_ids.shape[1] != 3:
                raise ValueError(f"M-RoPE position_ids must be [B, 3, n], got {tuple(position_ids.shape)}")
            freqs = position_ids.transpose(0, 1)[..., None].float() * inv_freq  # [3, B, n, d/2]
            scaling = self.config.rope_scaling
            freqs = mrope_frequencies(freqs, scaling["mrope_section"], bool(scaling.get("mrope_interleaved")))
        else:
            freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos() * self.rope_scale, emb.sin() * self.rope_scale
        return cos[:, None].to(dtype), sin[:, None].to(dtype)  # [B, 1, n, d]

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """Target features [.., 3*H_target] -> draft width [.., H]: fc, after EAGLE 3.1's input
        norms (norm_before_fc: over the whole concatenation; fc_norm: over each of the 3 states)."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        elif self.fc_norm is not None:
            chunks = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux)

    def step(self, input_ids, feat, position_ids, past_kv=None, attn_mask=None, input_embeds=None,
             head: bool = True, queries=None):
        """One draft forward over n new positions (see docs/design.md for shapes).

        `input_embeds` [B, n, H], when given, replaces `embed_tokens(input_ids)` (vision-language
        targets: the target's merged input embeddings at image positions).
        `queries` [B, m] (training's first TTT step): only these positions' outputs are computed;
        keys and values are at all n (the later steps attend to every one).
        Returns the next step's feature (the pre-norm output `out`, or `norm(out)` with EAGLE 3.1's
        norm_output), the draft-vocab logits `lm_head(norm(out))` (with head=False: `norm(out)`, for
        training, which scores it through `lm_head` itself), and the new (k, v).
        """
        if attn_mask is None:
            past = 0 if past_kv is None else past_kv[0].shape[2]
            attn_mask = causal_mask(input_ids.shape[1], past, input_ids.device)[None]
        emb = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        emb = emb.to(feat.dtype)
        cos, sin = self.rope(position_ids, feat.dtype)
        out, kv = self.midlayer(emb, feat, cos, sin, past_kv, attn_mask, self.attention, queries)
        normed = self.norm(out)
        return (normed if self.config.norm_output else out), (self.lm_head(normed) if head else normed), kv

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def trainable_parameters(self):
        """Everything but the embedding, which stays frozen to the target's (docs/contract.md §1)."""
        return [p for n, p in self.named_parameters() if not n.startswith("embed_tokens")]


__all__ = ["Eagle3Config", "Eagle3Draft", "TTTMask", "ARCHITECTURE", "EAGLE31_OPTIONS", "VLLM_IDS_KEY",
           "vllm_layer_ids"]
