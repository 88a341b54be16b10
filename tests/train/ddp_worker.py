"""Run by torchrun in test_distributed.py: two CPU processes train two steps, then each
writes a digest of its parameters (and what it rolled out) for the test to compare."""

import hashlib
import json
import sys
from pathlib import Path

import torch

from selfcest.budget import Budget
from selfcest.train.config import TrainConfig
from selfcest.train.trainer import GRPOTrainer

out = Path(sys.argv[1])
config = TrainConfig()
config.task.reward = sys.argv[2]
config.task.params = {"split": "train", "n_train": 32, "n_test": 4, "n_ood": 4}
config.rollout.budget = Budget(node_generation=16, tree_generation=32, node_context=256)
config.trainer.steps = 2
config.trainer.prompts_per_step = 4
config.trainer.tokens_per_micro_batch = 1024
config.trainer.lr = 1e-2
config.trainer.output_dir = str(out / "run")
config.log.progress = False
torch.set_num_threads(1)


def digest(model) -> str:
    h = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        h.update(name.encode() + param.detach().numpy().tobytes())
    return h.hexdigest()


trainer = GRPOTrainer(config)
before = digest(trainer.policy.model)
history = trainer.train()
trainer.close()
(out / f"rank{trainer.accelerator.process_index}.json").write_text(json.dumps({
    "world": trainer.accelerator.num_processes,
    "before": before,
    "after": digest(trainer.policy.model),
}))
