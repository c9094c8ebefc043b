"""``/v1/models``: the base model, then each LoRA adapter a request's ``model`` may choose
(docs/adapters.md), and the check that a request names one of them."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from mlxppd.http.api_state import STATE, ApiState
from mlxppd.http.errors import ApiError
from mlxppd.runtime.coordinator.adapter_registry import AdapterRegistry


def adapter_registry(backend: Any) -> AdapterRegistry | None:
    """The cluster's per-request adapters, when the backend is (or holds) a coordinator."""
    registry = getattr(getattr(backend, "coordinator", backend), "adapters", None)
    return registry if isinstance(registry, AdapterRegistry) else None


def _model_card(state: ApiState) -> dict[str, Any]:
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "mlxpp",
    }


def _adapter_cards(state: ApiState) -> list[dict[str, Any]]:
    registry = adapter_registry(state.backend)
    names = registry.names() if registry is not None else []
    return [{**_model_card(state), "id": n, "parent": state.model_name} for n in names]


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    # The base model, then each per-request adapter (a request's model picks one).
    cards = [_model_card(state), *_adapter_cards(state)]
    return web.json_response({"object": "list", "data": cards})


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = request.match_info["model"]
    if name in (state.model_name, state.backend.model_id):
        return web.json_response(_model_card(state))
    for card in _adapter_cards(state):
        if card["id"] == name:
            return web.json_response(card)
    raise ApiError(404, f"the model '{name}' does not exist", param="model", code="model_not_found")


def check_model(state: ApiState, model: str | None) -> None:
    if model is None or model in (state.model_name, state.backend.model_id):
        return
    registry = adapter_registry(state.backend)
    if registry is not None and registry.path(model) is not None:
        return  # an adapter (one being unloaded is refused with 409 when the request starts)
    adapters = registry.names() if registry is not None else []
    served = ", ".join(f"'{n}'" for n in [state.model_name, *adapters])
    raise ApiError(
        404,
        f"the model '{model}' does not exist; this server serves {served}",
        param="model",
        code="model_not_found",
    )
