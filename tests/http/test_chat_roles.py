"""OpenAI's ``developer`` role is the system role: newer OpenAI clients send it instead of
``system``, and the prompt is exactly the one a system message makes (the template's default
system prompt is not added, no literal "developer" turn). The embedded model's own template."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxppd.engine.tokenizer import load_tokenizer
from mlxppd.http.chat_prompt import chat_prompt
from mlxppd.http.tools import ToolPlan

pytestmark = pytest.mark.slow

CONTEXT = 8192


def test_a_developer_message_renders_as_the_system_message(embedded_model_dir: Path) -> None:
    tokenizer = load_tokenizer(embedded_model_dir)
    question = {"role": "user", "content": "What is the capital of France?"}
    as_developer = [{"role": "developer", "content": "Answer in one word."}, question]
    as_system = [{"role": "system", "content": "Answer in one word."}, question]

    ids = chat_prompt(tokenizer, as_developer, ToolPlan(), CONTEXT)
    assert ids == chat_prompt(tokenizer, as_system, ToolPlan(), CONTEXT)
    text = tokenizer.decode(ids)
    assert "developer" not in text
    assert "Answer in one word." in text
    # Without a system message this template adds its own default one: not here.
    default = tokenizer.decode(chat_prompt(tokenizer, [question], ToolPlan(), CONTEXT))
    assert default.split("<|im_start|>user")[0] not in text
