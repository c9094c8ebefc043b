"""How a stage opens an adapter's files (``engine/adapters/reader.py``): never through a
symbolic link, only a regular file of bounded size, checked on the descriptor it then reads
(mlx included); and no error quotes a byte of what it opened, the path escaped. An adapter
path is an operator's request to a stage host, so a link to a key file must not become a way
to read it back in an error."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest

from mlxppd.core.errors import ConfigurationError
from mlxppd.engine.adapters.reader import adapter_digest, read_adapter

pytestmark = pytest.mark.timeout(60)  # a FIFO opened the old way would wait for ever

#: a key file on the stage host: what a link in an adapter directory might point at
SECRET = b"sk-live-7f3c9a1e5b2d4c6a8e0f1a2b3c4d5e6f\n"
MODULE = "model.layers.0.self_attn.q_proj"
CONFIG = {"fine_tune_type": "lora", "num_layers": 1, "lora_parameters": {"rank": 4, "scale": 2.0}}


def everything(_module: str) -> bool:
    return True


def write_adapter(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    weights = {f"{MODULE}.lora_a": mx.ones((64, 4)), f"{MODULE}.lora_b": mx.zeros((4, 64))}
    mx.save_safetensors(str(directory / "adapters.safetensors"), weights)
    (directory / "adapter_config.json").write_text(json.dumps(CONFIG))
    return directory


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.secret"
    path.write_bytes(SECRET)
    path.chmod(0o600)
    return path


def refusal(read: Callable[[Path, Callable[[str], bool]], object], adapter: Path) -> str:
    with pytest.raises(ConfigurationError) as refused:
        read(adapter, everything)
    return str(refused.value)


def assert_no_bytes_of(message: str, data: bytes) -> None:
    """Neither the text nor the first 8 bytes as a number (a "header length") appear."""
    assert data.decode(errors="replace").strip() not in message
    assert data[:8].decode() not in message
    assert str(int.from_bytes(data[:8], "little")) not in message


def test_a_regular_adapter_is_read_and_digested_through_its_checked_descriptor(
    tmp_path: Path,
) -> None:
    adapter = write_adapter(tmp_path / "adapter")
    weights = read_adapter(adapter, everything)
    assert (weights.read, weights.stored, list(weights.modules)) == (2, 2, [MODULE])
    assert mx.array_equal(weights.modules[MODULE]["lora_a"], mx.ones((64, 4)))
    assert weights.digest == adapter_digest(adapter, everything)[0]


@pytest.mark.parametrize("read", [read_adapter, adapter_digest])
def test_a_weights_file_that_is_a_symbolic_link_is_refused_without_reading_its_target(
    read: Callable[[Path, Callable[[str], bool]], object], tmp_path: Path, secret: Path
) -> None:
    adapter = write_adapter(tmp_path / "adapter")
    (adapter / "adapters.safetensors").unlink()
    (adapter / "adapters.safetensors").symlink_to(secret)
    message = refusal(read, adapter)
    assert message == (
        f"{adapter}/adapters.safetensors: is a symbolic link, and adapter files are opened "
        "without following links; copy the file itself into the adapter directory (`cp -L`)"
    )
    assert_no_bytes_of(message, SECRET)


def test_a_link_to_a_real_adapter_file_is_refused_too(tmp_path: Path) -> None:
    """The rule is about the link, not its target: no target is opened through one."""
    real = write_adapter(tmp_path / "real")
    linked = write_adapter(tmp_path / "linked")
    for name in ("adapters.safetensors", "adapter_config.json"):
        (linked / name).unlink()
        (linked / name).symlink_to(real / name)
    assert "adapter_config.json: is a symbolic link" in refusal(read_adapter, linked)


def test_a_config_that_is_a_symbolic_link_is_refused(tmp_path: Path, secret: Path) -> None:
    adapter = write_adapter(tmp_path / "adapter")
    (adapter / "adapter_config.json").unlink()
    (adapter / "adapter_config.json").symlink_to(secret)
    message = refusal(read_adapter, adapter)
    assert message.startswith(f"{adapter}/adapter_config.json: is a symbolic link")
    assert_no_bytes_of(message, SECRET)


def test_a_key_copied_in_as_the_weights_file_is_not_a_safetensors_file(
    tmp_path: Path, secret: Path
) -> None:
    adapter = write_adapter(tmp_path / "adapter")
    (adapter / "adapters.safetensors").write_bytes(SECRET)
    for read in (read_adapter, adapter_digest):
        message = refusal(read, adapter)
        assert message.startswith(
            f"{adapter}/adapters.safetensors: is not a safetensors file (its header length is "
            "past the end of the file"
        )
        assert_no_bytes_of(message, SECRET)


def test_a_config_that_is_not_utf8_json_says_so_without_its_bytes(tmp_path: Path) -> None:
    adapter = write_adapter(tmp_path / "adapter")
    (adapter / "adapter_config.json").write_bytes(b"\xfe\xedKEYBYTES")
    message = refusal(read_adapter, adapter)
    assert message == f"{adapter}/adapter_config.json: is not UTF-8 text"
    (adapter / "adapter_config.json").write_bytes(b"{sk-live-secret")
    message = refusal(read_adapter, adapter)
    assert message.startswith(f"{adapter}/adapter_config.json: is not JSON (")
    assert "sk-live" not in message


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_something_other_than_a_regular_file_is_refused_without_waiting_on_it(
    kind: str, tmp_path: Path
) -> None:
    adapter = write_adapter(tmp_path / "adapter")
    weights = adapter / "adapters.safetensors"
    weights.unlink()
    if kind == "directory":
        weights.mkdir()
    else:
        os.mkfifo(weights)  # opened without O_NONBLOCK, this would wait for a writer
    for read in (read_adapter, adapter_digest):
        assert refusal(read, adapter) == f"{weights}: is not a regular file"


def test_the_path_in_an_error_is_escaped(tmp_path: Path, secret: Path) -> None:
    adapter = write_adapter(tmp_path / "evil\nstage 1: adapter loaded")
    (adapter / "adapters.safetensors").unlink()
    (adapter / "adapters.safetensors").symlink_to(secret)
    message = refusal(read_adapter, adapter)
    assert "\n" not in message and "evil\\nstage 1: adapter loaded" in message
