"""diffattn checkpoints on vLLM (the model plugin, ``diffattn.vllm_plugin``): greedy tokens equal
diffattn's own ``generate`` token for token, prompt log-probabilities equal its forward, with
prefix caching and chunked prefill on and off, GQA and MHA, for the three attention types and
GDA, stacks of mixed types and a Dex-merged Llama; the KV cache vLLM allocates is measured.
Tensor-parallel serving: tests/test_vllm_tensor_parallel.py.

One engine per checkpoint serves every test of it (pytest groups the tests by the
module-scoped fixture), since an engine takes 5 to 17 s to start on two cores.
"""

from __future__ import annotations

import os

import pytest

from extras import require_extra
from vllm_helpers import require_vllm

pytestmark = [require_extra("hf"), require_vllm(), pytest.mark.vllm]

import torch

from serve_helpers import VOCAB
from vllm_helpers import (
    BLOCK,
    LENGTHS,
    NEW_TOKENS,
    greedy,
    prompt_ids,
    save_checkpoint,
    start_engine,
    use_in_process_engines,
    vllm_greedy,
)

use_in_process_engines()
# LLM.apply_model ships the measuring function to the engine's worker by pickle.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

CACHING = dict(enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=64)
"""Prefix caching on, and prefill in chunks of at most 64 tokens (a 300-token prompt takes 5)."""
PLAIN = dict(enable_prefix_caching=False, enable_chunked_prefill=False, max_num_batched_tokens=512)
"""Both off: each prompt is prefilled whole, nothing is reused."""

CHECKPOINTS = {
    "baseline-gqa": ("baseline", dict(n_kv_heads=4), CACHING),
    "baseline-mha": ("baseline", dict(tie_embeddings=True, rope_style="interleaved"), PLAIN),
    "diff_v1-gqa": ("diff_v1", dict(n_kv_heads=4), CACHING),
    "diff_v1-mha": (
        "diff_v1",
        dict(head_norm_learnable=False, lambda_init=0.5, rope_style="interleaved"),
        PLAIN,
    ),
    "diff_v2-gqa": ("diff_v2", dict(n_kv_heads=4), CACHING),
    "diff_v2-mha": ("diff_v2", dict(v2_paired_heads=False, v2_lambda_sigmoid=False), PLAIN),
    "mixed-gqa": ("baseline", dict(layer_types="diff_v1,baseline", n_kv_heads=4), CACHING),
    "gda-gqa": ("gda", dict(n_kv_heads=2, attention_options={"gda": {"ratio": 3}}), CACHING),
    "gda-mha": (
        "gda",
        dict(
            n_kv_heads=4,
            head_norm_learnable=False,
            attention_options={"gda": {"ratio": 2, "head_budget": "outputs"}},
        ),
        PLAIN,
    ),
    "gda-mixed": (
        "baseline",
        dict(layer_types="gda,baseline", n_kv_heads=4, attention_options={"gda": {"ratio": 1}}),
        CACHING,
    ),
}
"""Each checkpoint: ``(attention, fields, engine settings)``; ``mixed-gqa`` is a stack of mixed
types, each layer served by its own call (DIFF V1's at width 2·head_dim, the baseline's at
head_dim) over one paged cache. GDA: ``gda-gqa`` 3:1 with 6 signal and 2 noise heads over one
KV group (W_O over 6·2d, wider than the baseline's), ``gda-mha`` 2:1 with ``head_budget``
'outputs' (4 signal, 2 noise heads, one per KV group), ``gda-mixed`` 1:1 beside a baseline
layer."""


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def served(request, tmp_path_factory):
    """``(name, diffattn model, vLLM engine, engine settings)`` for one checkpoint."""

    attention, overrides, settings = CHECKPOINTS[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    model, _ = save_checkpoint(directory, attention, **overrides)
    llm = start_engine(directory, **settings)
    yield request.param, model, llm, settings
    llm.llm_engine.engine_core.shutdown()
    del llm


def test_greedy_tokens_equal_diffattn_generate(served):
    name, model, llm, _ = served
    prompts = [prompt_ids(seed, n, VOCAB) for seed, n in enumerate(LENGTHS)]
    outputs = vllm_greedy(llm, prompts)
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = greedy(model, prompt, NEW_TOKENS)
        assert list(output.outputs[0].token_ids) == expected, (name, len(prompt))


def test_a_shared_prefix_gives_the_same_tokens(served):
    """Prompts that share 256 tokens: with prefix caching the later ones reuse the cached
    blocks (vLLM reports them), and the tokens stay diffattn's."""
    name, model, llm, settings = served
    prefix = prompt_ids(100, 256, VOCAB)
    vllm_greedy(llm, [prefix + prompt_ids(101, 5, VOCAB)])
    prompts = [prefix + prompt_ids(102 + i, n, VOCAB) for i, n in enumerate((1, 40))]
    outputs = vllm_greedy(llm, prompts)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert list(output.outputs[0].token_ids) == greedy(model, prompt, NEW_TOKENS), name
        cached = output.num_cached_tokens or 0
        if settings["enable_prefix_caching"]:
            assert cached >= 256 - BLOCK, (name, cached)
        else:
            assert cached == 0, (name, cached)


def test_prompt_logprobs_equal_the_forward(served):
    from vllm import SamplingParams

    name, model, llm, _ = served
    prompt = prompt_ids(7, 200, VOCAB)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), -1)
    worst = 0.0
    for t in range(1, len(prompt)):
        got = output.prompt_logprobs[t][prompt[t]].logprob
        worst = max(worst, abs(got - expected[t - 1, prompt[t]].item()))
    assert worst < 1e-4, (name, worst)


def test_kv_cache_is_the_baselines_size(served):
    """Measured from the cache tensors vLLM allocated: bytes per token, all layers, equal the
    least the model needs (K1, K2 at d and V at 2d per DIFF V1 group), which is the matched
    baseline's."""
    from diffattn.vllm_plugin.layout import ideal_kv_cache_bytes_per_token
    from diffattn.vllm_plugin.model import kv_cache_bytes

    name, model, llm, _ = served
    sizes = llm.apply_model(kv_cache_bytes)[0]
    cache = llm.llm_engine.vllm_config.cache_config
    per_token = sum(sizes.values()) / (cache.num_gpu_blocks * cache.block_size)
    assert len(sizes) == model.config.n_layers
    assert per_token == ideal_kv_cache_bytes_per_token(model.config, 4), name
    baseline = model.config.replace(attention="baseline", layer_types=None, attention_options={})
    assert per_token == ideal_kv_cache_bytes_per_token(baseline, 4), name


def test_a_dex_merged_llama_serves_as_the_dex_model_decodes(tmp_path):
    """A ``diffattn dex merge`` output is a plain Llama: vLLM runs it with its own Llama class,
    and its greedy tokens equal those of the Dex model (adapter applied, not merged)."""
    import copy

    from diffattn import dex
    from helpers import tiny_hf
    from serve_helpers import word_tokenizer

    model = tiny_hf("llama", vocab_size=VOCAB, hidden_size=128, max_position_embeddings=512)
    dex.apply(model, {0: [0, 2], 1: [1, 3]}, anneal_steps=10)
    dex.set_step(model, 20)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in dex.dex_layers(model).values():
            layer.w_d.add_(0.5 * torch.randn(layer.w_d.shape, generator=generator))
            layer.lambda_learn.fill_(0.6)
    merged = dex.merge(copy.deepcopy(model))
    merged.save_pretrained(tmp_path)
    word_tokenizer().save_pretrained(tmp_path)
    prompts = [prompt_ids(seed, n, VOCAB) for seed, n in enumerate(LENGTHS)]
    llm = start_engine(tmp_path)
    try:
        outputs = vllm_greedy(llm, prompts)
    finally:
        llm.llm_engine.engine_core.shutdown()
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():  # greedy by full forwards: no EOS handling, no cache
            for _ in range(NEW_TOKENS):
                ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
        expected = ids[0, len(prompt) :].tolist()
        assert list(output.outputs[0].token_ids) == expected, len(prompt)
