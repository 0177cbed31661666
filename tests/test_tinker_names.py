"""Model names that work from a client's side: what the server advertises loads offline, and the
names it was started with (`--model` as given, `--alias`) are accepted as base models."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import tinker
from transformers import AutoTokenizer

from backends.tinker.server_process import ServerProcess
from tinker_server.server import LocalServer
from torchkit.builtin import load_policy

DEADLINE_S = 60


def advertised(client: tinker.RestClient) -> list[str]:
    models = client.get_server_capabilities().result(DEADLINE_S).supported_models
    return [str(m.model_name) for m in models]


def test_a_builtin_model_is_advertised_by_a_directory_its_tokenizer_loads_from(
    tmp_path: Path,
) -> None:
    with LocalServer("builtin:tiny", store=tmp_path, aliases=["Qwen/Qwen3-8B"]) as url:
        rest = tinker.RestClient(base_url=url, api_key="tml-test")
        names = advertised(rest)
        assert names[0] == "builtin:tiny" and Path(names[1]).is_absolute(), names
        # What tinker-cookbook does with its `model_name`: a local directory loads offline.
        tokenizer = AutoTokenizer.from_pretrained(names[1])
        service = tinker.ServiceClient(base_url=url, api_key="tml-test")
        for name in (*names, "Qwen/Qwen3-8B"):
            tc = service.create_lora_training_client(name, rank=4).result(DEADLINE_S)
            assert tc.get_info().model_data.model_name == "builtin:tiny"
        assert tc.get_tokenizer().encode("a b c") == tokenizer.encode("a b c")
        with pytest.raises(tinker.RequestFailedError, match="--alias NAME"):
            service.create_lora_training_client("Qwen/Other", rank=4).result(DEADLINE_S)
        service.close("success").result(DEADLINE_S)


def test_a_relative_model_directory_is_advertised_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tokenizer = load_policy("builtin:tiny")
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    monkeypatch.chdir(tmp_path)
    with LocalServer("m", store=tmp_path / "store") as url:
        rest = tinker.RestClient(base_url=url, api_key="tml-test")
        assert advertised(rest) == [str(tmp_path / "m")]
        service = tinker.ServiceClient(base_url=url, api_key="tml-test")
        for name in ("m", str(tmp_path / "m")):
            service.create_lora_training_client(name, rank=4).result(DEADLINE_S)
        service.close("success").result(DEADLINE_S)


async def test_the_model_provider_named_by_model_is_accepted_as_a_base_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UNIFIED_TEST_MODEL_DIR", str(tmp_path / "provided"))
    server = ServerProcess("tests.model_providers:tiny_policy", store=tmp_path / "store")
    url = await server.start(timeout_s=120)
    try:
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            created = await client.post(
                f"{url}/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}
            )
            session = created.json()["session_id"]
            body = {
                "session_id": session,
                "model_seq_id": 0,
                "base_model": "tests.model_providers:tiny_policy",
                "lora_config": {"rank": 4},
            }
            request_id = (await client.post(f"{url}/api/v1/create_model", json=body)).json()
            answer = await client.post(f"{url}/api/v1/retrieve_future", json=request_id)
    finally:
        await server.stop()
    assert answer.json() == {"model_id": f"{session}:train:0", "type": "create_model"}
