"""GPU weight transfer into vLLM (`weight_transfer: nccl | ipc`, torchkit/vllm_transfer.py).

On CPU: the setting's checks, the engine's device placement, and what the trainer side hands
vLLM (init infos, the weight source, the client's requests), checked against vLLM's own
dataclasses and its sender's own consistency check. On a GPU (skipped here): the real transfer,
through `VllmSampler.load_weights`, checked by the logprobs sampled after it.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from torchkit.builtin import build_model
from torchkit.vllm_settings import VllmSettings, check_settings, engine_arguments, engine_devices
from unified.errors import BackendError, ConfigError

# vLLM's GPU kernels against the trainer's recomputation in fp32 (CPU tests: 1e-5). Not yet
# measured: no machine here runs the CUDA vllm wheel (docs/engines.md, GPU weight transfer).
GPU_LOGPROB_TOLERANCE = 1e-3
PROMPT = "3 5 7 -> 22"


def gpus(monkeypatch: pytest.MonkeyPatch, count: int, current: int = 0) -> None:
    """Pretend this machine has `count` GPUs, the trainer on `current` (placement logic only)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)


def test_the_default_is_shared_memory_and_nothing_changes_for_vllm(
    policy: tuple[torch.nn.Module, Any, Path],
) -> None:
    settings = check_settings({}, policy[2])
    assert settings.weight_transfer == "shared_memory"
    assert engine_arguments(settings, policy[2])["weight_transfer_config"] is None
    assert engine_devices(settings) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU message")
@pytest.mark.parametrize("mode", ["nccl", "ipc"])
def test_on_cpu_nccl_and_ipc_are_one_clear_line(
    policy: tuple[torch.nn.Module, Any, Path], mode: str
) -> None:
    with pytest.raises(ConfigError) as error:
        check_settings({"weight_transfer": mode}, policy[2], key="local.vllm")
    message = str(error.value)
    assert message.startswith("config key 'local.vllm.weight_transfer': ")
    assert "needs CUDA" in message and "shared_memory" in message and "\n" not in message


def test_device_counts_each_mode_needs(
    policy: tuple[torch.nn.Module, Any, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = policy[2]
    gpus(monkeypatch, 1)
    assert check_settings({"weight_transfer": "ipc"}, directory).weight_transfer == "ipc"
    with pytest.raises(ConfigError, match=r"nccl needs 2 GPUs .* with one GPU use ipc"):
        check_settings({"weight_transfer": "nccl"}, directory)
    gpus(monkeypatch, 2)
    assert check_settings({"weight_transfer": "nccl"}, directory).weight_transfer == "nccl"
    with pytest.raises(ConfigError, match="tensor_parallel_size must be 1"):
        check_settings({"weight_transfer": "ipc", "tensor_parallel_size": 2}, directory)
    with pytest.raises(ConfigError, match="nccl needs 3 GPUs"):
        check_settings({"weight_transfer": "nccl", "tensor_parallel_size": 2}, directory)


def test_the_engine_runs_on_the_trainers_gpu_for_ipc_and_on_others_for_nccl(
    policy: tuple[torch.nn.Module, Any, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    gpus(monkeypatch, 3, current=1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert engine_devices(VllmSettings(weight_transfer="ipc")) == "5"
    assert engine_devices(VllmSettings(weight_transfer="nccl")) == "4"
    assert engine_devices(VllmSettings(weight_transfer="nccl", tensor_parallel_size=2)) == "4,6"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert engine_devices(VllmSettings(weight_transfer="nccl")) == "0"
    arguments = engine_arguments(VllmSettings(weight_transfer="nccl"), policy[2])
    assert arguments["weight_transfer_config"] == {"backend": "nccl"}


def test_the_nccl_and_ipc_init_infos_are_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    from torchkit.vllm_transfer import trainer_init_info

    nccl = trainer_init_info(VllmSettings(weight_transfer="nccl", tensor_parallel_size=2))
    assert isinstance(nccl, NCCLTrainerInitInfo) and nccl.backend == "nccl"
    assert (nccl.master_address, nccl.world_size, nccl.rank) == ("127.0.0.1", 3, 0)
    assert nccl.is_sender and 0 < nccl.master_port < 65536
    # The workers' side of the same rendezvous, as vLLM's trainer_init derives it, validates.
    NCCLWeightTransferInitInfo(
        master_address=nccl.master_address,
        master_port=nccl.master_port,
        rank_offset=1,
        world_size=nccl.world_size,
    )
    ipc = trainer_init_info(VllmSettings(weight_transfer="ipc"))
    assert isinstance(ipc, IPCTrainerInitInfo) and ipc.backend == "ipc" and ipc.is_sender
    with pytest.raises(ValueError, match="shared_memory"):
        trainer_init_info(VllmSettings())


def test_the_source_declares_what_it_yields_as_vllms_sender_checks_it(
    policy: tuple[torch.nn.Module, Any, Path],
) -> None:
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLTrainerWeightTransferEngine,
        NCCLWeightTransferUpdateInfo,
    )

    from torchkit.vllm_transfer import Pending, state_dict_source

    state_dict = dict(policy[0].state_dict())
    state_dict["counter"] = torch.arange(3)  # a non-floating tensor keeps its dtype
    pending = Pending()
    source = state_dict_source(pending, torch.bfloat16, torch.device("cpu"))
    pending.state_dict = state_dict
    meta = source.metadata()
    assert [m.name for m in meta] == list(state_dict)
    assert [m.shape for m in meta] == [tuple(t.shape) for t in state_dict.values()]
    assert {m.dtype for m in meta} == {torch.bfloat16, torch.int64}
    # vLLM's NCCL sender checks every yielded tensor against the declared metadata.
    sent = dict(NCCLTrainerWeightTransferEngine._checked_iter(source, meta))
    for name, tensor in state_dict.items():
        assert torch.equal(sent[name], tensor.to(sent[name].dtype))
    # The update info vLLM builds from the metadata validates, and its dtypes name torch's.
    fields = {
        "names": [m.name for m in meta],
        "dtype_names": [str(m.dtype).split(".")[-1] for m in meta],
        "shapes": [list(m.shape) for m in meta],
    }
    info = NCCLWeightTransferUpdateInfo(**fields)
    assert [getattr(torch, name) for name in info.dtype_names] == [m.dtype for m in meta]
    IPCWeightTransferUpdateInfo(**fields, ipc_handles=[{} for _ in meta])
    pending.state_dict = {"one": torch.ones(2)}  # the next sync's dict: read afresh
    assert [m.name for m in source.metadata()] == ["one"]


class RecordingEngine:
    """Test-only: `AsyncLLM`'s four weight-sync coroutines, recording what they receive."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.delay_s = delay_s
        self.thread: threading.Thread | None = None

    async def _record(self, name: str, argument: Any) -> None:
        self.thread = threading.current_thread()
        await asyncio.sleep(self.delay_s)
        self.calls.append((name, argument))

    async def init_weight_transfer_engine(self, request: Any) -> None:
        await self._record("init", request)

    async def start_weight_update(self) -> None:
        await self._record("start", None)

    async def update_weights(self, request: Any) -> None:
        await self._record("update", request)

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await self._record("finish", weight_version)


async def test_the_client_runs_each_call_on_the_engines_loop_as_vllms_requests() -> None:
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.base import (
        VLLMWeightSyncClient,
        WeightTransferInitRequest,
        WeightTransferUpdateRequest,
    )

    from torchkit.vllm_transfer import EngineClient

    engine = RecordingEngine()
    client = EngineClient(engine, asyncio.get_running_loop(), timeout_s=10)
    assert isinstance(client, VLLMWeightSyncClient)

    def sync() -> None:  # what vLLM's trainer side does, from its thread
        client.init_weight_transfer_engine({"packed": False})
        client.start_weight_update()
        client.update_weights({"names": ["w"]})
        client.finish_weight_update()

    await asyncio.to_thread(sync)
    assert engine.thread is threading.current_thread()  # the loop's thread
    assert [name for name, _ in engine.calls] == ["init", "start", "update", "finish"]
    assert engine.calls[0][1] == WeightTransferInitRequest(init_info={"packed": False})
    assert engine.calls[2][1] == WeightTransferUpdateRequest(update_info={"names": ["w"]})
    slow = EngineClient(RecordingEngine(delay_s=5), asyncio.get_running_loop(), timeout_s=0.1)
    with pytest.raises(BackendError, match=r"took over 0\.1 s"):
        await asyncio.to_thread(slow.start_weight_update)


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


async def synced_logprob_gaps(
    policy: tuple[torch.nn.Module, Any, Path], mode: str
) -> tuple[float, float]:
    """Start an engine with `weight_transfer: mode`, sync new weights through it, sample: the
    largest gap of the sampled logprobs to the new weights' and to the old weights'."""
    from tests.test_vllm_engine import encode, recomputed
    from torchkit.vllm_engine import VllmSampler
    from unified.types import SamplingParams

    old, tokenizer, directory = policy
    new = build_model("tiny", seed=1, tokenizer=tokenizer).eval()
    sampler = VllmSampler.start(directory, {"weight_transfer": mode, "kv_cache_gb": 0.25})
    try:
        state_dict = {name: t.cuda() for name, t in new.state_dict().items()}
        for version in (1, 2):  # the first sync sets the transfer up, the second reuses it
            await sampler.load_weights(state_dict, version=version)
        params = SamplingParams(temperature=1.0, max_tokens=8, seed=3)
        out = await sampler.sample(encode(tokenizer, PROMPT), params)
        assert out.policy_version == 2 and out.completion_ids
        sampled = torch.tensor(out.logprobs)
        to_new = (recomputed(new, out, 1.0) - sampled).abs().max().item()
        to_old = (recomputed(old, out, 1.0) - sampled).abs().max().item()
        assert torch.equal(
            sampler.weights()["model.norm.weight"], new.state_dict()["model.norm.weight"]
        )
        return to_new, to_old
    finally:
        sampler.shutdown()


@needs_gpu
async def test_ipc_transfer_on_one_gpu_samples_on_the_new_weights(
    policy: tuple[torch.nn.Module, Any, Path],
) -> None:
    to_new, to_old = await synced_logprob_gaps(policy, "ipc")
    assert to_new <= GPU_LOGPROB_TOLERANCE < to_old, (to_new, to_old)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
async def test_nccl_transfer_to_another_gpu_samples_on_the_new_weights(
    policy: tuple[torch.nn.Module, Any, Path],
) -> None:
    to_new, to_old = await synced_logprob_gaps(policy, "nccl")
    assert to_new <= GPU_LOGPROB_TOLERANCE < to_old, (to_new, to_old)


async def test_an_engine_started_for_ipc_takes_the_clients_init(
    policy: tuple[torch.nn.Module, Any, Path],
) -> None:
    """The control plane end to end (on CPU here): vLLM started with the `weight_transfer_config`
    these settings give takes, through `EngineClient`, the init vLLM's IPC sender sends (the
    data plane needs CUDA)."""
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from torchkit.vllm_transfer import EngineClient

    settings = VllmSettings(weight_transfer="ipc", kv_cache_gb=0.25)
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_arguments(settings, policy[2])))
    try:
        client = EngineClient(engine, asyncio.get_running_loop(), timeout_s=60)
        await asyncio.to_thread(client.init_weight_transfer_engine, {"packed": False})
        with pytest.raises(Exception, match="unexpected keyword argument 'bogus'"):
            await asyncio.to_thread(client.init_weight_transfer_engine, {"bogus": 1})
    finally:
        engine.shutdown()
        engine.shutdown = lambda timeout=None: None  # AsyncLLM.__del__ calls it again
