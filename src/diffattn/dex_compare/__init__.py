"""The Dex comparison experiment (``diffattn dex compare``): Dex against LoRA and full
fine-tuning from the same pretrained model, on the same data, order and step budget (the Dex
paper's Tab. 1 at small scale), with the held-out loss of each method and, optionally, the
zero-shot benchmarks of ``diffattn eval`` on every trained model.

* :mod:`diffattn.dex_compare.methods`: training each method and writing the report
  (:func:`compare_methods`, :func:`load_recipe` for ``configs/dex/*.yaml``).
* :mod:`diffattn.dex_compare.benchmarks`: the benchmarks run on each compared model
  (:class:`BenchmarkSettings`).

An experiment built on the Dex library (:mod:`diffattn.dex`), the trainer and the evaluation
suite; the library itself imports none of it.
"""

from diffattn.dex_compare.benchmarks import BenchmarkSettings
from diffattn.dex_compare.methods import compare_methods, load_recipe

__all__ = ["BenchmarkSettings", "compare_methods", "load_recipe"]
