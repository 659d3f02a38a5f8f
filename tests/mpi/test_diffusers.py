"""diffusers over commlib: tiny Flux, QwenImage and Wan transformers (and
Flux 2, LTX-Video, ChronoEdit, Helios, one case per algorithm) made
context-parallel with their own ``_cp_plan`` equal the unsharded model
(float64 within 1e-10), with Ulysses, Ring and the hybrid, image and text
lengths the world size divides and not, the text sharded and whole, a
per-row text mask, uneven heads; a short denoising loop equals the
unsharded one; cross-attention over the whole text moves nothing; LTX's
attention to a text shard as long as the image shard is told from
self-attention; other models in the process are untouched; what is
refused (LTX-2, MiniMax-H3, a Helios of other than 40 blocks), on every
rank."""

import pytest

import requires
from conftest import all_ranks, raises_everywhere
from cuda_probe import cuda_skip_reason

torch = requires.module("torch")
diffusers = requires.module("diffusers")
cd = requires.module("commlib.bindings.diffusers")
from commlib import CollectiveMismatchError  # noqa: E402

# odd sizes cut every length unevenly; 4 is the 2 x 2 hybrid
WORLD_SIZES = (2, 3, 4)

HEADS, HEAD_DIM = 5, 8  # 5 heads: uneven over a Ulysses degree of 2, 3 and 4
# (image tokens, text tokens): 12 and 24 divide over 2, 3 and 4 ranks; 13 and 7 over none
# (text as long as the image: text="whole" cannot tell their RoPE tables apart, refused)
LENGTHS = {"divisible": ((3, 4), 24), "uneven": ((1, 13), 7)}
MODELS = ("flux", "qwenimage", "wan")
MORE_MODELS = ("flux2", "ltx", "chronoedit", "helios")  # one case per algorithm each
VIDEO = ("wan", "chronoedit", "helios")  # [batch, channels, frames, height, width] inputs
ALGORITHMS = ("ulysses", "ring", "hybrid")
TOL64 = 1e-10


def _randomized(model, dtype):
    """Zero-initialized weights (output projections, gates) drawn too, so
    that every path reaches the output."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if not p.abs().sum():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.to(dtype).eval()


def build(kind, dtype=torch.float64, heads=HEADS):
    torch.manual_seed(0)
    if kind == "flux":
        model = diffusers.FluxTransformer2DModel(
            patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
            attention_head_dim=HEAD_DIM, num_attention_heads=heads, joint_attention_dim=12,
            pooled_projection_dim=12, axes_dims_rope=(2, 2, 4))
    elif kind == "qwenimage":
        model = diffusers.QwenImageTransformer2DModel(
            patch_size=1, in_channels=8, out_channels=8, num_layers=2,
            attention_head_dim=HEAD_DIM, num_attention_heads=heads, joint_attention_dim=12,
            axes_dims_rope=(2, 2, 4))
    elif kind == "flux2":
        model = diffusers.Flux2Transformer2DModel(
            patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
            attention_head_dim=HEAD_DIM, num_attention_heads=heads, joint_attention_dim=12,
            timestep_guidance_channels=16, axes_dims_rope=(2, 2, 2, 2), guidance_embeds=False)
    elif kind == "ltx":
        model = diffusers.LTXVideoTransformer3DModel(
            in_channels=8, out_channels=8, num_attention_heads=heads, attention_head_dim=HEAD_DIM,
            cross_attention_dim=heads * HEAD_DIM, num_layers=2, caption_channels=12)
    elif kind == "chronoedit":
        model = diffusers.ChronoEditTransformer3DModel(
            patch_size=(1, 1, 1), num_attention_heads=heads, attention_head_dim=HEAD_DIM,
            in_channels=4, out_channels=4, text_dim=12, freq_dim=16, ffn_dim=32, num_layers=2,
            rope_max_seq_len=32)
    elif kind == "helios":  # its plan names blocks 0-39 one by one: 40 tiny blocks
        model = diffusers.HeliosTransformer3DModel(
            patch_size=(1, 1, 1), num_attention_heads=heads, attention_head_dim=HEAD_DIM,
            in_channels=4, out_channels=4, text_dim=12, freq_dim=16, ffn_dim=32, num_layers=40,
            rope_dim=(4, 2, 2))
    else:
        model = diffusers.WanTransformer3DModel(
            patch_size=(1, 1, 1), num_attention_heads=heads, attention_head_dim=HEAD_DIM,
            in_channels=4, out_channels=4, text_dim=12, freq_dim=16, ffn_dim=32, num_layers=2,
            rope_max_seq_len=32)
    return _randomized(model, dtype)


def inputs(kind, lengths, dtype=torch.float64, batch=2, seed=1):
    """The same global inputs on every rank. QwenImage's text mask hides the
    last two text tokens of row 1 only (a mask per row)."""
    (h, w), text = LENGTHS[lengths] if isinstance(lengths, str) else lengths
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)
    timestep = torch.full((batch,), 0.5, dtype=dtype)
    if kind == "flux":
        return dict(hidden_states=rand(batch, h * w, 8),
                    encoder_hidden_states=rand(batch, text, 12),
                    pooled_projections=rand(batch, 12), timestep=timestep,
                    img_ids=rand(h * w, 3), txt_ids=rand(text, 3))
    if kind == "flux2":
        return dict(hidden_states=rand(batch, h * w, 8),
                    encoder_hidden_states=rand(batch, text, 12), timestep=timestep,
                    img_ids=rand(batch, h * w, 4), txt_ids=rand(batch, text, 4))
    if kind == "ltx":  # its text mask hides the last two text tokens of row 1
        mask = torch.ones(batch, text, dtype=dtype)
        mask[1, -2:] = 0
        return dict(hidden_states=rand(batch, h * w, 8),
                    encoder_hidden_states=rand(batch, text, 12), timestep=timestep * 1000,
                    encoder_attention_mask=mask, num_frames=1, height=h, width=w)
    if kind == "qwenimage":
        mask = torch.ones(batch, text, dtype=torch.long)
        mask[1, -2:] = 0
        return dict(hidden_states=rand(batch, h * w, 8),
                    encoder_hidden_states=rand(batch, text, 12),
                    encoder_hidden_states_mask=mask, timestep=timestep,
                    img_shapes=[[(1, h, w)]] * batch)
    assert kind in VIDEO, kind
    return dict(hidden_states=rand(batch, 4, 1, h, w),
                encoder_hidden_states=rand(batch, text, 12),
                timestep=timestep * 1000)


def degrees(algorithm, size):
    """(ring_degree, ulysses_degree) of an algorithm at this world size."""
    if algorithm == "ulysses":
        return 1, size
    if algorithm == "ring":
        return size, 1
    if size != 4:
        pytest.skip("the hybrid needs 4 ranks here (a 2 x 2 grid)")
    return 2, 2


def sharded(model, comm, call, **options):
    cd.context_parallel(model, comm, **options)
    try:
        return call()
    finally:
        cd.remove_context_parallel(model)


def max_error(a, b):
    return float((a.detach().double() - b.detach().double()).abs().max())


_models = {}


def cached(kind):
    if kind not in _models:
        _models[kind] = build(kind)
    return _models[kind]


CASES = [(kind, algorithm, text, lengths) for kind in MODELS for algorithm in ALGORITHMS
         for text in ("sharded", "whole") for lengths in LENGTHS
         if not (kind == "wan" and text == "whole")]  # Wan's plan never splits the text
# LTX attends to the text: sharded (gathered) with Ulysses and the hybrid, whole with Ring
CASES += [(kind, algorithm, "whole" if (kind, algorithm) == ("ltx", "ring") else "sharded",
           "uneven") for kind in MORE_MODELS for algorithm in ALGORITHMS]


@pytest.mark.quick_sample(8)
@pytest.mark.parametrize("kind,algorithm,text,lengths", CASES,
                         ids=["-".join(case) for case in CASES])
def test_sharded_model_equals_the_unsharded(comm, kind, algorithm, text, lengths):
    ring, ulysses = degrees(algorithm, comm.size)
    model = cached(kind)
    with torch.no_grad():
        want = model(**inputs(kind, lengths)).sample
        got = sharded(model, comm, lambda: model(**inputs(kind, lengths)).sample,
                      ring_degree=ring, ulysses_degree=ulysses, text=text)
    assert got.shape == want.shape
    assert all_ranks(max_error(got, want) < TOL64), max_error(got, want)


def test_attention_to_a_text_shard_as_long_as_the_image_shard(comm):
    """LTX's attention to the text, where the text shard is as long as the
    image shard: told from self-attention by the processor's arguments
    (gathered), not by the lengths."""
    ring, ulysses = degrees("ulysses", comm.size)
    model = cached("ltx")
    lengths = ((2, 6), 12)
    with torch.no_grad():
        want = model(**inputs("ltx", lengths)).sample
        got = sharded(model, comm, lambda: model(**inputs("ltx", lengths)).sample,
                      ring_degree=ring, ulysses_degree=ulysses)
    assert all_ranks(max_error(got, want) < TOL64), max_error(got, want)


def test_flux_takes_its_deprecated_3d_ids(comm):
    """Flux with img_ids/txt_ids of shape [1, tokens, 3] (diffusers warns
    and takes ids[0]): the same image as the unsharded model (they were
    left whole, and the RoPE table did not match the split image)."""
    ring, ulysses = degrees("ulysses", comm.size)
    model = cached("flux")
    batched = inputs("flux", "uneven")
    batched.update(img_ids=batched["img_ids"][None], txt_ids=batched["txt_ids"][None])
    with torch.no_grad():
        want = model(**inputs("flux", "uneven")).sample
        got = sharded(model, comm, lambda: model(**batched).sample, ring_degree=ring,
                      ulysses_degree=ulysses)
    assert all_ranks(max_error(got, want) < TOL64), max_error(got, want)


@pytest.mark.parametrize("text", ["sharded", "whole"])
def test_an_empty_text_is_flux_joint_attention_over_the_image(comm, text):
    """Flux with no text tokens: its joint attention is over the image alone
    (the processor was given encoder_hidden_states, of length 0: not a
    cross-attention over the text)."""
    model = cached("flux")
    lengths = ((1, 13), 0)
    with torch.no_grad():
        want = model(**inputs("flux", lengths)).sample
        got = sharded(model, comm, lambda: model(**inputs("flux", lengths)).sample, text=text)
    assert all_ranks(max_error(got, want) < TOL64), max_error(got, want)


def test_float32_within_rounding(comm):
    """float32, uneven lengths, the hybrid where it exists: within 1e-5 of
    the unsharded float32 model (measured: below 2e-6)."""
    model = build("flux", torch.float32)
    ring = 2 if comm.size == 4 else 1
    with torch.no_grad():
        want = model(**inputs("flux", "uneven", torch.float32)).sample
        got = sharded(model, comm,
                      lambda: model(**inputs("flux", "uneven", torch.float32)).sample,
                      ring_degree=ring)
    assert all_ranks(max_error(got, want) < 1e-5), max_error(got, want)


# float64 gradients, per family: within 1e-10 where the model computes in float64 throughout
# (measured at most 3e-14); Wan and ChronoEdit run their norms in float32 (FP32LayerNorm: the
# sums over a rank's tokens and over all tokens round differently), measured up to 1.5e-7;
# Helios too, and every block gathers and re-splits: measured up to 1.1e-6 (|grad| up to 60)
GRAD_TOL = {"flux": TOL64, "qwenimage": TOL64, "flux2": TOL64, "ltx": TOL64, "wan": 1e-6,
            "chronoedit": 1e-6, "helios": 1e-5}
GRAD_CASES = [pytest.param(kind, marks=[pytest.mark.full] if kind == "helios" else [])
              for kind in GRAD_TOL]


@pytest.mark.parametrize("kind", GRAD_CASES)
def test_gradients_equal_the_unsharded(comm, kind):
    """Training through it: the gathered output's loss, every rank's weight
    gradients summed (each rank's are its share), gives every weight the
    gradient of the unsharded model: LTX's attention to a split text (its
    keys' gradient summed over the ranks that attend with them), Helios'
    replicated stretches between a gather and the next split. Ring for
    Flux, Ulysses for the rest."""
    model = cached(kind)

    def grads():
        model.zero_grad()
        model(**inputs(kind, "uneven")).sample.square().sum().backward()
        return [torch.zeros_like(p) if p.grad is None else p.grad.clone()
                for p in model.parameters()]
    want = grads()
    ring = comm.size if kind == "flux" else 1
    got = [comm.allreduce(g) for g in sharded(model, comm, grads, ring_degree=ring)]
    error = max(max_error(g, w) for g, w in zip(got, want))
    assert all_ranks(error < GRAD_TOL[kind]), error


def test_denoising_loop_equals_the_unsharded(comm):
    """Three Euler steps of flow matching with the model sharded give the
    latents of the unsharded loop."""
    model = cached("flux")

    def denoise():
        scheduler = diffusers.FlowMatchEulerDiscreteScheduler()
        scheduler.set_timesteps(3)
        step = inputs("flux", "uneven")
        latents = step.pop("hidden_states")
        with torch.no_grad():
            for t in scheduler.timesteps:
                step["timestep"] = torch.full((2,), float(t) / 1000, dtype=torch.float64)
                velocity = model(hidden_states=latents, **step).sample
                latents = scheduler.step(velocity, t, latents).prev_sample
        return latents
    want = denoise()
    got = sharded(model, comm, denoise, ring_degree=1)
    assert all_ranks(max_error(got, want) < TOL64), max_error(got, want)


def test_cross_attention_moves_nothing(comm):
    """Wan's cross-attention reads the whole text on every rank: no
    collective runs inside it; its self-attention does communicate."""
    model = cached("wan")
    calls, inside = [], {}
    names = ("alltoall", "alltoall_many", "alltoallv", "allgather", "ring_shift",
             "ring_shift_async", "agree")
    originals = {name: getattr(comm, name) for name in names}

    def counting(name):
        def call(*args, **kwargs):
            calls.append(name)
            return originals[name](*args, **kwargs)
        return call
    hooks = []
    for i, block in enumerate(model.blocks):
        for attn in ("attn1", "attn2"):
            module = getattr(block, attn)
            key = f"{i}.{attn}"
            hooks.append(module.register_forward_pre_hook(
                lambda *_, key=key: inside.__setitem__(key, len(calls))))
            hooks.append(module.register_forward_hook(
                lambda *_, key=key: inside.__setitem__(key, len(calls) - inside[key])))
    for name in names:
        setattr(comm, name, counting(name))
    try:
        with torch.no_grad():
            sharded(model, comm, lambda: model(**inputs("wan", ((2, 3), 9))))
    finally:
        for name in names:
            delattr(comm, name)
        for hook in hooks:
            hook.remove()
    crossing = {key: n for key, n in inside.items() if key.endswith("attn2")}
    selfs = {key: n for key, n in inside.items() if key.endswith("attn1")}
    assert all_ranks(all(n == 0 for n in crossing.values())
                     and all(n > 0 for n in selfs.values())), (crossing, selfs)


def test_other_models_are_untouched(comm):
    """A second Flux in the same process runs unsharded, on this rank alone,
    while the first is context-parallel; the first, undone, too."""
    first, second = cached("flux"), build("flux")
    with torch.no_grad():
        want = second(**inputs("flux", "uneven")).sample
        got = sharded(first, comm, lambda: second(**inputs("flux", "uneven")).sample)
        again = first(**inputs("flux", "uneven")).sample
    assert all_ranks(max_error(got, want) == 0 and max_error(again, want) == 0)


def test_refused_on_every_rank(comm):
    model = cached("flux")
    raises_everywhere(ValueError, lambda: cd.context_parallel(model, comm,
                                                              ring_degree=comm.size + 1),
                      match="must divide the number of ranks")
    raises_everywhere(ValueError, lambda: cd.context_parallel(model, comm, ring_degree=1,
                                                              ulysses_degree=1),
                      match="must equal the number of ranks")
    raises_everywhere(ValueError, lambda: cd.context_parallel(model, comm, text="half"),
                      match="text='half'")
    raises_everywhere(ValueError, lambda: cd.remove_context_parallel(model),
                      match="is not context-parallel")
    cd.context_parallel(model, comm)
    try:
        raises_everywhere(ValueError, lambda: cd.context_parallel(model, comm),
                          match="already parallel")
        # each rank its own latents: refused before they are split
        mine = inputs("flux", "uneven", seed=comm.rank)
        raises_everywhere(CollectiveMismatchError, lambda: model(**mine))
    finally:
        cd.remove_context_parallel(model)


def test_without_a_plan_refused_by_name(comm):
    """Refused naming the models that can be made parallel, and apart from
    them those that declare a plan but are refused."""
    model = diffusers.SD3Transformer2DModel(
        sample_size=4, patch_size=1, in_channels=4, num_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=8, caption_projection_dim=16,
        pooled_projection_dim=8, out_channels=4)
    error = raises_everywhere(ValueError, lambda: cd.context_parallel(model, comm),
                              match="SD3Transformer2DModel has no _cp_plan")
    supported = str(error).split("the models that can: ")[1].split(" (")[0]
    assert "FluxTransformer2DModel" in supported and "WanTransformer3DModel" in supported
    assert "LTX2VideoTransformer3DModel" not in supported
    assert "LTX2VideoTransformer3DModel and MiniMaxH3Transformer3DModel declare one too, but " \
           "are refused" in str(error)


def test_models_whose_attention_is_not_placed_refused_by_name(comm):
    """LTX-2 (a whole audio stream attending to and from the split video)
    and MiniMax-H3 (a packed sequence split at the first block), tiny, and a
    Helios of other than the 40 blocks its plan names, before any hook."""
    torch.manual_seed(0)
    ltx2 = diffusers.LTX2VideoTransformer3DModel(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, audio_in_channels=8, audio_out_channels=8,
        audio_num_attention_heads=2, audio_attention_head_dim=8, audio_cross_attention_dim=16,
        num_layers=1, caption_channels=12)
    minimax = diffusers.MiniMaxH3Transformer3DModel(
        num_attention_heads=2, attention_head_dim=8, hidden_size=16, num_layers=1,
        num_refiner_layers=1, ffn_dim=32, in_channels=4, audio_in_channels=4, text_dim=12,
        freq_dim=16, time_embed_hidden_dim=16, time_embed_dim=16, rope_freq_dim=4)
    for model, why in ((ltx2, "its audio stream"), (minimax, "a packed")):
        error = raises_everywhere(ValueError, lambda m=model: cd.context_parallel(m, comm),
                                  match=f"{type(model).__name__} is not supported")
        assert why in str(error)
    helios = diffusers.HeliosTransformer3DModel(
        patch_size=(1, 1, 1), num_attention_heads=2, attention_head_dim=8, in_channels=4,
        out_channels=4, text_dim=12, freq_dim=16, ffn_dim=32, num_layers=2, rope_dim=(4, 2, 2))
    raises_everywhere(ValueError, lambda: cd.context_parallel(helios, comm),
                      match="HeliosTransformer3DModel's own _cp_plan does not fit this "
                            "instance: _cp_plan key 'blocks.2.attn1'")
    assert not helios._forward_pre_hooks and not hasattr(helios, "_commlib_context_parallel")


def test_fewer_heads_than_the_ulysses_degree_refused(comm):
    model = build("flux", heads=1)
    raises_everywhere(ValueError, lambda: sharded(model, comm,
                                                  lambda: model(**inputs("flux", "uneven"))),
                      match="fewer than the Ulysses degree")


_NO_CUDA = cuda_skip_reason("torch")


@pytest.mark.gpu
@pytest.mark.skipif(_NO_CUDA is not None, reason=str(_NO_CUDA))
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_on_the_gpu(comm, algorithm):
    """CUDA tensors, float32 and bfloat16: within rounding of the unsharded
    model on the same GPU."""
    ring, ulysses = degrees(algorithm, comm.size)
    device = torch.device("cuda", torch.cuda.current_device())
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        model = build("flux", dtype).to(device)
        step = {k: v.to(device) for k, v in inputs("flux", "uneven", dtype).items()}
        with torch.no_grad():
            want = model(**step).sample
            got = sharded(model, comm, lambda m=model, x=step: m(**x).sample, ring_degree=ring,
                          ulysses_degree=ulysses)
        assert all_ranks(max_error(got, want) < tol * max(1.0, float(want.abs().max())))


# overlap_groups: 8 heads in 2 groups cut over 2, 3 and 4 ranks (4 a group: unevenly over 3)
OVERLAP_HEADS, GROUPS = 8, 2
FP8_TOL = 1e-2  # FP8 wire: output error / max |out|, tiny Flux: 1.3e-3 float32, 4.2e-3 bf16


def _overlapped_flux():
    if "flux8" not in _models:
        _models["flux8"] = build("flux", heads=OVERLAP_HEADS)
    return _models["flux8"]


def _counting(comm, name, calls):
    original = getattr(comm, name)

    def call(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)
    setattr(comm, name, call)


OVERLAP_CASES = [(text, lengths) for text in ("sharded", "whole") for lengths in LENGTHS]


@pytest.mark.quick_sample(2)
@pytest.mark.parametrize("text,lengths", OVERLAP_CASES, ids=["-".join(c) for c in OVERLAP_CASES])
def test_overlapped_projection_equals_the_unsharded(comm, text, lengths):
    """overlap_groups: Flux's double- and single-stream attention project
    their heads group by group inside the overlapped Ulysses (one started
    exchange per group and direction, counted), equal to the unsharded model."""
    model = _overlapped_flux()
    calls = []
    with torch.no_grad():
        want = model(**inputs("flux", lengths)).sample
        _counting(comm, "alltoall_many_async", calls)
        try:
            got = sharded(model, comm, lambda: model(**inputs("flux", lengths)).sample,
                          text=text, overlap_groups=GROUPS)
        finally:
            delattr(comm, "alltoall_many_async")
    attentions = len(model.transformer_blocks) + len(model.single_transformer_blocks)
    assert len(calls) == 2 * GROUPS * attentions, calls
    assert all_ranks(max_error(got, want) < TOL64), max_error(got, want)


def test_overlapped_gradients_equal_the_unsharded(comm):
    model = _overlapped_flux()

    def grads():
        model.zero_grad()
        model(**inputs("flux", "uneven")).sample.square().sum().backward()
        return [p.grad.clone() for p in model.parameters()]
    want = grads()
    got = [comm.allreduce(g) for g in sharded(model, comm, grads, overlap_groups=GROUPS)]
    error = max(max_error(g, w) for g, w in zip(got, want))
    assert all_ranks(error < TOL64), error


@pytest.mark.parametrize("overlap", [None, GROUPS], ids=["plain", "overlapped"])
def test_fp8_wire_within_its_error(comm, overlap):
    """attention_options={"wire": "float8"} under no_grad (Ulysses; the
    hybrid at 4 ranks): within FP8_TOL of max |out| of the exact binding."""
    model = build("flux", torch.float32, heads=OVERLAP_HEADS)
    ring = 2 if comm.size == 4 and overlap is None else 1
    step = inputs("flux", "uneven", torch.float32)
    with torch.no_grad():
        exact = sharded(model, comm, lambda: model(**step).sample, ring_degree=ring)
        fp8 = sharded(model, comm, lambda: model(**step).sample, ring_degree=ring,
                      overlap_groups=overlap, attention_options={"wire": "float8"})
    error = max_error(fp8, exact) / float(exact.abs().max())
    assert all_ranks(0 < error < FP8_TOL), error


def test_overlap_and_wire_refused_on_every_rank(comm):
    model = _overlapped_flux()
    grad = cd.context_parallel(model, comm, overlap_groups=GROUPS,
                               attention_options={"wire": "float8"})
    try:  # the torch binding's refusal of an FP8 forward under autograd
        raises_everywhere(ValueError, lambda: grad(**inputs("flux", "uneven")),
                          match="for inference")
    finally:
        cd.remove_context_parallel(model)
    if comm.size > 1:
        raises_everywhere(ValueError, lambda: cd.context_parallel(
            model, comm, ring_degree=comm.size, overlap_groups=GROUPS), match="pure Ulysses only")
        raises_everywhere(ValueError, lambda: cd.context_parallel(
            model, comm, ring_degree=comm.size, attention_options={"wire": "float8"}),
            match="pure Ring")
    raises_everywhere(ValueError, lambda: cd.context_parallel(model, comm, overlap_groups=3),
                      match="does not divide num_heads=8")
    raises_everywhere(ValueError, lambda: cd.context_parallel(model, comm, overlap_groups=0),
                      match="must be a positive int")


# -- what a rank's answer depends on, agreed: weights and unsplit inputs ----------------------

def _rank_own(value, rank):
    """``value`` as rank ``rank`` gets it: rank 0 the common one, others
    their own (a tensor shifted, QwenImage's image shapes transposed)."""
    if rank == 0:
        return value
    if isinstance(value, torch.Tensor):
        return value + 1e-3 * rank
    return [[(frames, width, height) for frames, height, width in row] for row in value]


# the inputs each model's plan leaves whole (the text under text="whole")
UNSPLIT = [("flux", "sharded", "timestep"), ("flux", "sharded", "pooled_projections"),
           ("flux", "whole", "encoder_hidden_states"), ("wan", "sharded", "timestep"),
           ("wan", "sharded", "encoder_hidden_states"), ("qwenimage", "sharded", "img_shapes")]


@pytest.mark.parametrize("kind,text,name", UNSPLIT, ids=["-".join(case) for case in UNSPLIT])
def test_an_unsplit_input_that_differs_is_refused_by_name(comm, kind, text, name):
    """An input that no rank splits (so no split checks it) but differs
    between ranks: CollectiveMismatchError on every rank naming it, before
    anything is computed (each rank's share of the image would be its
    own, silently wrong); the same inputs then run."""
    model = cached(kind)
    step = inputs(kind, "uneven")
    mine = {**step, name: _rank_own(step[name], comm.rank)}
    cd.context_parallel(model, comm, text=text)
    try:
        with torch.no_grad():
            raises_everywhere(CollectiveMismatchError, lambda: model(**mine),
                              match=f"the inputs and weights of {type(model).__name__} differ "
                                    f"between ranks: {name} (")
            assert model(**step).sample.shape == step["hidden_states"].shape
    finally:
        cd.remove_context_parallel(model)


def test_weights_that_differ_are_refused_by_name(comm):
    """A model built from each rank's own seed, and one whose single weight
    differs on the ranks past 0: refused by context_parallel on every rank,
    naming the tensors, before anything is installed."""
    model = build("flux")
    gen = torch.Generator().manual_seed(100 + comm.rank)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
    error = raises_everywhere(CollectiveMismatchError, lambda: cd.context_parallel(model, comm),
                              match="the weights of FluxTransformer2DModel differ between ranks")
    assert "more (the same shapes" in str(error)
    model = build("flux")
    with torch.no_grad():
        model.transformer_blocks[0].attn.to_q.weight[0, 0] += comm.rank
    raises_everywhere(CollectiveMismatchError, lambda: cd.context_parallel(model, comm),
                      match="differ between ranks: transformer_blocks.0.attn.to_q.weight (")
    assert not hasattr(model, "_commlib_context_parallel") and not model._forward_pre_hooks


def _change_weights(model, change):
    """A change of the weights: in place (the version counter), a new tensor
    (load_state_dict(assign=True)), or a tensor added and then one of
    diffusers' adapter methods called (as loading a LoRA does; without
    peft it raises, and still marks the weights to be read again)."""
    if change == "in place":
        with torch.no_grad():
            model.proj_out.weight[0, 0] += 1
    elif change == "assigned":
        model.proj_out.load_state_dict({"weight": model.proj_out.weight.detach() + 1,
                                        "bias": model.proj_out.bias.detach()}, assign=True)
    else:
        model.proj_out.register_buffer("added", torch.ones(3, dtype=torch.float64))
        with pytest.raises(ValueError, match="PEFT backend is required"):
            model.fuse_lora()


@pytest.mark.parametrize("change", ["in place", "assigned", "adapter"])
def test_a_later_weight_change_on_one_rank_is_refused(comm, change):
    """After context_parallel, rank 0 alone changes its weights: the next
    forward is refused on every rank. The same change then made on every
    rank runs, equal to the unsharded model with it."""
    model, reference = build("flux"), build("flux")
    _change_weights(reference, change)
    step = inputs("flux", "uneven")
    cd.context_parallel(model, comm)
    try:
        if comm.rank == 0:
            _change_weights(model, change)
        with torch.no_grad():
            raises_everywhere(CollectiveMismatchError, lambda: model(**step),
                              match="parameters and buffers" if change == "adapter" else
                              "differ between ranks: proj_out.weight (")
            if comm.rank:
                _change_weights(model, change)
            got, want = model(**step).sample, reference(**step).sample
    finally:
        cd.remove_context_parallel(model)
    assert all_ranks(max_error(got, want) < TOL64), max_error(got, want)


# -- diffusers' own forms: a pipeline, ContextParallelConfig; mistakes refused by name ------

def test_diffusers_config_gives_the_degrees(comm):
    """config=ContextParallelConfig(...) in place of the degrees: Ulysses
    and Ring, each equal to the unsharded model."""
    model = cached("flux")
    with torch.no_grad():
        want = model(**inputs("flux", "uneven")).sample
        for degrees in (dict(ulysses_degree=comm.size), dict(ring_degree=comm.size)):
            config = diffusers.ContextParallelConfig(**degrees)
            got = sharded(model, comm, lambda: model(**inputs("flux", "uneven")).sample,
                          config=config)
            assert all_ranks(max_error(got, want) < TOL64), (degrees, max_error(got, want))


def _wan_pipeline(transformer, transformer_2):
    """Wan 2.2's two-stage pipeline (transformer above the boundary
    timestep, transformer_2 below), fed prompt embeddings, returning
    latents: no tokenizer, text encoder or VAE."""
    pipe = diffusers.WanPipeline(tokenizer=None, text_encoder=None, vae=None,
                                 scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
                                 transformer=transformer, transformer_2=transformer_2,
                                 boundary_ratio=0.6)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _denoised(pipe):
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randn(1, 7, 12, generator=gen, dtype=torch.float64)
    return pipe(prompt_embeds=prompt, negative_prompt_embeds=prompt / 2, guidance_scale=2.0,
                height=16, width=80, num_frames=1, num_inference_steps=2, output_type="latent",
                generator=torch.Generator().manual_seed(5)).frames


def test_a_pipeline_with_two_transformers(comm):
    """context_parallel(pipeline): both of Wan 2.2's transformers made
    parallel (each one called, in its own stage), the pipeline returned;
    its latents equal the unsharded pipeline's (2 x 10 latent tokens)."""
    first = build("wan")
    second = build("wan")
    with torch.no_grad():
        for p in second.parameters():
            p.mul_(1.1)
    pipe = _wan_pipeline(first, second)
    want = _denoised(pipe)
    calls = []
    hooks = [m.register_forward_hook(lambda *_, m=m: calls.append(m)) for m in (first, second)]
    assert cd.context_parallel(pipe, comm) is pipe
    try:
        assert hasattr(first, "_commlib_context_parallel")
        assert hasattr(second, "_commlib_context_parallel")
        got = _denoised(pipe)
    finally:
        cd.remove_context_parallel(pipe)
        for hook in hooks:
            hook.remove()
    assert first in calls and second in calls
    assert not hasattr(first, "_commlib_context_parallel")
    assert all_ranks(max_error(got, want) < TOL64), max_error(got, want)


def test_diffusers_forms_refused_by_name(comm):
    """A ContextParallelConfig where the communicator goes; degrees given
    twice; a mesh; a pipeline with no transformer; diffusers'
    enable_parallelism on a model commlib holds (and back once undone)."""
    model = cached("flux")
    config = diffusers.ContextParallelConfig(ulysses_degree=2)
    raises_everywhere(TypeError, lambda: cd.context_parallel(model, config),
                      match="diffusers' ContextParallelConfig goes in config=")
    raises_everywhere(ValueError, lambda: cd.context_parallel(model, comm, config=config,
                                                              ring_degree=1),
                      match="the degrees were given twice")
    raises_everywhere(ValueError, lambda: cd.context_parallel(
        model, comm, config=diffusers.ContextParallelConfig(ulysses_degree=2, mesh=object())),
        match="not by a torch DeviceMesh")
    raises_everywhere(ValueError, lambda: cd.context_parallel(_wan_pipeline(None, None), comm),
                      match="WanPipeline holds no transformer")
    cd.context_parallel(model, comm)
    try:
        raises_everywhere(ValueError, lambda: model.enable_parallelism(config=config),
                          match="already context-parallel through commlib")
    finally:
        cd.remove_context_parallel(model)
    assert "enable_parallelism" not in vars(model) and "fuse_lora" not in vars(model)


@pytest.mark.parametrize("options", [{"parallel_config": None}, {"wrie": "float8"},
                                     {"method": "auto"}], ids=["diffusers", "typo", "method"])
def test_attention_options_refused_by_name(comm, options):
    """Options commlib's attention does not take (diffusers' own
    parallel_config, a typo; Ring's method under pure Ulysses), refused by
    context_parallel on every rank, not at the first forward."""
    model = cached("flux")
    match = ("pure Ulysses (ring_degree=1) has no ring" if "method" in options else
             f"attention_options {next(iter(options))}: not an option of commlib's attention; "
             f"the accepted keys: kernel")
    raises_everywhere(ValueError, lambda: cd.context_parallel(model, comm,
                                                              attention_options=options),
                      match=match)
    assert not hasattr(model, "_commlib_context_parallel")


def test_each_thing_agreed_once_a_forward(comm):
    """One agreement opens a forward (the model's inputs, whole or to be
    split, and its weights); only tensors computed inside the model are
    agreed at their split, each once: Flux splits only its inputs (one
    agreement in all); QwenImage's text mask, split at each of its 2
    blocks, once (with its RoPE tables and embedded image and text: 5)."""
    original, ops = comm.agree, []

    def counting(op, *facts, **options):
        ops.append(op)
        return original(op, *facts, **options)
    for kind, splits in (("flux", 0), ("qwenimage", 5)):
        model = cached(kind)
        cd.context_parallel(model, comm)
        ops.clear()
        comm.agree = counting
        try:
            with torch.no_grad():
                model(**inputs(kind, "uneven"))
        finally:
            del comm.agree
            cd.remove_context_parallel(model)
        ours = [op for op in ops if op.startswith("diffusers")]
        assert ours == ["diffusers context_parallel forward"] + \
            ["diffusers context_parallel split"] * splits, (kind, ours)
