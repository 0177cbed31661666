"""The protobuf side of the Tinker wire protocol, as the local server reads and writes it.

Most bodies are JSON; `forward_backward` requests and the results of type
`ForwardBackwardOutput` and `SampleResponse` are protobuf (`tinker.proto.tinker_public_pb2`,
shipped with the SDK). Layouts (from the SDK's `proto/request_conv.py` and `response_conv.py`):
tokens are int32 bytes; tensors are dense bytes (or, 2-D only, CSR: values, int64 row pointers
and column indices, 0 elsewhere) with a dtype enum and a shape; per-datum outputs are
`ArrayRecord`s whose `BatchedTensor` concatenates the data of consecutive datums of one trailing
shape with int64 byte offsets, one record per run (`(N,)` outputs: trailing shape `[]`; soft-target
`(N, K)` outputs: `[K]`). A loss input is `(N,)` or `(N, K)`; anything the server cannot read is
a `WireError` (answered as a user error).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import groupby
from typing import Any

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

_NUMPY_OF_DTYPE: dict[int, np.dtype[Any]] = {
    public_pb.DTYPE_FLOAT32: np.dtype(np.float32),
    public_pb.DTYPE_INT64: np.dtype(np.int64),
    public_pb.DTYPE_INT32: np.dtype(np.int32),
}
_MAX_DENSE_VALUES = 1 << 26
"""The most values a sparse input may expand to (256 MiB of float32): a bound on what a small
request can make the server allocate."""
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
    """A loss input as an `(N,)` or `(N, K)` array (a CSR tensor densified with 0)."""
    dtype = _NUMPY_OF_DTYPE.get(tensor.dtype)
    if dtype is None:
        raise WireError(f"loss_fn_inputs[{name!r}] has unsupported dtype {tensor.dtype}")
    shape = [int(n) for n in tensor.shape]
    if len(shape) > 2:
        raise WireError(
            f"loss_fn_inputs[{name!r}] has shape {shape}: {len(shape)}-D inputs are not served; "
            "send one value per position (N,) or K soft targets per position (N, K)"
        )
    if tensor.HasField("sparse_csr"):
        return _decode_csr(name, tensor.sparse_csr, dtype, shape)
    array = np.frombuffer(tensor.dense, dtype=dtype)
    if not shape:
        return array
    if int(np.prod(shape)) != array.size:
        raise WireError(
            f"loss_fn_inputs[{name!r}] declares shape {shape} but holds {array.size} values"
        )
    return array.reshape(shape)


def _decode_csr(
    name: str, csr: public_pb.SparseCsr, dtype: np.dtype[Any], shape: list[int]
) -> np.ndarray:
    """A CSR tensor (what the SDK sends for a mostly-zero 2-D `target_tokens` or `weights`,
    `TensorData.from_torch_sparse`), densified: 0 wherever no value is listed."""
    if len(shape) != 2:
        raise WireError(
            f"loss_fn_inputs[{name!r}] is sparse with shape {shape}: sparse tensors must be "
            "2-D (N, K); send a 1-D input dense"
        )
    rows, width = shape
    if rows * width > _MAX_DENSE_VALUES:
        raise WireError(
            f"loss_fn_inputs[{name!r}] is sparse with shape {shape}, over "
            f"{_MAX_DENSE_VALUES} values once dense; send fewer targets per position"
        )
    values = np.frombuffer(csr.values, dtype=dtype)
    crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
    col = np.frombuffer(csr.col_indices, dtype=np.int64)
    well_formed = (
        crow.size == rows + 1
        and crow.size > 0
        and crow[0] == 0
        and bool(np.all(np.diff(crow) >= 0))
        and crow[-1] == values.size == col.size
        and bool(np.all((col >= 0) & (col < width)))
    )
    if not well_formed:
        raise WireError(
            f"loss_fn_inputs[{name!r}] is not a valid CSR tensor of shape {shape} "
            f"({crow.size} row pointers, {col.size} column indices, {values.size} values); "
            "build it with TensorData.from_torch_sparse or send it dense"
        )
    dense = np.zeros(shape, dtype=dtype)
    dense[np.repeat(np.arange(rows), np.diff(crow)), col] = values
    return dense


def encode_forward_backward_output(logprobs: list[np.ndarray], metrics: dict[str, float]) -> bytes:
    """A protobuf `ForwardBackwardOutput`: each datum's logprobs, `(N,)` or `(N, K)`, and metrics.

    Consecutive datums of one trailing shape share an `ArrayRecord` (its `trailing_shape` is `[]`
    or `[K]`); the SDK rebuilds every datum's shape from its record and keeps datum order.
    """
    message = public_pb.ForwardBackwardOutput()
    message.loss_fn_output_type = "ArrayRecord"
    for key, value in metrics.items():
        message.metrics[key] = float(value)
    arrays = [np.ascontiguousarray(lp, dtype=np.float32) for lp in logprobs]
    runs = [list(run) for _, run in groupby(arrays, key=lambda a: a.shape[1:])] or [[]]
    for run in runs:
        record = message.loss_fn_outputs.add()
        record.num_datums = len(run)
        batched = record.fields["logprobs"]
        batched.dtype = public_pb.DTYPE_FLOAT32
        batched.trailing_shape.extend(run[0].shape[1:] if run else ())
        batched.data = b"".join(a.tobytes() for a in run)
        offsets = np.cumsum([0, *(a.nbytes for a in run)], dtype=np.int64)
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
