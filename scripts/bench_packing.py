"""Packed rows with document masking against padded batches: training tokens per second.

A seeded mix of documents (lengths log-uniform between ``--min-len`` and ``--max-len``) is run
through forward and backward twice per round and type: padded (``--batch`` documents per batch,
each padded to the batch's longest, a 2-D mask) and packed (documents placed in order into rows
of ``--row-len`` tokens, a row closed when the next document does not fit, ``--batch`` rows per
batch, ``document_ids``). Both see the same documents and count only their real tokens; the
order of the two alternates between rounds. Printed: real tokens per second of each and the
ratio packed / padded per round (median, min and max over rounds).

    PYTHONPATH=src python scripts/bench_packing.py --rounds 5
"""

from __future__ import annotations

import argparse
import math
import shlex
import statistics
import sys
import time

import torch

TYPES = ("baseline", "diff_v1", "diff_v2")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=96, help="documents (default: 96)")
    parser.add_argument("--min-len", type=int, default=16, help="default: 16")
    parser.add_argument("--max-len", type=int, default=512, help="default: 512")
    parser.add_argument("--row-len", type=int, default=512, help="packed row length; default 512")
    parser.add_argument("--batch", type=int, default=4, help="documents or rows per batch")
    parser.add_argument("--rounds", type=int, default=3, help="default: 3")
    parser.add_argument("--d-model", type=int, default=256, help="default: 256")
    parser.add_argument("--layers", type=int, default=4, help="default: 4")
    parser.add_argument("--heads", type=int, default=8, help="default: 8")
    parser.add_argument("--backend", default="auto", help="attention backend (default: auto)")
    args = parser.parse_args(argv)
    if not 1 <= args.min_len <= args.max_len <= args.row_len:
        parser.error("need 1 <= --min-len <= --max-len <= --row-len")
    return args


def document_lengths(args) -> list[int]:
    generator = torch.Generator().manual_seed(0)
    low, high = math.log(args.min_len), math.log(args.max_len)
    draws = torch.rand(args.docs, generator=generator) * (high - low) + low
    return [round(math.exp(x)) for x in draws.tolist()]


def padded_batches(docs: list[torch.Tensor], batch: int):
    for start in range(0, len(docs), batch):
        group = docs[start : start + batch]
        n = max(len(d) for d in group)
        ids = torch.zeros(len(group), n, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, doc in enumerate(group):
            ids[row, : len(doc)], mask[row, : len(doc)] = doc, 1
        yield {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def packed_rows(docs: list[torch.Tensor], row_len: int) -> list[list[torch.Tensor]]:
    rows, current, used = [], [], 0
    for doc in docs:
        if used + len(doc) > row_len and current:
            rows.append(current)
            current, used = [], 0
        current.append(doc)
        used += len(doc)
    return [*rows, current] if current else rows


def packed_batches(docs: list[torch.Tensor], row_len: int, batch: int):
    rows = packed_rows(docs, row_len)
    for start in range(0, len(rows), batch):
        group = rows[start : start + batch]
        n = max(sum(len(d) for d in row) for row in group)
        ids = torch.zeros(len(group), n, dtype=torch.long)
        mask = torch.zeros_like(ids)
        documents = torch.full_like(ids, -1)
        for r, row in enumerate(group):
            at = 0
            for index, doc in enumerate(row):
                ids[r, at : at + len(doc)], documents[r, at : at + len(doc)] = doc, index
                at += len(doc)
            mask[r, :at] = 1
            documents[r, at:] = len(row)  # right padding: a document of its own
        labels = ids.masked_fill(mask == 0, -100)
        yield {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": labels,
            "document_ids": documents,
        }


def run(model, batches) -> float:
    """Seconds for forward and backward over ``batches``."""
    start = time.perf_counter()
    for batch in batches:
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
    return time.perf_counter() - start


def main(argv=None) -> int:
    from diffattn import DiffTransformerLM, ModelConfig

    args = parse_args(argv)
    lengths = document_lengths(args)
    generator = torch.Generator().manual_seed(1)
    docs = [torch.randint(1, 4096, (n,), generator=generator) for n in lengths]
    real = sum(lengths)
    padded = list(padded_batches(docs, args.batch))
    packed = list(packed_batches(docs, args.row_len, args.batch))
    padded_slots = sum(b["input_ids"].numel() for b in padded)
    packed_slots = sum(b["input_ids"].numel() for b in packed)
    models = {}
    for attention in TYPES:
        torch.manual_seed(0)
        config = ModelConfig(
            vocab_size=4096,
            d_model=args.d_model,
            n_layers=args.layers,
            n_heads=args.heads,
            max_seq_len=args.row_len,
            attention=attention,
            backend=args.backend,
        )
        models[attention] = DiffTransformerLM(config).train()
        run(models[attention], padded[:1])  # first-use costs (kernel builds) stay untimed
        run(models[attention], packed[:1])
    speeds = {(a, kind): [] for a in TYPES for kind in ("padded", "packed")}
    ratios = {a: [] for a in TYPES}
    for round_index in range(args.rounds):
        for attention in TYPES:
            order = ("padded", "packed") if round_index % 2 == 0 else ("packed", "padded")
            seconds = {}
            for kind in order:
                seconds[kind] = run(models[attention], padded if kind == "padded" else packed)
                speeds[(attention, kind)].append(real / seconds[kind])
            ratios[attention].append(seconds["padded"] / seconds["packed"])
    given = shlex.join(argv or sys.argv[1:])
    print(f"command: PYTHONPATH=src python scripts/bench_packing.py {given}")
    print(
        f"{args.docs} documents of {args.min_len}-{args.max_len} tokens (mean "
        f"{real / args.docs:.0f}), {real} tokens; padded: {len(padded)} batches, "
        f"{padded_slots} positions; packed: {len(packed)} batches of rows of {args.row_len}, "
        f"{packed_slots} positions; d_model {args.d_model}, {args.layers} layers, {args.heads} "
        f"heads, backend {args.backend}; fwd+bwd, fp32; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; {args.rounds} rounds"
    )
    print()
    print("| type | padded tokens/s | packed tokens/s | packed / padded (median, min–max) |")
    print("|---|---|---|---|")
    for attention in TYPES:
        pad = statistics.median(speeds[(attention, "padded")])
        pack = statistics.median(speeds[(attention, "packed")])
        r = ratios[attention]
        print(
            f"| {attention} | {pad:.0f} | {pack:.0f} | {statistics.median(r):.2f} "
            f"({min(r):.2f}–{max(r):.2f}) |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
