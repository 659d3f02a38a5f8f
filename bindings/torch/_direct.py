"""When a torch call may run commlib's core directly instead of its
``torch.library`` op: nothing is traced (no ``torch.compile``, no fake or
meta tensors) and no autograd graph is recorded (grad mode off, or no input
requires a gradient), so the op would only add its dispatch: tens of
microseconds of Python a call, the size of a decode step's transfer
(issue 46). The results are the same arrays the op's body returns."""

from __future__ import annotations

from typing import Any

import torch


def runs_directly(*tensors: Any) -> bool:
    """Whether the core can run these (torch tensors, or None) directly."""
    if torch.compiler.is_compiling():
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if type(t) is not torch.Tensor or t.device.type == "meta" \
                or (grad and t.requires_grad):
            return False
    return True
