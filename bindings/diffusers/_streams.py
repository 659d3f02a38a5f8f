"""What one forward of a model split: its streams of tokens and their cuts.

Every tensor the model's ``_cp_plan`` splits is cut along its sequence
axis into equal padded shards (``_shards.Split``), checked first on every
rank together: the same shape and contents everywhere (the same global
batch and, upstream of the split, the same weights; a rank that drew other
latents or another seed would otherwise give a silently wrong image).
Two streams matter to the attention: the image (or video) tokens, split
as ``hidden_states``, and the text tokens, split as
``encoder_hidden_states`` or kept whole on every rank (``text="whole"``:
then the plan's text inputs are left unsplit). The record starts afresh at
every forward of the model.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from ._shards import Split

IMAGE, TEXT = "hidden_states", "encoder_hidden_states"
# the plan inputs that hold one value per text token (kept whole with the text)
TEXT_INPUTS = frozenset({TEXT, "encoder_hidden_states_mask", "encoder_attention_mask",
                         "txt_ids"})
TEXT_MODES = ("sharded", "whole")


class Streams:
    """The splits of the current forward, by stream name."""

    def __init__(self, comm, text: str):
        self.comm, self.text_whole = comm, text == "whole"
        self.splits: Dict[str, Split] = {}
        self.text_length: Optional[int] = None
        self.image_length: Optional[int] = None

    def begin(self, inputs: Dict[str, Any]) -> None:
        """A new forward, with the model's own inputs (by name)."""
        self.splits = {}
        self.text_length = _length(inputs.get(TEXT))
        self.image_length = _length(inputs.get(IMAGE))

    @property
    def image(self) -> Optional[Split]:
        return self.splits.get(IMAGE)

    @property
    def text(self) -> Optional[Split]:
        return self.splits.get(TEXT)

    def keeps_whole(self, name: Any, x: torch.Tensor, dim: int, where: str) -> bool:
        """Whether ``text="whole"`` leaves this plan input unsplit: the text
        inputs by name, and a module's outputs (QwenImage's text RoPE) by
        their length, the text's (refused where the image is as long:
        then the length cannot tell them apart)."""
        if not self.text_whole:
            return False
        if isinstance(name, str):
            return name in TEXT_INPUTS
        if x.shape[dim] != self.text_length:
            return False
        if self.text_length == self.image_length:
            raise ValueError(f"text='whole': output {name} of {where!r} is as long as both the "
                             f"text and the image ({self.text_length} tokens), so it cannot be "
                             f"told which it is; use text='sharded' or another text length")
        return True

    def split(self, name: Any, x: torch.Tensor, dim: int, where: str) -> torch.Tensor:
        """This rank's padded shard of ``x`` along ``dim``, after every rank
        agreed on its shape and contents."""
        self.comm.agree("diffusers context_parallel split", where, name, tuple(x.shape),
                        str(x.dtype), _checksum(x))
        split = Split(x.shape[dim], self.comm.size)
        self.splits[name if isinstance(name, str) else f"{where}[{name}]"] = split
        return split.shard(x, dim, self.comm.rank)


def _length(x: Any) -> Optional[int]:
    """The token count of a [batch, tokens, channels] input."""
    return x.shape[1] if isinstance(x, torch.Tensor) and x.dim() == 3 else None


def _checksum(x: torch.Tensor) -> str:
    """Sums that differ where two ranks' tensors differ (in practice)."""
    x = x.detach()
    flat = (torch.view_as_real(x) if x.is_complex() else x).reshape(-1).to(torch.float64)
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
    return f"{float(flat.sum())!r}/{float((flat * weights).sum())!r}"
