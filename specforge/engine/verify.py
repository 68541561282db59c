"""Tree verification (docs/contract.md §5): the greedy walk and SGLang's target-only sampling walk.

Both return the accepted path as node indices (root first) and the tokens to emit: the accepted
drafts followed by one token from the target at the last accepted node (the bonus). The accept
length of the round is `len(emitted)` = accepted drafts + 1.
"""
from __future__ import annotations

import torch

from specforge.engine.tree import Tree


def greedy_verify(tree: Tree, logits: torch.Tensor):
    """Walk from the root to the child whose token is the target's argmax, as long as one matches.

    Vectorised: a node is on the walk iff every node on its root path matches the argmax at its
    parent. Siblings carry distinct tokens, so those nodes form one chain; the deepest is the end.
    `logits` [N, V] are the target's at the tree nodes. Returns (path [a+1], emitted [a+1]).
    """
    return greedy_walk(tree, logits.argmax(dim=-1))


def greedy_walk(tree: Tree, pred: torch.Tensor):
    """`greedy_verify` given the target's argmax token at each node, `pred` [N] (the planner,
    specforge/eval/planner.py, reads it off a greedy trajectory instead of a verify forward)."""
    ok = tree.tokens == pred[tree.parent.clamp(min=0)]
    ok[0] = True
    on_walk = ~(tree.mask & ~ok[None, :]).any(dim=1)
    last = torch.argmax(torch.where(on_walk, tree.depth, -1))
    path = tree.mask[last].nonzero().flatten()  # ancestors ascend with node index
    emitted = torch.cat([tree.tokens[path[1:]], pred[last].reshape(1)])
    return path, emitted


def sampling_verify(tree: Tree, probs: torch.Tensor, generator: torch.Generator | None = None):
    """SGLang's tree_speculative_sampling_target_only with thresholds 1 (exact sampling from q).

    At the current node one coin u ~ U[0,1) is drawn; its children are walked in order,
    accumulating their target mass q(c); the first child where u < cumulative mass is accepted
    (this is inverse-CDF sampling from q, restricted to the children). If none is, the bonus is
    drawn from q with the rejected children removed (relu(q - rejected), renormalised); after a
    leaf, straight from q. `probs` [N, V] are the target's sampling distributions at the nodes.
    """
    n = len(tree)
    coins = torch.rand(n + 1, generator=generator, device=probs.device).tolist()
    tokens = tree.tokens.tolist()
    first_child, next_sibling = tree.first_child.tolist(), tree.next_sibling.tolist()
    path, cur = [0], 0
    while True:
        children = []
        c = first_child[cur]
        while c != -1:
            children.append(c)
            c = next_sibling[c]
        if not children:
            rejected = []
            break
        child_tokens = torch.tensor([tokens[c] for c in children], device=probs.device)
        mass = probs[cur, child_tokens].cumsum(0)
        hit = int((mass <= coins[cur]).sum())  # first child whose cumulative mass exceeds u
        if hit == len(children):
            rejected = child_tokens
            break
        cur = children[hit]
        path.append(cur)
    q = probs[cur]
    if len(rejected):
        q = q.clone()
        q[rejected] = 0
        if float(q.sum()) <= 0:  # all mass was on the children; u fell in float rounding
            q = probs[cur]
    bonus = _sample_with_coin(q, coins[n])
    path_t = torch.tensor(path, device=probs.device)
    emitted = torch.cat([tree.tokens[path_t[1:]], bonus.reshape(1)])
    return path_t, emitted


def _sample_with_coin(weights: torch.Tensor, coin: float) -> torch.Tensor:
    """Inverse-CDF sample from unnormalised non-negative weights with a given uniform coin."""
    cdf = weights.double().cumsum(0)
    idx = torch.searchsorted(cdf, cdf[-1:] * coin, right=True)
    return idx.clamp(max=weights.shape[0] - 1).reshape(())


def target_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Sampling distribution of the target at temperature > 0 (fp32 softmax)."""
    return torch.softmax(logits.float() / temperature, dim=-1)
