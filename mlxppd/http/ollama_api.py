"""The Ollama API under ``/api``, as routes on the base app, so UIs and editor plugins that
speak Ollama reach the cluster on the same listener as the OpenAI API.

``add_ollama_routes(app)`` adds it to an app built by ``base_app`` (``create_app`` builds one):
the same backend, model name, api key, limits and request log. ``/api/chat`` renders a
conversation as /v1/chat/completions does (``chat_prompt``) and ``/api/generate`` a prompt as
one user turn (or as is, ``raw``), and both run through the same ``choice_params`` and
``Generation``: at temperature 0 /api/chat and a chat completion say the same thing.
``format`` takes the grammar path of ``response_format``; tools work as in the chat API,
always ``auto`` (Ollama has no ``tool_choice``). Replies are ``ollama_stream.py``'s, errors
Ollama's ``{"error": "..."}`` (``OLLAMA_ERRORS``). Model management (pull, push, create, copy,
delete) and embeddings are refused, saying what to do instead. docs/ollama-api.md.
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiohttp import web

from mlxppd import __version__
from mlxppd.core.protocol.sampling import GrammarSpec
from mlxppd.http.api_state import STATE, ApiState
from mlxppd.http.base_app import (
    admit_sequences,
    body_bytes,
    client_gone,
    read_json,
    request_log,
    serve_errors_as,
)
from mlxppd.http.chat_prompt import chat_prompt, has_chat_template
from mlxppd.http.completion import Generation
from mlxppd.http.errors import OLLAMA_ERRORS, ApiError, invalid
from mlxppd.http.generation import GenerationRequest, choice_params, prompt_context
from mlxppd.http.models_api import adapter_registry, check_model
from mlxppd.http.ollama_models import (
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaMessage,
    OllamaShowRequest,
)
from mlxppd.http.ollama_stream import NDJSON, NdjsonWriter, Reply, Timing, created_at
from mlxppd.http.prompt_bound import bounded_tokens
from mlxppd.http.sse import failures_end_stream, send_content
from mlxppd.http.tools import ToolPlan, plan_tools, schema_text
from mlxppd.http.validation import validate

API_ROOT = "/api"
#: the Ollama release whose API this one follows (clients gate features on it)
OLLAMA_VERSION = "0.9.0"
#: a model that never unloads, as Ollama writes keep_alive forever
NEVER_EXPIRES = "9999-12-31T23:59:59Z"
#: longest chat-template complaint passed on to the client, in characters
_MAX_TEMPLATE_ERROR_CHARS = 500
#: the one tag a served name may carry (Ollama's clients add it)
_LATEST = ":latest"
#: the placeholders of an Ollama template this server fills; any other action is refused
_PLACEHOLDER = re.compile(r"(\s*)\{\{(-?)\s*\.(System|Prompt|Response)\s*(-?)\}\}(\s*)")
_ACTION = re.compile(r"\{\{.*?\}\}", re.DOTALL)
Generating = OllamaChatRequest | OllamaGenerateRequest
_FACTS: web.AppKey[dict[str, Any]] = web.AppKey("mlxpp_ollama_model_facts", dict)


# --- the served model, as Ollama lists it ---


def _tagged(name: str) -> str:
    return name if ":" in name else name + _LATEST


def _served_name(state: ApiState, model: str) -> str:
    """``model`` as the OpenAI side names it (``smollm:latest`` is ``smollm``); 404 unless
    it is the served model or an adapter."""
    if model.endswith(_LATEST) and ":" not in state.model_name:
        model = model.removesuffix(_LATEST)
    check_model(state, model)
    return model


def _model_dir(state: ApiState) -> Path | None:
    where = getattr(state.backend.tokenizer, "name_or_path", None)
    path = Path(where) if isinstance(where, str) and where else None
    return path if path is not None and (path / "config.json").is_file() else None


def _read_facts(state: ApiState) -> dict[str, Any]:
    """Size, digest, date and details of the weights, when the coordinator holds the model's
    directory (the tokenizer's); the digest hashes config.json and the weight files' names and
    sizes: it names these weights, not an Ollama registry blob."""
    facts: dict[str, Any] = {"size": 0, "modified_at": created_at(), "config": {}}
    digest = hashlib.sha256(state.backend.model_id.encode())
    if (path := _model_dir(state)) is not None:
        raw = (path / "config.json").read_bytes()
        digest.update(raw)
        weights = sorted(path.glob("*.safetensors"))
        for weight in weights:
            size = weight.stat().st_size
            facts["size"] += size
            digest.update(f"{weight.name}:{size}".encode())
        stamp = datetime.fromtimestamp((path / "config.json").stat().st_mtime, UTC)
        facts["modified_at"] = stamp.isoformat().replace("+00:00", "Z")
        try:
            config = json.loads(raw)
            facts["config"] = config if isinstance(config, dict) else {}
        except ValueError:
            pass
    facts["digest"] = digest.hexdigest()
    return facts


def _facts(app: web.Application) -> dict[str, Any]:
    if _FACTS not in app:
        raise RuntimeError("add_ollama_routes was not called on this app")
    facts = app[_FACTS]
    if facts:
        return facts
    read = _read_facts(app[STATE])
    if app[STATE].backend.tokenizer is not None:  # read once the model has loaded, then kept
        facts.update(read)
    return read


def _details(facts: dict[str, Any], parent: str = "") -> dict[str, Any]:
    config = facts["config"]
    family = str(config.get("model_type", ""))
    quant = config.get("quantization")
    bits = quant.get("bits") if isinstance(quant, dict) else None
    level = f"Q{bits}" if bits else str(config.get("torch_dtype", "")).upper().replace("FLOAT", "F")
    return {
        "parent_model": parent, "format": "safetensors", "family": family,
        "families": [family] if family else None, "parameter_size": "",
        "quantization_level": level,
    }  # fmt: skip


def _cards(request: web.Request) -> list[dict[str, Any]]:
    """The served model, then each adapter a request's model may name."""
    state = request.app[STATE]
    facts = _facts(request.app)
    registry = adapter_registry(state.backend)
    adapters = registry.names() if registry is not None else []
    names = [(state.model_name, ""), *((n, state.model_name) for n in adapters)]
    return [
        {"name": _tagged(name), "model": _tagged(name), "modified_at": facts["modified_at"],
         "size": facts["size"], "digest": facts["digest"], "details": _details(facts, parent)}
        for name, parent in names
    ]  # fmt: skip


async def _version(request: web.Request) -> web.Response:
    return web.json_response({"version": OLLAMA_VERSION, "mlxpp": __version__})


async def _tags(request: web.Request) -> web.Response:
    return web.json_response({"models": _cards(request)})


async def _ps(request: web.Request) -> web.Response:
    context = request.app[STATE].context()
    cards = [
        {**card, "expires_at": NEVER_EXPIRES, "size_vram": card["size"],
         "context_length": context or 0}
        for card in _cards(request)
    ]  # fmt: skip
    return web.json_response({"models": cards})


async def _show(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = validate(OllamaShowRequest, await read_json(request))
    _served_name(state, body.model or body.name or "")
    facts = _facts(request.app)
    tokenizer = state.loaded_tokenizer()
    template = tokenizer.chat_template if has_chat_template(tokenizer) else ""
    family = facts["config"].get("model_type", "")
    info: dict[str, Any] = {"general.architecture": family}
    if (context := state.context()) is not None:
        info[f"{family}.context_length"] = context
    capabilities = ["completion", "tools"] if template else ["completion"]
    return web.json_response({
        "modelfile": "", "parameters": "", "template": template if isinstance(template, str)
        else "", "details": _details(facts), "model_info": info,
        "capabilities": capabilities, "modified_at": facts["modified_at"],
    })  # fmt: skip


# --- prompts ---


def _chat_turns(messages: list[OllamaMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template (and ``tools.template_messages``) takes them: calls
    get ids, and a tool's result answers the earliest open call of its tool."""
    turns: list[dict[str, Any]] = []
    open_calls: list[tuple[str, str]] = []
    for i, m in enumerate(messages):
        turn: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            open_calls = [(f"call_{i}_{j}", c.function.name) for j, c in enumerate(m.tool_calls)]
            turn["tool_calls"] = [
                {"id": call_id, "type": "function",
                 "function": {"name": c.function.name,
                              "arguments": json.dumps(c.function.arguments, ensure_ascii=False)}}
                for (call_id, _), c in zip(open_calls, m.tool_calls, strict=True)
            ]  # fmt: skip
        if m.role == "tool":
            match = [c for c in open_calls if m.tool_name in (None, c[1])][:1]
            if match:
                open_calls.remove(match[0])
                turn["tool_call_id"] = match[0][0]
            if m.tool_name:
                turn["name"] = m.tool_name
        turns.append(turn)
    return turns


def _fill_template(template: str, system: str, prompt: str) -> str:
    """An Ollama template with only ``.System``, ``.Prompt`` and ``.Response`` (``{{-`` and
    ``-}}`` trim whitespace as in Go); a 400 for any other action (this is no Go engine)."""
    values = {"System": system, "Prompt": prompt, "Response": ""}
    if other := [a for a in _ACTION.findall(_PLACEHOLDER.sub("", template))]:
        raise invalid(
            f"this server fills only {{{{ .System }}}}, {{{{ .Prompt }}}} and {{{{ .Response }}}} "
            f"in a template, not {other[0][:80]!r}; render the prompt and send it with raw: true",
            "template",
        )

    def fill(match: re.Match[str]) -> str:
        before, trim_left, name, trim_right, after = match.groups()
        return ("" if trim_left else before) + values[name] + ("" if trim_right else after)

    return _PLACEHOLDER.sub(fill, template)


async def _generate_prompt(state: ApiState, body: OllamaGenerateRequest, size: int) -> list[int]:
    tokenizer = state.loaded_tokenizer()
    context = prompt_context(state)
    text, system = body.prompt or "", body.system or ""
    if body.raw or (body.template is None and not has_chat_template(tokenizer)):
        joined = text if body.raw or not system else f"{system}\n\n{text}"
        return await state.off_loop(
            lambda: bounded_tokens(tokenizer, joined, context, "prompt"), size=size
        )
    if body.template is not None:
        filled = _fill_template(body.template, system, text)
        return await state.off_loop(
            lambda: bounded_tokens(tokenizer, filled, context, "prompt", add_special_tokens=False),
            size=size,
        )
    turns = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}
    ]
    return await _templated(state, tokenizer, turns, ToolPlan(), size)


async def _templated(
    state: ApiState, tokenizer: Any, turns: list[dict[str, Any]], plan: ToolPlan, size: int
) -> list[int]:
    context = prompt_context(state)
    try:
        return await state.off_loop(lambda: chat_prompt(tokenizer, turns, plan, context), size=size)
    except ApiError:
        raise  # too long for the context, found before tokenizing
    except Exception as exc:  # the template rejects the conversation (e.g. roles out of order)
        reason = str(exc)[:_MAX_TEMPLATE_ERROR_CHARS]
        raise invalid(f"the chat template rejected the messages: {reason}", "messages") from None


# --- generation ---


def _asked(body: Generating, model: str) -> GenerationRequest:
    """What the request asks of the sampler, as the chat API asks it."""
    opts = body.options
    grammar = None
    if body.format == "json":
        grammar = GrammarSpec(kind="json_object")
    elif isinstance(body.format, dict):  # bounded by the request model (BoundedSchema)
        grammar = GrammarSpec(kind="json_schema", schema_text=schema_text(body.format))
    return GenerationRequest(
        model=model, max_tokens=opts.max_tokens, temperature=opts.temperature,
        top_p=opts.top_p, seed=None if opts.seed in (None, -1) else opts.seed, stop=opts.stop,
        top_k=opts.top_k, min_p=opts.min_p, repetition_penalty=opts.repeat_penalty,
        presence_penalty=opts.presence_penalty, frequency_penalty=opts.frequency_penalty,
        grammar=grammar,
    )  # fmt: skip


async def _run(
    request: web.Request, body: Generating, model: str, prompt: list[int], reply: Reply,
    timing: Timing,
) -> web.StreamResponse:  # fmt: skip
    state = request.app[STATE]
    asked = _asked(body, model)
    param = "messages" if reply.chat else "prompt"
    (params,) = choice_params(state, asked, len(prompt), param, reply.tools)
    await admit_sequences(request, 1)
    request_id = request_log(request).request_id
    timing.submit()
    events = state.backend.generate(request_id, prompt, params)
    gen = Generation(events, state.backend.tokenizer, len(prompt), asked.stop, client_gone(request))
    try:
        await gen.start()  # admission: a refusal is a plain error response, even when streaming
        timing.first_token()
        if body.stream:
            return await _stream(request, gen, reply, timing)
        await gen.collect()
        return web.json_response(reply.complete(gen, timing))
    finally:
        await gen.close()
        request_log(request).tokens = (len(prompt), gen.completion_tokens)


async def _stream(
    request: web.Request, gen: Generation, reply: Reply, timing: Timing
) -> web.StreamResponse:
    out = await NdjsonWriter.start(request, {"X-Request-Id": request_log(request).request_id})
    async with failures_end_stream(request, out.error):
        # With tools, text that may begin a call is held back; the calls go out at the end.
        hold = reply.tools.holdback()
        await send_content(request, gen.pieces(), hold, lambda text: out.line(reply.line(text)))
        _, calls = reply.split(gen)
        if calls:
            await out.line(reply.line("", calls))
        await out.line(reply.done("", gen.finish_reason, timing, gen))
        await out.close()
    return out.response


def _loaded(body: Generating, reply: Reply, timing: Timing) -> web.Response:
    """Nothing to generate: Ollama's answer to "load the model" (it always is)."""
    done = reply.done("", "load", timing)
    if not body.stream:
        return web.json_response(done)
    return web.Response(text=json.dumps(done) + "\n", content_type=NDJSON)


async def _chat(request: web.Request) -> web.StreamResponse:
    timing = Timing()
    state = request.app[STATE]
    body = validate(OllamaChatRequest, await read_json(request))
    model = _served_name(state, body.model)
    plan = plan_tools(body.tools, None)
    reply = Reply(_tagged(model), chat=True, tools=plan)
    if not body.messages:
        return _loaded(body, reply, timing)
    tokenizer = state.loaded_tokenizer()
    if not has_chat_template(tokenizer):
        raise invalid("this model has no chat template; use /api/generate with raw", "messages")
    turns = _chat_turns(body.messages)
    prompt = await _templated(state, tokenizer, turns, plan, body_bytes(request))
    return await _run(request, body, model, prompt, reply, timing)


async def _generate(request: web.Request) -> web.StreamResponse:
    timing = Timing()
    state = request.app[STATE]
    body = validate(OllamaGenerateRequest, await read_json(request))
    model = _served_name(state, body.model)
    reply = Reply(_tagged(model), chat=False)
    if not body.prompt and not body.system:
        return _loaded(body, reply, timing)
    prompt = await _generate_prompt(state, body, body_bytes(request))
    return await _run(request, body, model, prompt, reply, timing)


# --- what this server does not do ---

_PREPARE = (
    "this server serves the model its cluster was started with; weights reach the nodes "
    "with `mlxppctl prepare` (docs/operator-manual.md), not through the Ollama API"
)


def _refuse(status: int, message: str) -> Any:
    async def handler(request: web.Request) -> web.Response:
        raise ApiError(status, message, code="unsupported")

    return handler


def add_ollama_routes(app: web.Application) -> None:
    """Serve the Ollama API under /api on ``app``, an app from ``base_app`` (or
    ``create_app``) not yet started, under its api key, limits and request log, with every
    error there in Ollama's shape."""
    if STATE not in app:
        raise ValueError("add_ollama_routes needs an app built by create_app")
    serve_errors_as(app, API_ROOT, OLLAMA_ERRORS)
    app[_FACTS] = {}
    app.router.add_get("/api/version", _version)
    app.router.add_get("/api/tags", _tags)
    app.router.add_get("/api/ps", _ps)
    app.router.add_post("/api/show", _show)
    app.router.add_post("/api/chat", _chat)
    app.router.add_post("/api/generate", _generate)
    app.router.add_post("/api/pull", _refuse(400, f"models cannot be pulled: {_PREPARE}"))
    app.router.add_post("/api/push", _refuse(400, f"models cannot be pushed: {_PREPARE}"))
    app.router.add_post("/api/create", _refuse(400, f"models cannot be created: {_PREPARE}"))
    app.router.add_post("/api/copy", _refuse(400, f"models cannot be copied: {_PREPARE}"))
    app.router.add_delete("/api/delete", _refuse(400, f"models cannot be deleted: {_PREPARE}"))
    embeddings = (
        "embeddings are not served: this server generates text with one language model and "
        "runs no embedding model"
    )
    app.router.add_post("/api/embed", _refuse(404, embeddings))
    app.router.add_post("/api/embeddings", _refuse(404, embeddings))
