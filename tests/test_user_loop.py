"""KWNGPreconditioner in a new user's loop, second round: gradual unfreezing, settings
changed on a live preconditioner, a callable ``lr``, non-finite batches, degenerate
batches (a zero-initialised head, a short last batch), ``mode="auto"`` with dropout and
the messages of a refusal. Each test fails where the preconditioner trained silently
wrong, crashed or gave no way out."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from kwng.engine.precond import KWNGPreconditioner

MODES = ("fast", "reference")


def _data(N=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g)


def _mlp(seed=0, dropout=0.0):
    torch.manual_seed(seed)
    layers = [nn.Linear(6, 8), nn.ReLU()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers, nn.Linear(8, 3))


def _train(model, precond, batches, optimizer=None, before=None):
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for i, (z, y) in enumerate(batches):
        if before is not None:
            before(i)
        optimizer.zero_grad()
        X = model(z)
        loss = F.cross_entropy(X, y)
        precond.step(loss, X)
        optimizer.step()
        losses.append(loss.item())
    return losses


# ------------------------------------------------------------------ silent wrong cases
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("mode", MODES)
def test_a_parameter_unfrozen_after_construction_is_trained(mode, k):
    """Gradual unfreezing: the first layer, frozen when the preconditioner is built and
    unfrozen at step 2, moves from then on (its ``.grad`` is the KWNG direction of all
    active parameters), as plain SGD would move it."""
    model = _mlp()
    model[0].requires_grad_(False)
    pc = KWNGPreconditioner(model, lr=0.1, num_basis=3, mode=mode, refresh_every=k,
                            generator=torch.Generator().manual_seed(0))
    w0 = model[0].weight.detach().clone()
    batches = [_data(seed=s) for s in range(5)]

    def unfreeze(i):
        if i == 2:
            model[0].requires_grad_(True)

    _train(model, pc, batches, before=unfreeze)
    assert model[0].weight.grad is not None
    assert (model[0].weight - w0).norm() > 1e-3
    assert pc.counters()["fallbacks"] == 0


def test_unfrozen_parameters_get_the_same_direction_as_a_fresh_preconditioner():
    """After unfreezing, the step is the exact KWNG step over all parameters: the same
    direction as a preconditioner built with every parameter trainable."""
    z, y = _data()
    dirs = []
    for frozen_first in (True, False):
        model = _mlp()
        if frozen_first:
            model[0].requires_grad_(False)
        pc = KWNGPreconditioner(model, num_basis=3, mode="reference",
                                eps_schedule=None,
                                generator=torch.Generator().manual_seed(0))
        model[0].requires_grad_(True)
        X = model(z)
        pc.step(F.cross_entropy(X, y), X)
        dirs.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    torch.testing.assert_close(dirs[0], dirs[1])


@pytest.mark.parametrize("mode", MODES)
def test_settings_changed_on_a_live_preconditioner_take_effect(mode):
    """``precond.config = precond.config.replace(refresh_every=4)`` refreshes every 4
    steps from the next step on (and is checkpointed as such);
    ``replace(num_basis=5)`` builds a 5-point basis at the next step instead of
    crashing inside autograd."""
    model = _mlp()
    pc = KWNGPreconditioner(model, lr=0.1, num_basis=3, mode=mode,
                            generator=torch.Generator().manual_seed(0))
    batches = [_data(seed=s) for s in range(9)]
    _train(model, pc, batches[:2])
    pc.config = pc.config.replace(refresh_every=4)
    _train(model, pc, batches[2:6])
    # steps 2..5: one refresh (step 2, as the system was dropped) then cached steps
    assert pc.counters()["rank_sum"] == 3 * 6
    assert pc.state_dict()["hyperparameters"]["refresh_every"] == 4
    assert pc.cache.T is not None and pc.cache.T.shape[0] == 3
    pc.config = pc.config.replace(num_basis=5)
    _train(model, pc, batches[6:9])
    assert pc.cache.T.shape[0] == 5
    assert pc.counters()["fallbacks"] == 0
    assert pc.counters()["serial_steps"] == 0


def test_settings_that_cannot_change_on_a_live_preconditioner_are_refused():
    pc = KWNGPreconditioner(_mlp(), lr=0.1)
    for change in ({"eps": 1e-3}, {"mode": "reference"}, {"eps_schedule": None}):
        with pytest.raises(ValueError, match=f"{next(iter(change))} cannot change"):
            pc.config = pc.config.replace(**change)
    with pytest.raises(ValueError, match="config must be a kwng.KWNGConfig"):
        pc.config = {"num_basis": 3}


@pytest.mark.parametrize("bad", [-0.1, float("nan"), 0.0, "0.1", None])
def test_a_callable_lr_is_checked_at_every_step(bad):
    """``lr=lambda: -0.1`` (or NaN) would move ε the wrong way: refused at the step, as
    ``lr=-1`` is refused at construction."""
    model = _mlp()
    value = [0.1]
    pc = KWNGPreconditioner(model, lr=lambda: value[0], num_basis=3)
    _train(model, pc, [_data()])
    value[0] = bad
    z, y = _data(seed=1)
    X = model(z)
    with pytest.raises(ValueError, match=r"lr\(\) returned .*\(0, inf\)"):
        pc.step(F.cross_entropy(X, y), X)


@pytest.mark.parametrize("mode", [*MODES, "auto"])
def test_a_non_finite_batch_is_refused_in_every_mode(mode):
    """A NaN in the batch raises in every mode, before anything is written into
    ``p.grad`` (fast mode used to write NaN parameters)."""
    model = _mlp()
    pc = KWNGPreconditioner(model, lr=0.1, num_basis=3, mode=mode)
    z, y = _data()
    z[0, 0] = float("nan")
    X = model(z)
    with pytest.raises(ValueError, match="NaN or inf"):
        pc.step(F.cross_entropy(X, y), X)
    assert all(p.grad is None for p in model.parameters())
    assert pc.num_steps == 0


# ------------------------------------------------------------------ degenerate batches
def test_auto_mode_never_picks_fast_for_a_model_with_dropout(caplog):
    """A dense model with dropout on the CPU: ``auto`` used to pick fast, whose first
    step raised; it takes reference and trains."""
    model = _mlp(dropout=0.2)
    with caplog.at_level(logging.INFO, logger="kwng.engine.precond"):
        pc = KWNGPreconditioner(model, lr=0.1, num_basis=3, mode="auto")
    assert pc.mode == "reference"
    assert "mode='auto': reference, the model has Dropout" in caplog.text
    _train(model, pc, [_data(seed=s) for s in range(2)])
    assert pc.num_steps == 2
    assert KWNGPreconditioner(_mlp(), lr=0.1, mode="auto").mode == "fast"


@pytest.mark.parametrize("mode", MODES)
def test_a_zero_initialised_head_starts_with_the_euclidean_gradient(mode, caplog):
    """All samples coincide at step 0 (bandwidth 0): the step is the Euclidean gradient
    (clipped), logged and counted; once the outputs spread, KWNG steps follow."""
    model = _mlp()
    nn.init.zeros_(model[2].weight)
    nn.init.zeros_(model[2].bias)
    pc = KWNGPreconditioner(model, lr=0.1, num_basis=3, mode=mode, clip_norm=None)
    z, y = _data()
    X = model(z)
    loss = F.cross_entropy(X, y)
    g = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    with caplog.at_level(logging.WARNING):
        info = pc.step(loss, X)
    assert "coincide" in caplog.text and "Euclidean" in caplog.text
    assert bool(info["fallback"])
    for p, gp in zip(model.parameters(), g):
        torch.testing.assert_close(p.grad, gp)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.step()
    _train(model, pc, [_data(seed=s) for s in range(1, 4)], optimizer)
    c = pc.counters()
    assert c["euclidean_steps"] == 1 and c["fallbacks"] == 1 and c["steps"] == 4


@pytest.mark.parametrize("mode", MODES)
def test_a_short_last_batch_uses_what_it_can(mode, caplog):
    """A last batch smaller than ``num_basis``: a step between refreshes applies the
    cached system as usual; a refresh step takes the Euclidean gradient (logged,
    counted) instead of stopping the epoch."""
    model = _mlp()
    pc = KWNGPreconditioner(model, lr=0.1, num_basis=5, mode=mode, refresh_every=2)
    z, y = _data()
    batches = [(z, y), (z[:3], y[:3]), (z[:3], y[:3])]
    with caplog.at_level(logging.WARNING):
        _train(model, pc, batches)
    c = pc.counters()
    assert c["steps"] == 3
    assert c["rank_sum"] == 10  # the refresh and the cached step between refreshes
    assert c["euclidean_steps"] == 1
    assert "fewer than num_basis" in caplog.text


# ---------------------------------------------------------------------------- messages
def test_the_all_frozen_step_says_every_parameter_is_frozen():
    model = _mlp()
    pc = KWNGPreconditioner(model, lr=0.1, num_basis=3)
    model.requires_grad_(False)
    z, y = _data()
    X = model(z)
    with pytest.raises(ValueError, match="every parameter .* is frozen"):
        pc.step(F.cross_entropy(X, y).requires_grad_(), X)


def test_the_load_warning_names_each_differing_key(caplog):
    state = KWNGPreconditioner(_mlp(), lr=0.1, num_basis=3).state_dict()
    pc = KWNGPreconditioner(_mlp(), lr=0.1, num_basis=4, clip_norm=2.0)
    with caplog.at_level(logging.WARNING):
        pc.load_state_dict(state)
    assert "num_basis: saved 3, now 4" in caplog.text
    assert "clip_norm: saved 1.0, now 2.0" in caplog.text
    assert "'kernel'" not in caplog.text  # not the whole saved dict


# ------------------------------------------------------------- models with many outputs
class _TwoHeads(nn.Module):
    """Returns ``(logits, aux)``, or a Hugging Face-style dict with ``as_dict``."""

    def __init__(self, as_dict=False):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 8), nn.ReLU())
        self.head, self.aux = nn.Linear(8, 3), nn.Linear(8, 2)
        self.as_dict = as_dict

    def forward(self, z):
        h = self.body(z)
        logits, aux = self.head(h), self.aux(h)
        return {"logits": logits, "hidden": h} if self.as_dict else (logits, aux)


@pytest.mark.parametrize("as_dict", [False, True])
def test_output_fn_picks_the_samples_of_a_model_with_several_outputs(as_dict):
    """A tuple or dict output: with ``output_fn`` the fast step runs the replicated
    pass (no serial fallback) and gives the reference direction; the other outputs
    come back at the batch size."""
    pick = (lambda out: out["logits"]) if as_dict else (lambda out: out[0])
    z, y = _data()
    dirs = []
    for mode in MODES:
        model = _TwoHeads(as_dict)
        pc = KWNGPreconditioner(model, num_basis=3, mode=mode, eps_schedule=None,
                                output_fn=pick,
                                generator=torch.Generator().manual_seed(0))
        out = model(z)
        other = out["hidden"] if as_dict else out[1]
        assert other.shape[0] == 16
        X = pick(out)
        pc.step(F.cross_entropy(X, y), X)
        dirs.append(torch.cat([p.grad.reshape(-1) for p in (*model.body.parameters(),
                                                             *model.head.parameters())]))
        assert pc.counters()["serial_steps"] == 0
    torch.testing.assert_close(dirs[0], dirs[1], rtol=1e-4, atol=1e-6)


def test_a_tuple_output_without_output_fn_names_the_way_out():
    model = _TwoHeads()
    pc = KWNGPreconditioner(model, lr=0.1, num_basis=3, mode="fast")
    with pytest.raises(ValueError, match="output_fn=.*out\\[0\\]"):
        model(_data()[0])
    with pytest.raises(ValueError, match="output_fn must be None or a callable"):
        KWNGPreconditioner(nn.Linear(2, 2), lr=0.1, output_fn="logits")
    del pc


# --------------------------------------------------------------- gradient accumulation
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_accumulation_steps_give_the_direction_of_the_whole_batch(mode, k):
    """Three micro-batches of 8 with ``accumulation_steps=3`` give, step after step,
    the direction of one batch of 24 (float64), and leave ``p.grad`` alone until the
    third."""
    batches = [_data(N=24, seed=s) for s in range(4)]
    grads = {}
    for n in (1, 3):
        model = _mlp().double()
        pc = KWNGPreconditioner(model, lr=0.1, num_basis=4, mode=mode, refresh_every=k,
                                accumulation_steps=n,
                                generator=torch.Generator().manual_seed(0))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        grads[n] = []
        for z, y in batches:
            optimizer.zero_grad()
            for i, (zi, yi) in enumerate(zip(z.double().chunk(n), y.chunk(n))):
                X = model(zi)
                info = pc.step(F.cross_entropy(X, yi) / n, X)
                if i < n - 1:
                    assert int(info["micro_batches"]) == i + 1
                    assert all(p.grad is None for p in model.parameters())
            optimizer.step()
            grads[n].append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        assert pc.num_steps == len(batches)
    for a, b in zip(grads[1], grads[3]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_accumulation_steps_are_validated():
    assert KWNGPreconditioner(_mlp(), lr=0.1, accumulation_steps=2).accumulation_steps \
        == 2
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="accumulation_steps must be an integer"):
            KWNGPreconditioner(_mlp(), lr=0.1, accumulation_steps=bad)


def test_a_parameter_group_added_to_the_optimizer_later_is_trained():
    """The optimizer held the trainable parameters only; after unfreezing, the loop
    adds the first layer with ``optimizer.add_param_group``: the preconditioner built
    on ``optimizer.param_groups`` covers it from then on."""
    model = _mlp()
    model[0].requires_grad_(False)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad],
                                lr=0.1)
    pc = KWNGPreconditioner(model, params=optimizer.param_groups, num_basis=3)
    w0 = model[0].weight.detach().clone()

    def unfreeze(i):
        if i == 1:
            model[0].requires_grad_(True)
            optimizer.add_param_group({"params": list(model[0].parameters()),
                                       "lr": 0.05})

    _train(model, pc, [_data(seed=s) for s in range(3)], optimizer, before=unfreeze)
    assert (model[0].weight - w0).norm() > 1e-3
    assert len(pc.params) == 4
