"""Run under torchrun (gloo, CPU): tensor-parallel forward and backward against one process.

Every rank builds the whole model with the same seed (the single-process reference) and a
copy sharded over all ranks by :func:`diffattn.train.tensor_parallel.apply_tensor_parallel`,
then compares, for each attention type and backend: the loss of a padded batch, every
gradient (gathered with ``full_tensor``), and the logits of a prefill plus two decode steps
through a KV cache. Prints one JSON line per case on rank 0 with the largest differences.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from diffattn import DiffTransformerLM, ModelConfig
from diffattn.cache import DynamicCache
from diffattn.train.tensor_parallel import apply_tensor_parallel

BACKENDS = ("reference", "sdpa", "fused")


def config_for(attention: str, world: int) -> ModelConfig:
    # GQA with two query (differential) heads per KV group: baseline and DIFF V1 two groups
    # per rank, DIFF V2 one group (two head pairs) per rank
    heads = {"baseline": 4 * world, "diff_v1": 8 * world, "diff_v2": 2 * world}[attention]
    kv = {"baseline": 2 * world, "diff_v1": 4 * world, "diff_v2": world}[attention]
    return ModelConfig(
        attention=attention,
        vocab_size=64 * world,
        d_model=32,
        n_layers=2,
        n_heads=heads,
        n_kv_heads=kv,
        head_dim=8,
        ffn_hidden=24 * world,
        max_seq_len=64,
    )


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def compare(attention: str, backend: str, mesh) -> dict:
    world = mesh.size()
    config = config_for(attention, world).replace(backend=backend)
    torch.manual_seed(0)
    single = DiffTransformerLM(config)
    with torch.no_grad():  # λ away from its init, so its gradient path is exercised
        for name, p in single.named_parameters():
            if "lambda" in name or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    sharded = apply_tensor_parallel(copy.deepcopy(single), mesh)

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (3, 13), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, 10:] = 0  # right padding
    labels = ids.masked_fill(mask == 0, -100)
    ref = single(ids, attention_mask=mask, labels=labels)
    got = sharded(ids, attention_mask=mask, labels=labels)
    ref.loss.backward()
    got.loss.backward()
    grads = dict(sharded.named_parameters())
    grad_diff = max(
        (p.grad - _full(grads[name].grad)).abs().max().item()
        for name, p in single.named_parameters()
    )
    missing = [name for name, p in sharded.named_parameters() if p.grad is None]

    with torch.no_grad():  # prefill 9 tokens, then two single-token steps
        cache_a, cache_b = DynamicCache(), DynamicCache()
        worst = 0.0
        for start, stop in ((0, 9), (9, 10), (10, 11)):
            part = ids[:, start:stop]
            a = single(part, attention_mask=mask[:, :stop], past_key_values=cache_a).logits
            b = sharded(part, attention_mask=mask[:, :stop], past_key_values=cache_b).logits
            worst = max(worst, (a - b).abs().max().item())
    return {
        "attention": attention,
        "backend": backend,
        "loss_diff": abs(ref.loss.item() - got.loss.item()),
        "logit_diff": (ref.logits - got.logits).abs().max().item(),
        "grad_diff": grad_diff,
        "cache_diff": worst,
        "missing_grads": missing,
        "sharded": sum(isinstance(p, DTensor) for p in sharded.parameters()),
    }


def main() -> None:
    attentions = sys.argv[1].split(",")
    backends = sys.argv[2].split(",") if len(sys.argv) > 2 else BACKENDS
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for attention in attentions:
            for backend in backends:
                result = compare(attention, backend, mesh)
                if dist.get_rank() == 0:
                    print(json.dumps(result), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without the interpreter's teardown: gloo's threads, still joinable while static
    # destructors run, can abort a finished process ("terminate called without an active
    # exception"). The work and the process group are done; a failure above still raises.
    sys.stdout.flush()
    os._exit(0)
