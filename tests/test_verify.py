"""Greedy walk and SGLang's sampling walk over a draft tree."""
import pytest
import torch

from specforge.engine.tree import build_tree
from specforge.engine.tree_spec import TreeSpec
from tests.test_tree import draft_rounds
from specforge.engine.verify import greedy_verify, sampling_verify

V = 100



def make_tree(spec, level1, levels, root=5):
    return build_tree(root, *draft_rounds(level1, levels), TreeSpec.parse(spec))


def hand_tree():
    """tokens [5, 10, 11, 20, 22, 32], parents [-1, 0, 0, 1, 2, 3] (see test_tree.py)."""
    f, i = torch.float32, torch.long
    return make_tree(
        "3_2_6",
        (torch.tensor([0.6, 0.4]), torch.tensor([10, 11])),
        [
            (torch.tensor([[0.5, 0.3], [0.9, 0.05]], dtype=f), torch.tensor([[20, 21], [22, 23]], dtype=i)),
            (torch.tensor([[0.5, 0.4], [0.9, 0.1]], dtype=f), torch.tensor([[30, 31], [32, 33]], dtype=i)),
        ],
    )


def logits_with_argmax(*argmax):
    logits = torch.randn(len(argmax), V, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 100.0
    return logits


@pytest.mark.parametrize(
    "argmax, path, emitted",
    [
        ((11, 0, 22, 0, 99, 0), [0, 2, 4], [11, 22, 99]),  # second branch, stops at a leaf
        ((10, 20, 0, 32, 0, 7), [0, 1, 3, 5], [10, 20, 32, 7]),  # full depth: T drafts + bonus
        ((12, 20, 22, 32, 0, 0), [0], [12]),  # nothing matches at the root
        # Node 4 (22) matches the argmax at node 2, but node 2 is not on the walk.
        ((10, 21, 22, 0, 0, 0), [0, 1], [10, 21]),
    ],
)
def test_greedy_walk(argmax, path, emitted):
    tree = hand_tree()
    assert tree.tokens.tolist() == [5, 10, 11, 20, 22, 32]
    got_path, got_emitted = greedy_verify(tree, logits_with_argmax(*argmax))
    assert got_path.tolist() == path
    assert got_emitted.tolist() == emitted


def test_sampling_with_one_hot_target_is_the_greedy_walk():
    tree = hand_tree()
    for argmax in [(11, 0, 22, 0, 99, 0), (10, 20, 0, 32, 0, 7), (12, 20, 22, 32, 0, 0)]:
        logits = logits_with_argmax(*argmax)
        probs = torch.nn.functional.one_hot(logits.argmax(-1), V).float()
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            path, emitted = sampling_verify(tree, probs, g)
            gpath, gemitted = greedy_verify(tree, logits)
            assert path.tolist() == gpath.tolist() and emitted.tolist() == gemitted.tolist()


def test_sampling_bonus_never_repeats_a_rejected_child():
    tree = hand_tree()
    probs = torch.full((6, V), 1.0 / V)
    g = torch.Generator().manual_seed(2)
    for _ in range(300):
        path, emitted = sampling_verify(tree, probs, g)
        last = int(path[-1])
        children = tree.tokens[tree.parent == last].tolist()
        assert int(emitted[-1]) not in children
        assert emitted.shape[0] == path.shape[0]


def tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


def test_sampling_preserves_the_target_distribution():
    """Vocab 5. Tree: root -> children 1, 3 (in that order); 1 -> 0, 2; 3 -> 4, 1. The first
    emitted token must be distributed as q(root); given that the first token is the child c, the
    second must be distributed as q(c). A bonus drawn from q without removing the rejected
    children, or an independent coin per child, moves these by far more than the bound."""
    vocab, trials = 5, 20000
    tree = make_tree(
        "2_2_7",
        (torch.tensor([0.6, 0.4]), torch.tensor([1, 3])),
        [(torch.tensor([[0.7, 0.3], [0.6, 0.4]]), torch.tensor([[0, 2], [4, 1]]))],
        root=0,
    )
    assert tree.tokens.tolist() == [0, 1, 3, 0, 2, 4, 1]
    assert tree.parent.tolist() == [-1, 0, 0, 1, 1, 2, 2]
    q = torch.tensor(
        [
            [0.10, 0.30, 0.05, 0.35, 0.20],  # root: children 1, 3 hold 65% of the mass
            [0.40, 0.05, 0.25, 0.10, 0.20],  # node 1 (token 1)
            [0.15, 0.25, 0.30, 0.10, 0.20],  # node 2 (token 3)
            [0.2, 0.2, 0.2, 0.2, 0.2],
            [0.2, 0.2, 0.2, 0.2, 0.2],
            [0.2, 0.2, 0.2, 0.2, 0.2],
            [0.2, 0.2, 0.2, 0.2, 0.2],
        ]
    )
    g = torch.Generator().manual_seed(0)
    first = torch.zeros(vocab)
    second = {1: torch.zeros(vocab), 3: torch.zeros(vocab)}
    for _ in range(trials):
        _, emitted = sampling_verify(tree, q, g)
        e = emitted.tolist()
        first[e[0]] += 1
        if e[0] in second:
            assert len(e) >= 2  # the child was accepted, so its node emits the next token
            second[e[0]][e[1]] += 1
    assert tv(first, q[0]) < 0.015
    assert tv(second[1], q[1]) < 0.03
    assert tv(second[3], q[2]) < 0.03
