"""A tiny random target built locally: a byte-level BPE tokenizer trained on the spot with a
ChatML template, and a small Llama from a config. Tests and quick runs use it where SmolLM2
would be too slow; it behaves like a real Hugging Face model directory."""
from __future__ import annotations

from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


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


def build_tiny_tokenizer(out_dir: str | Path, vocab_size: int = 512):
    """Train a byte-level BPE tokenizer with the ChatML specials; returns a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
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
    fast.chat_template = CHATML_TEMPLATE
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
    import torch
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
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


if __name__ == "__main__":
    import sys

    print(build_tiny_llama(sys.argv[1]))
