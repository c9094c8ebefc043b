"""HTTPS end to end: a live ``mlxppd serve --pp-size 2 --tls-cert --tls-key`` cluster (real
processes and sockets, the embedded model, a certificate from ``mlxppctl tls self-signed``)
answered over https by the real ``openai`` and ``anthropic`` packages, each given an httpx
client (the Anthropic SDK's: httpx2) that trusts that certificate alone: a chat completion and
its stream, a message and its stream. ``mlxppctl status`` reaches the admin API with
``--cacert`` and with the right ``--pin-sha256``, and refuses a wrong pin naming both
fingerprints; plain http to the TLS port gets no answer; the log and the ready file name the
https:// URL, and the ``--metrics-port`` listener serves HTTPS too. Last, the web console in
headless Chromium (when Debian's ``chromium`` is installed) that accepts this one certificate
by its public key (``--ignore-certificate-errors-spki-list``; without it Chromium refuses the
page): the page logs in and shows a card per stage, and its screenshot goes to
``build/console-screenshots/https-console.png``."""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from mlxppd.wire.secret import write_new_secret
from tests.clients import asks
from tests.clients.conftest import KEY, MODEL
from tests.clients.loopback import LoopbackGuard
from tests.support.clusters import RunningCluster, start_cluster
from tests.support.mlxppctl import MLXPPCTL
from tests.support.paths import REPO_ROOT
from tests.support.tls import TlsPair, assert_plain_http_gets_no_answer

if TYPE_CHECKING:
    import httpx

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("loopback_only")]


@dataclass(frozen=True)
class TlsCluster:
    url: str
    tls: TlsPair
    secret: Path
    running: RunningCluster
    #: the --metrics-port listener's base URL, from its ready file
    metrics_url: str
    #: mlxppctl's environment: no MLXPP_* settings, an empty config directory
    ctl_env: dict[str, str]


@pytest.fixture(scope="module")
def tls_cluster(
    tmp_path_factory: pytest.TempPathFactory, cli_env: dict[str, str]
) -> Iterator[TlsCluster]:
    tmp = tmp_path_factory.mktemp("https-cluster")
    cert, key = tmp / "server.crt", tmp / "server.key"
    made = subprocess.run(
        [*MLXPPCTL, "tls", "self-signed", "--cert", str(cert), "--key", str(key),
         "--host", "127.0.0.1"],
        capture_output=True, text=True, env=cli_env, timeout=60, cwd=REPO_ROOT, check=True,
    )  # fmt: skip
    pair = TlsPair(cert, key, made.stdout.strip())
    key_file, secret = tmp / "api.key", tmp / "cluster.secret"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    write_new_secret(secret)
    flags = ["--pp-size", "2", "--api-key-file", str(key_file), "--alias", MODEL]
    flags += ["--tls-cert", str(cert), "--tls-key", str(key), "--cluster-secret-file", str(secret)]
    metrics_ready = tmp / "metrics.ready"
    flags += ["--metrics", "--metrics-port", "0", "--metrics-ready-file", str(metrics_ready)]
    running = start_cluster(tmp, cli_env, *flags)
    ctl_env = {k: v for k, v in cli_env.items() if not k.startswith("MLXPP_")}
    (tmp / "empty-config").mkdir()
    ctl_env["MLXPP_CONFIG_DIR"] = str(tmp / "empty-config")
    try:
        metrics_url = metrics_ready.read_text().strip()
        yield TlsCluster(running.url.rstrip("/"), pair, secret, running, metrics_url, ctl_env)
    finally:
        running.stop()


@pytest.fixture()
def trusting(tls_cluster: TlsCluster, loopback_only: LoopbackGuard) -> Iterator[httpx.Client]:
    """An httpx client that trusts the cluster's certificate alone (chain and name checked);
    one per test, since an SDK client closes the httpx client it was given."""
    import httpx

    with httpx.Client(verify=tls_cluster.tls.client_context(), timeout=120) as client:
        yield client


@pytest.fixture()
def trusting2(tls_cluster: TlsCluster, loopback_only: LoopbackGuard) -> Iterator[Any]:
    """The same in ``httpx2``, the fork the Anthropic SDK runs on (it refuses an httpx one)."""
    import httpx2

    with httpx2.Client(verify=tls_cluster.tls.client_context(), timeout=120) as client:
        yield client


def test_the_cluster_says_https_where_it_names_its_url(tls_cluster: TlsCluster) -> None:
    assert tls_cluster.url.startswith("https://127.0.0.1:")
    log = tls_cluster.running.log()
    assert f"OpenAI API on {tls_cluster.url}/v1" in log
    assert f"web console on {tls_cluster.url}/console" in log


def test_the_metrics_port_serves_https_too(tls_cluster: TlsCluster, trusting: httpx.Client) -> None:
    assert tls_cluster.metrics_url.startswith("https://127.0.0.1:")
    response = trusting.get(tls_cluster.metrics_url + "/metrics")
    assert response.status_code == 200 and "mlxpp_" in response.text


def test_openai_chat_and_its_stream_over_https(
    tls_cluster: TlsCluster, trusting: httpx.Client
) -> None:
    from openai import OpenAI

    with OpenAI(
        base_url=tls_cluster.url + "/v1", api_key=KEY, http_client=trusting, max_retries=0
    ) as client:
        ask = {
            "model": MODEL,
            "messages": [{"role": "user", "content": asks.HELLO}],
            "max_tokens": asks.CHAT_TOKENS,
            "temperature": 0,
        }
        completion = client.chat.completions.create(**ask)
        text = completion.choices[0].message.content
        assert text and completion.usage and 0 < completion.usage.completion_tokens <= 8
        chunks = list(client.chat.completions.create(**ask, stream=True))
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([d for d in deltas if d]) > 1, "the text came in one piece, not streamed"
    assert "".join(deltas) == text


def test_anthropic_message_and_its_stream_over_https(
    tls_cluster: TlsCluster, trusting2: Any
) -> None:
    from anthropic import Anthropic

    with Anthropic(
        base_url=tls_cluster.url, api_key=KEY, http_client=trusting2, max_retries=0
    ) as client:
        ask = {
            "model": MODEL,
            "max_tokens": asks.CHAT_TOKENS,
            "messages": [{"role": "user", "content": asks.HELLO}],
            "extra_body": {"temperature": 0},
        }
        message = client.messages.create(**ask)
        assert message.content[0].type == "text" and message.content[0].text
        with client.messages.stream(**ask) as stream:
            pieces = list(stream.text_stream)
            final = stream.get_final_message()
    assert len([p for p in pieces if p]) > 1, "the text came in one piece, not streamed"
    assert final.content[0].type == "text" and final.content[0].text == "".join(pieces)
    assert "".join(pieces) == message.content[0].text


def _status(cluster: TlsCluster, *trust: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*MLXPPCTL, "status", "--url", cluster.url, "--cluster-secret-file", str(cluster.secret),
         *trust],
        capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, env=cluster.ctl_env,
    )  # fmt: skip


def test_mlxppctl_status_with_the_ca_certificate(tls_cluster: TlsCluster) -> None:
    proc = _status(tls_cluster, "--cacert", str(tls_cluster.tls.cert))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("cluster ") and "HEALTHY" in proc.stdout.splitlines()[0]


def test_mlxppctl_status_with_the_right_pin(tls_cluster: TlsCluster) -> None:
    assert tls_cluster.tls.pin.startswith("sha256:")
    proc = _status(tls_cluster, "--pin-sha256", tls_cluster.tls.pin)
    assert proc.returncode == 0, proc.stderr
    assert "HEALTHY" in proc.stdout.splitlines()[0]


def test_mlxppctl_refuses_a_wrong_pin_naming_both(tls_cluster: TlsCluster) -> None:
    wrong = "sha256:" + "0" * 64
    proc = _status(tls_cluster, "--pin-sha256", wrong)
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    [line] = proc.stderr.strip().splitlines()
    assert f"presented the certificate {tls_cluster.tls.pin}, not {wrong}" in line
    assert proc.stdout == ""


def test_mlxppctl_without_trust_says_how_to_give_it(tls_cluster: TlsCluster) -> None:
    proc = _status(tls_cluster)
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    assert "does not verify" in proc.stderr and "--cacert" in proc.stderr


def test_plain_http_to_the_tls_port_gets_no_answer(tls_cluster: TlsCluster) -> None:
    assert_plain_http_gets_no_answer(int(tls_cluster.url.rsplit(":", 1)[1]))


CHROMIUM = shutil.which("chromium")
SHOTS = Path(
    os.environ.get("MLXPP_CONSOLE_SCREENSHOTS", REPO_ROOT / "build" / "console-screenshots")
)


def _spki_pin(cert: Path) -> str:
    """base64 SHA-256 of the certificate's public key: what Chromium's SPKI list takes."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    key = x509.load_pem_x509_certificate(cert.read_bytes()).public_key()
    der = key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return base64.b64encode(hashlib.sha256(der).digest()).decode()


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium")
def test_the_console_over_https_in_chromium(tls_cluster: TlsCluster, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    args = [
        "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--ignore-certificate-errors-spki-list={_spki_pin(tls_cluster.tls.cert)}",
    ]  # fmt: skip
    with sync_playwright() as playwright:
        # A persistent profile: Chromium honours the SPKI list only with --user-data-dir.
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, args=args,
            viewport={"width": 1280, "height": 900},
        )  # fmt: skip
        try:
            page = context.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.goto(f"{tls_cluster.url}/console")
            page.fill("#api-key", KEY)
            page.click("#login-form button")
            page.wait_for_selector("[data-testid=stage-card-1]")
            page.wait_for_function(
                "document.querySelector('[data-testid=badge]').dataset.health === 'healthy'"
            )
            SHOTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SHOTS / "https-console.png"), full_page=True)
            assert page.url.startswith("https://")
            assert not errors, errors
        finally:
            context.close()
