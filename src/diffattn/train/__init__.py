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

from diffattn.lazy_exports import lazy_exports

_EXPORTS = {
    "Callback": "trainer",
    "ConfigError": "config",
    "DistEnv": "distributed",
    "Evaluation": "trainer",
    "LRSchedule": "optim",
    "ModelSection": "config",
    "OptimSection": "config",
    "ScheduleSection": "config",
    "StepState": "trainer",
    "TrainConfig": "config",
    "TrainResult": "trainer",
    "Trainer": "trainer",
    "TrainingDiverged": "trainer",
    "apply_overrides": "config",
    "build_model": "parallel",
    "build_optimizer": "optim",
    "check_runtime": "config",
    "dump_config": "config",
    "evaluate": "trainer",
    "load_config": "config",
    "parallelize": "parallel",
    "parameter_groups": "optim",
    "read_env": "distributed",
    "read_metrics": "metrics",
    "shutdown": "distributed",
    "train": "trainer",
}
"""Each public name and the submodule that defines it (imported on first use)."""

__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
