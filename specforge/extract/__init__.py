"""Extract stage: target hidden states (3 aux layers + final post-norm state) into a sharded store.

store.py: the on-disk format (writer with resume, lazy reader); batching.py: the batch plan every
backend shares; embedded.py (+ vl.py for vision-language targets): the transformers backend;
server_backend.py: the `server` and `sglang` backends (SGLang's /generate); online.py: `extract=online`,
no store (the train stage computes the states as it reads them); stage.py: the pipeline entry
(`run(cfg, run_dir, fingerprint)`).
"""
from specforge.extract.store import HiddenStateStore, HiddenStateStoreWriter, StoreMetaMismatch

__all__ = ["HiddenStateStore", "HiddenStateStoreWriter", "StoreMetaMismatch"]
