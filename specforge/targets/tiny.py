"""A tiny random target built locally: a byte-level BPE tokenizer trained on the spot with a
ChatML template, and a small Llama (or Qwen3-MoE, or Qwen3-VL) from a config. Tests and quick runs
use it where SmolLM2 would be too slow; it behaves like a real Hugging Face model directory."""
from __future__ import annotations

from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen-VL chat format: a string content renders as above; a list content renders part by part,
# an image part as one placeholder `<|image_pad|>` between the vision markers (the data stage
# expands it to the image's token count, as Qwen's processor does).
VL_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
VL_SPECIAL_TOKENS = SPECIAL_TOKENS + [
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
]


def _corpus() -> list[str]:
    cities = ["Paris", "Oslo", "Lima", "Tokyo", "Cairo", "Quito", "Perth", "Bern"]
    words = "the weather is sunny rainy cloudy windy today tomorrow in city date temp wind rain".split()
    lines = []
    for i, c in enumerate(cities):
        lines.append(f"What is the weather in {c} on 2026-0{i % 9 + 1}-1{i}?")
        lines.append(f"weather:\n  city: {c}\n  temp_c: {i * 3 - 4}\n  wind_kmh: {i * 7}\n  sky: sunny")
        lines.append(" ".join(words[i:] + words[:i]))
    lines.append("You are a helpful assistant. Answer in TOON. {}[]:,-0123456789")
    return lines * 4


def build_tiny_tokenizer(
    out_dir: str | Path,
    vocab_size: int = 512,
    special_tokens: list[str] | None = None,
    chat_template: str = CHATML_TEMPLATE,
):
    """Train a byte-level BPE tokenizer with the ChatML specials; returns a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens or SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        bos_token=None,
        unk_token=None,
    )
    fast.chat_template = chat_template
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_llama(
    out_dir: str | Path,
    num_hidden_layers: int = 4,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    seed: int = 0,
) -> Path:
    """Write a random Llama target + tokenizer to `out_dir` (a normal HF model directory)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    tok = build_tiny_tokenizer(out_dir)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=hidden_size // num_attention_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        **_chatml_ids(tok),
    )
    return _save_random(LlamaForCausalLM, config, out_dir, seed)


def _chatml_ids(tok) -> dict:
    """The config's token ids from the tiny tokenizer: eos = pad = <|im_end|>, no bos."""
    return {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, "bos_token_id": None}


def _save_random(model_cls, config, out_dir: Path, seed: int) -> Path:
    import torch

    torch.manual_seed(seed)
    model_cls(config).save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def build_tiny_qwen3_moe(
    out_dir: str | Path,
    num_hidden_layers: int = 4,
    hidden_size: int = 64,
    seed: int = 0,
) -> Path:
    """Write a random Qwen3-MoE target + tokenizer to `out_dir`: the architecture of
    Qwen3-Coder-30B-A3B in miniature (every layer sparse, 8 experts with 2 per token, untied head,
    QK norm, and a head_dim whose heads do not multiply to the hidden size: 4 x 32 for 64, as
    32 x 128 for 2,048 there)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    out_dir = Path(out_dir)
    tok = build_tiny_tokenizer(out_dir)
    config = Qwen3MoeConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=3 * hidden_size,  # unused by the target (no dense layer); the draft's MLP width
        moe_intermediate_size=hidden_size // 2,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        **_chatml_ids(tok),
    )
    return _save_random(Qwen3MoeForCausalLM, config, out_dir, seed)


# Image processor defaults of the tiny VL target: 16-pixel patches merged 2x2, so a 64x64 image
# gives a 4x4 patch grid = 4 image tokens; at most 128x128 pixels (16 tokens) per image.
TINY_VL_MIN_PIXELS = 32 * 32
TINY_VL_MAX_PIXELS = 128 * 128


def build_tiny_qwen3vl(
    out_dir: str | Path,
    seed: int = 0,
    num_hidden_layers: int = 8,
    hidden_size: int = 64,
    deepstack_visual_indexes: tuple[int, ...] = (0, 1),
) -> Path:
    """Write a random Qwen3-VL target (safetensors), its tokenizer (Qwen vision specials, a ChatML
    template with image parts) and a Qwen2-VL image processor (PIL backend: no torchvision) to
    `out_dir`. Token ids in the config match the tokenizer; loads with `load_target(kind=qwen3_vl)`."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(out_dir, special_tokens=VL_SPECIAL_TOKENS, chat_template=VL_CHATML_TEMPLATE)
    ids = {t: tok.convert_tokens_to_ids(t) for t in VL_SPECIAL_TOKENS}
    head_dim = 16
    text_config = dict(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=hidden_size // head_dim,
        num_key_value_heads=max(1, hidden_size // head_dim // 2),
        head_dim=head_dim,
        max_position_embeddings=4096,
        # mrope_section sums to head_dim / 2 (T, H, W frequency bands), interleaved as in Qwen3-VL
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "mrope_section": [4, 2, 2], "mrope_interleaved": True},
        bos_token_id=None,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    vision_config = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=hidden_size,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=64,  # an 8x8 learned position grid, resampled per image
        deepstack_visual_indexes=list(deepstack_visual_indexes),
    )
    config = Qwen3VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    config.eos_token_id = ids["<|im_end|>"]
    config.pad_token_id = ids["<|endoftext|>"]
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config)
    model.save_pretrained(out_dir, safe_serialization=True)
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        size={"shortest_edge": TINY_VL_MIN_PIXELS, "longest_edge": TINY_VL_MAX_PIXELS},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    image_processor.save_pretrained(out_dir)
    return out_dir


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Write a tiny random target model directory.")
    parser.add_argument("out_dir")
    parser.add_argument("--kind", choices=["llama", "qwen3_moe", "qwen3_vl"], default="llama")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.kind == "qwen3_vl":
        print(build_tiny_qwen3vl(args.out_dir, seed=args.seed))
    elif args.kind == "qwen3_moe":
        print(build_tiny_qwen3_moe(args.out_dir, seed=args.seed))
    else:
        print(build_tiny_llama(args.out_dir, seed=args.seed))
