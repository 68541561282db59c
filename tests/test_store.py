"""The hidden-state store: exact round trip, format on disk, crash safety and resume."""
from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from specforge.extract.store import (
    MANIFEST,
    HiddenStateStore,
    HiddenStateStoreWriter,
    StoreDamaged,
    StoreMetaMismatch,
)

H = 8
META = {"hidden_size": H, "aux_layer_ids": [1, 3, 5], "storage_dtype": "bfloat16", "target_fingerprint": "abc"}
ROOT = Path(__file__).resolve().parents[1]


def make_samples(n: int = 7, seed: int = 0) -> list[dict]:
    """Deterministic samples of varied length; values are bf16-exact after the writer's cast."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        s = int(torch.randint(1, 12, (1,), generator=g))
        out.append(
            {
                "id": f"s{i:03d}",
                "input_ids": torch.randint(0, 50000, (s,), generator=g),
                "loss_mask": torch.randint(0, 2, (s,), generator=g),
                "aux": torch.randn(s, 3 * H, generator=g).to(torch.bfloat16),
                "last": torch.randn(s, H, generator=g).to(torch.bfloat16),
            }
        )
    return out


def write_all(out_dir: Path, samples: list[dict], shard_samples: int = 2, meta: dict = META) -> dict:
    """Every sample the store does not hold yet (a resumed store: the rest), then close."""
    with HiddenStateStoreWriter(out_dir, meta, shard_samples=shard_samples) as w:
        add_missing(w, samples)
    return w.close()


def add_missing(w: HiddenStateStoreWriter, samples: list[dict]) -> None:
    for s in samples:
        if s["id"] not in w.done_ids:
            w.add(s["id"], s["input_ids"], s["loss_mask"], s["aux"], s["last"],
                  s.get("position_ids"), s.get("image_embeds"))


def resume_and_finish(out: Path, meta: dict, samples: list[dict], shard_samples: int, done: list[dict]) -> None:
    """Reopen a crashed store: it resumes holding exactly `done`, no temp file left; add the rest."""
    w = HiddenStateStoreWriter(out, meta, shard_samples=shard_samples)
    assert w.resumed and w.done_ids == {s["id"] for s in done}
    assert not any(p.name.endswith(".tmp") for p in out.iterdir())
    add_missing(w, samples)
    w.close()


def assert_same_store(a: Path, b: Path) -> None:
    ma, mb = json.loads((a / MANIFEST).read_text()), json.loads((b / MANIFEST).read_text())
    assert ma == mb
    for shard in ma["shards"]:  # (header key order varies between writes, so compare contents)
        with safe_open(str(a / shard["name"]), framework="pt") as fa, safe_open(str(b / shard["name"]), framework="pt") as fb:
            assert fa.metadata() == fb.metadata()
            assert sorted(fa.keys()) == sorted(fb.keys())
            for k in fa.keys():
                assert torch.equal(fa.get_tensor(k), fb.get_tensor(k)), (shard["name"], k)
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())


def test_round_trip_exact(tmp_path):
    samples = make_samples(7)
    totals = write_all(tmp_path, samples, shard_samples=3)
    assert totals["shards"] == 3 and totals["samples"] == 7
    store = HiddenStateStore(tmp_path)
    assert len(store) == 7
    assert store.ids == [s["id"] for s in samples]
    assert store.lengths == [len(s["input_ids"]) for s in samples]
    assert store.num_tokens == sum(store.lengths) == totals["tokens"]
    assert store.meta == META
    # 3H + H bf16 values + int32 id + uint8 mask per token, plus headers/offsets
    assert store.bytes_per_token >= 4 * H * 2 + 5
    for i, s in enumerate(samples):
        got = store[i]
        assert got["input_ids"].dtype == torch.long and got["loss_mask"].dtype == torch.long
        assert got["aux"].dtype == torch.bfloat16 and got["last"].dtype == torch.bfloat16
        assert torch.equal(got["input_ids"], s["input_ids"].long())
        assert torch.equal(got["loss_mask"], s["loss_mask"].long())
        assert torch.equal(got["aux"], s["aux"])
        assert torch.equal(got["last"], s["last"])
    assert torch.equal(store[-1]["last"], samples[-1]["last"])
    with pytest.raises(IndexError):
        store[7]
    # picklable for DataLoader workers (handles reopen lazily)
    clone = pickle.loads(pickle.dumps(store))
    assert torch.equal(clone[4]["aux"], samples[4]["aux"])


def test_shard_format_on_disk(tmp_path):
    samples = make_samples(5)
    write_all(tmp_path, samples, shard_samples=3)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["complete"] is True
    assert [s["name"] for s in manifest["shards"]] == ["shard_00000.safetensors", "shard_00001.safetensors"]
    assert [s["samples"] for s in manifest["shards"]] == [3, 2]
    assert manifest["shards"][1]["first_id"] == "s003" and manifest["shards"][1]["last_id"] == "s004"
    with safe_open(str(tmp_path / "shard_00000.safetensors"), framework="pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
        ids = json.loads(f.metadata()["ids"])
    assert ids == ["s000", "s001", "s002"]
    n_tok = sum(len(s["input_ids"]) for s in samples[:3])
    assert t["input_ids"].dtype == torch.int32 and t["input_ids"].shape == (n_tok,)
    assert t["loss_mask"].dtype == torch.uint8 and t["loss_mask"].shape == (n_tok,)
    assert t["aux"].dtype == torch.bfloat16 and t["aux"].shape == (n_tok, 3 * H)
    assert t["last"].dtype == torch.bfloat16 and t["last"].shape == (n_tok, H)
    assert t["offsets"].dtype == torch.int64 and t["offsets"].tolist()[0] == 0
    assert t["offsets"].tolist()[-1] == n_tok
    assert torch.equal(t["aux"][: len(samples[0]["input_ids"])], samples[0]["aux"])


def test_add_validates_shapes(tmp_path):
    s = make_samples(1)[0]
    w = HiddenStateStoreWriter(tmp_path, META)
    with pytest.raises(ValueError, match="aux has shape"):
        w.add("x", s["input_ids"], s["loss_mask"], s["aux"][:, :H], s["last"])
    with pytest.raises(ValueError, match="loss_mask has shape"):
        w.add("x", s["input_ids"], torch.zeros(len(s["input_ids"]) + 1), s["aux"], s["last"])
    with pytest.raises(ValueError, match="only 0 and 1"):
        w.add("x", s["input_ids"], torch.full_like(s["loss_mask"], 2), s["aux"], s["last"])
    w.add("x", s["input_ids"], s["loss_mask"], s["aux"], s["last"])
    with pytest.raises(ValueError, match="already in the store"):
        w.add("x", s["input_ids"], s["loss_mask"], s["aux"], s["last"])


def test_add_refuses_inf_and_nan_naming_the_sample_and_why(tmp_path):
    """States the target computed as inf/nan, or that overflow float16 storage (massive activations
    past 65504), are refused: a draft trained on them learns nothing."""
    s = make_samples(1)[0]
    w = HiddenStateStoreWriter(tmp_path / "bf16", META)
    aux = s["aux"].clone()
    aux[-1, 5] = float("nan")
    n = len(s["input_ids"])
    with pytest.raises(ValueError, match=rf"sample 'x': aux holds inf/nan in row {n - 1} of {n}: the target computed "
                                         r"them so \(it overflows in torch.bfloat16\? try target.dtype=bfloat16 or float32\)"):
        w.add("x", s["input_ids"], s["loss_mask"], aux, s["last"])
    assert "x" not in w.done_ids
    loud = s["last"].float().clone()
    loud[0, 0] = 1e5  # finite in bf16 and fp32, inf in fp16
    w.add("x", s["input_ids"], s["loss_mask"], s["aux"], loud)  # bf16 storage holds it
    w16 = HiddenStateStoreWriter(tmp_path / "fp16", {**META, "storage_dtype": "float16"})
    with pytest.raises(ValueError, match=r"sample 'y': last holds inf/nan in row 0 of \d+: the target's values \(up to "
                                         r"1e\+05\) overflow the storage dtype torch.float16: use extract.dtype=bfloat16"):
        w16.add("y", s["input_ids"], torch.ones_like(s["loss_mask"]), s["aux"], loud)


# A child process that is killed (SIGKILL) while the third shard is half written.
CRASH_CHILD = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import specforge.extract.store as store
from {module} import {meta} as META, make_samples

real_save = store.save_file
calls = []
def save_then_die(tensors, path, metadata=None):
    calls.append(path)
    if len(calls) == {die_at}:                # leave half a temp file of this shard, then die
        real_save(tensors, path, metadata=metadata)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        os.kill(os.getpid(), signal.SIGKILL)
    real_save(tensors, path, metadata=metadata)
store.save_file = save_then_die

w = store.HiddenStateStoreWriter({out!r}, META, shard_samples={shard_samples})
for s in make_samples(7):
    w.add(s["id"], s["input_ids"], s["loss_mask"], s["aux"], s["last"])
w.close()
"""


def crash_child(out, module: str = "test_store", meta: str = "META", die_at: int = 3, shard_samples: int = 2) -> str:
    """A script writing make_samples(7) of `module` with `meta` that is SIGKILLed while it writes
    its `die_at`-th file (shard die_at - 1), half of that shard's temp file on disk."""
    return CRASH_CHILD.format(tests=str(Path(__file__).parent), out=str(out), module=module, meta=meta,
                              die_at=die_at, shard_samples=shard_samples)


def test_kill_mid_shard_then_resume_equals_uninterrupted(tmp_path):
    samples = make_samples(7)
    ref, out = tmp_path / "ref", tmp_path / "crashed"
    write_all(ref, samples, shard_samples=2)

    proc = subprocess.run([sys.executable, "-c", crash_child(out)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["complete"] is False
    assert [s["name"] for s in manifest["shards"]] == ["shard_00000.safetensors", "shard_00001.safetensors"]
    assert not (out / "shard_00002.safetensors").exists()
    assert any(p.name.startswith(".shard_00002") for p in out.iterdir())  # the half temp file
    with pytest.raises(StoreDamaged, match="incomplete"):
        HiddenStateStore(out)
    partial = HiddenStateStore(out, require_complete=False)
    assert len(partial) == 4 and torch.equal(partial[3]["aux"], samples[3]["aux"])

    resume_and_finish(out, META, samples, shard_samples=2, done=samples[:4])  # stray temp removed
    assert_same_store(ref, out)


def test_crash_between_rename_and_manifest(tmp_path, monkeypatch):
    """A renamed shard that never got listed is discarded and redone."""
    samples = make_samples(7)
    ref, out = tmp_path / "ref", tmp_path / "crashed"
    write_all(ref, samples, shard_samples=2)

    real = HiddenStateStoreWriter._write_manifest

    def failing(self, complete):
        if len(self.shards) == 2 and not complete:
            raise OSError("disk full (simulated)")
        real(self, complete)

    monkeypatch.setattr(HiddenStateStoreWriter, "_write_manifest", failing)
    with pytest.raises(OSError, match="simulated"):
        write_all(out, samples, shard_samples=2)
    monkeypatch.setattr(HiddenStateStoreWriter, "_write_manifest", real)
    assert (out / "shard_00001.safetensors").exists()
    assert len(json.loads((out / MANIFEST).read_text())["shards"]) == 1

    write_all(out, samples, shard_samples=2)
    assert_same_store(ref, out)


def test_meta_mismatch_errors_or_restarts(tmp_path):
    samples = make_samples(3)
    write_all(tmp_path, samples)
    other = dict(META, target_fingerprint="xyz")
    with pytest.raises(StoreMetaMismatch, match=r"manifest\.json.*target_fingerprint"):
        HiddenStateStoreWriter(tmp_path, other)
    w = HiddenStateStoreWriter(tmp_path, other, if_mismatch="restart")
    assert not w.done_ids and not w.resumed
    assert not list(tmp_path.glob("shard_*"))
    w.add(samples[0]["id"], samples[0]["input_ids"], samples[0]["loss_mask"], samples[0]["aux"], samples[0]["last"])
    w.close()
    store = HiddenStateStore(tmp_path)
    assert len(store) == 1 and store.meta["target_fingerprint"] == "xyz"


def test_reader_detects_damaged_shard(tmp_path):
    write_all(tmp_path, make_samples(3))
    shard = tmp_path / "shard_00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(StoreDamaged, match=r"shard_00000.safetensors has \d+ bytes, \d+ were written; run the "
                                           "extract stage again"):
        HiddenStateStore(tmp_path)


def test_a_damaged_store_is_refused_or_extracted_anew(tmp_path):
    """A listed shard deleted by hand: the writer refuses to resume from it, or (the extract stage's
    if_mismatch="restart") starts the store again; nothing of it is trusted."""
    samples, out, ref = make_samples(5), tmp_path / "store", tmp_path / "ref"
    write_all(out, samples)
    write_all(ref, samples)
    (out / "shard_00001.safetensors").unlink()
    with pytest.raises(StoreDamaged, match=r"listed shard shard_00001.safetensors is missing.*delete"):
        HiddenStateStoreWriter(out, META)
    w = HiddenStateStoreWriter(out, META, shard_samples=2, if_mismatch="restart")
    assert not w.done_ids and not list(out.glob("shard_*"))
    add_missing(w, samples)
    w.close()
    assert_same_store(ref, out)


def test_vision_language_store_round_trip(tmp_path):
    """M-RoPE positions and image embeddings (possibly none for a text-only row) come back per
    sample, across shard boundaries; a VL store refuses rows without them and vice versa."""
    meta = dict(META, vl=True, image_token_id=7)
    g = torch.Generator().manual_seed(3)
    samples = make_samples(5)
    for k, s in enumerate(samples):
        n = len(s["input_ids"])
        s["position_ids"] = torch.randint(0, 100, (3, n), generator=g)
        s["image_embeds"] = torch.randn(k % 3, H, generator=g).to(torch.bfloat16)  # 0, 1 or 2 rows
    with HiddenStateStoreWriter(tmp_path, meta, shard_samples=2) as w:
        with pytest.raises(ValueError, match="needs position_ids and image_embeds"):
            w.add("bad", samples[0]["input_ids"], samples[0]["loss_mask"], samples[0]["aux"], samples[0]["last"])
        with pytest.raises(ValueError, match=r"position_ids has shape \(2,"):
            s = samples[0]
            w.add("bad", s["input_ids"], s["loss_mask"], s["aux"], s["last"], s["position_ids"][:2], s["image_embeds"])
        for s in samples:
            w.add(s["id"], s["input_ids"], s["loss_mask"], s["aux"], s["last"], s["position_ids"], s["image_embeds"])
    store = HiddenStateStore(tmp_path)
    assert store.vl and len(store) == 5
    by_id = {s["id"]: s for s in samples}
    for i, sid in enumerate(store.ids):
        got, want = store[i], by_id[sid]
        assert torch.equal(got["position_ids"], want["position_ids"])
        assert torch.equal(got["image_embeds"], want["image_embeds"])
        assert torch.equal(got["aux"], want["aux"])

    text = tmp_path / "text"
    with HiddenStateStoreWriter(text, META) as w:
        s = samples[1]
        with pytest.raises(ValueError, match="need a store with meta vl=true"):
            w.add(s["id"], s["input_ids"], s["loss_mask"], s["aux"], s["last"], s["position_ids"], s["image_embeds"])
