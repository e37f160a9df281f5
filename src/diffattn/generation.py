"""Autoregressive generation for :class:`~diffattn.model.DiffTransformerLM`.

``generate(model, input_ids, attention_mask=None, config=None, streamer=None, generator=None,
**overrides)`` runs the prompt through the model once (the prefill, optionally in chunks),
then decodes one token per step with a KV cache from :mod:`diffattn.cache`, for all three
attention types. It returns a :class:`GenerationOutput`.

Sampling. Each step turns the last position's logits into one token per row. With
``do_sample=False`` or ``temperature=0`` the token is the argmax (greedy). Otherwise the logits
go through :func:`apply_temperature`, :func:`top_k_filter` and :func:`top_p_filter` (in that
order, each only when set) and a token is drawn from the softmax. Draws use ``generator`` if
one is passed, else a ``torch.Generator`` seeded with ``seed``, else the global RNG; with the
same seed, model and inputs the output is the same.

Batches. ``attention_mask`` (1 = real token) must pad on the LEFT, so that every row's next
token goes at the right end; a padded row gets exactly the tokens it gets alone. A row stops
when it emits one of ``eos_token_id``; from then on it receives ``pad_token_id`` (default: the
first EOS id), and generation ends early once every row has stopped.

Length. The model cannot attend beyond ``max_seq_len`` (RoPE tables and static buffers are
sized for it), so ``prompt length + max_new_tokens > max_seq_len`` raises ``ValueError``
before any work is done; the prompt length counts left padding.

Caches. ``cache="dynamic"`` grows a :class:`~diffattn.cache.DynamicCache` by concatenation.
``cache="static"`` allocates a :class:`~diffattn.cache.StaticCache` of ``prompt length +
max_new_tokens`` slots once and decodes with fixed shapes: the step passes its slot as a
tensor (``cache_position``) and a mask covering the whole buffer, so no shape and no Python
number changes from one token to the next. ``compile=True`` (static cache only) runs that step,
:func:`decode_step`, through ``torch.compile``: it is compiled on the first decode step and
reused for every later one. On the ``reference`` and ``sdpa`` backends the step is one graph
(it compiles with ``fullgraph=True``): the slot and the mask stay on the device, so nothing is
read back and nothing is recompiled per token. On CUDA the step is compiled with
``mode="reduce-overhead"`` (``compile_mode``): CUDA graphs replay the whole step with one
launch, the cache buffers marked as static addresses so the graph writes them in place.
``compile="auto"`` compiles (with the static cache) on CUDA only, where a decode step is
launch-bound, and decodes eagerly with ``cache`` elsewhere; the default, ``False``, decodes
eagerly everywhere (see :func:`decoding_plan`).

Streaming. ``streamer`` is either a callable, called with each new token column (a ``(B,)``
int64 tensor on the model's device) as soon as it is chosen, or an object with ``put(tokens)``
(same argument) and, optionally, ``end()``, called once after the last token.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from diffattn.attention.kernels import flash_available
from diffattn.cache import DynamicCache, StaticCache
from diffattn.config import reject_unknown_fields
from diffattn.model import COMPILE_MODES, DiffTransformerLM, let_dynamo_skip_kernel_logs

__all__ = [
    "CACHE_KINDS",
    "COMPILE_CHOICES",
    "GenerationConfig",
    "GenerationOutput",
    "apply_temperature",
    "compiled_decode_step",
    "decode_step",
    "decoding_plan",
    "generate",
    "mark_static_cache",
    "sample_next_token",
    "top_k_filter",
    "top_p_filter",
]

CACHE_KINDS = ("dynamic", "static")
COMPILE_CHOICES = (False, True, "auto")
"""``GenerationConfig.compile``: never, always (static cache), or on CUDA only."""
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
"""``torch.compile`` modes that capture CUDA graphs (each step starts a new replay)."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class GenerationConfig:
    """Settings of :func:`generate`; validated on construction (``ValueError`` naming the field).

    Attributes:
        max_new_tokens: tokens to generate per row at most (>= 1).
        do_sample: sample from the filtered distribution; ``False`` means greedy.
        temperature: divides the logits before sampling; ``0`` means greedy.
        top_k: keep only the ``top_k`` most probable tokens (``None``: off).
        top_p: nucleus sampling: keep the smallest set of most probable tokens whose
            probability reaches ``top_p``, in (0, 1] (``None``: off).
        eos_token_id: an id or a list of ids that end a row (``None``: never stop early).
        pad_token_id: what stopped rows receive (default: the first EOS id).
        seed: seeds a ``torch.Generator`` for the draws when no generator is passed.
        cache: ``"dynamic"`` or ``"static"`` (pre-allocated, fixed shapes).
        compile: run the decode step through ``torch.compile``: ``True`` (needs
            ``cache="static"``), ``False``, or ``"auto"``: compiled with the static cache on
            CUDA, eager with ``cache`` elsewhere (:func:`decoding_plan`).
        compile_backend: the ``torch.compile`` backend (``"inductor"``, ``"aot_eager"``, ...).
        compile_mode: the ``torch.compile`` mode; ``None`` picks ``"reduce-overhead"`` (CUDA
            graphs) on CUDA and the plain compile elsewhere.
        prefill_chunk_size: feed the prompt in chunks of this many tokens (``None``: at once).
    """

    max_new_tokens: int = 32
    do_sample: bool = True
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    seed: int | None = None
    cache: str = "dynamic"
    compile: bool | str = False
    compile_backend: str = "inductor"
    compile_mode: str | None = None
    prefill_chunk_size: int | None = None

    def __post_init__(self) -> None:
        eos = self.eos_token_id
        if isinstance(eos, Sequence) and not isinstance(eos, str):
            object.__setattr__(self, "eos_token_id", tuple(eos))  # lists become hashable
        self._validate()

    def _fail(self, name: str, message: str) -> None:
        raise ValueError(f"GenerationConfig.{name}: {message}")

    def _validate(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            self._fail("max_new_tokens", f"must be an integer >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.do_sample, bool):
            self._fail("do_sample", f"must be a bool, got {self.do_sample!r}")
        if not (isinstance(self.compile, bool) or self.compile == "auto"):
            choices = ", ".join(map(repr, COMPILE_CHOICES))
            self._fail("compile", f"must be one of {choices}, got {self.compile!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            self._fail("temperature", f"must be a finite number >= 0, got {t!r}")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            self._fail("top_k", f"must be an integer >= 1 or None (off), got {self.top_k!r}")
        p = self.top_p
        if p is not None and (
            isinstance(p, bool) or not isinstance(p, int | float) or not 0.0 < p <= 1.0
        ):
            self._fail("top_p", f"must be a number in (0, 1] or None (off), got {p!r}")
        eos = self.eos_token_id
        ids = eos if isinstance(eos, tuple) else (eos,) if eos is not None else ()
        if (isinstance(eos, tuple) and not eos) or not all(_is_int(i) and i >= 0 for i in ids):
            self._fail(
                "eos_token_id",
                f"must be a token id >= 0, a non-empty list of them, or None; got {eos!r}",
            )
        if self.pad_token_id is not None and (
            not _is_int(self.pad_token_id) or self.pad_token_id < 0
        ):
            self._fail(
                "pad_token_id", f"must be a token id >= 0 or None, got {self.pad_token_id!r}"
            )
        if self.seed is not None and not _is_int(self.seed):
            self._fail("seed", f"must be an integer or None, got {self.seed!r}")
        if self.cache not in CACHE_KINDS:
            self._fail("cache", f"must be one of {', '.join(CACHE_KINDS)}, got {self.cache!r}")
        if self.compile is True and self.cache != "static":
            self._fail("compile", "compiling the decode step needs cache='static' (fixed shapes)")
        if not isinstance(self.compile_backend, str) or not self.compile_backend:
            self._fail("compile_backend", f"must be a backend name, got {self.compile_backend!r}")
        if self.compile_mode not in COMPILE_MODES:
            modes = ", ".join(map(repr, COMPILE_MODES))
            self._fail("compile_mode", f"must be one of {modes}, got {self.compile_mode!r}")
        chunk = self.prefill_chunk_size
        if chunk is not None and (not _is_int(chunk) or chunk < 1):
            self._fail("prefill_chunk_size", f"must be an integer >= 1 or None, got {chunk!r}")

    @property
    def greedy(self) -> bool:
        """True when tokens are chosen by argmax (``do_sample=False`` or ``temperature=0``)."""
        return not self.do_sample or self.temperature == 0

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """``eos_token_id`` as a tuple (empty when unset)."""
        eos = self.eos_token_id
        return eos if isinstance(eos, tuple) else () if eos is None else (eos,)

    def replace(self, **changes: Any) -> GenerationConfig:
        """A validated copy with ``changes`` applied; an unknown name raises ``ValueError``."""
        reject_unknown_fields("GenerationConfig", changes, self, noun="setting")
        return dataclasses.replace(self, **changes)


@dataclass
class GenerationOutput:
    """What :func:`generate` returns.

    Attributes:
        sequences: ``(B, prompt_length + num_new_tokens)``: the prompt (with its padding)
            followed by the generated tokens; rows that stopped continue with the pad id.
        num_new_tokens: generated columns (fewer than ``max_new_tokens`` if all rows stopped).
        finished: ``(B,)`` bool, True for rows that emitted an EOS id.
        prompt_length: columns of the prompt, padding included.
    """

    sequences: torch.Tensor
    num_new_tokens: int
    finished: torch.Tensor
    prompt_length: int

    @property
    def new_tokens(self) -> torch.Tensor:
        """The generated part of ``sequences``, ``(B, num_new_tokens)``."""
        return self.sequences[:, self.prompt_length :]


# ----------------------------------------------------------------------------------------
# logit processing: pure functions on (..., vocab) tensors
def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature`` for ``temperature > 0``: below 1 sharpens the softmax, above 1
    flattens it. (Temperature 0, greedy decoding, is the argmax and handled by the caller.)"""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 here, got {temperature}")
    return logits if temperature == 1 else logits / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest logits of each row and set the others to ``-inf``.

    A token is kept iff its logit is >= the k-th largest logit of its row, so ties with the
    k-th value are all kept. ``k >= vocab`` keeps everything.
    """
    if k < 1:
        raise ValueError(f"top_k must be >= 1, got {k}")
    if k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of most probable tokens whose cumulative
    probability is >= ``p``; set the other logits to ``-inf``.

    With the probabilities ``softmax(logits)`` sorted in decreasing order, the token at sorted
    rank ``i`` is kept iff the probability of the tokens ranked before it is < ``p``. The top
    token is therefore always kept, so ``p -> 0`` is greedy and ``p = 1`` keeps every token
    with non-zero probability.
    """
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {p}")
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits.float(), dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass of the better-ranked tokens
    drop_sorted = before >= p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_next_token(
    logits: torch.Tensor,
    config: GenerationConfig,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token per row from ``(B, vocab)`` logits: argmax when ``config.greedy``, else a
    draw from ``softmax(top_p(top_k(logits / temperature)))``. Returns ``(B,)`` int64."""
    logits = logits.float()
    if config.greedy:
        return logits.argmax(dim=-1)
    logits = apply_temperature(logits, config.temperature)
    if config.top_k is not None:
        logits = top_k_filter(logits, config.top_k)
    if config.top_p is not None:
        logits = top_p_filter(logits, config.top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# ----------------------------------------------------------------------------------------
# the fixed-shape decode step
def decode_step(
    model: DiffTransformerLM,
    cache: StaticCache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache_position: torch.Tensor,
) -> torch.Tensor:
    """Run ``input_ids`` ``(B, N)`` into the static ``cache`` at slots ``cache_position``
    (``(N,)`` int64, consecutive) and return the last position's logits ``(B, vocab)``.

    ``attention_mask`` is ``None`` or ``(B, cache.max_len)`` (slots after the new tokens are
    ignored). Every shape is fixed and no value is read back from the device here, which is
    what lets ``torch.compile(decode_step)`` serve every decode step with one compilation.
    """
    out = model(
        input_ids,
        attention_mask=attention_mask,
        past_key_values=cache,
        cache_position=cache_position,
    )
    return out.logits[:, -1]


def decoding_plan(
    config: GenerationConfig, model: DiffTransformerLM, device: torch.device
) -> tuple[str, str | None]:
    """How :func:`generate` decodes on ``device``: ``(cache kind, compile mode)``, the mode
    ``None`` when the step runs eagerly.

    ``compile=True`` compiles (``config.cache`` is then ``"static"``). ``compile="auto"``
    compiles with the static cache on CUDA, unless the model's backend cannot run a static
    cache (flash-attn), and keeps ``config.cache`` and eager decoding elsewhere. A compiled
    step runs in ``config.compile_mode``, or by default in ``"reduce-overhead"`` (CUDA
    graphs) on CUDA and in ``torch.compile``'s default mode elsewhere.
    """
    compiled = config.compile is True or (
        config.compile == "auto"
        and device.type == "cuda"
        and _static_refusal(model, device) is None
    )
    if not compiled:
        return config.cache, None
    if config.compile_mode is not None:
        return "static", config.compile_mode
    return "static", "reduce-overhead" if device.type == "cuda" else "default"


@functools.cache
def compiled_decode_step(backend: str, mode: str = "default") -> Callable[..., torch.Tensor]:
    """:func:`decode_step` through ``torch.compile(backend=..., mode=...)``, one per pair (so
    later :func:`generate` calls reuse the compiled code).

    In a CUDA-graph mode (:data:`CUDA_GRAPH_MODES`) each call first marks a new step
    (``torch.compiler.cudagraph_mark_step_begin``): the previous step's outputs, such as its
    logits and the cache's device-side length, are then free to be overwritten by the next
    replay, so every decode step replays the same graph. Mark the cache's buffers with
    :func:`mark_static_cache` so the graph writes them in place.
    """
    let_dynamo_skip_kernel_logs()
    compiled = torch.compile(decode_step, backend=backend, mode=mode)
    if mode not in CUDA_GRAPH_MODES:
        return compiled

    def step(*args: Any) -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(*args)

    return step


def mark_static_cache(cache: StaticCache) -> StaticCache:
    """Mark every key and value buffer of ``cache`` as a static address, so a CUDA-graph step
    updates them in place instead of copying them in and out (without a guard: a new cache
    re-records the graph, it does not recompile). Returns ``cache``."""
    for buffer in (*cache.keys, *cache.values):
        torch._dynamo.mark_static_address(buffer)
    return cache


def _streamer_calls(streamer: Any) -> tuple[Callable | None, Callable | None]:
    if streamer is None:
        return None, None
    put = getattr(streamer, "put", None)
    if callable(put):
        end = getattr(streamer, "end", None)
        return put, end if callable(end) else None
    if callable(streamer):
        return streamer, None
    raise ValueError(
        f"streamer must be a callable or have a put(tokens) method, got {type(streamer).__name__}"
    )


def _static_refusal(model: DiffTransformerLM, device: torch.device) -> str | None:
    """Why ``model`` cannot decode into a static cache on ``device``, or ``None``: the flash
    kernel aligns its causal mask to the end of the keys, which a static buffer (keys up to
    max_len) breaks, so it is refused instead of returning wrong tokens."""
    backend = model.config.backend
    dtype = model.embed_tokens.weight.dtype
    auto_flash = (
        backend == "auto"
        and device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and flash_available()
    )
    if backend == "flash" or auto_flash:
        return (
            "cache='static' does not run on the flash attention backend; use cache='dynamic' "
            "or load the model with backend='sdpa'"
        )
    return None


def _prepare_mask(
    attention_mask: torch.Tensor | None, shape: tuple[int, int], device: torch.device
) -> torch.Tensor | None:
    """Validate a left-padded prompt mask; ``None`` when nothing is padded."""
    if attention_mask is None:
        return None
    if tuple(attention_mask.shape) != shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} does not match "
            f"input_ids shape {shape}"
        )
    mask = attention_mask.to(device=device, dtype=torch.long)
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (real tokens)")
    if bool((mask.sum(dim=1) == 0).any()):
        raise ValueError("attention_mask: every row needs at least one real token")
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError(
            "attention_mask must pad on the left (new tokens are appended at the right end "
            "of every row); re-pad the prompts on the left"
        )
    return None if bool(mask.all()) else mask


@torch.no_grad()
def generate(
    model: DiffTransformerLM,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    config: GenerationConfig | None = None,
    streamer: Any = None,
    generator: torch.Generator | None = None,
    **overrides: Any,
) -> GenerationOutput:
    """Generate up to ``max_new_tokens`` tokens after each row of ``input_ids``.

    Args:
        model: a :class:`~diffattn.model.DiffTransformerLM` (any attention type).
        input_ids: ``(B, P)`` int token ids; moved to the model's device.
        attention_mask: optional ``(B, P)``, 1 for real tokens, 0 for LEFT padding.
        config: a :class:`GenerationConfig` (default settings when ``None``).
        streamer: a callable or an object with ``put(tokens)`` / ``end()`` (module docstring).
        generator: a ``torch.Generator`` for the draws (overrides ``config.seed``).
        **overrides: :class:`GenerationConfig` fields replacing those of ``config``.

    Raises:
        ValueError: invalid settings or inputs, or ``P + max_new_tokens > max_seq_len``.
    """
    config = config if config is not None else GenerationConfig()
    if overrides:
        config = config.replace(**overrides)
    pad_id = _check_request(model, input_ids, config)
    bsz, prompt_len = input_ids.shape
    device = model.embed_tokens.weight.device
    input_ids = input_ids.to(device=device, dtype=torch.long)
    vocab = model.config.vocab_size
    if bool((input_ids < 0).any()) or bool((input_ids >= vocab).any()):
        raise ValueError(f"input_ids hold ids outside the model's vocabulary of {vocab}")
    prompt_mask = _prepare_mask(attention_mask, (bsz, prompt_len), device)
    put, end = _streamer_calls(streamer)
    if generator is None and config.seed is not None and not config.greedy:
        generator = torch.Generator(device=device).manual_seed(config.seed)
    decoding = _start_decoding(model, config, prompt_mask, bsz, prompt_len, device)
    logits = decoding.prefill(input_ids, config.prefill_chunk_size or prompt_len)
    columns, finished = _decode(decoding, logits, config, generator, prompt_len, pad_id, put)
    if end is not None:
        end()
    sequences = torch.cat([input_ids, torch.stack(columns, dim=1)], dim=1)
    return GenerationOutput(
        sequences=sequences,
        num_new_tokens=len(columns),
        finished=finished,
        prompt_length=prompt_len,
    )


def _check_request(model: DiffTransformerLM, input_ids: Any, config: GenerationConfig) -> int:
    """Refuse a prompt that is not a non-empty 2-D tensor of integer ids, one too long for the
    model (``P + max_new_tokens > max_seq_len``), or EOS/pad ids outside the vocabulary;
    returns the pad id (``pad_token_id``, else the first EOS id, else 0)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.numel() == 0:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else None
        raise ValueError(
            f"input_ids must be a non-empty (batch, prompt_length) tensor, got {shape}"
        )
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    prompt_len = input_ids.shape[1]
    new = config.max_new_tokens
    max_seq_len = model.config.max_seq_len
    if prompt_len + new > max_seq_len:
        raise ValueError(
            f"prompt length {prompt_len} + max_new_tokens {new} = {prompt_len + new} exceeds "
            f"the model's max_seq_len={max_seq_len}; shorten the prompt or lower max_new_tokens"
        )
    vocab = model.config.vocab_size
    eos_ids = config.eos_token_ids
    pad_id = config.pad_token_id if config.pad_token_id is not None else (eos_ids or (0,))[0]
    for name, ids in (("eos_token_id", eos_ids), ("pad_token_id", (pad_id,))):
        if any(i >= vocab for i in ids):
            raise ValueError(f"{name} {ids} is outside the model's vocabulary of {vocab}")
    return pad_id


@dataclass
class _Decoding:
    """Where a generation decodes (module docstring, "Caches"): the model, its cache, whether
    that cache is static, the step a static cache decodes with (:func:`decode_step`, compiled
    or not), and the ``(B, P + max_new_tokens)`` mask when the prompt is padded."""

    model: DiffTransformerLM
    cache: DynamicCache | StaticCache | None
    static: bool
    step: Callable[..., torch.Tensor]
    full_mask: torch.Tensor | None
    device: torch.device
    sequence: torch.Tensor | None = None
    """Without a cache (``cache`` is ``None``): the tokens so far, run whole at every step."""

    def prefill(self, input_ids: torch.Tensor, chunk: int) -> torch.Tensor:
        """Run the prompt into the cache, ``chunk`` tokens at a time (eagerly, also when the
        decode step is compiled); the last position's logits ``(B, vocab)``. Without a cache
        the prompt runs whole."""
        model, cache, full_mask = self.model, self.cache, self.full_mask
        prompt_len = input_ids.shape[1]
        if cache is None:
            self.sequence = input_ids
            return self.recompute(prompt_len)
        for start in range(0, prompt_len, chunk):
            stop = min(prompt_len, start + chunk)
            piece = input_ids[:, start:stop]
            if self.static:
                slots = torch.arange(start, stop, device=self.device)
                logits = decode_step(model, cache, piece, full_mask, slots)
            else:
                mask = full_mask[:, :stop] if full_mask is not None else None
                logits = model(piece, attention_mask=mask, past_key_values=cache).logits[:, -1]
        return logits

    def recompute(self, length: int) -> torch.Tensor:
        """The last position's logits of :attr:`sequence` (``length`` tokens), run whole."""
        mask = self.full_mask[:, :length] if self.full_mask is not None else None
        return self.model(self.sequence, attention_mask=mask).logits[:, -1]


def _cacheless_types(model: DiffTransformerLM) -> list[str]:
    """The attention types of ``model`` that cannot decode from a KV cache
    (``AttentionType.decodes_from_cache``)."""
    config = model.config
    return [t.name for t in config.attention_types if not t.decodes_from_cache]


def _start_decoding(
    model: DiffTransformerLM,
    config: GenerationConfig,
    prompt_mask: torch.Tensor | None,
    bsz: int,
    prompt_len: int,
    device: torch.device,
) -> _Decoding:
    """The mask of prompt and generated tokens (padded prompts only), and the cache and step
    :func:`decoding_plan` chooses: a :class:`StaticCache` of ``P + max_new_tokens`` slots
    (refused on flash attention) with a compiled step when it compiles, else a
    :class:`DynamicCache`."""
    total = prompt_len + config.max_new_tokens
    full_mask = None  # (B, P + max_new_tokens): prompt mask, then ones for generated tokens
    if prompt_mask is not None:
        full_mask = torch.ones(bsz, total, dtype=torch.long, device=device)
        full_mask[:, :prompt_len] = prompt_mask
    cache_kind, compile_mode = decoding_plan(config, model, device)
    static = cache_kind == "static"
    step = decode_step
    cacheless = _cacheless_types(model)
    if cacheless:
        if static:
            raise ValueError(
                f"attention type {cacheless[0]!r} cannot decode from a KV cache, so neither "
                "from a static one: generate with cache='dynamic' and no compile (each step "
                "then runs the whole sequence)"
            )
        return _Decoding(model, None, False, step, full_mask, device)
    if static:
        refusal = _static_refusal(model, device)
        if refusal is not None:
            raise ValueError(refusal)
        dtype = model.embed_tokens.weight.dtype
        cache = StaticCache(model.config, bsz, total, device=device, dtype=dtype)
        if compile_mode is not None:
            step = compiled_decode_step(config.compile_backend, compile_mode)
            mark_static_cache(cache)
    else:
        cache = DynamicCache()
    return _Decoding(model, cache, static, step, full_mask, device)


def _decode(
    decoding: _Decoding,
    logits: torch.Tensor,
    config: GenerationConfig,
    generator: torch.Generator | None,
    prompt_len: int,
    pad_id: int,
    put: Callable | None,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The decode loop from the prefill's ``logits``: one sampled token column per step
    (stopped rows get ``pad_id``), streamed to ``put``, until ``max_new_tokens`` or every row
    has emitted an EOS id; returns the columns and the ``(B,)`` finished flags."""
    model, cache, static, step = decoding.model, decoding.cache, decoding.static, decoding.step
    full_mask, device = decoding.full_mask, decoding.device
    new = config.max_new_tokens
    eos_ids = config.eos_token_ids
    eos = torch.tensor(eos_ids, device=device) if eos_ids else None
    finished = torch.zeros(logits.shape[0], dtype=torch.bool, device=device)
    columns: list[torch.Tensor] = []
    for i in range(new):
        token = sample_next_token(logits, config, generator)
        if eos is not None:
            token = torch.where(finished, torch.full_like(token, pad_id), token)
            finished = finished | torch.isin(token, eos)
        columns.append(token)
        if put is not None:
            put(token)
        if i == new - 1 or (eos is not None and bool(finished.all())):
            break
        slot = prompt_len + i  # where this token goes
        if static:
            logits = step(
                model, cache, token[:, None], full_mask, torch.arange(slot, slot + 1, device=device)
            )
        elif cache is None:  # a type that cannot decode from a cache: the whole sequence
            decoding.sequence = torch.cat([decoding.sequence, token[:, None]], dim=1)
            logits = decoding.recompute(slot + 1)
        else:
            mask = full_mask[:, : slot + 1] if full_mask is not None else None
            logits = model(token[:, None], attention_mask=mask, past_key_values=cache).logits
            logits = logits[:, -1]
    return columns, finished
