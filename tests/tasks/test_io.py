"""Task files that cannot be read stop a run before any compute, naming the file and the line."""

from __future__ import annotations

import json
import re

import pytest
from helpers import faulty_run

from selfcest.configure import ConfigError
from selfcest.tasks.io import MalformedRowError, load_jsonl, read_records
from selfcest.train.config import TrainConfig
from selfcest.train.setup import build_trainer

GOOD = json.dumps({"id": "a", "prompt": "What is 3 + 4?", "answer": "7"}).encode() + b"\n"
# Each bad file: its bytes, and the error naming its line (None: the file as a whole).
BAD = {
    "empty": (b"", None, "no task in it (an empty file?)"),
    "blank lines only": (b"\n  \n", None, "no task in it"),
    "not JSON": (GOOD + b'{"id": "b", "prompt": "p", \n', 2, "not valid JSON"),
    "missing field": (GOOD + b'{"id": "b", "prompt": "p"}\n', 2, "missing fields ['answer']"),
    "invalid UTF-8": (GOOD + GOOD + b'{"id": "c", "prompt": "caf\xe9", "answer": "1"}\n', 3,
                      "not valid UTF-8 (byte 0xe9 at column 27)"),
    "10 MB line": (GOOD + json.dumps({"id": "d", "prompt": "x" * 10_000_000,
                                      "answer": "1"}).encode() + b"\n" + GOOD,
                   2, "a line of 10000041 bytes, over the 4194304 a row may take "
                      "(task.params.max_line_bytes)"),
    "context of numbers": (b'{"id": "e", "prompt": "p", "answer": "1", "context": {"L1": 3}}\n', 1,
                           "the context must be an object of texts"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_task_file_names_its_line(tmp_path, case):
    data, line, message = BAD[case]
    path = tmp_path / "tasks.jsonl"
    path.write_bytes(data)
    where = f"{path} line {line}: " if line else f"{path}: "
    with pytest.raises(MalformedRowError, match=f"^{re.escape(where + message)}"):
        load_jsonl(path)


def test_a_long_line_is_refused_without_being_held_and_the_limit_can_be_raised(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_bytes(BAD["10 MB line"][0])
    (_, first), (where, long), (_, third) = read_records(path, max_line_bytes=1000)
    assert first["id"] == third["id"] == "a"  # reading goes on after it
    assert isinstance(long, MalformedRowError) and where.endswith("line 2")
    assert [t.id for t in load_jsonl(path, max_line_bytes=20_000_000)] == ["a", "d", "a"]


def test_a_json_array_with_invalid_utf8_names_its_line(tmp_path):
    path = tmp_path / "tasks.json"
    path.write_bytes(b'[\n{"id": "a", "prompt": "p", "answer": "1"},\n{"id": "b", "prompt": '
                     b'"\xff"}\n]')
    with pytest.raises(MalformedRowError,
                       match=r"tasks.json line 3: not valid UTF-8 \(byte 0xff\)"):
        list(read_records(path))


@pytest.mark.parametrize("case", ["empty", "invalid UTF-8", "10 MB line"])
def test_a_run_on_a_bad_task_file_stops_before_any_compute(tmp_path, case):
    data, line, message = BAD[case]
    (tmp_path / "bad.jsonl").write_bytes(data)
    config = TrainConfig()
    config.task.name, config.task.reward = "jsonl", "selfcest.rewards.qa:qa_reward"
    config.task.params = {"path": str(tmp_path / "bad.jsonl")}
    config.trainer.output_dir = str(tmp_path / "run")
    with pytest.raises(ConfigError, match=f"^task.params \\(jsonl\\): {tmp_path}/bad.jsonl"):
        build_trainer(config)
    assert not (tmp_path / "run").exists()  # no model, no folder, nothing written


def test_the_command_line_names_the_file_and_line_and_exits_2(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(BAD["invalid UTF-8"][0])
    bad = faulty_run(tmp_path / "run", "task=jsonl", f"task.params.path={path}",
                     f"task.eval_params.path={path}")
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert bad.stderr.strip().splitlines()[-1] == (
        f"selfcest: configuration error: task.params (jsonl): {path} line 3: not valid UTF-8 (byte "
        "0xe9 at column 27)")
