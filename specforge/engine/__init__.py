"""Embedded speculative decoding engine: SGLang's EAGLE3 tree semantics in plain PyTorch."""
