"""The draft tree, built exactly as SGLang builds it (docs/contract.md §5); the one tree builder of the project.

A round drafts T levels. Level 1 is the top-K of the draft's last distribution; each later level
expands K beams (lanes) into K*K children scored by path probability (product of the draft
probabilities) and keeps the best K as the next beams. Every child of every expanded beam is a
candidate: the tree is the global top-(N-1) of all `K + (T-1)*K*K` candidates, so the tree shape is
set by the scores, not by K ("topk is not the tree width").

Candidate indices follow SGLang's flat score list: level 1 is [0, K); level d >= 2 is
[K + (d-2)*K*K, K + (d-1)*K*K), ordered by (parent lane, child rank). `parents` (SGLang's
`parents_list`) maps a lane to the candidate index of the beam it expands. Nodes of the tree are
the root (node 0, the last accepted token) followed by the chosen candidates in ascending candidate
index, so a parent always has a smaller node index than its children and siblings are ordered by
descending draft probability.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specforge.engine.tree_spec import TreeSpec  # noqa: F401  (re-exported: `from specforge.engine.tree import TreeSpec`)


@dataclass
class Tree:
    """The N verify nodes. Node 0 is the root; `parent[0] = -1`."""

    tokens: torch.Tensor  # [N] target ids
    parent: torch.Tensor  # [N]
    depth: torch.Tensor  # [N], root 0
    mask: torch.Tensor  # [N, N] bool: ancestors + self
    first_child: torch.Tensor  # [N], -1 when a leaf (SGLang's retrieve_next_token)
    next_sibling: torch.Tensor  # [N], -1 when last (SGLang's retrieve_next_sibling)
    candidates: torch.Tensor  # [N-1] the chosen candidate indices, ascending
    scores: torch.Tensor  # [N-1] their path probabilities under the draft

    def positions(self, prefix_len: int) -> torch.Tensor:
        """Verify positions: S + depth, the root sitting at S."""
        return self.depth + prefix_len

    def __len__(self) -> int:
        return self.tokens.shape[0]


def first_level(probs: torch.Tensor, tokens: torch.Tensor):
    """Level 1 from the top-K (probs, target ids) [K] of the draft's last position.

    Returns the beam scores and the first entries of (score_list, token_list, parents_list).
    """
    k = probs.shape[-1]
    parents = torch.arange(-1, k, device=probs.device)
    return probs, probs, tokens, parents


def next_level(scores: torch.Tensor, probs: torch.Tensor, tokens: torch.Tensor, level: int):
    """Expand K beams by their children: scores [K], probs/tokens [K, K] (lane, child rank).

    `level` is the 0-based draft step i >= 1 (the children are at depth i+1). Returns the flat
    candidate scores and tokens [K*K], the new beam scores [K], the selected flat indices `sel`
    [K] (lane of the parent = sel // K) and the parents entry `sel + K + K*K*(i-1)`.
    """
    k = scores.shape[0]
    flat = (scores[:, None] * probs).reshape(-1)
    new_scores, sel = torch.topk(flat, k)
    return flat, tokens.reshape(-1), new_scores, sel, sel + k + k * k * (level - 1)


def choose(scores: torch.Tensor, num_draft_tokens: int) -> torch.Tensor:
    """Global top-(N-1) of all candidate scores (SGLang's flat score list), indices ascending.

    Ties prefer the lower index (a stable sort), so a child whose probability is exactly 1.0 can never
    be chosen without its parent (parent index < child index, parent score >= child score); SGLang
    leaves tie order to torch.topk.
    """
    order = torch.sort(scores, descending=True, stable=True).indices[: num_draft_tokens - 1]
    return torch.sort(order).values


def build_tree(root_token, score_list, token_list, parents_list, spec: TreeSpec) -> Tree:
    """SGLang's organize_draft_results + build_tree_kernel_efficient as tensor ops."""
    k, n = spec.topk, spec.num_draft_tokens
    all_scores = torch.cat(score_list)
    chosen = choose(all_scores, n)
    all_tokens = torch.cat(token_list)
    device = chosen.device
    root = torch.as_tensor(root_token, device=device, dtype=all_tokens.dtype).reshape(1)
    tokens = torch.cat([root, all_tokens[chosen]])

    # Parent: candidates of level 1 hang off the root; others through parents_list (lane -> beam).
    lane = chosen // k
    if len(parents_list) > 1:
        parent_list = torch.cat(parents_list[:-1])
        parent_cand = parent_list[lane]
        node = torch.searchsorted(chosen, parent_cand).clamp(max=n - 2)
        found = chosen[node] == parent_cand
        parent = torch.where(lane == 0, 0, torch.where(found, node + 1, -1))
    else:
        parent = torch.zeros_like(chosen)
    if bool((parent < 0).any()):
        raise RuntimeError(f"tree {spec}: a chosen draft token lost its parent (scores not monotone?)")
    parent = torch.cat([parent.new_full((1,), -1), parent])
    level = torch.where(chosen < k, 1, 2 + (chosen - k).clamp(min=0) // (k * k))
    depth = torch.cat([level.new_zeros(1), level])

    # Ancestors + self: walk every node up one parent at a time; T hops reach the root.
    mask = torch.eye(n, dtype=torch.bool, device=device)
    hop = parent.clamp(min=0)
    cur = torch.arange(n, device=device)
    rows = cur
    for _ in range(spec.steps):
        cur = hop[cur]
        mask[rows, cur] = True

    first_child, next_sibling = retrieve_links(parent)
    return Tree(tokens, parent, depth, mask, first_child, next_sibling, chosen, all_scores[chosen])


def retrieve_links(parent: torch.Tensor):
    """First child and next sibling per node (children ordered by node index), -1 when none."""
    n = parent.shape[0]
    idx = torch.arange(n, device=parent.device)
    first_child = torch.full((n,), n, dtype=torch.long, device=parent.device)
    first_child.scatter_reduce_(0, parent[1:], idx[1:], reduce="amin")
    first_child[first_child == n] = -1
    order = torch.sort(parent[1:], stable=True).indices + 1  # children grouped by parent, by index
    same = parent[order[1:]] == parent[order[:-1]]
    next_sibling = torch.full((n,), -1, dtype=torch.long, device=parent.device)
    next_sibling[order[:-1]] = torch.where(same, order[1:], -1)
    return first_child, next_sibling


def lane_attention_mask(
    prev: torch.Tensor | None, parent_lane: torch.Tensor | None, k: int, exact: bool
) -> torch.Tensor:
    """Which earlier draft-step keys each lane sees: [K, (i-1)*K] for draft step i.

    SGLang (exact=False): a lane keeps its own keys of the earlier steps, whatever beam it holds
    now. Exact: a lane sees the keys of its beam's ancestors (the parent lane of the previous step
    and, recursively, that lane's ancestors). `prev` is the mask of the previous step, `parent_lane`
    [K] the lane each new beam came from; both None for step 1.
    """
    eye = torch.eye(k, dtype=torch.bool, device=None if prev is None else prev.device)
    if prev is None:
        return eye[:, :0]
    if not exact:
        return torch.cat([prev, eye], dim=1)
    eye = eye.to(parent_lane.device)
    return torch.cat([prev[parent_lane], eye[parent_lane]], dim=1)
