"""The admin API's documents as ``mlxppctl`` reads them: parsed into the models the coordinator
built them from (``mlxppd/core/status_document.py``), so every command reads attributes of one
typed document, never keys of a dict.

A document that does not parse (another mlxpp version, or not a coordinator) is one line
naming the first field that differs, and exit status 3, like any other answer that is not the
coordinator's.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from mlxppd.cli.ctl_target import CoordinatorUnreachable, Target, call
from mlxppd.core.status_document import RepartitionEvents, StatusDocument
from mlxppd.http.admin_models import EVENTS_PATH, STATUS_PATH

__all__ = ["parse_answer", "read_events", "read_status"]

Document = TypeVar("Document", bound=BaseModel)


def read_status(target: Target, timeout: float) -> StatusDocument:
    """``GET /admin/v1/status``: the cluster's status with its health badge."""
    return parse_answer(StatusDocument, call(target, "GET", STATUS_PATH, timeout), target)


def read_events(target: Target, after: int, timeout: float) -> RepartitionEvents:
    """``GET /admin/v1/repartition/events``: the elastic state, the events above ``after``."""
    answer = call(target, "GET", f"{EVENTS_PATH}?after={after}", timeout)
    return parse_answer(RepartitionEvents, answer, target)


def parse_answer(model: type[Document], answer: dict[str, Any], target: Target) -> Document:
    """``answer`` as a ``model``; CoordinatorUnreachable (exit 3) when it is not one."""
    try:
        return model.model_validate(answer)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the document"
        raise CoordinatorUnreachable(
            f"the answer from {target.url} is not the {model.__name__} this mlxppctl reads "
            f"({where}: {first['msg']}); check that {target.where_from()} names the "
            "coordinator and that both run the same mlxpp version"
        ) from None
