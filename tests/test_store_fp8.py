"""The fp8 hidden-state store (extract.dtype=fp8): quantisation error, the compact `last` rows that
training reads (and proof that training is unchanged by them), meta / re-extraction, crash resume,
the extract stage end to end on the tiny Llama, and vision-language rows."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from specforge.extract import stage
from specforge.extract.embedded import EmbeddedExtractor
from specforge.extract.store import (FP8, MANIFEST, HiddenStateStore, HiddenStateStoreWriter, StoreMetaMismatch,
                                     dequantize_fp8, quantize_fp8, scored_rows, store_layout)
from specforge.train.batches import collate
from specforge.train.ttt import Teacher, summarize, ttt_forward
from tests.test_extract import (AUX, assert_equal_stores, capture, crash_extraction, run_setup, tiny_dir,  # noqa: F401
                                tiny_model)
from tests import test_store
from tests.test_store import META, assert_same_store, crash_child, resume_and_finish
from tests.test_ttt import tiny_draft

H = 24  # tiny_draft's target_hidden_size, so stores of this file can be trained on
FP8_META = dict(META, hidden_size=H, **store_layout("fp8"))
BF16_META = dict(META, hidden_size=H)
ROOT = Path(__file__).resolve().parents[1]
E4M3_REL = 2.0**-4  # half an ulp of a 3-bit mantissa, relative
E4M3_SUB = 2.0**-10  # half the subnormal step (2^-9), in units of the scale


def assert_fp8_close(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor) -> None:
    """|got - want| within e4m3 rounding (relative for normals, absolute near zero) plus bf16's."""
    want = want.float()
    scale = scale.repeat_interleave(want.shape[-1] // scale.shape[-1], dim=-1)
    bound = (E4M3_REL * want.abs() + E4M3_SUB * scale) * (1 + 2.0**-7)
    err = (got.float() - want).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max():.3g}"


def make_samples(n: int = 7, seed: int = 0) -> list[dict]:
    """Samples with varied lengths and loss masks (prompt 0s, answer 1s, some holes), per-token
    magnitudes over 7 decades, a BOS-like outlier row (|x| ~ 1e4) and all-zero rows; one sample
    is never scored, one has a single token."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        s = 1 if i == 3 else int(torch.randint(4, 14, (1,), generator=g))
        mask = (torch.arange(s) >= s // 3).long() & (torch.rand(s, generator=g) > 0.2).long()
        if i == 5:
            mask[:] = 0
        rows = torch.logspace(-3, 4, 7)[torch.randint(0, 7, (s,), generator=g)][:, None]
        aux = torch.randn(s, 3 * H, generator=g) * rows
        last = torch.randn(s, H, generator=g) * rows
        aux[0], last[0] = aux[0].sign() * 1e4, last[0].sign() * 2e4  # the BOS token's outlier state
        aux[0, H : 2 * H] *= 1e-6  # one quiet layer beside two loud ones: a scale per layer
        if s > 2:
            aux[-1], last[-2] = 0, 0
        out.append({"id": f"s{i:03d}", "input_ids": torch.randint(0, 50, (s,), generator=g), "loss_mask": mask,
                    "aux": aux.to(torch.bfloat16), "last": last.to(torch.bfloat16)})
    return out


def write_all(out_dir: Path, samples: list[dict], meta: dict, shard_samples: int = 3) -> dict:
    return test_store.write_all(out_dir, samples, shard_samples, meta)


def shard_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


# ---------------------------------------------------------------------------- quantisation


def test_quantize_per_token_per_layer_scales():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 3 * H, generator=g) * torch.logspace(-4, 4, 9)[:, None]
    x[4] = 0  # an all-zero row
    x[6, :H] = 1e4  # one outlier layer of one token
    q, scale = quantize_fp8(x, groups=3)
    assert q.dtype == FP8 and q.shape == x.shape and scale.dtype == torch.float32 and scale.shape == (9, 3)
    assert torch.equal(scale[4], torch.ones(3))  # zero guard: no 0/0
    torch.testing.assert_close(scale[6, 0], torch.tensor(1e4 / 448))
    back = dequantize_fp8(q, scale, torch.float32)
    assert torch.equal(back[4], torch.zeros(3 * H))
    assert_fp8_close(back, x, scale)
    # each group's maximum comes back (448 is exact in e4m3), whatever the other groups hold
    amax_at = x.reshape(9, 3, H).abs().argmax(-1, keepdim=True)
    torch.testing.assert_close(back.reshape(9, 3, H).gather(-1, amax_at), x.reshape(9, 3, H).gather(-1, amax_at),
                               rtol=1e-6, atol=0)
    rel = ((back - x).abs() / x.abs().clamp(min=1e-30))[x != 0]
    assert rel.mean() < 0.03  # a per-tensor scale would flush the 1e-4 rows to zero (rel 1.0)
    bf16 = dequantize_fp8(q, scale)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, back.to(torch.bfloat16))
    with pytest.raises(ValueError, match="inf/nan"):
        quantize_fp8(torch.tensor([[1.0, float("inf")]]))
    e_q, e_s = quantize_fp8(torch.zeros(0, H))
    assert e_q.shape == (0, H) and e_s.shape == (0, 1) and dequantize_fp8(e_q, e_s).shape == (0, H)


def test_scored_rows_are_the_positions_before_a_scored_token():
    assert scored_rows(torch.tensor([0, 0, 1, 1, 0, 1])).tolist() == [1, 2, 4]
    assert scored_rows(torch.tensor([1])).tolist() == []
    assert scored_rows(torch.tensor([1, 0, 0])).tolist() == []


# ---------------------------------------------------------------------------- the store


def test_fp8_store_round_trip_and_format(tmp_path):
    samples = make_samples(7)
    write_all(tmp_path / "bf16", samples, BF16_META)
    totals = write_all(tmp_path / "fp8", samples, FP8_META)
    assert totals["samples"] == 7 and totals["shards"] == 3
    ref, store = HiddenStateStore(tmp_path / "bf16"), HiddenStateStore(tmp_path / "fp8")
    assert store.meta["storage_dtype"] == "fp8" and store.meta["last_rows"] == "scored"
    assert store.ids == ref.ids and store.lengths == ref.lengths
    for i, s in enumerate(samples):
        got, want = store[i], ref[i]
        assert got.keys() == want.keys()
        for k in got:
            assert got[k].shape == want[k].shape and got[k].dtype == want[k].dtype, k
        assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["loss_mask"], want["loss_mask"])
        amax = s["aux"].float().reshape(-1, 3, H).abs().amax(-1)
        assert_fp8_close(got["aux"], s["aux"], amax / 448)
        at = scored_rows(s["loss_mask"])
        assert torch.equal(got["last"][at], s["last"][at])  # `last` stays bf16: the teacher's argmax reads it
        rest = torch.ones(len(s["input_ids"]), dtype=torch.bool)
        rest[at] = False
        assert not got["last"][rest].any()  # nothing stored where training never reads
        if len(at) and s["last"][at].any():
            assert got["last"][at].any()

    # on disk: fp8 aux with a float32 scale per token and layer, bf16 `last` only at the scored rows
    t = shard_tensors(tmp_path / "fp8" / "shard_00000.safetensors")
    n_tok = sum(len(s["input_ids"]) for s in samples[:3])
    n_rows = [len(scored_rows(s["loss_mask"])) for s in samples[:3]]
    assert t["aux"].dtype == FP8 and t["aux"].shape == (n_tok, 3 * H)
    assert t["aux_scale"].dtype == torch.float32 and t["aux_scale"].shape == (n_tok, 3)
    assert t["last"].dtype == torch.bfloat16 and t["last"].shape == (sum(n_rows), H)
    assert t["last_offsets"].tolist() == [0, n_rows[0], n_rows[0] + n_rows[1], sum(n_rows)]
    assert sorted(t) == ["aux", "aux_scale", "input_ids", "last", "last_offsets", "loss_mask", "offsets"]

    # bytes: a bf16 store holds 8H bytes of hidden states per token; fp8 3H + 12, and 2H per scored row
    tokens = sum(len(s["input_ids"]) for s in samples)
    rows = sum(len(scored_rows(s["loss_mask"])) for s in samples)
    assert ref.hidden_bytes_per_token == 8 * H
    assert store.hidden_bytes_per_token == pytest.approx((tokens * (3 * H + 12) + rows * 2 * H) / tokens)
    assert store.bytes_per_token > store.hidden_bytes_per_token  # ids, masks, offsets and headers on top
    assert store.bytes_per_token < ref.bytes_per_token  # (headers weigh a lot in a store this small)


def test_writer_quantises_what_the_extractor_hands_over(tmp_path):
    """fp32 or bf16 in: the writer is the one place that rounds, to the same fp8 values."""
    samples = make_samples(3)
    write_all(tmp_path / "a", samples, FP8_META)
    write_all(tmp_path / "b", [dict(s, aux=s["aux"].float(), last=s["last"].float()) for s in samples], FP8_META)
    assert_same_store(tmp_path / "a", tmp_path / "b")


def loss_and_grads(draft, batch, teacher):
    draft.zero_grad()
    loss, stats = ttt_forward(draft, batch, teacher, 4, 0.8)
    loss.backward()
    return loss.detach(), summarize(stats), {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("pack_tokens", [0, 24])
def test_training_reads_no_last_row_the_compact_store_drops(tmp_path, pack_tokens):
    """The same bf16 states stored with every `last` row and with only the scored ones: the TTT
    loss, its statistics and every gradient are identical, padded or packed (doc_ids) rows."""
    draft = tiny_draft(vocab=50)
    torch.manual_seed(3)
    teacher = Teacher(torch.randn(50, H), draft.t2d)
    samples = [s for s in make_samples(7) if s["id"] != "s003"]
    for s in samples:  # ordinary magnitudes, so the teacher is not one-hot
        s["aux"], s["last"] = (torch.randn(s["aux"].shape) / 2).bfloat16(), torch.randn(s["last"].shape).bfloat16()
    write_all(tmp_path / "all", samples, BF16_META)
    write_all(tmp_path / "scored", samples, dict(BF16_META, last_rows="scored"))
    dense, compact = HiddenStateStore(tmp_path / "all"), HiddenStateStore(tmp_path / "scored")
    assert compact.hidden_bytes_per_token < dense.hidden_bytes_per_token
    idx = list(range(len(samples)))
    ref = collate([dense[i] for i in idx], pack_tokens=pack_tokens)
    got = collate([compact[i] for i in idx], pack_tokens=pack_tokens)
    assert not torch.equal(got["last"], ref["last"])  # the dropped rows really are gone
    if pack_tokens:
        assert got["doc_ids"].max() > 0  # rows hold several documents
    ref_loss, ref_stats, ref_grads = loss_and_grads(draft, ref, teacher)
    loss, stats, grads = loss_and_grads(draft, got, teacher)
    assert ref_stats["positions"] > 0
    assert torch.equal(loss, ref_loss) and stats == ref_stats
    assert sorted(grads) == sorted(ref_grads)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-6, msg=name)
    # the check can fail: dropping one row that IS read changes the loss
    broken = [compact[i] for i in idx]
    at = scored_rows(broken[0]["loss_mask"])
    broken[0]["last"][at[0]] = 0
    assert not torch.equal(loss_and_grads(draft, collate(broken, pack_tokens=pack_tokens), teacher)[0], loss)


def test_fp8_vision_language_rows(tmp_path):
    """image_embeds are quantised like the other states (row scales); positions stay exact."""
    meta = dict(FP8_META, vl=True, image_token_id=7)
    g = torch.Generator().manual_seed(3)
    samples = make_samples(5)
    for k, s in enumerate(samples):
        s["position_ids"] = torch.randint(0, 100, (3, len(s["input_ids"])), generator=g)
        s["image_embeds"] = (torch.randn(k % 3, H, generator=g) * 30).to(torch.bfloat16)  # 0, 1 or 2 rows
    write_all(tmp_path, samples, meta, shard_samples=2)
    store = HiddenStateStore(tmp_path)
    assert store.vl
    for i, s in enumerate(samples):
        got = store[i]
        assert torch.equal(got["position_ids"], s["position_ids"])
        assert got["image_embeds"].shape == s["image_embeds"].shape and got["image_embeds"].dtype == torch.bfloat16
        assert_fp8_close(got["image_embeds"], s["image_embeds"], s["image_embeds"].float().abs().amax(-1, keepdim=True) / 448)
    t = shard_tensors(tmp_path / "shard_00001.safetensors")
    assert t["image_embeds"].dtype == FP8 and t["image_embeds_scale"].shape == (t["image_embeds"].shape[0], 1)
    assert t["position_ids"].dtype == torch.int32


# ---------------------------------------------------------------------------- meta and resume


def test_dtype_switch_is_a_meta_mismatch(tmp_path):
    samples = make_samples(3)
    write_all(tmp_path, samples, BF16_META)
    with pytest.raises(StoreMetaMismatch, match=r"last_rows.*storage_dtype"):
        HiddenStateStoreWriter(tmp_path, FP8_META)
    w = HiddenStateStoreWriter(tmp_path, FP8_META, if_mismatch="restart")
    assert not w.done_ids and not list(tmp_path.glob("shard_*"))
    with pytest.raises(ValueError, match="last_rows='some'"):
        HiddenStateStoreWriter(tmp_path / "x", dict(FP8_META, last_rows="some"))


# A child process (test_store.crash_child) killed (SIGKILL) while the second fp8 shard is half written.
def test_kill_mid_shard_then_resume_equals_uninterrupted(tmp_path):
    samples = make_samples(7)
    ref, out = tmp_path / "ref", tmp_path / "crashed"
    write_all(ref, samples, FP8_META)
    code = crash_child(out, module="test_store_fp8", meta="FP8_META", die_at=2, shard_samples=3)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["complete"] is False and [s["name"] for s in manifest["shards"]] == ["shard_00000.safetensors"]
    partial = HiddenStateStore(out, require_complete=False)
    assert len(partial) == 3 and torch.equal(partial[2]["last"], HiddenStateStore(ref)[2]["last"])
    resume_and_finish(out, FP8_META, samples, shard_samples=3, done=samples[:3])  # the half shard is gone
    assert_same_store(ref, out)


# ---------------------------------------------------------------------------- the extract stage


def test_stage_fp8_end_to_end(run_setup, tiny_model):
    """extract.dtype=fp8 on the tiny Llama (fp32): states within e4m3 rounding of the target's own,
    `last` at the scored positions only, and the teacher's argmax there as from fp32 states."""
    cfg, run_dir, rows = run_setup
    cfg.extract.dtype = "fp8"
    summary = stage.run(cfg, run_dir)
    tr = summary["splits"]["train"]
    assert tr["samples"] == 10 and tr["shards"] == 3
    assert tr["hidden_bytes_per_token"] < 0.6 * 8 * 64 and tr["bytes_per_token"] > tr["hidden_bytes_per_token"]
    store = HiddenStateStore(run_dir / "extract" / "train")
    assert store.meta["storage_dtype"] == "fp8" and store.meta["last_rows"] == "scored"
    by_id = {r["id"]: r for r in rows["train"]}
    agree = total = 0
    for i, sid in enumerate(store.ids):
        got, row = store[i], by_id[sid]
        assert got["input_ids"].tolist() == row["input_ids"] and got["aux"].dtype == torch.bfloat16
        ref, _ = capture(tiny_model, torch.tensor([row["input_ids"]]))
        want_aux = torch.cat([ref[L][0] for L in AUX], -1)
        assert_fp8_close(got["aux"], want_aux, want_aux.reshape(-1, 3, 64).abs().amax(-1) / 448)
        at = scored_rows(got["loss_mask"])
        want_last = ref["norm"][0][at]
        torch.testing.assert_close(got["last"][at], want_last.bfloat16(), rtol=0, atol=0)
        assert int((got["last"].abs().sum(-1) != 0).sum()) == len(at)
        head = tiny_model.lm_head.weight
        agree += int((got["last"][at].float() @ head.T).argmax(-1).eq((want_last @ head.T).argmax(-1)).sum())
        total += len(at)
    assert total > 0 and agree / total > 0.99


def test_stage_switch_to_fp8_extracts_again_then_resumes(run_setup, tmp_path, monkeypatch):
    cfg, run_dir, rows = run_setup
    stage.run(cfg, run_dir)  # bf16
    cfg.extract.dtype = "fp8"
    ref_dir = tmp_path / "ref"
    for split in ("train", "eval"):
        (ref_dir / "data").mkdir(parents=True, exist_ok=True)
        (ref_dir / "data" / f"{split}.jsonl").write_bytes((run_dir / "data" / f"{split}.jsonl").read_bytes())
    stage.run(cfg, ref_dir)  # an uninterrupted fp8 extraction

    crash_extraction(monkeypatch, cfg, run_dir)
    manifest = json.loads((run_dir / "extract" / "train" / MANIFEST).read_text())
    assert manifest["meta"]["storage_dtype"] == "fp8" and not manifest["complete"]
    assert 1 <= len(manifest["shards"]) < 3  # the bf16 shards were dropped, not appended to

    summary = stage.run(cfg, run_dir)
    assert summary["splits"]["train"]["resumed_samples"] == manifest["samples"] > 0
    for split in ("train", "eval"):
        assert_equal_stores(ref_dir / "extract" / split, run_dir / "extract" / split)
