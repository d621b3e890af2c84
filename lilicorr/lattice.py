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

Under ``torch.onnx.export(..., dynamo=True)``, ``match_scores``, ``greedy_walk``,
``fused_match_walk`` and ``build_tree`` emit the custom nodes ``lilicorr::LatticeMatch`` (2 outputs),
``lilicorr::GreedyWalk``, ``lilicorr::LatticeMatchWalk`` and ``lilicorr::DraftTree`` (4 outputs); ``lilicorr.plugins.onnx_functions``
adds ONNX local functions with the same semantics, and the TensorRT plugins of the same names
replace them in engines.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from lilicorr.config import DEFAULT_TREE_NODES

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
    "DEFAULT_TREE_NODES",
    "tree_size",
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


def tree_size(k: int, num_slots: int) -> int:
    """Number of paths of a K-candidate lattice over S slots: sum_j K^j, j = 1..S."""
    return sum(k ** (j + 1) for j in range(num_slots))


def _best_first(x: torch.Tensor, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, P] -> (values, indices) [N, w] of the w largest, best first, ties to the lower index
    (a stable sort: torch.topk does not promise an order among equal values; ONNX TopK does)."""
    v, i = torch.sort(x, dim=-1, descending=True, stable=True)
    return v[:, :w], i[:, :w]


def build_tree(anchor_scores: torch.Tensor, pair_scores: torch.Tensor, num_nodes: int) -> DraftTree:
    """Best-first draft tree from the lattice (rule `tree`), op ``lilicorr::DraftTree``.

    anchor_scores [N, K], pair_scores [N, S-1, K, K] -> DraftTree of M = min(num_nodes, sum_j K^j)
    nodes per row. The root's children are the K anchor candidates with log-conditionals
    log softmax(anchor_scores); a node at slot j holding candidate k has the K children at slot j+1
    with log softmax(pair_scores[j, k, :]) (the locally normalised Eq. 2 scores the walk uses). The
    tree is the M paths with the highest summed log-conditionals, in best-first expansion order.

    Log-conditionals are <= 0, so a path never scores above its prefix: the best M paths are
    closed under prefixes and they are exactly what a best-first expansion reaches in M pops. They
    are computed by slot, with no heap: the best min(M, K^(j+1)) paths at slot j are the best among
    the children of the paths kept at slot j-1 (a path cut there has M better ones at its own slot,
    and so has every extension of it), and the tree is the best M of all kept paths. Order:
    score, then slot (a parent before its children on equal scores), then rank within the slot,
    where a slot ranks its paths by score, then parent rank, then candidate index. Device and
    dtype independent tensor ops; under ONNX export this is one ``lilicorr::DraftTree`` node
    (``lilicorr.plugins.onnx_functions.draft_tree_function`` has the same semantics).
    """
    if anchor_scores.dim() != 2 or pair_scores.dim() != 4:
        raise ValueError(f"expected [N,K] and [N,S-1,K,K]; got {tuple(anchor_scores.shape)}, "
                         f"{tuple(pair_scores.shape)}")
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise ValueError(f"a draft tree needs at least one node, got {num_nodes!r}")
    n, k = anchor_scores.shape
    s = pair_scores.shape[1] + 1
    m = min(num_nodes, tree_size(k, s))
    if _in_onnx_export():
        parent, depth, cand, score = torch.onnx.ops.symbolic_multi_out(
            f"{ONNX_DOMAIN}::DraftTree", (anchor_scores, pair_scores),
            {"num_nodes": int(num_nodes), **_plugin_attrs()},
            dtypes=(torch.int64, torch.int64, torch.int64, torch.float32),
            shapes=((n, m),) * 4, version=1)
        return DraftTree(parent, depth, cand, score)
    dev = anchor_scores.device
    rows = torch.arange(n, device=dev)[:, None]
    cond = torch.log_softmax(pair_scores.detach().float(), -1)                  # [N, S-1, K, K]
    val, c = _best_first(torch.log_softmax(anchor_scores.detach().float(), -1), min(m, k))   # [N, W0]
    vals, cands, depths = [val], [c], [torch.zeros_like(c)]
    parents = [torch.full_like(c, -1)]            # index of the parent among all kept paths, -1: root
    offset = 0
    for j in range(s - 1):
        w = val.shape[1]
        ext = val[:, :, None] + cond[rows, j, c]                                 # [N, W, K]
        val, flat = _best_first(ext.reshape(n, w * k), min(m, w * k))            # [N, W']
        c = flat % k
        parents.append(offset + flat // k)
        offset += w
        vals.append(val)
        cands.append(c)
        depths.append(torch.full_like(c, j + 1))
    score, depth, cand, par = (torch.cat(x, 1) for x in (vals, depths, cands, parents))  # [N, P]
    score, sel = _best_first(score, m)                                           # [N, M]
    node_of = torch.full_like(par, -1).scatter_(1, sel, torch.arange(m, device=dev).expand(n, m))
    par = par.gather(1, sel)                                                     # [N, M] kept-path index
    parent = torch.where(par >= 0, node_of.gather(1, par.clamp_min(0)), par)     # [N, M] node index
    return DraftTree(parent, depth.gather(1, sel), cand.gather(1, sel), score)


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
