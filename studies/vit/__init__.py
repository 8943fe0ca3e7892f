"""Beyond the paper: the CIFAR-10 claim on a Vision Transformer, by the protocol of the
ResNet study (book chapter "Beyond the paper: a Vision Transformer", to come).

The network is the CIFAR kit's :mod:`studies.cifar.vit` (``model="vit"`` in a run's
settings: patch 4, width 192, depth 6, 3 heads, MLP ratio 4, pre-norm, GELU; 2.69 M
parameters), inside :class:`studies.cifar.nets.ConditionedNetwork` with the same
:class:`~studies.cifar.nets.DiagonalConditioning` (condition ``1e7``) as the ResNet-18.
It lives in the kit, beside the ResNet-18, so that the kit's trainer and timing and the
step-cost benchmark (``python -m studies.bench.step_cost --model vit``) build it by
name; the fast KWNG step batches every one of its parameters
(:mod:`kwng.engine.replicate`).

* :mod:`studies.vit.cost` — the ViT's committed step cost on one GPU;
* :mod:`studies.vit.protocol` — the protocol (``results/vit/protocol.json``, the Fig. 3
  protocol on the ViT at 50 epochs), its plan ``vit`` and check ``cifar check --suite
  vit``.
"""

from studies.vit import protocol  # noqa: F401  (it registers)
