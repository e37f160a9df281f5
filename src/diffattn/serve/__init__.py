"""``diffattn serve``: an OpenAI-compatible HTTP server for any model diffattn loads.

Built on ``transformers serve`` (its FastAPI app, handlers, streaming and continuous
batching), with the model loaded by :mod:`diffattn.loading` (:mod:`diffattn.serve.hf_serving`
is where the two meet) and request checks in front (:mod:`diffattn.serve.validation`).
Needs the ``serve`` extra: ``pip install 'diffattn[serve]'``. Usage: ``docs/serving.md``.
"""

from __future__ import annotations

from diffattn.serve.options import ServeOptions, ServeSettings, parse_options

__all__ = ["ServeOptions", "ServeSettings", "parse_options"]
