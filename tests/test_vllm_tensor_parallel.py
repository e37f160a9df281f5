"""Tensor-parallel serving of diffattn checkpoints on vLLM (the model plugin,
``diffattn.vllm_plugin``): two workers, each with half of the KV groups, give diffattn's greedy
tokens and prompt log-probabilities for the three attention types and GDA. (A file of its
own, so that CI's vLLM stage runs it beside tests/test_vllm_engine.py on its second worker.)

Each engine start with two workers costs about 35 s on 2 CPU cores, so the default run serves
one stack that holds every type, a layer each (each layer is split by its own type's plan); the
single-type checkpoints are ``slow``."""

from __future__ import annotations

import pytest

from extras import require_extra
from vllm_helpers import require_vllm

pytestmark = [require_extra("hf"), require_vllm(), pytest.mark.vllm]

import torch

from serve_helpers import VOCAB
from vllm_helpers import (
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


EVERY_TYPE = "baseline,diff_v1,diff_v2,gda"
"""One layer of each type that vLLM can serve split over two workers (GDA at 3:1)."""


@pytest.mark.parametrize(
    "attention",
    [
        "mixed",
        pytest.param("baseline", marks=pytest.mark.slow),
        pytest.param("diff_v1", marks=pytest.mark.slow),
        pytest.param("diff_v2", marks=pytest.mark.slow),
        pytest.param("gda", marks=pytest.mark.slow),
    ],
)
def test_tensor_parallel_serving_equals_diffattn(attention, tmp_path, monkeypatch):
    """Two tensor-parallel workers (vLLM's CPU workers, one core each): each holds half of the
    KV groups (whole (K1, K2) pairs for DIFF V1; for GDA 3:1 also their noise heads' groups of
    query heads and their signal heads' W_O columns); greedy tokens and prompt log-probabilities
    equal diffattn's."""
    from vllm import SamplingParams

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one NUMA node: bind by hand
    if attention == "mixed":
        model, directory = save_checkpoint(
            tmp_path, "baseline", n_kv_heads=4, n_layers=4, layer_types=EVERY_TYPE
        )
    else:
        model, directory = save_checkpoint(tmp_path, attention, n_kv_heads=4)
    llm = start_engine(directory, tensor_parallel_size=2, distributed_executor_backend="mp")
    try:
        prompts = [prompt_ids(seed, n, VOCAB) for seed, n in enumerate(LENGTHS)]
        outputs = vllm_greedy(llm, prompts)
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
        scored = llm.generate([{"prompt_token_ids": prompts[3]}], params, use_tqdm=False)[0]
    finally:
        llm.llm_engine.engine_core.shutdown()
    for prompt, output in zip(prompts, outputs, strict=True):
        assert list(output.outputs[0].token_ids) == greedy(model, prompt, NEW_TOKENS), len(prompt)
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([prompts[3]])).logits[0].double(), -1)
    worst = max(
        abs(
            scored.prompt_logprobs[t][prompts[3][t]].logprob - expected[t - 1, prompts[3][t]].item()
        )
        for t in range(1, len(prompts[3]))
    )
    assert worst < 1e-4, worst
