"""The single-device run the pipeline tests compare against."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def train_single_device(
    model: nn.Module,
    data: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    steps: int,
    lr: float,
) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """SGD on the whole batch of every step: the losses, and every parameter's gradient by
    name at each step."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses: list[float] = []
    grads: list[dict[str, torch.Tensor]] = []
    for step in range(steps):
        opt.zero_grad()
        x, y = data(step)
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
    return losses, grads
