"""Dataset generators for demos and tests."""
