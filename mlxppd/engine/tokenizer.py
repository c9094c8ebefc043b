"""Tokenizer loading and prompt encoding, through mlx-lm's wrapper (chat templates, EOS ids)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_tokenizer(model_dir: Path) -> Any:
    """mlx-lm's TokenizerWrapper for a local model directory."""
    from mlx_lm.utils import load_tokenizer as mlx_lm_load_tokenizer

    return mlx_lm_load_tokenizer(model_dir)


def encode_prompt(tokenizer: Any, text: str, *, chat_template: bool) -> list[int]:
    """Token ids for ``text``: wrapped as one user turn when the model has a chat template."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer.encode(text)]
