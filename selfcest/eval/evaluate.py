"""Budget-matched evaluation: clone trees against monolithic baselines over a budget sweep.

A *budget* of the sweep is the total number of tokens one task may make the model generate
(`Budget.tree_generation`, the matched inference budget of the paper). Three kinds of
method spend it:

- ``clones``: one tree per task, spawning allowed as the method's base budget says;
- ``monolithic``: one tree per task, spawning disabled (``max_depth = 0``);
- ``self_consistency``: k monolithic trees per task, each allowed ``budget // k`` tokens,
  and a majority vote over their normalised final answers.

Every method × budget × split becomes one `CellResult` (means over tasks, with percentile
bootstrap intervals over tasks for accuracy and token costs). `evaluate` is the Python API;
`run_evaluation` is the same with plain arguments, for the ``selfcest-eval`` command.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from statistics import fmean
from typing import Any, Protocol

from selfcest.budget import Budget
from selfcest.configure import Choice
from selfcest.eval.report import write_report
from selfcest.eval.results import CellResult, EvalResults
from selfcest.eval.stats import bootstrap_mean
from selfcest.policy import ClonePolicy, default_device
from selfcest.rewards.base import RewardFn, score_trees
from selfcest.rollout.backends.base import SamplingParams
from selfcest.rollout.backends.registry import BackendSettings
from selfcest.rollout.engine import RolloutEngine
from selfcest.task import Task
from selfcest.tasks.io import load_jsonl
from selfcest.tree import CloneTree

logger = logging.getLogger(__name__)

class MethodKind(Choice):
    clones = "clones"  # the policy may spawn clones
    monolithic = "monolithic"  # spawning disabled, one sample
    self_consistency = "self_consistency"  # spawning disabled, majority vote over samples


METHOD_KINDS = tuple(kind.value for kind in MethodKind)
TREES_DIR = "trees"
CONFIDENCE = 0.95  # level of every bootstrap interval


class PolicyLike(Protocol):
    """Anything that builds a rollout engine for a budget: a `ClonePolicy`, or a test double."""

    def engine(self, budget: Budget, sampling: SamplingParams | None,
               seed: int) -> RolloutEngine: ...


@dataclass(frozen=True)
class Method:
    """One way of spending a total-token budget on a task."""

    name: str  # label in tables, plots and file names; unique within one evaluation
    kind: MethodKind  # clones, monolithic or self_consistency (see the module docstring)
    # Base budget; the sweep sets tree_generation (node_generation is clamped to it), so
    # give a monolithic method a node_generation as large as the largest budget it should use.
    budget: Budget = field(default_factory=Budget)
    samples: int = 1  # k: trees per task, for self_consistency only
    # What this method's root reads instead of the task itself (e.g. the context inlined
    # for a monolithic baseline while the clone arm sees the keys only); None: the task.
    # The reward scores the trees against this view too; it must keep the task's answer.
    task_view: Callable[[Task], Task] | None = None
    policy: PolicyLike | None = None  # replaces `evaluate`'s policy (e.g. a separately trained arm)
    sampling: SamplingParams | None = None  # replaces `evaluate`'s sampling parameters

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise ValueError("a method needs a non-empty name")
        if self.kind not in METHOD_KINDS:
            raise ValueError(f"method {self.name!r}: kind must be one of {METHOD_KINDS}, got "
                             f"{self.kind!r}")
        if self.samples < 1:
            raise ValueError(f"method {self.name!r}: samples must be >= 1, got {self.samples}")
        if self.samples > 1 and self.kind != "self_consistency":
            raise ValueError(f"method {self.name!r}: only self_consistency draws several samples")
        if self.kind == "clones" and not self.budget.spawning:
            raise ValueError(
                f"method {self.name!r}: a clones method needs a budget that allows spawning "
                "(max_depth, spawn_rounds and clones_per_tree >= 1)"
            )

    def tree_budget(self, total: int) -> Budget:
        """The budget of each of this method's trees when a task may generate ``total`` tokens."""
        per_tree = total // self.samples
        if per_tree < 1:
            raise ValueError(
                f"method {self.name!r}: a budget of {total} tokens cannot be split into "
                f"{self.samples} samples"
            )
        budget = replace(
            self.budget,
            tree_generation=per_tree,
            node_generation=min(self.budget.node_generation, per_tree),
        )
        return budget if self.kind == "clones" else replace(budget, max_depth=0)

    def describe(self) -> dict[str, Any]:
        """The method's settings as JSON-ready data (callables and policies by name only)."""
        return {
            "name": self.name,
            "kind": self.kind,
            "samples": self.samples,
            "budget": asdict(self.budget),
            "task_view": getattr(self.task_view, "__qualname__", None) if self.task_view else None,
            "own_policy": self.policy is not None,
            "sampling": asdict(self.sampling) if self.sampling else None,
        }


# ---------------------------------------------------------------------------- voting

# A comma between digits that is followed by exactly three digits: a thousands separator.
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def normalize_answer(text: str) -> str:
    """An answer as votes compare it: case-folded, whitespace collapsed, thousands
    separators and trailing full stops removed (``"1,234."`` and ``" 1234"`` agree)."""
    text = _THOUSANDS.sub("", text)
    return " ".join(text.casefold().split()).rstrip(".").rstrip()


@dataclass(frozen=True)
class Vote:
    """The outcome of a majority vote over the samples of one task."""

    answer: str  # the elected normalised answer ("" when no sample answered)
    count: int  # samples that gave it
    index: int  # the first sample that gave it: the tree that stands for the vote


def majority_vote(answers: Sequence[str],
                  normalize: Callable[[str], str] = normalize_answer) -> Vote:
    """Elect the most frequent non-empty normalised answer.

    Empty answers (a sample cut by its budget before answering) do not vote, so silence
    never outvotes an answer. A tie goes to the answer given by the lowest-indexed sample,
    which makes the outcome a function of the samples alone.
    """
    if not answers:
        raise ValueError("a vote needs at least one answer")
    normalised = [normalize(a) for a in answers]
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, answer in enumerate(normalised):
        if answer:
            counts[answer] = counts.get(answer, 0) + 1
            first.setdefault(answer, i)
    if not counts:
        return Vote(answer="", count=0, index=0)
    # dicts keep insertion order and max() keeps the first maximum: ties go to the earliest.
    winner = max(counts, key=counts.__getitem__)
    return Vote(answer=winner, count=counts[winner], index=first[winner])


# ---------------------------------------------------------------------------- evaluation


@dataclass
class _Outcome:
    """One task's figures under one method (for self-consistency: those of its vote)."""

    correct: float  # 1.0 if the (elected) answer is correct
    reward: float  # reward_fn score of the tree that stands for the answer
    total_tokens: float  # generated tokens, summed over the task's trees
    critical_path_tokens: float  # longest critical path among the task's trees
    clones: float  # clones, summed over the task's trees
    spawn_error: float  # fraction of the task's trees with a spawn error entry
    budget_truncated: float  # fraction of the task's trees whose root stopped on a budget
    error: float  # fraction of the task's trees whose root failed


def evaluate(
    policy: PolicyLike | None,
    methods: Sequence[Method],
    splits: Mapping[str, Sequence[Task]],
    budgets: Sequence[int],
    reward_fn: RewardFn,
    out_dir: str | Path | None = None,
    *,
    sampling: SamplingParams | None = None,
    seed: int = 0,
    bootstrap_samples: int = 1000,
    normalize: Callable[[str], str] = normalize_answer,
) -> EvalResults:
    """Evaluate every method at every total-token budget on every task split.

    ``policy`` rolls out the methods that carry no policy of their own. ``splits`` maps a
    split name (e.g. ``"id"``, ``"ood"``) to its tasks; the first split is reported first.
    Every tree is scored with ``reward_fn`` (score and correctness are stored on the tree).
    The engine ``seed`` is shared by all methods, so the arms draw from the same random
    streams (common random numbers make their differences less noisy).

    With ``out_dir``, the trees are saved as JSONL under ``out_dir/trees/`` (one file per
    method, budget and split, each tree's ``info`` naming them) and `report.write_report`
    writes ``results.json``, ``results.csv``, ``results.md`` and the Pareto plots there.
    """
    _check(policy, methods, splits, list(budgets), bootstrap_samples)
    budgets = sorted(budgets)
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        (out / TREES_DIR).mkdir(parents=True, exist_ok=True)
    cells = []
    for method in methods:
        for budget in budgets:
            trees = _rollout(method, method.policy or policy, budget, splits, sampling, seed)
            for split, groups in trees.items():
                cell = _score_cell(method, budget, split, groups, reward_fn, normalize,
                                   bootstrap_samples, seed)
                if out is not None:
                    cell.trees_file = _save_trees(out, cell, groups)
                logger.info(
                    "%s @ %d on %s: accuracy %.3f, %.0f tokens/task", method.name, budget, split,
                    cell.accuracy.value, cell.total_tokens.value,
                )
                cells.append(cell)
    results = EvalResults(
        cells=cells,
        splits={name: len(tasks) for name, tasks in splits.items()},
        methods=[m.name for m in methods],
        budgets=list(budgets),
        settings={
            "seed": seed,
            "bootstrap_samples": bootstrap_samples,
            "confidence_level": CONFIDENCE,
            "sampling": asdict(sampling) if sampling else None,
            "methods": [m.describe() for m in methods],
        },
    )
    if out is not None:
        write_report(results, out)
    return results


def _check(
    policy: PolicyLike | None,
    methods: Sequence[Method],
    splits: Mapping[str, Sequence[Task]],
    budgets: list[int],
    bootstrap_samples: int,
) -> None:
    """Refuse a bad configuration before any compute is spent."""
    if not methods:
        raise ValueError("no method to evaluate")
    if not splits:
        raise ValueError("no task split to evaluate on")
    if not budgets or any(not isinstance(b, int) or b < 1 for b in budgets):
        raise ValueError(f"budgets must be positive integers, got {budgets}")
    if len(set(budgets)) != len(budgets):
        raise ValueError(f"budgets repeat: {budgets}")
    if bootstrap_samples < 1:
        raise ValueError(f"bootstrap_samples must be >= 1, got {bootstrap_samples}")
    for label, names in (("method", [m.name for m in methods]), ("split", list(splits))):
        slugs = [_slug(n) for n in names]
        if len(set(slugs)) != len(slugs):
            raise ValueError(f"{label} names must be unique (also as file names): {names}")
    for name, tasks in splits.items():
        if not tasks:
            raise ValueError(f"split {name!r} has no task")
    for method in methods:
        if method.policy is None and policy is None:
            raise ValueError(f"method {method.name!r} has no policy and evaluate got none")
        for budget in budgets:
            method.tree_budget(budget)  # raises when a budget cannot be split into k samples


def _rollout(
    method: Method,
    policy: PolicyLike,
    budget: int,
    splits: Mapping[str, Sequence[Task]],
    sampling: SamplingParams | None,
    seed: int,
) -> dict[str, list[tuple[Task, list[CloneTree]]]]:
    """Roll out every split in one engine call (one batch keeps the backend busy).

    Returns, per split, each task as the method saw it with its trees in sample order.
    """
    jobs = [(split, task) for split, tasks in splits.items() for task in tasks]
    seen = [method.task_view(task) if method.task_view else task for _, task in jobs]
    engine = policy.engine(method.tree_budget(budget), method.sampling or sampling, seed)
    trees: dict[int, list[CloneTree]] = defaultdict(list)
    for tree in engine.rollout(seen, samples_per_task=method.samples):
        trees[tree.task_index].append(tree)
    grouped: dict[str, list[tuple[Task, list[CloneTree]]]] = {split: [] for split in splits}
    for index, (split, _) in enumerate(jobs):
        group = sorted(trees[index], key=lambda t: t.sample_index)
        grouped[split].append((seen[index], group))
    return grouped


def _score_cell(
    method: Method,
    budget: int,
    split: str,
    groups: list[tuple[Task, list[CloneTree]]],
    reward_fn: RewardFn,
    normalize: Callable[[str], str],
    bootstrap_samples: int,
    seed: int,
) -> CellResult:
    outcomes = []
    for task, trees in groups:
        for tree in trees:
            tree.info.update(method=method.name, kind=method.kind, budget=budget, split=split)
        outcomes.append(_score_task(method, task, trees, reward_fn, normalize))

    def estimate(name: str):
        values = [getattr(o, name) for o in outcomes]
        return bootstrap_mean(values, bootstrap_samples, CONFIDENCE, seed)

    def mean(name: str) -> float:
        return fmean(getattr(o, name) for o in outcomes)

    return CellResult(
        method=method.name,
        kind=method.kind,
        samples=method.samples,
        budget=budget,
        split=split,
        tasks=len(groups),
        trees=sum(len(trees) for _, trees in groups),
        accuracy=estimate("correct"),
        total_tokens=estimate("total_tokens"),
        critical_path_tokens=estimate("critical_path_tokens"),
        clones=mean("clones"),
        spawn_error_rate=mean("spawn_error"),
        budget_truncated_rate=mean("budget_truncated"),
        error_rate=mean("error"),
        reward=mean("reward"),
    )


def _score_task(
    method: Method,
    task: Task,
    trees: list[CloneTree],
    reward_fn: RewardFn,
    normalize: Callable[[str], str],
) -> _Outcome:
    """Score every tree of one task; the vote's tree decides correctness and reward."""
    results = score_trees(trees, {task.id: task}, reward_fn)
    vote = majority_vote([tree.answer for tree in trees], normalize)
    if method.kind == "self_consistency":
        for i, tree in enumerate(trees):
            tree.info["vote"] = {
                "answer": vote.answer,
                "count": vote.count,
                "samples": len(trees),
                "elected": i == vote.index,
            }
    chosen = results[vote.index]
    costs = [tree.costs() for tree in trees]
    roots = [tree.root.finish_reason for tree in trees]
    return _Outcome(
        correct=float(chosen.correct),
        reward=float(chosen.score),
        total_tokens=float(sum(c.generated_tokens for c in costs)),
        critical_path_tokens=float(max(c.critical_path_tokens for c in costs)),
        clones=float(sum(c.clones for c in costs)),
        spawn_error=fmean(c.spawn_errors > 0 for c in costs),
        budget_truncated=fmean(r == "budget" for r in roots),
        error=fmean(r == "error" for r in roots),
    )


def task_correctness(trees: Sequence[CloneTree]) -> dict[str, float]:
    """Per task, 1.0 if its answer was right, read back from saved trees: a task's one tree,
    or for self-consistency the tree its vote elected (``info["vote"]["elected"]``, written by
    `_score_task`; the other samples do not stand for the task)."""
    return {tree.task_id: float(bool(tree.correct)) for tree in trees
            if tree.info.get("vote", {}).get("elected", True)}


def _slug(name: str) -> str:
    """A file-name-safe form of a method or split name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "_"


def _save_trees(out: Path, cell: CellResult, groups: list[tuple[Task, list[CloneTree]]]) -> str:
    name = f"{TREES_DIR}/{_slug(cell.method)}__{cell.budget}__{_slug(cell.split)}.jsonl"
    with open(out / name, "w", encoding="utf-8") as handle:
        for _, trees in groups:
            for tree in trees:
                handle.write(tree.to_json() + "\n")
    return name


# ---------------------------------------------------------------------------- plain arguments


def run_evaluation(
    model: str | Path | PolicyLike,
    tasks: Mapping[str, str | Path | Sequence[Task]],
    budgets: Sequence[int],
    methods: Sequence[Method | Mapping[str, Any]],
    reward_fn: RewardFn,
    out_dir: str | Path,
    *,
    budget: Budget | Mapping[str, int] | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    bootstrap_samples: int = 1000,
    serving: BackendSettings | None = None,
    device: str | None = None,
) -> EvalResults:
    """`evaluate` with plain arguments, for the ``selfcest-eval`` command.

    - ``model``: a saved policy folder (`ClonePolicy.from_pretrained`, loaded on ``device``,
      by default this process's GPU if there is one, and decoding with the backend of
      ``serving``, by default hf), or a policy object.
    - ``tasks``: split name -> a JSONL file of task records (`Task.to_dict`, one per line),
      or a list of tasks.
    - ``methods``: `Method`s or mappings such as ``{"name": "sc@4", "kind":
      "self_consistency", "samples": 4, "budget": {"node_generation": 512}, "model":
      "runs/b/policy"}``; ``budget`` there overrides fields of the base ``budget``, and
      ``model`` gives that method its own policy.
    - ``reward_fn``: the callable itself (the command resolves its dotted path).
    """
    base = budget if isinstance(budget, Budget) else Budget(**dict(budget or {}))
    policies: dict[str, PolicyLike] = {}

    def load(source: str | Path | PolicyLike) -> PolicyLike:
        if not isinstance(source, (str, Path)):
            return source
        if str(source) not in policies:
            policy = ClonePolicy.from_pretrained(source, device=device or default_device())
            policy.serving = serving or BackendSettings()
            policies[str(source)] = policy
        return policies[str(source)]

    parsed = [m if isinstance(m, Method) else method_from_mapping(m, base, load) for m in methods]
    splits = {
        name: load_jsonl(source) if isinstance(source, (str, Path)) else list(source)
        for name, source in tasks.items()
    }
    return evaluate(
        load(model),
        parsed,
        splits,
        budgets,
        reward_fn,
        out_dir,
        sampling=SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k),
        seed=seed,
        bootstrap_samples=bootstrap_samples,
    )


def method_from_mapping(
    data: Mapping[str, Any],
    base: Budget,
    load_policy: Callable[[str], PolicyLike] | None = None,
) -> Method:
    """A `Method` from config data: name, kind, samples, budget overrides, model, task_view."""
    known = {"name", "kind", "samples", "budget", "model", "task_view"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"method {data.get('name')!r}: unknown field(s) {unknown}; allowed: "
                         f"{sorted(known)}")
    if "name" not in data or "kind" not in data:
        raise ValueError(f"a method needs a name and a kind, got {dict(data)}")
    model = data.get("model")
    if model is not None and load_policy is None:
        raise ValueError(f"method {data['name']!r} names a model but no loader was given")
    return Method(
        name=str(data["name"]),
        kind=data["kind"],
        budget=replace(base, **dict(data.get("budget") or {})),
        samples=int(data.get("samples", 1)),
        task_view=data.get("task_view"),
        policy=load_policy(model) if model is not None else None,
    )
