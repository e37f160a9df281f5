"""Continuous batching (paged attention) of DiffAttnForCausalLM: greedy outputs equal ``generate``.

transformers' continuous batching packs the new tokens of many requests into one row and keeps
their keys and values in a paged cache (:mod:`diffattn.hf.paged`). Each request's greedy tokens
must equal those of HF's ``generate`` and of diffattn's own greedy decoding, for the three
attention types, with a prompt of one token, prompts longer than a page and than a batch's
token budget (chunked prefill), more requests than fit in one batch, the same prompt twice,
and requests arriving while others decode.
"""

from __future__ import annotations

import inspect
import time

import pytest
import torch

from extras import require_extra
from helpers import ATTENTIONS, tiny_diffattn

pytestmark = require_extra("hf")

import transformers

from diffattn.generation import generate as diffattn_generate
from diffattn.hf import DiffAttnForCausalLM

PAGE = 4
"""Tokens per page of the paged cache: the longer prompts span several pages."""
BUDGET = 8
"""Tokens one batch may hold: a longer prompt is prefilled in chunks."""
PROMPTS = [[5, 9, 2, 7, 1, 3, 8, 4, 6, 11, 12, 10, 13], [17], [3, 1, 4], [2, 7, 1, 8, 2, 8, 1]]
NEW_TOKENS = 6
HAS_CONFIG = hasattr(transformers, "ContinuousBatchingConfig")
"""Whether this release sizes continuous batching with a ``ContinuousBatchingConfig`` (after
5.0) or with fields of the ``GenerationConfig`` (5.0)."""


@pytest.fixture(autouse=True)
def cpu_memory_for_sizing(monkeypatch):
    """5.0 sizes the paged cache from the device's total memory, which it reads as ``None`` on
    the CPU (a ``TypeError`` inside transformers, for every model): give it 8 GiB there."""
    from transformers.generation.continuous_batching import cache

    breakdown = getattr(cache, "get_device_and_memory_breakdown", None)
    if breakdown is not None and breakdown()[1] is None:
        gib = 2**30
        monkeypatch.setattr(
            cache, "get_device_and_memory_breakdown", lambda: (torch.device("cpu"), 8 * gib, 0, 0)
        )


def hf_model(attention: str) -> DiffAttnForCausalLM:
    return DiffAttnForCausalLM.from_diffattn(tiny_diffattn(attention, seed=1)).eval()


def batching(max_requests: int = 8) -> tuple[transformers.GenerationConfig, dict]:
    """Greedy settings and a small paged cache: pages of ``PAGE`` tokens, ``BUDGET`` tokens and
    at most ``max_requests`` requests per batch."""
    generation = transformers.GenerationConfig(
        max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    sizes = dict(num_blocks=64, max_batch_tokens=BUDGET)
    if not HAS_CONFIG:  # 5.0: the sizes live on the generation config
        for name, value in dict(
            sizes, block_size=PAGE, max_requests_per_batch=max_requests
        ).items():
            setattr(generation, name, value)
        return generation, {}
    config = transformers.ContinuousBatchingConfig(
        page_size=PAGE, max_requests_per_batch=max_requests, **sizes
    )
    return generation, {"continuous_batching_config": config}


def outputs_by_prompt(results: dict, inputs: list[list[int]]) -> dict[tuple, list[list[int]]]:
    """The generated tokens of every request, by prompt (5.0 returns the requests in the order
    they finished, under ids not in input order); one result per input."""
    outputs: dict[tuple[int, ...], list[list[int]]] = {}
    for result in results.values():
        outputs.setdefault(tuple(result.prompt_ids), []).append(list(result.generated_tokens))
    assert sorted(outputs) == sorted({tuple(p) for p in inputs})
    assert sum(map(len, outputs.values())) == len(inputs)
    return outputs


def expected_by_prompt(hf: DiffAttnForCausalLM, inputs: list[list[int]]) -> dict:
    """``generate``'s tokens for each input, by prompt (a repeated prompt: repeated tokens)."""
    return {tuple(p): [reference_tokens(hf, p)] * inputs.count(p) for p in inputs}


def reference_tokens(hf: DiffAttnForCausalLM, prompt: list[int]) -> list[int]:
    """Greedy tokens from HF's ``generate``, checked against diffattn's own greedy decoding."""
    ids = torch.tensor([prompt])
    hf_tokens = hf.generate(
        ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None
    )[0, len(prompt) :].tolist()
    ours = diffattn_generate(hf.model, ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert ours.sequences[0, len(prompt) :].tolist() == hf_tokens
    return hf_tokens


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_generate_batch_equals_generate_for_every_request(attention):
    hf = hf_model(attention)
    # the same prompts twice, among others (the long one's full pages can be shared)
    prompts = [*PROMPTS, PROMPTS[2], PROMPTS[0]]
    generation, sizes = batching(max_requests=3)  # six requests, at most three per batch
    results = hf.generate_batch(prompts, generation_config=generation, **sizes)
    expected = expected_by_prompt(hf, prompts)
    assert outputs_by_prompt(results, prompts) == expected
    assert len(expected[tuple(PROMPTS[2])]) == len(expected[tuple(PROMPTS[0])]) == 2
    assert len({tuple(e[0]) for e in expected.values()}) == 4  # distinct prompts differ


def collect(manager, request_ids: set[str], deadline: float) -> dict[str, list[int]]:
    """The generated tokens of each finished request in ``request_ids``."""
    finished: dict[str, list[int]] = {}
    while len(finished) < len(request_ids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"finished {sorted(finished)} of {sorted(request_ids)}")
        result = manager.get_result(timeout=0.5)
        if result is not None and result.is_finished() and result.request_id in request_ids:
            assert result.error is None, result.error
            finished[result.request_id] = list(result.generated_tokens)
    return finished


@pytest.mark.parametrize(
    "attention",  # DIFF V1 by default (two maps, split values); the others with the slow tests
    [pytest.param(a, marks=pytest.mark.slow) if a != "diff_v1" else a for a in ATTENTIONS],
)
def test_manager_requests_added_while_others_decode(attention):
    """The manager API that servers use: a first request starts decoding, then others of
    different lengths arrive; every request still gets ``generate``'s tokens."""
    hf = hf_model(attention)
    generation, sizes = batching()
    manager = hf.init_continuous_batching(generation_config=generation, **sizes)
    manager.start()
    try:
        deadline = time.monotonic() + 60
        first = manager.add_request(PROMPTS[0], max_new_tokens=NEW_TOKENS, streaming=True)
        partial = None
        while partial is None or len(partial.generated_tokens) == 0:
            assert time.monotonic() < deadline, "the first request produced no token"
            partial = manager.get_result(request_id=first, timeout=0.5)
        assert not partial.is_finished()  # it is mid-decode when the others arrive
        late = [manager.add_request(p, max_new_tokens=NEW_TOKENS) for p in PROMPTS[1:]]
        streamed = list(partial.generated_tokens)
        finished = collect(manager, {first, *late}, deadline)
    finally:
        manager.stop(block=True, timeout=10)
    expected = [reference_tokens(hf, p) for p in PROMPTS]
    assert [finished[first], *(finished[r] for r in late)] == expected
    assert expected[0][: len(streamed)] == streamed


def test_continuous_batching_arguments_are_checked_by_name():
    hf = hf_model("diff_v1")
    ids = torch.tensor([[1, 2, 3]])
    lengths = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(TypeError, match="cu_seq_lens_typo"):
        hf(ids, cu_seq_lens_typo=lengths)
    with pytest.raises(ValueError, match="needs the PagedAttentionCache"):
        hf(ids, cu_seq_lens_q=lengths, cu_seq_lens_k=lengths, read_index=[lengths])
    # without the paged arguments, cu_seq_lens are HF's padding-free format (one document here)
    one = hf(ids, cu_seq_lens_q=lengths, cu_seq_lens_k=lengths, use_cache=False).logits
    torch.testing.assert_close(one, hf(ids, use_cache=False).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="read_index, write_index: continuous-batching"):
        hf(ids, read_index=[lengths], write_index=[lengths])


@pytest.mark.skipif(not HAS_CONFIG, reason="5.0 has no ContinuousBatchingConfig")
def test_block_table_and_cuda_graph_settings_are_refused_with_the_field_named():
    hf = hf_model("baseline")
    generation, _ = batching()
    for field in ({"max_blocks_per_request": 4}, {"use_cuda_graph": True}):
        config = transformers.ContinuousBatchingConfig(num_blocks=8, **field)
        with pytest.raises(ValueError, match=next(iter(field))):
            hf.init_continuous_batching(generation, continuous_batching_config=config)


@pytest.mark.slow
def test_eager_runs_as_paged_eager_on_the_reference_kernel():
    """Continuous batching switches ``eager`` to ``paged|eager``; that is diffattn's reference
    kernel, and the model returns to ``eager`` afterwards."""
    hf = hf_model("diff_v2")
    hf.set_attn_implementation("eager")
    generation, sizes = batching()
    results = hf.generate_batch(PROMPTS[1:3], generation_config=generation, **sizes)
    assert outputs_by_prompt(results, PROMPTS[1:3]) == expected_by_prompt(hf, PROMPTS[1:3])
    # 5.24 switches back to "eager" when the manager stops; 5.0 leaves "paged|eager"
    assert hf.config._attn_implementation in ("eager", "paged|eager")
    assert hf.model.backend == "reference"


def test_release_passes_only_arguments_forward_names():
    """Every argument this release's continuous batching passes to ``forward`` is a parameter
    of ``DiffAttnForCausalLM.forward`` (the names are read from the release where it states
    them)."""
    from transformers.generation.continuous_batching import continuous_api

    args_class = getattr(continuous_api, "PagedAttentionArgs", None)
    if args_class is None:
        from transformers.generation.continuous_batching import input_outputs

        args_class = input_outputs.PagedAttentionArgs
    names = set(getattr(args_class, "__annotations__", {}))
    names = {  # 5.0 annotates its fields with the names of the values, not of the arguments
        {"cumulative_seqlens_q": "cu_seq_lens_q", "cumulative_seqlens_k": "cu_seq_lens_k"}.get(n, n)
        for n in names
    }
    parameters = set(inspect.signature(DiffAttnForCausalLM.forward).parameters)
    assert names and names <= parameters | {"logits_to_keep"}, names - parameters


class SlotStore:
    """A stand-in for the paged cache: per layer, K and V rows at integer slots."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, keys, values, layer_index, read_index, write_index):
        """:func:`diffattn.hf.compat.paged_cache_update`'s contract on ``(1, H, T, d)``."""
        if layer_index not in self.rows:
            shape = (self.slots, keys.shape[1], keys.shape[-1])
            self.rows[layer_index] = (keys.new_full(shape, float("nan")),) * 2
            self.rows[layer_index] = (self.rows[layer_index][0], values.new_full(shape, 0.0))
        k_rows, v_rows = self.rows[layer_index]
        k_rows[write_index] = keys[0].transpose(0, 1)
        v_rows[write_index] = values[0].transpose(0, 1)
        if read_index.numel() == 0:
            return keys, values
        return (rows[read_index].transpose(0, 1)[None] for rows in (k_rows, v_rows))


def packed_step(sequences, slots, spans, padding: int = 0):
    """The packed arguments of one continuous-batching step: request ``i`` feeds tokens
    ``spans[i] = (start, stop)`` of ``sequences[i]`` (``start == stop``: a padding request of
    length 0), then ``padding`` padding tokens follow."""
    from diffattn.hf.paged import PagedBatchArguments

    ids, positions, cu_q, cu_k, reads, writes = [], [], [0], [0], [], []
    for sequence, own, (start, stop) in zip(sequences, slots, spans, strict=True):
        ids += sequence[start:stop]
        positions += range(start, stop)
        cu_q.append(cu_q[-1] + stop - start)
        cu_k.append(cu_k[-1] + (stop if stop > start else 0))
        writes += own[start:stop]
        reads += own[:stop] if stop > start else []
    ids, positions = ids + [0] * padding, positions + [0] * padding
    writes += [0] * padding  # the trash slot
    arguments = PagedBatchArguments(
        torch.tensor(cu_q, dtype=torch.int32),
        {"full_attention": torch.tensor(cu_k, dtype=torch.int32)},
        [torch.tensor(reads, dtype=torch.long)],
        [torch.tensor(writes, dtype=torch.long)],
    )
    return torch.tensor([ids]), torch.tensor([positions], dtype=torch.int32), arguments


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_paged_forward_logits_equal_each_requests_own_forward(attention, monkeypatch):
    """The paged path against its reference, the model's forward on each request alone (fp32,
    logits to 1e-5): requests of 1, 7 and 129 tokens (and one of 7 beside them) fed in chunks of
    different lengths over three steps, with keys at scattered slots, decode steps of unequal
    key lengths (left padding), a padding request of length 0 and trailing padding tokens."""
    from diffattn.hf import paged

    store = SlotStore(slots=400)
    monkeypatch.setattr(paged, "paged_cache_update", lambda cache, *a: store.update(*a))
    model = tiny_diffattn(attention, seed=2)
    generator = torch.Generator().manual_seed(0)
    lengths = [1, 7, 129, 7]
    sequences = [torch.randint(0, 128, (n,), generator=generator).tolist() for n in lengths]
    order = torch.randperm(399, generator=generator) + 1  # slot 0 is the trash slot
    slots = [order[sum(lengths[:i]) : sum(lengths[: i + 1])].tolist() for i in range(4)]
    steps = [  # (start, stop) per request and step
        [(0, 1), (0, 4), (0, 64), (0, 4)],
        [(1, 1), (4, 5), (64, 65), (4, 5)],  # decode of keys 5, 65, 5; request 0 is padding
        [(1, 1), (5, 7), (65, 129), (5, 7)],
    ]
    logits = {i: [] for i in range(4)}
    with torch.no_grad():
        for step, spans in enumerate(steps):
            ids, positions, arguments = packed_step(sequences, slots, spans, padding=step)
            out = paged.paged_forward(model, ids, positions, store, arguments)
            assert out.shape == (1, ids.shape[1], 128)
            starts = arguments.cu_seq_lens_q.tolist()
            for i, (start, stop) in enumerate(spans):
                logits[i].append(out[0, starts[i] : starts[i] + stop - start])
            if step:
                assert not out[0, starts[-1] :].any()  # padding tokens: zero rows
        for i, sequence in enumerate(sequences):
            full = model(torch.tensor([sequence])).logits[0]
            torch.testing.assert_close(torch.cat(logits[i]), full, rtol=0, atol=1e-5)
