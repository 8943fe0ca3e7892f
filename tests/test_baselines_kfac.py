"""KFAC's capturable step (:mod:`studies.cifar.kfac_factors`): the step between
refreshes with its own ops gives nngeometry's direction bit for bit (float64), a refresh
rewrites the factor buffers in place, a non-finite direction falls back on the device,
channels_last gives the same step, and the host-side schedule of a captured loop
(recorded step between refreshes, eager refresh steps) trains exactly as the eager
loop, through :class:`~studies.cifar.steps.StepRunner` with stand-ins for the
CUDA parts."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from kwng.engine.capture import amortized_replay, warmup_kind, warmup_steps
from kwng.engine.precond import SystemCache
from studies.cifar import steps
from studies.cifar.kfac_factors import FactorSchedule, InverseFactors
from studies.cifar.nets import ConditionedNetwork, DiagonalConditioning

pytest.importorskip("nngeometry")

from studies.cifar import baselines
from studies.cifar.baselines import KFACPreconditioner  # noqa: E402


def _net(seed: int = 0) -> ConditionedNetwork:
    """Conv2d with and without bias, BatchNorm, Linear with and without bias, U."""
    torch.manual_seed(seed)
    body = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 5, 3, stride=2, bias=False), nn.BatchNorm2d(5), nn.ReLU(),
        nn.Flatten(), nn.Linear(45, 6, bias=False), nn.ReLU(), nn.Linear(6, 4))
    return ConditionedNetwork(body, DiagonalConditioning(4, 1e3)).double()


def _batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(10, 3, 8, 8, generator=g, dtype=torch.float64),
             torch.randint(0, 4, (10,), generator=g)) for _ in range(n)]


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


class _NNGeometryKFAC(KFACPreconditioner):
    """The direction through nngeometry's objects:
    ``PMatKFAC.inverse(regul=damping).mv(g)`` on every step."""

    def step(self, loss, outputs=None, inputs=None):
        loss.backward()
        refresh = self.schedule.refresh_now()
        if refresh:
            self._fisher_passes(inputs)
        inverse = self.fim.inverse(regul=self.damping)
        dd = inverse.mv(self._grad_pvector()).to_dict()
        for name, mod in self.modules.items():
            mod.weight.grad.copy_(dd[name][0])
            if mod.bias is not None:
                mod.bias.grad.copy_(dd[name][1])
        baselines.clip_grad_norm(list(self.model.parameters()), self.clip_norm)
        self.schedule.advance()
        return {"refreshed": int(refresh)}


def _train(pc_class, batches, clip_norm, channels_last=False, **kw):
    model = _net()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 if clip_norm else 1e-3,
                          momentum=0.9)
    pc = pc_class(model, kind="kfac", update_freq=3, clip_norm=clip_norm, **kw)
    torch.manual_seed(7)  # the Monte-Carlo labels of the refreshes
    out = []
    for z, y in batches:
        if channels_last:
            z = z.contiguous(memory_format=torch.channels_last)
        opt.zero_grad()
        X = model(z)
        info = pc.step(nn.functional.cross_entropy(X, y), X, inputs=z)
        out.append((_grads(model), info["refreshed"]))
        opt.step()
    return out, model, pc


@pytest.mark.parametrize("clip_norm", [None, 1.0])
def test_the_own_ops_step_is_nngeometrys_direction_bit_for_bit(clip_norm):
    """7 steps of update_freq = 3 (refreshes at 0, 3, 6): every preconditioned
    gradient, BatchNorm's plain ones included, equals the nngeometry path's."""
    batches = _batches(7)
    got, _, pc = _train(KFACPreconditioner, batches, clip_norm)
    want, _, _ = _train(_NNGeometryKFAC, batches, clip_norm)
    assert [r for _, r in got] == [r for _, r in want] == [1, 0, 0, 1, 0, 0, 1]
    for s, ((g, _), (w, _)) in enumerate(zip(got, want)):
        assert all(torch.equal(a, b) for a, b in zip(g, w)), f"step {s}"
    assert pc.steps == 7 and not pc.schedule.due


def test_a_refresh_rewrites_the_factor_buffers_in_place():
    """The buffers a graph reads keep their addresses: a refresh and a load copy new
    factors into them; a step between refreshes leaves them alone."""
    batches = _batches(4)
    model = _net()
    pc = KFACPreconditioner(model, kind="kfac", update_freq=2)
    ptrs, values = None, []
    for z, y in batches:
        X = model(z)
        model.zero_grad()
        pc.step(nn.functional.cross_entropy(X, y), X, inputs=z)
        bufs = [t for pair in pc.factors.buffers.values() for t in pair]
        ptrs = ptrs or [t.data_ptr() for t in bufs]
        assert [t.data_ptr() for t in bufs] == ptrs
        values.append([t.clone() for t in bufs])
    assert all(torch.equal(a, b) for a, b in zip(values[0], values[1]))
    assert not all(torch.equal(a, b) for a, b in zip(values[1], values[2]))
    state = pc.state_dict()
    pc.factors.store({k: (a * 0, g * 0) for k, (a, g) in state["inverse_data"].items()})
    pc.load_state_dict(state)
    bufs = [t for pair in pc.factors.buffers.values() for t in pair]
    assert [t.data_ptr() for t in bufs] == ptrs
    assert all(torch.equal(a, b) for a, b in zip(bufs, values[3]))
    assert pc.steps == 4 and pc.schedule.ready and pc.schedule.due


def test_the_step_between_refreshes_uses_no_nngeometry_and_falls_back_on_device(
        monkeypatch):
    """Between refreshes no nngeometry object is touched; a non-finite direction
    leaves every gradient plain and returns fallback 1 as a device tensor."""
    model = _net()
    pc = KFACPreconditioner(model, kind="kfac", update_freq=5, clip_norm=None)
    (z, y), (z1, y1) = _batches(2)
    X = model(z)
    pc.step(nn.functional.cross_entropy(X, y), X, inputs=z)

    def refuse():
        raise AssertionError("nngeometry used between refreshes")

    monkeypatch.setattr(baselines, "_nngeometry", refuse)
    next(iter(pc.factors.buffers.values()))[0][0, 0] = float("nan")
    model.zero_grad()
    X = model(z1)
    plain = torch.autograd.grad(nn.functional.cross_entropy(X, y1),
                                list(model.parameters()), retain_graph=True)
    info = pc.step(nn.functional.cross_entropy(X, y1), X, inputs=z1)
    assert isinstance(info["fallback"], torch.Tensor) and int(info["fallback"]) == 1
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain))


def test_channels_last_gives_the_same_step():
    """A channels_last network (its conv gradients are not views of an (out, ·)
    matrix) takes the same steps as the NCHW one, refreshes included."""
    batches = _batches(4)
    got, m1, _ = _train(KFACPreconditioner, batches, 1.0, channels_last=True)
    want, m2, _ = _train(KFACPreconditioner, batches, 1.0)
    assert m1.body[0].weight.grad.is_contiguous(memory_format=torch.channels_last)
    for (g, _), (w, _) in zip(got, want):
        assert all(torch.allclose(a, b, rtol=1e-9, atol=1e-12) for a, b in zip(g, w))


def test_schedule_and_buffers_refuse_bad_arguments():
    with pytest.raises(ValueError, match=r"every must be an integer in \[1, inf\]"):
        FactorSchedule(0)
    with pytest.raises(ValueError, match="every = 1"):
        with FactorSchedule(1).forced(False):
            pass
    with pytest.raises(ValueError, match="refresh must be True or False"):
        with FactorSchedule(3).forced(1):
            pass
    sched = FactorSchedule(3)
    with sched.forced(False), pytest.raises(ValueError, match="refresh step first"):
        sched.refresh_now()
    with pytest.raises(ValueError, match="data must map each layer name"):
        InverseFactors().store({"a": torch.eye(2)})
    with pytest.raises(ValueError, match="modules must be layers with stored"):
        InverseFactors().apply({"fc": nn.Linear(2, 2)})
    with pytest.raises(ValueError, match="eager must be the step"):
        amortized_replay(FactorSchedule(3), lambda: None)
    pc = KFACPreconditioner(_net(), kind="kfac", update_freq=1)
    assert pc.cache is None
    assert KFACPreconditioner(_net(), kind="ekfac", diag_freq=2).cache.kinds == (
        "scale", False)
    with pytest.raises(ValueError, match="refresh must be True or False, got 'scale'"):
        with FactorSchedule(3).forced("scale"):
            pass
    with pytest.raises(ValueError, match="or 'scale', got 'x'"):
        with FactorSchedule(3, sub_every=2).forced("x"):
            pass
    with pytest.raises(ValueError, match=r"sub_every must be an integer in \[1, inf\]"):
        FactorSchedule(3, sub_every=0)
    with pytest.raises(ValueError, match="state must be a state_dict of kind='kfac'"):
        pc.load_state_dict({"kind": "ekfac", "steps": 0})


class _Graph:
    def __init__(self, kind, log):
        self.kind, self.log = kind, log

    def replay(self):
        self.log.append(self.kind)


def test_the_replay_runs_due_refreshes_eagerly_and_replays_the_rest():
    """:func:`kwng.engine.capture.amortized_replay` with a schedule whose refresh cannot
    be captured: only the step between refreshes is recorded, the counter is left where
    the warm-up put it, a due refresh runs the eager step (which counts itself) and
    the replay says whether a graph ran; the warm-up follows the schedule."""
    cache = FactorSchedule(4)
    cache.ready, cache.steps = True, 3  # after a warm-up of three steps
    log, recorded = [], []

    def record():
        recorded.append(cache.due)
        cache.advance()  # the recorded step's Python counts it
        return _Graph("cached", log)

    def eager():
        log.append("eager")
        cache.advance()

    replay = amortized_replay(cache, record, eager=eager)
    assert recorded == [False] and cache.steps == 3
    ran = [replay() for _ in range(7)]
    assert log == ["cached", "eager", "cached", "cached", "cached", "eager", "cached"]
    assert ran == [x == "cached" for x in log] and cache.steps == 10
    assert isinstance(warmup_kind(cache, 0), contextlib.nullcontext)
    kw = SystemCache(3)
    with warmup_kind(kw, 0):
        assert kw.due
    with warmup_kind(kw, 1):
        assert not kw.due


def test_a_schedule_with_scalings_every_k_steps_names_three_kinds():
    """``FactorSchedule(every=6, sub_every=3)``: refreshes at 0 and 6 (eager, kind
    ``None``), the scalings re-estimated at 3 and 9 ("scale"), the other steps plain
    (``False``); the replay records the two programs between refreshes and runs each
    where the counter names it; the warm-up follows the schedule."""
    cache = FactorSchedule(6, sub_every=3)
    names = []
    for s in range(12):
        cache.ready, cache.steps = s > 0, s
        names.append(cache.kind)
    assert names == [None, False, False, "scale", False, False,
                     None, False, False, "scale", False, False]
    assert cache.kinds == ("scale", False)
    with cache.forced("scale"):
        assert cache.sub_due and not cache.due and cache.kind == "scale"
    with cache.forced(True):
        assert cache.due and cache.sub_due and cache.kind is None
    cache.ready, cache.steps, log, recorded = True, 4, [], []

    def record():
        recorded.append(cache.kind)
        cache.advance()
        return _Graph(cache.kind, log)

    def eager():
        log.append("eager")
        cache.advance()

    replay = amortized_replay(cache, record, eager=eager)
    assert recorded == ["scale", False] and cache.steps == 4
    for _ in range(8):
        replay()
    assert log == [False, False, "eager", False, False, "scale", False, False]
    assert all(isinstance(warmup_kind(cache, i), contextlib.nullcontext)
               for i in range(4))
    assert warmup_steps(cache) == 2 and warmup_steps(SystemCache(3)) == 2


class _Stream:
    def wait_stream(self, other):
        pass


def _fake_cuda(monkeypatch, cache):
    """CUDA's streams as no-ops, and a graph whose replay runs the recorded kind of
    step (the counter left to the runner, as a replay runs no Python)."""
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a: _Stream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)

    class Graph:
        def __init__(self, fn):
            self.fn, self.kind = fn, cache._forced  # recorded under forced(kind)

        def replay(self):
            n = cache.steps
            with cache.forced(self.kind):
                self.fn()
            cache.steps = n

    monkeypatch.setattr(steps, "record_graph", Graph)


def _runner_run(batches, capture, monkeypatch):
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pc = KFACPreconditioner(model, kind="kfac", update_freq=4)
    method = steps.KFACStep(model, opt, pc)
    refreshed = []

    def step_fn(z, y):
        refreshed.append(pc.schedule.due)
        steps.train_step(method, model, z, y)

    runner = steps.StepRunner(step_fn, torch.device("cpu"), False, lambda: 0.1,
                              cache=pc.cache)
    if capture:
        _fake_cuda(monkeypatch, pc.cache)
        runner.capture = True
    torch.manual_seed(7)
    for z, y in batches:
        runner(z, y)
    return model, runner, refreshed, method


def test_a_captured_kfac_loop_trains_as_the_eager_one(monkeypatch):
    """:class:`StepRunner` with KFAC's schedule (update_freq = 4, 11 steps): three
    eager warm-up steps on the schedule (a refresh first), one recording, then the
    steps between refreshes replayed and the refreshes (4, 8) run eagerly; the
    parameters equal the eager loop's bit for bit."""
    batches = _batches(11)
    m_eager, r_eager, ref_eager, _ = _runner_run(batches, False, monkeypatch)
    m_cap, r_cap, ref_cap, method = _runner_run(batches, True, monkeypatch)
    assert method.capturable and r_cap.captures == 1
    assert (r_cap.eager, r_cap.replays, r_eager.eager) == (5, 6, 11)
    assert [s for s, r in enumerate(ref_eager) if r] == [0, 4, 8]
    assert [s for s, r in enumerate(ref_cap) if r] == [0, 4, 8]
    for p, q in zip(m_eager.parameters(), m_cap.parameters()):
        assert torch.equal(p, q)
    assert method.epoch_fields([]) == {"fallbacks": 0}


def test_the_trainer_keeps_channels_last_for_kfac_and_ekfac(tmp_path):
    """KFAC and EKFAC (both reshape the gradients themselves) train in channels_last
    when asked."""
    from studies.cifar import train

    for method, want in (("kfac", True), ("ekfac", True)):
        cfg = {"source": "sample", "model": "tiny", "batch_size": 50, "epochs": 1,
               "lr": 0.1, "device": "cpu", "method": method, "conditioning": "ill",
               "train_subset": 100, "val_size": 50, "schedule": "authors",
               "channels_last": True, "out": str(tmp_path / method / "res"),
               "checkpoint_dir": str(tmp_path / method / "ck")}
        rec = train.run(cfg, progress=False)
        assert rec["channels_last"] is want and rec["complete"]
        assert rec["epochs"][-1]["fallbacks"] == 0
