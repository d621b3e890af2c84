"""Reference lattice ops (paper §3.2, §3.5, Appendix E): the single source of truth the Triton
kernels, the ONNX local functions and the TensorRT plugins in ``lilicorr.plugins`` must match.

Shapes: N = batch rows, S = B-1 drafted slots, K = candidates per slot, E = d_e.
Slot indexing: array slot j (0..S-1) is the paper's slot j+1; the anchor is the paper's slot 0.

    anchor_scores[n, k']       = sigma * <o_0[n],        i[n, 0, k']>          (Eq. 1, s = 0)
    pair_scores[n, j, k, k']   = sigma * <o[n, j, k],    i[n, j+1, k']>        (Eq. 1, s = j+1)
    greedy (Eq. 8):  c_0 = argmax_k anchor_scores[n, k],  c_{j+1} = argmax_k pair_scores[n, j, c_j, k]
    path score (Eq. 12): g(c) = anchor_scores[n, c_0] + sum_j pair_scores[n, j, c_j, c_{j+1}]
    draft tree (rule `tree`): best-first expansion of paths by their summed log-conditionals,
        log softmax_k anchor_scores (root) + sum_j log softmax_k' pair_scores[n, j, c_j, :] (Eq. 2)

The in/out vectors are unit norm (the head normalises them), so the cosine of Eq. 1 is a dot
product here; no renormalisation happens in these ops. Ties break to the lowest index
(torch.argmax semantics on CPU; Triton's tl.argmax(tie_break_left=True); ONNX ArgMax with
select_last_index=0).

Under ``torch.onnx.export(..., dynamo=True)``, ``match_scores``, ``greedy_walk`` and
``fused_match_walk`` emit the custom nodes ``lilicorr::LatticeMatch`` (2 outputs),
``lilicorr::GreedyWalk`` and ``lilicorr::LatticeMatchWalk``; ``lilicorr.plugins.onnx_functions``
adds ONNX local functions with the same semantics, and the TensorRT plugins of the same names
replace them in engines.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

import torch

__all__ = [
    "ONNX_DOMAIN",
    "PLUGIN_VERSION",
    "match_scores",
    "greedy_walk",
    "viterbi",
    "path_scores",
    "fused_match_walk",
    "brute_force_best_path",
    "DraftTree",
    "build_tree",
    "tree_attention",
]

ONNX_DOMAIN = "lilicorr"
PLUGIN_VERSION = "1"


def _in_onnx_export() -> bool:
    try:
        return bool(torch.onnx.is_in_onnx_export())
    except Exception:  # pragma: no cover - very old torch
        return False


def _plugin_attrs(sigma: float | None = None) -> dict:
    attrs: dict = {}
    if sigma is not None:
        attrs["sigma"] = float(sigma)
    attrs["plugin_namespace"] = ONNX_DOMAIN
    attrs["plugin_version"] = PLUGIN_VERSION
    return attrs


def _check_vectors(anchor_out: torch.Tensor, out_vec: torch.Tensor, in_vec: torch.Tensor) -> None:
    if anchor_out.dim() != 2 or out_vec.dim() != 4 or in_vec.dim() != 4:
        raise ValueError(
            f"expected anchor_out [N,E], out_vec/in_vec [N,S,K,E]; got {tuple(anchor_out.shape)}, "
            f"{tuple(out_vec.shape)}, {tuple(in_vec.shape)}")
    if out_vec.shape != in_vec.shape:
        raise ValueError(f"out_vec {tuple(out_vec.shape)} and in_vec {tuple(in_vec.shape)} differ")


def match_scores(anchor_out: torch.Tensor, out_vec: torch.Tensor, in_vec: torch.Tensor,
                 sigma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 1 for every adjacent slot pair.

    anchor_out [N, E], out_vec / in_vec [N, S, K, E]
    -> anchor_scores [N, K], pair_scores [N, S-1, K, K]
    """
    _check_vectors(anchor_out, out_vec, in_vec)
    n, s, k, _ = out_vec.shape
    if _in_onnx_export():
        anchor_scores, pair_scores = torch.onnx.ops.symbolic_multi_out(
            f"{ONNX_DOMAIN}::LatticeMatch",
            (anchor_out, out_vec, in_vec),
            _plugin_attrs(sigma),
            dtypes=(out_vec.dtype, out_vec.dtype),
            shapes=((n, k), (n, s - 1, k, k)),
            version=1,
        )
        return anchor_scores, pair_scores
    # [N, K, E] x [N, E] -> [N, K]
    anchor_scores = sigma * torch.einsum("nke,ne->nk", in_vec[:, 0], anchor_out)
    # [N, S-1, K, E] x [N, S-1, E, K] -> [N, S-1, K, K]
    pair_scores = sigma * torch.matmul(out_vec[:, :-1], in_vec[:, 1:].transpose(-1, -2))
    return anchor_scores, pair_scores


def greedy_walk(anchor_scores: torch.Tensor, pair_scores: torch.Tensor) -> torch.Tensor:
    """Eq. 8: commit left to right, each slot conditioned on the previous pick.

    anchor_scores [N, K], pair_scores [N, S-1, K, K] -> idx [N, S] long
    """
    if anchor_scores.dim() != 2 or pair_scores.dim() != 4:
        raise ValueError(f"expected [N,K] and [N,S-1,K,K]; got {tuple(anchor_scores.shape)}, "
                         f"{tuple(pair_scores.shape)}")
    n, s1 = pair_scores.shape[0], pair_scores.shape[1]
    if _in_onnx_export():
        return torch.onnx.ops.symbolic(
            f"{ONNX_DOMAIN}::GreedyWalk",
            (anchor_scores, pair_scores),
            _plugin_attrs(),
            dtype=torch.int64,
            shape=(n, s1 + 1),
            version=1,
        )
    c = anchor_scores.argmax(dim=-1)                                    # [N]
    picks = [c]
    rows = torch.arange(n, device=anchor_scores.device)
    for j in range(s1):
        c = pair_scores[rows, j, c].argmax(dim=-1)                      # [N, K] -> [N]
        picks.append(c)
    return torch.stack(picks, dim=1)                                    # [N, S]


def viterbi(anchor_scores: torch.Tensor, pair_scores: torch.Tensor) -> torch.Tensor:
    """Appendix E: exact argmax over paths of the Eq. 12 score, O(S K^2).

    anchor_scores [N, K], pair_scores [N, S-1, K, K] -> idx [N, S] long
    Ties: lowest predecessor index at each step, lowest final index.
    """
    n, s1 = pair_scores.shape[0], pair_scores.shape[1]
    delta = anchor_scores                                               # [N, K] best score ending at k
    back = []
    for j in range(s1):
        cand = delta.unsqueeze(-1) + pair_scores[:, j]                  # [N, K(prev), K(next)]
        delta, arg = cand.max(dim=1)                                    # [N, K], [N, K]
        back.append(arg)
    c = delta.argmax(dim=-1)                                            # [N]
    picks = [c]
    rows = torch.arange(n, device=anchor_scores.device)
    for arg in reversed(back):
        c = arg[rows, c]
        picks.append(c)
    picks.reverse()
    return torch.stack(picks, dim=1)                                    # [N, S]


def path_scores(anchor_scores: torch.Tensor, pair_scores: torch.Tensor,
                idx: torch.Tensor) -> torch.Tensor:
    """Eq. 12 score of the given paths. idx [N, S] long -> [N]."""
    n, s1 = pair_scores.shape[0], pair_scores.shape[1]
    rows = torch.arange(n, device=anchor_scores.device)
    g = anchor_scores[rows, idx[:, 0]]                                  # [N]
    for j in range(s1):
        g = g + pair_scores[rows, j, idx[:, j], idx[:, j + 1]]
    return g


def fused_match_walk(anchor_out: torch.Tensor, out_vec: torch.Tensor, in_vec: torch.Tensor,
                     sigma: float) -> torch.Tensor:
    """greedy_walk(*match_scores(...)) without building the K x K tables: per slot only the row
    of the committed candidate, sigma * o[n, j, c_j] . i[n, j+1, :], is computed.

    anchor_out [N, E], out_vec / in_vec [N, S, K, E] -> idx [N, S] long
    """
    _check_vectors(anchor_out, out_vec, in_vec)
    n, s, _, _ = out_vec.shape
    if _in_onnx_export():
        return torch.onnx.ops.symbolic(
            f"{ONNX_DOMAIN}::LatticeMatchWalk",
            (anchor_out, out_vec, in_vec),
            _plugin_attrs(sigma),
            dtype=torch.int64,
            shape=(n, s),
            version=1,
        )
    rows = torch.arange(n, device=out_vec.device)
    z = sigma * torch.einsum("nke,ne->nk", in_vec[:, 0], anchor_out)   # [N, K]
    c = z.argmax(dim=-1)                                                # [N]
    picks = [c]
    for j in range(s - 1):
        o = out_vec[rows, j, c]                                         # [N, E]
        z = sigma * torch.einsum("nke,ne->nk", in_vec[:, j + 1], o)     # [N, K]
        c = z.argmax(dim=-1)
        picks.append(c)
    return torch.stack(picks, dim=1)                                    # [N, S]


def brute_force_best_path(anchor_scores: torch.Tensor, pair_scores: torch.Tensor) -> torch.Tensor:
    """Enumerates all K^S paths (tests only; tiny S, K). -> idx [N, S] long (first best in
    lexicographic order)."""
    n, k = anchor_scores.shape
    s = pair_scores.shape[1] + 1
    paths = torch.tensor(list(itertools.product(range(k), repeat=s)), dtype=torch.long)  # [P, S]
    best = []
    for r in range(n):
        g = anchor_scores[r, paths[:, 0]].clone()
        for j in range(s - 1):
            g += pair_scores[r, j, paths[:, j], paths[:, j + 1]]
        best.append(paths[int(torch.argmax(g))])
    return torch.stack(best, dim=0)


# ---------------------------------------------------------------------------------- draft trees
@dataclass
class DraftTree:
    """M nodes per row, in expansion order (a parent always precedes its children).

    parent [N, M] long: the parent node, -1 for a child of the anchor (the root)
    depth  [N, M] long: the node's slot (0 = the first drafted slot)
    cand   [N, M] long: the node's candidate index in its slot's pool
    score  [N, M] float: the summed log-conditionals of the path from the root to the node
    """

    parent: torch.Tensor
    depth: torch.Tensor
    cand: torch.Tensor
    score: torch.Tensor

    def tokens(self, cand_ids: torch.Tensor) -> torch.Tensor:
        """cand_ids [N, S, K] -> the node tokens [N, M]."""
        rows = torch.arange(cand_ids.shape[0], device=cand_ids.device)[:, None]
        return cand_ids[rows, self.depth.to(cand_ids.device), self.cand.to(cand_ids.device)]


def build_tree(anchor_scores: torch.Tensor, pair_scores: torch.Tensor, num_nodes: int) -> DraftTree:
    """Best-first draft tree from the lattice (rule `tree`).

    anchor_scores [N, K], pair_scores [N, S-1, K, K] -> DraftTree of M = min(num_nodes, sum_j K^j)
    nodes per row. The root's children are the K anchor candidates with log-conditionals
    log softmax(anchor_scores); a node at slot j holding candidate k has the K children at slot j+1
    with log softmax(pair_scores[j, k, :]) (the locally normalised Eq. 2 scores the walk uses).
    Repeatedly the frontier node with the highest path score joins the tree and its children join
    the frontier. Ties go to the node that joined the frontier first (the root's children and each
    node's children enter in candidate order), so the tree is deterministic. Row by row on the
    host: M and K are small and the heap is sequential.
    """
    if anchor_scores.dim() != 2 or pair_scores.dim() != 4:
        raise ValueError(f"expected [N,K] and [N,S-1,K,K]; got {tuple(anchor_scores.shape)}, "
                         f"{tuple(pair_scores.shape)}")
    if num_nodes < 1:
        raise ValueError(f"a draft tree needs at least one node, got {num_nodes}")
    n, k = anchor_scores.shape
    s = pair_scores.shape[1] + 1
    m = min(num_nodes, sum(k ** (j + 1) for j in range(s)))
    root = torch.log_softmax(anchor_scores.detach().float().cpu(), -1).tolist()           # [N][K]
    cond = torch.log_softmax(pair_scores.detach().float().cpu(), -1).tolist()             # [N][S-1][K][K]
    parent, depth, cand, score = ([[0] * m for _ in range(n)] for _ in range(4))
    for r in range(n):
        order = itertools.count()
        frontier = [(-root[r][c], next(order), -1, 0, c) for c in range(k)]   # (-score, tie, parent, depth, cand)
        heapq.heapify(frontier)
        for node in range(m):
            neg, _, par, d, c = heapq.heappop(frontier)
            parent[r][node], depth[r][node], cand[r][node], score[r][node] = par, d, c, -neg
            if d + 1 < s:
                row = cond[r][d][c]
                for c2 in range(k):
                    heapq.heappush(frontier, (neg - row[c2], next(order), node, d + 1, c2))
    as_long = lambda x: torch.tensor(x, dtype=torch.long).view(n, m)  # noqa: E731
    return DraftTree(as_long(parent), as_long(depth), as_long(cand),
                     torch.tensor(score, dtype=torch.float32).view(n, m))


def tree_attention(parent: torch.Tensor) -> torch.Tensor:
    """parent [N, M] -> visible [N, 1+M, 1+M] bool over (anchor, nodes): position 0 is the anchor,
    node i is position i+1; a position sees itself, the anchor and its ancestors."""
    n, m = parent.shape
    vis = torch.zeros(n, m + 1, m + 1, dtype=torch.bool)
    vis[:, :, 0] = True
    vis[:, 0, 0] = True
    par = parent.cpu()
    for i in range(m):                      # parents precede children: their rows are final
        p = par[:, i] + 1                                                   # [N] position of the parent
        vis[:, i + 1] = vis[torch.arange(n), p]
        vis[:, i + 1, i + 1] = True
    return vis
