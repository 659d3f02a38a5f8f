"""The attention a routed processor calls: commlib's Ulysses, Ring or hybrid
over the ranks' shards, in place of diffusers' ``dispatch_attention_fn``.

A processor hands over q, k, v of its local sequence ([b, s, h, d], the
layout commlib reads): image tokens, or [text | image] in joint attention
(Flux, Flux 2, QwenImage concatenate text first). ``ShardedAttention``
reads which from the lengths this forward split (``_streams.Streams``),
makes the padding and the duplicate copies of a whole text invisible
(``_visibility.py``), folds in the model's own key mask, and attends with
the commlib binding. A cross-attention whose keys are a split text (LTX's
video-to-text attention) gathers the text's keys and values and attends
locally; one whose keys are whole (the processor passes no config: Wan's)
never gets here. Every decision below depends only on shapes and on what
every rank split alike, so every rank raises alike.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import numpy as np
import torch

from commlib.ulysses.relayout import check_heads

from ..torch import (
    hybrid_attention,
    ring_attention,
    ulysses_attention,
    ulysses_attention_overlapped,
)
from ._routing import called_with
from ._shards import Split, gather
from ._streams import Streams
from ._visibility import Segment, visibility

LAYOUT = "contiguous"  # each rank's shard is one stretch of its streams; full attention


class ShardedAttention:
    """One model's context-parallel attention: set as its processors'
    ``_parallel_config``. ``ring_degree * ulysses_degree == comm.size``;
    ``options`` go to every commlib attention call as they are (``kernel=``,
    ``method=``, ``wire=``); ``overlap_groups``: the head groups of the
    processors whose projection the binding owns (pure Ulysses)."""

    def __init__(self, comm, streams: Streams, ring_degree: int, ulysses_degree: int,
                 options: Mapping[str, Any], overlap_groups: Optional[int] = None):
        self.comm, self.streams, self.options = comm, streams, dict(options)
        self.ring_degree, self.ulysses_degree = ring_degree, ulysses_degree
        self.overlap_groups = overlap_groups
        self.masks: Dict[Tuple[Any, ...], Any] = {}

    @property
    def context_parallel_config(self):
        """What diffusers' own context-parallel attention reads first: reached
        only by a processor that calls diffusers' attention some way this
        binding did not route."""
        raise RuntimeError("an attention processor passed commlib's context-parallel config "
                           "to diffusers' own attention (through a path commlib.bindings."
                           "diffusers does not route): its result would be wrong; undo with "
                           "remove_context_parallel(model)")

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: Optional[torch.Tensor], dropout_p: float, is_causal: bool,
                 scale: Optional[float], attention_kwargs: Optional[Mapping[str, Any]],
                 local: Callable[..., torch.Tensor]) -> torch.Tensor:
        _check_call(dropout_p, is_causal, attention_kwargs)
        if not self.streams.splits:
            # before the plan's first split of this forward (MiniMax-H3's text refiner): every
            # rank holds every token, so the attention is every rank's own
            return local(query, key, value, attn_mask=attn_mask, scale=scale)
        if self._is_cross(query, key):
            return self._over_text(query, key, value, attn_mask, scale, local)
        return self.by_rows(*query.shape[:3], attn_mask, lambda rows, mask: self._attend(
            query[rows], key[rows], value[rows], scale, mask))

    def by_rows(self, batch: int, local: int, heads: int, attn_mask: Optional[torch.Tensor],
                attend: Callable[[slice, Any], torch.Tensor]) -> torch.Tensor:
        """``attend(rows, mask)`` over a full attention of ``local`` tokens a
        rank: once for the whole batch, or row by row where the model's key
        mask differs per row (commlib's masks are one per call)."""
        segments = self._segments(local)
        if self.ulysses_degree > 1:
            check_heads(heads, self.ulysses_degree)
        key_mask = self._key_mask(attn_mask, batch, local)
        if key_mask is None or all(np.array_equal(row, key_mask[0]) for row in key_mask):
            row = None if key_mask is None else key_mask[0]
            return attend(slice(None), self._mask(segments, row))
        return torch.cat([attend(slice(i, i + 1), self._mask(segments, key_mask[i]))
                          for i in range(batch)])

    def _is_cross(self, query: torch.Tensor, key: torch.Tensor) -> bool:
        """Whether the keys are the processor's ``encoder_hidden_states`` while
        its queries are the image shard alone (LTX-Video's attention to the
        text), told by the processor's arguments where the lengths agree. An
        empty text leaves a joint attention (Flux's) over the image alone."""
        if key.shape[1] != query.shape[1]:
            return True
        image = self.streams.image
        return (called_with().get("encoder_hidden_states") is not None and image is not None
                and query.shape[1] == image.padded and self.streams.text_length != 0)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: Optional[float], mask: Any) -> torch.Tensor:
        """The one call into commlib's attention (options such as a wire
        format join ``self.options``)."""
        settings = dict(layout=LAYOUT, causal=False, softmax_scale=scale, mask=mask,
                        **self.options)
        if self.ring_degree == 1:
            return ulysses_attention(q, k, v, self.comm, **settings)
        if self.ulysses_degree == 1:
            return ring_attention(q, k, v, self.comm, **settings)
        return hybrid_attention(q, k, v, self.comm, self.ulysses_degree, **settings)

    def overlapped(self, project: Callable[[slice, slice, slice], Tuple[torch.Tensor, ...]],
                   batch: int, local: int, heads: int, attn_mask: Optional[torch.Tensor],
                   scale: Optional[float]) -> torch.Tensor:
        """Ulysses of the q, k, v that ``project(rows, heads, kv_heads)``
        makes head group by head group ([b, local, n, d] each, the batch
        ``rows``), each group's all-to-all in flight while the next is
        projected (``overlap_groups``; ``_projection.py``)."""
        return self.by_rows(batch, local, heads, attn_mask, lambda rows, mask: (
            ulysses_attention_overlapped(
                lambda h, kv: project(rows, h, kv), self.comm, num_heads=heads,
                groups=self.overlap_groups, layout=LAYOUT, causal=False, softmax_scale=scale,
                mask=mask, **self.options)))

    def _segments(self, local: int) -> List[Segment]:
        """The local sequence: the image shard, or [text | image shard]."""
        image, text = self.streams.image, self.streams.text
        if image is None:
            raise ValueError("a context-parallel attention ran before the model's plan split "
                             "its hidden_states")
        if local == image.padded:
            return [Segment(image.padded, image)]
        if text is not None and local == text.padded + image.padded:
            return [Segment(text.padded, text), Segment(image.padded, image)]
        if text is None and self.streams.text_whole and local > image.padded:
            return [Segment(local - image.padded), Segment(image.padded, image)]
        text_shard = "" if text is None else f" or [text shard ({text.padded}) | image shard]"
        raise ValueError(f"an attention over {local} local tokens is neither the image shard "
                         f"({image.padded} of {image.length} tokens){text_shard}: this model "
                         f"joins its tokens in a way commlib.bindings.diffusers does not know")

    def _key_mask(self, attn_mask: Optional[torch.Tensor], batch: int,
                  local: int) -> Optional[np.ndarray]:
        """The model's key mask over the global sequence, [batch, size * local]
        bool: every rank's mask of its own keys, gathered."""
        if attn_mask is None:
            return None
        visible = _visible_keys(attn_mask, batch, local)
        gathered = self.comm.allgather(visible.to(torch.uint8).cpu(), axis=1)
        return gathered.numpy().astype(bool)

    def _mask(self, segments: List[Segment], key_mask: Optional[np.ndarray]) -> Any:
        cache_key = (tuple(segments), None if key_mask is None else key_mask.tobytes())
        if cache_key not in self.masks:
            if len(self.masks) > 64:
                self.masks.clear()
            self.masks[cache_key] = visibility(segments, self.comm.size, key_mask)
        return self.masks[cache_key]

    def _over_text(self, query, key, value, attn_mask, scale, local):
        """Cross-attention over the text: a split text's keys and values
        gathered (padding cut; differentiable), then attended on this rank;
        a text every rank holds whole (``text="whole"``), attended here."""
        text, whole = self.streams.text, self.streams.text_length
        if text is None and whole is not None and key.shape[1] == whole:
            return local(query, key, value, attn_mask=attn_mask, scale=scale)
        if text is None or key.shape[1] != text.padded:
            raise ValueError(f"a cross-attention over {key.shape[1]} local keys that are neither "
                             f"the text's shard nor the whole text (" +
                             (f"{whole} tokens, not split" if text is None else
                              f"a shard of {text.padded} tokens") + ")")
        key, value = (gather(x, 1, text, self.comm) for x in (key, value))
        if attn_mask is not None:
            attn_mask = _gather_last(attn_mask, text, self.comm)
        return local(query, key, value, attn_mask=attn_mask, scale=scale)


def _check_call(dropout_p: float, is_causal: bool,
                attention_kwargs: Optional[Mapping[str, Any]]) -> None:
    """What the sharded attention does not do (the model's code passes the
    same on every rank)."""
    if dropout_p:
        raise ValueError(f"attention dropout ({dropout_p}) is not supported across ranks")
    if is_causal:
        raise ValueError("causal attention: commlib.bindings.diffusers shards full "
                         "(bidirectional) attention, what diffusion transformers use")
    if attention_kwargs:
        raise ValueError(f"attention_kwargs {sorted(attention_kwargs)} are not supported "
                         f"across ranks")


def _visible_keys(attn_mask: torch.Tensor, batch: int, local: int) -> torch.Tensor:
    """[batch, local] bool from a key mask broadcast over heads and queries
    (bool: True sees; float: 0 sees, -inf hides)."""
    shape = tuple(attn_mask.shape)
    if shape[-1] != local or any(n != 1 for n in shape[1:-1]) or \
            (len(shape) > 1 and shape[0] not in (1, batch)):
        raise ValueError(f"attention mask of shape {shape}: across ranks only a mask of keys "
                         f"(broadcast over heads and queries, [batch, 1, 1, {local}]) is "
                         f"supported")
    mask = attn_mask.reshape(-1, local)
    if mask.dtype == torch.bool:
        return mask.expand(batch, local)
    if not bool(((mask == 0) | (mask == float("-inf"))).all()):
        raise ValueError("an additive attention mask with values other than 0 and -inf "
                         "cannot be sharded as a mask of visible keys")
    return (mask == 0).expand(batch, local)


def _gather_last(mask: torch.Tensor, split: Split, comm) -> torch.Tensor:
    """A mask over the split text's keys (last axis), whole."""
    kept = split.kept(mask.device)
    return comm.allgather(mask.contiguous(), axis=mask.dim() - 1).index_select(-1, kept)


def dispatch(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``dispatch_attention_fn`` for a routed processor: commlib's attention
    where the processor passes a ``ShardedAttention``, diffusers' own
    (``original``) for anything else (None: keys not split)."""

    def dispatch_attention_fn(query, key, value, attn_mask=None, dropout_p=0.0,
                              is_causal=False, scale=None, enable_gqa=False,
                              attention_kwargs=None, *, backend=None, parallel_config=None):
        if not isinstance(parallel_config, ShardedAttention):
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                            is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                            attention_kwargs=attention_kwargs, backend=backend,
                            parallel_config=parallel_config)

        def local(q, k, v, *, attn_mask, scale):
            return original(q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=enable_gqa,
                            backend=backend, parallel_config=None)
        return parallel_config(query, key, value, attn_mask, dropout_p, is_causal, scale,
                               attention_kwargs, local)

    return dispatch_attention_fn
