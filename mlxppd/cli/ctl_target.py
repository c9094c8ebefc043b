"""Where ``mlxppctl`` sends admin requests, what it signs them with, and one signed request.

The coordinator's address, the signing key and the cluster name come from flags, else from
this host's config directory; the name, failing both, from the coordinator's unsigned
challenge route. The key is the operator key of ``--operator-key`` (or
``MLXPP_OPERATOR_KEY_FILE``) when one is named, else the one derived from the cluster secret
(legacy mode: a cluster that lists ``[operators]`` refuses it). A redirect is never followed:
the signature (bound to the Host) stays with the address it was made for (docs/admin-api.md).
"""

from __future__ import annotations

import argparse
import json
import ssl
import time
import tomllib
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from email.message import Message
from pathlib import Path
from typing import IO, Any

from mlxppd.cli.tls_client import PinMismatch, https_handler
from mlxppd.core.config.addresses import join_host_port
from mlxppd.core.config.cluster import load_cluster_config
from mlxppd.core.config.host import (
    CLUSTER_FILE,
    HOST_FILE,
    HostSettings,
    config_dir_from,
    load_host_settings,
)
from mlxppd.core.config.names import name_problem
from mlxppd.core.config.private_file import ENV_ALLOW_LOOSE
from mlxppd.core.errors import ConfigurationError, MlxppError
from mlxppd.http.admin_models import CHALLENGE_PATH
from mlxppd.wire.admin_auth import (
    admin_key,
    challenged_cluster,
    sign_operator_request,
    sign_request,
)
from mlxppd.wire.operator_key import (
    ENV_OPERATOR_KEY_FILE,
    OPERATOR_KEY_FLAG,
    OPERATORS_KEY,
    OperatorKey,
    load_operator_key,
)
from mlxppd.wire.secret import load_cluster_secret, resolve_secret_source

EXIT_UNREACHABLE = 3
#: a status document of a large cluster is a few KiB; never read an unbounded answer
MAX_RESPONSE_BYTES = 4 * 1024 * 1024


class CoordinatorUnreachable(MlxppError):
    """The coordinator did not answer, or refused the request (exit status 3)."""

    exit_code = EXIT_UNREACHABLE


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A 3xx answer stays an HTTPError: a signed request is never re-sent elsewhere."""

    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: IO[bytes],
        code: int,
        msg: str,
        headers: Message,
        newurl: str,
    ) -> urllib.request.Request | None:
        return None


def cluster_name_flag(value: str) -> str:
    """``--cluster-name``: the node-id rules, or a one-line error naming the flag."""
    problem = name_problem(value, "the cluster name")
    if problem is not None:
        raise ConfigurationError(f"{problem}; give the [cluster] name", source="--cluster-name")
    return value


class Target:
    """The coordinator's base URL, the admin key and the cluster name, from flags and the
    config directory."""

    def __init__(self, args: argparse.Namespace, environ: Mapping[str, str]) -> None:
        self._config_dir = config_dir_from(args.config_dir, environ)
        self._host: HostSettings | None = None
        self._environ = dict(environ)
        if args.allow_loose_secret_file:
            self._environ[ENV_ALLOW_LOOSE] = "1"
        self.from_config = args.url is None
        self.url = _base_url(args.url) if args.url is not None else self._url_from_config()
        #: the Host header every request carries, and every signature covers
        self.host = urllib.parse.urlsplit(self.url).netloc.lower()
        self.https = self._https(args)
        #: the operator key that signs, when one is named (then no secret is read)
        self.operator = self._operator_key(getattr(args, "operator_key", None))
        self.key: bytes | None = None
        if self.operator is None:
            self.secret_origin, self.key = self._key(args.cluster_secret_file)
        else:
            self.secret_origin = self.operator.origin
        self.cluster: str | None = None
        self.cluster_origin = "--cluster-name"
        if args.cluster_name is not None:
            self.cluster = cluster_name_flag(args.cluster_name)
        elif (self._config_dir / CLUSTER_FILE).exists():
            self.cluster = _cluster_value(self._config_dir / CLUSTER_FILE, "name", "mlxpp-cluster")
            self.cluster_origin = f"[cluster] name in {self._config_dir / CLUSTER_FILE}"

    def _https(self, args: argparse.Namespace) -> urllib.request.HTTPSHandler:
        for flag, dest in (("--cacert", "cacert"), ("--pin-sha256", "pin_sha256")):
            value = getattr(args, dest, None)
            if value is not None and not self.url.startswith("https://"):
                raise ConfigurationError(
                    f"{flag} has no effect on {self.url}, which is plain HTTP; give the "
                    f"coordinator's https:// address, or drop {flag}",
                    source=flag,
                )
        return https_handler(args)

    def _host_settings(self) -> HostSettings:
        if self._host is None:
            self._host = load_host_settings(
                self._config_dir, environ=self._environ, read_api_key=False
            )
        return self._host

    def _url_from_config(self) -> str:
        host = self._host_settings()
        if host.http_port == 0:
            raise ConfigurationError(
                "http_port is 0 (a free port picked at start), so the coordinator's address is "
                "unknown; pass --url",
                source=str(self._config_dir / HOST_FILE),
            )
        address = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host.http_host, host.http_host)
        scheme = "https" if host.tls_cert_file is not None else "http"
        return f"{scheme}://{join_host_port(address, host.http_port)}"

    def _operator_key(self, flag_path: str | None) -> OperatorKey | None:
        if flag_path:
            return load_operator_key(flag_path, environ=self._environ)
        if self._environ.get(ENV_OPERATOR_KEY_FILE):
            path = self._environ[ENV_OPERATOR_KEY_FILE]
            return load_operator_key(path, named_by=ENV_OPERATOR_KEY_FILE, environ=self._environ)
        return None

    def _key(self, flag_path: str | None) -> tuple[str, bytes]:
        config_secret_file: str | None = None
        # The config files are read only when neither a flag nor the environment names the
        # secret, so a broken mlxppd.toml does not stand in the way of explicit flags.
        if (
            resolve_secret_source(
                flag_path=flag_path, environ=self._environ, config_secret_file=None
            )
            is None
        ):
            config_secret_file = self._host_settings().secret_file
            cluster_file = self._config_dir / CLUSTER_FILE
            if config_secret_file is None and cluster_file.exists():
                config_secret_file = _cluster_value(cluster_file, "secret_file", None)
        found = resolve_secret_source(
            flag_path=flag_path, environ=self._environ, config_secret_file=config_secret_file
        )
        if found is None:
            # On an operator's own machine there is no secret: the key is what is missing.
            raise ConfigurationError(
                f"no operator key and no cluster secret to sign admin requests with; pass "
                f"{OPERATOR_KEY_FLAG} PATH (or set {ENV_OPERATOR_KEY_FILE}) with a key listed "
                f"under {OPERATORS_KEY}, or, on a cluster without {OPERATORS_KEY}, "
                "--cluster-secret-file PATH (`mlxppctl status --help` lists every place the "
                "secret is looked up)"
            )
        secret = load_cluster_secret(
            flag_path=flag_path,
            environ=self._environ,
            config_secret_file=config_secret_file,
            config_dir=self._config_dir,
        )
        return secret.origin, admin_key(secret.key_bytes())

    def where_from(self) -> str:
        if self.from_config:
            return f"http_host/http_port in {self._config_dir / HOST_FILE} or --url"
        return "--url"

    def cluster_name(self, timeout: float) -> str:
        """The name requests are signed for; asks the coordinator when nothing says it."""
        if self.cluster is None:
            answer = _send(self, urllib.request.Request(self.url + CHALLENGE_PATH), timeout, ())
            name = answer.get("cluster")
            if not isinstance(name, str) or name_problem(name, "the cluster name"):
                raise CoordinatorUnreachable(
                    f"{self.url} did not say its cluster name; pass --cluster-name"
                )
            self.cluster, self.cluster_origin = name, f"the coordinator at {self.url}"
        return self.cluster


_LENIENT_KEYS = {
    "name": ("name", "--cluster-name"),
    "secret_file": ("secret", "--cluster-secret-file"),
}


def _cluster_value(path: Path, key: str, default: str | None) -> str | None:
    """``[cluster] <key>``, read leniently: status matters most when the cluster TOML is broken
    (the running agents keep the previous one), so only this key has to be readable."""
    try:
        value = getattr(load_cluster_config(path).cluster, key)
        return value if isinstance(value, str) else default
    except ConfigurationError:
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
            what, flag = _LENIENT_KEYS[key]
            raise ConfigurationError(
                f"cannot find the cluster {what}: the cluster TOML does not parse; pass {flag}",
                source=str(path),
            ) from None
        section = data.get("cluster")
        value = section.get(key) if isinstance(section, dict) else None
        return value if isinstance(value, str) and value else default


def _base_url(raw: str) -> str:
    parsed = urllib.parse.urlsplit(raw.strip())
    if (
        parsed.scheme not in ("http", "https")
        or not parsed.hostname
        or parsed.path not in ("", "/")
        or parsed.query
        or parsed.fragment
        or parsed.username
    ):
        raise ConfigurationError(
            "takes the coordinator's base URL: scheme, host and port only, "
            "e.g. http://10.0.0.1:8080",
            source="--url",
        )
    try:
        parsed.port  # noqa: B018 - a bad port raises here
    except ValueError:
        raise ConfigurationError(
            "the port is not a number from 0 to 65535", source="--url"
        ) from None
    return f"{parsed.scheme}://{parsed.netloc}"


def call(
    target: Target,
    method: str,
    path: str,
    timeout: float,
    body: bytes = b"",
    accept: tuple[int, ...] = (),
) -> dict[str, Any]:
    """One signed request; HTTP errors in ``accept`` return their JSON body like a success."""
    cluster = target.cluster_name(timeout)
    now = time.time()
    if target.operator is not None:
        signature = sign_operator_request(
            target.operator, method, path, body, now=now, cluster=cluster, host=target.host
        )
    else:
        assert target.key is not None
        signature = sign_request(
            target.key, method, path, body, now=now, cluster=cluster, host=target.host
        )
    headers = {"Authorization": signature, "Accept": "application/json", "Host": target.host}
    if body:
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(
        target.url + path,
        data=body if method == "POST" else None,
        method=method,
        headers=headers,
    )
    return _send(target, request, timeout, accept)


def _send(
    target: Target, request: urllib.request.Request, timeout: float, accept: tuple[int, ...]
) -> dict[str, Any]:
    # The coordinator sits on the cluster's own network: a desktop proxy setting must not
    # reroute (or break) admin requests, and a redirect must not carry a signature elsewhere.
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), _NoRedirects(), target.https
    )
    try:
        with opener.open(request, timeout=timeout) as response:
            raw = response.read(MAX_RESPONSE_BYTES + 1)
    except urllib.error.HTTPError as exc:
        if exc.code not in accept:
            raise _refused(target, exc) from None
        raw = exc.read(MAX_RESPONSE_BYTES + 1)
    except (urllib.error.URLError, OSError) as exc:
        reason: Any = getattr(exc, "reason", None) or exc
        if isinstance(reason, PinMismatch):
            raise CoordinatorUnreachable(
                f"refused the coordinator at {target.url}: {reason}"
            ) from None
        if isinstance(reason, ssl.SSLCertVerificationError):
            raise CoordinatorUnreachable(
                f"the certificate of the coordinator at {target.url} does not verify "
                f"({reason.verify_message}); pass --cacert FILE with its certificate (or its "
                "CA's), or --pin-sha256 with its fingerprint"
            ) from None
        if isinstance(reason, OSError) and reason.strerror:
            reason = reason.strerror  # "Connection refused", without the errno
        raise CoordinatorUnreachable(
            f"cannot reach the coordinator at {target.url}: {reason}; check "
            f"{target.where_from()} and that mlxppd is running there"
        ) from None
    if len(raw) > MAX_RESPONSE_BYTES:
        raise CoordinatorUnreachable(
            f"the answer from {target.url} is larger than {MAX_RESPONSE_BYTES} bytes; check "
            f"that {target.where_from()} names the coordinator"
        )
    try:
        document = json.loads(raw)
    except ValueError:
        document = None
    if not isinstance(document, dict):
        raise CoordinatorUnreachable(
            f"the answer from {target.url} is not a JSON object; check that "
            f"{target.where_from()} names the coordinator"
        )
    return document


def _printable(text: str | None, limit: int = 200) -> str:
    clean = "".join(c if c.isprintable() else "?" for c in (text or ""))
    return clean[:limit] + ("..." if len(clean) > limit else "")


def _refused(target: Target, exc: urllib.error.HTTPError) -> CoordinatorUnreachable:
    if 300 <= exc.code < 400:
        location = _printable(exc.headers.get("Location")) or "nowhere"
        return CoordinatorUnreachable(
            f"{target.url} answered HTTP {exc.code} redirecting to {location}; mlxppctl never "
            f"sends a signed request on to another address: check {target.where_from()} and "
            "give the coordinator's own address"
        )
    code: Any = None
    try:
        error = json.loads(exc.read(64 * 1024)).get("error", {})
        code = error.get("code") if isinstance(error, dict) else None
    except (ValueError, AttributeError, OSError):
        pass
    if exc.code == 401:
        return _unauthorized(target, code, challenged_cluster(exc.headers.get("WWW-Authenticate")))
    if exc.code == 404:
        return CoordinatorUnreachable(
            f"{target.url} has no admin API (HTTP 404); check that {target.where_from()} "
            "names the coordinator"
        )
    return CoordinatorUnreachable(
        f"the coordinator at {target.url} answered HTTP {exc.code} {exc.reason}; check its log"
    )


def _unauthorized(target: Target, code: Any, cluster: str | None) -> CoordinatorUnreachable:
    if code == "stale":
        return CoordinatorUnreachable(
            f"the coordinator at {target.url} refused the signature as stale; check that this "
            "host's clock and the coordinator's agree (NTP)"
        )
    if code == "wrong_host":
        return CoordinatorUnreachable(
            f"the coordinator at {target.url} does not answer to Host {target.host}, which the "
            "signature covers; give its own address and port (not a proxy or a forwarded port) "
            f"in {target.where_from()}"
        )
    if code == "operator_key_required":
        return CoordinatorUnreachable(
            f"the coordinator at {target.url} takes only operator signatures (its cluster TOML "
            f"lists {OPERATORS_KEY}), not the cluster secret; pass {OPERATOR_KEY_FLAG} PATH (or "
            f"set {ENV_OPERATOR_KEY_FILE}) with a key listed there"
        )
    bad = code in ("bad_mac", "bad_signature")
    if bad and cluster is not None and cluster != target.cluster:
        return CoordinatorUnreachable(
            f"the coordinator at {target.url} serves cluster '{cluster}', but the request was "
            f"signed for cluster '{target.cluster}' (from {target.cluster_origin}); pass "
            f"--cluster-name {cluster} if that is the coordinator you mean, else check "
            f"{target.where_from()}"
        )
    if target.operator is not None:
        return CoordinatorUnreachable(
            f"the coordinator at {target.url} refused the signature ({code or 'unauthorized'}) "
            f"of operator '{target.operator.name}'; check that {OPERATORS_KEY} in its cluster "
            f"TOML has the line {target.operator.operators_line} (the key from "
            f"{target.secret_origin})"
        )
    return CoordinatorUnreachable(
        f"the coordinator at {target.url} refused the signature ({code or 'unauthorized'}); "
        f"check that the cluster secret from {target.secret_origin} is the cluster's"
    )
