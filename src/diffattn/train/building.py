"""Building a run (:class:`TrainerBuilding`): everything before the first step."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

from diffattn import fileio
from diffattn.config import ModelConfig
from diffattn.model import DiffTransformerLM
from diffattn.train import checkpoint as ckpt
from diffattn.train import distributed
from diffattn.train.config import (
    ConfigError,
    check_runtime,
    dump_config,
)
from diffattn.train.factory import (
    factory_model,
    load_factory_state,
    read_factory_state,
    takes_document_ids,
)
from diffattn.train.metrics import LambdaProbe, MetricsLogger, SpikeDetector
from diffattn.train.optim import LRSchedule, build_optimizer
from diffattn.train.parallel import (
    build_model,
    load_full_model_state,
    load_full_optimizer_state,
    parallelize,
    unwrap,
)
from diffattn.train.precision import compute_dtype
from diffattn.train.resume import (
    CONFIG_COPY_NAME,
    StartPlan,
    plan_start,
)
from diffattn.train.saving import save_tokenizer_once
from diffattn.train.sharded import ShardedCheckpointer, is_sharded, load_sharded

TOKENIZER_DIRNAME = "tokenizer"
# ModelConfig fields in which an ``init_from`` model may differ from the run's model: they change
# no weight (RoPE's inverse frequencies are a buffer rebuilt from rope_theta, not saved).
INIT_FREE_FIELDS = ("rope_theta", "max_seq_len")


class TrainerBuilding:
    """What :meth:`~diffattn.train.trainer.Trainer.build` runs (a mixin: it sets the trainer's
    attributes): launch and start plan, data, model, optimizer, loader, resume state,
    validation batches, output directory."""

    def _launch(self) -> None:
        """Read the launch, join the process group, and plan the resume (rank 0 decides)."""
        config = self.config
        try:
            env = distributed.read_env()
        except ValueError as error:
            raise ConfigError("environment", str(error)) from None
        check_runtime(config, env)
        for key in ("tp", "cp"):
            if getattr(config, key) > 1 and self.model_factory is not None:
                raise ConfigError(key, "applies to preset models, not to a model_factory")
        self.model_config = config.model_config() if self.model_factory is None else None
        self._data_config = config.data_config() if self.data is None else None
        self.env = env
        self.world = env.world_size
        # data-parallel ranks: the ranks of one tensor- and context-parallel group (cp·tp ranks,
        # which check_runtime has found to divide the launch) read the same rows
        group = config.tp * config.cp
        self.dp_world, self.dp_rank = env.world_size // group, env.rank // group
        self.main = env.is_main
        self.device = distributed.resolve_device(config.device, env)
        distributed.init_process_group(env, self.device)
        plan = (
            plan_start(
                config,
                self.model_config,
                self.out,
                self.resume,
                self.overwrite,
                self.resume_fallback,
            )
            if self.main
            else None
        )
        plan: StartPlan = distributed.broadcast_object(plan)
        if plan.error is not None:
            raise ConfigError(*plan.error)
        self.checkpoint_found = plan.checkpoint
        self.clear_output = plan.clear
        self.superseded = plan.superseded
        self.notes: list[str] = list(plan.notes)
        self.init_source = None
        if plan.checkpoint is None and config.init_from is not None:
            self.init_source, change = _check_init_from(Path(config.init_from), self.model_config)
            self.notes.append(f"starting from the weights of {self.init_source}{change}")
        if self.main:
            for message in plan.messages:  # shown even with --quiet: the run differs from asked
                print(f"diffattn train: {message}", file=sys.stderr, flush=True)

    def _build_data(self) -> None:
        """Prepare the data (rank 0 first, then the others from its cache)."""
        from diffattn.data import prepare_data

        if self.data is None:
            try:
                if self.main:
                    self.data = prepare_data(self._data_config, progress=self.progress)
                distributed.barrier()
                if not self.main:
                    self.data = prepare_data(self._data_config, progress=False)
            except ValueError as error:  # a missing source, an empty corpus, ...
                raise ConfigError("data", str(error)) from None
        self.vocab = int(self.data.tokenizer.vocab_size)
        model_config = self.model_config
        if model_config is not None and self.vocab > model_config.vocab_size:
            raise ConfigError(
                "model.vocab_size",
                f"{model_config.vocab_size} is smaller than the tokenizer's {self.vocab} tokens "
                f"({getattr(self.data.tokenizer, 'name', 'tokenizer')})",
            )
        self._check_model_tokenizer()

    def _check_model_tokenizer(self) -> None:
        """The shards' tokenizer is the one saved with the checkpoint resumed or the
        ``init_from`` model (when it saved one); else one error naming both."""
        from diffattn.data.tokenizer_match import tokenizer_mismatch

        model_dir = self.checkpoint_found or self.init_source
        if model_dir is None or not hasattr(self.data.tokenizer, "encode"):
            return
        problem = tokenizer_mismatch(self.data.tokenizer, self.data.train, Path(model_dir))
        if problem is not None:
            raise ConfigError("data.tokenizer", problem)

    def _build_model(self) -> None:
        """The seeded model, parallelised; a resumed run's weights loaded into it."""
        seed_everything(self.config.seed)
        if self.model_factory is None:
            self.parallel_model = self._build_preset_model()
        else:
            self.parallel_model = self._buildfactory_model()
        self.model = unwrap(self.parallel_model)
        if self.model_factory is not None:
            own = getattr(self.model, "config", None)
            self.model_config = own if isinstance(own, ModelConfig) else None
            if self.config.document_masking and not takes_document_ids(self.model):
                raise ConfigError(
                    "document_masking",
                    f"the model_factory model ({type(self.model).__name__}) takes no "
                    "document_ids in forward, so it would attend across documents; use a "
                    "diffattn model or turn document_masking off",
                )
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.num_parameters = sum(p.numel() for p in self.model.parameters())
        self.num_trainable = sum(p.numel() for p in self.trainable)

    def _build_preset_model(self) -> nn.Module:
        config = self.config
        found = self.checkpoint_found or self.init_source
        # a sharded checkpoint is read into the built model's shards (_resume_from)
        initial_state_needed = found is not None and not is_sharded(found)
        initial_state = (
            ckpt.load_model_state(found) if (initial_state_needed and self.main) else None
        )
        return build_model(
            self.model_config,
            mode=config.parallel,
            device=self.device,
            seed=config.seed,
            fsdp_init="sharded"
            if found is not None and not initial_state_needed
            else config.fsdp_init,
            activation_checkpointing=config.activation_checkpointing,
            selective_ac=config.selective_ac,
            compile=config.compile,
            mixed_precision=self._mixed_precision(),
            initial_state=initial_state,
            load_initial_state=found is not None and initial_state_needed,
            tp=config.tp,
        )

    def _mixed_precision(self) -> torch.dtype | None:
        """FSDP2's parameter dtype (``fsdp_mixed_precision``), or ``None``: fp32 all-gathers."""
        config = self.config
        if config.parallel != "fsdp" or not config.fsdp_mixed_precision:
            return None
        dtype = compute_dtype(self.device, config.dtype)
        return dtype if dtype != torch.float32 else None

    def _buildfactory_model(self) -> nn.Module:
        """``model_factory()`` on every rank (the same seed, so the same weights), moved to the
        device and parallelised. A checkpoint is read by rank 0 only: loaded before the DDP
        wrapper broadcasts rank 0's weights, or broadcast into the FSDP2 shards."""
        mode, found = self.config.parallel, self.checkpoint_found
        model = factory_model(self.model_factory, self.vocab)
        state = read_factory_state(found) if (found and self.main) else None
        if state is not None and mode != "fsdp":
            load_factory_state(model, state, found)
        try:
            wrapped = parallelize(
                model.to(self.device), mode, self.device, mixed_precision=self._mixed_precision()
            )
        except ValueError as error:  # FSDP2: no decoder blocks, or a parameter it cannot shard
            what, reason = type(model).__name__, str(error).rstrip(".")
            raise ConfigError(
                "parallel", f"{mode} cannot wrap {what}: {reason}; use parallel: ddp"
            ) from None
        if found is not None and mode == "fsdp":
            load_full_model_state(wrapped, state)
        return wrapped

    def _build_optimizer(self) -> None:
        self.optimizer = build_optimizer(self.model, self.config.optim)
        self.schedule = LRSchedule(
            self.config.optim.lr, self.config.schedule, self.config.decay_horizon
        )

    def _build_loader(self) -> None:
        """This rank's share of each global batch, in micro batches."""
        from diffattn.data import BatchLoader

        config = self.config
        self.local_batch = config.global_batch_size // self.dp_world
        self.micro = config.micro_batch_size or self.local_batch
        self.accumulation = self.local_batch // self.micro
        self.loader = BatchLoader(
            self.data.train,
            batch_size=config.global_batch_size,
            seq_len=config.seq_len,
            seed=config.seed,
            rank=self.dp_rank,
            world_size=self.dp_world,
        )
        loader = self.loader
        self.batches = loader if hasattr(loader, "__next__") else iter(loader)
        self.eos_id = loader.data.eos_id
        self.spikes = SpikeDetector(config.spike_factor, config.spike_window)

    def _resume_from(self, found: Path) -> None:
        """Optimizer, counters, spike detector, loader position and RNG of the checkpoint."""
        main = self.main
        state = ckpt.load_trainer_state(found) if main else None
        if is_sharded(found):  # the model and optimizer shards, resharded to this launch
            load_sharded(found, self.parallel_model, self.optimizer)
        else:
            optimizer_state = state.pop("optimizer") if main else None
            load_full_optimizer_state(self.parallel_model, self.optimizer, optimizer_state)
        state = distributed.broadcast_object(state)
        self.step = int(state["step"])
        self.tokens = int(state["tokens"])
        self.elapsed_before = float(state.get("elapsed_s", 0.0))
        self.spikes.load_state_dict(state["spikes"])
        rank_states = state["rank_states"]
        own = rank_states[self.env.rank] if len(rank_states) == self.world else rank_states[0]
        self.loader.load_state_dict(own["loader"])
        ckpt.restore_rng_state(own["rng"])
        changes = self.schedule.describe_changes(state["schedule"])
        self.notes += [f"schedule {change}" for change in changes]

    def _build_eval_batches(self, announce: bool = False) -> list[torch.Tensor]:
        """The fixed validation batches (this rank's rows): ``eval_batches`` batches of
        windows spread evenly over the validation stream, the same for every launch; empty
        when the split is too small, with a note when ``announce``."""
        from diffattn.data import eval_batches

        config = self.config
        self.eval_list = []
        try:
            self.eval_list = list(
                eval_batches(
                    self.data.valid,
                    config.eval_batch_size or config.global_batch_size,
                    config.seq_len,
                    config.eval_batches,
                    rank=self.dp_rank,
                    world_size=self.dp_world,
                    drop_last=True,
                )
            )
        except ValueError as error:
            if announce:
                self._say(f"note: no validation loss ({error})")
        return self.eval_list

    def _open_output(self) -> None:
        """The run directory (rank 0 writes), the metrics logger and the opening messages."""
        config, out = self.config, self.out
        self.checkpoint_root = out / ckpt.CHECKPOINTS_DIRNAME
        self.sharded = None
        if self._checkpoint_format() == "sharded":
            self.sharded = ShardedCheckpointer(self.checkpoint_root, self.config.async_checkpoint)
        self.tokenizer_dir = None
        if self.main:
            if self.clear_output:  # overwrite, or a restart of this run that saved nothing
                fileio.clear_output_directory(out)
            out.mkdir(parents=True, exist_ok=True)
            fileio.remove_partial_writes(self.checkpoint_root)
            self._continue_entries()
            (out / CONFIG_COPY_NAME).write_text(dump_config(config), encoding="utf-8")
            self.tokenizer_dir = save_tokenizer_once(self.data.tokenizer, out / TOKENIZER_DIRNAME)
        self.logger = MetricsLogger(
            out,
            enabled=self.main,
            resume_step=self.step if self.checkpoint_found is not None else None,
            tensorboard=config.tensorboard,
            wandb=config.wandb,
            wandb_project=config.wandb_project,
            run_name=config.run_name,
            config=config.to_dict(),
        )
        if isinstance(self.model, DiffTransformerLM):
            self.probe = LambdaProbe(self.model)
        self._announce()

    def _announce(self) -> None:
        config = self.config
        model_config = self.model_config
        what = model_config.attention if model_config is not None else type(self.model).__name__
        if self.num_trainable != self.num_parameters:
            what += f" · {self.num_trainable:,} trainable of"
        self._say(
            f"diffattn train: {what} {self.num_parameters:,} parameters · "
            f"{config.parallel} on {self.world} × {self.device.type}"
            f"{f' (tp {config.tp})' if config.tp > 1 else ''} · global batch "
            f"{config.global_batch_size} × {config.seq_len} tokens · micro {self.micro} × "
            f"{self.accumulation} accumulation"
        )
        if self.checkpoint_found is not None:
            self._say(f"resuming from {self.checkpoint_found} (step {self.step})")
            if self.step >= config.steps:
                self._say(
                    f"nothing to do: the checkpoint is at step {self.step} >= steps={config.steps}"
                )
        for note in self.notes:
            self._say(f"note: {note}")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ----------------------------------------------------------------------------------------
# helpers
def _check_init_from(path: Path, model_config: ModelConfig | None) -> tuple[Path, str]:
    """``(path, description of the changed fields)`` when ``init_from`` can seed the run's
    model: a diffattn model directory whose model differs at most in
    :data:`INIT_FREE_FIELDS`; else :class:`ConfigError`."""
    if model_config is None:
        raise ConfigError("init_from", "applies to preset models; a model_factory builds its own")
    if not (path / "config.json").is_file():
        raise ConfigError("init_from", f"{path}: not a diffattn model directory (no config.json)")
    try:
        saved = ckpt.read_checkpoint_model_config(path)
    except ValueError as error:
        raise ConfigError("init_from", str(error)) from None
    diffs = ckpt.model_config_differences(saved, model_config)
    fixed = [d for d in diffs if d.split(":", 1)[0] not in INIT_FREE_FIELDS]
    if fixed:
        raise ConfigError(
            "init_from",
            f"{path} has a different model: {'; '.join(fixed)}; only "
            f"{' and '.join(INIT_FREE_FIELDS)} may change",
        )
    changed = [d.replace(" (checkpoint) vs ", " -> ").replace(" (config)", "") for d in diffs]
    return path, (f" ({', '.join(changed)})" if changed else "")
