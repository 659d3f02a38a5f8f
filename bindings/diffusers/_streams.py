"""What one forward of a model depends on, agreed, and what it split.

At its start (``begin``) every rank agrees, in one exchange, on the
model's inputs (tensors by their contents, other values by their printed
form: the latents, the timestep, pooled projections, guidance, a text kept
whole), on the grad mode and on its weights (``_weights.py``), each thing once
(``_fingerprints.agree``): a rank's shards depend on all of them, and a rank
that drew another latent, another timestep or another seed would otherwise
give a silently wrong image. Every tensor the model's ``_cp_plan`` splits
is then cut along its sequence axis into equal padded shards
(``_shards.Split``); one computed inside the model (a RoPE table, Wan's
patch-embedded latents) is agreed on first, the model's inputs were
already. Two streams matter to the attention: the image (or video) tokens,
split as ``hidden_states``, and the text tokens, split as
``encoder_hidden_states`` or kept whole on every rank (``text="whole"``:
then the plan's text inputs are left unsplit). The record starts afresh at
every forward of the model.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from ._fingerprints import agree, tensor_items, value_items, version_of
from ._shards import Split
from ._weights import SAME_WEIGHTS, Weights

IMAGE, TEXT = "hidden_states", "encoder_hidden_states"
# the plan inputs that hold one value per text token (kept whole with the text)
TEXT_INPUTS = frozenset({TEXT, "encoder_hidden_states_mask", "encoder_attention_mask",
                         "txt_ids"})
TEXT_MODES = ("sharded", "whole")
SAME_INPUTS = ("Call the model with the same global inputs on every rank (the same latents, "
               "timestep, prompt embeddings, guidance: the same seed and prompt). " + SAME_WEIGHTS)


class Streams:
    """The splits of the current forward, by stream name, and the tensors
    every rank agreed on in it."""

    def __init__(self, comm, text: str, weights: Weights, model_name: str):
        self.comm, self.text_whole = comm, text == "whole"
        self.weights, self.model_name = weights, model_name
        self.splits: Dict[str, Split] = {}
        self.agreed: Dict[int, Tuple[torch.Tensor, Optional[int]]] = {}
        self.text_length: Optional[int] = None
        self.image_length: Optional[int] = None

    def begin(self, inputs: Dict[str, Any]) -> None:
        """A new forward, with the model's own inputs (by name): agreed, with
        the weights, by every rank."""
        inputs_and_mode = {**inputs, "torch.is_grad_enabled()": torch.is_grad_enabled()}
        items = [item for name, value in inputs_and_mode.items()
                 for item in value_items(name, value)]
        agree(self.comm, "diffusers context_parallel forward",
              f"the inputs and weights of {self.model_name}", items + [self.weights.item()],
              SAME_INPUTS)
        self.agreed = {}
        self._note_agreed(inputs.values())
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
        """This rank's padded shard of ``x`` along ``dim``, every rank having
        agreed on its shape and contents (at the forward's start, or here)."""
        held = self.agreed.get(id(x))  # held alive: its id names no other tensor
        if held is None or held[1] != version_of(x):
            agree(self.comm, "diffusers context_parallel split", f"the tensors {where!r} splits",
                  tensor_items([(str(name), x)]), SAME_INPUTS)
            self._note_agreed([x])
        split = Split(x.shape[dim], self.comm.size)
        self.splits[name if isinstance(name, str) else f"{where}[{name}]"] = split
        return split.shard(x, dim, self.comm.rank)

    def _note_agreed(self, values) -> None:
        """Tensors every rank now holds alike (the same object seen again in
        this forward, unchanged, needs no second agreement: QwenImage's text
        mask, split at every block)."""
        for value in values:
            if isinstance(value, torch.Tensor):
                self.agreed[id(value)] = (value, version_of(value))


def _length(x: Any) -> Optional[int]:
    """The token count of a [batch, tokens, channels] input."""
    return x.shape[1] if isinstance(x, torch.Tensor) and x.dim() == 3 else None
