"""The embedded engine on a vision-language target: prompts with images, M-RoPE positions after
the prompt, and what the draft is fed at image positions."""
from __future__ import annotations

import pytest
import torch

from specforge.config import TargetConfig
from specforge.engine.speculative import SpeculativeEngine
from specforge.engine.tree import build_tree as planner_build
from specforge.models.draft import Eagle3Config, Eagle3Draft
from specforge.targets.loader import load_target, load_tokenizer
from specforge.data.vl_render import prompt_with_images
from specforge.targets.vl import load_image_processor, mm_token_type_ids, rope_positions, vl_info

AUX = [2, 3, 4]


@pytest.fixture(scope="module")
def setup(tiny_vl_dir, two_image_prompt):
    """(model, draft, prompt ids, images) with a two-image prompt; the draft is random."""
    cfg = TargetConfig(name="tiny-vl", path=str(tiny_vl_dir), kind="qwen3_vl", dtype="float32")
    model, tok = load_target(cfg, "cpu"), load_tokenizer(cfg)
    info = vl_info(model.config)
    paths, messages = two_image_prompt
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    ids, images = prompt_with_images(list(ids), paths, load_image_processor(tiny_vl_dir), info)
    torch.manual_seed(0)
    dcfg = Eagle3Config.from_target(model.config, AUX, draft_vocab_size=len(tok))
    draft = Eagle3Draft(dcfg)
    for p in draft.parameters():  # sharper than the default init: the draft proposes varied trees
        torch.nn.init.normal_(p, std=0.3)
    draft.embed_tokens.weight.data.copy_(model.get_input_embeddings().weight)
    return model, draft, torch.tensor(ids), images, info


@pytest.mark.parametrize("tree", ["3_1_4", "3_2_6", "4_3_8"])
def test_speculative_equals_plain_decoding_with_images(setup, tree):
    model, draft, ids, images, _ = setup
    base, _ = SpeculativeEngine(model, None, aux_layer_ids=AUX).generate_base(ids, 20, images=images)
    spec, stats = SpeculativeEngine(model, draft, tree).generate(ids, 20, images=images)
    assert spec.tolist() == base.tolist() and stats.spec_verify_ct > 0


def test_base_decoding_equals_transformers_generate(setup):
    """Positions after an image prompt (text index + rope delta, in all three components) are
    the ones transformers' own generate() uses: same greedy tokens."""
    model, _, ids, images, info = setup
    base, _ = SpeculativeEngine(model, None, aux_layer_ids=AUX).generate_base(ids, 20, images=images)
    with torch.no_grad():
        ref = model.generate(input_ids=ids[None], pixel_values=images["pixel_values"],
                             image_grid_thw=images["image_grid_thw"], mm_token_type_ids=mm_token_type_ids(ids[None], info),
                             max_new_tokens=20, min_new_tokens=20, do_sample=False)
    assert base.tolist() == ref[0, len(ids):].tolist()


@pytest.mark.parametrize("mode", ["merged", "token"])
def test_draft_prefill_sees_target_positions_and_configured_image_embeddings(setup, mode):
    model, draft, ids, images, info = setup
    draft.config.extra["image_embeddings"] = mode
    seen = []
    original = draft.step

    def spy(input_ids, feat, position_ids, past_kv=None, attn_mask=None, input_embeds=None):
        seen.append((input_ids, position_ids, input_embeds))
        return original(input_ids, feat, position_ids, past_kv, attn_mask, input_embeds)

    draft.step = spy
    try:
        SpeculativeEngine(model, draft, "3_1_4").generate(ids, 4, images=images)
    finally:
        del draft.step
        draft.config.extra.pop("image_embeddings")
    tokens, positions, embeds = seen[0]  # the draft's prefill over the prompt
    target_positions, delta = rope_positions(model, ids[None], images["image_grid_thw"])
    assert torch.equal(positions[0], target_positions[:, 0])  # slot p: the target's position of p
    at = tokens[0] == info.image_token_id
    assert int(at.sum()) == int((ids == info.image_token_id).sum())
    if mode == "token":
        assert embeds is None  # the draft embeds the placeholder token itself
        return
    with torch.no_grad():
        features = torch.cat(model.model.get_image_features(images["pixel_values"], images["image_grid_thw"]).pooler_output)
    torch.testing.assert_close(embeds[0][at], features)  # slot p reads token p+1's merged embedding
    torch.testing.assert_close(embeds[0][~at], draft.embed_tokens(tokens[0][~at]))
    # after the prompt, every draft position is text index + delta in all three components
    later = seen[1][1]
    assert later.dim() == 2 and int(later.min()) >= len(ids) + int(delta) - 1



def test_planner_replays_the_engine_on_image_prompts(setup, monkeypatch):
    """The planner on a vision-language target: per tree, the engine's output, accepted drafts and
    drafted tree tokens in every round (the random draft accepts little, so the trees themselves
    show that the draft saw the prompt's M-RoPE positions and image embeddings), with the
    trajectory decoded or from the engine (specforge/eval/planner.py)."""
    from specforge.eval import planner

    model, draft, ids, images, _ = setup
    trees = ["3_1_4", "3_2_6", "4_3_8"]
    prompts = [{"input_ids": ids.tolist(), "images": images}]
    built = []
    monkeypatch.setattr(planner, "build_tree", lambda *a: built.append(planner_build(*a)) or built[-1])
    for source in (None, "3_2_6"):
        for tree in trees:
            built.clear()
            got = planner.plan(model, draft, prompts, [tree], 20, trajectory_tree=source)[tree][0]
            engine = SpeculativeEngine(model, draft, tree)
            drafted = []
            draft_tree = engine.draft_tree
            engine.draft_tree = lambda root, state: drafted.append(draft_tree(root, state)) or drafted[-1]
            out, stats = engine.generate(ids, 20, images=images)
            assert got.tokens == out.tolist(), (tree, source)
            assert got.stats.accepted_drafts == stats.accepted_drafts, (tree, source)
            assert [t.tokens.tolist() for t in built] == [t.tokens.tolist() for t in drafted], (tree, source)


def test_cost_model_measures_on_a_vision_language_target(setup):
    from specforge.eval.cost_model import cost_key, measure

    model, draft, ids, _, _ = setup
    cost = measure(model, draft, {"input_ids": ids.tolist()}, cost_key("tiny-vl", draft, 40), ["3_1_4", "3_2_6"], repeats=1)
    assert cost.t_base > 0 and set(cost.t_verify) == {4, 6} and set(cost.t_step) == {1, 2}


def test_a_shared_prefix_is_refused(setup):
    """Its prompt's M-RoPE positions come from the whole prompt: no cached prefix (the evaluation
    shares none on a vision-language target)."""
    model, draft, ids, _, _ = setup
    with pytest.raises(ValueError, match="vision-language"):
        SpeculativeEngine(model, draft, "3_1_4").share_prefix(ids[:20])
