"""``diffattn scaling``: loss against model size or training tokens, fitted (DIFF V1 Fig 3).

:func:`run_scaling` trains the recipe at every size (params axis) or to every token count
(tokens axis) for the Transformer baseline and the DIFF types, all on the same tokens in the
same order with the same seed, collects the validation losses, fits L(x) = a·x^−α + c per type
and reports the share of x each DIFF type needs to match the Transformer (:mod:`.report`).
:func:`fit_results` does the fitting and reporting alone, on finished runs or a file of points.

Layout of ``OUT``::

    scaling.yaml                     the resolved plan (every run's recipe, the points)
    runs/<attention>-<size>/         one training run each (metrics.jsonl, checkpoints/)
    report.md, results.json, scaling.png

Running the same command again reuses finished runs (and resumes interrupted ones from their
checkpoints) and rewrites the report; an ``OUT`` holding a different plan is refused unless
``overwrite`` is set.
"""

from diffattn.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    globals(),
    {
        "fit": ("PowerLawFit", "Share", "fit_power_law", "share_needed"),
        "plan": (
            "ATTENTIONS",
            "AXES",
            "COUNTS",
            "ScalingOptions",
            "default_recipe",
            "parse_size",
            "plan_runs",
        ),
        "points": ("Point",),
        "sweep": ("fit_results", "run_scaling"),
    },
)
