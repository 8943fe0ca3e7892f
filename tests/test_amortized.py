"""``refresh_every = k`` (``kwng.engine.precond.SystemCache``): the exact step at
``k = 1``, the cached system applied to the fresh gradient in between (float64),
descent, the state of a resumed run, the arguments, and the host-side choice between
the two captured graphs."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from kwng import solve
from kwng.engine.capture import amortized_replay, warmup_kind
from kwng.engine.config import KWNGConfig
from kwng.engine.precond import KWNGPreconditioner, SystemCache
from studies.cifar.nets import mlp, tiny_cnn

MODES = [("fast", False), ("fast", True), ("reference", False), ("reference", True)]


def _batches(n, N=16, d_in=6, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(N, d_in, generator=g, dtype=dtype),
             torch.randint(0, 4, (N,), generator=g)) for _ in range(n)]


def _mlp(seed=0):
    torch.manual_seed(seed)
    return mlp(6, 4, hidden=8, depth=2).double()


def _flat_grad(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()
                      if p.grad is not None]).clone()


def _fresh_gradient(model, z, y):
    """``∇L`` of ``model`` at ``(z, y)`` from a plain copy (its forward is the model's
    own, its parameters the same)."""
    twin = copy.deepcopy(model)
    loss = nn.functional.cross_entropy(twin(z), y)
    return torch.cat([p.reshape(-1)
                      for p in torch.autograd.grad(loss, list(twin.parameters()))])


def _run(model, batches, opt=None, pc=None, **kw):
    """Steps of SGD + KWNG over ``batches``; the directions, infos and the objects."""
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.05)
    kw.setdefault("generator", torch.Generator().manual_seed(3))
    pc = pc or KWNGPreconditioner(model, lr=0.05, num_basis=3, eps=1e-2, **kw)
    dirs, infos = [], []
    for z, y in batches:
        opt.zero_grad()
        X = model(z)
        info = pc.step(nn.functional.cross_entropy(X, y), X)
        dirs.append(_flat_grad(model))
        infos.append(info)
        opt.step()
    return dirs, infos, opt, pc


@pytest.mark.parametrize("mode,diagonal_only", MODES)
def test_k1_caches_nothing_and_a_refresh_step_is_the_exact_step(mode, diagonal_only):
    """k = 1 (the default) stores no system and keeps the replicated forward on; the
    first step of k = 5 (a refresh) is the k = 1 step bit for bit."""
    batches = _batches(4)
    kw = {"mode": mode, "diagonal_only": diagonal_only, "damping": "T"}
    d1, _, _, pc1 = _run(_mlp(), batches, **kw)
    d_default, _, _, _ = _run(_mlp(), batches, refresh_every=1, **kw)
    assert all(torch.equal(a, b) for a, b in zip(d1, d_default))
    assert pc1.cache.T is None and pc1.state_dict()["cache"] is None
    assert pc1._engine is None or pc1._engine.enabled
    d5, _, _, _ = _run(_mlp(), batches[:1], refresh_every=5, **kw)
    assert torch.equal(d5[0], d1[0])


@pytest.mark.parametrize("mode,diagonal_only", MODES)
def test_a_step_between_refreshes_is_prop6_with_the_cached_system(mode, diagonal_only):
    """Step 1 of k = 3 is Prop. 6 (then the safeguard) evaluated in float64 with the
    T, CCᵀ, K of step 0 and step 1's own gradient and ε; the basis is not redrawn."""
    batches = _batches(2)
    model = _mlp()
    _, _, opt, pc = _run(model, batches[:1], mode=mode, diagonal_only=diagonal_only,
                         refresh_every=3, clip_norm=0.5)
    T, CCt, K, N = (pc.cache.T.clone(), pc.cache.CCt.clone(), pc.cache.K.clone(),
                    pc.cache.N)
    gen_state = pc.generator.get_state()
    z, y = batches[1]
    g = _fresh_gradient(model, z, y)
    d, infos, _, _ = _run(model, batches[1:], opt=opt, pc=pc)
    eps = float(infos[0]["eps"])
    want = solve.kwng_direction(T, CCt, K, g, N, eps=eps, damping="T_tilde",
                                whitening="eig", diagonal_only=diagonal_only,
                                fallback=False).direction
    want = solve.safeguard(g, want, 0.5).direction
    assert torch.allclose(d[0], want, rtol=1e-9, atol=1e-12 * float(want.norm()))
    assert torch.equal(pc.cache.T, T)
    assert torch.equal(pc.generator.get_state(), gen_state)
    assert pc.counters()["serial_steps"] == 0 and not bool(infos[0]["fallback"])


@pytest.mark.parametrize("mode,diagonal_only", MODES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_amortized_step_is_a_descent_direction(mode, diagonal_only, seed):
    """gᵀd > 0 with the fresh gradient g on every step of k = 4 (refresh or not), on
    random networks and data, without the safeguard's fallback."""
    torch.manual_seed(seed)
    model = tiny_cnn(4, width=3).double() if seed == 2 else _mlp(seed)
    if seed == 2:
        g = torch.Generator().manual_seed(seed)
        batches = [(torch.randn(12, 3, 6, 6, generator=g, dtype=torch.float64),
                    torch.randint(0, 4, (12,), generator=g)) for _ in range(6)]
    else:
        batches = _batches(6, seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    pc = KWNGPreconditioner(model, lr=0.05, num_basis=3, eps=1e-3, mode=mode,
                            diagonal_only=diagonal_only, refresh_every=4, clip_norm=1.0,
                            generator=torch.Generator().manual_seed(seed))
    for z, y in batches:
        g = _fresh_gradient(model, z, y)
        opt.zero_grad()
        X = model(z)
        info = pc.step(nn.functional.cross_entropy(X, y), X)
        assert float(g @ _flat_grad(model)) > 0 and not bool(info["fallback"])
        opt.step()
    assert pc.num_steps == 6 and pc.cache.steps == 6


def _restored(buf, kw):
    """The checkpoint in ``buf`` (model, optimizer, preconditioner) loaded by
    ``torch.load(weights_only=True)`` into fresh objects: ``(saved, model, opt,
    pc)``."""
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model = _mlp(seed=5)
    model.load_state_dict(saved["model"])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    opt.load_state_dict(saved["opt"])
    pc = KWNGPreconditioner(model, lr=0.05, num_basis=3, eps=1e-2,
                            generator=torch.Generator(), **kw)
    pc.load_state_dict(saved["precond"])
    return saved, model, opt, pc


@pytest.mark.parametrize("mode", ["fast", "reference"])
def test_state_dict_round_trips_the_cache_and_a_resumed_run_replays(mode):
    """Stopped after 4 steps of k = 3 (the next step reuses the cache) and resumed from
    the saved states through torch.save/torch.load(weights_only=True): steps 4..7 take
    the uninterrupted run's directions bit for bit."""
    batches = _batches(8)
    kw = {"mode": mode, "refresh_every": 3}
    model = _mlp()
    _, _, opt, pc = _run(model, batches[:4], **kw)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "precond": pc.state_dict()}, buf)
    assert pc.state_dict()["cache"]["N"] == 16
    want, _, _, _ = _run(model, batches[4:], opt=opt, pc=pc)
    saved, model2, opt2, pc2 = _restored(buf, kw)
    assert pc2.cache.steps == 4 and not pc2.cache.due
    got, _, _, _ = _run(model2, batches[4:], opt=opt2, pc=pc2)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    pc2.load_state_dict({**saved["precond"], "cache": None})  # no system: refresh
    assert pc2.cache.T is None and pc2.cache.due
    with pytest.raises(ValueError, match="state\\['cache'\\] must be None or a dict"):
        pc2.load_state_dict({**saved["precond"], "cache": {"T": 1}})


def test_fast_mode_replicates_the_forward_before_refresh_steps_only():
    model = _mlp()
    batches = _batches(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    pc = KWNGPreconditioner(model, lr=0.05, num_basis=3, refresh_every=2, mode="fast")
    for s, (z, y) in enumerate(batches):
        opt.zero_grad()
        X = model(z)
        assert (pc._engine.first is not None) == (s % 2 == 0)
        pc.step(nn.functional.cross_entropy(X, y), X)
        opt.step()
    assert pc.counters()["serial_steps"] == 0


def test_a_frozen_parameter_forces_a_refresh():
    model = _mlp()
    batches = _batches(3)
    _, _, opt, pc = _run(model, batches[:1], mode="reference", refresh_every=5)
    model[0].bias.requires_grad_(False)
    model[0].bias.grad = None
    _, infos, _, _ = _run(model, batches[1:2], opt=opt, pc=pc)
    q = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert pc.cache.T.shape[-1] == q and int(infos[0]["rank"]) == 3


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "3", None])
def test_bad_refresh_every_is_refused_naming_the_argument_and_range(bad):
    msg = r"refresh_every must be an integer in \[1, inf\)"
    with pytest.raises(ValueError, match=msg):
        KWNGConfig(refresh_every=bad)
    with pytest.raises(ValueError, match="refresh_every"):
        KWNGPreconditioner(nn.Linear(3, 2), lr=0.1, refresh_every=bad)


def test_forcing_a_cached_step_needs_a_cache_and_k_above_1():
    with pytest.raises(ValueError, match="refresh_every = 1"):
        with SystemCache(1).forced(False):
            pass
    cache = SystemCache(3)
    with pytest.raises(ValueError, match="refresh must be True or False"):
        with cache.forced(1):
            pass
    with cache.forced(False):
        with pytest.raises(ValueError, match="run a refresh step first"):
            cache.refresh_now(10, torch.device("cpu"))


class _Graph:
    def __init__(self, kind, log):
        self.kind, self.log = kind, log

    def replay(self):
        self.log.append(self.kind)


def test_the_replay_picks_the_refresh_graph_every_k_steps_on_the_host():
    """:func:`kwng.engine.capture.amortized_replay` (capture_step's CUDA part aside):
    one graph of each kind recorded under ``forced``, the counter left where the
    warm-up put it, then replays in the schedule ``s % k == 0``."""
    seen = []
    cache = SystemCache(3, on_due=seen.append)
    cache.store(torch.zeros(2, 5), torch.eye(2), torch.eye(2), 8, torch.tensor(1.0))
    cache.steps = 2  # after a warm-up of two steps
    log, recorded = [], []

    def record():
        recorded.append(cache.due)
        return _Graph("refresh" if cache.due else "cached", log)

    replay = amortized_replay(cache, record)
    assert recorded == [True, False] and cache.steps == 2 and seen[-1] is False
    for _ in range(7):
        replay()
    assert log == ["cached", "refresh", "cached", "cached", "refresh", "cached",
                   "cached"]
    assert cache.steps == 9


def _warm_up(cache: SystemCache, n: int) -> list[bool]:
    """The kinds of ``n`` warm-up steps of a captured loop
    (:func:`kwng.engine.capture.warmup_kind`), each step storing a system when it
    refreshes and counting itself, as the preconditioner's step does."""
    kinds = []
    for i in range(n):
        with warmup_kind(cache, i):
            kinds.append(cache.due)
            if cache.due:
                cache.store(torch.zeros(2, 5), torch.eye(2), torch.eye(2), 8,
                            torch.tensor(1.0))
        cache.advance()
    return kinds


@pytest.mark.parametrize("k", [2, 3, 5, 100])
def test_a_captured_warm_up_from_step_0_takes_the_eager_loops_kinds(k):
    """From step 0 the warm-up of a captured loop refreshes exactly where the eager
    loop does (so that the two loops take the same steps), and still runs both kinds
    before their recording."""
    eager = [s % k == 0 for s in range(5)]
    assert _warm_up(SystemCache(k), 5) == eager
    assert {True, False} <= set(_warm_up(SystemCache(k), 2))


def test_a_captured_warm_up_resumed_between_refreshes_forces_one_refresh():
    """Resumed at step 7 of k = 5 with a cached system: the first warm-up step is
    forced to refresh (its graph must run before it is recorded), the rest follow the
    schedule (a refresh at step 10)."""
    cache = SystemCache(5)
    cache.store(torch.zeros(2, 5), torch.eye(2), torch.eye(2), 8, torch.tensor(1.0))
    cache.steps = 7
    assert _warm_up(cache, 4) == [True, False, False, True]


# ------------------------------------------------------------------------ the guard
def _refresh_steps(pc, model, batches, opt=None, spoil_at=None, spoil=None):
    """The indices of the refresh steps of a loop over ``batches`` (``spoil(pc)`` is
    applied to the cache after step ``spoil_at``)."""
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.05)
    kinds = []
    for i, (z, y) in enumerate(batches):
        opt.zero_grad()
        kinds.append(pc.cache.due)
        X = model(z)
        pc.step(nn.functional.cross_entropy(X, y), X)
        opt.step()
        if i == spoil_at:
            spoil(pc)
    return [i for i, r in enumerate(kinds) if r]


def _spoil(pc):
    pc.cache.T.fill_(float("nan"))


@pytest.mark.parametrize("mode,diagonal_only", MODES)
def test_a_guard_that_never_fires_takes_the_unguarded_steps_bit_for_bit(
        mode, diagonal_only):
    """A healthy run (no rank-deficient system, no fallback): the guard changes
    nothing."""
    batches = _batches(9)
    kw = {"mode": mode, "diagonal_only": diagonal_only, "refresh_every": 4}
    want, infos, _, _ = _run(_mlp(), batches, **kw)
    assert not any(bool(i["fallback"]) or bool(i.get("ill_conditioned", False))
                   for i in infos)
    got, _, _, pc = _run(_mlp(), batches, refresh_guard=True, **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert pc.cache.guard_refreshes == 0


def _info(fallback=False, ill=False):
    t = torch.tensor
    return {"fallback": t(fallback), "ill_conditioned": t(ill)}


def test_the_guard_refreshes_two_steps_after_a_rank_deficient_system_or_a_fallback():
    """The cache alone, steps of constructed infos, k = 12: the refresh at step 0 is
    rank deficient, so step 2 refreshes; a fallback at step 5 makes step 7 refresh; a
    flag raised on the step just before a refresh is spent by that refresh; the
    counter's own refresh (step 12) stays."""
    cache = SystemCache(12, guard=True)
    cache.store(torch.ones(2, 3), torch.eye(2), torch.eye(2), 4, torch.tensor(1.0))
    ill, fall = {0}, {5, 11}
    refreshes = []
    for s in range(14):
        if cache.refresh_now(3, torch.device("cpu")):
            refreshes.append(s)
        cache.observe(_info(fallback=s in fall, ill=s in ill))
        cache.advance()
    assert refreshes == [0, 2, 7, 12]
    assert cache.guard_refreshes == 2


@pytest.mark.parametrize("diagonal_only", [False, True])
def test_a_failed_cached_system_makes_the_guard_refresh_two_steps_later(diagonal_only):
    """After step 1 the cached ``T`` is spoiled (NaN: the direction fails and the
    safeguard falls back to ``g``). Step 2 raises the flag, the host reads it at the
    end of step 3, step 4 refreshes; without the guard the next refresh is the
    counter's, step 10."""
    batches = _batches(12)
    for guard, want in ((False, [0, 10]), (True, [0, 4, 10])):
        model = _mlp()
        pc = KWNGPreconditioner(model, lr=0.05, num_basis=3, eps=1e-2,
                                refresh_every=10, refresh_guard=guard,
                                diagonal_only=diagonal_only,
                                generator=torch.Generator().manual_seed(3))
        got = _refresh_steps(pc, model, batches, spoil_at=1, spoil=_spoil)
        assert got == want, (guard, got)
        assert pc.cache.guard_refreshes == int(guard)


def test_a_run_resumed_with_a_raised_flag_refreshes_where_the_uninterrupted_one_does():
    """Saved at the end of step 2, whose flag is raised but not yet read: the resumed
    run reads it at the end of step 3 and refreshes at step 4, as the uninterrupted
    run; both take the same directions bit for bit."""
    batches = _batches(8)
    kw = {"refresh_every": 10, "refresh_guard": True}
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    pc = KWNGPreconditioner(model, lr=0.05, num_basis=3, eps=1e-2,
                            generator=torch.Generator().manual_seed(3), **kw)
    _refresh_steps(pc, model, batches[:3], opt=opt, spoil_at=1, spoil=_spoil)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "precond": pc.state_dict()}, buf)
    assert pc.state_dict()["cache"]["guard"]["pending"] is True
    want, _, _, _ = _run(model, batches[3:], opt=opt, pc=pc)
    saved, model2, opt2, pc2 = _restored(buf, kw)
    assert not pc2.cache.due
    got, _, _, _ = _run(model2, batches[3:4], opt=opt2, pc=pc2)
    assert pc2.cache.due and pc2.cache.steps == 4  # the flag of step 2 was read
    got += _run(model2, batches[4:], opt=opt2, pc=pc2)[0]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert pc2.cache.guard_refreshes == pc.cache.guard_refreshes == 1


@pytest.mark.parametrize("bad", [1, 1.0, "yes", None])
def test_bad_refresh_guard_is_refused_naming_the_argument_and_range(bad):
    with pytest.raises(ValueError, match="refresh_guard must be True or False"):
        KWNGConfig(refresh_every=5, refresh_guard=bad)
    with pytest.raises(ValueError, match="refresh_guard=True needs refresh_every > 1"):
        KWNGConfig(refresh_guard=True)


def test_a_replayed_loop_refreshes_where_the_guard_says():
    """Captured (:func:`kwng.engine.capture.amortized_replay`): each recorded graph
    runs the guard's device part (here a replay calls ``observe`` with that step's
    fallback); the host reads the flags between replays, so the refresh graph runs
    two steps after a step that fell back, as eagerly."""
    cache = SystemCache(10, guard=True)
    cache.store(torch.zeros(2, 5), torch.eye(2), torch.eye(2), 8, torch.tensor(1.0))
    falls = iter([False, False, True, False, False, False, False, False])
    log = []

    class Graph:
        def __init__(self, refresh):
            self.refresh = refresh

        def replay(self):
            log.append(self.refresh)
            cache.observe(_info(fallback=next(falls)))

    replay = amortized_replay(cache, lambda: Graph(cache.due))
    for _ in range(8):
        replay()
    assert log == [True, False, False, False, True, False, False, False]
    assert cache.guard_refreshes == 1


def test_the_guard_switched_on_a_live_preconditioner_takes_effect():
    """``precond.config = precond.config.replace(refresh_guard=True)`` between steps:
    the next steps are guarded (a failed cached system refreshes two steps later) and
    the checkpoint records the guard."""
    batches = _batches(8)
    model = _mlp()
    pc = KWNGPreconditioner(model, lr=0.05, num_basis=3, eps=1e-2, refresh_every=10,
                            generator=torch.Generator().manual_seed(3))
    _refresh_steps(pc, model, batches[:1])
    pc.config = pc.config.replace(refresh_guard=True)
    assert pc.cache.guard and pc.state_dict()["hyperparameters"]["refresh_guard"]
    got = _refresh_steps(pc, model, batches[1:], spoil_at=1, spoil=_spoil)
    assert got == [0, 4] and pc.cache.guard_refreshes == 1
