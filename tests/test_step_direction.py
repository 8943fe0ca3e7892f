"""The step's direction (kwng.solve.safeguard, kwng.engine.precond.device_direction)
and the functions the fast path compiles on CUDA (kwng.engine.gpu_paths): the
safeguard's rule, and that each function traces into one graph (``fullgraph=True``,
what ``torch.compile`` needs on the GPU) with the same values as eager."""

import math

import pytest
import torch

from kwng import solve
from kwng.engine import gpu_paths
from kwng.engine.config import KWNGConfig
from kwng.engine.precond import INFO_KEYS, device_direction, direction_into
from kwng.engine.replicate_bn import bn_backward_torch
from kwng.engine.replicate_layers import repeat_copies, stack_copies
from kwng.nosync import nystrom_solve_nosync


def test_safeguard_keeps_a_descent_direction_and_clips_it():
    g = torch.tensor([3.0, 4.0])
    s = solve.safeguard(g, torch.tensor([6.0, 8.0]), clip_norm=5.0)
    assert torch.allclose(s.direction, g) and bool(s.clipped) and not bool(s.fallback)
    assert float(s.dot) == pytest.approx(25.0) and float(s.direction_norm) == 5.0
    assert float(s.grad_norm) == 5.0
    s = solve.safeguard(g, torch.tensor([1.0, 0.0]), clip_norm=None)
    assert torch.equal(s.direction, torch.tensor([1.0, 0.0])) and not bool(s.clipped)


@pytest.mark.parametrize(
    "bad", [[-1.0, 0.0], [0.0, 0.0], [math.nan, 1.0], [math.inf, 1.0]]
)
def test_safeguard_falls_back_to_the_gradient(bad):
    """⟨g, ĝ⟩ ≤ 0 or a non-finite ĝ (a failed solve is NaN): the clipped gradient."""
    g = torch.tensor([3.0, 4.0])
    s = solve.safeguard(g, torch.tensor(bad), clip_norm=1.0)
    assert bool(s.fallback) and torch.allclose(s.direction, g / 5)
    assert float(s.dot) == pytest.approx(5.0)  # ⟨g, g/5⟩


def _problem(M=4, q=300, N=16, dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    T = torch.randn(M, q, generator=gen, dtype=dtype)
    g = torch.randn(q, generator=gen, dtype=dtype)
    C = torch.randn(M, 3 * N, generator=gen, dtype=torch.float64)
    return T, C @ C.T, C @ C.T / N, g, N


@pytest.mark.parametrize("damping", solve.DAMPINGS)
def test_direction_into_is_the_solve_then_the_safeguard(damping):
    T, CCt, K, g, N = _problem()
    eps = torch.tensor(1e-2, dtype=torch.float64)
    out = torch.empty_like(g)
    info = direction_into(out, T, CCt, K, g, N, eps=eps, lam=0.1, damping=damping,
                          rcond=None, clip_norm=0.5)
    d, dg = nystrom_solve_nosync(T, CCt, K, g, N, eps=eps, lam=0.1, damping=damping)
    safe = solve.safeguard(g, d, 0.5)
    assert torch.equal(out, safe.direction) and set(info) == set(INFO_KEYS)
    assert bool(info["clipped"]) and int(info["rank"]) == int(dg["rank"])
    # on the CPU the dispatcher runs the same function eagerly
    out2 = torch.empty_like(g)
    device_direction(out2, T, CCt, K, g, N, eps=eps, lam=0.1, damping=damping,
                   rcond=None, clip_norm=0.5)
    assert torch.equal(out2, out)


def test_a_failed_solve_falls_back_to_the_gradient():
    """The same rule as the fused kernels: a failed Cholesky factorisation of the system
    (here ε < 0 makes it negative definite) gives the Euclidean gradient."""
    T, CCt, K, g, N = _problem()
    out = torch.empty_like(g)
    eps = torch.tensor(-1e12, dtype=torch.float64)
    info = direction_into(out, T, CCt, K, g, N, eps=eps, lam=0.0, damping="T_tilde",
                          rcond=None, clip_norm=None)
    assert bool(info["fallback"]) and torch.equal(out, g)


@pytest.mark.parametrize(
    "bad", [[-1.0, 0.0], [0.0, 0.0], [math.nan, 1.0], [math.inf, 1.0]]
)
def test_safeguard_with_skip_takes_no_step(bad):
    """``fallback="skip"``: a failing direction becomes zero (no step, ⟨g, ĝ⟩ = 0,
    not clipped), counted as a fallback; a good direction is the same as with the
    default."""
    g = torch.tensor([3.0, 4.0])
    s = solve.safeguard(g, torch.tensor(bad), clip_norm=1.0, fallback="skip")
    assert bool(s.fallback) and torch.equal(s.direction, torch.zeros(2))
    assert float(s.dot) == 0.0 and float(s.direction_norm) == 0.0
    assert not bool(s.clipped) and float(s.grad_norm) == 5.0
    good = torch.tensor([6.0, 8.0])
    a, b = (solve.safeguard(g, good, 5.0, fb) for fb in solve.FALLBACKS)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(ValueError, match=r"fallback must be one of \('gradient', "
                       r"'skip'\), got 'none'"):
        solve.safeguard(g, good, 5.0, fallback="none")


def test_a_failed_solve_with_skip_writes_no_step_on_every_path(monkeypatch):
    """A failed factorisation (ε < 0) with ``fallback="skip"``: zeros in ``out`` on the
    eager path and the CPU dispatcher; on the float64 reference path (whose solve
    cannot fail here: an ascent direction stands in for a failed one) too."""
    import types

    import kwng.engine.precond as precond_mod
    from kwng.engine.precond import reference_direction

    T, CCt, K, g, N = _problem()
    kw = dict(lam=0.0, damping="T_tilde", rcond=None, clip_norm=1.0, fallback="skip")
    for fn, eps in ((direction_into, torch.tensor(-1e12, dtype=torch.float64)),
                    (device_direction, torch.tensor(-1e12, dtype=torch.float64))):
        out = torch.full_like(g, 7.0)
        info = fn(out, T, CCt, K, g, N, eps=eps, **kw)
        assert bool(info["fallback"]) and torch.equal(out, torch.zeros_like(g))
        assert float(info["dot"]) == 0.0
    from kwng.estimator import nystrom_solve as real

    def ascent(*args, **kwargs):
        res = real(*args, **kwargs)
        return types.SimpleNamespace(direction=-args[3], diagnostics=res.diagnostics)

    monkeypatch.setattr(precond_mod, "nystrom_solve", ascent)
    out = torch.full_like(g, 7.0)
    info = reference_direction(out, T, CCt, K, g, N, eps=1e-2, **kw)
    assert bool(info["fallback"]) and torch.equal(out, torch.zeros_like(g))


def test_the_preconditioner_skips_the_step_its_direction_fails(monkeypatch):
    """``KWNGConfig(fallback="skip")`` through a training step: a step whose solve
    fails writes a zero gradient, counts a fallback, and the next step (solve healthy
    again) writes the KWNG direction; the default writes ``g`` instead."""
    from torch import nn

    import kwng.engine.precond as precond_mod
    from kwng.engine.precond import KWNGPreconditioner

    real = precond_mod.device_direction
    fail = {"on": True}

    def flaky(out, T, CCt, K, g, N, **kw):
        if fail["on"]:
            kw["eps"] = torch.full_like(kw["eps"], -1e12)  # the system's factor fails
        return real(out, T, CCt, K, g, N, **kw)

    monkeypatch.setattr(precond_mod, "device_direction", flaky)
    grads = {}
    for fb in ("skip", "gradient"):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        pc = KWNGPreconditioner(net, lr=0.1, num_basis=3, fallback=fb,
                                eps_schedule=None,
                                generator=torch.Generator().manual_seed(1))
        z, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
        fail["on"] = True
        out = net(z)
        pc.step(nn.functional.cross_entropy(out, y), out)
        grads[fb] = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
        assert pc.counters()["fallbacks"] == 1
        fail["on"] = False
        for p in net.parameters():
            p.grad = None
        out = net(z)
        pc.step(nn.functional.cross_entropy(out, y), out)
        assert pc.counters()["fallbacks"] == 1
        after = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
        assert float(after.norm()) > 0
    assert torch.equal(grads["skip"], torch.zeros_like(grads["skip"]))
    assert float(grads["gradient"].norm()) > 0


def test_the_config_names_the_fallbacks():
    assert KWNGConfig().fallback == "gradient"
    assert KWNGConfig(fallback="skip").fallback == "skip"
    with pytest.raises(ValueError, match="fallback must be one of"):
        KWNGConfig(fallback="zero")


def _traced(fn):
    """``fn`` traced by dynamo into one graph (fails on a graph break), run eagerly."""
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="eager")


def test_the_compiled_functions_trace_into_one_graph():
    T, CCt, K, g, N = _problem(dtype=torch.float32)
    eps = torch.tensor(1e-2, dtype=torch.float64)
    kw = dict(eps=eps, lam=0.0, damping="T_tilde", rcond=None, clip_norm=1.0)
    a, b = torch.empty_like(g), torch.empty_like(g)
    ref = direction_into(a, T, CCt, K, g, N, **kw)
    got = _traced(direction_into)(b, T, CCt, K, g, N, **kw)
    assert torch.allclose(a, b, rtol=1e-6) and bool(ref["clipped"] == got["clipped"])
    y0 = torch.randn(4, 3, 5, 5).contiguous(memory_format=torch.channels_last)
    assert torch.equal(_traced(repeat_copies)(y0, 3), torch.cat([y0] * 3))
    assert repeat_copies(y0, 3).stride() == torch.cat([y0] * 3).stride()
    dy = torch.randn(12, 3, 5, 5).contiguous(memory_format=torch.channels_last)
    assert torch.equal(_traced(stack_copies)(dy, 3), stack_copies(dy, 3))
    # float64: the traced graph may sum in another order than the eager call, which in
    # float32 moves the result by up to a tenth of allclose's tolerance
    f64 = {"generator": torch.Generator().manual_seed(0), "dtype": torch.float64}
    d, x = torch.randn(3, 40, 6, **f64), torch.randn(1, 40, 6, **f64)
    mean, invstd = x[0].mean(0), torch.rand(6, **f64) + 0.5
    scale = torch.randn(6, **f64)
    want = bn_backward_torch(d, x, mean, invstd, scale, True, True, True)
    have = _traced(bn_backward_torch)(d, x, mean, invstd, scale, True, True, True)
    for w, h in zip(want, have):
        assert torch.allclose(w, h)
    torch._dynamo.reset()


def test_compile_on_cuda_runs_eagerly_on_the_cpu_and_the_path_is_a_config_field():
    calls = []

    def f(x):
        calls.append(torch.compiler.is_compiling())
        return x + 1

    assert torch.equal(gpu_paths.compile_on_cuda(f)(torch.zeros(2)), torch.ones(2))
    assert torch.equal(gpu_paths.compile_on_cuda(f)(torch.zeros(2), gpu_solve="eager"),
                       torch.ones(2))
    assert calls == [False, False]
    assert not gpu_paths.use_kernels(torch.zeros(2), "compile")
    assert KWNGConfig().gpu_solve == "auto"
    assert KWNGConfig(gpu_solve="compile").gpu_solve == "compile"
    with pytest.raises(ValueError, match=r"gpu_solve must be one of \['auto', "
                       r"'triton', 'compile', 'eager'\], got 'cudnn'"):
        KWNGConfig(gpu_solve="cudnn")


def test_import_kwng_loads_no_triton_and_no_compiler():
    """Triton and the compiler are loaded only by a fast step on CUDA (or the kernels'
    checks), never by ``import kwng``."""
    import subprocess
    import sys

    code = ("import sys, kwng; bad = [m for m in sys.modules "
            "if m.split('.')[0] == 'triton' "
            "or m.startswith(('kwng.triton', 'torch._inductor'))]; print(bad); "
            "sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_gpu_solve_travels_with_the_preconditioner_and_old_states_load(caplog):
    """``gpu_solve`` is recorded in the hyperparameters, reaches the replicated engine
    (no process-wide switch), and a state saved before the field loads without a
    warning about differing hyperparameters."""
    from torch import nn

    from kwng.engine.precond import KWNGPreconditioner

    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    pc = KWNGPreconditioner(net, lr=0.1, num_basis=2, gpu_solve="eager")
    assert pc.hyperparameters()["gpu_solve"] == "eager"
    assert pc.path.gpu_solve == "eager" and pc._engine.state.gpu_solve == "eager"
    other = KWNGPreconditioner(nn.Linear(2, 2), lr=0.1, num_basis=2)
    assert other.path.gpu_solve == "auto"  # the first one changed nothing global
    state = pc.state_dict()
    del state["hyperparameters"]["gpu_solve"]
    fresh = KWNGPreconditioner(nn.Sequential(nn.Linear(3, 4), nn.Tanh(),
                                             nn.Linear(4, 2)), lr=0.1, num_basis=2)
    with caplog.at_level("WARNING"):
        fresh.load_state_dict(state)
    assert "differ" not in caplog.text
    pc.config = pc.config.replace(gpu_solve="compile")
    assert pc._engine.state.gpu_solve == "compile" == pc.path.gpu_solve
