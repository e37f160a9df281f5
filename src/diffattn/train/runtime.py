"""Checks of a training config that depend on the launch: world size, CUDA, optional
packages (:func:`check_runtime`)."""

from __future__ import annotations

from typing import Any

from diffattn.train.fields import ConfigError


# ----------------------------------------------------------------------------------------
# runtime checks
def check_runtime(config: Any, env: Any, cuda_available: bool | None = None) -> None:
    """Checks that depend on the launch: world size, CUDA, optional packages.

    ``config`` is a :class:`diffattn.train.config.TrainConfig`, ``env`` a
    :class:`diffattn.train.distributed.DistEnv`.
    """
    import torch

    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if config.device == "cuda" and not cuda_available:
        raise ConfigError("device", "cuda requested but CUDA is not available")
    if config.parallel != "none" and not env.launched:
        raise ConfigError(
            "parallel",
            f"{config.parallel!r} needs a distributed launch (torchrun sets RANK, WORLD_SIZE, "
            "MASTER_ADDR); run under torchrun or set parallel: none",
        )
    if config.tp > 1 and not env.launched:
        raise ConfigError(
            "tp", f"{config.tp} needs a distributed launch of tp processes or a multiple (torchrun)"
        )
    if env.world_size % config.tp:
        raise ConfigError(
            "tp", f"{config.tp} does not divide the {env.world_size} processes of the launch"
        )
    if config.parallel == "none" and env.world_size > config.tp:
        raise ConfigError(
            "parallel",
            f"launched with {env.world_size} processes but parallel is 'none'"
            + (f" and tp is {config.tp}" if config.tp > 1 else "")
            + "; set parallel: ddp or fsdp",
        )
    group = config.tp * config.cp  # the ranks that read the same rows: one data-parallel rank
    if env.world_size % group:
        within = f" × tp {config.tp}" if config.tp > 1 else ""
        raise ConfigError(
            "cp",
            f"{config.cp}{within} does not divide the {env.world_size} processes of the launch",
        )
    world = env.world_size // group  # data-parallel ranks
    micro = config.micro_batch_size
    if config.global_batch_size % world:
        raise ConfigError(
            "global_batch_size",
            f"{config.global_batch_size} is not divisible by the world size {world}",
        )
    if micro is not None and config.global_batch_size % (micro * world):
        raise ConfigError(
            "global_batch_size",
            f"{config.global_batch_size} is not divisible by micro_batch_size × world size "
            f"= {micro} × {world}",
        )
    eval_size = config.eval_batch_size or config.global_batch_size
    if config.eval_every and eval_size % world:
        raise ConfigError(
            "eval_batch_size", f"{eval_size} is not divisible by the world size {world}"
        )
    if config.tensorboard:
        try:
            import torch.utils.tensorboard
        except ImportError:
            raise ConfigError(
                "tensorboard",
                "true, but the tensorboard package is not installed (pip install tensorboard)",
            ) from None
    if config.wandb:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ConfigError(
                "wandb", "true, but the wandb package is not installed (pip install wandb)"
            )
