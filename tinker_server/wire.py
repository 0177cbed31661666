"""The protobuf side of the Tinker wire protocol, as the local server reads and writes it.

Most bodies are JSON; `forward_backward` requests and the results of type
`ForwardBackwardOutput` and `SampleResponse` are protobuf (`tinker.proto.tinker_public_pb2`,
shipped with the SDK). Layouts (from the SDK's `proto/request_conv.py` and `response_conv.py`):
tokens are int32 bytes; tensors are dense bytes with a dtype enum and a shape; per-datum outputs
are one `ArrayRecord` whose `BatchedTensor` concatenates every datum's data with int64 byte
offsets. Anything the server cannot read is a `WireError` (answered as a user error).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from tinker.proto import tinker_public_pb2 as public_pb

__all__ = [
    "PROTOBUF",
    "ForwardBackwardCall",
    "SampledTokens",
    "WireDatum",
    "WireError",
    "decode_forward_backward",
    "encode_forward_backward_output",
    "encode_sample_response",
]

PROTOBUF = "application/x-protobuf"

_NUMPY_OF_DTYPE = {
    public_pb.DTYPE_FLOAT32: np.dtype(np.float32),
    public_pb.DTYPE_INT64: np.dtype(np.int64),
    public_pb.DTYPE_INT32: np.dtype(np.int32),
}
_STOP_REASON = {"stop": public_pb.STOP_REASON_STOP, "length": public_pb.STOP_REASON_LENGTH}


class WireError(ValueError):
    """A request body the server cannot decode; the message says what is wrong."""


@dataclass
class WireDatum:
    """One training example: input tokens and the loss inputs, one entry per input position."""

    tokens: np.ndarray
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class ForwardBackwardCall:
    """A decoded `forward_backward` (or `forward`) request."""

    model_id: str
    seq_id: int
    loss_fn: str
    forward_only: bool
    loss_fn_config: dict[str, float]
    data: list[WireDatum]


@dataclass
class SampledTokens:
    """One sampled sequence: its tokens, their logprobs and why it stopped."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str


def decode_forward_backward(body: bytes) -> ForwardBackwardCall:
    """Parse a protobuf `ForwardBackwardRequest` (already decompressed)."""
    message = public_pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception as e:  # protobuf raises its own DecodeError
        raise WireError(f"forward_backward body is not a ForwardBackwardRequest: {e}") from e
    config = {key: float(value) for key, value in message.loss_fn_config.items()}
    for key, value in message.loss_fn_config_v2.items():
        if value.HasField("number"):
            config[key] = float(value.number)
        else:
            raise WireError(f"loss_fn_config[{key!r}] is text; the server takes numbers only")
    data = [_decode_datum(d) for d in message.data]
    return ForwardBackwardCall(
        model_id=message.model_id,
        seq_id=message.seq_id,
        loss_fn=message.loss_fn,
        forward_only=message.forward_only,
        loss_fn_config=config,
        data=data,
    )


def _decode_datum(datum: public_pb.Datum) -> WireDatum:
    tokens: list[np.ndarray] = []
    for chunk in datum.model_input:
        if chunk.WhichOneof("chunk") != "encoded_text":
            raise WireError(f"model_input chunk {chunk.WhichOneof('chunk')!r}: text only")
        tokens.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
    inputs = {name: _decode_tensor(name, t) for name, t in datum.loss_fn_inputs.items()}
    joined = np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.int32)
    return WireDatum(tokens=joined.astype(np.int64), inputs=inputs)


def _decode_tensor(name: str, tensor: public_pb.Tensor) -> np.ndarray:
    dtype = _NUMPY_OF_DTYPE.get(tensor.dtype)
    if dtype is None:
        raise WireError(f"loss_fn_inputs[{name!r}] has unsupported dtype {tensor.dtype}")
    if tensor.HasField("sparse_csr"):
        raise WireError(f"loss_fn_inputs[{name!r}] is sparse; the server takes dense tensors")
    if len(tensor.shape) > 1:
        raise WireError(
            f"loss_fn_inputs[{name!r}] has shape {list(tensor.shape)}: 2-D inputs (soft-target "
            "cross_entropy) are not served here; send one value per position"
        )
    array = np.frombuffer(tensor.dense, dtype=dtype)
    if list(tensor.shape) and int(np.prod(tensor.shape)) != array.size:
        raise WireError(f"loss_fn_inputs[{name!r}]: shape {list(tensor.shape)} vs {array.size}")
    return array


def encode_forward_backward_output(logprobs: list[np.ndarray], metrics: dict[str, float]) -> bytes:
    """A protobuf `ForwardBackwardOutput`: each datum's per-position logprobs, and metrics."""
    message = public_pb.ForwardBackwardOutput()
    message.loss_fn_output_type = "ArrayRecord"
    for key, value in metrics.items():
        message.metrics[key] = float(value)
    record = message.loss_fn_outputs.add()
    record.num_datums = len(logprobs)
    batched = record.fields["logprobs"]
    batched.dtype = public_pb.DTYPE_FLOAT32
    arrays = [np.asarray(lp, dtype=np.float32) for lp in logprobs]
    batched.data = b"".join(a.tobytes() for a in arrays)
    offsets = np.cumsum([0, *(a.nbytes for a in arrays)], dtype=np.int64)
    batched.offsets = offsets.tobytes()
    return message.SerializeToString()  # type: ignore[no-any-return]


def encode_sample_response(
    sequences: list[SampledTokens],
    prompt_logprobs: list[float] | None = None,
    topk_prompt: tuple[np.ndarray, np.ndarray] | None = None,
) -> bytes:
    """A protobuf `SampleResponse`; `prompt_logprobs[0]` is NaN (nothing precedes it);
    `topk_prompt` is token ids and logprobs, each `(prompt length, k)`."""
    message = public_pb.SampleResponse()
    for seq in sequences:
        out = message.sequences.add()
        out.stop_reason = _STOP_REASON[seq.stop_reason]
        out.tokens = np.asarray(seq.tokens, dtype=np.int32).tobytes()
        out.logprobs = np.asarray(seq.logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        message.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    if topk_prompt is not None:
        ids, logprobs = topk_prompt
        topk = message.topk_prompt_logprobs
        topk.length, topk.k = ids.shape
        topk.token_ids = np.ascontiguousarray(ids, dtype=np.int32).tobytes()
        topk.logprobs = np.ascontiguousarray(logprobs, dtype=np.float32).tobytes()
    return message.SerializeToString()  # type: ignore[no-any-return]
