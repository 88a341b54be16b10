"""Accelerate setups the trainer cannot run are refused before any compute, naming the fix.
(The sharded training itself runs in test_distributed.py: it needs two processes.)"""

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from accelerate import DistributedType, FullyShardedDataParallelPlugin

from selfcest.configure import ConfigError
from selfcest.train.sharding import check_supported, is_sharded

ROOT = Path(__file__).resolve().parents[2]


def accelerator(kind: DistributedType, **plugin) -> SimpleNamespace:
    """What check_supported reads of an `Accelerator` launched with such a config."""
    fsdp = FullyShardedDataParallelPlugin(**plugin) if kind == DistributedType.FSDP else None
    return SimpleNamespace(distributed_type=kind, state=SimpleNamespace(fsdp_plugin=fsdp))


def test_data_parallel_and_fsdp2_are_accepted():
    for kind in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        check_supported(accelerator(kind))
        assert not is_sharded(accelerator(kind))
    fsdp2 = accelerator(DistributedType.FSDP, fsdp_version=2, cpu_ram_efficient_loading=False)
    check_supported(fsdp2)
    assert is_sharded(fsdp2)


@pytest.mark.parametrize(("kind", "plugin", "named"), [
    (DistributedType.DEEPSPEED, {}, "configs/accelerate/fsdp.yaml"),
    (DistributedType.FSDP, {"fsdp_version": 1, "cpu_ram_efficient_loading": False},
     "fsdp_version: 2"),
    (DistributedType.FSDP, {"fsdp_version": 2, "cpu_ram_efficient_loading": True},
     "fsdp_cpu_ram_efficient_loading"),
])
def test_unsupported_setups_name_the_fix(kind, plugin, named):
    with pytest.raises(ConfigError, match=named):
        check_supported(accelerator(kind, **plugin))


def test_the_shipped_fsdp_config_is_one_the_trainer_runs():
    shipped = yaml.safe_load((ROOT / "configs" / "accelerate" / "fsdp.yaml").read_text())
    fsdp = shipped["fsdp_config"]
    check_supported(accelerator(DistributedType(shipped["distributed_type"]),
                                fsdp_version=fsdp["fsdp_version"],
                                cpu_ram_efficient_loading=fsdp["fsdp_cpu_ram_efficient_loading"]))
