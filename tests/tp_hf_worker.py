"""Run under torchrun (gloo, CPU): ``from_pretrained(..., tp_plan="auto")`` of a saved
diffattn model against the same model in one process.

Arguments: model directories. For each, prints on rank 0 one JSON line with the largest logit
difference of a padded batch, of a prefill plus one cached decode step, and of a greedy
``generate``, and how many parameters were sharded.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from diffattn.hf import register


def compare(path: str) -> dict:
    single = AutoModelForCausalLM.from_pretrained(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # tp_plan= as an argument
        sharded = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
    vocab = single.config.vocab_size
    ids = torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        a = single(ids, attention_mask=mask).logits
        b = sharded(ids, attention_mask=mask).logits
        full = (a - b).abs().max().item()
        out_a = single(ids[:, :10], attention_mask=mask[:, :10], use_cache=True)
        out_b = sharded(ids[:, :10], attention_mask=mask[:, :10], use_cache=True)
        step_a = single(
            ids[:, 10:], attention_mask=mask, past_key_values=out_a.past_key_values
        ).logits
        step_b = sharded(
            ids[:, 10:], attention_mask=mask, past_key_values=out_b.past_key_values
        ).logits
        cached = (step_a - step_b).abs().max().item()
        gen_a = single.generate(ids[:1], max_new_tokens=4, do_sample=False)
        gen_b = sharded.generate(ids[:1], max_new_tokens=4, do_sample=False)
    return {
        "path": path,
        "logit_diff": full,
        "cache_diff": cached,
        "same_generation": bool(torch.equal(gen_a, gen_b)),
        "sharded": sum(isinstance(p, DTensor) for p in sharded.parameters()),
    }


def main() -> None:
    register()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        for path in sys.argv[1:]:
            result = compare(path)
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
