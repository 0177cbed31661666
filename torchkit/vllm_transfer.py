"""Weights into vLLM on GPUs through vLLM's own weight-transfer engines: NCCL, or CUDA IPC.

The shared-memory path (`torchkit/vllm_weights.py`) suits a CPU engine; on GPUs the weights should
go device to device. vLLM 0.31 ships both ends of that: the engine's (started with
`weight_transfer_config={"backend": "nccl" | "ipc"}`, `vllm/distributed/weight_transfer/`) and
the trainer's (`WeightTransferTrainerFactory.trainer_init(init_info, client=, source=)` once,
then `send_weights()` per sync: `start_weight_update`, `update_weights` run concurrently with
the NCCL broadcast (or carrying the IPC handles), `finish_weight_update`). This module hands
vLLM's trainer side the two things it asks for: a client that drives this process's `AsyncLLM`
(vLLM's `VLLMWeightSyncClient` protocol; its own clients speak HTTP or Ray) and a `WeightSource`
over a state dict (Hugging Face names, floating tensors in the engine's dtype, on the trainer's
GPU).

vLLM's trainer side is synchronous (it blocks in NCCL calls and on its client), so it runs in a
worker thread, and the client runs each engine call back on the event loop the engine lives on.
ipc: trainer and engine on one GPU; nccl: the engine on other GPUs, a rendezvous on 127.0.0.1.
vLLM is imported only inside functions: settings are checked without it.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Coroutine, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from torchkit.vllm_settings import VllmSettings
from unified.errors import BackendError

if TYPE_CHECKING:
    from vllm.distributed.weight_transfer.base import (
        ParamMeta,
        TrainerInitInfo,
        TrainerWeightTransferEngine,
        WeightSource,
    )

__all__ = [
    "TRANSFER_TIMEOUT_S",
    "EngineClient",
    "Pending",
    "WeightTransfer",
    "state_dict_source",
    "trainer_init_info",
]

TRANSFER_TIMEOUT_S = 300.0
"""Deadline of one engine call, of setting a transfer up, and of one sync's send."""

_T = TypeVar("_T")
_RENDEZVOUS_HOST = "127.0.0.1"  # the engine runs on this host: NCCL meets it here


class EngineClient:
    """vLLM's `VLLMWeightSyncClient` on an `AsyncLLM` of this process: each call, made from the
    thread vLLM's trainer side runs in, runs on the engine's event loop within `timeout_s`."""

    def __init__(
        self, engine: Any, loop: asyncio.AbstractEventLoop, timeout_s: float = TRANSFER_TIMEOUT_S
    ) -> None:
        self.engine = engine
        self.loop = loop
        self.timeout_s = timeout_s

    def _run(self, call: Coroutine[Any, Any, None]) -> None:
        future = asyncio.run_coroutine_threadsafe(call, self.loop)
        try:
            future.result(self.timeout_s)
        except TimeoutError:
            future.cancel()
            raise BackendError(
                f"a vLLM weight-transfer call took over {self.timeout_s:g} s"
            ) from None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        request = WeightTransferInitRequest(init_info=init_info)
        self._run(self.engine.init_weight_transfer_engine(request))

    def start_weight_update(self) -> None:
        self._run(self.engine.start_weight_update())

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._run(self.engine.update_weights(WeightTransferUpdateRequest(update_info=update_info)))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._run(self.engine.finish_weight_update(weight_version))


def wire_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """What `tensor` travels as: the engine's dtype if floating, else its own."""
    return dtype if tensor.is_floating_point() else tensor.dtype


class Pending:
    """The state dict the next send carries (what the source reads)."""

    def __init__(self) -> None:
        self.state_dict: dict[str, torch.Tensor] = {}


def state_dict_source(pending: Pending, dtype: torch.dtype, device: torch.device) -> WeightSource:
    """vLLM's `WeightSource` over `pending.state_dict`: its tensors in order, floating ones as
    `dtype`, on `device` (the trainer's GPU); what `metadata` declares, iteration yields."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class StateDictSource(WeightSource):
        def metadata(self) -> list[ParamMeta]:
            return [
                ParamMeta(name, wire_dtype(tensor, dtype), tuple(tensor.shape))
                for name, tensor in pending.state_dict.items()
            ]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in pending.state_dict.items():
                yield name, tensor.detach().to(device=device, dtype=wire_dtype(tensor, dtype))

    return StateDictSource()


def free_port() -> int:
    """A TCP port free on the rendezvous host now (NCCL's rendezvous listens on it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((_RENDEZVOUS_HOST, 0))
        port: int = s.getsockname()[1]
        return port


def trainer_init_info(settings: VllmSettings) -> TrainerInitInfo:
    """vLLM's trainer-side init info for `settings.weight_transfer`; the trainer is rank 0 (the
    sender), the engine's `tensor_parallel_size` workers follow it in NCCL's group."""
    if settings.weight_transfer == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        return NCCLTrainerInitInfo(
            master_address=_RENDEZVOUS_HOST,
            master_port=free_port(),
            world_size=1 + settings.tensor_parallel_size,
            rank=0,
        )
    if settings.weight_transfer == "ipc":
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        return IPCTrainerInitInfo(rank=0)
    raise ValueError(f"no vLLM transfer engine for weight_transfer={settings.weight_transfer!r}")


def _on_device(device: torch.device, call: Callable[[], _T]) -> _T:
    """`call()` with `device` current (CUDA's current device is per thread: vLLM's sender reads
    it for its NCCL endpoint, its IPC handles' GPU and its stream)."""
    torch.cuda.set_device(device)
    return call()


class WeightTransfer:
    """The trainer side of one engine's NCCL or IPC transfer: `open` once, `send` per sync."""

    def __init__(
        self, sender: TrainerWeightTransferEngine[Any], pending: Pending, device: torch.device
    ) -> None:
        self.sender = sender
        self.pending = pending
        self.device = device

    @classmethod
    async def open(cls, engine: Any, settings: VllmSettings) -> WeightTransfer:
        """Set the transfer up with `engine` (started with these `settings`), on the running
        loop: vLLM's `trainer_init` (for NCCL, the rendezvous of trainer and workers)."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        client = EngineClient(engine, asyncio.get_running_loop())
        device = torch.device("cuda", torch.cuda.current_device())
        pending = Pending()
        source = state_dict_source(pending, getattr(torch, settings.dtype), device)
        info = trainer_init_info(settings)
        try:
            async with asyncio.timeout(TRANSFER_TIMEOUT_S):
                sender = await asyncio.to_thread(
                    _on_device,
                    device,
                    lambda: WeightTransferTrainerFactory.trainer_init(
                        info, client=client, source=source
                    ),
                )
        except TimeoutError:
            raise BackendError(
                f"vLLM's {settings.weight_transfer} weight transfer was not set up within "
                f"{TRANSFER_TIMEOUT_S:g} s"
            ) from None
        return cls(sender, pending, device)

    async def send(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Send `state_dict` (Hugging Face names) into the paused engine: vLLM's `send_weights`
        (the engine's `update_weights` alongside the trainer's send), within the deadline."""
        self.pending.state_dict = state_dict
        try:
            async with asyncio.timeout(TRANSFER_TIMEOUT_S):
                await asyncio.to_thread(_on_device, self.device, self.sender.send_weights)
        except TimeoutError:
            raise BackendError(
                f"a vLLM weight transfer took over {TRANSFER_TIMEOUT_S:g} s; its group is "
                "unusable now (restart the engine)"
            ) from None

    def close(self) -> None:
        """Drop the trainer side's communicators."""
        self.sender.shutdown()
