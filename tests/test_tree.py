"""The SGLang tree construction (docs/contract.md §5) on hand-worked examples."""
import pytest
import torch

from specforge.engine.tree import (
    build_tree,
    choose,
    first_level,
    lane_attention_mask,
    next_level,
)
from specforge.engine.tree_spec import TreeSpec



def t(*xs, dtype=torch.float32):
    return torch.tensor(xs, dtype=dtype)


# ---- TreeSpec ---------------------------------------------------------------------------------


def test_parse_valid():
    spec = TreeSpec.parse("8_2_16")
    assert (spec.steps, spec.topk, spec.num_draft_tokens) == (8, 2, 16)
    assert str(spec) == "8_2_16" and spec.num_candidates == 2 + 7 * 4
    assert TreeSpec.parse("5_1_6").num_draft_tokens == 6
    assert TreeSpec.parse("2_2_7").num_candidates == 6  # exactly at the bound


@pytest.mark.parametrize(
    "text, message",
    [
        ("8_2", "T_K_N"),
        ("8-2-16", "T_K_N"),
        ("a_b_c", "T_K_N"),
        ("", "T_K_N"),
        ("0_1_1", "steps"),
        ("3_0_4", "topk"),
        ("3_1_5", "chain"),  # K=1 forces N=T+1
        ("3_1_3", "chain"),
        ("2_2_8", "candidates"),  # N-1=7 > K+(T-1)K^2=6
        ("1_4_6", "candidates"),  # one level holds K candidates only
        ("1_1_1", ">= 2"),
    ],
)
def test_parse_refuses(text, message):
    with pytest.raises(ValueError, match=message):
        TreeSpec.parse(text)


# ---- construction -----------------------------------------------------------------------------


def draft_rounds(level1, levels):
    """Feed (probs, tokens) per level through first_level/next_level like the engine does."""
    scores, s0, tok0, par0 = first_level(*level1)
    score_list, token_list, parents_list = [s0], [tok0], [par0]
    for i, (probs, tokens) in enumerate(levels, start=1):
        flat, flat_tok, scores, sel, parents = next_level(scores, probs, tokens, i)
        score_list.append(flat)
        token_list.append(flat_tok)
        parents_list.append(parents)
    return score_list, token_list, parents_list


def test_chain():
    spec = TreeSpec.parse("3_1_4")
    lists = draft_rounds((t(0.9), t(10, dtype=torch.long)),
                         [(t([0.5]), t([[20]], dtype=torch.long)), (t([0.8]), t([[30]], dtype=torch.long))])
    assert [p.tolist() for p in lists[2]] == [[-1, 0], [1], [2]]
    tree = build_tree(7, *lists, spec)
    assert tree.tokens.tolist() == [7, 10, 20, 30]
    assert tree.parent.tolist() == [-1, 0, 1, 2]
    assert tree.depth.tolist() == [0, 1, 2, 3]
    assert tree.positions(100).tolist() == [100, 101, 102, 103]
    assert torch.equal(tree.mask, torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    assert tree.first_child.tolist() == [1, 2, 3, -1]
    assert tree.next_sibling.tolist() == [-1, -1, -1, -1]


# The K=2, T=3 example worked by hand:
#   level 1: probs [.6, .4] tokens [10, 11]                      candidates 0, 1
#   step 1:  lane 10 -> [.5 .3] tokens [20 21]; lane 11 -> [.9 .05] tokens [22 23]
#            flat [.30 .18 .36 .02] (candidates 2..5); beams: sel [2, 0] -> 22 (lane 1), 20 (lane 0)
#   step 2:  lane 22 -> [.5 .4] tokens [30 31]; lane 20 -> [.9 .1] tokens [32 33]
#            flat [.18 .144 .27 .03] (candidates 6..9)
#   parents_list: [-1, 0, 1], [2+2, 0+2] = [4, 2], ...
K2_LEVELS = (
    (t(0.6, 0.4), t(10, 11, dtype=torch.long)),
    [
        (t([0.5, 0.3], [0.9, 0.05]), t([20, 21], [22, 23], dtype=torch.long)),
        (t([0.5, 0.4], [0.9, 0.1]), t([30, 31], [32, 33], dtype=torch.long)),
    ],
)


def test_k2_beams_and_parents_list():
    scores, token_list, parents_list = draft_rounds(*K2_LEVELS)
    assert torch.allclose(torch.cat(scores), t(.6, .4, .30, .18, .36, .02, .18, .144, .27, .03))
    assert torch.cat(token_list).tolist() == [10, 11, 20, 21, 22, 23, 30, 31, 32, 33]
    assert parents_list[0].tolist() == [-1, 0, 1]
    assert parents_list[1].tolist() == [4, 2]  # beams 22 (candidate 4) then 20 (candidate 2)


def test_wide_topk_crowds_out_depth():
    """N=4 with T=3: the best 3 of all candidates are .6, .4 (level 1) and .36 (level 2); the
    tree is only two levels deep although three were drafted."""
    tree = build_tree(5, *draft_rounds(*K2_LEVELS), TreeSpec.parse("3_2_4"))
    assert tree.candidates.tolist() == [0, 1, 4]
    assert tree.tokens.tolist() == [5, 10, 11, 22]
    assert tree.parent.tolist() == [-1, 0, 0, 2]
    assert tree.depth.tolist() == [0, 1, 1, 2]


def test_parent_resolution_through_reordered_beams():
    """N=6: the top 5 are candidates 0 (.6), 1 (.4), 4 (.36), 2 (.30), 8 (.27). Candidate 8 is
    the first child of lane 1 at step 2, which holds beam 20 (candidate 2, node 3), not lane 1's
    step-1 beam 11."""
    tree = build_tree(5, *draft_rounds(*K2_LEVELS), TreeSpec.parse("3_2_6"))
    assert tree.candidates.tolist() == [0, 1, 2, 4, 8]
    assert tree.tokens.tolist() == [5, 10, 11, 20, 22, 32]
    assert tree.parent.tolist() == [-1, 0, 0, 1, 2, 3]
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 3]
    assert tree.positions(7).tolist() == [7, 8, 8, 9, 9, 10]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 0],
            [1, 0, 1, 0, 1, 0],
            [1, 1, 0, 1, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(tree.mask, expected)
    # Retrieve links: root's children 1 then 2 (descending probability), 1 -> 3, 2 -> 4, 3 -> 5.
    assert tree.first_child.tolist() == [1, 3, 4, 5, -1, -1]
    assert tree.next_sibling.tolist() == [-1, 2, -1, -1, -1, -1]


def test_all_candidates_siblings_in_probability_order():
    """N-1 = all 10 candidates: the full tree; siblings follow node index = descending probability."""
    tree = build_tree(5, *draft_rounds(*K2_LEVELS), TreeSpec.parse("3_2_11"))
    assert tree.tokens.tolist() == [5, 10, 11, 20, 21, 22, 23, 30, 31, 32, 33]
    assert tree.parent.tolist() == [-1, 0, 0, 1, 1, 2, 2, 5, 5, 3, 3]
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    assert tree.first_child.tolist() == [1, 3, 5, 9, -1, 7, -1, -1, -1, -1, -1]
    assert tree.next_sibling.tolist() == [-1, 2, -1, 4, -1, 6, -1, 8, -1, 10, -1]
    # Every row of the mask is exactly the root path of its node.
    for j in range(len(tree)):
        path, cur = {j}, j
        while cur > 0:
            cur = int(tree.parent[cur])
            path.add(cur)
        assert set(tree.mask[j].nonzero().flatten().tolist()) == path


def test_ties_keep_the_parent():
    """A child with draft probability exactly 1.0 ties its parent; the parent must be chosen first."""
    scores = t(0.5, 0.5, 0.5, 0.0, 0.5, 0.0)  # both beams' first children have p = 1.0
    assert choose(scores, 4).tolist() == [0, 1, 2]
    assert choose(scores, 3).tolist() == [0, 1]


def test_lane_attention_masks():
    """SGLang lanes keep their own keys; exact mode follows the beams' ancestry."""
    k = 3
    step1 = lane_attention_mask(None, None, k, exact=False)
    assert step1.shape == (3, 0)
    parent_lane = torch.tensor([2, 0, 2])  # new beams came from lanes 2, 0, 2
    sglang2 = lane_attention_mask(step1, parent_lane, k, exact=False)
    exact2 = lane_attention_mask(step1, parent_lane, k, exact=True)
    assert torch.equal(sglang2, torch.eye(3, dtype=torch.bool))
    assert exact2.int().tolist() == [[0, 0, 1], [1, 0, 0], [0, 0, 1]]
    parent_lane = torch.tensor([1, 1, 0])
    sglang3 = lane_attention_mask(sglang2, parent_lane, k, exact=False)
    exact3 = lane_attention_mask(exact2, parent_lane, k, exact=True)
    assert sglang3.int().tolist() == [[1, 0, 0, 1, 0, 0], [0, 1, 0, 0, 1, 0], [0, 0, 1, 0, 0, 1]]
    # Beams 0, 1 descend from step-2 lane 1 (child of step-1 lane 0); beam 2 from step-2 lane 0
    # (child of step-1 lane 2).
    assert exact3.int().tolist() == [[1, 0, 0, 0, 1, 0], [1, 0, 0, 0, 1, 0], [0, 0, 1, 1, 0, 0]]
