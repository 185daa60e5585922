"""k3_lm load-time checks ([CFG-L1], [CFG-L3]) without a server."""

from pathlib import Path

import pytest

from k3backend.config import ConfigError
from k3backend.serving.lm_adapter import PARAMETERS, _check_instance_config
from k3backend.serving.triton_io import ModelParams, resolve_device_dtype

GOOD = {"max_batch_size": 1, "model_transaction_policy": {"decoupled": True},
        "instance_group": [{"kind": "KIND_MODEL", "count": 1}]}


@pytest.mark.parametrize("change, message", [
    ({"instance_group": [{"kind": "KIND_GPU", "count": 1}]}, "KIND_MODEL"),
    ({"instance_group": [{"kind": "KIND_MODEL", "count": 2}]}, "exactly one instance"),
    ({"model_transaction_policy": {"decoupled": False}}, "decoupled must be true"),
    ({"max_batch_size": 4}, "max_batch_size must be 1"),
], ids=["kind-gpu", "two-instances", "not-decoupled", "batch"])
def test_CFG_L1_wrong_instance_config_fails_the_load(change, message):
    _check_instance_config(GOOD)
    with pytest.raises(ValueError, match=message):
        _check_instance_config({**GOOD, **change})


def test_CFG_L3_unknown_or_unparsable_parameters_name_the_parameter():
    def cfg(**params):
        return {"parameters": {k: {"string_value": v} for k, v in params.items()}}

    with pytest.raises(ConfigError, match=r"unknown parameter\(s\) \['max_num_seq'\]"):
        ModelParams(cfg(max_num_seq="4"), PARAMETERS, "k3_lm")
    p = ModelParams(cfg(max_num_seqs="four", default_thinking="maybe"), PARAMETERS, "k3_lm")
    with pytest.raises(ConfigError, match="parameter max_num_seqs: expected an integer"):
        p.int("max_num_seqs", lo=1)
    with pytest.raises(ConfigError, match="parameter default_thinking: expected true or false"):
        p.bool("default_thinking")
    assert ModelParams(cfg(), PARAMETERS, "k3_lm").int("default_max_tokens", lo=1) == 16
    p = ModelParams(cfg(gpu_memory_utilization="1.5"), PARAMETERS, "k3_lm")
    with pytest.raises(ConfigError, match=r"parameter gpu_memory_utilization: expected a finite number >= 0.01 and <= 1"):
        p.float("gpu_memory_utilization", lo=0.01, hi=1.0)


def test_repository_k3_lm_parameters_are_exactly_the_known_ones():
    """The shipped config.pbtxt lists every §4.4 parameter and nothing else."""
    text = (Path(__file__).resolve().parents[1] / "model_repository/k3_lm/config.pbtxt").read_text()
    keys = {line.split('"')[1] for line in text.splitlines() if line.startswith("parameters {")}
    assert keys == set(PARAMETERS)


def test_auto_device_and_dtype_on_cpu():
    device, dtype = resolve_device_dtype("auto", "auto", "k3_lm")
    import torch

    if not torch.cuda.is_available():
        assert (device.type, dtype) == ("cpu", torch.float32)
    assert resolve_device_dtype("cpu", "bfloat16", "k3_lm")[1] == torch.bfloat16
