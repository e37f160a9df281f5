"""``diffattn generate MODEL_DIR --prompt TEXT``: stream a continuation to stdout.

The model directory is read with :func:`diffattn.checkpoint.load_model`; the tokenizer is the
one saved beside it the Hugging Face way (``tokenizer.json``, plus ``tokenizer_config.json``
when present), or the one in ``--tokenizer DIR``, loaded by
:func:`diffattn.loading.load_saved_tokenizer` (with ``transformers`` when it is installed and
with ``tokenizers`` otherwise). The EOS id comes from
``generation_config.json``, else the tokenizer, else ``config.json``. Text is printed as
tokens arrive: the whole sequence is decoded after every token and only the new suffix is
written (and flushed), holding back a trailing U+FFFD while a multi-byte character is still
split across tokens. What ends up on stdout is therefore the decoded final sequence (the
prompt as the tokenizer decodes it, unless ``--no-echo``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffattn.loading import TextTokenizer
from diffattn.settings import Settings, setting

DESCRIPTION = (
    "Generate text with a diffattn model directory and the tokenizer saved beside it, "
    "streaming tokens to stdout as they are produced."
)

DTYPES = ("float32", "bfloat16")
GENERATION_CONFIG_FILE = "generation_config.json"


def _cache_kinds() -> Sequence[str]:
    from diffattn.generation import CACHE_KINDS

    return CACHE_KINDS


def _compile_modes() -> Sequence[str]:
    from diffattn.model import COMPILE_MODES

    return [mode for mode in COMPILE_MODES if mode is not None]


def _backends() -> Sequence[str]:
    from diffattn.config import BACKENDS

    return BACKENDS


COMPILING = "compile"
"""The group of ``--compile`` and ``--auto-compile`` (at most one of them)."""


@dataclass(frozen=True, kw_only=True)
class GenerateSettings(Settings):
    """The settings of ``diffattn generate`` (and of :func:`generate_text`)."""

    model_dir: str = setting(
        positional=True,
        flag="model_dir",
        metavar="MODEL_DIR",
        help="diffattn model directory, a diffattn train run (its final checkpoint, else its "
        "newest) or RUN@STEP, or any other model directory diffattn loads (Hugging Face "
        "Llama/Qwen2/Mistral, a Dex merge or adapter run), generated with transformers' generate",
    )
    prompt: str = setting(required=True, help="text to continue")
    tokenizer: str | None = setting(
        None,
        metavar="DIR",
        help="directory holding the tokenizer files (tokenizer.json and/or "
        "tokenizer_config.json), such as the tokenizer/ of a training run or of a prepared "
        "data directory (default: MODEL_DIR)",
    )
    max_new_tokens: int = setting(64, help="default: {default}")
    temperature: float = setting(1.0, help="0 means greedy (default: {default})")
    top_k: int | None = setting(None, help="keep the K most probable tokens")
    top_p: float | None = setting(None, help="nucleus sampling: keep probability mass P")
    seed: int | None = setting(None, help="seed of the sampling RNG")
    device: str = setting(
        "auto", help="torch device, or auto (default: CUDA when available, else the CPU)"
    )
    dtype: str = setting("float32", choices=DTYPES, help="default: {default}")
    cache: str = setting("dynamic", choices=_cache_kinds, help="KV cache kind (default: {default})")
    compile: str | bool = setting(  # False, True or "auto" (an option given a default: not bool)
        False,
        action="store_const",
        const=True,
        group=COMPILING,
        help="compile the decode step with torch.compile (uses the static cache)",
    )
    auto_compile: bool = setting(
        False,
        dest="compile",
        action="store_const",
        const="auto",
        group=COMPILING,
        parse=lambda compile: compile == "auto",
        command_only=True,
        help="compile the decode step on CUDA only (static cache, CUDA graphs); decode "
        "eagerly elsewhere",
    )
    """``--auto-compile``: the option that sets ``compile`` to ``"auto"``."""
    compile_mode: str | None = setting(
        None,
        choices=_compile_modes,
        help="torch.compile mode of the decode step (default: reduce-overhead, i.e. CUDA "
        "graphs, on CUDA; the plain compile elsewhere)",
    )
    backend: str | None = setting(
        None,
        choices=_backends,
        help="attention backend (default: the one in config.json); 'reference' gives "
        "--compile a single graph",
    )
    no_echo: bool = setting(False, help="print only the continuation, not the prompt")

    @classmethod
    def add_arguments(cls, parser: Any) -> None:
        """The options, ``--compile`` and ``--auto-compile`` in a group that may also be left
        out (:meth:`Settings.add_arguments` makes a ``group`` required)."""
        super().add_arguments(_OptionalGroups(parser))


class _OptionalGroups:
    """``parser``, whose mutually exclusive groups are optional: at most one of their
    options, none being fine."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser

    def add_argument(self, *names: str, **options: Any) -> argparse.Action:
        return self.parser.add_argument(*names, **options)

    def add_mutually_exclusive_group(self, required: bool = False) -> Any:
        return self.parser.add_mutually_exclusive_group()

    def set_defaults(self, **defaults: Any) -> None:
        self.parser.set_defaults(**defaults)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``generate`` verb's arguments to ``parser``."""
    parser.description = parser.description or DESCRIPTION
    GenerateSettings.add_arguments(parser)


# ----------------------------------------------------------------------------------------
# tokenizers
def text_tokenizer(model_dir: str | Path, tokenizer_dir: str | Path | None) -> TextTokenizer:
    """The tokenizer saved in ``tokenizer_dir`` (``None``: in ``model_dir``), read by
    :func:`diffattn.loading.load_saved_tokenizer`. A missing or broken one is a one-line
    :class:`~diffattn.fileio.CheckpointError` naming the files looked for and how to add them."""
    from diffattn.fileio import CheckpointError
    from diffattn.loading import (
        TOKENIZER_CONFIG_FILE,
        TOKENIZER_FILE,
        has_tokenizer,
        load_saved_tokenizer,
    )

    files = f"{TOKENIZER_FILE} and {TOKENIZER_CONFIG_FILE}"
    if tokenizer_dir is not None:
        if not has_tokenizer(tokenizer_dir):
            raise CheckpointError(f"--tokenizer {tokenizer_dir}: no tokenizer (looked for {files})")
        return TextTokenizer(load_saved_tokenizer(tokenizer_dir))
    if not has_tokenizer(model_dir):
        raise CheckpointError(
            f"{model_dir}: no tokenizer (looked for {files}); copy the tokenizer files the "
            "model was trained with into it (a training run or a prepared data directory "
            "keeps them in its tokenizer/), or pass --tokenizer DIR"
        )
    return TextTokenizer(load_saved_tokenizer(model_dir))


def eos_token_ids(model_dir: str | Path, tokenizer: TextTokenizer) -> int | list[int] | None:
    """EOS id(s): ``generation_config.json``, else the tokenizer, else ``config.json``."""
    from diffattn.fileio import read_json

    model_dir = Path(model_dir)
    generation_config = model_dir / GENERATION_CONFIG_FILE
    if generation_config.is_file():
        eos = read_json(generation_config).get("eos_token_id")
        if eos is not None:
            return eos
    if tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    config = model_dir / "config.json"
    return read_json(config).get("eos_token_id") if config.is_file() else None


# ----------------------------------------------------------------------------------------
# streaming
class TextStreamer:
    """Streams decoded text: ``put(tokens)`` with each new token column (batch of one).

    The text of everything so far is decoded after each token and only the part beyond what
    was already written is passed to ``write``. A trailing U+FFFD is held back, since it
    usually marks a multi-byte character whose remaining bytes are in the next tokens;
    :meth:`end` writes whatever is left. Concatenating the writes gives the decoded sequence.
    """

    def __init__(
        self,
        tokenizer: TextTokenizer,
        prompt_ids: Sequence[int] = (),
        write: Callable[[str], Any] | None = None,
        echo: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids)
        self._write = write
        self.text = ""  # everything written (or skipped, for the prompt without echo)
        prompt_text = tokenizer.decode(self.ids) if self.ids else ""
        if echo:
            self._emit(prompt_text.rstrip("\ufffd"))
        else:
            self.text = prompt_text.rstrip("\ufffd")

    def _emit(self, piece: str) -> None:
        if not piece:
            return
        self.text += piece
        if self._write is not None:
            self._write(piece)
        else:
            sys.stdout.write(piece)
            sys.stdout.flush()

    def _flush(self, final: bool) -> None:
        text = self.tokenizer.decode(self.ids)
        if not final:
            text = text.rstrip("\ufffd")
        if len(text) > len(self.text):
            self._emit(text[len(self.text) :])

    def put(self, tokens: Any) -> None:
        """Add one token (a ``(1,)`` tensor, an int or a list with one id) and write."""
        if hasattr(tokens, "tolist"):
            tokens = tokens.tolist()
        self.ids.extend(tokens if isinstance(tokens, list) else [tokens])
        self._flush(final=False)

    def end(self) -> None:
        """Write what is left, including a trailing U+FFFD that no token completed."""
        self._flush(final=True)


# ----------------------------------------------------------------------------------------
def _parse_device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ValueError(f"--device: unknown device {name!r} ({error})") from error
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine")
    return device


def run(args: argparse.Namespace) -> int:
    """The command: :func:`generate_text` with the settings of the parsed command line."""
    return generate_text(GenerateSettings.from_args(args))


def generate_text(settings: GenerateSettings) -> int:
    """Load the model and tokenizer, then stream the continuation. Returns the exit status."""
    import torch

    from diffattn.checkpoint import CheckpointError, load_model
    from diffattn.generation import GenerationConfig, generate
    from diffattn.loading import training_run_checkpoint

    # a training run (its final, else newest checkpoint) or RUN@STEP: that checkpoint
    model_dir = training_run_checkpoint(settings.model_dir) or Path(settings.model_dir)
    if not model_dir.exists():
        raise CheckpointError(f"{model_dir}: model directory not found")
    device = _parse_device(settings.device)
    cache = "static" if settings.compile is True else settings.cache
    config = GenerationConfig(
        max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature,
        top_k=settings.top_k,
        top_p=settings.top_p,
        seed=settings.seed,
        cache=cache,
        compile=settings.compile,
        compile_mode=settings.compile_mode,
    )  # validates the sampling options before anything is loaded
    from diffattn.loading import resolve_source

    source = resolve_source(model_dir)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[settings.dtype]
    if source.kind != "diffattn":
        return generate_with_transformers(settings, source, device, dtype, config)
    tokenizer = text_tokenizer(model_dir, settings.tokenizer)
    config = config.replace(eos_token_id=eos_token_ids(model_dir, tokenizer))
    overrides = {"backend": settings.backend} if settings.backend else {}
    model = load_model(model_dir, device=device, dtype=dtype, **overrides)
    prompt_ids = tokenizer.encode(settings.prompt, special=True)  # with BOS where it adds one
    if not prompt_ids:
        raise ValueError("--prompt encodes to no tokens; give a non-empty prompt")
    streamer = TextStreamer(tokenizer, prompt_ids, echo=not settings.no_echo)
    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    generate(model, input_ids, config=config, streamer=streamer)
    sys.stdout.write("\n")
    sys.stdout.flush()
    return 0


class _AfterThePrompt:
    """transformers' streamer protocol over :class:`TextStreamer`: ``generate`` first puts the
    prompt (already shown), then each new token."""

    def __init__(self, streamer: TextStreamer) -> None:
        self.streamer = streamer
        self.prompt_seen = False

    def put(self, tokens: Any) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.streamer.put(tokens.reshape(-1)[-1:])

    def end(self) -> None:
        self.streamer.end()


def generate_with_transformers(
    settings: GenerateSettings, source: Any, device, dtype, config
) -> int:
    """A model diffattn loads that is not a diffattn directory (a Hugging Face Llama, Qwen2 or
    Mistral, a Dex merge or adapter, a directory holding a GGUF file): transformers'
    ``generate`` with this command's sampling settings only (not the model's
    ``generation_config.json``, whose EOS is read as for diffattn models), streamed the same
    way. diffattn's decoding options (``--backend``, ``--compile``, ``--auto-compile``,
    ``--compile-mode``, ``--cache static``) do not apply and are refused by name."""
    import torch

    from diffattn.loading import load_model

    given = {
        "--backend": settings.backend is not None,
        "--compile/--auto-compile": bool(settings.compile),
        "--compile-mode": settings.compile_mode is not None,
        "--cache static": settings.cache == "static",
    }
    refused = [name for name, on in given.items() if on]
    if refused:
        raise ValueError(
            f"{', '.join(refused)}: diffattn decoding options; {source.spec} is a "
            f"{source.kind} model, generated with transformers' generate"
        )
    directory = source.model_dir
    tokenizer = text_tokenizer(directory, settings.tokenizer)
    eos = eos_token_ids(directory, tokenizer)
    model = load_model(source, device=device, dtype=dtype)
    prompt_ids = tokenizer.encode(settings.prompt, special=True)
    if not prompt_ids:
        raise ValueError("--prompt encodes to no tokens; give a non-empty prompt")
    streamer = TextStreamer(tokenizer, prompt_ids, echo=not settings.no_echo)
    if config.seed is not None:
        torch.manual_seed(config.seed)
    sampling = {} if config.greedy else {
        "temperature": config.temperature, "top_k": config.top_k or 0, "top_p": config.top_p or 1.0
    }  # fmt: skip
    first_eos = eos[0] if isinstance(eos, list) and eos else eos
    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    # Only this command's settings: the model's generation_config.json (repetition penalties,
    # n-gram bans, ...) would otherwise be merged into the call (its EOS is read above).
    from transformers import GenerationConfig as HFGenerationConfig

    model.generation_config = HFGenerationConfig()
    with torch.no_grad():
        model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=config.max_new_tokens,
            do_sample=not config.greedy,
            eos_token_id=eos,
            pad_token_id=first_eos if first_eos is not None else 0,
            streamer=_AfterThePrompt(streamer),
            **sampling,
        )
    sys.stdout.write("\n")
    sys.stdout.flush()
    return 0
