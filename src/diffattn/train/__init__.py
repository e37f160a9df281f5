"""Training: recipes, the trainer, checkpoints, DDP/FSDP2, metrics.

```python
from diffattn.train import load_config, train

config = load_config("configs/tiny.yaml", ["model.attention=diff_v1", "steps=100"])
result = train(config, "runs/tiny-v1")
result.losses[100], result.final["lambda"], result.checkpoint
```

``train`` is ``Trainer(config, out).run()``; a :class:`Trainer` also runs step by step
(``build``, ``train_step``, ``evaluate``, ``save``) and trains any ``nn.Module`` through
``model_factory``.

The same entry point runs as ``diffattn train CONFIG`` / ``python -m diffattn.train CONFIG``
and under ``torchrun``; see ``docs/training.md``.
"""

from diffattn.train.config import (
    ConfigError,
    ModelSection,
    OptimSection,
    ScheduleSection,
    TrainConfig,
    apply_overrides,
    check_runtime,
    dump_config,
    load_config,
)
from diffattn.train.distributed import DistEnv, read_env, shutdown
from diffattn.train.metrics import read_metrics
from diffattn.train.optim import LRSchedule, build_optimizer, parameter_groups
from diffattn.train.parallel import build_model, parallelize
from diffattn.train.trainer import (
    Callback,
    Evaluation,
    StepState,
    Trainer,
    TrainingDiverged,
    TrainResult,
    evaluate,
    train,
)

__all__ = [
    "Callback",
    "ConfigError",
    "DistEnv",
    "Evaluation",
    "LRSchedule",
    "ModelSection",
    "OptimSection",
    "ScheduleSection",
    "StepState",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "TrainingDiverged",
    "apply_overrides",
    "build_model",
    "build_optimizer",
    "check_runtime",
    "dump_config",
    "evaluate",
    "load_config",
    "parallelize",
    "parameter_groups",
    "read_env",
    "read_metrics",
    "shutdown",
    "train",
]
