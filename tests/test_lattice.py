"""Reference lattice ops (lilicorr.lattice): Eq. 1, 8, 12 against plain loops / brute force."""
import pytest
import torch

from lilicorr import lattice as L


def unit(*shape, gen=None):
    return torch.nn.functional.normalize(torch.randn(*shape, generator=gen), dim=-1)


def vectors(N, B, K, E, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = B - 1
    return unit(N, E, gen=g), unit(N, S, K, E, gen=g), unit(N, S, K, E, gen=g)


def loop_match(anchor, out_vec, in_vec, sigma):
    N, S, K, E = out_vec.shape
    a = torch.zeros(N, K)
    p = torch.zeros(N, S - 1, K, K)
    for n in range(N):
        for k2 in range(K):
            a[n, k2] = sigma * float(torch.dot(anchor[n].double(), in_vec[n, 0, k2].double()))
        for s in range(S - 1):
            for k in range(K):
                for k2 in range(K):
                    p[n, s, k, k2] = sigma * float(torch.dot(out_vec[n, s, k].double(),
                                                             in_vec[n, s + 1, k2].double()))
    return a, p


def first_argmax(values):
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def loop_greedy(anchor_scores, pair_scores):
    N = anchor_scores.shape[0]
    S = pair_scores.shape[1] + 1
    out = torch.zeros(N, S, dtype=torch.long)
    for n in range(N):
        c = first_argmax(anchor_scores[n].tolist())
        out[n, 0] = c
        for j in range(S - 1):
            c = first_argmax(pair_scores[n, j, c].tolist())
            out[n, j + 1] = c
    return out


@pytest.mark.parametrize("N,B,K,E", [(1, 4, 3, 8), (2, 5, 5, 96), (3, 2, 4, 7)])
def test_match_scores_matches_loops(N, B, K, E):
    a, o, i = vectors(N, B, K, E, seed=N + B)
    sa, sp = L.match_scores(a, o, i, 10.0)
    assert sa.shape == (N, K) and sp.shape == (N, B - 2, K, K)
    ra, rp = loop_match(a, o, i, 10.0)
    torch.testing.assert_close(sa, ra, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sp, rp, atol=1e-5, rtol=1e-5)


def test_match_scores_is_cosine_for_unit_vectors():
    a, o, i = vectors(2, 4, 3, 16, seed=3)
    sa, sp = L.match_scores(a, o, i, 7.0)
    assert sa.abs().max() <= 7.0 + 1e-5 and sp.abs().max() <= 7.0 + 1e-5
    cos = torch.nn.functional.cosine_similarity(o[:, 0, :, None, :], i[:, 1, None, :, :], dim=-1)
    torch.testing.assert_close(sp[:, 0], 7.0 * cos, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("N,S,K", [(3, 1, 4), (2, 6, 5), (4, 15, 8)])
def test_greedy_walk_matches_python_loop(seed, N, S, K):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(N, K, generator=g)
    p = torch.randn(N, S - 1, K, K, generator=g)
    assert torch.equal(L.greedy_walk(a, p), loop_greedy(a, p))


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("S,K", [(1, 3), (2, 2), (3, 4), (4, 3), (5, 3)])
def test_viterbi_matches_brute_force(seed, S, K):
    g = torch.Generator().manual_seed(100 * seed + 10 * S + K)
    N = 3
    a = torch.randn(N, K, generator=g)
    p = torch.randn(N, S - 1, K, K, generator=g)
    v = L.viterbi(a, p)
    bf = L.brute_force_best_path(a, p)
    assert v.shape == (N, S)
    torch.testing.assert_close(L.path_scores(a, p, v), L.path_scores(a, p, bf))
    assert torch.equal(v, bf)  # continuous random scores: the maximiser is unique
    assert (L.path_scores(a, p, v) >= L.path_scores(a, p, L.greedy_walk(a, p)) - 1e-6).all()


def test_path_scores_matches_manual_sum():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(2, 4, generator=g)
    p = torch.randn(2, 3, 4, 4, generator=g)
    idx = torch.tensor([[0, 1, 2, 3], [3, 3, 0, 1]])
    for n in range(2):
        ref = a[n, idx[n, 0]] + sum(p[n, j, idx[n, j], idx[n, j + 1]] for j in range(3))
        torch.testing.assert_close(L.path_scores(a, p, idx)[n], ref)


def test_greedy_can_lose_to_viterbi():
    # Appendix E: greedy commits the best first slot; the best chain sacrifices it.
    a = torch.tensor([[1.0, 0.9]])
    p = torch.tensor([[[[0.0, 0.0], [5.0, 0.0]]]])
    assert L.greedy_walk(a, p).tolist() == [[0, 0]]
    assert L.viterbi(a, p).tolist() == [[1, 0]]


def test_ties_break_to_lowest_index():
    a = torch.tensor([[0.5, 2.0, 2.0, 1.0]])
    p = torch.zeros(1, 2, 4, 4)
    p[0, 0, 1] = torch.tensor([3.0, 1.0, 3.0, 3.0])
    p[0, 1, 0] = torch.tensor([0.0, 0.0, 0.0, 0.0])
    assert L.greedy_walk(a, p).tolist() == [[1, 0, 0]]
    # all-equal lattice: every rule picks index 0 everywhere
    z = torch.zeros(2, 3)
    zp = torch.zeros(2, 4, 3, 3)
    assert L.greedy_walk(z, zp).eq(0).all() and L.viterbi(z, zp).eq(0).all()
    anchor = torch.zeros(2, 6)
    vec = torch.zeros(2, 5, 3, 6)
    assert L.fused_match_walk(anchor, vec, vec, 10.0).eq(0).all()


@pytest.mark.parametrize("N,B,K,E", [(1, 16, 8, 1024), (2, 16, 8, 1024), (3, 5, 5, 96),
                                     (2, 2, 3, 17), (4, 7, 6, 33)])
@pytest.mark.parametrize("sigma", [10.0, -3.0])
def test_fused_equals_unfused(N, B, K, E, sigma):
    a, o, i = vectors(N, B, K, E, seed=K + E)
    ref = L.greedy_walk(*L.match_scores(a, o, i, sigma))
    got = L.fused_match_walk(a, o, i, sigma)
    assert got.dtype == torch.long and got.shape == (N, B - 1)
    assert torch.equal(got, ref)


def test_shape_errors():
    with pytest.raises(ValueError):
        L.match_scores(torch.zeros(2, 4), torch.zeros(2, 3, 2, 4), torch.zeros(2, 3, 3, 4), 1.0)
    with pytest.raises(ValueError):
        L.greedy_walk(torch.zeros(2, 4), torch.zeros(2, 4, 4))
