"""The controller experiment's sweep: every cost setting and credit strategy, every seed.

::

    python -m selfcest.experiments.controller_sweep         # configs/controller_sweep.yaml
    python -m selfcest.experiments.controller_sweep seeds=[0] 'overrides=[trainer.steps=8]'
    python -m selfcest.experiments.controller_sweep --config-name controller_main  # for make run

Each run is `selfcest.experiments.controller.run` with ``experiment=<setting> trainer.seed=<seed>
algo.credit.strategy=<credit>`` and the sweep's ``overrides``, written to
``<output_dir>/<setting>-<credit>/seed<seed>``. The settings differ only in reward and credit, so
the runs of one seed share one warm start; `sweep` says how an interrupted sweep resumes and what it
writes.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from hydra.core.config_store import ConfigStore

from selfcest import machine
from selfcest.cli import register_schemas
from selfcest.configure import hydra_app, require, setting
from selfcest.experiments.common import compose, say
from selfcest.experiments.controller import POLICIES, refresh, run
from selfcest.experiments.controller_report import plot_by_size, plot_decisions
from selfcest.templates import environment


@dataclass
class SweepConfig:
    """Which controller runs the sweep makes."""

    experiments: list[str] = setting(help="cost settings (configs/experiment/<name>.yaml), each "
                                          "with the default credit",
                                     factory=lambda: ["controller_free", "controller_low",
                                                      "controller",
                                                      "controller_latency"])
    credit_experiment: str = setting("controller",
                                     help="the setting the credit strategies are compared on")
    credits: list[str] = setting(help="credit strategies compared on credit_experiment (the first "
                                      "is the default credit)",
                                 factory=lambda: ["broadcast", "ratio", "sibling",
                                                  "counterfactual"])
    seeds: list[int] = setting(help="trainer.seed of each repeat (it also seeds the model's init)",
                               factory=lambda: [0, 1, 2])
    overrides: list[str] = setting(help="key=value overrides applied to every run", factory=list)
    output_dir: str = setting("runs/controller_sweep", help="where runs and summary.md go")
    refresh: bool = setting(False, help=(
        "summarize every finished run again from its saved decisions with this version's "
        "summary and report (nothing is sampled or trained)"))
    results_file: str | None = setting(None, help=(
        "where to write the list of every finished run's record as JSON (null: "
        "<output_dir>/controller_sweep.json)"))

    def check(self) -> None:
        require(bool(self.experiments) and bool(self.credits) and bool(self.seeds), "experiments",
                "experiments, credits and seeds must each name at least one")

    def runs(self) -> list[tuple[str, str]]:
        """(setting, credit) pairs, each once: every setting under the first credit, then the
        credit experiment under every credit."""
        pairs = [(name, self.credits[0]) for name in self.experiments]
        pairs += [(self.credit_experiment, credit) for credit in self.credits]
        return list(dict.fromkeys(pairs))


def sweep(config: SweepConfig, log=say) -> Path:
    """Every run not done yet, seed by seed; then ``summary.md``.

    The runs of one seed share one warm start: the first run of the seed trains it, the others load
    it. A run whose ``results.json`` exists is not run again, and a warm start already saved in the
    first run's folder is not trained again: an interrupted sweep resumes where it stopped.
    ``summary.md`` (with ``delegation_rate.png`` and ``branching.png``) tabulates every run found,
    whether or not all of them are done yet, and ``results_file`` lists each run's
    `selfcest.experiments.controller.record` (the README's figures are read from the committed
    ``docs/results/controller_sweep.json``).
    """
    out = Path(config.output_dir)
    for seed in config.seeds:
        warm_start = None
        for name, credit in config.runs():
            folder = out / f"{name}-{credit}" / f"seed{seed}"
            if warm_start is None and (folder / "sft" / "config.json").exists():
                warm_start = folder / "sft"  # saved before an interruption: not trained again
            overrides = [f"trainer.seed={seed}", f"algo.credit.strategy={credit}",
                         f"trainer.output_dir={folder}", *config.overrides]
            if not (folder / "results.json").exists():
                log(f"sweep: {name} credit={credit} seed={seed}")
                if warm_start is not None:
                    overrides.append(f"warm_start.policy={warm_start}")
                run(compose(name, overrides), log)
            elif config.refresh:
                refresh(compose(name, overrides), log)
            warm_start = warm_start or folder / "sft"
    return write_summary(out, config)


def load_results(out: Path, config: SweepConfig) -> dict[tuple[str, str], list[dict]]:
    """The results.json of every finished run, by (setting, credit)."""
    found = {}
    for name, credit in config.runs():
        files = sorted((out / f"{name}-{credit}").glob("seed*/results.json"))
        if files:
            found[(name, credit)] = [json.loads(f.read_text()) for f in files]
    return found


def mean_rows(results: list[dict], policy: str, field: str) -> list[tuple[int, dict | None]]:
    """Per size, ``field``'s value averaged over seeds (and its intervals' bounds averaged:
    an indication of spread, not an interval of the mean)."""
    sizes = [row["size"] for row in results[0]["per_size"][policy]]
    series = []
    for i, size in enumerate(sizes):
        estimates = [r["per_size"][policy][i][field] for r in results
                     if r["per_size"][policy][i][field]]
        series.append((size, {k: statistics.fmean(e[k] for e in estimates)
                              for k in ("value", "low", "high")}
                       if estimates else None))
    return series


def write_summary(out: Path, config: SweepConfig) -> Path:
    """``summary.md``: one line per (setting, credit) over its finished seeds, and the
    per-size delegation rate and branching before and after RL, averaged over seeds."""
    results = load_results(out, config)
    out.mkdir(parents=True, exist_ok=True)
    rate, branching = {}, {}
    for (name, credit), runs in results.items():
        label = f"{name} ({credit})"
        if not rate:  # the warm start is the same for every setting of a seed
            rate["warm start"] = mean_rows(runs, POLICIES[0], "delegation_rate")
            branching["warm start"] = mean_rows(runs, POLICIES[0], "branching")
        rate[label] = mean_rows(runs, POLICIES[1], "delegation_rate")
        branching[label] = mean_rows(runs, POLICIES[1], "branching")
    plots = {}
    records = [run["record"] for runs in results.values() for run in runs if "record" in run]
    if results:
        plots = {"rate": plot_by_size(rate, "P(root delegates)", out / "delegation_rate.png").name,
                 "branching": plot_by_size(branching, "clones of the first call",
                                           out / "branching.png").name,
                 "decisions": plot_decisions(records, out / "decisions.png").name}
    records_file = Path(config.results_file or out / "controller_sweep.json")
    records_file.parent.mkdir(parents=True, exist_ok=True)
    records_file.write_text(json.dumps(records, indent=1) + "\n")
    text = environment(html=False).get_template("controller_sweep.md.j2").render(
        config=config, results=results, rate=rate, branching=branching, plots=plots,
        fmean=statistics.fmean, settings=setting_rows(records),
        machines=sorted({machine.one_line(run["machine"]) for runs in results.values()
                         for run in runs if run.get("machine")}))
    path = out / "summary.md"
    path.write_text(text)
    return path


def setting_rows(records: list[dict]) -> list[dict]:
    """One row per (setting, credit): the seeds' boundaries, and the delegation rate and
    clones per call of RL at each size, averaged over seeds."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["name"], r["credit"]), []).append(r)
    rows = []
    for (name, credit), runs in groups.items():
        sizes = runs[0]["sizes"]

        def mean_at(field: str, policy: str, i: int) -> float | None:
            values = [r[field][policy][i] for r in runs if r[field][policy][i] is not None]
            return statistics.fmean(values) if values else None

        rows.append({
            "name": name, "credit": credit, "cost": runs[0]["cost"], "lambda": runs[0]["lambda"],
            "seeds": [r["seed"] for r in runs], "sizes": sizes,
            "boundaries": [r["boundary"]["RL"] for r in runs],
            "p_delegate": [mean_at("p_delegate", "RL", i) for i in range(len(sizes))],
            "clones": [mean_at("clones_per_call", "RL", i) for i in range(len(sizes))],
            "oracles": [r["oracle_rl"] for r in runs],
        })
    return rows


def main() -> None:
    """The Hydra app over configs/controller_sweep.yaml."""
    register_schemas()
    ConfigStore.instance().store(name="sweep_schema", node=SweepConfig)
    hydra_app("controller_sweep", SweepConfig, sweep,
              program="python -m selfcest.experiments.controller_sweep")


if __name__ == "__main__":
    main()
