"""The answer to a path this server has no route for: a 404 in the path's API shape that names
what is served, instead of a bare "Not Found" (client libraries show the message). OpenAI's
paths for what a one-model generation server has no model for (embeddings, audio, images,
moderations) say so."""

from __future__ import annotations

from aiohttp import web

from mlxppd.http.errors import ApiError

#: OpenAI's endpoints for models this server does not run, under /v1
NO_MODEL_FOR = {
    "embeddings": "embedding model",
    "audio": "speech model",
    "images": "image model",
    "moderations": "moderation model",
}


def served_paths(app: web.Application) -> list[str]:
    """The POST routes under /v1 the app serves, in the order they were added."""
    found = [
        route.resource.canonical
        for route in app.router.routes()
        if route.method == "POST"
        and route.resource is not None
        and route.resource.canonical.startswith("/v1/")
    ]
    return list(dict.fromkeys(found))


def not_found(request: web.Request) -> ApiError:
    """The 404 for ``request``, whose path no route matched."""
    served = ", ".join(served_paths(request.app))
    what = f"{request.method} {request.path}"[:200]
    name = request.path.removeprefix("/v1/").split("/", 1)[0]
    if request.path.startswith("/v1/") and name in NO_MODEL_FOR:
        message = (
            f"{what} is not served: this server generates text with one language model and "
            f"runs no {NO_MODEL_FOR[name]}; it serves POST {served}"
        )
    else:
        message = f"{what} is not a route of this server; it serves POST {served}"
    return ApiError(404, message, code="not_found")
