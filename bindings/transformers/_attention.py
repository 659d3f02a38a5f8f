"""Ring, Ulysses and hybrid attention as transformers attention implementations.

transformers calls an attention implementation once per layer with this
rank's shard of the sequence: query [b, h, s_local, d], key and value
[b, kv_heads, s_local, d]. Each implementation here hands them to the
differentiable functions of ``commlib.bindings.torch``, which attend over the
whole (sharded) sequence. The mask functions registered under the same names
build no mask: commlib applies the causal mask, the documents of a packed
sequence and a sliding window itself, on global positions; a
[s_local, s_local] mask built from the local shard would be wrong.

Packed sequences arrive as transformers' flash-attention keyword arguments
(``cu_seq_lens_q``/``cu_seq_lens_k``, global offsets that ``shard_batch``
puts in the batch and the model forwards to every attention call); a
sliding window as the ``sliding_window`` the model passes; attention sinks
(gpt-oss) as the ``s_aux`` it passes (one learned logit per query head, in
every softmax: ``commlib.kernels.sinks``); Gemma2's logit soft-cap as the
``softcap`` it passes (the scores capped in the tiled kernel). Anything else
that would change the attention's math and that commlib does not implement
(chunked attention, dropout, padding masks) is refused by name, on every
rank, rather than silently dropped.
"""

from __future__ import annotations

import functools
import reprlib
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from transformers import AttentionInterface, AttentionMaskInterface

from commlib import hybrid
from commlib.hybrid.attention import check_degree
from commlib.sequence.documents import packing_for, positions_of
from commlib.ulysses.relayout import check_heads

from ..torch import hybrid_attention, latent_ring_attention, ring_attention, ulysses_attention
from . import _latent

__all__ = ["register_attention", "layout_of", "LAYOUTS", "PositionCheck", "mark_checked",
           "model_check", "forget_checked", "is_checked"]

# the sequence layout of each implementation (shard_batch shards in it): the
# ring and the hybrid balance causal work with zigzag shards; Ulysses gathers
# the whole sequence, so contiguous shards cost it least
LAYOUTS = {"commlib_ring": "zigzag", "commlib_ring_docs": "zigzag_docs",
           "commlib_ulysses": "contiguous", "commlib_hybrid": "zigzag"}

# Keyword arguments transformers passes down to every attention call that do
# not change the attention's math: the batch's own bookkeeping (the loss
# inputs travel through the model's **kwargs; the longest document is
# flash-attention's, commlib reads the offsets), output switches, and
# ModernBERT's ``deterministic`` (whether flash-attention's backward may sum
# in a varying order: rounding, not math).
BOOKKEEPING = frozenset({"position_ids", "use_cache", "num_items_in_batch", "shift_labels",
                         "output_hidden_states", "max_length_q", "max_length_k",
                         "deterministic"})

# read by the attention function itself (the packed documents)
DOCUMENTS = ("cu_seq_lens_q", "cu_seq_lens_k")
# read by the attention function itself: gpt-oss's attention sinks, [heads]
SINKS = "s_aux"
# read by the attention function itself: Gemma2's logit soft-cap (attn_logit_softcapping)
SOFTCAP = "softcap"

# Keyword arguments that change the math, accepted only unset (None or False).
UNSUPPORTED = {
    "position_bias": "an additive position bias",
    "head_mask": "a head mask",
    "output_attentions": "returning attention weights",
    "seq_idx": "per-token sequence indices (packed sequences travel as cu_seq_lens_q/k: "
               "shard_batch makes them from position_ids)",
    "output_router_logits": "the routers' load-balancing loss (each rank would count its "
                            "own tokens' and add it to its share of the loss)",
    # BERT's self-attention is handed its layer's encoder_hidden_states, None in an encoder
    "encoder_hidden_states": "cross-attention to an encoder's states (encoder_hidden_states)",
}

# attend(q, k, v, causal=, softmax_scale=, cu_seqlens=, window=, sinks=, softcap=) on
# [b, s_local, h, d] shards
Attend = Callable[..., torch.Tensor]
# packed documents' global offsets: host ints, a host tensor, or None (one sequence)
Documents = Union[None, List[int], torch.Tensor]


def register_attention(comm, ulysses_size: Optional[int] = None) -> None:
    """Register ``"commlib_ring"`` (zigzag layout), ``"commlib_ring_docs"``
    (the ring over the per-document ``zigzag_docs`` layout),
    ``"commlib_ulysses"`` (contiguous layout) and ``"commlib_hybrid"`` (zigzag) over
    ``comm`` in transformers' ``AttentionInterface``, with mask functions of
    the same names in ``AttentionMaskInterface``. ``ulysses_size``: the
    hybrid's Ulysses degree (default: ``commlib.hybrid.plan``'s choice for
    each shape). A later call replaces the communicator."""
    for name, attend in implementations(comm, ulysses_size).items():
        AttentionInterface.register(name, _attention_function(name, attend, comm))
        AttentionMaskInterface.register(name, mask_function(name, comm))


def implementations(comm, ulysses_size: Optional[int] = None) -> Dict[str, Attend]:
    """Each implementation's attention over ``comm`` on [b, s_local, h, d]
    shards in its layout (``LAYOUTS``): ``attend(q, k, v, causal=,
    softmax_scale=, cu_seqlens=, window=, sinks=, softcap=)``."""
    if ulysses_size is not None:
        check_degree(comm.size, ulysses_size)
    attends: Dict[str, Attend] = {
        name: functools.partial(ring_attention, comm=comm, layout=LAYOUTS[name])
        for name in ("commlib_ring", "commlib_ring_docs")}
    attends["commlib_ulysses"] = _ulysses(comm)
    attends["commlib_hybrid"] = _hybrid(comm, ulysses_size)
    return attends


def _ulysses(comm) -> Attend:
    def attend(q, k, v, **settings):
        _check_ulysses_heads("commlib_ulysses", q.shape[2], k.shape[2], comm.size)
        return ulysses_attention(q, k, v, comm, layout=LAYOUTS["commlib_ulysses"], **settings)
    return attend


def _hybrid(comm, ulysses_size: Optional[int]) -> Attend:
    """The hybrid at ``ulysses_size`` (its ring a ring), or at the degree and
    ring method the planner picks for each shape (planned once per shape: the
    first plan probes the fabric, a collective every rank reaches at the same
    layer)."""
    planned: Dict[Tuple[Any, ...], hybrid.SplitPlan] = {}

    # a constant to torch.compile: run (and the fabric probed) when traced,
    # not traced into (the probe's MPI calls would break the graph)
    @torch.compiler.assume_constant_result
    def choose(*shape: Any) -> Tuple[int, str]:
        if shape not in planned:
            s_local, heads, kv_heads, head_dim, itemsize, causal = shape
            # priced in the layout it shards in: a contiguous causal ring costs more
            planned[shape] = hybrid.plan(comm, s_local * comm.size, heads, kv_heads,
                                         head_dim, itemsize, causal=causal,
                                         layout=LAYOUTS["commlib_hybrid"])
        return planned[shape].ulysses_size, planned[shape].method

    def attend(q, k, v, **settings):
        (_, s_local, heads, head_dim), kv_heads = q.shape, k.shape[2]
        degree, method = ulysses_size, "ring"
        if degree is None:
            degree, method = choose(s_local, heads, kv_heads, head_dim, q.element_size(),
                                    settings["causal"])
        _check_ulysses_heads("commlib_hybrid", heads, kv_heads, degree)
        return hybrid_attention(q, k, v, comm, degree, layout=LAYOUTS["commlib_hybrid"],
                                method=method, **settings)
    return attend


def _check_ulysses_heads(name: str, heads: int, kv_heads: int, degree: int) -> None:
    """Ulysses splits the heads over its degree (unevenly where it must):
    every rank needs one (decided from the config, so every rank raises
    alike)."""
    try:
        check_heads(heads, degree)
    except ValueError as error:
        raise ValueError(f"{name}: Ulysses splits the attention heads ({heads}) and kv heads "
                         f"({kv_heads}) over its degree ({degree}): {error}. commlib_ring "
                         f"works with any head count; commlib_hybrid takes a smaller "
                         f"ulysses_size") from None


def layout_of(attn_implementation: Union[str, torch.nn.Module]) -> str:
    """The sequence layout of a commlib attention implementation, named or
    read from a model's config."""
    name = attn_implementation
    if isinstance(attn_implementation, torch.nn.Module):
        name = getattr(getattr(attn_implementation, "config", None), "_attn_implementation", None)
    if name not in LAYOUTS:
        raise ValueError(f"attn_implementation {name!r} is not one of commlib's; use one of "
                         f"{', '.join(LAYOUTS)} (register them with register(comm) and load "
                         f"the model with one)")
    return LAYOUTS[name]


def _attention_function(name: str, attend: Attend, comm) -> Callable:
    """The function transformers calls: checks the call, reads the packed
    documents, the window and the sinks, checks that the shard is in this
    implementation's layout, moves the heads axis where commlib wants it
    ([b, s, h, d]), attends."""
    world_size = comm.size
    checked = PositionCheck(name, LAYOUTS[name], comm)

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                  dropout: float = 0.0, scaling: Optional[float] = None,
                  is_causal: Optional[bool] = None, sliding_window: Optional[int] = None,
                  **kwargs: Any) -> Tuple[torch.Tensor, None]:
        check_call(name, module, attention_mask, dropout, kwargs)
        if world_size > 1:
            _check_model_checked(name, module)
        cu_seqlens = _documents(name, kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k"))
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        checked(kwargs.get("position_ids"), cu_seqlens, query.shape[2])
        _check_lengths(name, module, cu_seqlens, query.shape[2] * world_size)
        # the shards' (padded) length: a window as long covers every document too
        settings = dict(causal=causal, softmax_scale=scaling, cu_seqlens=cu_seqlens,
                        window=window_of(name, sliding_window, query.shape[2] * world_size,
                                         causal, getattr(module, "config", None)),
                        sinks=kwargs.get(SINKS), softcap=kwargs.get(SOFTCAP))
        latent = _latent.take(module, key)
        if latent is not None:  # multi-head latent attention: the latent travels
            out = latent_ring_attention(query.transpose(1, 2), *latent,
                                        *_latent.up_projections(module), comm,
                                        layout=LAYOUTS[name], **settings)
        else:
            out = attend(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                         **settings)
        return out, None

    attention.__name__ = attention.__qualname__ = name
    return attention


def _check_model_checked(name: str, module: torch.nn.Module) -> None:
    """A sharded batch may reach only a model whose every token-mixing
    layer is context-parallel, which ``shard_batch`` checks (the model is
    the same on every rank, so every rank raises). A batch sharded by other
    means, a model nobody checked (another built from the same config, say),
    or a model changed since its check is refused. Under torch.compile the
    check runs when the graph is traced."""
    checked = _checked_when_traced(module) if torch.compiler.is_compiling() else \
        is_checked(module)
    if not checked:
        raise ValueError(f"{name}: this model was not checked for layers that mix tokens along "
                         f"the sequence, or changed since (a convolution or recurrence would "
                         f"read nothing beyond its shard's edges): make its batch with "
                         f"commlib.bindings.transformers.shard_batch(batch, comm, "
                         f"attn_implementation=model), which checks it")


@torch.compiler.assume_constant_result
def _checked_when_traced(module: torch.nn.Module) -> bool:
    return is_checked(module)


class _Check:
    """A model's check, shared by its attention layers: whether the model is
    still the one checked (``still`` None: a layer vouched for alone), asked
    again at its first attention layer, so once per forward."""

    def __init__(self, still: Optional[Callable[[], bool]], first: Optional[int]):
        self.still, self.first, self.held = still, first, None

    def holds(self, module: torch.nn.Module) -> bool:
        if self.still is None:
            return True
        if self.held is None or id(module) == self.first:
            self.held = self.still()
        return self.held


# checked attention layers, kept beside them, not in their config: a config attribute would be
# saved with the model and vouch for a model loaded from it unchecked (or built from it twice)
_checked: Dict[int, Tuple["weakref.ref[Any]", _Check]] = {}


def mark_checked(module: torch.nn.Module, check: Optional[_Check] = None) -> None:
    """Vouch for an attention layer: its model passed the check
    (``_model_check``: ``check`` says whether the model is unchanged since),
    or, ``check`` None, a layer used alone, with no model around it to check
    (a test, a benchmark)."""
    key = id(module)
    _checked[key] = (weakref.ref(module, lambda _: _checked.pop(key, None)),
                     check or _Check(None, None))


def model_check(still: Callable[[], bool], first: torch.nn.Module) -> _Check:
    """The check its attention layers share: ``still()`` whether the model is
    unchanged, asked at ``first`` (its first attention layer)."""
    return _Check(still, id(first))


def forget_checked(module: torch.nn.Module) -> None:
    _checked.pop(id(module), None)


def is_checked(module: Any) -> bool:
    entry = _checked.get(id(module))
    return entry is not None and entry[0]() is module and entry[1].holds(module)


class PositionCheck:
    """Checks, once per ``position_ids`` tensor (every layer of a forward
    gets the same one), that they are the positions this rank's shard has
    in the implementation's layout (shard_batch makes them so), on every
    rank together: a batch sharded in another layout would attend over the
    wrong tokens."""

    def __init__(self, name: str, layout: str, comm):
        self.name, self.layout, self.comm = name, layout, comm
        self.last: Any = None

    def __call__(self, position_ids: Optional[torch.Tensor], cu_seqlens: Documents,
                 local_length: int) -> None:
        # under torch.compile it would read the positions on the host, a
        # graph break per layer: a compiled step trusts shard_batch (an eager
        # step first checks the batch)
        if torch.compiler.is_compiling() or position_ids is None or position_ids is self.last:
            return
        self.last = position_ids
        problem = None
        try:
            if isinstance(cu_seqlens, torch.Tensor):
                cu_seqlens = cu_seqlens.tolist()
            packing = packing_for(cu_seqlens, self.layout, self.comm.size, local_length)
            want = torch.as_tensor(positions_of(packing, self.comm.rank))
            given = position_ids.detach().reshape(-1, local_length)[0].cpu()
            if not torch.equal(given, want.to(given.dtype)):
                at = int((given != want.to(given.dtype)).nonzero()[0, 0]) \
                    if given.shape == want.shape else 0
                problem = ValueError(
                    f"{self.name} reads shards in the {self.layout} layout, but this rank's "
                    f"position_ids are not its positions in that layout ({given.shape[0]} "
                    f"given, {want.shape[0]} expected; from index {at}: "
                    f"{reprlib.repr(given[at:].tolist())} given, "
                    f"{reprlib.repr(want[at:].tolist())} expected): "
                    + ("the batch was sharded for another layout, or the model does not pass "
                       "the documents shard_batch adds (cu_seq_lens_q) on to its attention, "
                       "which then cannot tell padding and documents apart (not supported). "
                       if cu_seqlens is None else
                       "the batch was sharded for another layout. ")
                    + "Make the batch with shard_batch(batch, comm, attn_implementation=model)")
        except ValueError as error:
            problem = error
        self.comm.agree(f"{self.name} positions", problem=problem)


def _check_mask(name: str, module: torch.nn.Module,
                attention_mask: Optional[torch.Tensor]) -> None:
    """Refuse a mask reaching the attention call. commlib's mask functions
    make none (padding is refused there, on every rank), so it is the
    layer's own (Doge's dynamic mask: a bias per key, learned from its
    values) or a 4-D mask given to the model, which transformers passes on
    as it is; commlib adds no bias to its scores."""
    if attention_mask is None:
        return
    layer = getattr(module, "layer_idx", None)
    raise ValueError(
        f"{name}: {type(module).__name__}{'' if layer is None else f' (layer {layer})'} passes "
        f"its attention call an attention mask of its own (a dynamic or learned mask, such "
        f"as Doge's dynamic mask attention: a bias per key computed from the values; or a "
        f"4-D attention_mask given to the model, which transformers passes on as it is), not "
        f"padding: commlib's mask functions make no mask, and refuse padding. commlib applies "
        f"only the causal mask, packed documents and a sliding window, on the global "
        f"sequence, and adds no mask {tuple(attention_mask.shape)} to the scores: run this "
        f"model unsharded")


def check_call(name: str, module: torch.nn.Module, attention_mask: Optional[torch.Tensor],
               dropout: float, kwargs: Dict[str, Any]) -> None:
    """Refuse, by name, what the attention would otherwise get wrong. Every
    check reads the model's config and the shapes, the same on every rank."""
    _check_mask(name, module, attention_mask)
    if dropout:
        raise ValueError(f"{name} does not implement attention dropout (dropout={dropout}); "
                         f"set the model's config.attention_dropout = 0.0")
    unknown = sorted(set(kwargs) - BOOKKEEPING - set(DOCUMENTS) - {SINKS, SOFTCAP}
                     - set(UNSUPPORTED))
    if unknown:
        raise ValueError(f"{name} got keyword argument(s) {', '.join(unknown)} that it does not "
                         f"know; they may change the attention's math, so it refuses them "
                         f"rather than ignore them")
    for key, what in UNSUPPORTED.items():
        if kwargs.get(key) is not None and kwargs[key] is not False:
            raise ValueError(f"{name} does not implement {what} ({key}= was given)")


def _documents(name: str, cu_seq_lens_q: Any, cu_seq_lens_k: Any) -> Documents:
    """The packed documents' global offsets, or None for one unpadded
    sequence. A tensor stays one, on the host: the attention op reads it
    when it runs, so a compiled model neither breaks its graph at the
    offsets nor retraces for other documents. Self-attention over one
    packed sequence: queries and keys share them (compared when they are
    two objects; shard_batch gives one)."""
    if cu_seq_lens_q is None and cu_seq_lens_k is None:
        return None
    if cu_seq_lens_q is not cu_seq_lens_k and (
            cu_seq_lens_q is None or cu_seq_lens_k is None
            or not torch.equal(torch.as_tensor(cu_seq_lens_q).cpu(),
                               torch.as_tensor(cu_seq_lens_k).cpu())):
        shown = [None if cu is None else torch.as_tensor(cu).tolist()
                 for cu in (cu_seq_lens_q, cu_seq_lens_k)]
        raise ValueError(f"{name}: cu_seq_lens_q {reprlib.repr(shown[0])} and cu_seq_lens_k "
                         f"{reprlib.repr(shown[1])} "
                         f"differ; commlib attends within the documents of one packed sequence, "
                         f"whose queries and keys share the same offsets")
    if isinstance(cu_seq_lens_q, torch.Tensor):
        return cu_seq_lens_q.cpu()
    return [int(offset) for offset in cu_seq_lens_q]


def window_of(name: str, sliding_window: Optional[int], global_length: int,
              causal: bool, config: Any = None) -> Optional[Tuple[int, int]]:
    """transformers' ``sliding_window=W`` lets query i see keys i-W+1 .. i
    (masking_utils' ``sliding_window_overlay``: kv > q - W; its flash-attention
    integration's ``window_size=(W-1, W-1)`` under the causal mask):
    commlib's ``window=(W - 1, 0)``. Without the causal mask, keys
    i-W+1 .. i+W-1: ``(W - 1, W - 1)``, flash-attention's window, which
    transformers' sdpa mask (``|q - k| <= config.sliding_window``) draws too
    only where ``config.sliding_window`` is W - 1 (ModernBERT's local
    layers pass their config's half window + 1); elsewhere the two disagree
    and it is refused. None when the window covers the sequence."""
    if sliding_window is None or sliding_window >= global_length:
        return None
    if sliding_window < 1:
        raise ValueError(f"{name}: sliding_window={sliding_window} leaves a query no key; "
                         f"a sliding window holds at least the query's own token")
    if causal:
        return (sliding_window - 1, 0)
    configured = getattr(config, "sliding_window", None)
    if configured != sliding_window - 1:
        raise ValueError(f"{name} does not implement this bidirectional sliding window "
                         f"(sliding_window={sliding_window} without the causal mask, "
                         f"config.sliding_window={configured}): transformers' sdpa mask "
                         f"(|q - k| <= {configured}) and flash-attention path "
                         f"(|q - k| <= {sliding_window - 1}) disagree on its width; commlib "
                         f"implements the window where they agree (config.sliding_window = "
                         f"{sliding_window - 1}, as ModernBERT's local layers)")
    return (sliding_window - 1, sliding_window - 1)


def attention_chunk(config: Any, layer: Optional[int] = None) -> Optional[int]:
    """The chunk Llama 4's chunked attention confines ``layer``'s queries to
    (``config.attention_chunk_size``, for its ``"chunked_attention"``
    layers; any such layer when ``layer`` is None), or None. transformers'
    chunked mask keeps the keys of the query's chunk of positions (in its
    document, when packed): within a document no longer than the chunk,
    that is the causal attention commlib computes."""
    chunk = getattr(config, "attention_chunk_size", None)
    types = getattr(config, "layer_types", None)
    if chunk is None or types is None:  # no layer types: every layer may be chunked
        return chunk
    if layer is None or not 0 <= layer < len(types):
        return chunk if "chunked_attention" in types else None
    return chunk if types[layer] == "chunked_attention" else None


def temperature_floor(module: torch.nn.Module) -> Optional[int]:
    """Llama 4's attention temperature tuning (its layers without RoPE)
    scales the query of the token at index i among those the layer is given
    by log1p(floor((i + 1) / config.floor_scale)) * attn_scale + 1: i counts
    the shard's tokens, or the one decoded, not the sequence's. The scale is
    1, alike everywhere, while every index + 1 < floor_scale: that bound,
    or None for a layer that does not tune."""
    if getattr(module, "attn_temperature_tuning", False) and \
            not getattr(module, "use_rope", True):
        return int(module.floor_scale)
    return None


def _check_lengths(name: str, module: torch.nn.Module, cu_seqlens: Documents,
                   padded_length: int) -> None:
    """Refuse what holds only up to a length, past it: Llama 4's chunks
    shorter than the batch's longest document (commlib does not implement
    chunked attention), its temperature tuning past its floor_scale tokens
    in the row. The documents' offsets are global, the same on every rank;
    under torch.compile they are not read (a graph break per layer), and
    the shards' padded length stands in for them."""
    layer = getattr(module, "layer_idx", None)
    chunk = attention_chunk(getattr(module, "config", None), layer)
    floor = temperature_floor(module)
    if (chunk is None or chunk >= padded_length) and (floor is None or floor > padded_length):
        return
    longest = row = padded_length
    what, note = "sequence as sharded", \
        " (its padding included: under torch.compile the documents are not read)"
    if not torch.compiler.is_compiling():
        offsets = torch.as_tensor([0, padded_length] if cu_seqlens is None else cu_seqlens)
        longest, row = int((offsets[1:] - offsets[:-1]).max()), int(offsets[-1])
        what, note = "document" if offsets.numel() > 2 else "sequence", ""
    named = f"{name}: {type(module).__name__}{'' if layer is None else f' (layer {layer})'}"
    if chunk is not None and longest > chunk:
        raise ValueError(
            f"{named} attends within chunks of {chunk} tokens, shorter than this batch's "
            f"longest {what} of {longest} tokens{note} (config.attention_chunk_size: Llama "
            f"4's chunked attention); commlib does not implement chunked attention. Within "
            f"{chunk} tokens a chunk is the causal attention commlib computes: keep every "
            f"sequence (packed document) within {chunk} tokens, or make "
            f"config.attention_chunk_size cover them")
    if floor is not None and row >= floor:
        raise ValueError(
            f"{named} tunes its attention temperature by each token's index among those it "
            f"is given (Llama 4's layers without RoPE: config.attn_temperature_tuning, "
            f"floor_scale={floor}), which on a shard counts the shard's tokens, not the "
            f"sequence's: past {floor - 1} tokens a row (this batch's has {row}{note}) the "
            f"ranks would scale differently from the unsharded model. Keep rows within "
            f"{floor - 1} tokens, or set config.attn_temperature_tuning = False")


def mask_function(name: str, comm) -> Callable:
    """transformers' mask hook for ``name``: no mask (commlib applies the
    causal mask, the documents and a sliding window), after refusing what it
    does not implement: padding, or chunks its config does not describe. A
    chunk the config describes is judged by each attention call, which
    alone sees the user's sequence (``attention_chunk``); the shard's length
    here is padded, and in commlib's probe it is the probe's."""

    def no_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
                kv_offset: int = 0, mask_function: Optional[Callable] = None,
                attention_mask: Optional[torch.Tensor] = None,
                local_size: Optional[int] = None, config: Any = None, **kwargs: Any) -> None:
        if (local_size is not None and not _is_sliding_window(local_size, config)
                and attention_chunk(config) != local_size):
            raise ValueError(f"{name}: {type(config).__name__} asks for attention in chunks "
                             f"of {local_size} tokens, but its config does not say which "
                             f"layers attend so (config.attention_chunk_size and "
                             f"'chunked_attention' in config.layer_types, as Llama 4's do): "
                             f"commlib, which does not implement chunked attention, cannot "
                             f"tell whether the chunks cover the sequence")
        if attention_mask is not None:  # its values differ per rank: decide together
            padded = not bool(attention_mask.all())
            comm.agree(f"{name} attention mask", problem=ValueError(
                f"{name}: the attention mask pads this rank's tokens; padding masks are not "
                f"implemented: make the batch with shard_batch (which pads where the layout "
                f"needs it and tells the attention)") if padded else None)
        return None

    no_mask.__name__ = no_mask.__qualname__ = f"{name}_mask"
    return no_mask


def _is_sliding_window(local_size: int, config: Any) -> bool:
    """transformers passes ``local_size`` for a sliding window
    (``config.sliding_window``) and for chunked attention
    (``config.attention_chunk_size``); the config tells them apart. Probing
    ``mask_function`` cannot: on a shard whose positions jump (zigzag,
    packed documents) transformers wraps it to read the shard's own
    positions, so two probed indices stand for other positions than asked."""
    return (getattr(config, "sliding_window", None) == local_size
            and getattr(config, "attention_chunk_size", None) != local_size)
