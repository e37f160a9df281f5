"""Run under torchrun (gloo, CPU): tensor parallelism of the types on DIFF V1's heads (``dint``,
``gated_diff``) against one process.

Every rank builds the whole model with the same seed and a copy sharded over all ranks by
:func:`diffattn.train.tensor_parallel.apply_tensor_parallel`, then compares the loss of a padded
batch, the logits and every gradient (gathered with ``full_tensor``), and, for a type that
decodes from a cache, a prefill and two decode steps. Prints one JSON line per case on rank 0.

Arguments: ``TYPE[:option=value,...]`` cases separated by spaces, then the backend.
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
from diffattn.attention.types import attention_type
from diffattn.cache import DynamicCache
from diffattn.train.tensor_parallel import apply_tensor_parallel


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _cached_logits(model, ids, mask) -> torch.Tensor:
    cache, pieces = DynamicCache(), []
    for start, stop in ((0, 9), (9, 10), (10, 11)):
        out = model(ids[:, start:stop], attention_mask=mask[:, :stop], past_key_values=cache)
        pieces.append(out.logits)
    return torch.cat(pieces, dim=1)


def compare(attention: str, options: dict, backend: str, world: int, mesh) -> dict:
    # two differential heads per KV group, two KV groups per rank
    config = ModelConfig(
        attention=attention,
        attention_options={attention: options} if options else {},
        vocab_size=64 * world,
        d_model=32,
        n_layers=2,
        n_heads=8 * world,
        n_kv_heads=4 * world,
        head_dim=8,
        ffn_hidden=24 * world,
        max_seq_len=64,
        backend=backend,
    )
    torch.manual_seed(0)
    single = DiffTransformerLM(config)
    with torch.no_grad():  # own parameters away from their init
        for p in single.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    sharded = apply_tensor_parallel(copy.deepcopy(single), mesh)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (3, 13), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, 10:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    ref = single(ids, attention_mask=mask, labels=labels)
    got = sharded(ids, attention_mask=mask, labels=labels)
    ref.loss.backward()
    got.loss.backward()
    grads = dict(sharded.named_parameters())
    result = {
        "case": f"{attention}:{options}",
        "loss_diff": abs(ref.loss.item() - got.loss.item()),
        "logit_diff": (ref.logits - got.logits).abs().max().item(),
        "grad_diff": max(
            (p.grad - _full(grads[name].grad)).abs().max().item()
            for name, p in single.named_parameters()
        ),
        "missing_grads": [name for name, p in grads.items() if p.grad is None],
        "sharded": sum(isinstance(p, DTensor) for p in sharded.parameters()),
        "cache_diff": 0.0,
    }
    if attention != "dint":  # DINT refuses to attend from a cache that holds tokens
        with torch.no_grad():
            a, b = _cached_logits(single, ids, mask), _cached_logits(sharded, ids, mask)
        result["cache_diff"] = (a - b).abs().max().item()
    return result


def _case(text: str) -> tuple[str, dict]:
    """``TYPE:option=value,...``, each value read by the option's declared ``parse``."""
    name, _, rest = text.partition(":")
    declared = {option.name: option for option in attention_type(name).options}
    options = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        options[key] = declared[key].parse(value)
    return name, options


def main() -> None:
    *cases, backend = sys.argv[1:]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        world = dist.get_world_size()
        mesh = init_device_mesh("cpu", (world,))
        for text in cases:
            result = compare(*_case(text), backend, world, mesh)
            if dist.get_rank() == 0:
                print(json.dumps(result), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads can abort the interpreter's teardown (see tp_worker.py)
