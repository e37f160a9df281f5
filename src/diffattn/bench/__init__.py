"""Throughput and memory harness: ``diffattn bench`` and the FLOP bound it reports.

* :mod:`diffattn.bench.throughput`: times baseline, DIFF V1 and DIFF V2 (and HF Llama /
  DiffLlama) interleaved in one run and measures each step's peak tensor memory.
FLOPs per token and the best throughput ratio they allow are :mod:`diffattn.flops` (a core
module: the trainer reports MFU with it), device peaks :mod:`diffattn.hardware`.
"""

from diffattn.bench import throughput

__all__ = ["throughput"]
