"""EKFAC's capturable step (:mod:`studies.cifar.ekfac_factors`), float64 on a
tiny conv + linear net: the scalings from the training forward are nngeometry's
``PMatEKFAC.update_diag`` given the same sampled labels, the direction is its
``solvePVec``, every step of a run (NCHW or channels_last) is the old nngeometry path's
(``update_diag`` and ``solvePVec``) from the same state and labels, the
training gradient is untouched by the extra backward, the buffers keep their addresses,
a non-finite direction falls back on the device, a state_dict resumes exactly, and a
captured loop (stand-ins for the CUDA parts) trains as the eager one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from studies.cifar import steps
from studies.cifar.ekfac_factors import (
    EigenFactors,
    LayerRecorder,
    check_layers,
    fisher_output_grads,
)
from studies.cifar.nets import ConditionedNetwork, DiagonalConditioning

pytest.importorskip("nngeometry")

from studies.cifar import baselines
from studies.cifar.baselines import KFACPreconditioner  # noqa: E402
from tests.test_baselines_kfac import _fake_cuda  # noqa: E402

B = 10


def _net(seed: int = 0) -> ConditionedNetwork:
    """Conv2d with and without bias, with more output locations than channels (the
    per-example gradient projected after the sum over locations) and with fewer (the
    patches projected first, nngeometry's order), BatchNorm, Linear with and without
    bias, U."""
    torch.manual_seed(seed)
    body = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 5, 3, stride=2, bias=False), nn.BatchNorm2d(5), nn.ReLU(),
        nn.Conv2d(5, 8, 3), nn.ReLU(), nn.Flatten(),
        nn.Linear(8, 6, bias=False), nn.ReLU(), nn.Linear(6, 4))
    return ConditionedNetwork(body, DiagonalConditioning(4, 1e3)).double()


def _batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, 3, 8, 8, generator=g, dtype=torch.float64),
             torch.randint(0, 4, (B,), generator=g)) for _ in range(n)]


def _loader(z: torch.Tensor):
    """A loader whose iterator draws its seed from its own generator, so that
    nngeometry's pass draws its labels first from the global stream."""
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(z.detach()),
                                       batch_size=z.shape[0],
                                       generator=torch.Generator())


def _step(pc, model, z, y, seed=None):
    model.zero_grad()
    X = model(z)
    if seed is not None:
        torch.manual_seed(seed)
    return pc.step(nn.functional.cross_entropy(X, y), X, inputs=z)


def _pvector(pc, grads):
    PVector = baselines._nngeometry()[4]
    d = {name: tuple(grads[id(p)] for p in mod.parameters())
         for name, mod in pc.modules.items()}
    return PVector(pc.layer_collection, dict_repr=d)


@pytest.mark.parametrize("refresh", [True, False])
def test_the_scalings_and_direction_are_nngeometrys(refresh):
    """On a refresh step (the new eigenbasis) and a step between refreshes: the
    scalings equal ``PMatEKFAC.update_diag`` on the same batch with the same labels
    (the same generator state), the direction ``solvePVec(regul=damping)`` of the
    plain gradient with those scalings."""
    (z0, y0), (z, y) = _batches(2)
    model = _net()
    pc = KFACPreconditioner(model, kind="ekfac", update_freq=1 if refresh else 5,
                            damping=1e-3, clip_norm=None)
    _step(pc, model, z0, y0, seed=3)
    model.zero_grad()
    X = model(z)
    loss = nn.functional.cross_entropy(X, y)
    plain = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    torch.manual_seed(11)
    info = pc.step(loss, X, inputs=z)
    assert info["refreshed"] == int(refresh) and int(info["fallback"]) == 0
    evecs, mine = pc.eigen.state()
    assert all(torch.equal(a, b) for k in evecs
               for a, b in zip(evecs[k], pc.fim.data[0][k]))
    torch.manual_seed(11)
    pc.fim.update_diag(_loader(z))
    for k, s in mine.items():
        ref = pc.fim.data[1][k]
        assert torch.allclose(s, ref, rtol=1e-12, atol=1e-15 * ref.abs().max()), k
    want = pc.fim.solvePVec(_pvector(pc, {id(p): g for p, g in zip(
        model.parameters(), plain)}), regul=1e-3).to_dict()
    for name, mod in pc.modules.items():
        for p, w in zip(mod.parameters(), want[name]):
            assert torch.allclose(p.grad, w, rtol=1e-10, atol=1e-12), name
    # with nngeometry's scalings the direction is its own bit for bit
    pc.eigen.store(pc.fim.data)
    model.zero_grad()
    for p, g in zip(model.parameters(), plain):
        p.grad = g.clone()
    pc.eigen.apply(pc.modules, 1e-3)
    for name, mod in pc.modules.items():
        assert all(torch.equal(p.grad, w) for p, w in zip(mod.parameters(),
                                                          want[name])), name


class _Checked(KFACPreconditioner):
    """The new step, and the old nngeometry path's direction from the same state:
    ``update_diag`` on the batch with the labels of the step's own draw (the same
    generator state), then ``solvePVec`` of the plain gradient (clip_norm = None).
    Records the largest difference per step."""

    diffs: list

    def step(self, loss, outputs=None, inputs=None):
        params = list(self.model.parameters())
        plain = torch.autograd.grad(loss, params, retain_graph=True)
        state = torch.get_rng_state()
        info = super().step(loss, outputs, inputs)
        after = torch.get_rng_state()
        torch.set_rng_state(state)
        saved = baselines.bn_state(self.model)
        with self.recorder.paused():
            self.fim.update_diag(_loader(inputs))
        baselines.restore_bn_state(self.model, saved)
        torch.set_rng_state(after)
        grads = {id(p): g.contiguous() for p, g in zip(params, plain)}
        want = self.fim.solvePVec(_pvector(self, grads), regul=self.damping).to_dict()
        for name, mod in self.modules.items():
            for p, w in zip(mod.parameters(), want[name]):
                grads[id(p)] = w
        self.diffs.append(max(float((p.grad - grads[id(p)]).abs().max()
                                    / grads[id(p)].abs().max().clamp_min(1e-300))
                              for p in params))
        return info


@pytest.mark.parametrize("channels_last", [False, True])
def test_every_step_of_a_run_is_the_old_nngeometry_paths(channels_last):
    """7 steps of update_freq = 3 (refreshes at 0, 3, 6), in NCHW or channels_last:
    on every step the new direction (BatchNorm's plain gradients included) is the old
    path's from the same state and labels. (Two whole runs cannot be compared: the
    eigenbasis of a rank-deficient factor is arbitrary within its null space, and
    rounding-level differences of the parameters pick different ones.)"""
    model = _net()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    # unclipped directions are large (damping 1e-3): a small step keeps every ReLU alive
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    pc = _Checked(model, kind="ekfac", update_freq=3, clip_norm=None)
    pc.diffs = []
    refreshed = []
    for s, (z, y) in enumerate(_batches(7)):
        if channels_last:
            z = z.contiguous(memory_format=torch.channels_last)
        refreshed.append(_step(pc, model, z, y, seed=100 + s)["refreshed"])
        opt.step()
    assert refreshed == [1, 0, 0, 1, 0, 0, 1]
    assert len(pc.diffs) == 7 and all(d < 1e-10 for d in pc.diffs), pc.diffs
    assert all(float(p.grad.abs().max()) > 0 for p in model.parameters())
    assert pc.steps == 7 and not pc.schedule.due and not pc.recorder.saved
    if channels_last:
        assert model.body[0].weight.grad.is_contiguous(
            memory_format=torch.channels_last)


def test_the_training_gradient_is_untouched_by_the_extra_backward(monkeypatch):
    """Before the direction replaces them, the gradients are exactly the training
    loss's; the BatchNorm statistics are those of the one training forward."""
    (z0, y0), (z, y) = _batches(2)
    model = _net()
    pc = KFACPreconditioner(model, kind="ekfac", update_freq=4, clip_norm=None)
    _step(pc, model, z0, y0)
    monkeypatch.setattr(pc.eigen, "apply", lambda *a: torch.zeros((), dtype=int))
    model.zero_grad()
    X = model(z)
    bn = baselines.bn_state(model)
    loss = nn.functional.cross_entropy(X, y)
    plain = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    pc.step(loss, X, inputs=z)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain))
    assert all(torch.equal(v, bn[k]) for k, v in baselines.bn_state(model).items())


def _buffers(pc):
    return [t for triple in pc.eigen.buffers.values() for t in triple]


def test_buffers_in_place_and_an_exact_resume():
    """A refresh and a load copy into the same buffers; the eigenbasis changes at the
    refreshes only, the scalings every step; a fresh preconditioner loaded from a
    state_dict takes the next step exactly as the original."""
    batches = _batches(5)
    model = _net()
    pc = KFACPreconditioner(model, kind="ekfac", update_freq=2)
    ptrs, values = None, []
    for s, (z, y) in enumerate(batches[:4]):
        _step(pc, model, z, y, seed=s)
        ptrs = ptrs or [t.data_ptr() for t in _buffers(pc)]
        assert [t.data_ptr() for t in _buffers(pc)] == ptrs
        values.append([t.clone() for t in _buffers(pc)])
    bases = [[t for i, t in enumerate(v) if i % 3 < 2] for v in values]
    assert all(torch.equal(a, b) for a, b in zip(bases[0], bases[1]))
    assert not all(torch.equal(a, b) for a, b in zip(bases[1], bases[2]))
    assert not any(torch.equal(a[2], b[2]) for a, b in zip(values[0][2::3],
                                                           values[1][2::3]))
    state = pc.state_dict()
    pc.eigen.store(({k: (a * 0, g * 0) for k, (a, g) in state["fim_data"][0].items()},
                    state["fim_data"][1]))
    pc.load_state_dict(state)
    assert [t.data_ptr() for t in _buffers(pc)] == ptrs
    assert all(torch.equal(a, b) for a, b in zip(_buffers(pc), values[3]))
    assert pc.steps == 4 and pc.schedule.ready and pc.schedule.due
    twin = KFACPreconditioner(model, kind="ekfac", update_freq=2)
    twin.load_state_dict(pc.state_dict())
    pc.schedule.steps = twin.schedule.steps = 5  # a step between refreshes
    z, y = batches[4]
    grads = []
    for p in (pc, twin):
        p.recorder.saved = {}
        _step(p, model, z, y, seed=9)
        grads.append([q.grad.clone() for q in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_no_nngeometry_between_refreshes_and_the_device_fallback(monkeypatch):
    """Between refreshes no nngeometry object is touched; a non-finite direction
    leaves every gradient plain and returns fallback 1 as a device tensor."""
    model = _net()
    pc = KFACPreconditioner(model, kind="ekfac", update_freq=5, clip_norm=None)
    (z, y), (z1, y1) = _batches(2)
    _step(pc, model, z, y)

    def refuse():
        raise AssertionError("nngeometry used between refreshes")

    monkeypatch.setattr(baselines, "_nngeometry", refuse)
    info = _step(pc, model, z1, y1)
    assert isinstance(info["fallback"], torch.Tensor) and int(info["fallback"]) == 0
    next(iter(pc.eigen.buffers.values()))[0][0, 0] = float("nan")
    model.zero_grad()
    X = model(z1)
    plain = torch.autograd.grad(nn.functional.cross_entropy(X, y1),
                                list(model.parameters()), retain_graph=True)
    info = pc.step(nn.functional.cross_entropy(X, y1), X, inputs=z1)
    assert isinstance(info["fallback"], torch.Tensor) and int(info["fallback"]) == 1
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain))


def _runner_run(batches, capture, monkeypatch, diag_freq=1):
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pc = KFACPreconditioner(model, kind="ekfac", update_freq=4, diag_freq=diag_freq)
    method = steps.KFACStep(model, opt, pc)
    refreshed = []

    def step_fn(z, y):
        refreshed.append(pc.schedule.due)
        before = [t.clone() for t in _buffers(pc)[2::3]] if pc.eigen.buffers else []
        steps.train_step(method, model, z, y)
        method.scaled = getattr(method, "scaled", []) + [
            bool(before) and any(not torch.equal(a, b)
                                 for a, b in zip(before, _buffers(pc)[2::3]))]

    runner = steps.StepRunner(step_fn, torch.device("cpu"), False, lambda: 0.1,
                              cache=pc.cache)
    if capture:
        _fake_cuda(monkeypatch, pc.cache)
        runner.capture = True
    torch.manual_seed(7)
    for z, y in batches:
        runner(z, y)
    return model, runner, refreshed, method


def test_a_captured_ekfac_loop_trains_as_the_eager_one(monkeypatch):
    """:class:`StepRunner` with EKFAC's schedule (update_freq = 4, 11 steps): eager
    warm-up, one recording, the steps between refreshes replayed and the refreshes
    (4, 8) run eagerly; the parameters equal the eager loop's bit for bit."""
    batches = _batches(11)
    m_eager, r_eager, ref_eager, _ = _runner_run(batches, False, monkeypatch)
    m_cap, r_cap, ref_cap, method = _runner_run(batches, True, monkeypatch)
    assert method.capturable and r_cap.captures == 1
    assert (r_cap.eager, r_cap.replays, r_eager.eager) == (5, 6, 11)
    assert [s for s, r in enumerate(ref_cap) if r] == [0, 4, 8]
    for p, q in zip(m_eager.parameters(), m_cap.parameters()):
        assert torch.equal(p, q)
    assert method.epoch_fields([]) == {"fallbacks": 0}


def test_scalings_every_k_steps_captured_train_as_the_eager_loop(monkeypatch):
    """EKFAC with ``diag_freq = 3`` under :class:`StepRunner` (update_freq = 4, 13
    steps): three eager warm-up steps as the schedule names them, one recording of the
    two programs between refreshes, the refreshes (4, 8, 12) eager and the rest
    replayed; the scalings change on the steps that refresh or re-estimate them (3, 6,
    9) only; the parameters equal the eager loop's bit for bit."""
    batches = _batches(13)
    m_eager, r_eager, _, e_method = _runner_run(batches, False, monkeypatch, 3)
    m_cap, r_cap, ref_cap, method = _runner_run(batches, True, monkeypatch, 3)
    assert method.capturable and r_cap.captures == 1
    assert (r_cap.eager, r_cap.replays, r_eager.eager) == (6, 7, 13)
    assert [s for s, r in enumerate(ref_cap) if r] == [0, 4, 8, 12]
    assert [s for s, c in enumerate(e_method.scaled) if c] == [3, 4, 6, 8, 9, 12]
    assert method.scaled == e_method.scaled
    for p, q in zip(m_eager.parameters(), m_cap.parameters()):
        assert torch.equal(p, q)
    assert method.epoch_fields([]) == {"fallbacks": 0}


def test_the_labels_are_torch_multinomials_draw():
    """The device-side draw gives torch.multinomial's labels from the same state."""
    x = torch.randn(50, 7, dtype=torch.float64, requires_grad=True) * 2
    torch.manual_seed(4)
    (g,) = fisher_output_grads(x, {"x": x}).values()
    torch.manual_seed(4)
    p = torch.softmax(x.detach(), 1)
    labels = torch.multinomial(p, 1, replacement=True).squeeze(1)
    assert torch.allclose(g, torch.eye(7, dtype=torch.float64)[labels] - p)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="groups=1"):
        check_layers({"c": nn.Conv2d(4, 4, 3, groups=2)})
    with pytest.raises(ValueError, match="must be a Conv2d or a Linear"):
        check_layers({"b": nn.BatchNorm2d(3)})
    with pytest.raises(ValueError, match="data must be"):
        EigenFactors().store({"a": torch.eye(2)})
    with pytest.raises(ValueError, match="stored eigenbasis"):
        EigenFactors().apply({"fc": nn.Linear(2, 2)}, 1e-3)
    with pytest.raises(ValueError, match="ran no forward"):
        LayerRecorder({"fc": nn.Linear(2, 2)}).take(["fc"])
    with pytest.raises(ValueError, match="logits must be"):
        fisher_output_grads(torch.zeros(3, 2), {})
    fc = nn.Linear(2, 2)
    rec = LayerRecorder({"fc": fc})
    torch.relu_(fc(torch.randn(3, 2)))
    with pytest.raises(ValueError, match="modified in place"):
        rec.take(["fc"])
    model = _net()
    pc = KFACPreconditioner(model, kind="ekfac")
    (z, y), = _batches(1)
    X = model(z)
    with pytest.raises(ValueError, match="outputs must be"):
        pc.step(nn.functional.cross_entropy(X, y), None, inputs=z)
    rec.remove()
    assert not fc._forward_hooks


def test_close_removes_the_hooks_and_a_closed_preconditioner_refuses_to_step():
    """close() leaves the model without EKFAC's forward hooks (KFAC has none)."""
    model = _net()
    layers = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    pc = KFACPreconditioner(model, kind="ekfac", update_freq=3, clip_norm=None)
    assert all(len(m._forward_hooks) == 1 for m in layers)
    (z, y), = _batches(1)
    _step(pc, model, z, y, seed=0)
    pc.close()
    assert all(len(m._forward_hooks) == 0 for m in layers)
    with pytest.raises(ValueError, match="ran no forward"):
        _step(pc, model, z, y, seed=0)
    KFACPreconditioner(_net(), kind="kfac").close()


def test_a_method_spec_takes_diag_freq_for_ekfac_only():
    from studies.cifar.methods import METHODS, check_method_spec

    assert METHODS["ekfac_s10"].spec["diag_freq"] == 10
    check_method_spec("x", {"optimizer": "sgd", "precond": "ekfac", "diag_freq": 3})
    for bad in ({"precond": "kfac", "diag_freq": 3},
                {"precond": "ekfac", "diag_freq": 0},
                {"precond": "ekfac", "diag_freq": 2.5}):
        with pytest.raises(ValueError, match="diag_freq"):
            check_method_spec("x", {"optimizer": "sgd", **bad})
