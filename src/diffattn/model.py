"""DiffTransformerLM: the LLaMA-style decoder of DIFF V1 §2.2 with a pluggable attention.

Layer l (Eq.4–5): ``Y = Attn(RMSNorm(X)) + X``; ``X' = SwiGLU(RMSNorm(Y)) + Y``. Then a final
RMSNorm and the LM head (optionally tied to the embedding).

Initialisation (``init_weights``): every Linear and the embedding ~ N(0, init_std²); the two
residual output projections of each block (``attn.o_proj``, ``ffn.down_proj``) use
``init_std / sqrt(2·n_layers)`` (GPT-2 style depth scaling); norms are 1; DIFF V1's λ vectors
~ N(0, lambda_std²) as in the official code. ``init_weights`` also recomputes buffers (RoPE),
so a model built on the meta device is usable after ``to_empty`` + ``init_weights``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from diffattn.attention import AttentionMaps, AttentionMask, build_attention
from diffattn.attention.common import ProjectedAttention
from diffattn.attention.registry import check_backend_name
from diffattn.cache import DynamicCache, StaticCache
from diffattn.config import ModelConfig
from diffattn.layers import RMSNorm, RotaryEmbedding, SwiGLU

IGNORE_INDEX = -100
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""The ``mode`` values of ``torch.compile`` that :meth:`DiffTransformerLM.compile_blocks` takes."""


def let_dynamo_skip_kernel_logs() -> None:
    """Make Dynamo drop, rather than break the graph at, the attention backends' log calls.

    ``auto`` announces each backend it resolves, and a backend that steps aside warns once,
    on the ``diffattn.kernels`` logger. Under ``torch.compile`` such a call would split the
    graph (and fail ``fullgraph=True``); registered in ``ignore_logger_methods`` it is skipped
    while tracing, so an eager run still logs it. Idempotent.
    """
    kernels = logging.getLogger("diffattn.kernels")
    ignored = torch._dynamo.config.ignore_logger_methods
    ignored.update((kernels.debug, kernels.info, kernels.warning))


def _checkpoint(block, *args):
    return torch.utils.checkpoint.checkpoint(block, *args, use_reentrant=False)


@dataclass
class CausalLMOutput:
    """What :meth:`DiffTransformerLM.forward` returns.

    Attributes:
        logits: ``(B, N, vocab)``.
        loss: mean next-token cross-entropy over labels ``!= -100`` (``None`` without labels).
        attentions: per layer, the map applied to V, ``(B, H_out, N, N)``: softmax for the
            baseline, the differential map ``A1 − λA2`` for DIFF V1/V2.
        attention_maps: per layer, an :class:`AttentionMaps` with A1, A2 and λ as well.
        hidden_states: ``n_layers + 1`` tensors ``(B, N, d_model)``: the embeddings, the
            outputs of blocks 1…L−1, and the final normed state (Hugging Face convention).
        past_key_values: the KV cache after this call (with ``use_cache`` or a cache given).
        documents: the ``(B, N)`` documents of a packed row, as given (``document_ids``) or
            read from restarting ``position_ids``; ``None`` for one document per row.
    """

    logits: torch.Tensor
    loss: torch.Tensor | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    attention_maps: tuple[AttentionMaps, ...] | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    past_key_values: DynamicCache | StaticCache | None = None
    documents: torch.Tensor | None = None


class DecoderBlock(nn.Module):
    """Pre-norm block: attention and SwiGLU, each with a residual connection (Eq.4–5)."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = build_attention(config, layer_index)
        self.ffn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.ffn = SwiGLU(config.d_model, config.ffn_dim)
        # The two projections that write into the residual stream get the depth-scaled init.
        self.attn.o_proj.residual_projection = True
        self.ffn.down_proj.residual_projection = True

    def forward(self, x, rope, mask, need_weights=False, cache=None):
        attn_out, maps = self.attn(self.attn_norm(x), rope, mask, need_weights, cache)
        x = x + attn_out
        x = x + self.ffn(self.ffn_norm(x))
        return x, maps


def next_token_loss(
    logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    """Mean (or, with ``reduction="sum"``, summed) cross-entropy of ``logits[:, t]`` against
    ``labels[:, t + 1]`` over labels ``!= -100``.

    The labels are shifted, not the logits: the last position gets the ignored label, so the
    ``(B, N, vocab)`` logits enter the loss as a view, without the copy (and, in backward, the
    zero-filled full-size gradient) that slicing off their last position would cost. Same
    terms, same order, same mean.
    """
    shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        shifted.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction=reduction,
    )


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that count real tokens only: ``cumsum(mask) − 1``, clamped at 0.

    With left padding this gives each real token the position it has in the unpadded
    sequence, which makes padded and unpadded outputs identical.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def documents_from_positions(position_ids: torch.Tensor) -> torch.Tensor | None:
    """The documents of rows packed as Hugging Face's padding-free format lays them out: a new
    document begins wherever the position does not grow (``position_ids[t] <= [t − 1]``, the
    restart to 0 of ``DataCollatorWithFlattening``). ``(B, N)`` document index per token, or
    ``None`` when every row is one run of growing positions."""
    restarts = position_ids[:, 1:] <= position_ids[:, :-1]
    if not bool(restarts.any()):
        return None
    return F.pad(restarts.long().cumsum(-1), (1, 0))


def _check_documents(document_ids, bsz: int, n: int) -> None:
    """Refuse ``document_ids`` that are not a ``(bsz, n)`` tensor of integers."""
    if not isinstance(document_ids, torch.Tensor):
        raise TypeError(
            f"document_ids must be a torch.Tensor of integers, shape ({bsz}, {n}), got "
            f"{type(document_ids).__name__} (convert it with torch.as_tensor)"
        )
    dtype = document_ids.dtype
    integer = not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
    if document_ids.shape != (bsz, n) or not integer:
        raise ValueError(
            f"document_ids must be an integer tensor of shape ({bsz}, {n}), got "
            f"{dtype} {tuple(document_ids.shape)}"
        )


def document_runs(document_ids: torch.Tensor) -> torch.Tensor:
    """``(B, N)`` index of each token's run of equal ids, from 0 per row: the documents as the
    mask, RoPE and the loss all read them (``[0, 1, 0]`` is three documents, not two)."""
    changes = document_ids[:, 1:] != document_ids[:, :-1]
    return F.pad(changes.long().cumsum(-1), (1, 0))


def positions_in_documents(document_ids: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    """RoPE positions that restart at 0 with each document (counting real tokens only when
    ``real``, the 2-D padding mask, is given), ``(B, N)``."""
    n = document_ids.shape[1]
    index = torch.arange(n, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    counted = real.long() if real is not None else torch.ones_like(index)
    total = counted.cumsum(-1)
    before = total.gather(1, first) - counted.gather(1, first)
    return (total - before - 1).clamp_min(0)


def document_lengths(document_ids: torch.Tensor) -> torch.Tensor:
    """The number of tokens of the longest document in each row, ``(B,)``."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    run = starts.long().cumsum(-1)  # runs of one document id, numbered per row
    counts = torch.zeros(run.shape[0], run.shape[1] + 1, dtype=torch.long, device=run.device)
    counts.scatter_add_(1, run, torch.ones_like(run))
    return counts.max(dim=-1).values


def labels_within_documents(labels: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """``labels`` with the target of each document's last token ignored: the next token is
    another document's first, which a packed row must not learn to predict."""
    crossing = F.pad(document_ids[:, 1:] != document_ids[:, :-1], (1, 0), value=False)
    return labels.masked_fill(crossing, IGNORE_INDEX)


class DiffTransformerLM(nn.Module):
    """Decoder-only language model with baseline, DIFF V1 or DIFF V2 attention.

    Calling it (:meth:`forward`), the inputs that shape who attends to whom:

    * ``attention_mask``, 2-D ``(B, cached + N)``: 1 for real tokens and 0 for padding (left
      or right), covering the cached tokens too; real tokens get the outputs they would get
      without padding. 4-D ``(B or 1, 1, N, cached + N)``: the full mask (custom masks, packed
      sequences), boolean (``True`` = may attend) or additive float (0 = may attend, the
      dtype's minimum = may not); a row that may attend to nothing reads its own position.
    * ``cache_position``: ``(N,)`` int64 tensor of consecutive slots of a pre-allocated cache
      (:class:`~diffattn.cache.StaticCache`, or any cache with ``max_len`` and
      ``set_cache_position``, such as the Hugging Face adapter's) for the new tokens
      (fixed-shape decoding, e.g. a compiled decode step). ``attention_mask`` is then ``None``
      or ``(B, cache.max_len)``, covering the whole buffer (slots after the new tokens are
      ignored), and nothing is read back from the device.
    * ``position_ids``: ``(B or 1, N)`` RoPE positions; by default they count the real tokens
      (2-D masks) or run on from the cache length. Without a mask or cached tokens, positions
      that restart inside a row (Hugging Face's padding-free format:
      ``DataCollatorWithFlattening``) mark packed documents, as ``document_ids`` would.
    * ``document_ids``: ``(B, N)`` integers: documents packed in a row, a run of equal ids per
      document. Each token attends only to its own document, RoPE positions restart at 0 with
      each (unless ``position_ids`` are given), no loss target crosses a boundary, and
      ``max_seq_len`` bounds each document, not the row: every document gets the outputs it
      gets alone. Not with a KV cache holding tokens, ``cache_position`` or a 4-D mask.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(DecoderBlock(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.rotary = RotaryEmbedding(config.dim_per_head, config.rope_theta, config.rope_style)
        # Activation checkpointing of every block in training (set by the trainer, or by
        # Hugging Face's gradient_checkpointing_enable, which also sets the function).
        self.gradient_checkpointing = False
        self._gradient_checkpointing_func = None
        if config.tie_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if not self.embed_tokens.weight.is_meta:
            self.init_weights()

    # ------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """(Re)initialise every parameter and buffer as described in the module docstring."""
        for module in self.modules():
            self.init_module(module, generator)

    @torch.no_grad()
    def init_module(self, module: nn.Module, generator: torch.Generator | None = None) -> None:
        """Initialise the parameters and buffers owned directly by ``module`` (one of ours)."""
        cfg = self.config
        if isinstance(module, nn.Linear):
            std = cfg.init_std
            if getattr(module, "residual_projection", False):
                std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
            module.weight.normal_(0.0, std, generator=generator)
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, cfg.init_std, generator=generator)
        elif isinstance(module, RMSNorm | RotaryEmbedding):
            module.reset_parameters()
        elif isinstance(module, ProjectedAttention):
            module.reset_own_parameters(generator)  # the attention type's own initialisation

    # ------------------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        """The attention backend the model runs on now."""
        return self.config.backend

    def set_backend(self, name: str) -> DiffTransformerLM:
        """Run attention on backend ``name`` from now on (``reference``, ``sdpa``, ``flash``,
        ``auto`` or a registered one); returns the model. Weights are untouched and nothing is
        saved: the backend is a run-time choice, not part of ``config.json``."""
        check_backend_name(name)
        for block in self.layers:
            block.attn.backend = name
        self.config = self.config.replace(backend=name)
        return self

    @property
    def output_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Parameter count (tied weights once). ``exclude_embeddings`` drops the input
        embedding, so an untied model counts one embedding matrix (its LM head)."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= self.embed_tokens.weight.numel()
        return total

    def compile_blocks(
        self,
        *,
        backend: str | Callable = "inductor",
        mode: str | None = None,
        fullgraph: bool = False,
        dynamic: bool | None = None,
    ) -> DiffTransformerLM:
        """``torch.compile`` every decoder block in place and return the model.

        Each block (Eq.4–5: RMSNorm, RoPE, the attention with DIFF V1's subtraction and head
        norm, SwiGLU, the residual adds) becomes one graph, so inductor fuses its element-wise
        work; names and state-dict keys do not change. The embedding, final norm, LM head and
        loss stay eager. ``fullgraph=True`` raises at the first graph break instead of
        splitting the block (every block compiles whole on the ``reference``, ``sdpa`` and
        ``auto`` backends); the other arguments are ``torch.compile``'s.

        Raises:
            ValueError: an unknown ``mode``, or a ``backend`` that is neither a name nor a
                callable.
        """
        if mode not in COMPILE_MODES:
            raise ValueError(
                f"compile_blocks: mode must be one of {', '.join(map(str, COMPILE_MODES))}, "
                f"got {mode!r}"
            )
        if not (callable(backend) or (isinstance(backend, str) and backend)):
            raise ValueError(f"compile_blocks: backend must be a backend name, got {backend!r}")
        let_dynamo_skip_kernel_logs()
        for block in self.layers:
            block.compile(backend=backend, mode=mode, fullgraph=fullgraph, dynamic=dynamic)
        return self

    def _embed(self, input_ids, inputs_embeds) -> torch.Tensor:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is not None:
            if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != self.config.d_model:
                raise ValueError(
                    f"inputs_embeds must have shape (batch, seq_len, {self.config.d_model}), "
                    f"got {tuple(inputs_embeds.shape)}"
                )
            return inputs_embeds
        if input_ids.dim() != 2:
            raise ValueError(
                f"input_ids must have shape (batch, seq_len), got {tuple(input_ids.shape)}"
            )
        return self.embed_tokens(input_ids)

    def _mask_and_positions(self, attention_mask, cache, cache_position, past, bsz, n, device):
        """The :class:`AttentionMask` of this call and the default RoPE positions."""
        if cache_position is not None:
            # Fixed shapes into a static buffer: slots come from a tensor and the mask spans
            # the buffer, so no shape or Python int changes from one decode step to the next.
            if getattr(cache, "max_len", None) is None or not hasattr(cache, "set_cache_position"):
                raise ValueError(
                    "cache_position needs a pre-allocated cache (a StaticCache) as past_key_values"
                )
            if cache_position.shape != (n,) or cache_position.dtype != torch.long:
                raise ValueError(
                    f"cache_position must be an int64 tensor of shape ({n},), one slot per "
                    f"new token; got {cache_position.dtype} {tuple(cache_position.shape)}"
                )
            cache.set_cache_position(cache_position)
            if attention_mask is None:
                return AttentionMask(query_offset=cache_position[0]), cache_position.expand(bsz, n)
            if attention_mask.shape != (bsz, cache.max_len):
                raise ValueError(
                    f"with cache_position, attention_mask must cover the static buffer: "
                    f"expected {(bsz, cache.max_len)}, got {tuple(attention_mask.shape)}"
                )
            positions = position_ids_from_mask(attention_mask)[:, cache_position]
            mask = AttentionMask(key_padding=attention_mask.bool(), query_offset=cache_position[0])
            return mask, positions
        default_positions = torch.arange(past, past + n, device=device).expand(bsz, n)
        if attention_mask is None:
            return AttentionMask(query_offset=past), default_positions
        if attention_mask.dim() == 4:
            return self._full_mask(attention_mask, cache, past, bsz, n), default_positions
        if attention_mask.shape != (bsz, past + n):
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} does not "
                f"match (batch, cached + new tokens) = {(bsz, past + n)}"
            )
        positions = position_ids_from_mask(attention_mask)[:, past:]
        padding = attention_mask.bool()
        if not torch.compiler.is_compiling() and bool(padding.all()):
            padding = None
        elif getattr(cache, "max_len", None) is not None:  # keys span a static buffer
            padding = F.pad(padding, (0, cache.max_len - past - n), value=True)
        return AttentionMask(key_padding=padding, query_offset=past), positions

    def _attention_inputs(
        self, attention_mask, cache, cache_position, position_ids, document_ids, past, bsz, n,
        device,
    ):  # fmt: skip
        """``(AttentionMask, RoPE positions, documents or None)`` of a call: the mask rule,
        the packed documents (given, or read from restarting ``position_ids``), positions
        restarting per document unless ``position_ids`` are given, and the length check (per
        document when packed)."""
        if position_ids is not None and (
            position_ids.dim() != 2
            or position_ids.shape[1] != n
            or position_ids.shape[0] not in (1, bsz)
        ):
            raise ValueError(
                f"position_ids must have shape ({bsz}, {n}) or (1, {n}), "
                f"got {tuple(position_ids.shape)}"
            )
        document_ids = self._documents(
            document_ids, position_ids, attention_mask, cache, cache_position, past, bsz, n
        )
        if document_ids is None and past + n > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {past + n} exceeds max_seq_len="
                f"{self.config.max_seq_len} of this model"
            )
        mask, positions = self._mask_and_positions(
            attention_mask, cache, cache_position, past, bsz, n, device
        )
        if document_ids is not None:
            document_ids = document_ids.to(device)
            mask.document_ids = document_ids
            real = attention_mask.bool() if attention_mask is not None else None
            positions = positions_in_documents(document_ids, real)
        if position_ids is not None:
            positions = position_ids.to(device).expand(bsz, n)
        return mask, positions, document_ids

    def _documents(
        self, document_ids, position_ids, attention_mask, cache, cache_position, past, bsz, n
    ):
        """The packed documents of this call, ``(B, N)`` or ``None`` (see ``forward``)."""
        if document_ids is None:
            if (
                position_ids is None
                or attention_mask is not None
                or past
                or cache_position is not None
            ):
                return None
            document_ids = documents_from_positions(position_ids.expand(bsz, n))
            if document_ids is None:
                return None
        else:
            _check_documents(document_ids, bsz, n)
        if past or cache_position is not None:
            raise ValueError(
                "documents packed in a row (document_ids, or position_ids that restart) cannot "
                "follow cached tokens or use cache_position: start from an empty cache"
            )
        if cache is not None:
            raise ValueError(
                "documents packed in a row cannot fill a KV cache (a next token would attend to "
                "every document, at the row's position): pass use_cache=False"
            )
        if attention_mask is not None and attention_mask.dim() == 4:
            raise ValueError(
                "document_ids and a 4-D attention_mask both say who attends to whom; give one"
            )
        # each run of equal ids is one document (an id that comes back later starts another)
        document_ids = document_runs(document_ids)
        if bool((document_ids == 0).all()):
            return None  # one document per row: today's causal path, exactly
        longest = int(document_lengths(document_ids).max())
        if longest > self.config.max_seq_len:
            raise ValueError(
                f"a packed document of {longest} tokens exceeds max_seq_len="
                f"{self.config.max_seq_len} of this model"
            )
        return document_ids

    @staticmethod
    def _full_mask(attention_mask, cache, past, bsz, n) -> AttentionMask:
        """A 4-D mask (boolean or additive) as an :class:`AttentionMask`."""
        keys = past + n
        shape = tuple(attention_mask.shape)
        if shape[0] not in (1, bsz) or shape[1] != 1 or shape[2] != n or shape[3] != keys:
            raise ValueError(
                f"a 4-D attention_mask must have shape ({bsz} or 1, 1, {n}, {keys}) "
                f"(batch, 1, new tokens, cached + new tokens), got {shape}"
            )
        if attention_mask.dtype == torch.bool:
            allowed = attention_mask
        else:
            allowed = attention_mask > torch.finfo(attention_mask.dtype).min / 2
        q_pos = torch.arange(n, device=allowed.device)[:, None] + past
        diagonal = torch.arange(keys, device=allowed.device)[None, :] == q_pos
        allowed = allowed | (diagonal & ~allowed.any(-1, keepdim=True))
        if getattr(cache, "max_len", None) is not None:  # keys span a static buffer
            allowed = F.pad(allowed, (0, cache.max_len - keys), value=False)
        return AttentionMask(query_offset=past, allowed=allowed)

    # ------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        past_key_values: DynamicCache | StaticCache | None = None,
        use_cache: bool = False,
        cache_position: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        """Run the model (the inputs' rules: the class docstring).

        Args:
            input_ids: ``(B, N)`` token ids (only the new tokens when a cache is given).
            attention_mask: optional, 2-D ``(B, cached + N)`` (1 = real token, 0 = padding) or
                4-D ``(B or 1, 1, N, cached + N)`` (the full mask, boolean or additive).
            labels: optional ``(B, N)``; the loss predicts ``labels[:, 1:]`` from positions
                ``:-1``; ``-100`` is ignored (set it on padding).
            output_attentions: also return the per-layer maps. This computes attention with
                the explicit ``reference`` kernel for this call, whatever the backend.
            output_hidden_states: also return the hidden states.
            past_key_values: a :class:`~diffattn.cache.DynamicCache` or
                :class:`~diffattn.cache.StaticCache` holding earlier tokens; it is updated.
            use_cache: start a :class:`~diffattn.cache.DynamicCache` when none is given.
            cache_position: optional ``(N,)`` int64 slots of a pre-allocated cache for the new
                tokens (fixed-shape decoding).
            inputs_embeds: ``(B, N, d_model)`` instead of ``input_ids`` (soft prompts).
            position_ids: optional ``(B or 1, N)`` RoPE positions.
            document_ids: optional ``(B, N)`` integers: documents packed in a row.
        """
        x = self._embed(input_ids, inputs_embeds)
        bsz, n = x.shape[:2]
        cache = past_key_values
        if cache is None and use_cache:
            cache = DynamicCache()
        past = 0 if cache is None or cache_position is not None else cache.get_seq_length()
        mask, positions, document_ids = self._attention_inputs(
            attention_mask, cache, cache_position, position_ids, document_ids, past, bsz, n,
            x.device,
        )  # fmt: skip
        rope = self.rotary(positions)
        x, maps, hidden = self._decode_layers(
            x, rope, mask, cache, output_attentions, output_hidden_states
        )
        # the module call (not F.linear on its weight) lets a tensor-parallel plan shard it
        logits = self.lm_head(x) if self.lm_head is not None else F.linear(x, self.output_weight)
        loss = None
        if labels is not None:
            loss = self._loss(logits, labels, document_ids, bsz, n)
        return CausalLMOutput(
            logits=logits,
            loss=loss,
            attentions=tuple(m.diff for m in maps) if maps is not None else None,
            attention_maps=tuple(maps) if maps is not None else None,
            hidden_states=tuple(hidden) if hidden is not None else None,
            past_key_values=cache,
            documents=document_ids,
        )

    def _decode_layers(self, x, rope, mask, cache, output_attentions, output_hidden_states):
        """The decoder blocks (Eq.4–5 each; checkpointed in training when asked), the cache's
        advance past this call's tokens, and the final RMSNorm: ``(x, maps, hidden states)``,
        the lists ``None`` unless asked for (the last hidden state is the normed one)."""
        hidden = [x] if output_hidden_states else None
        maps = [] if output_attentions else None
        checkpointing = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.layers:
            # A block that checkpoints itself (the Hugging Face wrapper's blocks) is not
            # wrapped a second time.
            if checkpointing and not getattr(block, "gradient_checkpointing", False):
                run = self._gradient_checkpointing_func or _checkpoint
                x, layer_maps = run(block, x, rope, mask, output_attentions, cache)
            else:
                x, layer_maps = block(x, rope, mask, output_attentions, cache)
            if output_attentions:
                maps.append(layer_maps)
            if output_hidden_states:
                hidden.append(x)
        if cache is not None:
            cache.advance()
        x = self.norm(x)
        if output_hidden_states:
            hidden[-1] = x
        return x, maps, hidden

    @staticmethod
    def _loss(logits, labels, document_ids, bsz, n) -> torch.Tensor:
        """Mean next-token cross-entropy (:func:`next_token_loss`), no target crossing a
        packed document's boundary; refuses labels not shaped like the input."""
        if labels.shape != (bsz, n):
            raise ValueError(
                f"labels shape {tuple(labels.shape)} does not match "
                f"the input's (batch, seq_len) = {(bsz, n)}"
            )
        if document_ids is not None:
            labels = labels_within_documents(labels, document_ids)
        # Rows of one-token documents have no target, and the documents' path reads its ids on
        # the host already, so it says so; elsewhere labels with no target give torch's NaN,
        # as in HF's models (checking would make every call wait for the device).
        if document_ids is not None and not bool((labels[:, 1:] != IGNORE_INDEX).any()):
            raise ValueError(
                "no loss target: no token has a next token of its own document to predict "
                "(the packed documents are one token long, or their labels are -100)"
            )
        return next_token_loss(logits, labels)


def count_parameters(config: ModelConfig, exclude_embeddings: bool = False) -> int:
    """Parameter count of ``DiffTransformerLM(config)``, built on the meta device (free)."""
    with torch.device("meta"):
        model = DiffTransformerLM(config)
    return model.num_parameters(exclude_embeddings=exclude_embeddings)
