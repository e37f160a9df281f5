"""The retrieval experiment of ``diffattn compare``: token-level associative recall among
look-alike distractors (:class:`diffattn.data.synthetic.RetrievalTask`), where the papers'
retrieval and noise-cancellation claims can be judged on a CPU.

Each arm (an attention type or an ablation of one, :mod:`diffattn.compare.arms`) is trained
from the same seed on the same stream of fresh episodes (the loss
on the answers only), then measured on fixed test episodes shared by every model:

* ``acc_<P>``: accuracy (greedy, one token) with P pairs in the context, for every P of the
  grid, and ``acc_mean`` / ``acc_mid`` / ``acc_hard`` (mean, middle and hardest point):
  the analogue of DIFF V1 Table 2, with the pair count in the role of the needle count;
* attention at each query position (the token that predicts the answer), per layer and head,
  through the probe: the mass of the applied map (A, or the signed A1 − λA2 of Eq.1 and the V2
  blog) on the queried pair, on its look-alike pairs, on the other pairs and on filler; and the
  same masses divided by the row's total (*shares*), because a differential row sums to 1 − λ.
  ``answer_share``, ``lookalike_share`` and ``noise_share`` (everything outside the queried
  pair) are the last layer's, mean over heads, queries and grid (DIFF V1 Table 3, Fig 1);
* ``qacc_<b>`` / ``qdrop_<b>``: accuracy with every attention logit quantized to b bits
  (:func:`diffattn.eval.outliers.quantize_absmax`, per head and row) and its drop from the
  unquantized accuracy (DIFF V1 Fig 8);
* ``lambda``: the λ per layer at the end, under the type's ``lambda_key`` (DIFF V1's λ of Eq.2,
  DIFF V2's mean token λ).

:func:`measure` takes any model the probe observes (diffattn, Hugging Face, Dex), so a
researcher's own attention variant can be measured on the same episodes; :func:`train_model`
trains any module whose forward takes ``input_ids`` and returns ``.logits``.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from diffattn.compare.arms import Arm, parse_arm
from diffattn.data.synthetic import RetrievalTask

RESULT_NAME = "retrieval.json"


@dataclass(frozen=True)
class RetrievalSettings:
    """Everything the experiment does (the ``retrieval:`` section of the compare recipe)."""

    # task (diffattn.data.synthetic.RetrievalTask: its defaults, but a shorter context)
    context: int = 32
    queries: int = RetrievalTask.queries
    lookalikes: int = RetrievalTask.lookalikes
    filler: int = RetrievalTask.filler
    prefixes: int = RetrievalTask.prefixes
    suffixes: int = RetrievalTask.suffixes
    values: int = RetrievalTask.values
    grid: tuple[int, ...] = (4, 6, 8, 10)
    """Pair counts measured (the difficulty axis); training draws from the same range."""
    # model (the recipe's preset, resized) and training
    preset: str = "tiny"
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    """Baseline heads; each type uses them as its declaration says (DIFF V1 pairs them, DIFF V2
    doubles its query heads)."""
    steps: int = 900
    batch_size: int = 32
    """Episodes per optimizer step."""
    lr: float = 3e-3
    warmup: int = 30
    min_lr_ratio: float = 0.1
    """Peak learning rate, reached linearly over ``warmup`` steps, then cosine decay to
    ``min_lr_ratio`` × ``lr`` at ``steps``."""
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    clip: float = 1.0
    """AdamW's weight decay and betas (DIFF V1 App. D); the gradient norm is clipped to
    ``clip``."""
    # measurement
    test_episodes: int = 64
    """Test episodes per grid point (each asks every one of its queries)."""
    test_seed: int = 1234
    bits: tuple[int, ...] = (8, 6, 4)
    seeds: int = 3
    device: str = "auto"

    def __post_init__(self) -> None:
        task = self.task()  # validates the task fields
        if not self.grid:
            raise ValueError("retrieval.grid: give at least one pair count")
        for pairs in self.grid:
            task.check_pairs(pairs)
        positive = ("d_model", "n_layers", "n_heads", "steps", "batch_size", "test_episodes")
        for name in (*positive, "seeds"):
            if getattr(self, name) < 1:
                raise ValueError(f"retrieval.{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("retrieval.lr must be > 0 and retrieval.min_lr_ratio in [0, 1]")
        if self.n_heads % 2:
            raise ValueError("retrieval.n_heads must be even (DIFF V1 pairs the heads)")
        if self.d_model % self.n_heads:
            raise ValueError("retrieval.d_model must be a multiple of retrieval.n_heads")
        if any(not 2 <= b <= 16 for b in self.bits):
            raise ValueError(f"retrieval.bits must lie in 2..16, got {self.bits}")

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> RetrievalSettings:
        data = dict(data or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"retrieval: unknown key(s) {unknown}; accepted: {', '.join(sorted(known))}"
            )
        for key in ("grid", "bits", "betas"):
            if key in data:
                value = data[key]
                data[key] = tuple(value) if isinstance(value, list | tuple) else (value,)
        try:
            return cls(**data)
        except TypeError as error:
            raise ValueError(f"retrieval: {error}") from None

    def task(self) -> RetrievalTask:
        """The task these settings describe (their fields of :class:`RetrievalTask`)."""
        return RetrievalTask(**{f.name: getattr(self, f.name) for f in fields(RetrievalTask)})

    def train_pairs(self) -> list[int]:
        """Pair counts training draws from: every count from the grid's smallest to largest."""
        return list(range(min(self.grid), max(self.grid) + 1))

    def model_config(self, arm: Arm | str):
        """The model of ``arm`` (an :class:`~diffattn.compare.arms.Arm` or its spelling),
        parameters matched across arms: by construction (DIFF V1), or by narrowing the SwiGLU
        where the type's declaration ``matches_by_ffn`` (DIFF V2,
        :func:`diffattn.presets.match_v2_params`).

        The SwiGLU is matched to the unit, not to a multiple of 64: at d_model 64 one 64-wide
        step is a fifth of the model's parameters, and models this small are too small for
        GEMM alignment to matter. The vocabulary (the task's, rounded up to 8) is not padded
        to 64 either.
        """
        from diffattn import presets

        arm = parse_arm(arm) if isinstance(arm, str) else arm
        task = self.task()
        vocab = -(-task.vocab_size // 8) * 8
        config = presets.get(
            self.preset,
            vocab_size=vocab,
            d_model=self.d_model,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            head_dim=self.d_model // self.n_heads,
            max_seq_len=task.seq_len,
            **arm.model_fields(),
        )
        if presets.ffn_matched_layers(config):
            config = presets.match_v2_params(config, 1)
        return config


def _tensors(episodes, device):
    import torch

    ids = torch.tensor(episodes.input_ids, dtype=torch.long, device=device)
    labels = torch.tensor(episodes.labels, dtype=torch.long, device=device)
    return ids, labels


def answer_loss(logits, labels):
    """Mean cross-entropy of the answers only: ``logits[:, t]`` predicts ``labels[:, t + 1]``,
    every other label is -100 (ignored)."""
    import torch.nn.functional as F

    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
        labels[:, 1:].reshape(-1),
        ignore_index=-100,
    )


def train_model(model, settings: RetrievalSettings, seed: int, device: str = "cpu") -> list:
    """Train ``model`` on fresh episodes drawn from ``random.Random(seed)``: the same stream
    for every model trained with ``seed``. AdamW (DIFF V1 App. D's β and weight decay), linear
    warmup, cosine decay to ``min_lr_ratio``. Returns ``[(step, loss), ...]`` every 10 steps."""
    import torch

    from diffattn.data.synthetic import retrieval_batch

    task = settings.task()
    rng = random.Random(f"retrieval-train:{seed}:{task}")
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=settings.lr,
        betas=settings.betas,
        weight_decay=settings.weight_decay,
    )

    def lr_at(step: int) -> float:
        if step < settings.warmup:
            return (step + 1) / settings.warmup
        progress = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
        floor = settings.min_lr_ratio
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    pairs = settings.train_pairs()
    curve = []
    model.train()
    for step in range(settings.steps):
        ids, labels = _tensors(retrieval_batch(task, rng, pairs, settings.batch_size), device)
        loss = answer_loss(model(input_ids=ids).logits, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.clip)
        optimizer.step()
        scheduler.step()
        if step % 10 == 0 or step == settings.steps - 1:
            curve.append((step, float(loss.detach())))
    model.eval()
    return curve


def _accuracy(model, ids, episodes, captures=()) -> tuple[list[bool], Any]:
    """Per-query correctness (greedy) of one batch, under a probe with ``captures``."""
    import torch

    from diffattn.probe import Probe

    with torch.no_grad(), Probe(model, list(captures)) as probe:
        logits = model(input_ids=ids).logits
    positions = torch.tensor(episodes.query_positions, device=logits.device)
    predicted = logits[:, positions].argmax(-1).cpu().tolist()
    correct = [
        p == a
        for row_p, row_a in zip(predicted, episodes.answers, strict=True)
        for p, a in zip(row_p, row_a, strict=True)
    ]
    return correct, probe


def _span_masks(episodes, seq_len: int):
    """``(B, Q, S)`` bool masks of the queried pair, its look-alikes and the other pairs."""
    import torch

    batch, queries = len(episodes.input_ids), len(episodes.query_positions)
    masks = {k: torch.zeros(batch, queries, seq_len, dtype=torch.bool) for k in
             ("answer", "lookalike", "other")}  # fmt: skip
    for b in range(batch):
        for q in range(queries):
            spans = {
                "answer": [episodes.answer_spans[b][q]],
                "lookalike": episodes.lookalike_spans[b][q],
                "other": episodes.other_spans[b][q],
            }
            for kind, items in spans.items():
                for start, end in items:
                    masks[kind][b, q, start:end] = True
    return masks


def attention_masses(maps: dict, episodes, seq_len: int) -> dict[str, Any]:
    """Per layer and head, mean over episodes and queries, of the applied map's mass on the
    queried pair, its look-alikes, the other pairs and the rest (filler, BOS, SEP, earlier
    queries), raw (signed) and divided by the row's total (shares).

    ``maps``: :class:`~diffattn.probe.AttentionMaps` result for one forward of ``episodes``
    with ``query_positions`` the episodes' query positions."""
    masks = _span_masks(episodes, seq_len)
    out: dict[str, Any] = {}
    for layer, calls in maps.items():
        applied = calls[0]["applied"].float().cpu()  # (B, H, Q, S)
        total = applied.sum(-1)  # (B, H, Q)
        raw = {}
        for kind, mask in masks.items():
            raw[kind] = (applied * mask[:, None].float()).sum(-1)
        raw["rest"] = total - raw["answer"] - raw["lookalike"] - raw["other"]
        raw["noise"] = total - raw["answer"]
        safe = total.where(total.abs() > 1e-12, total.new_tensor(math.nan))
        entry = {"total": total.mean((0, 2)).tolist()}
        for kind, mass in raw.items():
            entry[f"{kind}_mass"] = mass.mean((0, 2)).tolist()
            entry[f"{kind}_share"] = (mass / safe).nanmean((0, 2)).tolist()
        out[str(layer)] = entry
    return out


def measure(
    model, settings: RetrievalSettings, test_set: dict | None = None, device: str = "cpu"
) -> dict[str, Any]:
    """Every measurement of one trained model on the fixed test episodes (any model the probe
    observes; see the module docstring for the keys)."""
    from diffattn.data.synthetic import retrieval_test_set
    from diffattn.eval.outliers import quantize_absmax
    from diffattn.probe import AttentionMaps, Lambda, LogitTransform

    task = settings.task()
    if test_set is None:
        test_set = retrieval_test_set(
            task, list(settings.grid), settings.test_episodes, settings.test_seed
        )
    results: dict[str, Any] = {"attention": {}}
    quant: dict[int, list[bool]] = {b: [] for b in settings.bits}
    per_layer_share: dict[str, list] = {}
    for pairs, episodes in test_set.items():
        ids, _ = _tensors(episodes, device)
        maps = AttentionMaps(what=("applied",), query_positions=episodes.query_positions)
        lam = Lambda()
        correct, _ = _accuracy(model, ids, episodes, [maps, lam])
        results[f"acc_{pairs}"] = sum(correct) / len(correct)
        masses = attention_masses(maps.result(), episodes, task.seq_len)
        results["attention"][str(pairs)] = masses
        for layer, entry in masses.items():
            per_layer_share.setdefault(layer, []).append(entry)
        if "lambda" not in results:
            results["lambda"] = lam.result()
        for bits in settings.bits:
            transform = LogitTransform(
                lambda logits, allowed, layer, b=bits: quantize_absmax(logits, allowed, b)
            )
            quant[bits] += _accuracy(model, ids, episodes, [transform])[0]
    grid = list(settings.grid)
    accuracies = [results[f"acc_{p}"] for p in grid]
    results["acc_mean"] = sum(accuracies) / len(accuracies)
    results["acc_mid"] = results[f"acc_{grid[(len(grid) - 1) // 2]}"]
    results["acc_hard"] = results[f"acc_{grid[-1]}"]
    for bits, correct in quant.items():
        results[f"qacc_{bits}"] = sum(correct) / len(correct)
        results[f"qdrop_{bits}"] = results["acc_mean"] - results[f"qacc_{bits}"]
    last = per_layer_share[max(per_layer_share, key=int)]
    for kind in ("answer", "lookalike", "noise"):
        for unit in ("share", "mass"):
            per_point = [sum(e[f"{kind}_{unit}"]) / len(e[f"{kind}_{unit}"]) for e in last]
            results[f"{kind}_{unit}"] = sum(per_point) / len(per_point)
    results["chance"] = 1.0 / task.values
    return results


def example_maps(model, settings: RetrievalSettings, device: str = "cpu") -> dict[str, Any]:
    """The applied map of the last layer at one query position of the first test episode of
    the grid's middle point, per head (for the Fig 1 picture), with its spans."""
    from diffattn.data.synthetic import retrieval_test_set
    from diffattn.probe import AttentionMaps

    task = settings.task()
    pairs = list(settings.grid)[(len(settings.grid) - 1) // 2]
    episodes = retrieval_test_set(task, [pairs], settings.test_episodes, settings.test_seed)[pairs]
    ids, _ = _tensors(episodes, device)
    ids = ids[:1]
    position = episodes.query_positions[0]
    layer = len(model_view_layers(model)) - 1
    maps = AttentionMaps(what=("applied",), layers=[layer], query_positions=[position])
    correct, _ = _accuracy(model, ids, _first(episodes), [maps])
    applied = maps.result()[layer][0]["applied"][0, :, 0, : position + 1].float().cpu()
    return {
        "layer": layer,
        "position": position,
        "tokens": episodes.input_ids[0][: position + 1],
        "applied": applied.tolist(),
        "answer": list(episodes.answer_spans[0][0]),
        "lookalikes": [list(s) for s in episodes.lookalike_spans[0][0]],
        "others": [list(s) for s in episodes.other_spans[0][0]],
        "correct": bool(correct[0]),
        "pairs": pairs,
    }


def model_view_layers(model) -> list:
    from diffattn.probe.models import view

    return view(model).layers


def _first(episodes):
    return replace(
        episodes,
        input_ids=episodes.input_ids[:1],
        labels=episodes.labels[:1],
        pairs=episodes.pairs[:1],
        answers=episodes.answers[:1],
        answer_spans=episodes.answer_spans[:1],
        lookalike_spans=episodes.lookalike_spans[:1],
        other_spans=episodes.other_spans[:1],
    )


@dataclass
class RetrievalRun:
    """One (arm, seed) run: trained, measured, cached in ``run_dir/retrieval.json``."""

    arm: Arm
    seed: int
    settings: RetrievalSettings
    run_dir: Path
    threads: int | None = None
    results: dict[str, Any] = field(default_factory=dict)

    @property
    def attention(self) -> str:
        """The arm's name (its key in the results)."""
        return self.arm.name


def fingerprint(settings: RetrievalSettings, attention: str, seed: int) -> str:
    from diffattn.eval.common import fingerprint as digest

    return digest([asdict(replace(settings, seeds=1, device="any")), attention, seed])


def run_one(run: RetrievalRun) -> dict[str, Any]:
    """Train and measure one run (in this process or a worker, on the device the process
    holds: :mod:`diffattn.compare.devices`), reusing a cached result."""
    import torch

    from diffattn.compare.devices import device_in_use
    from diffattn.compare.evaluate import cached_results
    from diffattn.eval.common import resolve_device
    from diffattn.fileio import write_json
    from diffattn.model import DiffTransformerLM, count_parameters

    if run.threads is not None:
        torch.set_num_threads(run.threads)
    key = fingerprint(run.settings, run.attention, run.seed)
    cache = Path(run.run_dir) / RESULT_NAME
    cached = cached_results(cache, key)
    if cached is not None:
        return cached
    device = resolve_device(run.settings.device)
    used = device_in_use(run.settings.device)
    device = used if used.startswith("cuda") else device
    started = time.perf_counter()
    cpu_started = time.process_time()
    config = run.settings.model_config(run.arm)
    torch.manual_seed(run.seed)
    model = DiffTransformerLM(config).to(device)
    curve = train_model(model, run.settings, run.seed, device)
    train_seconds = time.perf_counter() - started
    train_cpu = time.process_time() - cpu_started
    results = measure(model, run.settings, device=device)
    results["train_cpu_seconds"] = train_cpu
    results["example"] = example_maps(model, run.settings, device)
    results.update(
        params=count_parameters(config),
        train_curve=curve,
        train_seconds=train_seconds,
        seconds=time.perf_counter() - started,
        cpu_seconds=time.process_time() - cpu_started,
        device=used,
    )
    cache.parent.mkdir(parents=True, exist_ok=True)
    write_json(cache, {"fingerprint": key, "results": results})
    return results


def plan_runs(
    out: Path, settings: RetrievalSettings, arms: tuple[Arm, ...], threads: int | None
) -> list[RetrievalRun]:
    """Every (arm, seed) run of the experiment, seed by seed, in ``out/retrieval``."""
    return [
        RetrievalRun(
            arm, seed, settings, Path(out) / "retrieval" / f"{arm.directory}-seed{seed}", threads
        )
        for seed in range(settings.seeds)
        for arm in arms
    ]


def finished_line(run: RetrievalRun, result: dict[str, Any], done: int, total: int) -> str:
    """The progress line of a finished run."""
    return f"  [{done}/{total}] {run.attention} seed {run.seed}: accuracy {result['acc_mean']:.3f}"


def by_type(
    runs: list[RetrievalRun], done: dict[int, dict[str, Any]], arms: tuple[Arm, ...]
) -> dict[str, list[dict[str, Any]]]:
    """``{arm name: [results per seed]}`` of finished ``runs`` (``done[i]``: run i's)."""
    per_type: dict[str, list[dict[str, Any]]] = {arm.name: [] for arm in arms}
    for index, run in enumerate(runs):
        per_type[run.attention].append(done[index])
    return per_type


def run_all(
    out: Path,
    settings: RetrievalSettings,
    arms: tuple[Arm, ...],
    jobs: int | None = None,
    say: Any = print,
    per_device: int = 1,
) -> dict[str, list[dict[str, Any]]]:
    """Every (arm, seed) run, ``jobs`` side by side (on CUDA each worker on its own
    device, ``per_device`` runs per device at most); ``{arm name: [results per seed]}`` with
    seeds ``0 .. settings.seeds - 1`` in order."""
    from diffattn.compare.devices import holding, plan_workers, worker_pool

    count = settings.seeds * len(arms)
    jobs, threads, devices = plan_workers(jobs, count, settings.device, per_device)
    runs = plan_runs(out, settings, arms, threads)
    on = f" on {', '.join(devices)}" if devices else ""
    say(f"retrieval: {len(runs)} runs, {jobs} at a time{on}")
    done: dict[int, dict[str, Any]] = {}
    if jobs == 1:
        with holding(devices[0] if devices else None):
            for index, run in enumerate(runs):
                done[index] = run_one(run)
                say(finished_line(run, done[index], index + 1, len(runs)))
    else:
        from concurrent.futures import as_completed

        with worker_pool(jobs, devices) as pool:
            futures = {pool.submit(run_one, run): i for i, run in enumerate(runs)}
            for future in as_completed(futures):
                index = futures[future]
                done[index] = future.result()
                say(finished_line(runs[index], done[index], len(done), len(runs)))
    return by_type(runs, done, arms)
