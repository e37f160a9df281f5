"""What differs between the transformers releases diffattn supports, in one place.

transformers 5.24 renamed the KV cache argument and output field from ``past_key_values`` to
``cache`` (the old name still reaches a model's ``forward`` from code written for older
releases, and older releases' ``generate`` passes it). Nothing else in :mod:`diffattn.hf`
looks at the version: it asks this module.

The supported range is stated in ``pyproject.toml`` and tested at both ends
(``constraints/lowest.txt`` and the newest release; docs/compatibility.md).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import itertools
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from transformers import Cache, GenerationConfig, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

CACHE_FIELD = (
    "cache"
    if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
    else "past_key_values"
)
"""The name of the cache in HF's model outputs (and ``forward`` arguments) of this release."""


def resolve_cache_argument(cache: Any, past_key_values: Any) -> Any:
    """The cache a ``forward`` was given, under either name.

    ``past_key_values`` warns (``FutureWarning``) on releases whose name is ``cache``, as HF's
    own models do; both names at once is a ``ValueError``.
    """
    if past_key_values is None:
        return cache
    if cache is not None:
        raise ValueError("give the cache as `cache` or as `past_key_values`, not both")
    if CACHE_FIELD == "cache" and not torch.compiler.is_compiling():
        warnings.warn(
            "`past_key_values` is deprecated in this transformers release; pass the cache as "
            "`cache`",
            FutureWarning,
            stacklevel=3,
        )
    return past_key_values


CACHE_UPDATE_TAKES_SLOTS = "cache_kwargs" in inspect.signature(Cache.update).parameters
"""Whether this release's ``Cache.update`` must be told the slots to write (``cache_kwargs``
with ``cache_position``). Before 5.24 a static cache layer does not count its tokens: without
slots it writes every update at slot 0, and its ``get_seq_length`` counts the slots whose key
is not all zeros. From 5.24 every layer keeps its own length and takes no slots."""


def update_cache(
    cache: Any,
    layer_index: int,
    keys: torch.Tensor,
    values: torch.Tensor,
    cached_tokens: int | None = None,
    slots: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write ``keys``/``values`` of the new tokens into an HF ``Cache`` right after its
    ``cached_tokens`` tokens (or at the tensor ``slots``, which are that same run: the
    fixed-shape path reads no length from the device), and return the layer's keys and values
    (all of them). From 5.24 the cache places them after its own length."""
    if CACHE_UPDATE_TAKES_SLOTS:
        if slots is None:
            slots = torch.arange(cached_tokens, cached_tokens + keys.shape[-2], device=keys.device)
        return cache.update(keys, values, layer_index, {"cache_position": slots})
    return cache.update(keys, values, layer_index)


@contextlib.contextmanager
def keeping_loaded_tensors(module: torch.nn.Module) -> Iterator[bool]:
    """Run a module's weight initialisation without touching what ``from_pretrained`` loaded.

    HF marks each tensor it loaded (or will tie) with ``_is_hf_initialized`` and then calls
    ``_init_weights`` on every module. From 5.24 it also marks a module whose own tensors are
    all loaded, and skips it; before 5.24 it calls ``_init_weights`` anyway and relies on its
    own ``transformers.initialization`` functions, which skip marked tensors. diffattn's
    initialisers are its own, so in every release: yields ``False`` when all of ``module``'s
    own parameters and buffers are loaded (nothing to initialise), else ``True``, and puts the
    loaded values back afterwards.
    """
    own = [
        t
        for t in itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False))
        if t is not None
    ]
    loaded = [t for t in own if getattr(t, "_is_hf_initialized", False)]
    if own and len(loaded) == len(own):
        yield False
        return
    kept = [(t, t.detach().clone()) for t in loaded]
    yield True
    with torch.no_grad():
        for tensor, value in kept:
            tensor.copy_(value)


CHECKPOINTING_PROPERTY = (
    "is_activation_checkpointing"
    if hasattr(PreTrainedModel, "is_activation_checkpointing")
    else "is_gradient_checkpointing"
)
"""HF's property telling whether activation (gradient) checkpointing is on: renamed
``is_activation_checkpointing`` in later 5.x releases (the old name then warns)."""

ACTIVATION_CHECKPOINTING_METHODS = hasattr(PreTrainedModel, "activation_checkpointing_enable")
"""Whether HF names its switches ``activation_checkpointing_enable``/``_disable`` (later 5.x
releases; ``gradient_checkpointing_enable``/``_disable`` then warn) or only the old names."""


def is_activation_checkpointing(model: PreTrainedModel) -> bool:
    """Whether activation (gradient) checkpointing is on for ``model``, as HF reports it."""
    return bool(getattr(model, CHECKPOINTING_PROPERTY))


def enable_activation_checkpointing(
    model: PreTrainedModel, checkpoint_kwargs: dict[str, Any] | None = None
) -> None:
    """HF's activation (gradient) checkpointing on, under this release's name;
    ``checkpoint_kwargs`` go to ``torch.utils.checkpoint`` (e.g. ``use_reentrant``)."""
    if ACTIVATION_CHECKPOINTING_METHODS:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs)


def disable_activation_checkpointing(model: PreTrainedModel) -> None:
    """HF's activation (gradient) checkpointing off, under this release's name."""
    if ACTIVATION_CHECKPOINTING_METHODS:
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def check_cache_position(
    cache_position: torch.Tensor,
    cached_tokens: int,
    new_tokens: int,
) -> None:
    """``ValueError`` unless ``cache_position`` is the run of slots after the cached tokens.

    Releases before 5.24 pass ``cache_position``; diffattn places new tokens right after the
    cached ones and takes positions from the attention mask, so any other value would be
    silently ignored: it is refused instead. Nothing is read from the device while compiling.
    """
    if torch.compiler.is_compiling():
        return
    if cache_position.dim() != 1 or cache_position.shape[0] != new_tokens:
        raise ValueError(
            f"cache_position must have shape ({new_tokens},), one slot per new token; "
            f"got {tuple(cache_position.shape)}"
        )
    expected = torch.arange(cached_tokens, cached_tokens + new_tokens)
    if not torch.equal(cache_position.detach().cpu().long(), expected):
        raise ValueError(
            f"cache_position {cache_position.tolist()} is not the run of slots after the "
            f"{cached_tokens} cached tokens ({cached_tokens}..{cached_tokens + new_tokens - 1}); "
            "diffattn models write new tokens right after the cached ones"
        )


GENERATE_ONLY_ARGUMENTS = ("tokenizer", "assistant_tokenizer")
"""``generate()`` arguments meant for generation itself (stop strings, assisted decoding), not
for the model. From 5.24 (at least) ``generate`` hands them to the decoding loop together with
the model inputs, and ``prepare_inputs_for_generation`` forwards them to ``forward``, where HF's
own models swallow them in ``**kwargs``; a diffattn model's forward has no catch-all, so they
are taken out before it (``DiffAttnForCausalLM.prepare_inputs_for_generation``)."""


def paged_cache_class() -> type:
    """The class of the paged KV cache that continuous batching passes to ``forward`` (every
    supported release has it under the same path)."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    return PagedAttentionCache


@functools.cache
def _paged_update_takes_kwargs() -> bool:
    return "kwargs" in inspect.signature(paged_cache_class().update).parameters


FULL_ATTENTION = "full_attention"
"""The layer type of every diffattn layer in the paged cache (no sliding-window layers)."""


def paged_cache_update(
    cache: Any,
    keys: torch.Tensor,
    values: torch.Tensor,
    layer_index: int,
    read_index: torch.Tensor,
    write_index: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the new ``keys``/``values`` ``(1, H, T, d)`` of a paged cache's layer at the slots
    ``write_index`` ``(T,)`` and return the keys and values at ``read_index`` ``(S,)`` as
    ``(1, H, S, d)`` (the new ones themselves when ``read_index`` is empty).

    5.0 takes the read and write indices of every layer group as lists and returns
    ``(S, H, d)``; later releases take them in a dict of the batch's arguments (with the key
    lengths per layer type, which the update only reformats) and return ``(1, H, S, d)``."""
    if _paged_update_takes_kwargs():
        lengths = torch.zeros(2, dtype=torch.int32, device=keys.device)
        arguments = {
            "cu_seq_lens_k": {FULL_ATTENTION: lengths},
            "max_length_k": {FULL_ATTENTION: 0},
            "read_index": [read_index],
            "write_index": [write_index],
        }
        return cache.update(keys, values, layer_index, arguments)
    if read_index.numel() == 0:  # 5.0 always reads back: read what was just written
        read_index = write_index
    keys, values = cache.update(keys, values, layer_index, [read_index], [write_index])
    return keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)


def full_attention_lengths(cu_seq_lens_k: Any) -> torch.Tensor:
    """The cumulative key lengths of the full-attention layers: a tensor (5.0) or a dict by layer
    type (later releases; diffattn models have only ``full_attention`` layers)."""
    if isinstance(cu_seq_lens_k, dict):
        if set(cu_seq_lens_k) != {FULL_ATTENTION}:
            raise ValueError(
                f"cu_seq_lens_k covers layer types {sorted(cu_seq_lens_k)}; diffattn models "
                f"have only {FULL_ATTENTION!r} layers"
            )
        return cu_seq_lens_k[FULL_ATTENTION]
    return cu_seq_lens_k


def strip_paged_prefix(attn_implementation: str | None) -> str | None:
    """The attention implementation without the ``paged|`` prefix that continuous batching adds
    (``paged|eager`` in every release; 5.0 also ``paged|sdpa`` and ``paged|flash_attention_2``)."""
    if attn_implementation is not None and attn_implementation.startswith("paged|"):
        return attn_implementation.removeprefix("paged|")
    return attn_implementation


def _continuous_batching_config_class() -> type | None:
    """transformers' ``ContinuousBatchingConfig`` (5.x after 5.0; ``None`` in 5.0, whose
    settings live on the ``GenerationConfig`` and which has no block-table decode path)."""
    import transformers

    return getattr(transformers, "ContinuousBatchingConfig", None)


def with_paged_batching_defaults(
    model: Any, args: tuple, kwargs: dict[str, Any]
) -> tuple[tuple, dict[str, Any]]:
    """The arguments of ``init_continuous_batching`` with the two settings diffattn's paged
    forward needs (:mod:`diffattn.hf.paged`): no block-table decode path
    (``max_blocks_per_request=0``) and no CUDA graphs (``use_cuda_graph=False``: the forward
    groups requests by their lengths, read on the host). Other settings are kept; a
    ``ContinuousBatchingConfig`` that asks for either is a ``ValueError`` naming the field.
    Releases without ``ContinuousBatchingConfig`` get the arguments unchanged."""
    config_class = _continuous_batching_config_class()
    if config_class is None:
        return args, kwargs
    from transformers import GenerationMixin

    bound = inspect.signature(GenerationMixin.init_continuous_batching).bind(model, *args, **kwargs)
    arguments = dict(bound.arguments)
    arguments.pop("self", None)
    config = arguments.get("continuous_batching_config")
    if config is None:
        generation = arguments.get("generation_config") or model.generation_config
        config = getattr(generation, "continuous_batching_config", None)
    config = config_class() if not isinstance(config, config_class) else copy.deepcopy(config)
    if config.max_blocks_per_request:
        raise ValueError(
            f"ContinuousBatchingConfig(max_blocks_per_request={config.max_blocks_per_request}) "
            "asks for the block-table decode path, which diffattn models do not take; leave it "
            "unset or 0"
        )
    graphs = config.use_cuda_graph
    if graphs is True or (isinstance(graphs, tuple) and any(graphs)):
        raise ValueError(
            f"ContinuousBatchingConfig(use_cuda_graph={graphs}): diffattn models run continuous "
            "batching without CUDA graphs; leave it unset or False"
        )
    config.max_blocks_per_request = 0
    config.use_cuda_graph = False
    arguments["continuous_batching_config"] = config
    return (), arguments


# The arguments each supported release passes to ``create_masks_for_generate``, by name. A
# name outside this set is a new release's addition that diffattn has not been checked
# against: an error, not a silent guess.
MASK_ARGUMENTS_IGNORED = frozenset(
    {
        "config",
        "input_embeds",  # 5.0
        "inputs_embeds",
        "cache",  # 5.24
        "past_key_values",  # before 5.24
        "cache_position",  # before 5.24
        "position_ids",  # also passed to forward, which applies them
        "is_first_iteration",
    }
)
# Accepted only when None: a value would change the mask in a way diffattn does not model.
MASK_ARGUMENTS_UNSUPPORTED = frozenset(
    {"block_sequence_ids", "token_type_ids", "mm_token_type_ids"}
)


def check_mask_arguments(arguments: dict[str, Any]) -> None:
    """``TypeError`` naming any argument of ``create_masks_for_generate`` that diffattn neither
    uses nor knowingly ignores; ``ValueError`` for a supported-when-absent one that is set."""
    unknown = sorted(set(arguments) - MASK_ARGUMENTS_IGNORED - MASK_ARGUMENTS_UNSUPPORTED)
    if unknown:
        raise TypeError(
            f"create_masks_for_generate got argument(s) diffattn does not know: "
            f"{', '.join(unknown)} (a transformers release newer than those tested; see "
            "docs/compatibility.md)"
        )
    given = sorted(k for k in MASK_ARGUMENTS_UNSUPPORTED if arguments.get(k) is not None)
    if given:
        raise ValueError(f"diffattn models do not support {', '.join(given)} in generate")


# Keys HF's PretrainedConfig takes (and pops) without storing them under the same name, in some
# supported release; the stored ones are read from the release itself (generic_config_keys).
_CONFIG_KEYS_POPPED = frozenset(
    {
        "name_or_path",
        "_commit_hash",
        "attn_implementation",
        "experts_implementation",
        "output_attentions",
        "per_layer_config",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "return_unused_kwargs",
        "use_cache",
        # token ids and task settings every HF model accepts (base fields in older releases,
        # free attributes in newer ones)
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "tie_word_embeddings",
        "is_decoder",
        "add_cross_attention",
        "tokenizer_class",
        "auto_map",
        "prefix",
        "task_specific_params",
        "finetuning_task",
        "pruned_heads",
        "torchscript",
        "tie_encoder_decoder",
        "cross_attention_hidden_size",
    }
)


@functools.cache
def generic_config_keys() -> frozenset[str]:
    """The constructor arguments HF's ``PretrainedConfig`` itself understands in this release
    (token ids, ``return_dict``, ``architectures``, generation defaults it pops, ...): what a
    model config may pass on to it. Read from the release, so a rename stays visible."""
    keys = set(_CONFIG_KEYS_POPPED)
    if dataclasses.is_dataclass(PretrainedConfig):  # 5.24: a dataclass
        keys.update(f.name for f in dataclasses.fields(PretrainedConfig))
    keys.update(
        name
        for name, p in inspect.signature(PretrainedConfig.__init__).parameters.items()
        if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and name != "self"
    )
    keys.update(PretrainedConfig().to_dict())
    defaults = getattr(GenerationConfig, "_get_default_generation_params", None)
    keys.update(defaults() if defaults is not None else GenerationConfig().to_dict())
    return frozenset(keys)


__all__ = [
    "ACTIVATION_CHECKPOINTING_METHODS",
    "CACHE_FIELD",
    "CACHE_UPDATE_TAKES_SLOTS",
    "CHECKPOINTING_PROPERTY",
    "FULL_ATTENTION",
    "MASK_ARGUMENTS_IGNORED",
    "check_cache_position",
    "check_mask_arguments",
    "disable_activation_checkpointing",
    "enable_activation_checkpointing",
    "full_attention_lengths",
    "generic_config_keys",
    "is_activation_checkpointing",
    "keeping_loaded_tensors",
    "paged_cache_class",
    "paged_cache_update",
    "resolve_cache_argument",
    "strip_paged_prefix",
    "update_cache",
    "with_paged_batching_defaults",
]
