import re

import pytest

from selfcest.tasks.keyed_sum import (
    KEY_LETTERS,
    KeyedSumConfig,
    keyed_sum_splits,
    keyed_sum_tasks,
    keys_answer,
    load_keyed_sum,
)


def numbers(task):
    return {key: [int(v) for v in text.split(" ")] for key, text in task.context.items()}


def test_default_prompt_shows_keys_only():
    task = keyed_sum_tasks(1, seed=0)[0]
    assert task.prompt == "Add all numbers in L1 L2 L3 L4."
    assert list(task.context) == ["L1", "L2", "L3", "L4"]
    for text in task.context.values():
        assert re.fullmatch(r"\d( \d){3}", text)
        assert text not in task.prompt
    lists = numbers(task)
    assert task.answer == str(sum(sum(v) for v in lists.values()))
    assert task.metadata["sums"] == {key: sum(v) for key, v in lists.items()}
    assert task.source == "keyed_sum"


def test_inline_prompt_prints_every_list():
    task = keyed_sum_tasks(1, seed=0, config=KeyedSumConfig(inline=True))[0]
    c = task.context
    assert task.prompt == (
        f"Add all numbers.\n[L1] {c['L1']}\n[L2] {c['L2']}\n[L3] {c['L3']}\n[L4] {c['L4']}"
    )
    # The same draw as the keys-only variant: only the prompt differs.
    assert task.context == keyed_sum_tasks(1, seed=0)[0].context


def test_knobs():
    config = KeyedSumConfig(num_keys=7, list_len=3, min_value=10, max_value=99, key_prefix="K")
    tasks = keyed_sum_tasks(50, seed=4, config=config)
    assert tasks[0].prompt == "Add all numbers in K1 K2 K3 K4 K5 K6 K7."
    for task in tasks:
        lists = numbers(task)
        assert list(lists) == [f"K{i}" for i in range(1, 8)]
        assert all(len(v) == 3 and all(10 <= x <= 99 for x in v) for v in lists.values())
        assert int(task.answer) == sum(map(sum, lists.values()))
    values = {x for t in tasks for v in numbers(t).values() for x in v}
    assert min(values) < 20 and max(values) > 90  # the whole range is used


def test_deterministic_and_seed_dependent():
    assert keyed_sum_tasks(10, seed=1) == keyed_sum_tasks(10, seed=1)
    assert keyed_sum_tasks(10, seed=1) != keyed_sum_tasks(10, seed=2)
    assert keyed_sum_splits(seed=3, n_train=20, n_test=5, n_ood=5) == keyed_sum_splits(
        seed=3, n_train=20, n_test=5, n_ood=5
    )


def test_splits_disjoint_ood_longer_and_stable():
    splits = keyed_sum_splits(seed=0, n_train=200, n_test=50, n_ood=50)
    contexts = {
        name: [tuple(t.context.items()) for t in splits[name]] for name in ("train", "test", "ood")
    }
    assert [len(set(c)) for c in contexts.values()] == [200, 50, 50]
    assert not set(contexts["train"]) & set(contexts["test"])
    assert all(len(t.context) == 4 for t in splits.train + splits.test)
    assert all(len(t.context) == 6 for t in splits.ood)
    assert splits.ood[0].prompt == "Add all numbers in L1 L2 L3 L4 L5 L6."
    ids = [t.id for name in ("train", "test", "ood") for t in splits[name]]
    assert len(set(ids)) == len(ids) and ids[0] == "keyed_sum-train-0"
    # Asking for a different number of test or OOD tasks leaves train (and OOD) alone.
    other = keyed_sum_splits(seed=0, n_train=200, n_test=10, n_ood=20)
    assert other.train == splits.train and other.ood == splits.ood[:20]


def test_splits_stay_disjoint_when_ood_equals_train():
    tiny = KeyedSumConfig(num_keys=1, list_len=2, max_value=2)  # 9 distinct tasks
    splits = keyed_sum_splits(seed=0, train=tiny, ood=tiny, n_train=4, n_test=2, n_ood=3)
    every = [t.context["L1"] for name in ("train", "test", "ood") for t in splits[name]]
    assert len(set(every)) == 9
    with pytest.raises(ValueError, match="distinct"):
        keyed_sum_splits(seed=0, train=tiny, ood=tiny, n_train=4, n_test=2, n_ood=4)
    with pytest.raises(ValueError, match="only 9 distinct"):
        keyed_sum_tasks(10, config=tiny)


@pytest.mark.parametrize(
    "bad", [dict(num_keys=0), dict(list_len=0), dict(min_value=5, max_value=4),
            dict(key_prefix="L1"), dict(key_prefix="a b"), dict(key_prefix="")],
)
def test_invalid_config(bad):
    with pytest.raises(ValueError):
        KeyedSumConfig(**bad)


def test_unknown_split_name():
    with pytest.raises(KeyError, match="split"):
        keyed_sum_splits(n_train=1, n_test=1, n_ood=1)["validation"]


def test_modulus_reduces_the_answer_and_every_key_sum():
    config = KeyedSumConfig(num_keys=3, list_len=4, modulus=10)
    for task in keyed_sum_tasks(50, seed=1, config=config):
        lists = [[int(v) for v in task.context[k].split()] for k in ("L1", "L2", "L3")]
        assert task.answer == str(sum(map(sum, lists)) % 10)
        assert task.metadata["sums"] == {f"L{i + 1}": sum(xs) % 10 for i, xs in enumerate(lists)}
        assert task.prompt == "Add all numbers in L1 L2 L3 mod 10."
    inline = keyed_sum_tasks(1, seed=1,
                             config=KeyedSumConfig(num_keys=1, modulus=10, inline=True))[0]
    assert inline.prompt.startswith("Add all numbers mod 10.\n[L1] ")
    with pytest.raises(ValueError, match="modulus"):
        KeyedSumConfig(modulus=-1)


def test_inline_view_prints_the_same_lists_with_the_same_answer():
    from selfcest.tasks.keyed_sum import inline_view

    task = keyed_sum_tasks(1, seed=3, config=KeyedSumConfig(num_keys=2, modulus=10))[0]
    view = inline_view(task)
    assert view.answer == task.answer and view.context == task.context and view.id == task.id
    assert view.prompt == (f"Add all numbers mod 10.\n[L1] {task.context['L1']}\n[L2] "
                           f"{task.context['L2']}")
    assert inline_view(view) == view


def test_sizes_give_each_number_of_keys_its_own_disjoint_splits():
    shape = {"list_len": 3, "max_value": 3, "inline": True}
    train, test = (load_keyed_sum(split, n_train=20, n_test=5, n_ood=7, sizes=[2, 5], train=shape,
                                  ood={**shape, "num_keys": 9}) for split in ("train", "test"))
    for split, tasks, n in (("train", train, 20), ("test", test, 5)):
        assert [len(t.context) for t in tasks] == [2] * n + [5] * n
        assert len({t.id for t in tasks}) == 2 * n and tasks[n].id == f"keyed_sum-{split}-5k-0"
    assert not {t.prompt for t in train} & {t.prompt for t in test}
    ood = load_keyed_sum("ood", n_ood=7, sizes=[2, 5], ood={**shape, "num_keys": 9})
    assert [len(t.context) for t in ood] == [9] * 7


def test_a_clones_answer_is_the_total_of_the_keys_it_holds():
    (task,) = keyed_sum_tasks(1, seed=2, config=KeyedSumConfig(num_keys=3, modulus=10))
    sums = numbers(task)
    assert keys_answer(task, ["L1", "L3"]) == str((sum(sums["L1"]) + sum(sums["L3"])) % 10)
    assert keys_answer(task, []) is None and keys_answer(task, ["L9"]) is None


def test_letter_keys_are_single_letters_that_no_prompt_word_begins_with():
    config = KeyedSumConfig(num_keys=4, letter_keys=True, inline=True)
    assert config.keys() == ["B", "C", "D", "E"]
    task = keyed_sum_tasks(1, seed=0, config=config)[0]
    assert list(task.context) == ["B", "C", "D", "E"] and "[B]" in task.prompt
    assert not {"A", "I", "L", "O"} & set(KEY_LETTERS)
    with pytest.raises(ValueError, match="at most"):
        KeyedSumConfig(num_keys=len(KEY_LETTERS) + 1, letter_keys=True)
