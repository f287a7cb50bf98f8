"""`berth serve` gives each engine its own GPU or MIG instance."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.cli.topology import engine_devices, parse_gpu_list, serve_devices
from tests.stack import ROOT

TWO_GPUS = """\
GPU 0: NVIDIA H200 (UUID: GPU-3f2a9c1e-0000-1111-2222-333344445555)
GPU 1: NVIDIA H200 (UUID: GPU-7b1d0e2f-6666-7777-8888-999900001111)
"""

ONE_SPLIT = """\
GPU 0: NVIDIA H200 (UUID: GPU-aaaa0000-0000-0000-0000-000000000000)
  MIG 3g.71gb     Device  0: (UUID: MIG-1111aaaa-0000-0000-0000-000000000000)
  MIG 3g.71gb     Device  1: (UUID: MIG-2222bbbb-0000-0000-0000-000000000000)
GPU 1: NVIDIA H200 (UUID: GPU-bbbb0000-0000-0000-0000-000000000000)
"""


def test_whole_gpus_by_uuid() -> None:
    assert parse_gpu_list(TWO_GPUS) == [
        "GPU-3f2a9c1e-0000-1111-2222-333344445555",
        "GPU-7b1d0e2f-6666-7777-8888-999900001111",
    ]


def test_a_split_gpu_gives_one_engine_per_mig_instance() -> None:
    assert parse_gpu_list(ONE_SPLIT) == [
        "MIG-1111aaaa-0000-0000-0000-000000000000",
        "MIG-2222bbbb-0000-0000-0000-000000000000",
        "GPU-bbbb0000-0000-0000-0000-000000000000",
    ]


def test_no_nvidia_smi_output_means_no_devices_listed() -> None:
    assert parse_gpu_list("") == []
    assert parse_gpu_list("NVIDIA-SMI has failed") == []


def test_the_callers_visible_devices_are_split_not_renumbered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert engine_devices() == ["2", "3"]  # GPUs 2 and 3, not 0 and 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-1111aaaa,MIG-2222bbbb")
    assert engine_devices() == ["MIG-1111aaaa", "MIG-2222bbbb"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # hidden: the CPU
    assert engine_devices() == []


def test_device_picks_one_of_the_visible_gpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--device cuda:N serves on the N-th GPU this machine shows (of the
    caller's CUDA_VISIBLE_DEVICES when set), not on all of them."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert serve_devices("cuda:1") == ["3"]
    assert serve_devices("cuda") == serve_devices("auto") == ["2", "3"]
    assert serve_devices("cpu") == []
    with pytest.raises(ValueError, match="shows 2 GPU"):
        serve_devices("cuda:2")
    with pytest.raises(ValueError, match="cuda:N, not 'gpu1'"):
        serve_devices("gpu1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU: cuda is an error
    assert serve_devices("auto") == []
    with pytest.raises(ValueError, match="shows 0 GPU"):
        serve_devices("cuda")


def test_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    import torch

    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    devices = engine_devices()  # MIG instances count one each: CUDA shows one
    assert len(devices) >= cuda and (not devices) == (not cuda)


def test_cpu_defaults_count_the_cpus_this_process_may_use() -> None:
    """In a cpuset (a container's --cpuset-cpus, Kubernetes' static CPU
    manager) os.cpu_count() is the host's: serve sizes by the CPUs it has."""
    from services.cli.topology import (
        cpus_available,
        default_engines,
        default_gateways,
    )

    allowed = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(allowed)})
        assert cpus_available() == 1
        assert default_engines(0) == 1
        assert default_gateways(1) == 1
    finally:
        os.sched_setaffinity(0, allowed)
    assert cpus_available() == len(allowed)


@pytest.mark.parametrize(
    ("device", "says"),
    [("cuda:7", "--device cuda:7: this machine shows 2 GPU"), ("gpu1", "not 'gpu1'")],
)
def test_a_device_serve_cannot_use_is_refused_before_models_are_built(
    tmp_path: Path, device: str, says: str
) -> None:
    """Building the default models takes a while (minutes with a first GPU
    export): a --device that cannot work is refused first, with nothing
    built in the (empty) model repository."""
    repository = tmp_path / "repository"
    repository.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "BERTH_BUILD_MODELS"}
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "serve", "--device", device]
        + ["--model-repository", str(repository), "--build-models"],
        cwd=ROOT,
        env={**env, "CUDA_VISIBLE_DEVICES": "0,1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert says in done.stderr, done.stderr
    assert not list(repository.iterdir()), "models were built first"
