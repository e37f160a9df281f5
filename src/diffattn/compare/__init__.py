"""``diffattn compare``: baseline vs DIFF V1 vs DIFF V2 (or any arms), trained the same way, one
report.

A fair comparison (DIFF V1 §3) holds everything but the attention fixed: every run
starts from the same recipe, reads the same prepared tokens in the same order (the loader is
seeded by the run's seed, identical across attention types), uses the same initialisation seed,
and has the same parameter count (DIFF V1 matches the baseline by construction; a type whose
declaration ``matches_by_ffn``, as DIFF V2, through ``model.match_params``). Parameter counts
are reported beside the losses.

The arms are the default three types, or any registered type and ablations of one, spelled
``TYPE[:option=value,...]`` (:mod:`diffattn.compare.arms`), e.g. ``gda:ratio=3`` or
``diff_v1:lambda_init=0.8``; each is compared against the baseline
(:data:`~diffattn.compare.arms.REFERENCE`).

Layout of ``OUT``::

    compare.yaml            the resolved plan (recipe + overrides, attention types, seeds)
    runs/<arm>-seed<k>/     one training run each (metrics.jsonl, checkpoints/); an arm's
                            directory name is its spelling with ':' and ',' as '-'
    report.md, report.json  the results table, settings and λ summaries
    loss_curves.png         training and validation loss per attention type
    lambda.png              each arm's λ per layer over steps (DIFF V1 λ, DIFF V2 mean λ)
    retrieval/<arm>-seed<k>/retrieval.json   the retrieval experiment's runs
    retrieval_accuracy.png, retrieval_attention.png  its accuracy and attention plots

Two parts (``part``): ``lm``, language modelling on the recipe's data mix, and
``retrieval``, the token-level retrieval experiment of :mod:`diffattn.compare.retrieval`
(settings: the recipe's ``retrieval:`` section, ``--set retrieval.key=value``); ``all`` runs
both.

Running the same command again reuses finished runs (and resumes interrupted ones from their
checkpoints) and rewrites the report; an ``OUT`` holding a different plan is refused unless
``overwrite`` is set.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Any

from diffattn.compare.arms import Arm, matched_config, parse_arms
from diffattn.compare.evaluate import EvalSettings, MeasurementOptions
from diffattn.compare.language_modelling import (
    _Job,
    _train_and_measure,
    lm_finished_line,
    lm_summaries,
    lm_work,
)
from diffattn.compare.report import RunSummary, write_report
from diffattn.settings import Settings, nested, progress_switch, setting
from diffattn.train.cli import recipe_overrides

ATTENTIONS = ("baseline", "diff_v1", "diff_v2")
"""The default arms: the papers' three types."""
PARTS = ("all", "lm", "retrieval")
PLAN_NAME = "compare.yaml"
RETRIEVAL_KEY = "retrieval"


@dataclass
class CompareOptions(Settings):
    """What ``diffattn compare`` runs, each setting declared once with its option
    (:meth:`add_arguments`); ``None`` keeps the recipe's value. ``attentions`` and
    ``overrides`` given as lists are kept as tuples, as the command line gives them."""

    out: str | Path = setting(  # noqa: RUF009 (a field, as every setting())
        "runs/compare", help="output directory"
    )
    part: str = setting(
        "all",
        choices=PARTS,
        help="lm: language modelling; retrieval: the token-level retrieval experiment "
        "(scale it with --set retrieval.steps=..., retrieval.seeds=..., retrieval.grid=[...]); "
        "all: both (default)",
    )
    """``lm`` (language modelling), ``retrieval`` (the retrieval experiment) or ``all``."""
    config: str | Path | None = setting(  # noqa: RUF009 (a field, as every setting())
        None, help="a YAML recipe (default: the embedded compare recipe)"
    )
    """A YAML recipe (see ``configs/``); default: the embedded ``recipes/compare.yaml``."""
    steps: int | None = setting(
        None, help="optimizer steps per language-modelling run (retrieval: --set retrieval.steps=N)"
    )
    preset: str | None = setting(None, help="model preset (see `diffattn presets`)")
    seeds: int = setting(
        3,
        help="seeds per model in the language-modelling part (default {default}; verdicts need "
        ">= 2; the retrieval part's: --set retrieval.seeds=N)",
    )
    """Number of seeds: ``seed, seed + 1, ...`` from the recipe's seed; the claims are judged
    on the spread over seeds, so fewer than 2 leaves every verdict inconclusive."""
    jobs: int | None = setting(
        None,
        help="runs trained side by side (default: one per CPU core, one thread each; on CUDA one "
        "per visible device, each worker on its own device, at most devices × --jobs-per-device)",
    )
    """Runs trained side by side (``None``: automatic, see :func:`resolve_jobs`); on CUDA each
    worker holds its own device (:mod:`diffattn.compare.devices`)."""
    jobs_per_device: int = setting(
        1,
        metavar="K",
        help="CUDA only: let K runs share each device (default {default}), so --jobs may reach "
        "devices × K",
    )
    """On CUDA, how many runs may share one device (``--jobs`` up to devices × this)."""
    evaluate: bool = setting(
        True,
        flag="--no-eval",
        help="train and report losses only: no measurements, no claims table",
    )
    """Measure every trained model (:mod:`diffattn.compare.evaluate`) and judge the claims."""
    eval_settings: EvalSettings = nested(  # noqa: RUF009 (a field, as every setting())
        MeasurementOptions, MeasurementOptions.eval_settings, default=EvalSettings
    )
    """What is measured; on the command line, the options of :class:`MeasurementOptions`."""
    device: str | None = setting(None, help="auto, cpu or cuda (both parts)")
    attentions: tuple[str, ...] = setting(
        ATTENTIONS,
        flag="--attention",
        dest="attention",
        metavar="ARM",
        help="arms to compare: any registered attention type, or an ablation of one as "
        "TYPE:option=value,... (e.g. diff_v1:lambda_init=0.8); separated by spaces or commas "
        "(default: baseline diff_v1 diff_v2)",
    )
    """The arms (:mod:`diffattn.compare.arms`), as spelled; each is compared against the
    baseline."""
    overrides: Sequence[str] = recipe_overrides(
        "override a recipe value, e.g. --set optim.lr=1e-3 (repeatable)"
    )
    """``key.sub=value`` overrides applied to the recipe."""
    overwrite: bool = setting(False, help="replace an OUT holding a different comparison")
    progress: bool = progress_switch()

    def __post_init__(self) -> None:
        self.attentions = tuple(self.attentions)
        self.overrides = tuple(self.overrides)


@dataclass
class CompareResult:
    out_dir: Path
    runs: list[RunSummary]
    report: Path
    plots: list[Path]


def default_recipe() -> Path:
    """Path of the embedded recipe ``diffattn/recipes/compare.yaml``."""
    return Path(str(resources.files("diffattn.recipes").joinpath("compare.yaml")))


def read_recipe(path: Path) -> dict[str, Any]:
    """The recipe at ``path`` as a mapping, its ``base:`` chain merged in
    (:func:`diffattn.train.config.read_recipe`); ``ConfigError`` names what is wrong."""
    from diffattn.train.config import read_recipe as read_training_recipe

    return read_training_recipe(path)


def retrieval_settings(options: CompareOptions, recipe: dict[str, Any], device: str):
    """The retrieval experiment's settings: the recipe's ``retrieval:`` section with the
    ``retrieval.*`` overrides; its device is ``--device`` or the recipe's ``device``."""
    from diffattn.compare.retrieval import RetrievalSettings
    from diffattn.train import ConfigError
    from diffattn.train.config import apply_overrides

    section = recipe.get(RETRIEVAL_KEY) or {}
    if not isinstance(section, dict):
        raise ConfigError(RETRIEVAL_KEY, "expected a mapping of settings")
    mine = [o for o in options.overrides if o.strip().startswith(RETRIEVAL_KEY + ".")]
    data = apply_overrides({RETRIEVAL_KEY: {"device": device, **section}}, mine)[RETRIEVAL_KEY]
    if options.device is not None:
        data["device"] = options.device
    try:
        return RetrievalSettings.from_dict(data)
    except ValueError as error:
        message = str(error)
        if not message.startswith("retrieval"):
            message = f"retrieval: {message}"
        raise ConfigError(RETRIEVAL_KEY, message.partition(": ")[2]) from None


def arms_of(options: CompareOptions) -> tuple[Arm, ...]:
    """The arms ``options.attentions`` spells; ``ConfigError`` naming a bad or repeated one."""
    from diffattn.train import ConfigError

    try:
        return parse_arms(options.attentions, "--attention")
    except ValueError as error:
        raise ConfigError("--attention", str(error).partition(": ")[2]) from None


def plan_configs(options: CompareOptions) -> tuple[Any, dict[tuple[str, int], Any]]:
    """Validate everything and return (base config, {(arm name, seed): TrainConfig}).

    Raises ``ConfigError`` (a ``ValueError`` naming the key) before any file is written.
    """
    from diffattn.train import ConfigError, TrainConfig, check_runtime, read_env
    from diffattn.train.config import apply_overrides

    arms = arms_of(options)
    if options.seeds < 1:
        raise ConfigError("--seeds", f"must be >= 1, got {options.seeds}")
    if options.part not in PARTS:
        raise ConfigError("--part", f"must be one of {', '.join(PARTS)}, got {options.part!r}")
    overrides = [o for o in options.overrides if not o.strip().startswith(RETRIEVAL_KEY + ".")]
    if options.steps is not None:
        overrides.append(f"steps={options.steps}")
    if options.preset is not None:
        overrides.append(f"model.preset={options.preset}")
    if options.device is not None:
        overrides.append(f"device={options.device}")
    recipe = Path(options.config) if options.config is not None else default_recipe()
    data = read_recipe(recipe)
    data.pop(RETRIEVAL_KEY, None)

    def load_config(_: Path, items: list[str]) -> Any:
        return TrainConfig.from_dict(apply_overrides(data, items))

    base = load_config(recipe, overrides)
    env = read_env()
    if env.world_size > 1:
        raise ConfigError("environment", "diffattn compare runs in one process, not torchrun")
    configs = {}
    for seed_offset in range(options.seeds):
        for arm in arms:
            run_overrides = [*arm.recipe_overrides(), f"seed={base.seed + seed_offset}"]
            config = matched_config(arm, partial(load_config, recipe), [*overrides, *run_overrides])
            check_runtime(config, env)
            configs[(arm.name, base.seed + seed_offset)] = config
    return base, configs


def _plan_text(options: CompareOptions, base: Any, retrieval: Any) -> str:
    """The resolved plan as YAML; the attention field varies per run and is left out."""
    from dataclasses import asdict

    import yaml

    from diffattn.train import dump_config

    recipe = yaml.safe_load(dump_config(base))
    recipe["model"].pop("attention", None)
    recipe.pop("seed", None)
    plan = {
        "attentions": [arm.name for arm in arms_of(options)],
        "seeds": [base.seed + i for i in range(options.seeds)],
        "recipe": recipe,
        RETRIEVAL_KEY: {
            k: list(v) if isinstance(v, tuple) else v for k, v in asdict(retrieval).items()
        },
    }
    return yaml.safe_dump(plan, sort_keys=True)


def resolve_jobs(
    jobs: int | None, runs: int, device: str, per_device: int = 1
) -> tuple[int, int | None]:
    """(parallel runs, torch threads per run) for ``jobs`` (``None``: automatic).

    Automatic: on CPU one run per core, one thread each, as long as there are runs: small
    models use cores far better side by side than through intra-op threads; on CUDA one run per
    visible device (``per_device`` runs per device), each worker on its own device
    (:func:`diffattn.compare.devices.plan_workers`, which also names the devices)."""
    from diffattn.compare.devices import plan_workers

    jobs, threads, _ = plan_workers(jobs, runs, device, per_device)
    return jobs, threads


def run_compare(options: CompareOptions) -> CompareResult:
    """Run the parts of the comparison ``options.part`` names: train every (arm, seed)
    run of the plan on the same data, measure every trained model, judge the claims and write
    the report."""
    from diffattn.compare.devices import plan_workers
    from diffattn.compare.schedule import run_both, shared_plan
    from diffattn.fileio import use_plan_directory

    say = partial(print, flush=True) if options.progress else (lambda *a, **k: None)
    base, configs = plan_configs(options)
    arms = arms_of(options)
    recipe = Path(options.config) if options.config is not None else default_recipe()
    retrieval = retrieval_settings(options, read_recipe(recipe), str(base.device))
    # --jobs against the devices, for both parts, before any file is written
    if options.part in ("all", "retrieval"):
        runs = retrieval.seeds * len(arms)
        plan_workers(options.jobs, runs, retrieval.device, options.jobs_per_device)
    if options.part in ("all", "lm"):
        plan_workers(options.jobs, len(configs), str(base.device), options.jobs_per_device)
    out = Path(options.out)
    plan = _plan_text(options, base, retrieval)
    use_plan_directory(out, PLAN_NAME, plan, options.overwrite, "a comparison")

    started = time.perf_counter()
    section = None
    summaries: list[RunSummary] = []
    prepared = None
    shared = shared_plan(options, base, configs, retrieval)
    if shared is not None:  # one pool for both parts (diffattn.compare.schedule)
        from diffattn.compare.retrieval_report import retrieval_section

        per_type, summaries, prepared = run_both(
            options, base, configs, retrieval, out, say, shared
        )
        section = retrieval_section(out, retrieval, per_type)
    if shared is None and options.part in ("all", "retrieval"):
        from diffattn.compare.retrieval import run_all
        from diffattn.compare.retrieval_report import retrieval_section

        say("diffattn compare: the retrieval experiment")
        per_type = run_all(out, retrieval, arms, options.jobs, say, options.jobs_per_device)
        section = retrieval_section(out, retrieval, per_type)
    if shared is None and options.part in ("all", "lm"):
        summaries, prepared = _language_modelling(options, base, configs, out, say)
    report, plots = write_report(
        out, base, summaries, prepared, time.perf_counter() - started, retrieval=section
    )
    return CompareResult(out_dir=out, runs=summaries, report=report, plots=plots)


def _language_modelling(
    options: CompareOptions, base: Any, configs: dict, out: Path, say: Any
) -> tuple[list[RunSummary], Any]:
    """The language-modelling part: every run trained and measured; their summaries."""
    from diffattn.compare.devices import holding, plan_workers

    jobs, threads, devices = plan_workers(
        options.jobs, len(configs), str(base.device), options.jobs_per_device
    )
    work, prepared = lm_work(options, base, configs, out, say, threads, jobs == 1)
    done: dict[int, tuple[int, dict[str, Any], float, str]] = {}
    if jobs == 1:
        with holding(devices[0] if devices else None):
            for index, job in enumerate(work, start=1):
                say(f"\n[{index}/{len(work)}] {job.attention}, seed {job.seed} -> {job.run_dir}")
                done[index - 1] = _train_and_measure(job)
    else:
        done = _run_parallel(work, jobs, threads, say, devices)
    return lm_summaries(work, done), prepared


def _run_parallel(
    work: list[_Job],
    jobs: int,
    threads: int | None,
    say: Any,
    devices: list[str] | None = None,
    run: Any = _train_and_measure,
) -> dict:
    """Run the jobs in ``jobs`` worker processes (each through ``run``, a module-level
    function), reporting each as it finishes; with ``devices`` (one per worker) each worker
    holds its own for its life (:func:`diffattn.compare.devices.worker_pool`)."""
    from concurrent.futures import FIRST_COMPLETED, wait

    from diffattn.compare.devices import worker_pool

    on = f", on {', '.join(devices)}" if devices else ""
    say(
        f"training and measuring {len(work)} runs, {jobs} at a time "
        f"({threads} thread{'s' if threads != 1 else ''} each{on})"
    )
    done: dict[int, tuple[int, dict[str, Any], float, str]] = {}
    with worker_pool(jobs, devices) as pool:
        futures = {pool.submit(run, job): i for i, job in enumerate(work)}
        pending = set(futures)
        try:
            while pending:
                # each run is reported as it finishes (FIRST_EXCEPTION would wait for all)
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for future in finished:
                    index = futures[future]
                    done[index] = future.result()  # re-raises a worker's error here
                    say(lm_finished_line(work[index], done[index], len(done), len(work)))
        except BaseException:
            for future in pending:
                future.cancel()
            raise
    return done


__all__ = [
    "ATTENTIONS",
    "PARTS",
    "CompareOptions",
    "CompareResult",
    "MeasurementOptions",
    "default_recipe",
    "run_compare",
]
