"""``diffattn compare``: baseline vs DIFF V1 vs DIFF V2, trained the same way, one report.

A fair comparison (DIFF V1 §3) holds everything but the attention fixed: every run
starts from the same recipe, reads the same prepared tokens in the same order (the loader is
seeded by the run's seed, identical across attention types), uses the same initialisation seed,
and has the same parameter count (DIFF V1 matches the baseline by construction, DIFF V2 through
``model.match_params``). Parameter counts are reported beside the losses.

Layout of ``OUT``::

    compare.yaml            the resolved plan (recipe + overrides, attention types, seeds)
    runs/<attention>-seed<k>/   one training run each (metrics.jsonl, checkpoints/)
    report.md, report.json  the results table, settings and λ summaries
    loss_curves.png         training and validation loss per attention type
    lambda.png              DIFF V1 λ and DIFF V2 mean λ per layer over steps

Running the same command again reuses finished runs (and resumes interrupted ones from their
checkpoints) and rewrites the report; an ``OUT`` holding a different plan is refused unless
``overwrite`` is set.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from diffattn.compare.evaluate import EvalSettings
from diffattn.compare.report import RunSummary, summarise_run, write_report

ATTENTIONS = ("baseline", "diff_v1", "diff_v2")
PLAN_NAME = "compare.yaml"


@dataclass
class CompareOptions:
    """What ``diffattn compare`` runs; ``None`` keeps the recipe's value."""

    out: str | Path = "runs/compare"
    config: str | Path | None = None
    """A YAML recipe (see ``configs/``); default: the embedded ``recipes/compare.yaml``."""
    overrides: list[str] = field(default_factory=list)
    """``key.sub=value`` overrides applied to the recipe."""
    attentions: tuple[str, ...] = ATTENTIONS
    seeds: int = 1
    """Number of seeds: ``seed, seed + 1, ...`` from the recipe's seed."""
    steps: int | None = None
    preset: str | None = None
    device: str | None = None
    overwrite: bool = False
    progress: bool = True
    evaluate: bool = True
    """Measure every trained model (:mod:`diffattn.compare.evaluate`) and judge the claims."""
    eval_settings: EvalSettings = field(default_factory=EvalSettings)


@dataclass
class CompareResult:
    out_dir: Path
    runs: list[RunSummary]
    report: Path
    plots: list[Path]


def default_recipe() -> Path:
    """Path of the embedded recipe ``diffattn/recipes/compare.yaml``."""
    return Path(str(resources.files("diffattn.recipes").joinpath("compare.yaml")))


def plan_configs(options: CompareOptions) -> tuple[Any, dict[tuple[str, int], Any]]:
    """Validate everything and return (base config, {(attention, seed): TrainConfig}).

    Raises ``ConfigError`` (a ``ValueError`` naming the key) before any file is written.
    """
    from diffattn.train import ConfigError, check_runtime, load_config, read_env

    if not options.attentions:
        raise ConfigError("--attention", "name at least one attention type")
    unknown = [a for a in options.attentions if a not in ATTENTIONS]
    if unknown:
        raise ConfigError(
            "--attention", f"unknown type(s) {unknown}; choose from {', '.join(ATTENTIONS)}"
        )
    if len(set(options.attentions)) != len(options.attentions):
        raise ConfigError("--attention", "each attention type may appear once")
    if options.seeds < 1:
        raise ConfigError("--seeds", f"must be >= 1, got {options.seeds}")
    overrides = list(options.overrides)
    if options.steps is not None:
        overrides.append(f"steps={options.steps}")
    if options.preset is not None:
        overrides.append(f"model.preset={options.preset}")
    if options.device is not None:
        overrides.append(f"device={options.device}")
    recipe = Path(options.config) if options.config is not None else default_recipe()
    base = load_config(recipe, overrides)
    env = read_env()
    if env.world_size > 1:
        raise ConfigError("environment", "diffattn compare runs in one process, not torchrun")
    configs = {}
    for seed_offset in range(options.seeds):
        for attention in options.attentions:
            run_overrides = [f"model.attention={attention}", f"seed={base.seed + seed_offset}"]
            if attention == "diff_v2":
                run_overrides.append("model.match_params=true")
            config = load_config(recipe, [*overrides, *run_overrides])
            config.model_config()  # validates the model fields for this attention type
            check_runtime(config, env)
            configs[(attention, base.seed + seed_offset)] = config
    return base, configs


def _plan_text(options: CompareOptions, base: Any) -> str:
    """The resolved plan as YAML; the attention field varies per run and is left out."""
    import yaml

    from diffattn.train import dump_config

    recipe = yaml.safe_load(dump_config(base))
    recipe["model"].pop("attention", None)
    recipe.pop("seed", None)
    plan = {
        "attentions": list(options.attentions),
        "seeds": [base.seed + i for i in range(options.seeds)],
        "recipe": recipe,
    }
    return yaml.safe_dump(plan, sort_keys=True)


def _prepare_out_dir(out: Path, plan: str, overwrite: bool) -> None:
    """The output-directory rule (:func:`diffattn.fileio.check_output_directory`): ``out``
    is used when absent, empty or holding this same plan (``compare.yaml``); another
    non-empty directory is refused unless ``overwrite``, which replaces it as a whole."""
    from diffattn.fileio import check_output_directory, clear_output_directory

    plan_file = out / PLAN_NAME
    same = plan_file.is_file() and plan_file.read_text(encoding="utf-8") == plan
    replace = check_output_directory(
        out,
        overwrite,
        own=same and not overwrite,
        option="--out",
        hint="it holds other files or a comparison with different settings; choose "
        "another --out or pass --overwrite to replace it",
    )
    if replace:
        clear_output_directory(out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = plan_file.with_suffix(".tmp")
    tmp.write_text(plan, encoding="utf-8")
    tmp.replace(plan_file)


def run_compare(options: CompareOptions) -> CompareResult:
    """Train every (attention, seed) run of the plan on the same data and write the report."""
    from diffattn.compare.evaluate import eval_device, evaluate_checkpoint, held_out_documents
    from diffattn.data import prepare_data
    from diffattn.train import train
    from diffattn.train.checkpoint import latest_checkpoint

    say = print if options.progress else (lambda *a, **k: None)
    base, configs = plan_configs(options)
    out = Path(options.out)
    _prepare_out_dir(out, _plan_text(options, base), options.overwrite)

    started = time.perf_counter()
    say(f"diffattn compare: preparing data ({', '.join(base.data_config().sources)})")
    prepared = prepare_data(base.data_config(), progress=options.progress)

    held_out = None
    if options.evaluate:
        held_out = held_out_documents(base.data_config(), base.seq_len, options.eval_settings.seed)
    summaries: list[RunSummary] = []
    for index, ((attention, seed), config) in enumerate(configs.items(), start=1):
        run_dir = out / "runs" / f"{attention}-seed{seed}"
        resume = latest_checkpoint(run_dir / "checkpoints") is not None
        say(f"\n[{index}/{len(configs)}] {attention}, seed {seed} -> {run_dir}")
        result = train(config, run_dir, resume=resume, progress=options.progress, data=prepared)
        if result.stopped is not None:
            raise KeyboardInterrupt(f"{attention} seed {seed} stopped by {result.stopped}")
        summary = summarise_run(attention, seed, config, run_dir, result)
        if held_out is not None:
            say(f"evaluating {attention}, seed {seed}")
            summary.evals = evaluate_checkpoint(
                latest_checkpoint(run_dir / "checkpoints"),
                run_dir,
                options.eval_settings,
                held_out,
                device=eval_device(config),
            )
        summaries.append(summary)

    report, plots = write_report(out, base, summaries, prepared, time.perf_counter() - started)
    return CompareResult(out_dir=out, runs=summaries, report=report, plots=plots)


__all__ = ["ATTENTIONS", "CompareOptions", "CompareResult", "default_recipe", "run_compare"]
