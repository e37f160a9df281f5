"""``DiffAttnForCausalLM``: a diffattn model as a Hugging Face ``PreTrainedModel``.

The wrapper holds a :class:`~diffattn.model.DiffTransformerLM` as ``self.model``; its state
dict is therefore the diffattn model-directory layout (``model.``-prefixed keys, see
:mod:`diffattn.checkpoint`), and ``save_pretrained`` / ``from_pretrained`` read and write the
same directories as :func:`diffattn.checkpoint.save_model` / ``load_model``.

HF caches: ``generate()`` passes HF ``Cache`` objects (``DynamicCache``, ``StaticCache``, ...).
:class:`HFCacheAdapter` lets diffattn's attention modules write into them. HF caches assume
K and V have the same number of heads; DIFF V1 keeps ``n_kv_heads`` key half-heads of width d
but ``n_kv_heads / 2`` value heads of width 2d, so the adapter stores each width-2d value head
as two width-d heads (an exact reshape) and reassembles them on read. diffattn's own caches
(:mod:`diffattn.cache`) need no reshaping and are the faster choice for V1.

Positions are derived from ``attention_mask`` (the running count of real tokens), as in
:class:`~diffattn.model.DiffTransformerLM`, unless ``position_ids`` are given. ``inputs_embeds``,
4-D attention masks (custom masks, packed sequences), ``return_dict=False``,
``resize_token_embeddings`` and ``gradient_checkpointing_enable`` behave as in HF's own models.
``output_attentions=True`` returns the differential maps (A1 − λA2 for DIFF V1/V2), i.e. the
matrices that multiply V, not the raw softmax maps; ``attention_maps`` holds A1, A2 and λ too.

Continuous batching (``generate_batch``, ``init_continuous_batching``, ``transformers serve
--continuous-batching``): ``forward`` takes the packed batch and the paged cache by name and runs
it through :mod:`diffattn.hf.paged`.

Attention backend: ``attn_implementation`` chooses diffattn's run-time backend: ``"eager"`` runs
``reference``, ``"sdpa"`` runs ``sdpa`` and ``"flash_attention_2"`` runs ``flash`` (see
:mod:`diffattn.attention.registry`). ``set_attn_implementation`` switches it on a built model.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from diffattn.attention.common import AttentionMaps
from diffattn.attention.registry import backend_for_hf
from diffattn.hf.compat import (
    CACHE_FIELD,
    GENERATE_ONLY_ARGUMENTS,
    check_cache_position,
    check_mask_arguments,
    keeping_loaded_tensors,
    resolve_cache_argument,
    strip_paged_prefix,
    update_cache,
    with_paged_batching_defaults,
)
from diffattn.hf.configuration import DiffAttnConfig
from diffattn.hf.paged import (
    PagedBatchArguments,
    check_paged_call,
    is_paged_cache,
    paged_forward,
)
from diffattn.hf.remote_runtime import register_auto_class
from diffattn.hf.tp_plan import TP_PLAN
from diffattn.hf.value_heads import merge_value_heads, split_value_heads, value_parts
from diffattn.model import (
    DecoderBlock,
    DiffTransformerLM,
    documents_from_positions,
    labels_within_documents,
    next_token_loss,
)

PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth")


def refuse_pickle_only(path: Any, subfolder: str = "") -> None:
    """``ValueError`` when a local model directory holds pickle weights and no safetensors,
    or a safetensors file that is cut off or corrupt (named)."""
    directory = Path(str(path)) / (subfolder or "")
    if not directory.is_dir():
        return
    weights = sorted(directory.glob("*.safetensors"))
    if weights:
        from diffattn.checkpoint import check_safetensors_files

        check_safetensors_files(weights)
        return
    found = [name for name in PICKLE_WEIGHTS if (directory / name).is_file()]
    if found:
        raise ValueError(
            f"{directory}: refusing pickle weights {found[0]} (loading a pickle can run "
            "arbitrary code); diffattn loads safetensors only, so save the model with "
            "safe_serialization=True"
        )


@dataclass
class DiffAttnCausalLMOutput(CausalLMOutputWithPast):
    """HF's ``CausalLMOutputWithPast`` plus ``attention_maps``: per layer an
    :class:`~diffattn.attention.AttentionMaps` with the applied map, A1, A2 and λ (with
    ``output_attentions``)."""

    attention_maps: tuple[AttentionMaps, ...] | None = None


def backend_for_implementation(attn_implementation: str | None) -> str:
    """The diffattn backend that serves a Hugging Face ``attn_implementation`` name."""
    if attn_implementation is None:
        return "auto"
    # continuous batching switches "eager" to "paged|eager" (5.0: every name gets the prefix)
    backend = backend_for_hf(strip_paged_prefix(attn_implementation))
    if backend is None:
        raise ValueError(
            f"attn_implementation={attn_implementation!r} is not available for diffattn models; "
            "use 'eager' (the reference kernel), 'sdpa' or 'flash_attention_2'"
        )
    return backend


class HFCacheAdapter:
    """Present an HF ``Cache`` with the interface diffattn's attention modules call."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        if hasattr(cache, "get_max_length"):  # transformers 5
            max_shape = cache.get_max_length(0)
        elif hasattr(cache, "get_max_cache_shape"):
            max_shape = cache.get_max_cache_shape()
        else:
            max_shape = -1
        # A pre-allocated HF cache returns buffers of max_shape keys (zeros past the length).
        self.max_len = int(max_shape) if max_shape is not None and max_shape > 0 else None
        self._cached: int | None = None
        self._slots: torch.Tensor | None = None

    def slots(
        self, new_tokens: int, cache_position: torch.Tensor | None, device: torch.device
    ) -> torch.Tensor:
        """The slots of a pre-allocated cache that this forward's ``new_tokens`` go to, as a
        tensor: ``cache_position`` when given (releases before 5.24 pass it; it must be the run
        after the cached tokens), else the run after the cache's length."""
        if cache_position is not None:
            if not torch.compiler.is_compiling():
                check_cache_position(cache_position, self.get_seq_length(), new_tokens)
            return cache_position.to(device=device, dtype=torch.long)
        # eagerly the length is read once per forward (the mask check reuses it); traced, it
        # stays whatever the cache keeps (5.24: a device tensor, so no guard on its value)
        tracing = torch.compiler.is_compiling()
        start = self.cache.get_seq_length() if tracing else self.get_seq_length()
        if isinstance(start, torch.Tensor):
            return torch.arange(new_tokens, device=device) + start.to(device=device)
        return torch.arange(start, start + new_tokens, device=device)

    def set_cache_position(self, slots: torch.Tensor) -> None:
        """The next :meth:`update` calls write at ``slots`` (the model's fixed-shape path)."""
        self._slots = slots

    def get_seq_length(self) -> int:
        """The number of tokens the cache held when this forward began (read once per forward,
        until :meth:`advance`: the new tokens go right after them in every layer)."""
        if self._cached is None:
            self._cached = int(self.cache.get_seq_length())
        return self._cached

    def update(
        self, layer_index: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        parts = value_parts(k, v)  # DIFF V1: one width-2d value head -> two width-d heads
        v = split_value_heads(v, parts)
        if self._slots is not None:
            keys, values = update_cache(self.cache, layer_index, k, v, slots=self._slots)
        else:
            keys, values = update_cache(self.cache, layer_index, k, v, self.get_seq_length())
        return keys, merge_value_heads(values, parts)

    def advance(self) -> None:
        """The forward is done: the next one reads the (grown) length again. HF caches track
        their own length."""
        self._cached = None
        self._slots = None


def spanning_mask(attention_mask: torch.Tensor, max_len: int) -> torch.Tensor:
    """A 2-D padding mask ``(B, cached + new)`` widened to a pre-allocated cache's
    ``(B, max_len)`` (the slots after the new tokens are zeros, which causality hides anyway):
    the same shape at every decode step, so a compiled step is not re-traced."""
    width = attention_mask.shape[1]
    if width > max_len:
        raise ValueError(
            f"attention_mask covers {width} tokens, more than the cache holds (max {max_len})"
        )
    if width == max_len:
        return attention_mask
    return F.pad(attention_mask, (0, max_len - width), value=0)


class CheckpointedDecoderBlock(GradientCheckpointingLayer, DecoderBlock):
    """:class:`~diffattn.model.DecoderBlock` as HF's ``GradientCheckpointingLayer``: the same
    module, parameters and forward; HF's ``gradient_checkpointing_enable`` checkpoints it."""


def use_hf_blocks(model: DiffTransformerLM) -> DiffTransformerLM:
    """Make ``model``'s decoder blocks :class:`CheckpointedDecoderBlock` in place (a class
    change only: parameters, buffers and outputs stay as they are). The core model does not
    import transformers; the HF wrapper applies this to the model it holds."""
    for block in model.layers:
        if type(block) is DecoderBlock:
            block.__class__ = CheckpointedDecoderBlock
        elif not isinstance(block, CheckpointedDecoderBlock):
            raise TypeError(f"unexpected decoder block type {type(block).__name__}")
    return model


class DiffAttnPreTrainedModel(PreTrainedModel):
    """Shared HF plumbing: config class, weight init, module names."""

    config_class = DiffAttnConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flash_attn = True
    _can_compile_fullgraph = True  # a static-cache step is one graph (tests/test_hf_generic.py)
    _no_split_modules = ["CheckpointedDecoderBlock", "DecoderBlock"]  # noqa: RUF012
    _skip_keys_device_placement = ["cache", "past_key_values"]  # noqa: RUF012

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Initialise ``module``'s own tensors as :class:`DiffTransformerLM` does, except those
        ``from_pretrained`` loaded (:func:`~diffattn.hf.compat.keeping_loaded_tensors`)."""
        lm = getattr(self, "model", None)
        if isinstance(lm, DiffTransformerLM):
            with keeping_loaded_tensors(module) as needed:
                if needed:
                    lm.init_module(module)


def padding_free_documents(
    rows,
    position_ids,
    attention_mask,
    cache,
    read_index,
    cu_seq_lens_q,
    cu_seq_lens_k,
    max_length_q,
    max_length_k,
) -> torch.Tensor | None:
    """The documents of HF's padding-free formats, ``(B, N)``, or ``None``: ``cu_seq_lens_q``
    without continuous batching's paged cache (:func:`flattened_documents`), or restarting
    ``position_ids`` with no mask and no cache (``DataCollatorWithFlattening``'s default),
    read once here and handed to the core model as ``document_ids``."""
    if cu_seq_lens_q is not None:
        if is_paged_cache(cache) or read_index is not None:
            return None
        return flattened_documents(cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, rows)
    if position_ids is None or attention_mask is not None or cache is not None:
        return None
    if position_ids.dim() != 2 or rows is None or position_ids.shape[1] != rows.shape[1]:
        return None  # the core model names the bad shape
    return documents_from_positions(position_ids.expand(rows.shape[0], -1))


def flattened_documents(
    cu_seq_lens_q: torch.Tensor,
    cu_seq_lens_k: torch.Tensor | None,
    max_length_q: int | None,
    max_length_k: int | None,
    rows: torch.Tensor | None,
) -> torch.Tensor:
    """The ``(1, N)`` document ids of HF's padding-free batch: one row whose documents end at
    ``cu_seq_lens_q[1:]`` (``[0, len_1, len_1 + len_2, ..., N]``). The keys are the queries
    (``cu_seq_lens_k`` equal, or absent), and ``max_length_q``/``_k``, when given, are the
    longest document; anything else is a ``ValueError`` naming it."""
    if rows is None or rows.shape[0] != 1:
        shape = None if rows is None else tuple(rows.shape[:2])
        raise ValueError(
            f"cu_seq_lens_q without a paged cache is HF's padding-free format: one row of "
            f"packed documents, got input of shape {shape}"
        )
    n = rows.shape[1]
    bounds = cu_seq_lens_q.detach().to("cpu", torch.long).flatten()
    lengths = bounds[1:] - bounds[:-1]
    if (
        bounds.numel() < 2
        or int(bounds[0]) != 0
        or int(bounds[-1]) != n
        or bool((lengths < 1).any())
    ):
        raise ValueError(
            f"cu_seq_lens_q must run from 0 to the row's {n} tokens in growing steps, got "
            f"{bounds.tolist()}"
        )
    if cu_seq_lens_k is not None and not torch.equal(
        cu_seq_lens_k.detach().cpu().long().flatten(), bounds
    ):
        raise ValueError("cu_seq_lens_k must equal cu_seq_lens_q (self-attention over the row)")
    for name, value in (("max_length_q", max_length_q), ("max_length_k", max_length_k)):
        if value is not None and int(value) != int(lengths.max()):
            raise ValueError(
                f"{name}={int(value)} is not the longest document ({int(lengths.max())} tokens)"
            )
    document_ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    return document_ids[None].to(rows.device)


FORWARD_DOC = """HF's causal-LM forward. Every argument is used or checked; there is no
catch-all, so an argument this model does not understand is a ``TypeError`` naming it.

Args:
    cache: an HF ``Cache`` holding earlier tokens (transformers >= 5.24 name).
    past_key_values: the same, under its name before transformers 5.24 (a
        ``FutureWarning`` where ``cache`` is the current name); giving both is an error.
    cache_position: accepted for the transformers versions that pass it; positions and
        cache slots come from ``attention_mask`` and the cache, so it must be the run of
        slots that follows the cached tokens (anything else is an error).
    num_items_in_batch: the number of target tokens of the whole (accumulated) batch,
        as HF's ``Trainer`` passes it: the loss is then the sum over this batch's
        targets divided by it, as in HF's own causal LMs.
    cu_seq_lens_q, cu_seq_lens_k, read_index, write_index, block_table: continuous
        batching's packed batch over a paged cache (:mod:`diffattn.hf.paged`): given
        together with a ``PagedAttentionCache``. Without one, ``cu_seq_lens_q``/``_k``
        (and ``max_length_q``/``_k``) are HF's padding-free format
        (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``): one row of
        documents, each attending only to itself (``document_ids`` of the core model).
    logits_indices, logits_processor_args: the rows continuous batching samples from
        and its logits processors' inputs; it applies them to the returned logits
        itself (the rows arrive again as a tensor ``logits_to_keep``).
    max_length_q, max_length_k, max_seqlen_q, max_seqlen_k, is_causal: sizes and the
        causal flag continuous batching passes for HF's kernels (``max_seqlen_*`` in
        5.0); here the per-request lengths come from ``cu_seq_lens_q``/``_k`` and every
        request is causal.
"""
"""The docstring of :meth:`DiffAttnForCausalLM.forward` (kept here: its argument list is HF's)."""


class DiffAttnForCausalLM(DiffAttnPreTrainedModel, GenerationMixin):
    """Causal LM head model: ``forward`` returns HF's ``CausalLMOutputWithPast``."""

    _tp_plan = TP_PLAN  # from_pretrained(..., tp_plan="auto"): see diffattn.hf.tp_plan

    def __init__(self, config: DiffAttnConfig) -> None:
        super().__init__(config)
        self.model = use_hf_blocks(DiffTransformerLM(config.to_model_config()))
        self._backend_source: str | None = None
        self._sync_backend()
        self.post_init()

    def _sync_backend(self, force: bool = False) -> None:
        """Follow ``config._attn_implementation`` when it changed since the last call."""
        implementation = self.config._attn_implementation
        if force or implementation != self._backend_source:
            self.model.set_backend(backend_for_implementation(implementation))
            self._backend_source = implementation

    def set_attn_implementation(self, attn_implementation, *args: Any, **kwargs: Any) -> None:
        """Switch the attention backend (``"eager"``, ``"sdpa"``, ``"flash_attention_2"``).

        HF checks the name first (its own error for a name it does not know); a name HF knows
        but diffattn has no backend for is then refused and the previous choice kept."""
        previous = self.config._attn_implementation
        super().set_attn_implementation(attn_implementation, *args, **kwargs)
        try:
            self._sync_backend(force=True)
        except ValueError:
            super().set_attn_implementation(previous)
            self._sync_backend(force=True)
            raise

    @classmethod
    def from_diffattn(cls, model: DiffTransformerLM, **hf_kwargs: Any) -> DiffAttnForCausalLM:
        """Wrap an existing :class:`DiffTransformerLM` (weights shared, not copied; its blocks
        become :class:`CheckpointedDecoderBlock`, which computes the same)."""
        config = DiffAttnConfig.from_model_config(model.config, **hf_kwargs)
        with torch.device("meta"):
            wrapper = cls(config)
        wrapper.model = use_hf_blocks(model)
        wrapper._backend_source = wrapper.config._attn_implementation  # keep model.backend
        return wrapper

    def create_masks_for_generate(self, attention_mask=None, **arguments: Any) -> Any:
        """Keep the 2-D padding mask for pre-allocated caches: the model builds its own masks
        (causal + padding) and reads positions from it; HF would pass a 4-D mask instead.

        The other arguments HF passes (cache, embeddings, positions, ...) are checked by name
        (:func:`~diffattn.hf.compat.check_mask_arguments`): one this model does not know is an
        error, never silently dropped."""
        check_mask_arguments(arguments)
        cache = arguments.get("cache", arguments.get("past_key_values"))
        if attention_mask is not None and attention_mask.dim() == 2 and cache is not None:
            max_len = HFCacheAdapter(cache).max_len
            if max_len is not None:  # pre-allocated: one mask shape for every step
                return spanning_mask(attention_mask, max_len)
        return attention_mask

    def prepare_inputs_for_generation(self, *args: Any, **model_kwargs: Any) -> dict:
        """HF's preparation, without the arguments ``generate`` keeps for itself (its
        ``tokenizer`` for stop strings, :data:`~diffattn.hf.compat.GENERATE_ONLY_ARGUMENTS`),
        which some releases pass along with the model inputs."""
        for name in GENERATE_ONLY_ARGUMENTS:
            model_kwargs.pop(name, None)
        return super().prepare_inputs_for_generation(*args, **model_kwargs)

    # generate() reads this method's signature (whether it takes inputs_embeds, ...): HF's.
    prepare_inputs_for_generation.__signature__ = inspect.signature(
        GenerationMixin.prepare_inputs_for_generation
    )

    def init_continuous_batching(self, *args: Any, **kwargs: Any):
        """HF's continuous-batching manager (``generate_batch`` and ``transformers serve`` build
        theirs here), with the block-table decode path and CUDA graphs off, which the paged
        forward does not take (:func:`~diffattn.hf.compat.with_paged_batching_defaults`; a
        config asking for them is refused). Arguments as in HF's method, all passed on."""
        args, kwargs = with_paged_batching_defaults(self, args, kwargs)
        return super().init_continuous_batching(*args, **kwargs)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear | None:
        return self.model.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.model.lm_head = new_embeddings

    def resize_token_embeddings(self, *args: Any, **kwargs: Any) -> nn.Embedding:
        """HF's resize; the diffattn model's own config follows the new vocabulary size."""
        embeddings = super().resize_token_embeddings(*args, **kwargs)
        vocab = embeddings.weight.shape[0]
        self.config.vocab_size = vocab
        self.model.config = self.model.config.replace(vocab_size=vocab)
        return embeddings

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any):
        """HF's ``from_pretrained`` with weights from safetensors only (a pickle is refused)."""
        refuse_pickle_only(pretrained_model_name_or_path, kwargs.get("subfolder", ""))
        kwargs.setdefault("use_safetensors", True)
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Any | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        num_items_in_batch: int | torch.Tensor | None = None,
        past_key_values: Any | None = None,
        cache_position: torch.LongTensor | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | dict[str, torch.Tensor] | None = None,
        read_index: list[torch.Tensor] | None = None,
        write_index: list[torch.Tensor] | None = None,
        block_table: torch.Tensor | None = None,
        logits_indices: torch.Tensor | None = None,
        logits_processor_args: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | dict[str, int] | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_k: int | dict[str, int] | None = None,
        is_causal: bool | None = None,
    ) -> DiffAttnCausalLMOutput:
        cache = resolve_cache_argument(cache, past_key_values)
        document_ids = padding_free_documents(
            input_ids if input_ids is not None else inputs_embeds,
            position_ids,
            attention_mask,
            cache,
            read_index,
            cu_seq_lens_q,
            cu_seq_lens_k,
            max_length_q,
            max_length_k,
        )
        if document_ids is None and (cu_seq_lens_q is not None or is_paged_cache(cache)):
            paged = PagedBatchArguments(
                cu_seq_lens_q, cu_seq_lens_k, read_index, write_index, block_table
            )
            refused = (inputs_embeds, labels, output_attentions, output_hidden_states)
            logits = self._paged_logits(
                input_ids, position_ids, attention_mask, cache, paged, refused
            )
            return self._causal_lm_output(None, logits, None, logits_to_keep, cache, return_dict)
        refuse_continuous_batching_arguments(
            document_ids is not None,
            read_index=read_index,
            write_index=write_index,
            block_table=block_table,
            cu_seq_lens_k=cu_seq_lens_k,
            logits_indices=logits_indices,
            logits_processor_args=logits_processor_args,
            max_length_q=max_length_q,
            max_length_k=max_length_k,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            is_causal=is_causal,
        )
        return self._model_step(
            input_ids,
            attention_mask,
            position_ids,
            cache,
            inputs_embeds,
            labels,
            use_cache,
            output_attentions,
            output_hidden_states,
            return_dict,
            logits_to_keep,
            num_items_in_batch,
            cache_position,
            document_ids,
        )

    forward.__doc__ = FORWARD_DOC

    def _paged_logits(self, input_ids, position_ids, attention_mask, cache, paged, refused):
        """The logits of one continuous-batching step over the paged cache
        (:mod:`diffattn.hf.paged`); ``refused`` holds the inputs such a step refuses
        (``inputs_embeds``, ``labels``, ``output_attentions``, ``output_hidden_states``)."""
        check_paged_call(paged, cache, attention_mask, refused_inputs(*refused))
        self._sync_backend()
        return paged_forward(self.model, input_ids, position_ids, cache, paged)

    def _model_step(
        self,
        input_ids,
        attention_mask,
        position_ids,
        cache,
        inputs_embeds,
        labels,
        use_cache,
        output_attentions,
        output_hidden_states,
        return_dict,
        logits_to_keep,
        num_items_in_batch,
        cache_position,
        document_ids,
    ) -> DiffAttnCausalLMOutput:
        """The forward of everything but a continuous-batching step: the core model over the
        tokens, with an HF cache (created when ``use_cache`` asks for one) or none."""
        if use_cache is None:
            use_cache = getattr(self.config, "use_cache", True)
        if document_ids is not None:  # a padding-free row: nothing to cache (the next token
            use_cache = False  # would attend to every document)
        if cache is None and use_cache and not self.training:
            from transformers import DynamicCache

            cache = DynamicCache()
        if output_attentions is None:
            output_attentions = getattr(self.config, "output_attentions", False)
        if output_hidden_states is None:
            output_hidden_states = getattr(self.config, "output_hidden_states", False)
        self._sync_backend()
        adapter = HFCacheAdapter(cache) if cache is not None else None
        new_tokens = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        slots, attention_mask = cache_slots_and_mask(
            adapter,
            attention_mask,
            new_tokens,
            cache_position,
            self.model.embed_tokens.weight.device,
        )
        out = self.model(
            input_ids,
            attention_mask=attention_mask,
            labels=labels if num_items_in_batch is None else None,
            output_attentions=bool(output_attentions),
            output_hidden_states=bool(output_hidden_states),
            past_key_values=adapter,
            cache_position=slots,
            inputs_embeds=inputs_embeds,
            position_ids=position_ids,
            document_ids=document_ids,
        )
        loss = out.loss
        if labels is not None and num_items_in_batch is not None:
            if out.documents is not None:
                labels = labels_within_documents(labels, out.documents)
            loss = next_token_loss(out.logits, labels, reduction="sum") / num_items_in_batch
        return self._causal_lm_output(loss, out.logits, out, logits_to_keep, cache, return_dict)

    def _causal_lm_output(self, loss, logits, out, logits_to_keep, cache, return_dict):
        """HF's output of ``forward``: the logits rows ``logits_to_keep`` selects, the cache,
        and the hidden states and maps of the core model's output ``out`` (if any)."""
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            logits = logits[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, torch.Tensor):
            logits = logits[:, logits_to_keep]
        output = DiffAttnCausalLMOutput(
            loss=loss,
            logits=logits,
            hidden_states=None if out is None else out.hidden_states,
            attentions=None if out is None else out.attentions,
            attention_maps=None if out is None else out.attention_maps,
            **{CACHE_FIELD: cache},
        )
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        return output if return_dict else output.to_tuple()


def _register() -> None:
    """Make ``AutoModelForCausalLM`` build this class for ``DiffAttnConfig`` (not in the copy
    vendored into Hub remote code: :mod:`diffattn.hf.remote_runtime`)."""
    register_auto_class("AutoModelForCausalLM", DiffAttnConfig, DiffAttnForCausalLM)


_register()


__all__ = [
    "CheckpointedDecoderBlock",
    "DiffAttnCausalLMOutput",
    "DiffAttnForCausalLM",
    "DiffAttnPreTrainedModel",
    "HFCacheAdapter",
    "backend_for_implementation",
]


def refused_inputs(
    inputs_embeds: Any, labels: Any, output_attentions: Any, output_hidden_states: Any
) -> dict[str, bool]:
    """The inputs a continuous-batching step refuses, each with whether it was given."""
    return {
        "inputs_embeds": inputs_embeds is not None,
        "labels": labels is not None,
        "output_attentions": bool(output_attentions),
        "output_hidden_states": bool(output_hidden_states),
    }


def refuse_continuous_batching_arguments(padding_free: bool, **arguments: Any) -> None:
    """``ValueError`` naming the continuous-batching arguments given (not ``None``) to a
    forward that is no continuous-batching step (no ``cu_seq_lens_q`` and paged cache).

    With ``padding_free`` (HF's padding-free format read the documents from ``cu_seq_lens_q``)
    its other sizes (``cu_seq_lens_k``, ``max_length_q``, ``max_length_k``) belong to it."""
    flattening = ("cu_seq_lens_k", "max_length_q", "max_length_k") if padding_free else ()
    given = sorted(
        name for name, value in arguments.items() if value is not None and name not in flattening
    )
    if given:
        raise ValueError(
            f"{', '.join(given)}: continuous-batching arguments, valid only with "
            "cu_seq_lens_q and a PagedAttentionCache"
        )


def cache_slots_and_mask(
    adapter: HFCacheAdapter | None,
    attention_mask: torch.Tensor | None,
    new_tokens: int,
    cache_position: torch.LongTensor | None,
    device: torch.device,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The cache slots of the new tokens and the attention mask the core model takes.

    A pre-allocated cache (HF's ``StaticCache``) gets fixed shapes: slots as a tensor and a
    mask spanning its buffer, so the step compiles with ``fullgraph=True``. Otherwise the
    slots follow the cached tokens (``None``) and a given ``cache_position`` must say the same.
    """
    if (
        adapter is not None
        and adapter.max_len is not None
        and (attention_mask is None or attention_mask.dim() == 2)
    ):
        slots = adapter.slots(new_tokens, cache_position, device)
        if attention_mask is not None:
            if attention_mask.shape[1] != adapter.max_len and not torch.compiler.is_compiling():
                expected = adapter.get_seq_length() + new_tokens
                if attention_mask.shape[1] != expected:
                    raise ValueError(
                        f"attention_mask shape {tuple(attention_mask.shape)} does not match "
                        f"(batch, cached + new tokens) = {(attention_mask.shape[0], expected)} "
                        f"nor the static cache's (batch, {adapter.max_len})"
                    )
            attention_mask = spanning_mask(attention_mask, adapter.max_len)
        return slots, attention_mask
    if cache_position is not None:
        cached = adapter.get_seq_length() if adapter is not None else 0
        check_cache_position(cache_position, cached, new_tokens)
    return None, attention_mask
