"""A constrained stream survives the loss of the last stage: ``serve --pp-size 2``, a greedy
``json_object`` answer streamed, the last stage SIGKILLed mid-stream; its supervisor restarts
it, the coordinator replays the sequence, and the client's text is the same valid JSON as the
unfaulted run's. The tokens sent before the loss reach the new last stage only through stage
0's prefill, so its grammar must be told them (``SamplerSpec.replay``): started fresh, it once
turned a 141-character answer into 1,462 characters of invalid JSON."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from tests.support.clusters import (
    kill,
    restarted_stage_pids,
    start_cluster,
    wait_gone,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MESSAGES = [
    {"role": "user", "content": "Describe a person as JSON: a name, an age, a city and hobbies."}
]
MAX_TOKENS = 160
#: the chunk after which the last stage is killed
KILL_AFTER = 10


def stream_json(url: str, kill_pid: int | None = None) -> tuple[str, int, str | None]:
    """A greedy json_object stream's text, its chunk count and finish reason; ``kill_pid``
    is SIGKILLed after chunk ``KILL_AFTER``; any error event fails."""
    body = {
        "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
        "response_format": {"type": "json_object"},
    }  # fmt: skip
    text, chunks, finish = "", 0, None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            if event["choices"]:
                choice = event["choices"][0]
                text += choice["delta"].get("content") or ""
                finish = choice.get("finish_reason") or finish
            chunks += 1
            if chunks == KILL_AFTER and kill_pid is not None:
                kill(kill_pid)
    return text, chunks, finish


def test_a_json_answer_replayed_after_the_last_stage_is_lost_is_the_unfaulted_answer(
    tmp_path: Path, cli_env: dict[str, str]
) -> None:
    running = start_cluster(tmp_path, cli_env, "--pp-size", "2")
    try:
        expected, chunks, finish = stream_json(running.url)
        assert finish == "stop" and isinstance(json.loads(expected), dict), expected
        assert chunks > 2 * KILL_AFTER, expected  # long enough to be cut in the middle
        replayed, _, finish = stream_json(running.url, kill_pid=running.stage_pids[1])
        assert replayed == expected
        assert finish == "stop"
        (restarted,) = restarted_stage_pids(running, 1)
        assert re.search(
            r"failover: reconnected after [\d.]+ s: the lost node came back; 1 sequences "
            r"replayed",
            running.log(),
        ), running.log()[-3000:]
    finally:
        assert running.stop() == 0, running.log()
    assert wait_gone([running.proc.pid, *running.stage_pids, restarted]) == []
