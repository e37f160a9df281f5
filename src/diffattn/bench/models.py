"""The models ``diffattn bench`` times and how each one is called.

Ours (baseline, DIFF V1, DIFF V2, and any registered attention type ``--models`` names) are
built at matched parameters (see
:mod:`diffattn.bench.throughput`); with ``transformers`` importable, HF ``LlamaForCausalLM`` and
``DiffLlamaForCausalLM`` join them at the same size, and with ``--dex`` two copies of that HF
Llama with Dex on half of every layer's heads (Dex §3.2 adapts the top half): one with the
adapter hooks in place (``dex_unmerged``) and one with Dex folded into W_O (``dex_merged``, a
plain Llama again, Dex App. E). HF rows take their ratios against HF Llama, so every ratio pits
a model against the baseline of its own code base.

Every :class:`Candidate` has three ways of being run: ``call(ids, labels)`` (a forward, with a
loss when labels are given) and ``decode(prompt, new_tokens)``, which runs the prompt into a
fresh KV cache (untimed) and returns the timed part: ``new_tokens`` greedy steps of one token.
Our models decode with a :class:`~diffattn.cache.StaticCache` through
:func:`~diffattn.generation.decode_step` (optionally compiled as ``generate`` compiles it:
CUDA graphs on CUDA); HF models with their own default cache.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from diffattn.attention.baseline import BASELINE
from diffattn.attention.kernels import resolve_backend
from diffattn.bench.backends import auto_choice
from diffattn.cache import DynamicCache, StaticCache
from diffattn.config import ModelConfig
from diffattn.flops import (
    V1Form,
    decode_flops_per_token,
    flops_per_token,
    v1_form_for_kernel,
)
from diffattn.generation import compiled_decode_step, decode_step, mark_static_cache
from diffattn.model import DiffTransformerLM

DEX_ROWS = ("dex_unmerged", "dex_merged")
HF_ROWS = ("hf_llama", "hf_diffllama")
"""The Hugging Face rows: Llama (the reference of the HF rows) and DiffLlama."""
REFERENCE = BASELINE.name
"""The row each of our rows is compared with: the matched Transformer baseline."""
MODE_CASES = {"fwd": "prefill", "fwd+bwd": "train", "decode": "decode"}
"""The call shape of each bench mode, as ``auto`` sees it."""


@dataclass
class Candidate:
    """One model under test and how to call it."""

    name: str
    model: torch.nn.Module
    params: int
    kernel: str
    """Attention kernel actually used: a resolved diffattn backend or HF attn_implementation."""
    reference: str
    """The row this one's ratios are taken against."""
    call: Callable[..., Any]
    """``call(ids, labels)`` -> an output with ``.loss`` (``labels`` may be ``None``)."""
    decode: Callable[..., Callable[[], None]]
    """``decode(prompt, new_tokens, eager=False)``: prefill a fresh cache, return the timed
    decode loop (``eager``: without ``torch.compile``, for the CPU memory tracker)."""
    config: ModelConfig
    """The diffattn config whose FLOPs this model has (for HF rows, the config it mirrors)."""
    extra_flops: float = 0.0
    """Forward FLOPs per token on top of ``config``'s (Dex's W_D products)."""
    cache: str = "static"
    """The KV cache ``decode`` uses: ``static`` or ``dynamic``."""
    v1_form: V1Form = "qk_once"
    """How the kernel computes DIFF V1 (:func:`~diffattn.flops.v1_form_for_kernel`)."""
    mode_kernels: dict[str, str] | None = None
    """The kernel of each mode when it differs by call (``auto`` resolves per call)."""
    ours: bool = False
    """A diffattn model (``--compile`` compiles its blocks), not a Hugging Face one."""

    def kernel_in(self, mode: str) -> str:
        """The attention kernel this row runs in ``mode``."""
        return (self.mode_kernels or {}).get(mode, self.kernel)

    def v1_form_in(self, mode: str) -> V1Form:
        """How this row's kernel computes DIFF V1 in ``mode``."""
        if self.mode_kernels is None or mode not in self.mode_kernels:
            return self.v1_form
        return v1_form_for_kernel(self.mode_kernels[mode])

    def flops_per_token(
        self, mode: str, seq_len: int, new_tokens: int = 1, as_computed: bool = False
    ) -> float:
        """FLOPs per token of ``mode`` (backward = 2× forward; ``seq_len`` is the prompt length
        in ``decode``). Model FLOPs count DIFF V1 with QK once; ``as_computed`` counts it the way
        this row's kernel computes it (the FLOP bound's numbers)."""
        form = self.v1_form_in(mode) if as_computed else "qk_once"
        if mode == "decode":
            flops = decode_flops_per_token(self.config, seq_len, new_tokens, form)
            return flops + self.extra_flops
        forward = flops_per_token(self.config, seq_len, form).forward + self.extra_flops
        return 3.0 * forward if mode == "fwd+bwd" else forward


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1].argmax(dim=-1, keepdim=True)


def our_decode(model: DiffTransformerLM, cache_kind: str, compiled: bool):
    """The ``decode`` of one of our models (see the module docstring)."""
    device = model.embed_tokens.weight.device
    mode = "reduce-overhead" if device.type == "cuda" else "default"  # as generate()'s
    step = compiled_decode_step("inductor", mode) if compiled else decode_step

    @torch.no_grad()
    def prepare(prompt: torch.Tensor, new_tokens: int, eager: bool = False) -> Callable[[], None]:
        model.eval()
        bsz, length = prompt.shape
        weight = model.embed_tokens.weight
        if cache_kind == "dynamic":
            cache = DynamicCache()
            token = _greedy(model(prompt, past_key_values=cache).logits)

            @torch.no_grad()
            def run_dynamic() -> None:
                nonlocal token
                for _ in range(new_tokens):
                    token = _greedy(model(token, past_key_values=cache).logits)

            return run_dynamic
        cache = StaticCache(
            model.config, bsz, length + new_tokens, device=weight.device, dtype=weight.dtype
        )
        if compiled:
            mark_static_cache(cache)
        slots = torch.arange(length, device=weight.device)
        token = decode_step(model, cache, prompt, None, slots).argmax(-1, keepdim=True)

        @torch.no_grad()
        def run_static() -> None:
            nonlocal token
            for i in range(new_tokens):
                slot = torch.arange(length + i, length + i + 1, device=weight.device)
                run_step = decode_step if eager else step
                token = run_step(model, cache, token, None, slot).argmax(-1, keepdim=True)

        return run_static

    return prepare


def hf_decode(model: torch.nn.Module):
    """The ``decode`` of a Hugging Face model, with HF's ``StaticCache`` (preallocated like
    ours, so no row pays for a growing cache's copies and allocations) and explicit
    ``cache_position``."""
    from transformers import StaticCache

    @torch.no_grad()
    def prepare(prompt: torch.Tensor, new_tokens: int, eager: bool = True) -> Callable[[], None]:
        model.eval()
        length = prompt.shape[1]
        device = prompt.device
        cache = StaticCache(config=model.config, max_cache_len=length + new_tokens)
        out = model(
            input_ids=prompt,
            past_key_values=cache,
            cache_position=torch.arange(length, device=device),
            use_cache=True,
        )
        state = {"token": _greedy(out.logits)}

        @torch.no_grad()
        def run() -> None:
            for i in range(new_tokens):
                position = torch.arange(length + i, length + i + 1, device=device)
                out = model(
                    input_ids=state["token"],
                    past_key_values=cache,
                    cache_position=position,
                    use_cache=True,
                )
                state["token"] = _greedy(out.logits)

        return run

    return prepare


def our_candidates(
    configs: dict[str, ModelConfig], device, dtype, compiled: bool = False
) -> list[Candidate]:
    """One model per config of ``configs`` (baseline, DIFF V1, DIFF V2, ...) on its backend
    (``compiled``: their calls are traced by ``torch.compile``, which ``auto`` resolves as
    such). ``auto`` is resolved for the kernel entry point each type calls
    (``AttentionType.entry``)."""
    probe = torch.empty(0, device=device, dtype=dtype)
    out = []
    for name, config in configs.items():
        torch.manual_seed(0)
        model = DiffTransformerLM(config).to(device=device, dtype=dtype)
        mode_kernels = None
        if config.backend == "auto":  # resolved per call: what each mode's calls run on
            entry = config.single_type("diffattn bench").entry
            cases = dict.fromkeys(MODE_CASES, "traced") if compiled else MODE_CASES
            mode_kernels = {
                mode: auto_choice(entry, case, device, dtype, config.dim_per_head)
                for mode, case in cases.items()
            }
            kernel = mode_kernels["fwd+bwd"]
        else:
            kernel = resolve_backend(config.backend, probe)
        decode_kernel = (mode_kernels or {}).get("decode", kernel)
        cache = "dynamic" if decode_kernel == "flash" else "static"  # flash: causal to the end
        out.append(
            Candidate(
                name=name,
                model=model,
                params=model.num_parameters(),
                kernel=kernel,
                reference=REFERENCE,
                call=lambda ids, labels, m=model: m(ids, labels=labels),
                decode=our_decode(model, cache, compiled),
                config=config,
                cache=cache,
                v1_form=v1_form_for_kernel(kernel),
                mode_kernels=mode_kernels,
                ours=True,
            )
        )
    return out


def hf_available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _hf_candidate(name, model, config, extra_flops=0.0) -> Candidate:
    return Candidate(
        name=name,
        model=model,
        params=sum(p.numel() for p in model.parameters()),
        kernel=model.config._attn_implementation,
        reference=HF_ROWS[0],
        call=lambda ids, labels, m=model: m(input_ids=ids, labels=labels, use_cache=False),
        decode=hf_decode(model),
        config=config,
        extra_flops=extra_flops,
        cache="static",
        v1_form="two_call",
    )


def hf_candidates(configs: dict[str, ModelConfig], device, dtype) -> list[Candidate]:
    """HF Llama and DiffLlama at the size of ``configs``; empty without ``transformers``.

    HF DiffLlama counts heads like our config (``num_attention_heads`` query heads of width
    ``head_dim``, paired h / h+H/2; V has ``num_key_value_heads`` heads of width d), so the
    same numbers give our DIFF V1's shapes. It has no head-norm weight, 2d per layer fewer
    parameters. Its attention runs two SDPA calls, each over all query half-heads against one
    d-wide half of V, so QKᵀ is computed twice (the split-V two-call form of the FLOP count).
    """
    if not hf_available():
        return []
    from transformers import DiffLlamaForCausalLM, LlamaForCausalLM

    from diffattn.convert.diffllama import diffattn_config_to_diffllama
    from diffattn.convert.llama import diffattn_config_to_llama

    base = configs[REFERENCE]
    specs = (
        (HF_ROWS[0], diffattn_config_to_llama(base), LlamaForCausalLM, REFERENCE),
        (
            HF_ROWS[1],
            diffattn_config_to_diffllama(configs["diff_v1"]),
            DiffLlamaForCausalLM,
            "diff_v1",
        ),
    )
    out = []
    for name, hf_config, model_cls, ours in specs:
        torch.manual_seed(0)
        impl = "sdpa" if getattr(model_cls, "_supports_sdpa", False) else "eager"
        model = model_cls._from_config(hf_config, attn_implementation=impl)
        model = model.to(device=device, dtype=dtype)
        out.append(_hf_candidate(name, model, configs[ours]))
    return out


def dex_flops_per_token(config: ModelConfig, adapted_heads: int) -> float:
    """Forward FLOPs per token Dex adds: ``O_h W_D,h`` (d × d) for every adapted head."""
    return 2.0 * config.dim_per_head**2 * adapted_heads


def dex_candidates(hf_llama: Candidate) -> list[Candidate]:
    """HF Llama with Dex on the first half of every layer's heads, unmerged and merged.

    λ_learn starts at 0.5 with no annealing (λ = λ_learn), so the adapter changes the outputs
    and the merged model carries a real fold; nothing is frozen, so ``fwd+bwd`` computes the
    same weight gradients as the base model plus Dex's.
    """
    from diffattn.dex.adapter import apply
    from diffattn.dex.merge import merge
    from diffattn.dex.sites import find_attention

    config = hf_llama.config
    sites = find_attention(hf_llama.model)
    heads = {site.index: list(range(site.n_heads // 2)) for site in sites}
    adapted = sum(len(h) for h in heads.values())
    torch.manual_seed(0)
    unmerged = apply(
        copy.deepcopy(hf_llama.model),
        heads,
        anneal_steps=0,
        lambda_learn_init=0.5,
        freeze=False,
    )
    merged = merge(copy.deepcopy(unmerged))
    extra = dex_flops_per_token(config, adapted)
    return [
        _hf_candidate("dex_unmerged", unmerged, config, extra_flops=extra),
        _hf_candidate("dex_merged", merged, config),
    ]
