"""Extract stage: target hidden states (3 aux layers + final post-norm state) into a sharded store.

store.py: the on-disk format (writer with resume, lazy reader); embedded.py: the transformers
backend; stage.py: the pipeline entry (`run(cfg, run_dir)`).
"""
from specforge.extract.store import HiddenStateStore, HiddenStateStoreWriter, StoreMetaMismatch

__all__ = ["HiddenStateStore", "HiddenStateStoreWriter", "StoreMetaMismatch"]
