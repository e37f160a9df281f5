"""Shared machinery of the Hugging Face ↔ diffattn converters.

Tensor names (per layer ``i``; HF prefixes ``model.`` to everything but the LM head)::

    diffattn                         Hugging Face Llama / DiffLlama
    embed_tokens.weight              model.embed_tokens.weight
    layers.i.attn_norm.weight        model.layers.i.input_layernorm.weight
    layers.i.attn.{q,k,v,o}_proj     model.layers.i.self_attn.{q,k,v,o}_proj
    layers.i.attn.NAME               model.layers.i.self_attn.NAME  (a type's own: DIFF V1's λ)
    layers.i.ffn_norm.weight         model.layers.i.post_attention_layernorm.weight
    layers.i.ffn.{gate,up,down}_proj model.layers.i.mlp.{gate,up,down}_proj
    norm.weight                      model.norm.weight
    lm_head.weight                   lm_head.weight   (absent when embeddings are tied)

Every tensor keeps its shape across the two layouts; attention weights only have their rows
(or o_proj's columns) permuted by the model-specific converters. Weights are read from
safetensors only, and output directories are written atomically
(:func:`diffattn.fileio.atomic_directory`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diffattn.checkpoint import (
    CONFIG_NAME,
    KEY_PREFIX,
    CheckpointError,
    check_state_dict,
    read_config,
    read_safetensors,
    weight_files,
    write_model_files,
)
from diffattn.config import ModelConfig
from diffattn.fileio import (
    atomic_directory,
    check_output_directory,
    copy_tokenizer_files,
    read_json,
    write_json,
)
from diffattn.model import DiffTransformerLM

TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
"""Special-token ids carried from one ``config.json`` to the other."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_LAYER_KEYS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn.gate_proj.weight": "mlp.gate_proj.weight",
    "ffn.up_proj.weight": "mlp.up_proj.weight",
    "ffn.down_proj.weight": "mlp.down_proj.weight",
}


# ----------------------------------------------------------------------------------------
# small helpers
def require_transformers() -> Any:
    """Import ``transformers`` or raise ``ImportError`` saying how to install it."""
    try:
        import transformers
    except ImportError as error:  # pragma: no cover - transformers is a dev dependency
        raise ImportError(
            "diffattn convert needs the transformers package: pip install 'diffattn[hf]'"
        ) from error
    return transformers


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``None``, a :class:`torch.dtype` or one of ``float32``, ``bfloat16``, ``float16``."""
    if dtype is None or isinstance(dtype, torch.dtype):
        if isinstance(dtype, torch.dtype) and dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; choose one of {', '.join(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def check_output_dir(src: Path, out: Path, overwrite: bool) -> None:
    """Fail early (before any work) if ``out`` may not be written."""
    if out.is_dir() and (
        out.resolve() == src.resolve() or src.resolve().is_relative_to(out.resolve())
    ):
        raise ValueError(f"{out}: the output directory must not hold the source {src}")
    check_output_directory(
        out, overwrite, hint="choose another OUT, or pass --overwrite to replace it"
    )


def token_ids(config_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The special-token ids present in a ``config.json`` dict."""
    return {k: config_dict[k] for k in TOKEN_ID_KEYS if config_dict.get(k) is not None}


def cast_state(
    state: dict[str, torch.Tensor], dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """Floating tensors cast to ``dtype`` (``None`` keeps the stored dtypes)."""
    if dtype is None:
        return state
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}


# ----------------------------------------------------------------------------------------
# names
def _hf_name(ours: str) -> str:
    """The Hugging Face name of the diffattn tensor ``ours`` (module docstring's table; a
    type's own attention tensors keep their names under ``self_attn``)."""
    if ours in ("embed_tokens.weight", "norm.weight"):
        return f"model.{ours}"
    if ours == "lm_head.weight":
        return ours
    layers, index, rest = ours.split(".", 2)
    if layers != "layers":  # pragma: no cover - DiffTransformerLM has no other tensors
        raise ValueError(f"{ours}: no Hugging Face name is known for this tensor")
    if rest in _LAYER_KEYS:
        return f"model.layers.{index}.{_LAYER_KEYS[rest]}"
    if rest.startswith("attn."):
        return f"model.layers.{index}.self_attn.{rest[len('attn.') :]}"
    raise ValueError(f"{ours}: no Hugging Face name is known for this tensor")


def key_map(config: ModelConfig) -> dict[str, str]:
    """diffattn tensor name -> Hugging Face tensor name for every stored tensor of ``config``
    (those of ``DiffTransformerLM(config)``: a type's own, DIFF V1's λ vectors, come along)."""
    return {ours: _hf_name(ours) for ours in meta_state(config)}


def check_hf_format(config: ModelConfig, target: str) -> None:
    """Refuse, in one ``ValueError`` naming the attention type and the formats it converts to,
    a model whose layers ``--to target`` cannot write: every layer's type must declare
    ``target`` as its Hugging Face format (``AttentionType.hf_format``)."""
    types = config.attention_types
    if all(declaration.hf_format == target for declaration in types):
        return
    if config.is_mixed:
        raise ValueError(
            f"--to {target} writes one Hugging Face architecture for every layer; this model "
            f"mixes the attention types {', '.join(d.name for d in types)} "
            f"(layer_types={','.join(config.layer_types)}), which converts with --to hub only"
        )
    declaration = types[0]
    formats = [f"--to {name}" for name in (declaration.hf_format, "hub") if name is not None]
    raise ValueError(
        f"--to {target} cannot write attention type {declaration.name!r}"
        + ("" if declaration.hf_format else ", which has no Hugging Face counterpart")
        + f"; it converts with {' or '.join(formats)}"
    )


def meta_state(config: ModelConfig) -> dict[str, torch.Tensor]:
    """The state dict of ``DiffTransformerLM(config)`` on the meta device (shapes only)."""
    with torch.device("meta"):
        return DiffTransformerLM(config).state_dict()


def hf_state_to_diffattn(
    hf_state: Mapping[str, torch.Tensor], config: ModelConfig, source: str
) -> dict[str, torch.Tensor]:
    """Rename an HF state dict to diffattn names, checking names and shapes (HF names in errors).

    A stored ``lm_head.weight`` of a tied model and old ``rotary_emb.inv_freq`` buffers are
    ignored. Attention weights are not permuted here.
    """
    names = key_map(config)
    expected = meta_state(config)
    found = {
        k: v
        for k, v in hf_state.items()
        if not k.endswith("rotary_emb.inv_freq")
        and not (config.tie_embeddings and k == "lm_head.weight")
    }
    expected_hf = {theirs: expected[ours] for ours, theirs in names.items()}
    check_state_dict(expected_hf, found, source)
    return {ours: found[theirs] for ours, theirs in names.items()}


def diffattn_state_to_hf(state: Mapping[str, torch.Tensor], config: ModelConfig) -> dict:
    """Rename a diffattn state dict (no ``model.`` prefix) to Hugging Face names."""
    return {theirs: state[ours] for ours, theirs in key_map(config).items()}


# ----------------------------------------------------------------------------------------
# diffattn side
def read_diffattn_dir(src_dir: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """Config, checked state dict (without the ``model.`` prefix) and raw ``config.json``."""
    config = read_config(src_dir)
    raw = read_json(src_dir / "config.json")
    stored = read_safetensors(weight_files(src_dir))
    unprefixed = [k for k in stored if not k.startswith(KEY_PREFIX)]
    if unprefixed:
        raise CheckpointError(
            f"{src_dir}: tensor(s) without the {KEY_PREFIX!r} prefix: {', '.join(unprefixed[:5])}"
        )
    state = {k[len(KEY_PREFIX) :]: v for k, v in stored.items()}
    check_state_dict(meta_state(config), state, str(src_dir))
    return config, state, raw


def write_diffattn_dir(
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    out: Path,
    *,
    overwrite: bool,
    tokenizer_dir: Path | None,
    ids: Mapping[str, Any],
) -> Path:
    """Build the model around ``state`` and write it as a diffattn model directory (atomically).

    Tensors keep their dtype. ``ids`` (special-token ids) are added to ``config.json``, where
    :func:`diffattn.checkpoint.read_config` ignores them, and tokenizer files are copied from
    ``tokenizer_dir``.
    """
    check_state_dict(meta_state(config), state, "converted weights")
    with torch.device("meta"):
        model = DiffTransformerLM(config)
    model.to_empty(device="cpu")
    model.rotary.reset_parameters()
    model.load_state_dict(state, strict=True, assign=True)

    with atomic_directory(out, overwrite=overwrite) as tmp:
        write_model_files(model, tmp)
        if ids:
            write_json(tmp / CONFIG_NAME, {**read_json(tmp / CONFIG_NAME), **ids})
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, tmp)
    return out


# ----------------------------------------------------------------------------------------
# Hugging Face side
def load_hf_config(src_dir: Path, config_class: Any) -> Any:
    """The HF config of ``src_dir`` (``config_class.from_pretrained``), errors as ValueError."""
    try:
        return config_class.from_pretrained(str(src_dir))
    except Exception as error:  # transformers' strict configs raise several exception types
        raise ValueError(f"{src_dir / 'config.json'}: not a valid config ({error})") from error


def rope_theta_of(hf_config: Any, source: str) -> float:
    """RoPE base of an HF config; any rope scaling or partial rotary is a ``ValueError``."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:  # transformers 4.x keeps rope_theta and rope_scaling as attributes
        scaling = getattr(hf_config, "rope_scaling", None)
        params = dict(scaling or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    if not isinstance(params, Mapping) or "rope_theta" not in params:
        raise ValueError(
            f"{source}: rope_parameters={params!r} has no single rope_theta; diffattn needs "
            "one plain RoPE for all layers"
        )
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(
            f"{source}: rope_scaling / rope_parameters with rope_type={rope_type!r} is not "
            "supported; diffattn implements plain RoPE (rope_type 'default')"
        )
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(
            f"{source}: partial_rotary_factor={partial} is not supported; diffattn rotates "
            "every channel of a head"
        )
    return float(params["rope_theta"])


def check_common_features(hf_config: Any, source: str) -> None:
    """Raise a ``ValueError`` naming the first HF setting diffattn cannot reproduce."""
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(
            f"{source}: hidden_act={act!r} is not supported; diffattn's feed-forward is "
            "SwiGLU with SiLU ('silu')"
        )
    for name in ("attention_bias", "mlp_bias"):
        if getattr(hf_config, name, False):
            raise ValueError(
                f"{source}: {name}=True is not supported; diffattn's projections have no bias"
            )
    head_dim = getattr(hf_config, "head_dim", None)
    if head_dim is not None and (not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2):
        raise ValueError(f"{source}: head_dim={head_dim!r} must be a positive even integer")


def model_config_from_hf(hf_config: Any, source: str, **fields: Any) -> ModelConfig:
    """The :class:`ModelConfig` of an HF Llama-family config (plus attention ``fields``)."""
    check_common_features(hf_config, source)
    n_heads = hf_config.num_attention_heads
    values = dict(
        vocab_size=hf_config.vocab_size,
        d_model=hf_config.hidden_size,
        n_layers=hf_config.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=getattr(hf_config, "num_key_value_heads", None) or n_heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // n_heads,
        ffn_hidden=hf_config.intermediate_size,
        max_seq_len=hf_config.max_position_embeddings,
        rope_theta=rope_theta_of(hf_config, source),
        rope_style="half",
        norm_eps=float(hf_config.rms_norm_eps),
        tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        init_std=float(getattr(hf_config, "initializer_range", 0.02)),
    )
    values.update(fields)
    try:
        return ModelConfig(**values)
    except ValueError as error:
        raise ValueError(f"{source}: cannot be expressed as a diffattn model: {error}") from error


def hf_config_fields(config: ModelConfig, ids: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``LlamaConfig`` / ``DiffLlamaConfig`` arguments both families share, for ``config``.

    ``ids`` holds the special-token ids to carry over (absent ones become ``None``).
    """
    return dict(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=config.ffn_dim,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.dim_per_head,
        hidden_act="silu",
        max_position_embeddings=config.max_seq_len,
        initializer_range=config.init_std,
        rms_norm_eps=config.norm_eps,
        tie_word_embeddings=config.tie_embeddings,
        rope_theta=float(config.rope_theta),
        attention_bias=False,
        **{k: (ids or {}).get(k) for k in TOKEN_ID_KEYS},
    )


def read_hf_state(src_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF directory, from safetensors only (pickle ``.bin`` is refused)."""
    return read_safetensors(weight_files(src_dir))


def write_hf_dir(
    model_class: Any,
    hf_config: Any,
    hf_state: dict[str, torch.Tensor],
    out: Path,
    *,
    overwrite: bool,
    tokenizer_dir: Path | None,
) -> Path:
    """Write ``hf_state`` as an HF model directory with ``save_pretrained`` (atomically)."""
    with torch.device("meta"):
        model = model_class(hf_config)
    result = model.load_state_dict(hf_state, strict=False, assign=True)
    allowed_missing = {"lm_head.weight"} if hf_config.tie_word_embeddings else set()
    problems = sorted(set(result.missing_keys) - allowed_missing) + sorted(result.unexpected_keys)
    if problems:  # pragma: no cover - guarded by the state-dict checks before
        raise CheckpointError(f"converted weights do not fit {model_class.__name__}: {problems}")
    if hf_config.tie_word_embeddings:
        model.tie_weights()
    with atomic_directory(out, overwrite=overwrite) as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
        if tokenizer_dir is not None:  # the source's files replace save_pretrained's
            copy_tokenizer_files(tokenizer_dir, tmp, overwrite=True)
        weight_files(tmp)  # the directory must hold safetensors weights
    return out


@dataclass(frozen=True)
class HFFamily:
    """A Hugging Face model family and the four functions that map it to and from diffattn.

    ``config_to_diffattn(hf_config, source)`` and ``state_to_diffattn(hf_state, config,
    source)`` read the HF side; ``config_from_diffattn(config, ids)`` and
    ``state_from_diffattn(state, config)`` write it.
    """

    hf_config_name: str
    hf_model_name: str
    config_to_diffattn: Callable[[Any, str], ModelConfig]
    state_to_diffattn: Callable[[dict[str, torch.Tensor], ModelConfig, str], dict]
    config_from_diffattn: Callable[[ModelConfig, dict[str, Any]], Any]
    state_from_diffattn: Callable[[dict[str, torch.Tensor], ModelConfig], dict]

    def read_hf(self, src_dir: Path) -> tuple[Any, ModelConfig, dict[str, torch.Tensor]]:
        """The HF config of the directory ``src_dir``, its diffattn :class:`ModelConfig` and
        its weights as a checked diffattn state dict."""
        transformers = require_transformers()
        hf_config = load_hf_config(src_dir, getattr(transformers, self.hf_config_name))
        config = self.config_to_diffattn(hf_config, str(src_dir / "config.json"))
        state = self.state_to_diffattn(read_hf_state(src_dir), config, str(src_dir))
        return hf_config, config, state

    def to_diffattn(
        self, src_dir: Path, out: Path, *, overwrite: bool = False, dtype: torch.dtype | None = None
    ) -> Path:
        """Convert an HF directory of this family into a diffattn model directory."""
        _, config, state = self.read_hf(src_dir)
        return write_diffattn_dir(
            config,
            cast_state(state, dtype),
            out,
            overwrite=overwrite,
            tokenizer_dir=src_dir,
            ids=token_ids(read_json(src_dir / "config.json")),
        )

    def from_diffattn(
        self, src_dir: Path, out: Path, *, overwrite: bool = False, dtype: torch.dtype | None = None
    ) -> Path:
        """Convert a diffattn model directory into an HF directory of this family."""
        transformers = require_transformers()
        config, state, raw = read_diffattn_dir(src_dir)
        return write_hf_dir(
            getattr(transformers, self.hf_model_name),
            self.config_from_diffattn(config, token_ids(raw)),
            cast_state(self.state_from_diffattn(state, config), dtype),
            out,
            overwrite=overwrite,
            tokenizer_dir=src_dir,
        )
