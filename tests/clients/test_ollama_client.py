"""The ``ollama`` Python client against the live 2-stage cluster (``mlxppd serve``), as its
users call it: ``host`` is the coordinator's address, the key a header.

Shown: the real server serves Ollama's API beside the OpenAI one (``app/api_app.py``): the
model list names the alias; a chat reply and its NDJSON stream carry the same greedy text,
the stream's last line done with its counts; a ``format`` schema from a pydantic model gives
an answer the model validates; a wrong key is the client's ``ResponseError`` with 401.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

from tests.clients import asks
from tests.clients.conftest import LiveCluster
from tests.clients.loopback import LoopbackGuard

if TYPE_CHECKING:
    from ollama import Client

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(loopback_only: LoopbackGuard, live_cluster: LiveCluster) -> Iterator[Client]:
    from ollama import Client

    with Client(
        host=live_cluster.url, headers={"Authorization": f"Bearer {live_cluster.key}"}, timeout=120
    ) as c:
        yield c


def test_the_list_names_the_alias(client: Client, live_cluster: LiveCluster) -> None:
    assert [m.model for m in client.list().models] == [f"{live_cluster.model}:latest"]


def test_chat_and_its_stream_carry_the_same_greedy_text(
    client: Client, live_cluster: LiveCluster
) -> None:
    ask: dict[str, Any] = {
        "model": live_cluster.model,
        "messages": [{"role": "user", "content": asks.HELLO}],
        "options": {"temperature": 0, "num_predict": asks.CHAT_TOKENS},
    }
    whole = client.chat(**ask)
    assert whole.message.content and 0 < whole.eval_count <= asks.CHAT_TOKENS
    parts = list(client.chat(**ask, stream=True))
    assert len([p for p in parts if p.message.content]) > 1, "not streamed"
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].done and parts[-1].eval_count == whole.eval_count


def test_a_format_schema_gives_the_model(client: Client, live_cluster: LiveCluster) -> None:
    reply = client.chat(
        live_cluster.model,
        [{"role": "user", "content": asks.CITY}],
        format=asks.City.model_json_schema(),
        options={"temperature": 0, "num_predict": asks.JSON_TOKENS},
    )
    city = asks.City.model_validate_json(reply.message.content)
    assert city.name and city.country


def test_a_wrong_key_is_a_401(live_cluster: LiveCluster, loopback_only: LoopbackGuard) -> None:
    from ollama import Client, ResponseError

    with pytest.raises(ResponseError) as refused:
        Client(host=live_cluster.url, headers={"Authorization": "Bearer wrong"}).list()
    assert refused.value.status_code == 401
