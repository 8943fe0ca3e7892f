"""A parameter shared by every sample, handed to the model per sample:
:class:`ExpandedParameter`.

A transformer adds a class token and a position embedding to every sample of the batch:
``nn.Parameter`` tensors that the model's ``forward`` uses directly. The fast KWNG step
(:mod:`kwng.engine.replicate`) needs each parameter's gradient for each of its ``M + 1``
cotangents, so it must see where a parameter meets the batch; a bare ``nn.Parameter``
used inside ``forward`` hides that (and makes the model take serial backward passes).
Hold such a tensor in an :class:`ExpandedParameter` and call it on the batch::

    self.cls_token = ExpandedParameter(1, width)    # not nn.Parameter(…(1, 1, width))
    self.pos_embed = ExpandedParameter(tokens, width)
    ...
    x = torch.cat([self.cls_token(x), x], 1) + self.pos_embed(x)

``module(x)`` is ``weight.expand(len(x), *weight.shape)``: the same tensor for every
sample, so any model that broadcasts a parameter over the batch can be written this way.
In the replicated forward the gradient of copy ``r`` is the sum of the output gradient
over copy ``r``'s samples.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kwng.engine.replicate_layers import _State

__all__ = ["ExpandedParameter"]


class ExpandedParameter(nn.Module):
    """A learnable tensor ``weight`` of shape ``shape``, shared by every sample:
    ``forward(x)`` returns it expanded to ``(x.shape[0], *shape)`` (a view; ``x`` is
    read for its batch size only). Initialised to zeros (``nn.init`` on ``weight`` as
    for any parameter).

    >>> pos = ExpandedParameter(3, 4)
    >>> pos(torch.randn(8, 3, 4)).shape
    torch.Size([8, 3, 4])
    """

    def __init__(self, *shape: int, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        if not shape or any(not isinstance(s, int) or s < 1 for s in shape):
            raise ValueError(f"shape must be positive integers, got {shape}")
        self.weight = nn.Parameter(torch.zeros(shape, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight.expand((x.shape[0],) + tuple(self.weight.shape))

    def extra_repr(self) -> str:
        return f"shape={tuple(self.weight.shape)}"


class _Expand(torch.autograd.Function):
    """``weight`` expanded to the ``R·N`` rows of the replicated batch; the backward
    pass sums the output gradient over each copy's ``N`` rows."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, st: _State) -> torch.Tensor:
        ctx.meta = (st, weight)
        return weight.expand((st.copies * st.batch,) + tuple(weight.shape))

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):
        st, weight = ctx.meta
        acc = torch.promote_types(dy.dtype, torch.float32)
        G = dy.reshape((st.copies, st.batch) + tuple(weight.shape)).sum(1, dtype=acc)
        st.grads[id(weight)] = G.to(weight.dtype)
        return st.grads[id(weight)][0], None
