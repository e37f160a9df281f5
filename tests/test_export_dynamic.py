"""The static-cache decode step exports with dynamic shapes (transformers' ``DynamoExporter``)
for the three types on ``sdpa``: no Python bool is taken of a symbolic shape."""

from __future__ import annotations

import pytest
import torch

from extras import require_extra

pytestmark = require_extra("hf")

from transformers import GenerationConfig

from diffattn.attention.backends.sdpa import heads_differ
from diffattn.hf import DiffAttnConfig, DiffAttnForCausalLM
from helpers import ATTENTIONS, tiny_config

try:
    from transformers import exporters
except ImportError:  # transformers before 5.24 has no exporters package
    exporters = None
needs_exporters = pytest.mark.skipif(exporters is None, reason="transformers.exporters: >= 5.24")


@needs_exporters
@pytest.mark.parametrize("n_kv_heads", [2, 4], ids=["gqa", "mha"])
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_static_cache_generation_exports_with_dynamic_shapes(attention, n_kv_heads):
    torch.manual_seed(0)
    config = DiffAttnConfig.from_model_config(tiny_config(attention, n_kv_heads=n_kv_heads))
    model = DiffAttnForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, 128, (2, 7))
    exported = exporters.DynamoExporter().export_for_generation(
        model,
        {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
        exporters.DynamoConfig(dynamic=True),
        generation_config=GenerationConfig(cache_implementation="static"),
    )
    assert set(exported.components) == {"prefill", "decode"}


def test_heads_differ_is_a_bool_for_symbolic_head_counts():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    heads = env.create_unbacked_symint()
    assert heads_differ(4, 2) is True and heads_differ(4, 4) is False
    assert heads_differ(4, heads) is True  # unknown: grouping is exact for equal counts too
