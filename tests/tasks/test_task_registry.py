import json

import pytest

from selfcest.tasks import (
    MalformedRowError,
    check_params,
    load_jsonl,
    load_tasks,
    write_jsonl,
)
from selfcest.tasks.keyed_sum import KeyedSumConfig, keyed_sum_splits


def test_keyed_sum_by_name_with_mapping_configs():
    tasks = load_tasks(
        "keyed_sum", split="ood", seed=2, n_train=5, n_test=2, n_ood=3,
        train={"num_keys": 3}, ood={"num_keys": 5, "max_value": 5},
    )
    expected = keyed_sum_splits(
        2, KeyedSumConfig(num_keys=3), KeyedSumConfig(num_keys=5, max_value=5), 5, 2, 3
    ).ood
    assert tasks == expected and len(tasks[0].context) == 5


def test_arithmetic_and_gym_by_name():
    assert len(load_tasks("arithmetic", split="test", n_train=3, n_test=2)) == 2
    assert len(load_tasks("gym", dataset="chain_sum", size=2, seed=1)) == 2


def test_gym_splits_are_distinct_seed_ranges():
    train, test = (load_tasks("gym", dataset="chain_sum", size=20, split=split)
                   for split in ("train", "test"))
    assert train == load_tasks("gym", dataset="chain_sum", size=20, seed=0)
    assert {t.prompt for t in train}.isdisjoint({t.prompt for t in test})
    with pytest.raises(ValueError, match="gym split"):
        load_tasks("gym", dataset="chain_sum", size=2, split="dev")


def test_unknown_name_and_arguments():
    with pytest.raises(ValueError, match="unknown task source 'nope'"):
        load_tasks("nope")
    with pytest.raises(ValueError, match="keyed_sum"):
        load_tasks("keyed_sum", n_keys=3)


def test_jsonl_round_trip(tmp_path):
    tasks = load_tasks("keyed_sum", split="train", n_train=4, n_test=1, n_ood=1)
    path = tmp_path / "out" / "train.jsonl"
    assert write_jsonl(tasks, path) == 4
    assert load_jsonl(path) == tasks
    assert load_tasks("jsonl", path=path) == tasks


def test_load_jsonl_names_the_bad_line(tmp_path):
    good = {"id": "a", "prompt": "p", "answer": "1", "context": {}, "source": "s", "metadata": {}}
    cases = {
        "{broken": "line 2: not valid JSON",
        json.dumps({**good, "answer": " "}): "line 2: empty answer",
        json.dumps({"id": "b", "prompt": "p"}): r"line 2: missing fields \['answer'\]",
        json.dumps({**good, "extra": 1}): r"line 2: unknown fields \['extra'\]",
    }
    for bad, message in cases.items():
        path = tmp_path / "tasks.jsonl"
        path.write_text(json.dumps(good) + "\n" + bad + "\n")
        with pytest.raises(MalformedRowError, match=message):
            load_jsonl(path)


def test_mix_keeps_sources_apart_and_repeats():
    sources = [
        {"name": "keyed_sum", "params": {"split": "train", "n_train": 3, "n_test": 0, "n_ood": 0}},
        {"name": "keyed_sum", "params": {"split": "train", "n_train": 2, "n_test": 0, "n_ood": 0,
                                         "train": {"num_keys": 2}}, "repeat": 2},
    ]
    tasks = load_tasks("mix", sources=sources)
    assert len(tasks) == 3 + 2 * 2
    assert len({t.id for t in tasks[:5]}) == 5  # same generator, different sources: distinct ids
    assert tasks[0].id.startswith("0/") and tasks[3].id.startswith("1/")
    with pytest.raises(ValueError, match=r"sources.0 must be \{name, params, repeat\}"):
        load_tasks("mix", sources=[{"params": {}}])


def test_mix_sources_may_be_named_and_errors_name_them():
    one = {"name": "keyed_sum", "params": {"split": "train", "n_train": 2, "n_test": 0, "n_ood": 0}}
    tasks = load_tasks("mix", sources={"small": one, "twice": {**one, "repeat": 2}})
    assert [t.id.split("/")[0] for t in tasks] == ["small"] * 2 + ["twice"] * 4
    with pytest.raises(ValueError, match="sources.twice.params.n_train must be int; got '2'"):
        load_tasks("mix", sources={"twice": {**one, "params": {"n_train": "2"}}})
    with pytest.raises(ValueError,
                       match="sources.twice.params.split: task source 'jsonl' takes no 'split'"):
        load_tasks("mix", sources={"twice": {"name": "jsonl", "params": {"split": "x"}}})


def test_check_params_reads_nothing_and_names_arguments_by_the_callers_key(tmp_path):
    def key(arg):
        return f"task.params.{arg}"

    check_params("jsonl", {"path": str(tmp_path)}, key)  # it exists; nothing is read
    check_params("gym", {"dataset": "chain_sum", "size": 2, "anything": 1}, key)  # **config
    for params, message in [
        ({}, "task.params.path is required by task source 'jsonl'"),
        ({"path": 3}, "task.params.path must be str | Path; got 3"),
        ({"path": str(tmp_path / "none")}, "task.params.path: no file or folder"),
    ]:
        with pytest.raises(ValueError, match=message):
            check_params("jsonl", params, key)
    with pytest.raises(ValueError, match="task.params.seed must be int; got True"):
        check_params("arithmetic", {"seed": True}, key)
