"""Exactness of the fast (replicated) KWNG path against serial autograd on the paper's
ResNet-18.

For each configuration (fp32 NCHW / fp32 channels_last with TF32 off, bf16 autocast +
channels_last) one batch in train mode: g and the M rows of T from the replicated
backward vs serial ``torch.autograd.grad`` calls of the same model in fp32, and the
final KWNG direction of both modes with the same basis. Prints relative errors and the
cosine; ``--json`` writes them::

    python -m studies.bench.precond_exactness [--device cuda] \\
        [--batch 128] [--num-basis 5]
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch
from torch import nn

from kwng.engine.precond import KWNGPreconditioner
from kwng.jacobians import jacobian_from_outputs
from studies.cifar.nets import resnet18
from studies.kit.provenance import (
    atomic_write_json,
    index_provenance,
    make_provenance,
)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _direction(model, z, y, mode, amp, seed):
    m = copy.deepcopy(model)
    pc = KWNGPreconditioner(
        m,
        mode=mode,
        clip_norm=None,
        eps_schedule=None,
        generator=torch.Generator().manual_seed(seed),
    )
    ctx = (
        torch.autocast(z.device.type, dtype=amp)
        if amp
        else torch.autocast(z.device.type, enabled=False)
    )
    with ctx:
        X = m(z)
        loss = nn.functional.cross_entropy(X.float(), y)
    pc.step(loss, X)
    return torch.cat([p.grad.reshape(-1) for p in m.parameters()]), pc


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--num-basis", type=int, default=5)
    p.add_argument("--json", default=None)
    return p.parse_args()


def _tf32_off() -> None:
    """Full fp32: TF32 (on by default for cuDNN convolutions) limits any agreement to
    ~1e-3."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    if hasattr(torch.backends.cudnn, "conv"):  # torch >= 2.9: also per operation
        torch.backends.cudnn.conv.fp32_precision = "ieee"
        torch.backends.cuda.matmul.fp32_precision = "ieee"


def _float64_errors(model, z, y, num_basis: int) -> dict:
    """T of the fast path against serial VJPs, all in float64 on the GPU (any difference
    beyond round-off is a bug), and serial fp32 against serial fp64."""
    dev = z.device
    m64 = copy.deepcopy(model).double()
    X64 = m64(z.double())
    C64 = torch.randn(num_basis, z.shape[0], 10, device=dev, dtype=torch.float64)
    T64 = jacobian_from_outputs(X64, list(m64.parameters()), C64, retain_graph=True)
    e64 = copy.deepcopy(model).double()
    pc64 = KWNGPreconditioner(e64, eps_schedule=None, num_basis=num_basis)
    Xe = e64(z.double())
    _, Te = pc64._gradients(
        nn.functional.cross_entropy(Xe, y), Xe, C64, list(e64.parameters())
    )
    m32 = copy.deepcopy(model)
    T32 = jacobian_from_outputs(
        m32(z), list(m32.parameters()), C64.float(), retain_graph=True
    )
    return {
        "rel_err_T_fast_vs_serial_fp64": _rel(Te, T64),
        "rel_err_T_serial_fp32_vs_fp64": _rel(T32, T64),
    }


def _autocast(dev: torch.device, amp):
    return (torch.autocast(dev.type, dtype=amp) if amp
            else torch.autocast(dev.type, enabled=False))


def _serial_reference(model, z, y, num_basis: int):
    """``(C, T, g)`` of serial autograd on an fp32 copy of ``model``."""
    plain = copy.deepcopy(model)
    Xr = plain(z)
    C = torch.randn(num_basis, z.shape[0], 10, device=z.device,
                    generator=torch.Generator(z.device).manual_seed(2))
    T_ref = jacobian_from_outputs(Xr, list(plain.parameters()), C, retain_graph=True)
    grads = torch.autograd.grad(
        nn.functional.cross_entropy(Xr, y), list(plain.parameters()))
    return C, T_ref, torch.cat([g.reshape(-1) for g in grads])


def _config_errors(model, z, y, fmt, amp, num_basis: int, ref_dir) -> dict:
    """One configuration (memory format, autocast dtype): g and T of the replicated
    engine against serial VJPs (fp32 reference model) and its direction against the
    fp32 reference mode."""
    m = copy.deepcopy(model).to(memory_format=fmt)
    zz = z.contiguous(memory_format=fmt)
    C, T_ref, g_ref = _serial_reference(model, z, y, num_basis)
    pc = KWNGPreconditioner(m, eps_schedule=None, num_basis=num_basis)
    with _autocast(z.device, amp):
        X = m(zz)
        loss = nn.functional.cross_entropy(X.float(), y)
    g, T = pc._gradients(loss, X, C, list(m.parameters()))
    d, pcd = _direction(m, zz, y, "fast", amp, 1)
    sgd = copy.deepcopy(model).to(memory_format=fmt)  # plain autograd in this config
    with _autocast(z.device, amp):
        loss_s = nn.functional.cross_entropy(sgd(zz).float(), y)
    g_sgd = torch.cat([gr.reshape(-1) for gr in
                       torch.autograd.grad(loss_s, list(sgd.parameters()))])
    return {
        "rel_err_g": _rel(g, g_ref),
        "rel_err_T": _rel(T, T_ref),
        "rel_err_g_plain_autograd_same_config": _rel(g_sgd, g_ref),
        "rel_err_direction_vs_reference_fp32": _rel(d, ref_dir),
        "cosine_direction": float(torch.nn.functional.cosine_similarity(
            d.double(), ref_dir.double(), dim=0)),
        "serial_steps": pcd.counters()["serial_steps"],
    }


def main() -> None:
    a = _parse()
    _tf32_off()
    print("TF32 off:", not torch.backends.cudnn.allow_tf32)
    dev = torch.device(a.device)
    torch.manual_seed(0)
    model = resnet18(10).to(dev)
    z = torch.randn(a.batch, 3, 32, 32, device=dev)
    y = torch.randint(0, 10, (a.batch,), device=dev)
    out: dict = {}
    ref_dir, _ = _direction(model, z, y, "reference", None, 1)
    if dev.type == "cuda":
        out["float64"] = _float64_errors(model, z, y, a.num_basis)
        print("float64", json.dumps(out["float64"]))
    for name, fmt, amp in (
        ("fp32_nchw", torch.contiguous_format, None),
        ("fp32_channels_last", torch.channels_last, None),
        ("bf16_channels_last", torch.channels_last, torch.bfloat16),
    ):
        out[name] = _config_errors(model, z, y, fmt, amp, a.num_basis, ref_dir)
        print(name, json.dumps(out[name]))
    if a.json:
        path = Path(a.json)
        if path.exists():
            raise SystemExit(f"{path} exists (a committed result?): use another --json")
        prov = make_provenance(vars(a), seeds={"torch": 0}, device=str(dev))
        atomic_write_json(path, {"results": out, "provenance": prov})
        index_provenance(path.parent)


if __name__ == "__main__":
    main()
