"""Every public name of DeepEP V1's package exists here and behaves as DeepEP's does.

Top level: ``Buffer``, ``Config``, ``EventOverlap``, ``topk_idx_t``, ``__version__``. ``deep_ep.utils``:
``EventOverlap``, ``EventHandle``, ``Config``, ``check_nvlink_connections``; the import a client makes to detect
DeepEP (``from deep_ep.utils import EventHandle, EventOverlap``) works in a fresh interpreter without a GPU.
CUDA is replaced by recording stand-ins where a test needs a stream.
"""
from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import deep_ep
import deep_ep.utils as utils
from deep_ep.backends.common import wait_event

REPO_ROOT = Path(__file__).resolve().parent.parent


class RecordingEvent:
    def __init__(self, *args, **kwargs) -> None:
        self.recorded_on = None
        self.done = False

    def record(self, stream=None) -> None:
        self.recorded_on = stream

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


class RecordingStream:
    def __init__(self, name: str) -> None:
        self.name, self.waited = name, []

    def wait_event(self, event) -> None:
        self.waited.append(event)


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA "available", with a current stream that records what it waits for."""
    streams = {"current": RecordingStream("compute")}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", RecordingEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: streams["current"])
    return streams


def test_top_level_names_match_deepep_v1():
    for name in ("Buffer", "Config", "EventOverlap", "topk_idx_t"):
        assert name in deep_ep.__all__
        assert getattr(deep_ep, name) is not None
    assert deep_ep.Buffer is __import__("deep_ep.buffer", fromlist=["Buffer"]).Buffer
    assert deep_ep.topk_idx_t in (torch.int64, torch.int32)
    assert isinstance(deep_ep.__version__, str) and deep_ep.__version__


def test_utils_reuses_the_package_classes():
    assert set(utils.__all__) >= {"EventOverlap", "EventHandle", "Config", "check_nvlink_connections"}
    assert utils.EventOverlap is deep_ep.EventOverlap
    assert utils.Config is deep_ep.Config
    config = utils.Config(20, 6, 256, 6, 128)
    assert config.get_nvl_buffer_size_hint(7168 * 2, 8) > 0


def test_client_detection_import_works_without_gpu():
    code = ("from deep_ep import Buffer\nfrom deep_ep.utils import EventHandle, EventOverlap\n"
            "overlap = EventOverlap(EventHandle())\noverlap.current_stream_wait()\n"
            "with overlap:\n    pass\nprint('ok', EventHandle().query())")
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok True"


def test_event_handle_without_cuda_is_complete(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    handle = utils.EventHandle()
    assert not handle.recorded and handle.query()
    handle.current_stream_wait()
    handle.synchronize()
    overlap = utils.EventOverlap(handle)
    overlap.current_stream_wait()
    with overlap:
        pass


def test_event_handle_records_on_the_current_stream(fake_cuda):
    handle = utils.EventHandle()
    assert handle.recorded
    assert handle.cuda_event.recorded_on is fake_cuda["current"]
    assert handle.query() is False
    fake_cuda["current"] = RecordingStream("other")
    utils.EventOverlap(handle).current_stream_wait()
    assert fake_cuda["current"].waited == [handle.cuda_event]
    handle.synchronize()
    assert handle.query() is True


def test_event_handle_as_previous_event_orders_the_comm_stream(fake_cuda):
    handle = utils.EventHandle()
    comm = RecordingStream("comm")
    wait_event(comm, utils.EventOverlap(handle))
    assert comm.waited == [handle.cuda_event]


def test_event_handle_without_cuda_as_previous_event_is_a_no_op(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    handle = utils.EventHandle()
    comm = RecordingStream("comm")
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: __import__("contextlib").nullcontext())
    wait_event(comm, utils.EventOverlap(handle))
    assert comm.waited == []


class ExplodingGroup:
    def size(self) -> int:
        raise AssertionError("the group must not be consulted")


def test_nvlink_check_without_cuda_has_nothing_to_check(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert utils.check_nvlink_connections(ExplodingGroup()) is None


def test_nvlink_check_passes_sxm_parts(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert utils.check_nvlink_connections(ExplodingGroup()) is None


class SizedGroup:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def test_nvlink_check_refuses_more_than_two_pcie_ranks(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-PCIE-40GB")
    with pytest.raises(RuntimeError, match="at most 2 ranks, got 4"):
        utils.check_nvlink_connections(SizedGroup(4))


def fake_pynvml(linked: set[frozenset]) -> types.ModuleType:
    module = types.ModuleType("pynvml")
    module.NVML_P2P_CAPS_INDEX_NVLINK, module.NVML_P2P_STATUS_OK = 3, 0
    module.calls = []
    module.nvmlInit = lambda: module.calls.append("init")
    module.nvmlShutdown = lambda: module.calls.append("shutdown")
    module.nvmlDeviceGetHandleByUUID = lambda uuid: uuid
    module.nvmlDeviceGetP2PStatus = lambda a, b, cap: 0 if frozenset((a, b)) in linked else 4
    return module


@pytest.mark.parametrize("linked", [True, False])
def test_nvlink_check_asks_nvml_about_each_pair_of_pcie_gpus(fake_cuda, monkeypatch, linked):
    uuids = ["GPU-aaaa", "GPU-bbbb"]
    nvml = fake_pynvml({frozenset(uuids)} if linked else set())
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-PCIE-40GB")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(uuid="aaaa"))

    def all_gather_object(output, obj, group=None):
        assert obj == "GPU-aaaa"
        output[:] = uuids

    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    if linked:
        utils.check_nvlink_connections(SizedGroup(2))
    else:
        with pytest.raises(RuntimeError, match="GPU GPU-aaaa and GPU GPU-bbbb .* not connected by NVLink"):
            utils.check_nvlink_connections(SizedGroup(2))
    assert nvml.calls == ["init", "shutdown"]


def test_nvlink_pairs_skip_ranks_sharing_a_gpu():
    asked = []
    utils._check_pairs(["GPU-a", "GPU-a"], lambda a, b: asked.append((a, b)) or False)
    assert asked == []
