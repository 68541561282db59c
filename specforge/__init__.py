"""EAGLE3 draft-model training pipeline."""
