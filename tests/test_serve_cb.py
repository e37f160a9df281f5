"""``diffattn serve --continuous-batching``: transformers' paged-attention batching serves the
three types, and every request's greedy answer is the model's own ``generate``, with requests
of different lengths arriving at different times.

DIFF V1 (on ``sdpa``) runs in the default suite; the baseline and DIFF V2 are ``slow``.
"""

from __future__ import annotations

import time
from functools import partial

import pytest

from extras import require_extra
from serve_helpers import (
    Reference,
    ServerProcess,
    prompt_text,
    run_concurrently,
    save_tiny_model,
)

pytestmark = require_extra("hf", "serve")

CONTEXT = 96
REQUESTS = 10
ARRIVAL_GAP_SECONDS = 0.15


def _ask(client, name, index):
    """Request ``index``: its own prompt length, token limit, and streaming or not."""
    prompt, limit = prompt_text(100 + index, 1 + 7 * index), 2 + 3 * index
    stream = index % 2 == 1
    answer = client.completions.create(
        model=name, prompt=prompt, max_tokens=limit, temperature=0, stream=stream
    )
    if stream:
        return "".join(chunk.choices[0].text or "" for chunk in answer if chunk.choices)
    return answer.choices[0].text


@pytest.mark.parametrize(
    ("kind", "backend"),
    [
        ("diff_v1", "sdpa"),
        pytest.param("baseline", None, marks=pytest.mark.slow),
        pytest.param("diff_v1", None, marks=pytest.mark.slow),
        pytest.param("diff_v2", None, marks=pytest.mark.slow),
    ],
)
def test_continuous_batching_answers_equal_generate(kind, backend, tmp_path):
    model_dir = save_tiny_model(kind, tmp_path / kind, CONTEXT, seed=5)
    options = ["--continuous-batching", "--cb-block-size", "16", "--cb-num-blocks", "64"]
    options += ["--cb-max-batch-tokens", "64"]
    if backend:
        options += ["--backend", backend]
    reference = Reference(model_dir, backend=backend)
    expected = [
        reference.completion(prompt_text(100 + i, 1 + 7 * i), 2 + 3 * i) for i in range(REQUESTS)
    ]
    process = ServerProcess(model_dir, *options, log=tmp_path / "log")
    try:
        process.warm_up(str(model_dir))

        def client_job(index):
            time.sleep(index * ARRIVAL_GAP_SECONDS)  # arrivals spread over the decoding
            return _ask(process.client(), str(model_dir), index)

        results = run_concurrently([partial(client_job, i) for i in range(REQUESTS)], 180)
        for index in range(REQUESTS):
            assert results[index] == expected[index], f"request {index}"
        assert "CB: True" in process.output()
    finally:
        assert process.stop() == 0, process.output()
