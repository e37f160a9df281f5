"""Run under torchrun (gloo, CPU): context parallelism against one process.

Every rank builds the same model (same seed; λ and norm weights moved off their init so their
gradients are exercised), runs the whole batch alone (the one-process reference), then its own
load-balanced chunks under :func:`diffattn.train.context_parallel.context_parallel_forward`, sums
the gradients over the ranks and compares: the loss, the logits gathered back, and every
parameter's gradient, as relative errors (largest |difference| over the reference's largest
|value|, per tensor). Prints one JSON line per case on rank 0.

Usage: ``cp_worker.py DTYPE BACKEND[+ckpt|+compile] CASES`` with CASES a comma-separated list of
``TYPE:KV:DOCS`` (``KV`` = ``gqa`` or ``mha``; ``DOCS`` = ``packed``, ``plain`` or ``padded``)
and ``refusals`` (the one-line errors); ``+ckpt`` checkpoints every block's activations,
``+compile`` compiles every block (``compile_blocks``, inductor).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from diffattn import DiffTransformerLM, ModelConfig
from diffattn.attention.context_parallel import context_parallel
from diffattn.model import document_runs, labels_within_documents
from diffattn.train.context_parallel import (
    context_parallel_forward,
    gather_logits,
    reduce_context_parallel_gradients,
)

SEQ_LEN = 24  # 2·C chunks of 6 (C = 2) or 3 (C = 4) tokens
BATCH = 2


def config_for(attention: str, kv: str) -> ModelConfig:
    heads, kv_heads = {"gqa": (8, 4), "mha": (4, 4)}[kv]
    if attention == "diff_v2":
        heads, kv_heads = {"gqa": (4, 2), "mha": (2, 2)}[kv]
    options = {"gda": {"ratio": 3}} if attention == "gda" else {}
    if attention == "gda":
        heads, kv_heads = 8, 2
    return ModelConfig(
        attention=attention,
        attention_options=options,
        vocab_size=61,
        d_model=32,
        n_layers=2,
        n_heads=heads,
        n_kv_heads=kv_heads,
        head_dim=8,
        ffn_hidden=40,
        max_seq_len=64,
    )


def batch(docs: str) -> dict[str, torch.Tensor]:
    """Token ids and labels (a few ignored), with packed documents whose boundaries fall inside
    and across chunks, or left and right padding."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 61, (BATCH, SEQ_LEN), generator=generator)
    labels = ids.clone()
    labels[0, 7] = -100
    inputs = {"input_ids": ids, "labels": labels}
    if docs == "packed":
        inputs["document_ids"] = torch.tensor(
            [[0] * 5 + [1] * 9 + [2] * 2 + [3] * 8, [4] * 13 + [7] * 11]
        )
    elif docs == "padded":
        mask = torch.ones_like(ids)
        mask[0, :5] = 0  # left padding
        mask[1, 19:] = 0  # right padding
        inputs["attention_mask"] = mask
        inputs["labels"] = labels.masked_fill(mask == 0, -100)
    return inputs


def whole_row_loss(logits: torch.Tensor, inputs: dict) -> torch.Tensor:
    """The model's loss (targets shifted, none crossing a document) in the logits' own dtype:
    the model computes it in fp32, which would hide float64's agreement."""
    labels = inputs["labels"]
    if "document_ids" in inputs:
        labels = labels_within_documents(labels, document_runs(inputs["document_ids"]))
    targets = F.pad(labels[:, 1:], (0, 1), value=-100)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def computed_in_fp32(name: str) -> bool:
    """Parameters the model computes with in fp32 whatever its dtype (RMSNorm's weights, DIFF
    V1 Eq.2's λ vectors): their gradients sum over tokens in fp32, so in float64 they agree
    to fp32's rounding, not float64's."""
    return name.endswith("norm.weight") or ".lambda_q" in name or ".lambda_k" in name


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().item()
    return (got - want).abs().max().item() / (scale if scale > 0 else 1.0)


def build(attention: str, kv: str, dtype: torch.dtype, backend: str) -> DiffTransformerLM:
    torch.manual_seed(0)
    model = DiffTransformerLM(config_for(attention, kv).replace(backend=backend))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lambda" in name or "norm" in name or "gate" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.to(dtype)  # the same weights in every dtype


def one_process(case: str, dtype: torch.dtype, backend: str, inputs: dict):
    """The whole batch in one process: ``(loss, logits, {parameter: gradient})``."""
    attention, kv, _ = case.split(":")
    model = build(attention, kv, dtype, backend)
    out = model(**inputs)
    loss = whole_row_loss(out.logits, inputs)
    loss.backward()
    return loss.detach(), out.logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def split_run(case: str, dtype: torch.dtype, backend: str, variant: str, inputs: dict):
    """This rank's chunks under context parallelism, gradients summed over the ranks, logits
    gathered: ``(loss, logits, {parameter: gradient or None})``."""
    attention, kv, _ = case.split(":")
    model = build(attention, kv, dtype, backend)
    model.gradient_checkpointing = variant == "ckpt"
    if variant == "compile":
        model.compile_blocks()  # inductor, as the trainer's compile: true
    model.train()
    out = context_parallel_forward(
        model,
        inputs["input_ids"],
        dist.group.WORLD,
        labels=inputs["labels"],
        document_ids=inputs.get("document_ids"),
        attention_mask=inputs.get("attention_mask"),
    )
    with context_parallel(out.split):  # recomputed (checkpointed) layers gather again
        out.loss.backward()
    reduce_context_parallel_gradients(model, dist.group.WORLD)
    logits = gather_logits(out.logits, out.layout, dist.group.WORLD)
    return out.loss.detach(), logits, {n: p.grad for n, p in model.named_parameters()}


SUMMED_OVER_TOKENS = (".lambda_q", ".lambda_k", ".gate_proj.")
"""Parameters whose gradient is one sum over every token (and head) of terms that nearly
cancel: DIFF V1 Eq.2's λ vectors (all scale dL/dλ) and the gate's projection. In fp32 their
rounding depends on the order of that sum, which the split changes."""


def grad_verdict(split: dict, one: dict, truth: dict, dtype: torch.dtype) -> dict:
    """Each gradient against one process. float64: within 1e-12 (1e-5 for the parameters the
    model computes with in fp32 whatever its dtype). float32: within 1e-5; one of
    :data:`SUMMED_OVER_TOKENS` may instead be held to the float64 result: within 1e-4, or
    four times the error of one process in fp32 if that is larger (both are fp32 sums, in
    another order)."""
    diffs, failures, ill_conditioned = {}, [], []
    for name, want in one.items():
        got = split[name]
        if got is None:
            failures.append(f"{name}: no gradient")
            continue
        diffs[name] = relative(got, want)
        if dtype == torch.float64:
            bound = 1e-5 if computed_in_fp32(name) else 1e-12
            if diffs[name] > bound:
                failures.append(f"{name}: {diffs[name]:.3e}")
            continue
        if diffs[name] <= 1e-5:
            continue
        if not any(part in name for part in SUMMED_OVER_TOKENS):
            failures.append(f"{name}: {diffs[name]:.3e}")
            continue
        ill_conditioned.append(name)
        floor = relative(want.double(), truth[name])
        error = relative(got.double(), truth[name])
        if error > max(1e-4, 4 * floor):
            failures.append(f"{name}: {error:.3e} from float64 (one process: {floor:.3e})")
    exact = [d for name, d in diffs.items() if not computed_in_fp32(name)]
    return {
        "grad_diff": max(exact),
        "fp32_grad_diff": max((d for n, d in diffs.items() if computed_in_fp32(n)), default=0.0),
        "grad_failures": failures,
        "ill_conditioned": ill_conditioned,
    }


def compare(case: str, dtype: torch.dtype, backend: str, variant: str) -> dict:
    inputs = batch(case.split(":")[2])
    ref_loss, ref_logits, ref_grads = one_process(case, dtype, backend, inputs)
    truth = ref_grads
    if dtype != torch.float64:
        truth = one_process(case, torch.float64, "sdpa", inputs)[2]
    loss, logits, grads = split_run(case, dtype, backend, variant, inputs)
    return {
        "case": case,
        "dtype": str(dtype).removeprefix("torch."),
        "backend": backend,
        "variant": variant,
        "world": dist.get_world_size(),
        "loss_diff": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
        "logit_diff": relative(logits, ref_logits),
        **grad_verdict(grads, ref_grads, truth, dtype),
    }


def refusals() -> list[dict]:
    """The one-line errors: a length that does not cut into 2·C chunks, DINT, a 4-D mask."""
    rows = []
    model = build("baseline", "gqa", torch.float32, "reference")
    ids = torch.zeros(1, 2 * dist.get_world_size() + 2, dtype=torch.long)
    for name, run in (
        ("length", lambda: context_parallel_forward(model, ids, dist.group.WORLD)),
        (
            "dint",
            lambda: context_parallel_forward(
                build("dint", "gqa", torch.float32, "reference"),
                torch.zeros(1, SEQ_LEN, dtype=torch.long),
                dist.group.WORLD,
            ),
        ),
        (
            "mask",
            lambda: context_parallel_forward(
                model,
                torch.zeros(1, SEQ_LEN, dtype=torch.long),
                dist.group.WORLD,
                attention_mask=torch.ones(1, 1, SEQ_LEN, SEQ_LEN),
            ),
        ),
    ):
        try:
            run()
            rows.append({"refusal": name, "error": None})
        except ValueError as error:
            rows.append({"refusal": name, "error": str(error)})
    return rows


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    dtype = {"float32": torch.float32, "float64": torch.float64}[sys.argv[1]]
    backend, _, variant = sys.argv[2].partition("+")
    rows = []
    for case in sys.argv[3].split(","):
        if case == "refusals":
            rows.extend(refusals())
        else:
            rows.append(compare(case, dtype, backend, variant))
    if dist.get_rank() == 0:
        for row in rows:
            print(json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
