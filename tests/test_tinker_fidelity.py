"""Every answer of the local Tinker server validates against the pinned SDK's own response types.

The server is driven through the real `tinker` SDK (0.38.0) and every HTTP answer it gives is
recorded on the server's side, then checked with the SDK's pydantic models: JSON answers with
`model_validate`, protobuf results with the SDK's own `deserialize_proto_response`, and each
`retrieve_future` result with the type its request kind resolves to in the SDK. A `type`
discriminator the SDK does not accept (`"save_sampler_weights"`) fails here, not in a user's run.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pydantic
import pytest
import tinker
import torch
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from tinker import types
from tinker.proto.response_conv import PROTO_SUPPORTED_TYPES, deserialize_proto_response

from tinker_server.compat import LOSS_NOTES, METHODS, sdk_losses, sdk_methods
from tinker_server.server import LocalServer
from tinker_server.training import LOSS_INPUTS, REFUSED_LOSSES
from torchkit.builtin import load_policy

DEADLINE_S = 60
PROMPT = [5, 6, 7, 8, 9]
BASE = "builtin:tiny"


@dataclass
class Exchange:
    """One request the server answered: what was asked and what it said."""

    method: str
    path: str
    request: bytes
    status: int = 0
    media_type: str = ""
    body: bytes = b""


class Recorder:
    """ASGI middleware keeping every exchange (test only)."""

    def __init__(self, app: ASGIApp, *, log: list[Exchange]) -> None:
        self.app = app
        self.log = log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        exchange = Exchange(scope["method"], scope["path"], b"")

        async def receiving() -> Message:
            message = await receive()
            exchange.request += message.get("body", b"")
            return message

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                exchange.status = message["status"]
                headers = dict(message.get("headers", []))
                exchange.media_type = headers.get(b"content-type", b"").decode()
            elif message["type"] == "http.response.body":
                exchange.body += message.get("body", b"")
            await send(message)

        await self.app(scope, receiving, sending)
        self.log.append(exchange)


EMPTY = None
"""An answer the SDK reads as `None` (finish, delete, publish ...): any 2xx, body unread."""

ROUTES: list[tuple[str, str, Any]] = [
    ("POST", r"/api/v1/client/config", types.ClientConfigResponse),
    ("POST", r"/api/v1/client/dynamic_config", types.ClientDynamicConfigResponse),
    ("GET", r"/api/v1/healthz", types.HealthResponse),
    ("GET", r"/api/v1/get_server_capabilities", types.GetServerCapabilitiesResponse),
    ("POST", r"/api/v1/create_session", types.CreateSessionResponse),
    ("POST", r"/api/v1/session_heartbeat", types.SessionHeartbeatResponse),
    ("POST", r"/api/v1/telemetry", types.TelemetryResponse),
    ("POST", r"/api/v1/sessions/[^/]+/finish", EMPTY),
    ("POST", r"/api/v1/get_info", types.GetInfoResponse),
    ("POST", r"/api/v1/create_sampling_session", types.CreateSamplingSessionResponse),
    ("GET", r"/api/v1/samplers/[^/]+", types.GetSamplerResponse),
    ("POST", r"/api/v1/asample", types.UntypedAPIFuture),
    *[
        ("POST", f"/api/v1/{kind}", types.UntypedAPIFuture)
        for kind in (
            "create_model",
            "forward_backward",
            "optim_step",
            "save_weights",
            "save_weights_for_sampler",
            "save_weights_external",
            "load_weights",
        )
    ],
    ("POST", r"/api/v1/retrieve_future", "future"),
]
"""Each endpoint of the SDK's training and sampling flow, and the SDK type it reads it as."""

REST_ROUTES: list[tuple[str, str, Any]] = [
    ("GET", r"/api/v1/training_runs", types.TrainingRunsResponse),
    ("GET", r"/api/v1/training_runs/[^/]+", types.TrainingRun),
    ("GET", r"/api/v1/training_runs/[^/]+/checkpoints", types.CheckpointsListResponse),
    ("GET", r"/api/v1/checkpoints", types.CheckpointsListResponse),
    ("DELETE", r"/api/v1/training_runs/[^/]+/checkpoints/[^/]+/[^/]+", EMPTY),
    ("POST", r"/api/v1/training_runs/[^/]+/checkpoints/[^/]+/[^/]+/publish", EMPTY),
    ("DELETE", r"/api/v1/training_runs/[^/]+/checkpoints/[^/]+/[^/]+/publish", EMPTY),
    ("PUT", r"/api/v1/training_runs/[^/]+/checkpoints/[^/]+/[^/]+/ttl", EMPTY),
    ("POST", r"/api/v1/weights_info", types.WeightsInfoResponse),
    (
        "GET",
        r"/api/v1/training_runs/[^/]+/checkpoints/external_weights/[^/]+/external_weights_urls",
        types.ExternalWeightsUrlsResponse,
    ),
    ("GET", r"/api/v1/external_files/.+", EMPTY),  # the files those URLs name
]
"""The `RestClient` endpoints, and the SDK type each answer is read as."""

FUTURE_RESULT: dict[str, Any] = {
    "create_model": types.CreateModelResponse,
    "forward_backward": types.ForwardBackwardOutput,
    "optim_step": types.OptimStepResponse,
    "save_weights": types.SaveWeightsResponse,
    "save_weights_for_sampler": types.SaveWeightsForSamplerResponseInternal,
    "save_weights_external": types.SaveWeightsExternalResponseInternal,
    "load_weights": types.LoadWeightsResponse,
    "asample": types.SampleResponse,
}
"""What a future of each request kind resolves to, as the SDK's `_APIFuture(model_cls, ...)`."""


def response_type(method: str, path: str) -> Any:
    for route_method, pattern, model in ROUTES + REST_ROUTES:
        if route_method == method and re.fullmatch(pattern, path):
            return model
    raise AssertionError(f"{method} {path}: not an endpoint the pinned SDK calls")


def check_exchange(exchange: Exchange) -> Any:
    """The answer parsed by the SDK's own type; raises if the SDK would reject it."""
    where = f"{exchange.method} {exchange.path}"
    if exchange.status in (400, 403, 404) and not exchange.path.endswith("retrieve_future"):
        return {"refused": json.loads(exchange.body)["detail"]}  # one line, asserted by tests
    if exchange.status == 408 and exchange.path.endswith("retrieve_future"):
        return types.TryAgainResponse.model_validate(json.loads(exchange.body))  # not ready yet
    assert 200 <= exchange.status < 300, f"{where} answered {exchange.status}: {exchange.body!r}"
    model = response_type(exchange.method, exchange.path)
    if model is EMPTY:
        return None
    if model != "future":
        return model.model_validate(json.loads(exchange.body))
    request_id = str(json.loads(exchange.request)["request_id"])
    if exchange.media_type.startswith("application/json"):
        answer = json.loads(exchange.body)
        if answer.get("type") == "try_again":
            return types.TryAgainResponse.model_validate(answer)
        if "error" in answer:
            return types.RequestFailedResponse.model_validate(answer)
    kind = request_id.rsplit("-", 1)[0]
    result = FUTURE_RESULT[kind]
    if result in PROTO_SUPPORTED_TYPES:
        assert exchange.media_type == "application/x-protobuf", f"{where} {kind}: not protobuf"
        return deserialize_proto_response(exchange.body, result)
    return result.model_validate(json.loads(exchange.body))


@pytest.fixture
def recorded(tmp_path: Path) -> Iterator[tuple[LocalServer, list[Exchange]]]:
    """A local server whose every answer is recorded."""
    log: list[Exchange] = []
    served = LocalServer(BASE, store=tmp_path / "store")
    served.app.add_middleware(Recorder, log=log)
    served.start(timeout_s=DEADLINE_S)
    yield served, log
    served.stop()


def sample(client: tinker.SamplingClient, n: int = 2) -> tinker.SampleResponse:
    params = tinker.SamplingParams(max_tokens=4, temperature=1.0, seed=0)
    prompt = tinker.ModelInput.from_ints(PROMPT)
    future = client.sample(prompt, num_samples=n, sampling_params=params)
    return future.result(DEADLINE_S)


def sft_datum() -> tinker.Datum:
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(PROMPT[:-1]),
        loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [1.0] * 4},
    )


def connect(server: LocalServer) -> tuple[tinker.ServiceClient, tinker.TrainingClient]:
    service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-test")
    return service, service.create_lora_training_client(BASE, rank=4).result(DEADLINE_S)


def check_all(log: list[Exchange]) -> dict[str, list[Any]]:
    """Every recorded answer checked; the parsed answers by endpoint (future kind for futures)."""
    parsed: dict[str, list[Any]] = {}
    for exchange in log:
        answer = check_exchange(exchange)
        key = exchange.path
        if exchange.path == "/api/v1/retrieve_future":
            key = "future:" + str(json.loads(exchange.request)["request_id"]).rsplit("-", 1)[0]
        parsed.setdefault(key, []).append(answer)
    return parsed


def test_save_weights_for_sampler_answers_the_type_the_sdk_accepts(
    recorded: tuple[LocalServer, list[Exchange]],
) -> None:
    """The cookbook's checkpoint call: named sampler weights, then a sampler on them."""
    service, tc = connect(recorded[0])
    saved = tc.save_weights_for_sampler("step-1").result(DEADLINE_S)
    assert isinstance(saved, types.SaveWeightsForSamplerResponse)
    assert saved.path.endswith("/sampler_weights/step-1"), saved.path
    sampler = service.create_sampling_client(model_path=saved.path).result(DEADLINE_S)
    assert len(sample(sampler).sequences) == 2
    service.close("success").result(DEADLINE_S)
    parsed = check_all(recorded[1])
    (answer,) = parsed["future:save_weights_for_sampler"]
    assert answer.type == "save_weights_for_sampler" and answer.path == saved.path


def test_every_answer_of_the_sdk_flow_validates_against_the_sdks_types(
    recorded: tuple[LocalServer, list[Exchange]],
) -> None:
    """Every ServiceClient, TrainingClient and SamplingClient call the server serves, once."""
    server, log = recorded
    service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-test")
    rest = tinker.RestClient(base_url=server.base_url, api_key="tml-test")

    # The SDK's `health_check` resource has no public caller; a probe reaches it directly.
    assert httpx.get(f"{server.base_url}/api/v1/healthz", timeout=DEADLINE_S).is_success
    capabilities = rest.get_server_capabilities().result(DEADLINE_S)
    assert capabilities.supported_models[0].model_name == BASE
    tc = service.create_lora_training_client(BASE, rank=4).result(DEADLINE_S)
    info = tc.get_info()
    assert info.model_data.model_name == BASE and info.lora_rank == 4 and info.is_lora
    assert tc.get_tokenizer().encode("a b") != []

    forward = tc.forward([sft_datum()], "cross_entropy").result(DEADLINE_S)
    assert forward.loss_fn_outputs[0]["logprobs"].to_numpy().shape == (4,)
    backward = tc.forward_backward([sft_datum()], "cross_entropy").result(DEADLINE_S)
    assert backward.metrics["loss:sum"] > 0
    custom = tc.forward_backward_custom([sft_datum()], lambda _, lps: (-lps[0].sum(), {}))
    assert custom.result(DEADLINE_S).loss_fn_outputs[0]["logprobs"].to_numpy().shape == (4,)
    step = tc.optim_step(tinker.AdamParams(learning_rate=1e-3)).result(DEADLINE_S)
    assert step.metrics is not None and step.metrics["grad_norm"] > 0

    state = tc.save_state("state-1").result(DEADLINE_S)
    assert state.path.endswith("/weights/state-1")
    for_sampler = tc.save_weights_for_sampler("sampler-1").result(DEADLINE_S)
    assert for_sampler.path.endswith("/sampler_weights/sampler-1")

    snapshot = tc.save_weights_and_get_sampling_client().result(DEADLINE_S)
    response = sample(snapshot)
    assert len(response.sequences) == 2  # each runs to max_tokens unless it samples EOS
    assert all(len(s.tokens) == 4 or s.stop_reason == "stop" for s in response.sequences)
    logprobs = snapshot.compute_logprobs(tinker.ModelInput.from_ints(PROMPT)).result(DEADLINE_S)
    assert logprobs[0] is None and len(logprobs) == len(PROMPT)
    from_training = tc.create_sampling_client(for_sampler.path).result(DEADLINE_S)
    assert len(sample(from_training, n=1).sequences) == 1
    base_sampler = service.create_sampling_client(base_model=BASE).result(DEADLINE_S)
    assert base_sampler.get_base_model() == BASE
    sampler_info = rest.get_sampler(base_sampler.get_sampler_handle()).result(DEADLINE_S)
    assert sampler_info.base_model == BASE

    weights_only = service.create_training_client_from_state(state.path).result(DEADLINE_S)
    assert weights_only.get_info().lora_rank == 4
    resumed = service.create_training_client_from_state_with_optimizer(state.path)
    assert resumed.result(DEADLINE_S).get_info().lora_rank == 4
    service.close("success").result(DEADLINE_S)

    parsed = check_all(log)
    reached = set(parsed)
    for kind in FUTURE_RESULT:
        if kind != "save_weights_external":
            assert f"future:{kind}" in reached, f"the walk never retrieved a {kind} result"
    skipped = ("telemetry", "heartbeat", "external", "retrieve")
    assert_reached(parsed, [p for _, p, _ in ROUTES if not any(s in p for s in skipped)])


def assert_reached(parsed: dict[str, list[Any]], patterns: list[str]) -> None:
    for pattern in patterns:
        assert any(re.fullmatch(pattern, path) for path in parsed), f"never reached {pattern}"


def test_a_refused_request_is_an_error_future_the_sdk_parses(
    recorded: tuple[LocalServer, list[Exchange]],
) -> None:
    service, tc = connect(recorded[0])
    with pytest.raises(tinker.RequestFailedError, match="takes loss_fn_inputs"):
        tc.forward_backward([sft_datum()], "importance_sampling").result(DEADLINE_S)
    service.close("success").result(DEADLINE_S)
    failed = [a for a in check_all(recorded[1])["future:forward_backward"]]
    assert isinstance(failed[-1], types.RequestFailedResponse) and failed[-1].category == "user"


def test_the_route_table_is_checked_strictly() -> None:
    """A `type` the SDK does not accept is a validation error (the bug this file guards)."""
    wrong = Exchange(
        "POST",
        "/api/v1/retrieve_future",
        json.dumps({"request_id": "save_weights_for_sampler-1"}).encode(),
        200,
        "application/json",
        json.dumps(
            {"path": "tinker://r/sampler_weights/x", "type": "save_sampler_weights"}
        ).encode(),
    )
    with pytest.raises(pydantic.ValidationError, match="save_weights_for_sampler"):
        check_exchange(wrong)
    with pytest.raises(AssertionError, match="not an endpoint"):
        response_type("GET", "/api/v1/nowhere")


# -- the REST surface --------------------------------------------------------------------------


def rest_client(server: LocalServer) -> tinker.RestClient:
    return tinker.RestClient(base_url=server.base_url, api_key="tml-test")


def test_training_runs_and_checkpoints_through_the_rest_client(
    recorded: tuple[LocalServer, list[Exchange]],
) -> None:
    """What the cookbook's resume, checkpoint loading and rolling checkpoints call."""
    server, log = recorded
    service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-test")
    metadata = {"renderer_name": "role_colon"}
    tc = service.create_lora_training_client(BASE, rank=4, user_metadata=metadata)
    tc = tc.result(DEADLINE_S)
    run = tc.model_id
    state = tc.save_state("s1", user_metadata={"step": "1"}).result(DEADLINE_S).path
    sampler = tc.save_weights_for_sampler("p1", ttl_seconds=3600).result(DEADLINE_S).path
    rest = rest_client(server)

    got = rest.get_training_run(run).result(DEADLINE_S)
    assert (got.training_run_id, got.base_model, got.lora_rank) == (run, BASE, 4)
    assert got.is_lora and got.user_metadata == metadata
    assert got.last_checkpoint is not None and got.last_checkpoint.tinker_path == state
    assert got.last_sampler_checkpoint is not None
    assert got.last_sampler_checkpoint.tinker_path == sampler
    assert rest.get_training_run_by_tinker_path(state).result(DEADLINE_S).training_run_id == run
    runs = rest.list_training_runs(limit=5).result(DEADLINE_S)
    assert [r.training_run_id for r in runs.training_runs] == [run]
    assert runs.cursor.total_count == 1

    listed = {c.checkpoint_id: c for c in rest.list_checkpoints(run).result(DEADLINE_S).checkpoints}
    assert set(listed) == {"weights/s1", "sampler_weights/p1"}
    assert listed["weights/s1"].user_metadata == {"step": "1"}
    assert (
        listed["weights/s1"].expires_at is None
        and listed["weights/s1"].checkpoint_type == "training"
    )
    assert listed["sampler_weights/p1"].expires_at is not None
    assert all(c.size_bytes for c in listed.values())
    mine = rest.list_user_checkpoints(limit=1).result(DEADLINE_S)
    assert len(mine.checkpoints) == 1 and mine.cursor is not None and mine.cursor.total_count == 2

    info = rest.get_weights_info_by_tinker_path(state).result(DEADLINE_S)
    assert (info.base_model, info.lora_rank, info.is_lora) == (BASE, 4, True)

    rest.publish_checkpoint_from_tinker_path(state).result(DEADLINE_S)
    assert rest.list_checkpoints(run).result(DEADLINE_S).checkpoints[-1].public
    rest.unpublish_checkpoint_from_tinker_path(state).result(DEADLINE_S)
    rest.set_checkpoint_ttl_from_tinker_path(sampler, None).result(DEADLINE_S)
    for checkpoint in rest.list_checkpoints(run).result(DEADLINE_S).checkpoints:
        assert not checkpoint.public and checkpoint.expires_at is None

    rest.delete_checkpoint_from_tinker_path(sampler).result(DEADLINE_S)
    left = rest.list_checkpoints(run).result(DEADLINE_S).checkpoints
    assert [c.tinker_path for c in left] == [state]
    with pytest.raises(tinker.NotFoundError, match="no checkpoint"):
        rest.delete_checkpoint_from_tinker_path(sampler).result(DEADLINE_S)
    spare = tc.save_state("s2").result(DEADLINE_S).path
    rest.delete_checkpoint(run, "weights/s2").result(DEADLINE_S)
    assert spare not in [
        c.tinker_path for c in rest.list_checkpoints(run).result(DEADLINE_S).checkpoints
    ]
    with pytest.raises(tinker.NotFoundError, match="no training run"):
        rest.get_training_run("nobody:train:0").result(DEADLINE_S)
    service.close("success").result(DEADLINE_S)
    parsed = check_all(log)
    assert_reached(parsed, [p for _, p, _ in REST_ROUTES if "external" not in p])


def test_a_checkpoint_past_its_ttl_disappears(
    recorded: tuple[LocalServer, list[Exchange]],
) -> None:
    server, log = recorded
    now = [1_000_000.0]
    server.service.catalog.clock = lambda: now[0]
    service, tc = connect(server)
    rolling = tc.save_state("rolling", ttl_seconds=3600).result(DEADLINE_S).path
    kept = tc.save_state("kept").result(DEADLINE_S).path
    rest = rest_client(server)
    assert len(rest.list_checkpoints(tc.model_id).result(DEADLINE_S).checkpoints) == 2
    now[0] += 3601
    listed = rest.list_checkpoints(tc.model_id).result(DEADLINE_S).checkpoints
    assert [c.tinker_path for c in listed] == [kept]
    assert not (server.service.store / tc.model_id / "weights" / "rolling").exists()
    with pytest.raises(tinker.RequestFailedError, match="no saved state"):
        service.create_training_client_from_state(rolling).result(DEADLINE_S)
    service.close("success").result(DEADLINE_S)
    check_all(log)


def test_exported_weights_download_without_a_key_and_load_into_the_local_backend(
    recorded: tuple[LocalServer, list[Exchange]], tmp_path: Path
) -> None:
    server, log = recorded
    service, tc = connect(server)
    tc.forward_backward([sft_datum()], "cross_entropy").result(DEADLINE_S)
    tc.optim_step(tinker.AdamParams(learning_rate=1e-2)).result(DEADLINE_S)
    exported = tc.save_weights_external("hf").result(DEADLINE_S)
    assert exported.path == f"tinker://{tc.model_id}/external_weights/hf"
    rest = rest_client(server)
    urls = rest.get_external_weights_urls(exported.path).result(DEADLINE_S).urls
    assert "config.json" in urls and "model.safetensors" in urls, sorted(urls)
    target = tmp_path / "downloaded"
    for relative, url in urls.items():
        answer = httpx.get(url, timeout=DEADLINE_S)  # no API key: the signed URL is enough
        assert answer.is_success, (relative, answer.text)
        (target / relative).parent.mkdir(parents=True, exist_ok=True)
        (target / relative).write_bytes(answer.content)
    tampered = httpx.get(urls["config.json"].replace("sig=", "sig=0"), timeout=DEADLINE_S)
    assert tampered.status_code == 403, tampered.text

    model, _ = load_policy(str(target))
    datum = sft_datum()
    ids = torch.tensor([datum.model_input.to_ints()])
    with torch.no_grad():
        logp = model(ids).logits.log_softmax(-1)[0]
    mine = logp[torch.arange(4), torch.tensor(PROMPT[1:])].numpy()
    trainer = tc.forward([datum], "cross_entropy").result(DEADLINE_S)
    theirs = trainer.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert abs(mine - theirs).max() <= 1e-5, (mine, theirs)
    service.close("success").result(DEADLINE_S)
    parsed = check_all(log)
    assert_reached(parsed, [p for _, p, _ in REST_ROUTES if "external" in p])
    assert_reached(parsed, ["future:save_weights_external"])


def test_an_export_to_age_recipients_stores_only_encrypted_files(
    recorded: tuple[LocalServer, list[Exchange]], tmp_path: Path
) -> None:
    pyrage = pytest.importorskip("pyrage")
    server, log = recorded
    service, tc = connect(server)
    identity = pyrage.x25519.Identity.generate()
    path = tc.save_weights_external("sealed", age_encryption_recipients=[str(identity.to_public())])
    path = path.result(DEADLINE_S).path
    urls = rest_client(server).get_external_weights_urls(path).result(DEADLINE_S).urls
    assert urls and all(name.endswith(".age") for name in urls), sorted(urls)
    sealed = httpx.get(urls["config.json.age"], timeout=DEADLINE_S).content
    assert b"architectures" not in sealed, "the store holds no plain text"
    config = json.loads(pyrage.decrypt(sealed, [identity]))
    assert config["model_type"] == "qwen2", config
    with pytest.raises(tinker.RequestFailedError, match="not an age x25519 recipient"):
        tc.save_weights_external("bad", age_encryption_recipients=["ssh-rsa AAAA"]).result(
            DEADLINE_S
        )
    service.close("success").result(DEADLINE_S)
    check_all(log)


@pytest.mark.parametrize(
    ("call", "reason"),
    [
        (lambda rest: rest.copy_weights("tinker://r/weights/x", "proj"), "projects are not"),
        (lambda rest: rest.get_session("local-x"), "session lookup is not served"),
        (lambda rest: rest.list_sessions(), "session listing is not served"),
    ],
)
def test_calls_out_of_scope_are_refused_in_one_line(
    recorded: tuple[LocalServer, list[Exchange]], call: Any, reason: str
) -> None:
    with pytest.raises(tinker.BadRequestError, match=reason):
        call(rest_client(recorded[0])).result(DEADLINE_S)


def test_topk_prompt_logprobs_are_served_and_other_prompt_options_refused(
    recorded: tuple[LocalServer, list[Exchange]],
) -> None:
    service, tc = connect(recorded[0])
    sampler = tc.save_weights_and_get_sampling_client().result(DEADLINE_S)
    params = tinker.SamplingParams(max_tokens=1, seed=0)
    prompt = tinker.ModelInput.from_ints(PROMPT)
    answer = sampler.sample(
        prompt, 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=3
    ).result(DEADLINE_S)
    topk, logprobs = answer.topk_prompt_logprobs, answer.prompt_logprobs
    assert topk is not None and logprobs is not None and len(topk) == len(PROMPT)
    assert topk[0] is None and logprobs[0] is None, "nothing precedes the first token"
    for position in range(1, len(PROMPT)):
        best = topk[position]
        assert best is not None and len(best) == 3
        values = [lp for _, lp in best]
        assert values == sorted(values, reverse=True)
        actual = logprobs[position]
        assert actual is not None and actual <= values[0] + 1e-6
        for token, lp in best:
            if token == PROMPT[position]:
                assert lp == pytest.approx(actual, abs=1e-5)
    with pytest.raises(tinker.RequestFailedError, match="topk_sample_logprobs"):
        sampler.sample(prompt, 1, params, topk_sample_logprobs=2).result(DEADLINE_S)
    service.close("success").result(DEADLINE_S)
    check_all(recorded[1])


def test_every_public_sdk_method_is_served_or_refused() -> None:
    """A method a new SDK adds fails here until `tinker_server/compat.py` classifies it."""
    found = set(sdk_methods())
    assert found == set(METHODS), (sorted(found - set(METHODS)), sorted(set(METHODS) - found))


def test_every_loss_the_sdk_names_is_served_or_refused_with_a_reason() -> None:
    served, refused = set(LOSS_INPUTS), set(REFUSED_LOSSES)
    assert not served & refused, served & refused
    assert served | refused == set(sdk_losses()), sorted(set(sdk_losses()) ^ (served | refused))
    assert set(LOSS_NOTES) == served, "each served loss has its note in the generated table"


@pytest.mark.parametrize(
    "name", [name for name, support in METHODS.items() if support.status == "served"]
)
def test_every_method_the_table_calls_served_is_driven_by_a_test(name: str) -> None:
    """Each served method is called through the real SDK somewhere in the tinker tests."""
    # `SamplingClient.create` is what every `create_sampling_client` runs.
    method = {"SamplingClient.create": "create_sampling_client"}.get(name, name.split(".")[1])
    sources = "".join(p.read_text() for p in Path(__file__).parent.glob("test_tinker*.py"))
    assert f".{method}(" in sources, f"{name} is listed as served, but no tinker test calls it"
