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

__all__, __getattr__, __dir__ = lazy_exports(
    globals(),
    {
        "config": (
            "ConfigError",
            "ModelSection",
            "OptimSection",
            "ScheduleSection",
            "TrainConfig",
            "apply_overrides",
            "check_runtime",
            "dump_config",
            "load_config",
        ),
        "distributed": ("DistEnv", "read_env", "shutdown"),
        "metrics": ("read_metrics",),
        "optim": ("LRSchedule", "build_optimizer", "parameter_groups"),
        "parallel": ("build_model", "parallelize"),
        "trainer": (
            "Callback",
            "Evaluation",
            "StepState",
            "TrainResult",
            "Trainer",
            "TrainingDiverged",
            "evaluate",
            "train",
        ),
    },
)
