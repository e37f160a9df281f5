"""diffattn → a Hub-ready directory (``convert --to hub``) that loads without diffattn.

The directory is what ``DiffAttnForCausalLM.save_pretrained`` writes (``config.json``,
``generation_config.json``, ``model.safetensors``) plus:

* ``modeling_diffattn.py``, the remote code generated from the installed package
  (:mod:`diffattn.hf.remote_code` says how, and why it cannot drift), and ``auto_map`` in
  ``config.json`` pointing at it, so ``AutoConfig`` / ``AutoModelForCausalLM.from_pretrained(
  dir, trust_remote_code=True)`` build the model on a machine without diffattn (the file is
  written by ``save_pretrained`` itself, as for any config whose ``auto_map`` points at it:
  :mod:`diffattn.hf.remote_runtime`);
* the tokenizer, with a pad token (the eos token when it has none: ``padding=True`` then works,
  and the attention mask hides the padding), and the special-token ids in both configs.

Every attention type exports, and every stack of them (``layer_types``): the remote code
carries the modules of the types the model uses, those of another package included
(:mod:`diffattn.hf.remote_types`). The weights are the same tensors under the same names, so
logits are those of diffattn itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from diffattn.checkpoint import CheckpointError
from diffattn.convert.common import cast_state, read_diffattn_dir, require_transformers, token_ids
from diffattn.fileio import TOKENIZER_FILES, atomic_directory, copy_tokenizer_files


def _tokenizer_with_pad(src_dir: Path, tmp: Path) -> dict[str, int]:
    """Copy the tokenizer of ``src_dir`` into ``tmp`` with a pad token; its special ids."""
    if not any((src_dir / name).is_file() for name in TOKENIZER_FILES):
        return {}
    from transformers import AutoTokenizer

    copy_tokenizer_files(src_dir, tmp)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tmp))
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{src_dir}: its tokenizer files do not load ({error})") from None
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise CheckpointError(
                f"{src_dir}: the tokenizer has neither a pad nor an eos token to pad with"
            )
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(str(tmp))
    ids = {
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }
    return {name: value for name, value in ids.items() if value is not None}


def _model(config, state: dict[str, torch.Tensor], ids: dict[str, Any]):
    from diffattn.hf import DiffAttnConfig, DiffAttnForCausalLM
    from diffattn.hf.remote_code import AUTO_MAP

    hf_config = DiffAttnConfig.from_model_config(config, **ids)
    hf_config.auto_map = dict(AUTO_MAP)
    with torch.device("meta"):
        model = DiffAttnForCausalLM(hf_config)
    model.load_state_dict({f"model.{k}": v for k, v in state.items()}, strict=True, assign=True)
    model.model.rotary.reset_parameters()  # RoPE's buffers are rebuilt, not saved
    for name, value in ids.items():
        setattr(model.generation_config, name, value)
    return model


def diffattn_to_hub(
    src_dir: Path, out: Path, *, overwrite: bool = False, dtype: torch.dtype | None = None
) -> Path:
    """Write the diffattn directory ``src_dir`` as a Hub-ready directory ``out`` (atomically).

    Raises:
        CheckpointError / ValueError: unreadable weights or tokenizer, unusable ``out``.
    """
    require_transformers()
    from diffattn.hf.remote_code import MODELING_FILE

    config, state, raw = read_diffattn_dir(src_dir)
    with atomic_directory(out, overwrite=overwrite) as tmp:
        ids = {**token_ids(raw), **_tokenizer_with_pad(src_dir, tmp)}
        model = _model(config, cast_state(state, dtype), ids)
        # the config's auto_map makes this write modeling_diffattn.py too
        model.save_pretrained(str(tmp), safe_serialization=True)
        saved = json.loads((tmp / "config.json").read_text(encoding="utf-8"))
        if saved.get("auto_map") is None or not (tmp / MODELING_FILE).is_file():  # pragma: no cover
            raise CheckpointError(
                f"{out}: config.json lost its auto_map, or {MODELING_FILE} is missing"
            )
    return out
