"""Triton-language kernels vs the torch reference, on CPU through the Triton interpreter.

TRITON_INTERPRET must be set before triton is imported (it is read when @triton.jit runs).
The CUDA C++ greedy walk is compile-checked with nvcc where nvcc exists.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

import pathlib  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from lilicorr import lattice as L  # noqa: E402

pytest.importorskip("triton", reason="triton not installed (pip install 'lilicorr[kernels]')")
from lilicorr.plugins import triton_kernels as tk  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]

# (N, B, K, E): the paper's block (B=16, K=8, d_e=1024), non-power-of-two K and E, S = 1
SHAPES = [(1, 16, 8, 1024), (2, 16, 8, 1024), (3, 5, 5, 96), (2, 2, 3, 17), (2, 7, 6, 33),
          (1, 4, 12, 200)]


def vectors(N, B, K, E, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    S = B - 1
    f = lambda *s: torch.nn.functional.normalize(torch.randn(*s, generator=g), dim=-1).to(dtype)  # noqa: E731
    return f(N, E), f(N, S, K, E), f(N, S, K, E)


@pytest.mark.parametrize("N,B,K,E", SHAPES)
def test_lattice_match_kernel(N, B, K, E):
    a, o, i = vectors(N, B, K, E, seed=N * 1000 + K)
    ra, rp = L.match_scores(a, o, i, 10.0)
    ka, kp = tk.lattice_match(a, o, i, 10.0)
    assert ka.shape == ra.shape and kp.shape == rp.shape and ka.dtype == ra.dtype
    torch.testing.assert_close(ka, ra, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kp, rp, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("N,B,K,E", SHAPES)
def test_greedy_walk_kernel(N, B, K, E):
    a, o, i = vectors(N, B, K, E, seed=7 + K)
    sa, sp = L.match_scores(a, o, i, 10.0)
    got = tk.greedy_walk(sa, sp)
    assert got.dtype == torch.int64 and got.shape == (N, B - 1)
    assert torch.equal(got, L.greedy_walk(sa, sp))


@pytest.mark.parametrize("N,B,K,E", SHAPES)
def test_fused_match_walk_kernel(N, B, K, E):
    a, o, i = vectors(N, B, K, E, seed=11 + E)
    ref = L.greedy_walk(*L.match_scores(a, o, i, 10.0))
    assert torch.equal(tk.fused_match_walk(a, o, i, 10.0), ref)
    assert torch.equal(L.fused_match_walk(a, o, i, 10.0), ref)


def test_greedy_walk_kernel_random_scores_and_ties():
    g = torch.Generator().manual_seed(5)
    for N, S, K in [(3, 6, 5), (2, 15, 8), (1, 1, 7)]:
        a = torch.randn(N, K, generator=g)
        p = torch.randn(N, S - 1, K, K, generator=g)
        assert torch.equal(tk.greedy_walk(a, p), L.greedy_walk(a, p))
    a = torch.tensor([[0.5, 2.0, 2.0, 1.0]])
    p = torch.zeros(1, 2, 4, 4)
    p[0, 0, 1] = torch.tensor([3.0, 1.0, 3.0, 3.0])
    assert tk.greedy_walk(a, p).tolist() == [[1, 0, 0]] == L.greedy_walk(a, p).tolist()
    zero_a, zero_v = torch.zeros(2, 9), torch.zeros(2, 4, 5, 9)
    assert tk.fused_match_walk(zero_a, zero_v, zero_v, 10.0).eq(0).all()


def test_kernels_negative_sigma_and_block_e_override():
    a, o, i = vectors(2, 6, 5, 96, seed=3)
    ra, rp = L.match_scores(a, o, i, -2.5)
    ka, kp = tk.lattice_match(a, o, i, -2.5, block_e=16)
    torch.testing.assert_close(kp, rp, atol=1e-5, rtol=1e-5)
    assert torch.equal(tk.fused_match_walk(a, o, i, -2.5, block_e=32), L.greedy_walk(ra, rp))


def test_kernels_write_into_given_outputs():
    a, o, i = vectors(2, 5, 5, 96, seed=4)
    sa = torch.full((2, 5), float("nan"))
    sp = torch.full((2, 3, 5, 5), float("nan"))
    tk.lattice_match(a, o, i, 10.0, anchor_scores=sa, pair_scores=sp)
    ra, rp = L.match_scores(a, o, i, 10.0)
    torch.testing.assert_close(sp, rp, atol=1e-5, rtol=1e-5)
    idx = torch.full((2, 4), -1, dtype=torch.int64)
    tk.greedy_walk(sa, sp, idx=idx)
    assert torch.equal(idx, L.greedy_walk(ra, rp))


def test_fp16_inputs():
    a, o, i = vectors(2, 5, 5, 96, seed=9, dtype=torch.float16)
    ra, rp = L.match_scores(a.float(), o.float(), i.float(), 10.0)
    ka, kp = tk.lattice_match(a, o, i, 10.0)
    assert ka.dtype == torch.float16
    torch.testing.assert_close(kp.float(), rp, atol=2e-2, rtol=1e-2)
    assert torch.equal(tk.greedy_walk(ka, kp), L.greedy_walk(ka.float(), kp.float()))


CU_FILES = sorted((ROOT / "plugins").rglob("*.cu"))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH: cannot compile-check the .cu files")
@pytest.mark.parametrize("cu", CU_FILES, ids=[p.name for p in CU_FILES])
def test_cuda_sources_compile_for_sm90(cu, tmp_path):
    r = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-c", str(cu), "-o", str(tmp_path / "k.o")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "k.o").stat().st_size > 0


@pytest.mark.parametrize("N,K,S,M", [(2, 8, 7, 16), (3, 2, 3, 100), (2, 5, 4, 1), (1, 3, 1, 5), (1, 6, 5, 37)])
def test_draft_tree_kernel(N, K, S, M):
    """The tree kernel equals lattice.build_tree node for node, ties included."""
    g = torch.Generator().manual_seed(N * 100 + K * 10 + M)
    a, p = 3 * torch.randn(N, K, generator=g), 3 * torch.randn(N, S - 1, K, K, generator=g)
    for a_, p_ in [(a, p), (torch.zeros_like(a), torch.zeros_like(p)), (a.round(), p.round().clamp(-1, 1))]:
        ref = L.build_tree(a_, p_, M)
        got = tk.draft_tree(a_, p_, M)
        for name, x, y in zip(("parent", "depth", "cand"), got[:3], (ref.parent, ref.depth, ref.cand)):
            assert torch.equal(x, y), name
        torch.testing.assert_close(got[3], ref.score, atol=1e-5, rtol=1e-5)
