"""Analytic kernel derivatives against autograd, and the bandwidth heuristics."""

import pytest
import torch

import kwng

KERNELS = [kwng.GaussianKernel(0.7), kwng.RationalQuadraticKernel(1.3, alpha=0.8)]


def _points(M=4, N=5, d=3, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M, d, generator=g, dtype=dtype), torch.randn(
        N, d, generator=g, dtype=dtype
    )


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_first_derivative_matches_autograd(kernel):
    Y, X = _points()
    Y.requires_grad_(True)
    gram = kernel(Y, X)
    auto = torch.stack([torch.autograd.grad(gram[:, n].sum(), Y, retain_graph=True)[0]
                        for n in range(X.shape[0])], dim=1)  # (M, N, d)
    torch.testing.assert_close(kernel.grad(Y.detach(), X), auto, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_mixed_derivative_matches_autograd(kernel):
    Y, X = _points(M=3, N=4, d=2)
    M, N, d = Y.shape[0], X.shape[0], Y.shape[1]
    expected = torch.zeros(M, N, d, d, dtype=torch.float64)
    for m in range(M):
        for n in range(N):
            def k_pair(y, x, m=m, n=n):
                return kernel(y[None], x[None])[0, 0]
            H = torch.autograd.functional.hessian(k_pair, (Y[m], X[n]))
            expected[m, n] = H[0][1]  # ∂_{y_i} ∂_{x_j}
    torch.testing.assert_close(kernel.mixed(Y, X), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_coordinate_versions_select_from_full(kernel):
    Y, X = _points()
    coords = torch.tensor([0, 2, 1, 2])
    full_g, full_m = kernel.grad(Y, X), kernel.mixed(Y, X)
    m = torch.arange(Y.shape[0])
    torch.testing.assert_close(kernel.grad_coord(Y, coords, X), full_g[m, :, coords])
    torch.testing.assert_close(
        kernel.mixed_coord(Y, coords, X), full_m[m, :, coords, :]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dtype_preserved(dtype):
    Y, X = _points(dtype=dtype)
    k = kwng.GaussianKernel(1.0)
    assert k.mixed_coord(Y, torch.zeros(4, dtype=torch.long), X).dtype == dtype


def test_rq_tends_to_gaussian_for_large_alpha():
    Y, X = _points()
    rq, ga = kwng.RationalQuadraticKernel(0.9, alpha=1e7), kwng.GaussianKernel(0.9)
    torch.testing.assert_close(rq.mixed(Y, X), ga.mixed(Y, X), rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_matches_cpu():
    Y, X = _points()
    k = kwng.GaussianKernel(1.0)
    torch.testing.assert_close(k.mixed(Y.cuda(), X.cuda()).cpu(), k.mixed(Y, X))


def test_bandwidth_heuristics():
    Y, X = _points(M=3, N=50)
    sq = ((Y[:, None] - X[None]) ** 2).sum(-1)
    assert kwng.mean_sq_bandwidth(X, Y, sigma0=2.0) == pytest.approx(
        2.0 * float(sq.mean())
    )
    assert kwng.median_bandwidth(X, Y) == pytest.approx(float(sq.flatten().median()))
    assert kwng.median_bandwidth(X) > 0


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_non_positive_bandwidth_rejected(bad):
    with pytest.raises(ValueError, match="bandwidth"):
        kwng.GaussianKernel(bad)
    with pytest.raises(ValueError, match="bandwidth"):
        kwng.RationalQuadraticKernel(bad)


def test_bad_coords_and_shapes_rejected():
    Y, X = _points()
    k = kwng.GaussianKernel(1.0)
    with pytest.raises(ValueError, match="coords"):
        k.mixed_coord(Y, torch.tensor([0, 1, 2, 3]), X)  # 3 >= d
    with pytest.raises(ValueError, match="dimension"):
        k(Y, X[:, :2])
    with pytest.raises(ValueError, match="sigma0"):
        kwng.mean_sq_bandwidth(X, Y, sigma0=0.0)
