"""Networks of the experiments: the CIFAR study's ResNet-18 and its conditioning (paper
App. D.2, Table 1), and small models for the benchmarks, tests and the book.

* :func:`resnet18` — one 3×3 convolution (64 channels), 8 residual blocks (two per width
  64, 128, 256, 512; each block two 3×3 convolutions with batch normalisation and ReLU;
  stride 2 at the first block of widths 128/256/512), global average pooling and a
  linear layer. Its output is the logits ``x = h_θ(z)``: the samples of the implicit
  model.
* :class:`DiagonalConditioning` — the fixed diagonal ``U`` of the ill-conditioned study;
  log-spaced diagonal from ``1e-6`` to ``10`` (condition number ``1e7``) by default.
* :class:`ConditionedNetwork` — ``z ↦ U h_θ(z)``: ``U`` inside the network, as in the
  authors' code, so that the network's outputs (the samples of the implicit model) are
  ``U h_θ(z)``; the loss is ``CE(U h_θ(z), y)`` either way.
  :meth:`ConditionedNetwork.forward_both` also returns ``h_θ(z)``.
* :func:`last_linear` — the last ``nn.Linear`` of a network (the layer that ``U``
  reparametrises).
* :func:`tiny_cnn`, :func:`mlp` — small models for tests and CPU examples.
* :data:`NETWORKS` — the networks a run names, the Vision Transformer of
  :mod:`studies.cifar.vit` among them (``vit``, and ``vit_tiny`` for the CPU).
"""

from __future__ import annotations

import torch
from torch import nn

from kwng._checks import check_int, check_positive
from studies.cifar.vit import vit, vit_tiny

__all__ = [
    "BasicBlock",
    "ResNet18",
    "resnet18",
    "DiagonalConditioning",
    "ConditionedNetwork",
    "last_linear",
    "tiny_cnn",
    "mlp",
    "NETWORKS",
]


class BasicBlock(nn.Module):
    """Two 3×3 convolutions with batch norm; identity or 1×1-convolution shortcut."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False),
                nn.BatchNorm2d(c_out),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """The residual network of the paper's Table 1 (CIFAR-sized inputs ``3 × 32 ×
    32``)."""

    def __init__(
        self, num_classes: int = 10, widths: tuple[int, ...] = (64, 128, 256, 512)
    ) -> None:
        super().__init__()
        check_int(num_classes, "num_classes", 2)
        self.conv1 = nn.Conv2d(3, widths[0], 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        layers, c_in = [], widths[0]
        for i, w in enumerate(widths):
            stride = 1 if i == 0 else 2
            layers += [BasicBlock(c_in, w, stride), BasicBlock(w, w, 1)]
            c_in = w
        self.layers = nn.Sequential(*layers)
        self.linear = nn.Linear(c_in, num_classes)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(z)))
        out = self.layers(out)
        out = torch.flatten(nn.functional.adaptive_avg_pool2d(out, 1), 1)
        return self.linear(out)


def resnet18(num_classes: int = 10) -> ResNet18:
    """ResNet-18 of Table 1 of the paper (≈11.2M parameters for 10 classes)."""
    return ResNet18(num_classes)


class DiagonalConditioning(nn.Module):
    """Multiply logits by a fixed diagonal ``U`` (a buffer, never trained).

    ``condition`` is the ratio ``max U / min U``; ``U`` is log-spaced from ``top /
    condition`` to ``top`` (``top = 10``, ``condition = 1e7``: ``1e-6 … 10`` as in the
    authors' setup), with the entries in a fixed random order (``seed``) so that no
    class is systematically favoured. ``condition = 1`` gives the identity (the
    well-conditioned case).
    """

    def __init__(
        self, num_classes: int, condition: float = 1e7, top: float = 10.0, seed: int = 0
    ) -> None:
        super().__init__()
        check_int(num_classes, "num_classes", 1)
        condition = check_positive(condition, "condition")
        if condition < 1:
            raise ValueError(f"condition must be >= 1, got {condition}")
        top = check_positive(top, "top")
        if condition == 1:
            diag = torch.ones(num_classes)
        else:
            diag = torch.logspace(
                torch.log10(torch.tensor(top / condition)),
                torch.log10(torch.tensor(top)),
                num_classes,
                dtype=torch.float64,
            ).float()
            perm = torch.randperm(
                num_classes, generator=torch.Generator().manual_seed(seed)
            )
            diag = diag[perm]
        self.register_buffer("diag", diag)

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return logits * self.diag

    def extra_repr(self) -> str:
        d = self.diag
        return (f"num_classes={d.numel()}, min={float(d.min()):.1e}, "
                f"max={float(d.max()):.1e}")


class ConditionedNetwork(nn.Module):
    """``z ↦ U h_θ(z)``: a network ``body`` (``h_θ``) followed by a fixed
    ``conditioning`` (``U``).

    With ``U`` inside the network the samples of the implicit model are ``U h_θ(z)``, as
    in the authors' code. For a diagonal ``U`` and a last layer ``h_θ(z) = W φ(z) + b``,
    the outputs are ``(U W) φ(z) + U b``: ``U`` is a reparametrisation of the last
    layer, and a natural gradient on these samples is invariant to it (Prop. 1; book
    chapter :ref:`experiments-cifar`). ``conditioning=None`` is the identity (the
    well-conditioned case).
    """

    def __init__(self, body: nn.Module, conditioning: nn.Module | None = None) -> None:
        super().__init__()
        if not isinstance(body, nn.Module):
            raise ValueError(
                f"body must be a torch.nn.Module, got {type(body).__name__}"
            )
        if conditioning is not None and not isinstance(conditioning, nn.Module):
            raise ValueError(
                "conditioning must be None or an nn.Module, got "
                f"{type(conditioning).__name__}"
            )
        self.body = body
        self.conditioning = conditioning

    def forward_both(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h_θ(z), U h_θ(z))`` from one forward pass (the first is the second when
        ``U`` is None)."""
        h = self.body(z)
        return h, (h if self.conditioning is None else self.conditioning(h))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.forward_both(z)[1]


def last_linear(model: nn.Module) -> nn.Linear:
    """The last ``nn.Linear`` module of ``model`` in registration order (its output
    layer)."""
    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not layers:
        raise ValueError(f"model has no nn.Linear layer: {type(model).__name__}")
    return layers[-1]


def tiny_cnn(num_classes: int = 10, width: int = 8) -> nn.Sequential:
    """A small CNN with batch norm for ``3 × 32 × 32`` (or smaller) inputs."""
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1, bias=False),
        nn.BatchNorm2d(2 * width),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, num_classes),
    )


def mlp(d_in: int, d_out: int, hidden: int = 32, depth: int = 2) -> nn.Sequential:
    """A ReLU multilayer perceptron ``d_in → hidden (× depth) → d_out``."""
    layers, c = [], d_in
    for _ in range(depth):
        layers += [nn.Linear(c, hidden), nn.ReLU()]
        c = hidden
    layers.append(nn.Linear(c, d_out))
    return nn.Sequential(*layers)


#: the networks a run's ``model`` setting names: name -> ``(num_classes) -> nn.Module``
NETWORKS = {"resnet18": resnet18, "tiny": tiny_cnn, "vit": vit, "vit_tiny": vit_tiny}
