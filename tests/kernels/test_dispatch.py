"""Backend selection: config value, KVBENCH_KERNELS override, forced backend, device rule, errors, logging."""

from __future__ import annotations

import logging

import pytest
import torch

from kvbench.errors import ConfigError
from kvbench.kernels import dispatch
from kvbench.kernels.merge import group_sum


@pytest.fixture(autouse=True)
def clean_backend(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    dispatch.set_backend("auto")
    yield
    dispatch.set_backend("auto")


def run_group_sum() -> str:
    weight = torch.tensor([[[1.0, 2.0, 4.0]]])
    out = group_sum(weight, torch.tensor([[[0, 1, 0]]]), 2)
    assert out.tolist() == [[[5.0, 2.0]]]
    return dispatch.ran["group_sum"]


def test_auto_runs_torch_on_cpu():
    assert run_group_sum() == "torch"


def test_config_value_selects_triton():
    dispatch.set_backend("triton")
    assert run_group_sum() == "triton"


def test_environment_overrides_config(monkeypatch):
    dispatch.set_backend("triton")
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    assert run_group_sum() == "torch"


def test_forced_backend_wins_and_is_restored(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    with dispatch.use_backend("triton"):
        assert run_group_sum() == "triton"
    assert run_group_sum() == "torch"


def test_bad_names_are_config_errors(monkeypatch):
    with pytest.raises(ConfigError, match="'cuda'.*accepted: auto, torch, triton"):
        dispatch.set_backend("cuda")
    monkeypatch.setenv(dispatch.ENV_VAR, "fast")
    with pytest.raises(ConfigError, match="'fast'.*KVBENCH_KERNELS"):
        run_group_sum()


def test_triton_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    dispatch.set_backend("triton")
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        run_group_sum()


def test_each_choice_is_logged_once(caplog):
    dispatch._logged.clear()
    with caplog.at_level(logging.INFO, logger="kvbench.kernels"):
        run_group_sum()
        run_group_sum()
        with dispatch.use_backend("triton"):
            run_group_sum()
    lines = [r.getMessage() for r in caplog.records if "group_sum" in r.getMessage()]
    assert lines == [
        "kernel group_sum runs on torch (cpu tensors, requested auto)",
        "kernel group_sum runs on triton (cpu tensors, requested triton)",
    ]
