"""A schema the last stage cannot compile within its grammar compile limit reaches the client as
a 400 that names the limit and what to do, through the whole path: the HTTP API, the
coordinator's admission, real stage workers on loopback (the last one's compile made slow);
and the cluster serves the next request."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import aiohttp

from mlxppd.app.api_app import api_app
from mlxppd.app.http_site import start_site
from mlxppd.core.profile.model import read_model_config
from mlxppd.core.protocol.sampling import GrammarSpec
from mlxppd.core.stages import StageSpec
from mlxppd.engine.grammar import Constraint
from mlxppd.engine.grammar_compiles import GrammarCompiles
from mlxppd.engine.sampling import constraint_for
from mlxppd.engine.tokenizer import load_tokenizer
from mlxppd.runtime.coordinator.gate import GatedBackend
from mlxppd.runtime.stage.loader import load_stage_runner, stage_kv_manager
from mlxppd.runtime.stage.worker import StageWorker
from mlxppd.runtime.system.mlx_thread import MlxThread
from mlxppd.wire.backends import create_transport
from tests.support.pipelines import pipeline
from tests.support.wire import config, run

SPLIT = (StageSpec(0, 2, 0, 2), StageSpec(1, 2, 2, 4))  # the chat llama's four layers
LIMIT_S = 0.2
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


async def worker_for(
    model: Path, mlx: MlxThread, spec: StageSpec, grammars: GrammarCompiles | None = None
) -> StageWorker:
    runner, per_token = await load_stage_runner(mlx, model, spec, read_model_config(model))
    kv = stage_kv_manager(spec, per_token, None, 8)
    transport = create_transport("tcp", config(f"stage-{spec.index}"))
    return StageWorker(spec, runner, kv, transport, mlx, grammars=grammars)


def test_a_schema_past_the_compile_limit_is_a_400_naming_the_limit_and_the_fix(
    chat_llama: Path,
) -> None:
    let_go = threading.Event()

    def slow(grammar: GrammarSpec, tokenizer: Any, vocab: int) -> Constraint | None:
        let_go.wait(20)  # longer than the limit: the test lets it go once refused
        return constraint_for(grammar, tokenizer, vocab)

    async def scenario() -> tuple[int, dict[str, Any], int, str]:
        tokenizer = load_tokenizer(chat_llama)
        mlx = MlxThread("grammar-limit-mlx")
        grammars = GrammarCompiles(lambda: tokenizer, LIMIT_S, compile=slow)
        workers = [
            await worker_for(chat_llama, mlx, SPLIT[0]),
            await worker_for(chat_llama, mlx, SPLIT[1], grammars),
        ]
        async with pipeline(workers, mlx, chat_llama) as coordinator:
            gate = GatedBackend(tokenizer, "tiny")
            gate.coordinator = coordinator
            site, port = await start_site(api_app(gate), "127.0.0.1", 0)
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
            try:
                async with aiohttp.ClientSession() as http:
                    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8}
                    try:
                        async with http.post(url, json={**body, "response_format": fmt}) as r:
                            refused, error = r.status, (await r.json())["error"]
                    finally:
                        let_go.set()
                    async with http.post(url, json=body) as r:  # then a plain request
                        probe, text = r.status, await r.text()
            finally:
                await site.cleanup()
            return refused, error, probe, text

    refused, error, probe, text = run(scenario, timeout=180)
    assert refused == 400, error
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_value"
    assert error["message"] == (
        "stage 1 cannot serve this request's sampling parameters: the output schema did not "
        f"compile within the grammar compile limit of {LIMIT_S:g} s ([cluster] "
        "grammar_compile_limit_s); simplify the schema (fewer anyOf alternatives, string "
        "formats or patterns), or raise the limit"
    )
    assert probe == 200, text
    assert json.loads(text)["choices"][0]["finish_reason"] in ("length", "stop")
