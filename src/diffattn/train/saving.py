"""Writing a run's checkpoints: gathered full checkpoints or sharded ones (:mod:`.sharded`), the
``latest`` and ``final`` links, the tokenizer saved once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from diffattn import fileio
from diffattn.train import checkpoint as ckpt
from diffattn.train import distributed
from diffattn.train.config import (
    ConfigError,
    dump_config,
)
from diffattn.train.factory import save_factory_checkpoint
from diffattn.train.outcome import TrainingDiverged
from diffattn.train.parallel import (
    full_model_state,
    full_optimizer_state,
)
from diffattn.train.resume import (
    set_aside,
)


class CheckpointSaving:
    """The checkpoint writing of :class:`~diffattn.train.trainer.Trainer` (a mixin: it uses the
    trainer's attributes): full or sharded checkpoints, the ``latest``/``final`` links."""

    # ------------------------------------------------------------------------------------
    # checkpoints
    def save(self) -> Path:
        """Checkpoint the current step (collective; rank 0 writes); returns its directory.

        Raises:
            TrainingDiverged: the weights are not finite (nothing is written).
        """
        step = self.step
        if not _weights_finite(self.trainable, self.device):
            raise TrainingDiverged(
                f"non-finite weights after step {step}; not saving them. The last good "
                f"checkpoint is {self.last_checkpoint}.",
                step,
                self.last_checkpoint,
            )
        if self.sharded is not None:
            return self._save_sharded(step)
        model_state = full_model_state(self.parallel_model)
        optimizer_state = full_optimizer_state(self.parallel_model, self.optimizer)
        rank_states = distributed.gather_objects(
            {"rng": ckpt.capture_rng_state(), "loader": self.loader.state_dict()}
        )
        outcome: tuple[str | None, str | None] = (None, None)
        if self.main:
            try:
                trainer_state = self._trainer_state(optimizer_state, rank_states)
                written = self._write_checkpoint(model_state, trainer_state)
                self._point_entries(written, final=step >= self.config.steps)
                outcome = (str(written), None)
            except Exception as exc:  # every rank must learn about it
                outcome = (None, f"{type(exc).__name__}: {exc}")
        path, failure = distributed.broadcast_object(outcome)
        if failure is not None:
            raise RuntimeError(f"saving the checkpoint of step {step} failed: {failure}")
        self.last_checkpoint = Path(path)
        self.last_saved_step = step
        return self.last_checkpoint

    def _save_sharded(self, step: int) -> Path:
        """Each rank writes its shards (:mod:`diffattn.train.sharded`); rank 0 the rest."""
        rank_states = distributed.gather_objects(
            {"rng": ckpt.capture_rng_state(), "loader": self.loader.state_dict()}
        )

        def write_small_files(tmp: Path) -> None:
            state = self._trainer_state(None, rank_states)
            state["sharded"] = True
            config_yaml = dump_config(self.config)
            ckpt.write_run_files(tmp, state, config_yaml, self.tokenizer_dir, self.model_config)

        def finish(path: Path) -> None:
            ckpt.prune(self.checkpoint_root, self.config.keep_last)
            self._point_entries(path, final=step >= self.config.steps)

        model, optimizer = self.parallel_model, self.optimizer
        path = self.sharded.save(step, model, optimizer, write_small_files, finish)
        self.last_checkpoint = path
        self.last_saved_step = step
        return path

    def _checkpoint_format(self) -> str:
        """``full`` or ``sharded`` (``auto``: sharded for preset models under FSDP2)."""
        chosen = self.config.checkpoint_format
        if chosen == "auto":
            preset = self.model_factory is None
            chosen = "sharded" if preset and self.config.parallel == "fsdp" else "full"
        if chosen == "sharded" and self.model_factory is not None:
            raise ConfigError(
                "checkpoint_format",
                "sharded checkpoints are for preset models, not a model_factory",
            )
        if self.config.async_checkpoint and chosen != "sharded":
            raise ConfigError("async_checkpoint", "needs checkpoint_format: sharded")
        return chosen

    def _continue_entries(self) -> None:
        """On a resume (rank 0): checkpoints after the resumed step go to ``superseded/`` and
        ``latest`` points at the resumed one. ``final`` stays until the run writes a newer
        checkpoint (:meth:`_point_entries`), so a resume that fails before its first save
        leaves it; only a ``final`` whose checkpoint was set aside goes now."""
        root, found = self.checkpoint_root, self.checkpoint_found
        if found is None:
            return
        for moved in set_aside(self.out, self.superseded) if self.superseded else ():
            self._say(f"note: set aside {moved}")
        ckpt.point_entry(root, ckpt.LATEST_ENTRY, found)
        if ckpt.read_entry(root, ckpt.FINAL_ENTRY) is None:  # its checkpoint is gone
            ckpt.clear_entry(root, ckpt.FINAL_ENTRY)

    def _point_entries(self, checkpoint: Path, final: bool) -> None:
        """After writing ``checkpoint``: ``latest`` links to it, and ``final`` too when it is
        the run's last step; else an older ``final`` goes (the run went past it)."""
        ckpt.point_entry(self.checkpoint_root, ckpt.LATEST_ENTRY, checkpoint)
        if final:
            ckpt.point_entry(self.checkpoint_root, ckpt.FINAL_ENTRY, checkpoint)
        else:
            ckpt.clear_entry(self.checkpoint_root, ckpt.FINAL_ENTRY)

    def _trainer_state(self, optimizer_state: dict | None, rank_states: list) -> dict[str, Any]:
        """What ``trainer_state.pt`` holds (the optimizer only when it is not sharded)."""
        self.logger.flush()
        state = {
            "step": self.step,
            "tokens": self.tokens,
            "world_size": self.world,
            "elapsed_s": self.elapsed_s,
            "schedule": self.schedule.state_dict(),
            "spikes": self.spikes.state_dict(),
            "rank_states": rank_states,
        }
        if optimizer_state is not None:
            state["optimizer"] = optimizer_state
        return state

    def _write_checkpoint(self, model_state: dict, trainer_state: dict[str, Any]) -> Path:
        config = self.config
        if self.model_factory is not None:
            return save_factory_checkpoint(
                self.checkpoint_root,
                self.step,
                self.model,
                model_state,
                trainer_state,
                dump_config(config),
                self.tokenizer_dir,
                config.keep_last,
            )
        return ckpt.save_checkpoint(
            self.checkpoint_root,
            self.step,
            self.model_config,
            model_state,
            trainer_state,
            dump_config(config),
            tokenizer_dir=self.tokenizer_dir,
            keep_last=config.keep_last,
        )


def save_tokenizer_once(tokenizer: Any, directory: Path) -> Path | None:
    """Save the tokenizer to ``directory`` once (checkpoints copy these files)."""
    if directory.is_dir() and any(directory.iterdir()):
        return directory
    if not hasattr(tokenizer, "save"):
        return None
    with fileio.atomic_directory(directory, overwrite=True) as tmp:
        tokenizer.save(tmp)
    return directory


def _weights_finite(params: list[torch.Tensor], device: torch.device) -> bool:
    """True when every (local shard of every) parameter is finite on every rank."""
    bad = torch.zeros((), device=device)
    with torch.no_grad():
        for param in params:
            local = param.to_local() if hasattr(param, "to_local") else param
            if not bool(torch.isfinite(local).all()):
                bad += 1
                break
    distributed.all_reduce_sum(bad)
    return float(bad) == 0.0
