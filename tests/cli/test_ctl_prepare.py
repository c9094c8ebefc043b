"""``mlxppctl prepare``'s view of the transfer: a bar per node (bytes, rate, ETA) redrawn in
place on a terminal, plain lines otherwise; and the status text's identity and prepare rows."""

from __future__ import annotations

import io
from typing import Any

from mlxppd.cli.ctl_admin import render_status
from mlxppd.cli.ctl_prepare import ProgressView, progress_line
from mlxppd.core.status_document import PrepareNodeProgress
from tests.support.admin_server import status_document

SENDING: dict[str, Any] = {
    "node": "stage-0", "stage": 0, "layers": [0, 15], "state": "sending", "found": "missing",
    "tensors_needed": 300, "bytes_total": 64_000_000, "bytes_resumed": 16_000_000,
    "bytes_sent": 16_000_000, "stage_bytes": 64_000_000, "rate_bytes_s": 8_000_000.0,
    "eta_s": 4.0, "error": None,
}  # fmt: skip


def node(**changes: Any) -> PrepareNodeProgress:
    """SENDING with ``changes``, as mlxppctl parses it from the status document."""
    return PrepareNodeProgress.model_validate({**SENDING, **changes})


def test_a_line_shows_the_bar_bytes_rate_eta_and_state() -> None:
    line = progress_line(node(), bar_width=10)
    assert line.startswith("stage-0")
    assert "[#####.....]  50%" in line
    assert "32.0 / 64.0 MB, 16.0 MB resumed" in line
    assert "8.0 MB/s" in line and "ETA 0m04s" in line and "sending (missing)" in line


def test_a_terminal_redraws_the_bars_in_place() -> None:
    out = io.StringIO()
    view = ProgressView(out, tty=True)
    view.show([node(), node(node="stage-1")])
    view.show([node(bytes_sent=48_000_000), node(node="stage-1")])
    text = out.getvalue()
    assert text.count("\x1b[2F") == 1  # back up two lines once, then draw over them
    assert text.count("stage-0") == 2 and "100%" in text


def test_plain_output_prints_a_line_per_tenth_or_state_change_only() -> None:
    out = io.StringIO()
    view = ProgressView(out, tty=False)
    for sent in (16_000_000, 16_100_000, 16_200_000, 48_000_000):
        view.show([node(bytes_sent=sent)])
    view.show([node(bytes_sent=48_000_000, state="done", eta_s=None)])
    view.finish([node(bytes_sent=48_000_000, state="done")])
    lines = out.getvalue().splitlines()
    assert "\x1b" not in out.getvalue()
    assert len(lines) == 4  # 50%, 100%, done, and the summary
    assert lines[-1] == (
        "stage-0: holds the cluster's copy of layers [0, 15] (missing); 48.0 MB sent of the "
        "stage's 64.0 MB"
    )


def test_status_text_shows_each_stages_identity_and_the_last_prepare() -> None:
    prepare = {"state": "running", "reason": "operator", "started_at": 0.0,
               "max_rate_bytes_s": None, "nodes": [SENDING]}  # fmt: skip
    verified = {"state": "verified", "detail": "", "expected_sha256": None,
                "actual_sha256": "ab" * 32}  # fmt: skip
    mismatch = {"state": "mismatch", "expected_sha256": None, "actual_sha256": None,
                "detail": "model_mismatch: stage 1 (node stage-1): its tensors differ"}  # fmt: skip
    document = status_document(
        cluster="c", health="unhealthy", detail="refused", coordinator={"prepare": prepare},
        cards=[{"identity": verified}, {"identity": mismatch}],
    )  # fmt: skip
    text = render_status(document, dash="-")
    assert "prepare (operator): running" in text
    assert "  stage-0 " in text and "sending (missing)" in text
    assert "model identity     verified (sha256 abababababababab)" in text
    assert "model identity     mismatch: model_mismatch: stage 1" in text
