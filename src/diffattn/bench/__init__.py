"""Throughput and memory harness: ``diffattn bench`` and the FLOP bound it reports.

* :mod:`diffattn.bench.throughput`: times baseline, DIFF V1 and DIFF V2 (and HF Llama /
  DiffLlama) interleaved in one run and measures each step's peak tensor memory.
* :mod:`diffattn.bench.flops`: FLOPs per token from a config's projection shapes and the
  best throughput ratio they allow.
"""

from diffattn.bench import flops, throughput

__all__ = ["flops", "throughput"]
