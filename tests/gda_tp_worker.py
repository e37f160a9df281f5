"""Run under torchrun (gloo, CPU): ``tp_worker.py``'s comparison of tensor parallelism with one
process (loss, logits, every gathered gradient, a prefill and two decode steps through a KV
cache) for GDA layers, ratio 3 with two noise heads per KV group and one group per rank."""

from __future__ import annotations

import os
import sys

import tp_worker
from diffattn import ModelConfig


def gda_config(attention: str, world: int) -> ModelConfig:
    return ModelConfig(
        attention=attention,
        attention_options={"gda": {"ratio": 3}},
        vocab_size=64 * world,
        d_model=32,
        n_layers=2,
        n_heads=8 * world,  # 2·world noise heads, 6·world signal heads
        n_kv_heads=2 * world,  # world KV groups: one a rank
        head_dim=8,
        ffn_hidden=24 * world,
        max_seq_len=64,
    )


if __name__ == "__main__":
    tp_worker.config_for = gda_config
    tp_worker.main()
    sys.stdout.flush()
    os._exit(0)  # as tp_worker: leave without gloo's teardown
