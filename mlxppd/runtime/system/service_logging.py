"""Where the agent's log goes: the journal with structured fields, or plain lines on stderr.

systemd sets ``JOURNAL_STREAM`` when stderr goes to the journal. With systemd-python installed
(the ``mlxpp[systemd]`` extra) records go to journald natively, carrying ``MLXPP_NODE_ID``,
``MLXPP_ROLE`` and ``MLXPP_LOGGER`` so ``journalctl MLXPP_ROLE=hybrid`` finds them. Otherwise
lines go to stderr, without a timestamp when journald adds its own.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable, Mapping
from typing import Any, TextIO

__all__ = [
    "JOURNAL_FIELDS",
    "SYSLOG_IDENTIFIER",
    "JournalFieldsFilter",
    "JournaldHandler",
    "configure_logging",
]

SYSLOG_IDENTIFIER = "mlxppd"
JOURNAL_FIELDS = ("MLXPP_NODE_ID", "MLXPP_ROLE", "MLXPP_LOGGER")
STDERR_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
JOURNAL_STREAM_FORMAT = "%(levelname)s %(name)s: %(message)s"

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}

# Marks the handlers configure_logging installed, so a second call replaces only those
# (pytest's and other embedders' handlers on the root logger stay).
_OWNED = "_mlxpp_service_logging"


class JournalFieldsFilter(logging.Filter):
    """Stamps every record with the journal fields of this node (never drops a record)."""

    def __init__(self, *, node_id: str | None, role: str | None) -> None:
        super().__init__()
        self._constant = {
            key: value
            for key, value in (("MLXPP_NODE_ID", node_id), ("MLXPP_ROLE", role))
            if value is not None
        }

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in self._constant.items():
            setattr(record, key, value)
        record.MLXPP_LOGGER = record.name
        return True


class JournaldHandler(logging.Handler):
    """Sends each record to journald through ``send`` (``systemd.journal.send``).

    systemd-python's own JournalHandler forwards only fields fixed at construction (and
    MESSAGE_ID), so the fields a filter stamps on a record would never reach the journal.
    """

    def __init__(
        self,
        send: Callable[..., Any],
        *,
        identifier: str = SYSLOG_IDENTIFIER,
        level: int = logging.NOTSET,
    ) -> None:
        super().__init__(level)
        self._send = send
        self._identifier = identifier

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fields = {
                key: str(getattr(record, key)) for key in JOURNAL_FIELDS if hasattr(record, key)
            }
            self._send(
                self.format(record),
                PRIORITY=str(_syslog_priority(record.levelno)),
                SYSLOG_IDENTIFIER=self._identifier,
                LOGGER=record.name,
                THREAD_NAME=record.threadName,
                CODE_FILE=record.pathname,
                CODE_LINE=record.lineno,
                CODE_FUNC=record.funcName,
                **fields,
            )
        except Exception:
            self.handleError(record)


def _syslog_priority(levelno: int) -> int:
    # syslog(3) priorities: 2 crit, 3 err, 4 warning, 6 info, 7 debug.
    if levelno <= logging.DEBUG:
        return 7
    if levelno <= logging.INFO:
        return 6
    if levelno <= logging.WARNING:
        return 4
    if levelno <= logging.ERROR:
        return 3
    return 2


def _journal_send() -> Callable[..., Any] | None:
    try:
        journal = importlib.import_module("systemd.journal")
    except ImportError:
        return None
    send: Callable[..., Any] = journal.send
    return send


def configure_logging(
    level: str,
    *,
    environ: Mapping[str, str],
    node_id: str | None = None,
    role: str | None = None,
    stream: TextIO | None = None,
    systemd_python: bool = True,
) -> str:
    """Set up the root logger for the agent; returns ``"journald"`` or ``"stderr"``.

    Calling it again (a reload changed the level or the node id) replaces the handler it
    installed before. ``stream`` defaults to ``sys.stderr`` at call time. ``systemd_python``
    False logs as if systemd-python were not installed.
    """
    try:
        numeric = _LEVELS[level.lower()]
    except KeyError:
        raise ValueError(f"unknown log level {level!r}; use one of {', '.join(_LEVELS)}") from None
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _OWNED, False)]:
        root.removeHandler(old)
        old.close()

    journal_stream = bool(environ.get("JOURNAL_STREAM"))
    send = _journal_send() if journal_stream and systemd_python else None
    handler: logging.Handler
    if send is not None:
        handler = JournaldHandler(send)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.addFilter(JournalFieldsFilter(node_id=node_id, role=role))
        destination = "journald"
    else:
        handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
        # journald stamps every line itself; a second timestamp only adds noise.
        handler.setFormatter(
            logging.Formatter(JOURNAL_STREAM_FORMAT if journal_stream else STDERR_FORMAT)
        )
        destination = "stderr"
    setattr(handler, _OWNED, True)
    root.addHandler(handler)
    root.setLevel(numeric)
    if journal_stream and send is None:
        logging.getLogger(__name__).warning(
            "systemd-python is not installed (pip install 'mlxpp[systemd]'): logging plain "
            "lines to stderr, which journald records without structured fields"
        )
    return destination
