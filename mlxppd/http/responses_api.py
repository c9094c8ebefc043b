"""OpenAI's Responses API as routes on the base app: ``POST /v1/responses``, and the stored
responses under ``/v1/responses/{id}`` (``GET``, ``DELETE``, ``GET .../input_items``).

``add_responses_routes(app)`` adds it to an app built by ``create_app``: the same backend,
model name, api key, limits and request log (the app's ``STATE``), errors in OpenAI's shape.
A request's items become the chat template's messages as /v1/chat/completions's would
(``instructions`` a system message first, ``developer`` a system message, a
``function_call`` the assistant's tool call, a ``function_call_output`` a tool message), and
run through the same ``chat_prompt``, ``choice_params`` and ``Generation``: at temperature 0 a
response and a chat completion of one conversation say the same thing. ``text.format`` is the
chat API's ``response_format``; function tools go through ``http/tools.py``.

With ``store`` (the default) a response is kept (``responses_store.py``), and
``previous_response_id`` puts its conversation before the new input, rendered by the same
template, so the stages' prompt cache serves that prefix. Streams: ``responses_stream.py``.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from mlxppd.core.protocol.sampling import GrammarSpec
from mlxppd.http.api_state import STATE, ApiState
from mlxppd.http.base_app import (
    admit_sequences,
    body_bytes,
    client_gone,
    read_json,
    request_log,
)
from mlxppd.http.chat_prompt import chat_prompt, has_chat_template
from mlxppd.http.completion import Generation
from mlxppd.http.errors import ApiError, invalid
from mlxppd.http.generation import GenerationRequest, choice_params, prompt_context
from mlxppd.http.models_api import check_model
from mlxppd.http.responses_models import (
    RESPONSES_PATH,
    AllowedTools,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    ResponsesRequest,
    TextConfig,
)
from mlxppd.http.responses_reply import ResponseReply, new_id
from mlxppd.http.responses_store import (
    DEFAULT_STORE_BYTES,
    DEFAULT_STORE_ENTRIES,
    RESPONSE_STORE,
    ResponseStore,
    StoredResponse,
)
from mlxppd.http.responses_stream import stream_response
from mlxppd.http.tools import (
    NamedToolChoice,
    ToolChoice,
    ToolDef,
    ToolPlan,
    plan_tools,
    schema_text,
)
from mlxppd.http.validation import validate

#: longest chat-template complaint passed on to the client, in characters
_MAX_TEMPLATE_ERROR_CHARS = 500
#: the part a listed message's text is, by its role
_PART = {"assistant": "output_text", "user": "input_text", "system": "input_text",
         "developer": "input_text"}  # fmt: skip
#: most items one input_items page lists
MAX_ITEMS_PAGE = 100


def not_found(response_id: str, param: str | None) -> ApiError:
    shown = response_id[:64]
    return ApiError(
        404,
        f"no stored response has the id {shown!r}; it was never stored, was deleted, or was "
        "dropped from the server's bounded store: send the whole conversation instead",
        param=param,
        code="previous_response_not_found" if param else "not_found",
    )


# --- the request, in the chat API's terms ---


def _plan(body: ResponsesRequest) -> ToolPlan:
    """The request's function tools and tool_choice as the chat API plans them."""
    tools = [
        ToolDef.model_validate(
            {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
        )
        for t in body.tools or ()
    ]
    choice: ToolChoice | None
    asked = body.tool_choice
    if asked is None or isinstance(asked, str):
        choice = asked
    elif isinstance(asked, AllowedTools):  # only these tools; required: one must be called
        allowed = {t.name for t in asked.tools}
        tools = [t for t in tools if t.function.name in allowed]
        choice = asked.mode
    else:
        named = {"type": "function", "function": {"name": asked.name}}
        choice = NamedToolChoice.model_validate(named)
    try:
        return plan_tools(tools, choice)
    except ValueError as exc:
        raise invalid(str(exc), "tool_choice", "invalid_value") from None


def _grammar(text: TextConfig | None) -> GrammarSpec | None:
    """``text.format`` as the chat API's ``response_format`` constrains decoding."""
    spec = text.format if text is not None else None
    if spec is None or spec.type == "text":
        return None
    if spec.type == "json_object":
        return GrammarSpec(kind="json_object")
    # The request model bounded exactly this text (tools.BoundedSchema), so it fits here.
    text_ = schema_text(spec.schema_)
    return GrammarSpec(kind="json_schema", schema_text=text_, strict=spec.strict is not False)


def chat_messages(items: str | list[InputItem]) -> list[dict[str, Any]]:
    """Input items as the chat template's messages, as the chat API maps its own: calls join
    the assistant turn before them, a call's output is a tool message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.content})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last["tool_calls"] = [*last.get("tool_calls", ()), call]
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            out.append({"role": "tool", "content": item.output, "tool_call_id": item.call_id})
    return out


def listed_items(items: str | list[InputItem]) -> list[dict[str, Any]]:
    """The input items as ``input_items`` lists them, each with an id."""
    if isinstance(items, str):
        items = [MessageItem.model_validate({"role": "user", "content": items})]
    listed = []
    for item in items:
        if isinstance(item, MessageItem):
            listed.append({
                "type": "message", "id": item.id or new_id("msg"), "role": item.role,
                "status": "completed",
                "content": [{"type": _PART[item.role], "text": item.content}],
            })  # fmt: skip
        elif isinstance(item, FunctionCallItem | FunctionCallOutputItem):
            entry = item.model_dump(mode="json", exclude_none=True)
            entry["id"] = item.id or new_id("fc" if isinstance(item, FunctionCallItem) else "fco")
            listed.append({**entry, "status": "completed"})
    return listed


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat template's assistant turn."""
    text = "".join(p["text"] for i in output if i["type"] == "message" for p in i["content"])
    calls = [
        {"id": i["call_id"], "type": "function",
         "function": {"name": i["name"], "arguments": i["arguments"]}}
        for i in output if i["type"] == "function_call"
    ]  # fmt: skip
    turn: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        turn["tool_calls"] = calls
    return [turn]


async def _prompt(
    state: ApiState, messages: list[dict[str, Any]], plan: ToolPlan, size: int
) -> list[int]:
    tokenizer = state.loaded_tokenizer()
    if not has_chat_template(tokenizer):
        raise invalid("this model has no chat template, which the Responses API needs", "input")
    context = prompt_context(state)
    try:
        return await state.off_loop(
            lambda: chat_prompt(tokenizer, messages, plan, context), size=size
        )
    except ApiError:
        raise  # too long for the context, found before tokenizing
    except Exception as exc:  # the template rejects the conversation (e.g. roles out of order)
        reason = str(exc)[:_MAX_TEMPLATE_ERROR_CHARS]
        raise invalid(f"the chat template rejected the input: {reason}", "input") from None


# --- handlers ---


async def _create(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    store = request.app[RESPONSE_STORE]
    body = validate(ResponsesRequest, await read_json(request))
    check_model(state, body.model)
    earlier: StoredResponse | None = None
    if body.previous_response_id is not None:
        earlier = store.get(body.previous_response_id)
        if earlier is None:
            raise not_found(body.previous_response_id, "previous_response_id")
    plan = _plan(body)
    grammar = _grammar(body.text)
    if plan.forced and grammar is not None:
        raise invalid("a forced tool call and a text.format cannot both hold", "tool_choice")
    history = [*(earlier.messages if earlier else ()), *chat_messages(body.input)]
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    prompt = await _prompt(state, system + history, plan, body_bytes(request))
    asked = GenerationRequest(
        model=body.model,
        max_tokens=body.max_output_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        grammar=grammar,
    )
    (params,) = choice_params(state, asked, len(prompt), "input", plan)
    await admit_sequences(request, 1)
    log_line = request_log(request)
    events = state.backend.generate(log_line.request_id, prompt, params)
    gen = Generation(events, state.backend.tokenizer, len(prompt), (), client_gone(request))
    reply = ResponseReply(body, params.adapter or state.model_name, plan)

    def keep(response: dict[str, Any]) -> None:
        if body.store is not False:
            turns = history + output_messages(response["output"])
            store.put(response, listed_items(body.input), turns)

    try:
        await gen.start()  # admission: a refusal is a plain error response, even when streaming
        if body.stream:
            return await stream_response(request, gen, reply, keep)
        await gen.collect()
        response = reply.complete(gen)
        keep(response)
        return web.json_response(response)
    finally:
        await gen.close()
        log_line.tokens = (len(prompt), gen.completion_tokens)


def _stored(request: web.Request) -> StoredResponse:
    key = request.match_info["response_id"]
    entry = request.app[RESPONSE_STORE].get(key)
    if entry is None:
        raise not_found(key, None)
    return entry


async def _get(request: web.Request) -> web.Response:
    if request.query.get("stream") in ("true", "1"):
        raise invalid("streaming a stored response is not supported", "stream", "unsupported")
    return web.json_response(_stored(request).response)


async def _delete(request: web.Request) -> web.Response:
    key = request.match_info["response_id"]
    if not request.app[RESPONSE_STORE].delete(key):
        raise not_found(key, None)
    return web.json_response({"id": key, "object": "response", "deleted": True})


def _limit(request: web.Request) -> int:
    raw = request.query.get("limit", "20")
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_ITEMS_PAGE:
        raise invalid(f"limit must be a whole number from 1 to {MAX_ITEMS_PAGE}", "limit")
    return int(raw)


async def _input_items(request: web.Request) -> web.Response:
    items = list(_stored(request).items)
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("order must be 'asc' or 'desc'", "order", "invalid_value")
    if order == "desc":  # OpenAI lists the newest first unless asked otherwise
        items.reverse()
    if (after := request.query.get("after")) is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise invalid("after must be the id of one of the response's input items", "after")
        items = items[ids.index(after) + 1 :]
    limit = _limit(request)
    page = items[:limit]
    listing = {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }
    return web.json_response(listing)


def add_responses_routes(
    app: web.Application,
    *,
    store_entries: int = DEFAULT_STORE_ENTRIES,
    store_bytes: int = DEFAULT_STORE_BYTES,
) -> None:
    """Serve the Responses API on ``app``, an app from ``create_app`` not yet started; at most
    ``store_entries`` responses and ``store_bytes`` bytes of them are kept (least recently
    used go first; 0 keeps none)."""
    if STATE not in app:
        raise ValueError("add_responses_routes needs an app built by create_app")
    app[RESPONSE_STORE] = ResponseStore(store_entries, store_bytes)
    app.router.add_post(RESPONSES_PATH, _create)
    app.router.add_get(RESPONSES_PATH + "/{response_id}", _get)
    app.router.add_delete(RESPONSES_PATH + "/{response_id}", _delete)
    app.router.add_get(RESPONSES_PATH + "/{response_id}/input_items", _input_items)
