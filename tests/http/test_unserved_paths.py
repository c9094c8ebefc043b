"""A path this server has no route for answers a 404 in the path's API shape that names what
is served; OpenAI's embeddings, audio, images and moderations say there is no such model here
(a bare "Not Found" told a client nothing). The real openai SDK against a live server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.http import LiveServer

pytestmark = pytest.mark.slow

KEY = "test-key"


@pytest.fixture(scope="module")
def base_url(embedded_model_dir: Path) -> Iterator[str]:
    server = LiveServer(embedded_model_dir, 1)
    try:
        yield server.start_api(api_key=KEY, alias="smollm")
    finally:
        server.stop()


def test_embeddings_are_a_404_saying_no_embedding_model_runs_here(base_url: str) -> None:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError) as caught:
        client.embeddings.create(model="smollm", input="hello")
    message = caught.value.body["message"]  # type: ignore[index]
    assert "POST /v1/embeddings is not served" in message
    assert "runs no embedding model" in message
    assert "/v1/chat/completions" in message and "/v1/completions" in message
    assert caught.value.body["code"] == "not_found"  # type: ignore[index]


def test_an_unknown_path_names_the_served_routes_in_its_apis_shape(base_url: str) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    openai_shape = httpx.post(base_url + "/v1/chat/completion", headers=headers, json={})
    assert openai_shape.status_code == 404
    error = openai_shape.json()["error"]
    assert "POST /v1/chat/completion is not a route of this server" in error["message"]
    assert "/v1/chat/completions" in error["message"]

    anthropic_shape = httpx.post(base_url + "/v1/messages/nothing", headers=headers, json={})
    assert anthropic_shape.status_code == 404
    assert anthropic_shape.json()["type"] == "error"
    assert anthropic_shape.json()["error"]["type"] == "not_found_error"


def test_without_the_key_an_unknown_path_says_only_401(base_url: str) -> None:
    assert httpx.post(base_url + "/v1/embeddings", json={}).status_code == 401
