"""The agent logs to journald with structured fields, or plain lines on stderr."""

from __future__ import annotations

import importlib
import io
import logging
import re
from collections.abc import Iterator
from typing import Any

import pytest

from mlxppd.runtime.system.service_logging import (
    JournaldHandler,
    JournalFieldsFilter,
    configure_logging,
)


def _systemd_journal() -> Any:
    try:
        return importlib.import_module("systemd.journal")
    except ImportError:
        pytest.skip(
            "systemd-python is not installed: apt-get install libsystemd-dev pkg-config, "
            "then pip install 'mlxpp[systemd]'"
        )


@pytest.fixture(autouse=True)
def restore_root_logger() -> Iterator[None]:
    # configure_logging changes the process-wide root logger; leave it as pytest set it up.
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    root.setLevel(level)


def test_without_systemd_lines_go_to_stderr_with_a_timestamp() -> None:
    stream = io.StringIO()
    assert configure_logging("info", environ={}, stream=stream) == "stderr"
    logging.getLogger("mlxppd.agent").info("serving on %s", "127.0.0.1:8080")
    logging.getLogger("mlxppd.agent").debug("not at info level")
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO mlxppd\.agent: serving on 127\.0\.0\.1:8080\n",
        stream.getvalue(),
    )


def test_the_level_names_match_the_settings() -> None:
    stream = io.StringIO()
    configure_logging("debug", environ={}, stream=stream)
    logging.getLogger("mlxppd.agent").debug("visible")
    assert "DEBUG mlxppd.agent: visible" in stream.getvalue()
    configure_logging("error", environ={}, stream=stream)
    logging.getLogger("mlxppd.agent").warning("hidden")
    assert "hidden" not in stream.getvalue()
    with pytest.raises(ValueError, match="debug, info, warning, error"):
        configure_logging("verbose", environ={}, stream=stream)


def test_calling_again_replaces_the_handler_it_installed() -> None:
    first, second = io.StringIO(), io.StringIO()
    configure_logging("info", environ={}, stream=first)
    configure_logging("info", environ={}, stream=second)
    logging.getLogger("mlxppd.agent").info("once")
    assert first.getvalue() == ""
    assert second.getvalue().count("once") == 1


def test_journal_stream_without_systemd_python_drops_the_timestamp_and_says_so() -> None:
    stream = io.StringIO()
    environ = {"JOURNAL_STREAM": "8:12345"}
    # systemd_python=False: as on a host without the mlxpp[systemd] extra.
    destination = configure_logging("info", environ=environ, stream=stream, systemd_python=False)
    assert destination == "stderr"
    logging.getLogger("mlxppd.agent").info("serving")
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith(
        "WARNING mlxppd.runtime.system.service_logging: systemd-python is not"
    )
    assert "mlxpp[systemd]" in lines[0]
    assert lines[1] == "INFO mlxppd.agent: serving"


def test_journal_stream_with_systemd_python_logs_to_journald(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    journal = _systemd_journal()
    real_send = journal.send
    sent: list[tuple[str, dict[str, Any]]] = []
    failures: list[BaseException] = []

    def send(message: str, **fields: Any) -> Any:
        sent.append((message, fields))
        # The real libsystemd call: it checks the fields (and drops the message silently
        # where no journald listens). The handler would swallow its error; keep it.
        try:
            return real_send(message, **fields)
        except BaseException as exc:
            failures.append(exc)
            raise

    monkeypatch.setattr(journal, "send", send)
    stream = io.StringIO()
    environ = {"JOURNAL_STREAM": "8:12345"}
    destination = configure_logging(
        "info", environ=environ, node_id="stage-1", role="pipeline_stage", stream=stream
    )
    assert destination == "journald"
    logging.getLogger("mlxppd.agent").info("serving on %s", "127.0.0.1:8080")
    assert stream.getvalue() == ""
    assert failures == []
    [(message, fields)] = [(m, f) for m, f in sent if f.get("LOGGER") == "mlxppd.agent"]
    assert message == "serving on 127.0.0.1:8080"
    assert fields["PRIORITY"] == "6"
    assert fields["SYSLOG_IDENTIFIER"] == "mlxppd"
    assert fields["MLXPP_NODE_ID"] == "stage-1"
    assert fields["MLXPP_ROLE"] == "pipeline_stage"
    assert fields["MLXPP_LOGGER"] == "mlxppd.agent"


def _record(name: str = "mlxppd.agent", level: int = logging.INFO) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, "reloaded %s", ("cluster.toml",), None)


def test_the_fields_filter_stamps_node_role_and_logger_on_every_record() -> None:
    record = _record()
    assert JournalFieldsFilter(node_id="stage-0", role="pipeline_stage").filter(record)
    assert record.MLXPP_NODE_ID == "stage-0"
    assert record.MLXPP_ROLE == "pipeline_stage"
    assert record.MLXPP_LOGGER == "mlxppd.agent"


def test_the_fields_filter_leaves_out_what_is_not_known_yet() -> None:
    record = _record("mlxppd.runtime.reload")
    assert JournalFieldsFilter(node_id=None, role=None).filter(record)
    assert not hasattr(record, "MLXPP_NODE_ID")
    assert not hasattr(record, "MLXPP_ROLE")
    assert record.MLXPP_LOGGER == "mlxppd.runtime.reload"


def test_the_journald_handler_sends_the_fields_with_each_message() -> None:
    # Stands in for systemd.journal.send, which writes to /run/systemd/journal/socket.
    sent: list[tuple[str, dict[str, Any]]] = []

    def send(message: str, **fields: Any) -> None:
        sent.append((message, fields))

    handler = JournaldHandler(send)
    handler.addFilter(JournalFieldsFilter(node_id="coordinator", role="hybrid"))
    logger = logging.getLogger("mlxppd.test_journald")
    logger.propagate = False
    logger.addHandler(handler)
    try:
        logger.warning("kv budget %d%% used", 93)
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
    [(message, fields)] = sent
    assert message == "kv budget 93% used"
    assert fields["PRIORITY"] == "4"
    assert fields["SYSLOG_IDENTIFIER"] == "mlxppd"
    assert fields["MLXPP_NODE_ID"] == "coordinator"
    assert fields["MLXPP_ROLE"] == "hybrid"
    assert fields["MLXPP_LOGGER"] == "mlxppd.test_journald"
    assert fields["LOGGER"] == "mlxppd.test_journald"
