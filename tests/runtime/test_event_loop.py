"""Which event loop mlxppd processes run on: uvloop where installed, unless told otherwise."""

from __future__ import annotations

import asyncio
import sys

import pytest

from mlxppd.core.errors import ConfigurationError
from mlxppd.runtime.system import event_loop


async def loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_uvloop_is_the_default_where_it_is_installed() -> None:
    pytest.importorskip("uvloop", reason="uvloop does not build on this platform")
    name, _ = event_loop.event_loop_factory({})
    assert name == "uvloop"
    assert event_loop.run(loop_module(), environ={}).startswith("uvloop")


@pytest.mark.parametrize("value", ["asyncio", "ASYNCIO", " asyncio "])
def test_the_environment_can_ask_for_asyncios_own_loop(value: str) -> None:
    environ = {event_loop.EVENT_LOOP_ENV: value}
    assert event_loop.event_loop_factory(environ)[0] == "asyncio"
    assert event_loop.run(loop_module(), environ=environ).startswith("asyncio")


def test_an_unknown_loop_name_is_a_configuration_error_naming_the_variable() -> None:
    main = loop_module()
    with pytest.raises(ConfigurationError) as raised:
        event_loop.run(main, environ={event_loop.EVENT_LOOP_ENV: "trio"})
    message = str(raised.value)
    assert "MLXPP_EVENT_LOOP" in message and "'trio'" in message
    assert "auto, uvloop, asyncio" in message
    assert main.cr_frame is None  # closed, not left to warn that it was never awaited


def test_asking_for_uvloop_without_it_installed_says_how_to_fix_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # what an absent package looks like
    with pytest.raises(ConfigurationError, match="pip install uvloop"):
        event_loop.event_loop_factory({event_loop.EVENT_LOOP_ENV: "uvloop"})
    # ... while the default quietly takes asyncio's loop.
    assert event_loop.event_loop_factory({})[0] == "asyncio"
