"""KWNGPreconditioner in a user's training loop (:mod:`kwng.engine.precond`).

Each test names, in its docstring, the silent misbehaviour of a plain loop that it
guards against: a gradient put into ``p.grad`` before the step, gradient accumulation,
a ``GradScaler``, a ``DistributedDataParallel`` model, a resumed run, a pickled model,
an optimizer over a subset of the parameters, parameter groups with their own step
sizes, ``loss.backward()`` before the step, a ``.grad`` the loop keeps, and
``mode="auto"``.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import kwng
from kwng.engine.config import AUTO_MODES, resolve_mode
from kwng.engine.distributed import DistributedKWNG
from kwng.engine.precond import (
    KWNGPreconditioner,
    backward_hint,
    is_compiled,
    predicted_decrease,
)
from studies.bench.mode_choice import ROWS, auto_modes
from studies.bench.mode_choice import main as mode_choice_main
from studies.cifar.nets import mlp, tiny_cnn

ROOT = Path(__file__).resolve().parents[1]
MODES = ("fast", "reference")


def _batch(N=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, 3, 8, 8, generator=g), torch.randint(0, 10, (N,), generator=g)


def _cnn(seed=0):
    torch.manual_seed(seed)
    return tiny_cnn(10, width=4)


def _pc(model, mode, seed=3, **kw):
    kw.setdefault("lr", 0.1)
    return KWNGPreconditioner(model, mode=mode, eps=1e-3,
                              generator=torch.Generator().manual_seed(seed), **kw)


def _step(model, pc, opt, seed, scaler=None):
    z, y = _batch(seed=seed)
    opt.zero_grad()
    X = model(z)
    loss = F.cross_entropy(X, y)
    pc.step(loss if scaler is None else scaler.scale(loss), X)
    if scaler is None:
        opt.step()
    else:
        scaler.step(opt)
        scaler.update()


def _flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


@pytest.mark.parametrize("mode", MODES)
def test_a_gradient_in_p_grad_before_the_step_is_added(mode):
    """Guards: a ``.grad`` filled before the step (an auxiliary loss's backward) was
    overwritten by the step, so the auxiliary loss silently did nothing."""
    z, y = _batch()
    m1, m2 = _cnn(), _cnn()
    pc1, pc2 = _pc(m1, mode), _pc(m2, mode)
    X = m1(z)
    pc1.step(F.cross_entropy(X, y), X)
    direction = _flat(p.grad for p in m1.parameters())
    aux = 0.5 * sum((p ** 2).sum() for p in m2.parameters())
    aux.backward()  # p.grad = p
    X = m2(z)
    pc2.step(F.cross_entropy(X, y), X)
    expected = direction + _flat(p.detach() for p in m2.parameters())
    assert torch.allclose(_flat(p.grad for p in m2.parameters()), expected,
                          rtol=1e-6, atol=1e-7)


def test_two_steps_without_an_optimizer_step_are_refused():
    """Guards: gradient accumulation (one ``step`` per micro-batch, one optimizer step
    per batch) silently kept the last micro-batch only."""
    m = _cnn()
    pc, opt = _pc(m, "fast"), torch.optim.SGD(m.parameters(), lr=0.1)
    opt.zero_grad()
    for seed in (0, 1):
        z, y = _batch(seed=seed)
        X = m(z)
        if seed == 1:
            with pytest.raises(ValueError, match="accumulation"):
                pc.step(F.cross_entropy(X, y), X)
        else:
            pc.step(F.cross_entropy(X, y), X)


def test_a_loop_without_zero_grad_replaces_the_previous_direction():
    """The direction of the previous step (still in ``p.grad`` when the loop does not
    call ``zero_grad``) is replaced, not added: the same parameters as with
    ``zero_grad``."""
    runs = []
    for zero in (True, False):
        m = _cnn()
        pc, opt = _pc(m, "fast"), torch.optim.SGD(m.parameters(), lr=0.1)
        for seed in range(3):
            z, y = _batch(seed=seed)
            if zero:
                opt.zero_grad()
            X = m(z)
            pc.step(F.cross_entropy(X, y), X)
            opt.step()
        runs.append(_flat(m.parameters()).detach())
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("mode", MODES)
def test_grad_scaler_steps_like_the_unscaled_loop(mode):
    """Guards: with a ``GradScaler`` the scaled direction was clipped before
    ``scaler.step`` unscaled it (updates 65,536 times too small)."""
    m1, m2 = _cnn(), _cnn()
    opt1 = torch.optim.SGD(m1.parameters(), lr=0.1)
    opt2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    pc1, pc2 = _pc(m1, mode, clip_norm=1.0), _pc(m2, mode, clip_norm=1.0,
                                                   grad_scaler=scaler)
    for seed in range(3):
        _step(m1, pc1, opt1, seed)
        _step(m2, pc2, opt2, seed, scaler)
    assert torch.allclose(_flat(m1.parameters()), _flat(m2.parameters()),
                          rtol=1e-6, atol=1e-8)
    assert pc1.eps == pc2.eps
    z, y = _batch()
    X = m2(z)
    with pytest.raises(ValueError, match="pass the scaled loss"):
        pc2.step(F.cross_entropy(X, y), X)



@pytest.mark.parametrize("mode", MODES)
def test_an_overflowed_scaled_step_is_skipped_by_the_scaler(mode):
    """A scaled gradient that overflows reaches ``p.grad`` as infinities, so that
    ``scaler.step`` skips the step and lowers the scale, as it does for SGD (the
    reference solve would otherwise refuse the non-finite ``g``)."""
    m = _cnn()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127)
    pc = _pc(m, mode, grad_scaler=scaler)
    before = _flat(m.parameters()).detach().clone()
    z, y = _batch()
    X = m(z)
    pc.step(scaler.scale(1e6 * F.cross_entropy(X, y)), X)  # ∇ of the scaled loss: inf
    scaler.step(opt)
    scaler.update()
    assert torch.equal(_flat(m.parameters()), before)
    assert scaler.get_scale() == 2.0 ** 126
    assert pc.counters()["fallbacks"] == 1


def test_a_ddp_model_is_refused_and_distributed_kwng_refuses_a_filled_grad(tmp_path):
    """Guards: ``KWNGPreconditioner`` on a ``DistributedDataParallel`` model ran without
    a word while the replicas drifted apart; the message points to
    ``kwng.DistributedKWNG``, which is exported and refuses a rank's own ``p.grad``
    (adding it would make the replicas drift too)."""
    assert kwng.DistributedKWNG is DistributedKWNG
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0,
                                world_size=1)
    try:
        model = mlp(4, 3)
        with pytest.raises(ValueError, match=r"kwng\.DistributedKWNG\(model\.module"):
            KWNGPreconditioner(nn.parallel.DistributedDataParallel(model), lr=0.1)
        pc = DistributedKWNG(model, lr=0.1, batch_sizes=8)
        sum((p ** 2).sum() for p in model.parameters()).backward()
        X = model(torch.randn(8, 4))
        with pytest.raises(ValueError, match="does not add it"):
            pc.step(F.cross_entropy(X, torch.zeros(8, dtype=torch.long)), X)
    finally:
        if started:
            dist.destroy_process_group()


@pytest.mark.parametrize("mode", MODES)
def test_a_resumed_run_draws_the_same_bases(mode):
    """Guards: ``state_dict()`` lacked the basis generator's state, so a run resumed
    from a checkpoint drew other bases and ended elsewhere (bit-exact resume)."""
    def run(model, opt, pc, seeds):
        for s in seeds:
            _step(model, pc, opt, s)

    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    m = _cnn()
    opt, pc = sgd(m), _pc(m, mode, seed=5)
    run(m, opt, pc, range(3))
    buf = io.BytesIO()
    torch.save({"model": m.state_dict(), "opt": opt.state_dict(),
                "pc": pc.state_dict()}, buf)
    run(m, opt, pc, range(3, 6))
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    m2 = _cnn(seed=1)
    opt2, pc2 = sgd(m2), _pc(m2, mode, seed=5)
    m2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    pc2.load_state_dict(ckpt["pc"])
    run(m2, opt2, pc2, range(3, 6))
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))
    assert pc2.state_dict() == pc.state_dict()


def test_a_pickled_model_runs_its_own_forward():
    """Guards: ``torch.save(model)`` with a fast-mode preconditioner attached pickled
    its hooks and patched layers; the loaded model ran every training forward on
    ``M + 1`` copies of the batch, with no preconditioner."""
    m = _cnn()
    pc = _pc(m, "fast")
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert all(type(x).__module__.startswith("torch.nn") for x in loaded.modules())
    seen = []
    conv = next(x for x in loaded.modules() if isinstance(x, nn.Conv2d))
    conv.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape[0]))
    z, y = _batch()
    assert loaded(z).shape == (16, 10) and seen == [16]
    fresh = _pc(loaded, "fast")  # a new preconditioner attaches to the loaded model
    X = loaded(z)
    fresh.step(F.cross_entropy(X, y), X)
    X = m(z)
    pc.step(F.cross_entropy(X, y), X)  # the original keeps its engine
    assert fresh.counters()["serial_steps"] == pc.counters()["serial_steps"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_params_restricts_the_metric_to_the_optimizers_parameters(mode):
    """Guards: with an optimizer over a subset of the parameters, the preconditioner
    solved with the metric of all of them and wrote ``.grad`` for all. With
    ``params=optimizer.param_groups`` the direction is that of a model whose other
    parameters are frozen, and the others' ``.grad`` stay empty."""
    z, y = _batch()
    m1 = _cnn()
    head = list(m1[-1].parameters())
    opt = torch.optim.SGD(head, lr=0.1)
    pc1 = _pc(m1, mode, params=opt.param_groups, clip_norm=None)
    X = m1(z)
    pc1.step(F.cross_entropy(X, y), X)
    m2 = _cnn()
    for p in m2[:-1].parameters():
        p.requires_grad_(False)
    pc2 = _pc(m2, mode, clip_norm=None)
    X = m2(z)
    pc2.step(F.cross_entropy(X, y), X)
    assert all(p.grad is None for p in m1[:-1].parameters())
    assert torch.allclose(_flat(p.grad for p in head),
                          _flat(p.grad for p in m2[-1].parameters()), rtol=1e-5,
                          atol=1e-8)
    with pytest.raises(ValueError, match="params must hold parameters of model"):
        _pc(m1, mode, params=[nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="params must be an iterable"):
        _pc(m1, mode, params=head[0])


def test_param_groups_with_their_own_step_sizes_enter_the_eps_rule():
    """Guards: parameter groups with different step sizes shared one step in the ε
    rule; the predicted decrease is ``Σ_k lr_k ⟨g_k, ĝ_k⟩``, each group's ``"lr"``
    read at every step (``lr=`` not needed)."""
    m = _cnn()
    body, head = list(m[:-1].parameters()), list(m[-1].parameters())
    opt = torch.optim.SGD([{"params": body, "lr": 0.1}, {"params": head, "lr": 0.01}])
    pc = KWNGPreconditioner(m, params=opt.param_groups, mode="reference", eps=1e-3,
                            clip_norm=None, generator=torch.Generator().manual_seed(3))
    z, y = _batch()
    X = m(z)
    loss = F.cross_entropy(X, y)
    g = _flat(torch.autograd.grad(loss, body + head, retain_graph=True))
    pc.step(loss, X)
    d = _flat(p.grad for p in body + head).double()
    q = sum(p.numel() for p in body)
    want = 0.1 * (g[:q].double() @ d[:q]) + 0.01 * (g[q:].double() @ d[q:])
    assert pc.lm.state_dict()["pred"] == pytest.approx(0.5 * float(want), rel=1e-5)
    params = body + head
    one = predicted_decrease([{"params": params, "lr": 0.3}], params, g, d.float(),
                             torch.tensor(2.0), lambda: 1.0)
    assert one[0] == 0.3 and float(one[1]) == 2.0


@pytest.mark.parametrize("mode", MODES)
def test_backward_before_step_is_named(mode):
    """Guards: the kfac-pytorch order ``loss.backward(); precond.step(...)`` gave
    autograd's "backward through the graph a second time", and with
    ``retain_graph=True`` counted ``g`` twice; both now say what to do."""
    m = _cnn()
    pc = _pc(m, mode)
    z, y = _batch()
    X = m(z)
    loss = F.cross_entropy(X, y)
    loss.backward()
    with pytest.raises(RuntimeError, match="runs the backward pass"):
        pc.step(loss, X)
    m.zero_grad()
    X = m(z)
    loss = F.cross_entropy(X, y)
    loss.backward(retain_graph=True)
    with pytest.raises(ValueError, match="already holds the gradient of the loss"):
        pc.step(loss, X)


def test_a_grad_the_loop_keeps_is_not_overwritten_by_the_next_step():
    """Guards: the ``.grad`` tensors are views of one buffer that the next step
    rewrote, so a ``.grad`` the loop kept after ``zero_grad`` changed under it."""
    m = _cnn()
    pc, opt = _pc(m, "fast"), torch.optim.SGD(m.parameters(), lr=0.1)
    _step(m, pc, opt, 0)
    kept = [p.grad for p in m.parameters()]
    saved = [k.clone() for k in kept]
    _step(m, pc, opt, 1)
    assert all(torch.equal(k, s) for k, s in zip(kept, saved))
    assert not torch.equal(_flat(kept), _flat(p.grad for p in m.parameters()))


def test_reference_mode_under_torch_compile_names_the_cause():
    """Guards: an autograd failure of ``mode="reference"`` (``M + 1`` backward passes
    through one graph) on a ``torch.compile``'d model surfaced as a raw torch error."""
    m = _cnn()
    assert is_compiled(torch.compile(m)) and not is_compiled(m)
    err = RuntimeError("an error inside torch")
    hint = backward_hint(err, compiled=True, mode="reference")
    assert "mode='fast'" in str(hint) and "an error inside torch" in str(hint)
    assert backward_hint(err, compiled=False, mode="reference") is err
    assert backward_hint(err, compiled=True, mode="fast") is err


def test_auto_mode_takes_the_measured_faster_path():
    """``mode="auto"`` takes :data:`AUTO_MODES` for the device and the model's kind,
    and that table agrees with the committed measurements
    (``results/benchmarks/mode_choice/``)."""
    cnn, dense = _cnn(), mlp(4, 3)
    cpu = torch.device("cpu")
    assert resolve_mode("auto", cpu, cnn) == AUTO_MODES["cpu"]["conv"]
    assert resolve_mode("auto", cpu, dense) == AUTO_MODES["cpu"]["dense"]
    assert resolve_mode("fast", cpu, cnn) == "fast"
    pc = KWNGPreconditioner(cnn, lr=0.1, mode="auto")
    assert pc.mode == AUTO_MODES["cpu"]["conv"]
    assert pc.hyperparameters()["mode"] == "auto"
    records = sorted((ROOT / "results" / "benchmarks" / "mode_choice").glob("*.json"))
    records = [r for r in records
               if r.name != "provenance.json" and ".backup-" not in r.name]
    assert any(r.name == "cpu.json" for r in records)
    for path in records:
        rec = json.loads(path.read_text())
        table = AUTO_MODES[rec["device_type"]]
        assert {k: table[k] for k in rec["auto_modes"]} == rec["auto_modes"], path
    with pytest.raises(ValueError, match="auto"):
        KWNGPreconditioner(cnn, lr=0.1, mode="fastest")


def test_bad_loop_arguments_are_named():
    m = _cnn()
    with pytest.raises(ValueError, match="grad_scaler must be a torch.amp.GradScaler"):
        KWNGPreconditioner(m, lr=0.1, grad_scaler=object())
    with pytest.raises(ValueError, match="'params' entry"):
        KWNGPreconditioner(m, lr=0.1, params=[{"lr": 0.1}])
    with pytest.raises(ValueError, match="lr is required"):
        KWNGPreconditioner(m, params=[{"params": list(m.parameters())}])
    with pytest.raises(ValueError, match="twice"):
        KWNGPreconditioner(m, lr=0.1, params=[*m.parameters(), *m.parameters()])


def test_mode_choice_times_both_paths_and_decides_per_kind(tmp_path):
    """The benchmark behind ``AUTO_MODES`` times SGD, ``fast`` and ``reference`` side
    by side and writes the verdict per model kind with provenance."""
    rows = [{"model": m, "kind": k, "mode": mode, "median_ms": t}
            for m, k, times in (("a", "conv", (1.0, 3.0, 2.0)),
                                ("b", "conv", (1.0, 2.0, 4.0)),
                                ("c", "dense", (1.0, 1.0, 4.0)))
            for mode, t in zip(ROWS, times)]
    verdict, ratios = auto_modes(rows)
    assert verdict == {"conv": "fast", "dense": "fast"}  # geometric mean √0.75 < 1
    assert ratios == {"a": 1.5, "b": 0.5, "c": 0.25}
    rows[1]["median_ms"] = 6.0  # a: fast / reference = 3, geometric mean √1.5 > 1
    assert auto_modes(rows)[0] == {"conv": "reference", "dense": "fast"}

    out = tmp_path / "cpu.json"
    rec = mode_choice_main(["--device", "cpu", "--models", "mlp", "--batch", "8",
                            "--steps", "2", "--warmup", "0", "--rounds", "2",
                            "--out", str(out)])
    assert [r["mode"] for r in rec["rows"]] == list(ROWS)
    assert set(rec["auto_modes"]) == {"dense"} and rec["provenance"]["command"]
    assert json.loads(out.read_text())["auto_modes"] == rec["auto_modes"]
    with pytest.raises(SystemExit):
        mode_choice_main(["--device", "cpu", "--models", "mlp", "--out", str(out)])
    with pytest.raises(SystemExit):
        mode_choice_main(["--models", "vgg", "--out", str(tmp_path / "x.json")])
