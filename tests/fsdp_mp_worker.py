"""``torchrun --nproc-per-node 2 tests/fsdp_mp_worker.py REPORT.json``: the dtypes FSDP2 uses
with and without diffattn's mixed-precision policy (``parallel.build_model(mixed_precision=)``):
a Linear's weight as its forward sees it, the sharded master weight, its gradient, and AdamW's
state after one step. A test helper (CPU, gloo), not part of the library."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from diffattn.config import ModelConfig
from diffattn.train.parallel import build_model, decoder_blocks


def dtypes(mixed_precision: torch.dtype | None) -> dict[str, str]:
    config = ModelConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, max_seq_len=32)
    model = build_model(
        config, mode="fsdp", device=torch.device("cpu"), seed=0, mixed_precision=mixed_precision
    )
    seen = {}
    linear = next(m for m in decoder_blocks(model)[0].modules() if isinstance(m, torch.nn.Linear))

    def record(module, _inputs):
        seen.setdefault("compute", str(module.weight.dtype))

    linear.register_forward_pre_hook(record)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    weight = linear.weight
    seen["master"] = str(weight.dtype)
    seen["grad"] = str(weight.grad.dtype)
    seen["optimizer"] = str(optimizer.state[weight]["exp_avg"].dtype)
    return seen


def main(out: str) -> None:
    dist.init_process_group("gloo")
    report = {"with_policy": dtypes(torch.bfloat16), "without_policy": dtypes(None)}
    if dist.get_rank() == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
