"""The training recipe's levers (docs/benchmarks.md, "Draft quality against speculators"): the lm_head
started from the target's, a loss target weighted towards the argmax, feature noise. Each is off by
default and, when on, does exactly what its config line says."""
import pytest
import torch

from specforge.config import DraftConfig
from specforge.train.loop import TTTModule, build_draft, noisy_features
from specforge.train.ttt import Teacher
from tests.test_eagle31 import compose_cfg, tiny_target_config, tiny_vocab
from tests.test_ttt import random_batch, tiny_draft


def test_lm_head_starts_as_the_targets_rows_of_the_draft_vocab():
    embed, head = torch.randn(50, 24), torch.randn(50, 24)
    vocab = tiny_vocab()
    draft = build_draft(compose_cfg("draft.lm_head_init=target"), tiny_target_config(), [0, 1, 2], vocab, embed, head)
    assert torch.equal(draft.lm_head.weight, head[vocab["t2d"]])
    assert draft.lm_head.weight.requires_grad  # a start, not frozen
    # draft id i is target id i + d2t[i]: the row it starts from is that token's row of the target's head
    ids = torch.arange(20) + vocab["d2t"]
    assert torch.equal(draft.lm_head.weight, head[ids])
    fresh = build_draft(compose_cfg("draft.lm_head_init=random"), tiny_target_config(), [0, 1, 2], vocab, embed, head)
    assert not torch.equal(fresh.lm_head.weight, head[vocab["t2d"]])
    assert DraftConfig().lm_head_init == "random"  # the default; the demo's exp chooses target
    with pytest.raises(ValueError, match="draft.lm_head_init=target: the target's lm_head is \\(50, 16\\)"):
        build_draft(compose_cfg("draft.lm_head_init=target"), tiny_target_config(), [0, 1, 2], vocab, embed,
                    torch.randn(50, 16))
    with pytest.raises(Exception, match="lm_head_init"):
        compose_cfg("draft.lm_head_init=embedding")


def test_hard_label_weight_mixes_the_target_distribution_with_its_argmax():
    draft = tiny_draft()
    weight, last = torch.randn(50, 24), torch.randn(2, 6, 24)
    soft = Teacher(weight, draft.t2d).probs(last)
    half = Teacher(weight, draft.t2d, hard_weight=0.5).probs(last)
    hard = Teacher(weight, draft.t2d, hard_weight=1.0).probs(last)
    one_hot = torch.nn.functional.one_hot(soft.argmax(-1), soft.shape[-1]).float()
    assert torch.equal(hard, one_hot)
    assert torch.allclose(half, 0.5 * soft + 0.5 * one_hot, atol=1e-7)
    assert torch.allclose(half.sum(-1), torch.ones(2, 6))
    assert torch.equal(Teacher(weight, draft.t2d, hard_weight=0.5).in_vocab(last), Teacher(weight, draft.t2d).in_vocab(last))
    assert torch.equal(half.argmax(-1), soft.argmax(-1))
    with pytest.raises(ValueError, match="train.hard_label_weight: 1.5"):
        Teacher(weight, draft.t2d, hard_weight=1.5)


def test_feature_noise_is_relative_per_state_and_only_in_training():
    aux = torch.cat([torch.randn(2, 6, 24), 100 * torch.randn(2, 6, 24), torch.randn(2, 6, 24)], dim=-1)
    torch.manual_seed(0)
    noisy = noisy_features(aux, 0.1)
    for part, before in zip(noisy.chunk(3, -1), aux.chunk(3, -1)):
        rms = before.pow(2).mean(-1, keepdim=True).sqrt()
        assert ((part - before).abs() <= 0.1 * rms + 1e-5).all() and not torch.equal(part, before)

    draft = tiny_draft()
    batch = random_batch(draft)
    teacher = Teacher(torch.randn(50, 24), draft.t2d)
    plain, noisy_module = TTTModule(draft, teacher, 2, 0.8), TTTModule(draft, teacher, 2, 0.8, feature_noise=0.1)
    noisy_module.train(False)
    assert torch.equal(noisy_module(batch)[0], plain(batch)[0])  # held-out metrics see the real states
    noisy_module.train(True)
    assert not torch.equal(noisy_module(batch)[0], plain(batch)[0])


def test_freeze_lm_head_keeps_the_targets_rows_through_a_training_step():
    embed, head = torch.randn(50, 24), torch.randn(50, 24)
    vocab = tiny_vocab()
    draft = build_draft(compose_cfg("draft.lm_head_init=target", "train.freeze_lm_head=true"), tiny_target_config(),
                        [0, 1, 2], vocab, embed, head)
    assert not draft.lm_head.weight.requires_grad
    start = draft.lm_head.weight.detach().clone()
    fc = draft.fc.weight.detach().clone()
    module = TTTModule(draft, Teacher(head, draft.t2d), 2, 0.8)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    loss, _ = module(random_batch(draft, seq=6))
    loss.backward()
    opt.step()
    assert torch.equal(draft.lm_head.weight, start) and draft.lm_head.weight.grad is None
    assert not torch.equal(draft.fc.weight, fc)  # the rest trains


@pytest.mark.parametrize("override", ["train.reach_weight=1.5", "train.hard_label_weight=-0.1"])
def test_loss_shares_outside_0_1_fail_before_any_stage_runs(tmp_path, override):
    from specforge.pipeline import run_pipeline

    with pytest.raises(ValueError, match=f"{override.split('=')[0]}: must lie in \\[0, 1\\], got "):
        run_pipeline(compose_cfg(override, f"output_dir={tmp_path}"))
    assert not any(tmp_path.iterdir())  # nothing ran, nothing was written


def test_layer_init_identity_starts_as_the_highest_target_state():
    """fc passes the highest captured state through and the layer adds nothing: the draft's first
    feature and output are that state (after the EAGLE 3.1 norms the exp turns on)."""
    embed, head = torch.randn(50, 24), torch.randn(50, 24)
    draft = build_draft(compose_cfg("draft.layer_init=identity"), tiny_target_config(), [0, 2, 1], tiny_vocab(),
                        embed, head)
    aux = torch.randn(1, 5, 72)
    top = aux[..., 24:48]  # aux_layer_ids [0, 2, 1]: the second state is the highest layer's
    feat = draft.project(aux)
    torch.testing.assert_close(feat, draft.fc_norm[1](top) if draft.fc_norm is not None else top)
    out, _, _ = draft.step(torch.randint(0, 50, (1, 5)), feat, torch.arange(5)[None])
    torch.testing.assert_close(out, draft.norm(feat) if draft.config.norm_output else feat)
    assert DraftConfig().layer_init == "random"
    with pytest.raises(ValueError, match="draft.hidden_size: the draft is 16 wide, the target 24"):
        build_draft(compose_cfg("draft.layer_init=identity", "draft.hidden_size=16", "draft.lm_head_init=random"),
                    tiny_target_config(), [0, 1, 2], tiny_vocab(), embed, head)
