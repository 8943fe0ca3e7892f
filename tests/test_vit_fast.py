"""The fast KWNG step on a Vision Transformer: layer norm, attention from linear
projections, GELU MLPs and the class token and position embedding
(:class:`kwng.engine.expanded.ExpandedParameter`) are batched over the ``M + 1`` copies,
and the direction equals the reference path's to float64 round-off; a model the engine
cannot batch is named in a ``UserWarning``."""

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from kwng.engine.expanded import ExpandedParameter
from kwng.engine.precond import KWNGPreconditioner
from kwng.engine.replicate import unsupported_reason
from studies.cifar.nets import ConditionedNetwork, DiagonalConditioning
from studies.cifar.vit import vit, vit_tiny


def _vit(dtype=torch.float64):
    torch.manual_seed(0)
    return ConditionedNetwork(vit_tiny(), DiagonalConditioning(10, 1e7)).to(dtype)


def _batch(N=12, dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(N, 3, 32, 32, generator=g, dtype=dtype),
            torch.randint(0, 10, (N,), generator=g))


def _directions(model, mode, M, k, steps=4):
    """The directions of ``steps`` training steps (SGD, clipped KWNG) from a copy of
    ``model``, and the preconditioner's counters."""
    model = copy.deepcopy(model)
    z, y = _batch()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    pc = KWNGPreconditioner(model, lr=1e-2, mode=mode, num_basis=M, eps=1e-3,
                            clip_norm=1.0, refresh_every=k,
                            generator=torch.Generator().manual_seed(3))
    out = []
    for _ in range(steps):
        opt.zero_grad()
        X = model(z)
        pc.step(F.cross_entropy(X, y), X)
        out.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        opt.step()
    return out, pc


@pytest.mark.parametrize("M", [2, 5])
@pytest.mark.parametrize("k", [1, 3])
def test_fast_direction_equals_the_reference_on_a_conditioned_vit(M, k):
    """Four steps (with k = 3: one refresh, two cached steps, a refresh) of the tiny ViT
    inside the ill-conditioned output (condition 1e7), in float64: the replicated
    backward pass ran on every refresh (no serial step) and every direction equals the
    reference path's to round-off."""
    model = _vit()
    fast, pc = _directions(model, "fast", M, k)
    ref, _ = _directions(model, "reference", M, k)
    assert pc.counters()["serial_steps"] == 0
    for d, r in zip(fast, ref):
        assert torch.allclose(d, r, rtol=1e-10, atol=1e-10 * float(r.abs().max()))


def test_every_parameter_of_the_vit_is_batched():
    """No module of the ViT falls back: the engine patches every layer that holds a
    parameter (patch embedding, tokens, layer norms, projections, MLPs, head), and its
    per-copy gradients equal serial vector-Jacobian products."""
    model = _vit()
    params = list(model.parameters())
    assert unsupported_reason(model, params) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pc = KWNGPreconditioner(model, lr=0.1, num_basis=3, mode="fast")
    assert pc._engine.owned() == {id(p) for p in params}
    z, y = _batch()
    plain = copy.deepcopy(model)
    C = torch.randn(3, 12, 10, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(2))
    X = model(z)
    g, T = pc._gradients(F.cross_entropy(X, y), X, C, params)
    Xp = plain(z)
    from kwng.jacobians import jacobian_from_outputs

    T_ref = jacobian_from_outputs(Xp, list(plain.parameters()), C, retain_graph=True)
    g_ref = torch.cat([a.reshape(-1) for a in torch.autograd.grad(
        F.cross_entropy(Xp, y), list(plain.parameters()))])
    assert torch.allclose(X, Xp, rtol=0, atol=0)
    assert torch.allclose(T, T_ref, rtol=1e-10, atol=1e-13 * float(T_ref.abs().max()))
    assert torch.allclose(g, g_ref, rtol=1e-10, atol=1e-13 * float(g_ref.abs().max()))


def test_a_patched_vit_copies_pickles_and_backpropagates_as_the_plain_one():
    """``loss.backward()`` on a replicated forward leaves the true gradient (class token
    and layer norms included); a deep copy and a pickle are plain layers with the same
    ``state_dict``."""
    model = _vit()
    ref = copy.deepcopy(model)
    KWNGPreconditioner(model, lr=0.1, num_basis=2)
    z, y = _batch()
    F.cross_entropy(model(z), y).backward()
    F.cross_entropy(ref(z), y).backward()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-10, atol=1e-14)
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert type(other.body.cls_token) is ExpandedParameter
        assert type(other.body.norm) is nn.LayerNorm
        assert other.state_dict().keys() == ref.state_dict().keys()


def test_bf16_autocast_runs_batched_on_the_cpu():
    """Under CPU bf16 autocast the replicated step runs (no serial pass): its outputs
    are the plain model's bit for bit and its direction is the reference path's under
    the same autocast, to the float32 round-off of the solve (bf16 itself moves both
    equally far from the float32 direction)."""
    model = _vit(torch.float32)
    z, y = _batch(dtype=torch.float32)
    out = {}
    for mode in ("fast", "reference"):
        m = copy.deepcopy(model)
        pc = KWNGPreconditioner(m, lr=0.1, mode=mode, num_basis=5, eps=1e-3,
                                eps_schedule=None, clip_norm=None,
                                generator=torch.Generator().manual_seed(4))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            X = m(z)
            loss = F.cross_entropy(X.float(), y)
        pc.step(loss, X)
        assert pc.counters()["serial_steps"] == 0 or mode == "reference"
        out[mode] = X, torch.cat([p.grad.reshape(-1) for p in m.parameters()])
    (X, d), (X_ref, d_ref) = out["fast"], out["reference"]
    assert torch.equal(X, X_ref)
    assert float((d - d_ref).norm()) <= 1e-3 * float(d_ref.norm())


class _BareTokens(nn.Module):
    """A class token as a bare ``nn.Parameter`` used in ``forward``, and a GroupNorm:
    two kinds of parameters the engine cannot batch."""

    def __init__(self):
        super().__init__()
        self.token = nn.Parameter(torch.zeros(1, 4))
        self.norm = nn.GroupNorm(2, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, z):
        return self.head(self.norm(z + self.token))


def test_a_model_the_engine_cannot_batch_gets_one_warning_naming_its_modules(caplog):
    """A ``UserWarning`` at construction names every module that falls back (once per
    preconditioner); the step is still exact, through serial passes."""
    model = _BareTokens()
    with pytest.warns(UserWarning, match="serial backward passes") as record:
        pc = KWNGPreconditioner(model, lr=0.1, num_basis=2, mode="fast")
    assert len(record) == 1
    text = str(record[0].message)
    assert "model (_BareTokens)" in text and "norm (GroupNorm)" in text
    assert "ExpandedParameter" in text
    z, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning at the steps
        for _ in range(2):
            model.zero_grad()
            X = model(z)
            pc.step(F.cross_entropy(X, y), X)
    assert pc.counters()["serial_steps"] == 2


def test_the_study_vit_has_the_stated_size():
    """Patch 4, width 192, depth 6, 3 heads, MLP ratio 4: 2.69 M parameters, logits for
    CIFAR-shaped inputs."""
    model = vit(10)
    assert sum(p.numel() for p in model.parameters()) == 2_693_578
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_the_committed_vit_step_cost_meets_the_target_on_its_gpu():
    """The step-cost record of the ViT (bf16, batch 128, M = 5, one GPU, every row
    side by side in one run): provenance names the command, the GPU and the date, and a
    captured exact KWNG step costs at most 4 captured SGD steps."""
    import json

    from studies.vit import cost

    rec = json.loads(cost.STEP_COST.read_text())
    prov = rec["provenance"]
    assert "step_cost" in prov["command"] and "--model vit" in prov["command"]
    assert prov["device"].startswith("NVIDIA") and prov["date"] and prov["git_commit"]
    assert rec["model"] == "vit" and rec["batch_size"] == 128
    ratios = cost.captured_ratios()
    assert set(ratios) == {"adam", "kwng_k1", "kwng_k20"}
    assert ratios["kwng_k1"] <= cost.TARGET
    assert ratios["kwng_k20"] < ratios["kwng_k1"]
