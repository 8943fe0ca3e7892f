"""KFAC and EKFAC on the Vision Transformer (:mod:`studies.cifar.kfac_tokens`): the
factor pass sees every token as a row of a Linear layer (KFAC-expand), the factors are
the hand-computed ones with KFAC-expand's normalisation, the model computes the same
function during the pass and is the plain model after it, a step gives a finite
descent direction, and the study's short training run finishes."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from studies.cifar.ekfac_factors import _square_grads
from studies.cifar.kfac_tokens import expand_scale, token_rows
from studies.cifar.nets import ConditionedNetwork, DiagonalConditioning
from studies.cifar.vit import vit_tiny

pytest.importorskip("nngeometry")

from studies.cifar.baselines import KFACPreconditioner  # noqa: E402

TOKENS = 65  # 8 x 8 patches of 4 x 4 and the class token


def _vit() -> ConditionedNetwork:
    torch.manual_seed(0)
    return ConditionedNetwork(vit_tiny(), DiagonalConditioning(10, 1e3)).double()


def _batch(n: int = 6):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(n, 3, 32, 32, generator=g, dtype=torch.float64),
            torch.randint(0, 10, (n,), generator=g))


def _linears(model: nn.Module) -> dict[str, nn.Module]:
    return {k: m for k, m in model.named_modules() if isinstance(m, nn.Linear)}


def test_the_preconditioned_layers_are_the_patch_embedding_and_every_linear():
    """KFAC's layer collection on the ViT: the patch Conv2d, the qkv, proj and MLP
    Linear layers of each block and the head; the layer norms, the class token and the
    position embedding are not in it (they keep the plain gradient)."""
    model = _vit()
    pc = KFACPreconditioner(model, kind="kfac")
    blocks = [f"body.blocks.{i}.{n}" for i in range(2)
              for n in ("attn.qkv", "attn.proj", "mlp.0", "mlp.2")]
    assert list(pc.layer_collection.layers) == ["body.patch", *blocks, "body.head"]


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_a_step_gives_a_finite_descent_direction(kind):
    """One refresh step in float64: the direction is finite, no fallback, the
    preconditioned layers' gradients changed, every other parameter keeps its plain
    gradient, and ``<direction, gradient> > 0``."""
    model = _vit()
    z, y = _batch()
    F.cross_entropy(model(z), y).backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    pc = KFACPreconditioner(model, kind=kind, clip_norm=None)
    torch.manual_seed(3)
    out = model(z)
    info = pc.step(F.cross_entropy(out, y), out, inputs=z)
    assert int(info["fallback"]) == 0 and info["refreshed"] == 1
    owned = {f"{k}.{p}" for k in pc.modules for p in ("weight", "bias")}
    d = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    g = torch.cat([plain[n].reshape(-1) for n, _ in model.named_parameters()])
    assert torch.isfinite(d).all() and float(d @ g) > 0
    for n, p in model.named_parameters():
        if n in owned:
            assert not torch.allclose(p.grad, plain[n]), n
        else:
            assert torch.equal(p.grad, plain[n]), n
    pc.close()


def _hand_factors(model, z, layer: nn.Module, seed: int):
    """``(Σ_{n,t} a aᵀ / N, Σ_{n,t} g gᵀ / N)`` of ``layer`` (a bias coordinate in
    ``a``), with ``g`` the gradient of ``Σ_n log p(ỹ_n | z_n)`` with respect to the
    layer's output and ``ỹ`` drawn as nngeometry draws it after ``manual_seed(seed)``
    (behind a one-batch loader, whose iterator draws a seed first)."""
    seen = {}
    h = layer.register_forward_hook(lambda m, i, o: seen.update(x=i[0], y=o))
    torch.manual_seed(seed)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(z),
                                         batch_size=z.shape[0])
    (z,) = next(iter(loader))
    log_p = torch.log_softmax(model(z), dim=1)
    labels = torch.multinomial(torch.exp(log_p), 1, replacement=True)
    h.remove()
    (gy,) = torch.autograd.grad(log_p.gather(1, labels).sum(), [seen["y"]])
    x = seen["x"].detach().reshape(-1, seen["x"].shape[-1])
    x = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
    gy = gy.reshape(-1, gy.shape[-1])
    n = z.shape[0]
    return x.T @ x / n, gy.T @ gy / n


def test_nngeometry_factors_are_the_token_sums_and_expand_rescales_g():
    """On a batch of 3: nngeometry's factors of ``blocks.0.mlp.0`` (run through
    :func:`token_rows`) are the sums over the 3 · 65 token rows divided by the 3 images;
    the preconditioner divides ``G`` by the 65 tokens (KFAC-expand) and stores the
    π-damped inverses of those factors; the head (one row per image) is unscaled."""
    from nngeometry.layercollection import LayerCollection
    from nngeometry.metrics import FIM_MonteCarlo
    from nngeometry.object import PMatKFAC

    model, (z, _) = _vit(), _batch(3)
    name = "body.blocks.0.mlp.0"
    layer = model.get_submodule(name)
    a_hand, g_hand = _hand_factors(model, z, layer, seed=5)
    lc = LayerCollection()
    lc.add_layer(name, LayerCollection._module_to_layer(layer))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(z),
                                         batch_size=3)
    torch.manual_seed(5)
    with token_rows({name: layer}) as rows:
        fim = FIM_MonteCarlo(model=model, loader=loader, representation=PMatKFAC,
                             variant="classif_logits", layer_collection=lc)
    assert rows == {name: TOKENS}
    a, g = fim.data[name]
    assert torch.allclose(a, a_hand, rtol=1e-12, atol=1e-14)
    assert torch.allclose(g, g_hand, rtol=1e-10, atol=1e-14 * float(g.abs().max()))

    pc = KFACPreconditioner(model, kind="kfac", damping=1e-3)
    torch.manual_seed(5)
    pc._fisher_passes(z)
    a2, g2 = pc.fim.data[name]
    assert torch.allclose(a2, a_hand, rtol=1e-12, atol=1e-14)
    assert torch.allclose(g2, g_hand / TOKENS, rtol=1e-10,
                          atol=1e-14 * float(g2.abs().max()))
    # π-corrected damping; nngeometry's identity is float32 (torch.eye's default
    # dtype), so its damping terms carry float32 rounding: the same here
    pi = (a2.trace() / a2.shape[0] / (g2.trace() / g2.shape[0])) ** 0.5
    a_inv = torch.linalg.inv(a2 + pi * 1e-3 ** 0.5 * torch.eye(a2.shape[0]))
    g_inv = torch.linalg.inv(g2 + 1e-3 ** 0.5 / pi * torch.eye(g2.shape[0]))
    assert torch.allclose(pc.factors.buffers[name][0], a_inv, rtol=1e-9)
    assert torch.allclose(pc.factors.buffers[name][1], g_inv, rtol=1e-9)
    a_head, g_head = _hand_factors(model, z, model.body.head, seed=5)
    assert torch.allclose(pc.fim.data["body.head"][1], g_head, rtol=1e-10,
                          atol=1e-14 * float(g_head.abs().max()))


def test_the_model_is_the_same_function_inside_and_after_token_rows():
    """Inside :func:`token_rows` the outputs and gradients are the plain model's (to
    round-off); on exit, also after an error, every Linear is a plain ``nn.Linear``
    again with nothing added to it, and the ``state_dict`` is unchanged."""
    model, (z, y) = _vit(), _batch()
    keys = list(model.state_dict())
    out = model(z)
    grads = torch.autograd.grad(F.cross_entropy(out, y), list(model.parameters()))
    with token_rows(_linears(model)) as rows:
        assert all(type(m).__name__ == "Linear" for m in _linears(model).values())
        out2 = model(z)
        grads2 = torch.autograd.grad(F.cross_entropy(out2, y),
                                     list(model.parameters()))
    assert rows["body.head"] == 1 and rows["body.blocks.1.mlp.2"] == TOKENS
    assert torch.allclose(out2, out, rtol=0, atol=1e-13)
    for a, b in zip(grads2, grads):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-15)
    with pytest.raises(RuntimeError, match="boom"):
        with token_rows(_linears(model)):
            raise RuntimeError("boom")
    for m in _linears(model).values():
        assert type(m) is nn.Linear and "_token_rows_log" not in m.__dict__
    assert list(model.state_dict()) == keys
    assert torch.equal(model(z), out)


def test_ekfac_scalings_of_a_token_layer_use_per_example_gradients():
    """``Σᵢ (U_Gᵀ (Σ_t g_it x_itᵀ) U_A)²`` for a Linear layer on ``(N, T, D)``: the
    per-example gradients summed over the tokens, then projected and squared."""
    g = torch.Generator().manual_seed(2)
    layer = nn.Linear(4, 3).double()
    x = torch.randn(5, 7, 4, generator=g, dtype=torch.float64)
    gy = torch.randn(5, 7, 3, generator=g, dtype=torch.float64)
    ua = torch.linalg.qr(torch.randn(5, 5, generator=g, dtype=torch.float64))[0]
    ug = torch.linalg.qr(torch.randn(3, 3, generator=g, dtype=torch.float64))[0]
    xb = torch.cat([x, torch.ones_like(x[..., :1])], dim=2)
    ref = sum((ug.T @ (gy[i].T @ xb[i]) @ ua) ** 2 for i in range(5))
    assert torch.allclose(_square_grads(layer, x, gy, ua, ug), ref, rtol=1e-12)
    with pytest.raises(ValueError, match="Linear layer's input"):
        _square_grads(layer, x, gy[:, :6], ua, ug)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="modules must"):
        with token_rows([nn.Linear(2, 2)]):
            pass
    with pytest.raises(ValueError, match="data must"):
        expand_scale({"a": torch.eye(2)}, {})
    with pytest.raises(ValueError, match="rows must"):
        expand_scale({"a": (torch.eye(2), torch.eye(2))}, {"a": 0})


@pytest.mark.parametrize("method", ["kfac", "ekfac_s10"])
def test_the_short_vit_training_run_finishes(method, tmp_path, monkeypatch):
    """The study's trainer on ``vit_tiny``, 100 sample images, one epoch of 2 steps:
    complete, not diverged, a finite loss and no fallback to the plain gradient."""
    import studies
    from studies.cifar import train

    studies.load_all()
    monkeypatch.chdir(tmp_path)
    rec = train.run({"source": "sample", "model": "vit_tiny", "batch_size": 50,
                     "epochs": 1, "lr": 0.1, "device": "cpu", "out": "res",
                     "checkpoint_dir": "ck", "train_subset": 100, "method": method},
                    progress=False)
    assert rec["complete"] and not rec["diverged"]
    (epoch,) = rec["epochs"]
    assert epoch["steps"] == 2 and math.isfinite(epoch["train_loss"])
    assert epoch["fallbacks"] == 0
