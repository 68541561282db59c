"""M-RoPE in the draft (vision-language targets, docs/contract.md §1) and the input-embeddings override.

The draft must rotate q/k exactly as the target does, with the same 3-D (T, H, W) positions, and
TTT must feed it the target's merged input embeddings where the batch overrides them."""
import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2_5_VLConfig, Qwen3VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VLRotaryEmbedding,
    apply_rotary_pos_emb,
)
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

from specforge.models.draft import Eagle3Config, Eagle3Draft, rotate_half
from specforge.train.ttt import Teacher, shift, ttt_forward

TEXT = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, num_hidden_layers=8, vocab_size=100, max_position_embeddings=4096,
            bos_token_id=1, eos_token_id=2)


def qwen3_vl(section=(4, 2, 2), theta=5e6):
    rope = {"rope_type": "default", "rope_theta": theta, "mrope_section": list(section),
            "mrope_interleaved": True}
    return Qwen3VLConfig(text_config={**TEXT, "rope_parameters": rope})


def qwen2_5_vl(section=(2, 3, 3), theta=1e6):
    # as the released checkpoints spell it: {"type": "mrope", "mrope_section": [...]}
    return Qwen2_5_VLConfig(text_config={**TEXT, "rope_theta": theta,
                                         "rope_scaling": {"type": "mrope", "mrope_section": list(section)}})


def random_positions(batch=2, n=9, seed=0):
    """[B, 3, n] with independent T, H, W components (as image tokens have)."""
    return torch.randint(0, 300, (batch, 3, n), generator=torch.Generator().manual_seed(seed))


def test_interleaved_mrope_matches_qwen3_vl():
    target = qwen3_vl()
    draft = Eagle3Draft(Eagle3Config.from_target(target, [0, 1, 2]))
    pos = random_positions()
    x = torch.zeros(1, dtype=torch.float32)
    hf_cos, hf_sin = Qwen3VLTextRotaryEmbedding(target.text_config)(x, pos.transpose(0, 1))  # [B, n, d]
    cos, sin = draft.rope(pos, torch.float32)
    assert cos.shape == (2, 1, 9, 16)
    torch.testing.assert_close(cos[:, 0], hf_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[:, 0], hf_sin, rtol=0, atol=1e-6)


def test_sectioned_mrope_matches_qwen2_5_vl():
    target = qwen2_5_vl()
    draft = Eagle3Draft(Eagle3Config.from_target(target, [0, 1, 2]))
    assert draft.uses_mrope and not draft.config.rope_scaling.get("mrope_interleaved", False)
    pos = random_positions(seed=1)
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 4, 9, 16, generator=g), torch.randn(2, 2, 9, 16, generator=g)
    hf_cos, hf_sin = Qwen2_5_VLRotaryEmbedding(target.text_config)(q, pos.transpose(0, 1))
    hf_q, hf_k = apply_rotary_pos_emb(q, k, hf_cos, hf_sin)
    cos, sin = draft.rope(pos, torch.float32)
    torch.testing.assert_close(q * cos + rotate_half(q) * sin, hf_q, rtol=0, atol=1e-5)
    torch.testing.assert_close(k * cos + rotate_half(k) * sin, hf_k, rtol=0, atol=1e-5)


@pytest.mark.parametrize("target", [qwen3_vl, qwen2_5_vl])
def test_text_positions_give_plain_rope(target):
    cfg = Eagle3Config.from_target(target(), [0, 1, 2])
    mrope = Eagle3Draft(cfg)
    plain = Eagle3Draft(Eagle3Config(**{**vars(cfg), "rope_scaling": None}))
    assert mrope.uses_mrope and not plain.uses_mrope
    pos = torch.randint(0, 1000, (2, 7))
    expected = plain.rope(pos, torch.float32)
    for got in (mrope.rope(pos, torch.float32), mrope.rope(pos[:, None].expand(2, 3, 7), torch.float32)):
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    with pytest.raises(ValueError, match="mrope_section"):
        plain.rope(pos[:, None].expand(2, 3, 7), torch.float32)


def test_from_target_keeps_mrope_and_config_json_round_trips():
    cfg = Eagle3Config.from_target(qwen3_vl(), [3, 4, 5])
    assert cfg.rope_scaling == {"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True}
    assert cfg.rope_theta == 5e6 and cfg.head_dim == 16 and cfg.uses_mrope
    d = json.loads(json.dumps(cfg.to_json_dict()))
    assert d["rope_scaling"] == cfg.rope_scaling
    assert Eagle3Config.from_json_dict(d) == cfg
    # Qwen2.5-VL's {"type": "mrope"} is default RoPE per component
    assert Eagle3Config.from_target(qwen2_5_vl(), [0, 1, 2]).rope_scaling == {
        "rope_type": "default", "mrope_section": [2, 3, 3]}


def test_mrope_section_must_match_the_draft_head_dim():
    with pytest.raises(ValueError, match="rope_scaling.mrope_section"):
        Eagle3Config.from_target(qwen3_vl(), [0, 1, 2], draft_cfg=SimpleNamespace(head_dim=32))
    d = Eagle3Config.from_target(qwen3_vl(), [0, 1, 2]).to_json_dict()
    d["rope_scaling"]["mrope_section"] = [4, 2, 3]
    with pytest.raises(ValueError, match="rope_scaling.mrope_section"):
        Eagle3Config.from_json_dict(d)
    d["rope_scaling"].update(mrope_section=[4, 2, 2], rope_type="yarn", factor=2.0)
    with pytest.raises(ValueError, match="rope_scaling.rope_type"):  # SGLang would serve it as default
        Eagle3Config.from_json_dict(d)


# -- TTT with M-RoPE positions and the embedding override -----------------------------------------

def tiny_vl_draft():
    """test_ttt's tiny draft with interleaved M-RoPE (head_dim 8: sections sum to 4)."""
    from test_ttt import tiny_draft

    return tiny_draft(target_hidden=32, rope_scaling={"rope_type": "default", "mrope_section": [2, 1, 1],
                                                      "mrope_interleaved": True})


def vl_batch(draft, batch=2, seq=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    cfg = draft.config
    mask = torch.zeros(batch, seq, dtype=torch.bool)
    mask[0, 2:5] = True
    mask[1, 6] = True
    return {
        "input_ids": torch.randint(0, cfg.vocab_size, (batch, seq), generator=g),
        "loss_mask": torch.ones(batch, seq, dtype=torch.bool),
        "aux": torch.randn(batch, seq, 3 * cfg.target_hidden_size, generator=g),
        "last": torch.randn(batch, seq, cfg.target_hidden_size, generator=g),
        "position_ids": torch.randint(0, 20, (batch, 3, seq), generator=g),
        "embed_override": torch.randn(batch, seq, cfg.hidden_size, generator=g),
        "embed_override_mask": mask,
    }


def run_ttt(draft, batch, steps=3):
    """(loss, stats, logits of every step) of the TTT unroll."""
    captured, original = [], draft.step

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        captured.append(out[1] if kwargs.get("head", True) else draft.lm_head(out[1]))  # training: norm(out)
        return out

    draft.step = spy
    teacher = Teacher(torch.randn(draft.config.vocab_size, draft.config.target_hidden_size,
                                  generator=torch.Generator().manual_seed(3)), draft.t2d)
    loss, stats = ttt_forward(draft, batch, teacher, steps, 0.8, skip_unscored=False)  # logits at every position
    draft.step = original
    return loss, stats, captured, teacher


def merged_embeddings(draft, batch):
    """By hand: the target's merged embedding where the mask is set, else the token's embedding."""
    ids, mask, over = batch["input_ids"], batch["embed_override_mask"], batch["embed_override"]
    rows = [[over[b, t] if mask[b, t] else draft.embed_tokens.weight[ids[b, t]] for t in range(ids.shape[1])]
            for b in range(ids.shape[0])]
    return torch.stack([torch.stack(r) for r in rows])


def test_override_with_empty_mask_changes_nothing():
    draft = tiny_vl_draft()
    batch = vl_batch(draft)
    plain = {k: v for k, v in batch.items() if not k.startswith("embed_override")}
    empty = {**batch, "embed_override_mask": torch.zeros_like(batch["embed_override_mask"])}
    loss_a, stats_a, logits_a, _ = run_ttt(draft, plain)
    loss_b, stats_b, logits_b, _ = run_ttt(draft, empty)
    assert torch.equal(loss_a, loss_b)
    for sa, sb in zip(stats_a, stats_b):
        assert all(torch.equal(x, y) for x, y in zip(vars(sa).values(), vars(sb).values()))
    for k, (a, b) in enumerate(zip(logits_a, logits_b)):  # every position that can be scored
        torch.testing.assert_close(a[:, : 10 - 2 - k], b[:, : 10 - 2 - k], rtol=0, atol=0)


@torch.no_grad()
def test_override_step0_equals_manual_computation():
    draft = tiny_vl_draft()
    batch = vl_batch(draft)
    plain = {k: v for k, v in batch.items() if not k.startswith("embed_override")}
    loss, stats, logits, teacher = run_ttt(draft, batch)
    assert not torch.allclose(loss, run_ttt(draft, plain)[0])

    ids, pos = batch["input_ids"], batch["position_ids"]
    embeds = merged_embeddings(draft, batch)[:, 1:]  # the draft at t consumes token t+1
    n = ids.shape[1] - 1
    _, manual, _ = draft.step(ids[:, 1:], draft.project(batch["aux"][:, :n]), pos[..., :n], input_embeds=embeds)
    torch.testing.assert_close(logits[0][:, :n], manual, rtol=1e-5, atol=1e-5)

    probs, in_vocab = teacher.probs(batch["last"]), teacher.in_vocab(batch["last"])
    valid = shift(batch["loss_mask"], 2, False) & shift(in_vocab, 1, False)
    per_pos = -(probs[:, 1:] * F.log_softmax(manual.float(), -1)).sum(-1)
    torch.testing.assert_close(stats[0].loss_sum, (per_pos * valid[:, :n]).sum(), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_override_ttt_unroll_equals_chained_drafting_with_mrope_positions():
    """Every TTT step k at position t = the k-th chained draft step after prefix 0..t, with
    3-D positions + k and the merged embedding of the token it consumes."""
    draft = tiny_vl_draft()
    batch = vl_batch(draft)
    steps = 3
    _, _, batched, _ = run_ttt(draft, batch, steps)
    ids, pos, emb = batch["input_ids"], batch["position_ids"], merged_embeddings(draft, batch)
    for t in range(0, 10 - steps - 1):
        feat = draft.project(batch["aux"][:, : t + 1])
        out, logits, (k, v) = draft.step(ids[:, 1 : t + 2], feat, pos[..., : t + 1],
                                         input_embeds=emb[:, 1 : t + 2])
        torch.testing.assert_close(batched[0][:, t], logits[:, t], atol=1e-5, rtol=1e-4)
        feat = out[:, t : t + 1]
        for j in range(1, steps):
            a = t + 1 + j
            out, logits, (nk, nv) = draft.step(ids[:, a : a + 1], feat, pos[..., t : t + 1] + j,
                                               past_kv=(k, v), input_embeds=emb[:, a : a + 1])
            k, v = torch.cat([k, nk], 2), torch.cat([v, nv], 2)
            torch.testing.assert_close(batched[j][:, t], logits[:, 0], atol=1e-5, rtol=1e-4)
            feat = out
