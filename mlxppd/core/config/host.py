"""This host's settings for the agent: ``mlxppd.toml`` in the config directory.

``cluster.toml`` (the same file on every host) says what the cluster is; ``mlxppd.toml`` says
what this host is: its node id, model, secret, HTTP address, KV budget, log level and state dir.

Precedence, highest first: command-line flags, environment variables ``MLXPP_<FIELD>``
(e.g. ``MLXPP_HTTP_PORT``), ``mlxppd.toml``, the defaults below. Each layer is validated on its
own first, so an error names the flag, the variable, or the file with its line and key.
"""

from __future__ import annotations

import contextvars
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, ValidationError, create_model
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from mlxppd.core.config.messages import format_key_path, validation_error
from mlxppd.core.config.origins import MAX_ORIGINS, parse_origins, wildcard_problem
from mlxppd.core.config.private_file import allow_loose_from, read_private_file
from mlxppd.core.config.tls import TlsFiles, check_tls_files, tls_files
from mlxppd.core.cpu_weights import CpuWeightsField
from mlxppd.core.errors import ConfigurationError
from mlxppd.core.fair_share import (
    DEFAULT_MAX_CHOICES_PER_REQUEST,
    MAX_CHOICES_PER_REQUEST,
    per_client,
)
from mlxppd.core.kv_admission import DEFAULT_STAGE_SEQUENCES
from mlxppd.core.strict import StrictModel

__all__ = [
    "CLUSTER_FILE",
    "DEFAULT_CONFIG_DIR",
    "ENV_CONFIG_DIR",
    "HOST_FILE",
    "HostSettings",
    "config_dir_from",
    "host_json_schema_text",
    "host_tls_files",
    "load_host_settings",
    "read_api_key_file",
]

DEFAULT_CONFIG_DIR = Path("/etc/mlxpp")
ENV_CONFIG_DIR = "MLXPP_CONFIG_DIR"
CLUSTER_FILE = "cluster.toml"
HOST_FILE = "mlxppd.toml"
ENV_PREFIX = "MLXPP_"

LogLevel = Literal["debug", "info", "warning", "error"]


def _origin_list(value: Any) -> Any:
    # MLXPP_CORS_ORIGINS comes as one string: its origins separated by commas.
    if isinstance(value, str):
        value = [v for v in value.split(",") if v.strip()]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        try:
            return parse_origins(value)
        except ValueError as exc:
            raise PydanticCustomError("invalid_value", "{why}", {"why": str(exc)}) from None
    return value


OriginList = Annotated[tuple[str, ...], BeforeValidator(_origin_list)]

# The layers below the flags, handed to the settings sources for one load (no global state
# outlives a call).
_LAYERS: contextvars.ContextVar[tuple[dict[str, Any], dict[str, Any]]] = contextvars.ContextVar(
    "mlxpp_host_layers"
)


class _Layer(PydanticBaseSettingsSource):
    def __init__(self, settings_cls: type[BaseSettings], index: int):
        super().__init__(settings_cls)
        self._index = index

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self().get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_LAYERS.get(({}, {}))[self._index])


class HostSettings(BaseSettings):
    """``mlxppd.toml``: this host's part of the cluster."""

    model_config = SettingsConfigDict(extra="forbid", frozen=True, env_prefix=ENV_PREFIX)

    node_id: str | None = Field(
        None,
        min_length=1,
        description="This host's [[nodes]] id in cluster.toml; unset means the node whose "
        "address is one of this host's own.",
    )
    model: str | None = Field(
        None,
        min_length=1,
        description="mlx-lm model directory (the same model on every host); unset means the "
        "embedded default.",
    )
    secret_file: str | None = Field(
        None,
        min_length=1,
        description="Cluster secret file for this host; overrides [cluster] secret_file "
        "(relative paths are relative to the config directory).",
    )
    node_key_file: str | None = Field(
        None,
        min_length=1,
        description="This node's private key file (`mlxppctl node-key new`; mode 600); unset "
        "means node.key in the config directory (relative paths are relative to it).",
    )
    http_host: str = Field(
        "127.0.0.1",
        min_length=1,
        description="Address the coordinator's HTTP API (OpenAI + admin) listens on.",
    )
    http_port: int = Field(8080, ge=0, le=65535, description="TCP port of the HTTP API.")
    api_key: str | None = Field(
        None,
        min_length=1,
        repr=False,
        description="Bearer key clients must send to the OpenAI API (prefer api_key_file).",
    )
    api_key_file: str | None = Field(
        None,
        min_length=1,
        description="File holding the OpenAI API bearer key, mode 600 like the cluster secret "
        "(relative paths are relative to the config directory); instead of api_key.",
    )
    tls_cert_file: str | None = Field(
        None,
        min_length=1,
        description="PEM certificate (then any intermediates) the HTTP listeners serve HTTPS "
        "with; needs tls_key_file (relative paths are relative to the config directory).",
    )
    tls_key_file: str | None = Field(
        None,
        min_length=1,
        description="Unencrypted PEM private key of tls_cert_file, mode 600 like the cluster "
        "secret (relative paths are relative to the config directory).",
    )
    cors_origins: OriginList = Field(
        (),
        max_length=MAX_ORIGINS,
        description="Origins (scheme://host[:port]; '*': every one, only without an API key) "
        "whose web pages may call the HTTP API from a browser (CORS); MLXPP_CORS_ORIGINS "
        "lists them separated by commas.",
    )
    kv_budget_bytes: int | None = Field(
        None,
        ge=1,
        description="KV cache budget of this host's stage in bytes; overrides "
        "[cluster] kv_budget_bytes.",
    )
    cpu_weights: CpuWeightsField | None = Field(
        None,
        description="How this host's stage holds its weights (auto, native, float32); "
        "overrides [cluster] cpu_weights.",
    )
    memory_budget_bytes: int | None = Field(
        None,
        ge=1,
        description="Memory this host's stage may use for parameters and KV cache, bytes; the "
        "elastic partitioner plans within it (unset: no limit).",
    )
    dnssd_advertise: bool = Field(
        True,
        description="Advertise this node on DNS-SD (_mlxpp._tcp on multicast DNS, signed with "
        "the cluster secret) on the interface of its address in the cluster TOML (never on "
        "loopback); false where multicast DNS is unwelcome.",
    )
    log_level: LogLevel = Field("info", description="Log level: debug, info, warning, error.")
    state_dir: str = Field(
        "/var/lib/mlxpp",
        min_length=1,
        description="Directory for this node's state: when set, the model cache is its "
        "models/ folder (MLXPP_MODEL_CACHE wins; unset: ~/.cache/mlxpp).",
    )
    parallel: int = Field(
        DEFAULT_STAGE_SEQUENCES,
        ge=1,
        description="Sequences the coordinator generates at once (sequences).",
    )
    max_choices_per_request: int = Field(
        DEFAULT_MAX_CHOICES_PER_REQUEST,
        ge=1,
        le=MAX_CHOICES_PER_REQUEST,
        description="Coordinator only: the most choices (n) one request may ask for; each is a "
        "sequence of its own counted against parallel (sequences).",
    )
    max_sequences: int = Field(
        DEFAULT_STAGE_SEQUENCES,
        ge=1,
        le=4096,
        description="Stage only: sequences this stage holds KV for; more are refused with 503 "
        "(sequences).",
    )
    micro_batch_size: int = Field(
        0,
        ge=0,
        le=256,
        description="Decode sequences per pipeline pass (sequences; 1: each alone; 0: auto, "
        "one balanced micro-batch per stage).",
    )
    prefill_chunk_size: int = Field(
        0,
        ge=0,
        le=65536,
        description="Coordinator only: prompt tokens per prefill pass (tokens; 0: sized per "
        "prompt from the stage count and the measured pipeline speed).",
    )
    prompt_cache_entries: int = Field(
        8,
        ge=0,
        le=4096,
        description="Coordinator only: prompt prefixes every stage keeps for reuse, evicted "
        "least recently used (entries; 0: none).",
    )
    metrics: bool = Field(True, description="Serve Prometheus metrics at /metrics.")
    drain_timeout_s: float = Field(
        120.0,
        gt=0,
        allow_inf_nan=False,
        description="Seconds in-flight requests may take to finish on SIGTERM or a reload.",
    )
    reconcile_interval_s: float = Field(
        5.0,
        gt=0,
        allow_inf_nan=False,
        description="Seconds between reconcile passes when nothing changed (heals lost links).",
    )
    warmup: bool = Field(True, description="Run a 2-token request through the pipeline at start.")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # flags > environment > mlxppd.toml > defaults; the environment comes in as a mapping.
        return (init_settings, _Layer(settings_cls, 0), _Layer(settings_cls, 1))


# The same fields, all optional, as a plain strict model: validates one layer on its own.
def _layer_model() -> type[Any]:
    fields: dict[str, Any] = {}
    for name, info in HostSettings.model_fields.items():
        optional: Any = info.annotation
        fields[name] = (optional | None, FieldInfo.merge_field_infos(info, default=None))
    model: type[Any] = create_model("HostLayer", __base__=StrictModel, **fields)
    return model


def _check_layer(data: Mapping[str, Any], describe: Any) -> None:
    try:
        _layer_model().model_validate(dict(data))
    except ValidationError as exc:
        raise describe(exc) from None


def config_dir_from(flag: str | Path | None, environ: Mapping[str, str]) -> Path:
    """``--config-dir``, else ``MLXPP_CONFIG_DIR``, else ``/etc/mlxpp``."""
    if flag:
        return Path(flag).expanduser()
    if environ.get(ENV_CONFIG_DIR):
        return Path(environ[ENV_CONFIG_DIR]).expanduser()
    return DEFAULT_CONFIG_DIR


def _env_layer(environ: Mapping[str, str]) -> dict[str, str]:
    out = {}
    for name in HostSettings.model_fields:
        key = ENV_PREFIX + name.upper()
        if key in environ:
            out[name] = environ[key]
    return out


def _file_layer(path: Path) -> tuple[dict[str, Any], str]:
    if not path.exists():
        return {}, ""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigurationError(
            f"cannot read the host settings: {exc}", source=str(path)
        ) from None
    try:
        return tomllib.loads(text), text
    except tomllib.TOMLDecodeError as exc:
        raise ConfigurationError(
            f"not valid TOML: {exc}; fix the syntax there", source=str(path)
        ) from None


def load_host_settings(
    config_dir: Path,
    *,
    environ: Mapping[str, str],
    overrides: Mapping[str, Any] | None = None,
    read_api_key: bool = True,
) -> HostSettings:
    """This host's settings: flags (``overrides``, None values ignored) > ``environ``
    (``MLXPP_*``) > ``config_dir/mlxppd.toml`` (optional) > defaults.

    With ``read_api_key``, an ``api_key_file`` is read (as the cluster secret is: mode 600,
    no link) into ``api_key``; setting both is an error."""
    path = config_dir / HOST_FILE
    file_data, text = _file_layer(path)
    _check_layer(file_data, lambda exc: validation_error(exc, HostSettings, text, str(path)))
    env_data = _env_layer(environ)

    def env_error(exc: ValidationError) -> ConfigurationError:
        error = exc.errors()[0]
        name = format_key_path(tuple(error["loc"]))
        return ConfigurationError(
            f"{error['msg']}; fix or unset the variable",
            source=f"environment variable {ENV_PREFIX}{name.upper()}",
        )

    _check_layer(env_data, env_error)
    flags = {k: v for k, v in (overrides or {}).items() if v is not None}

    def flag_error(exc: ValidationError) -> ConfigurationError:
        error = exc.errors()[0]
        name = format_key_path(tuple(error["loc"])).replace("_", "-")
        return ConfigurationError(f"{error['msg']}", source=f"--{name}")

    _check_layer(flags, flag_error)
    token = _LAYERS.set((env_data, file_data))
    try:
        settings = HostSettings(**flags)
    finally:
        _LAYERS.reset(token)
    keyed = settings.api_key is not None or settings.api_key_file is not None
    if (problem := wildcard_problem(settings.cors_origins, keyed)) is not None:
        raise ConfigurationError(problem, source=str(path), key="cors_origins")
    if settings.max_choices_per_request > per_client(settings.parallel):
        raise ConfigurationError(
            f"is {settings.max_choices_per_request} and one client may hold at most "
            f"{per_client(settings.parallel)} of the {settings.parallel} sequences of parallel: "
            "a request with that many choices could never run; lower it or raise parallel",
            source=str(path),
            key="max_choices_per_request",
        )
    settings = _with_tls_files(settings, config_dir, path, check=read_api_key, environ=environ)
    if settings.api_key_file is None or not read_api_key:
        return settings
    if settings.api_key is not None:
        raise ConfigurationError(
            "api_key and api_key_file are both set (in the file, MLXPP_API_KEY or "
            "MLXPP_API_KEY_FILE); keep only api_key_file",
            source=str(path),
            key="api_key_file",
        )
    file = Path(settings.api_key_file).expanduser()
    key = read_api_key_file(
        file if file.is_absolute() else config_dir / file,
        named_by="api_key_file",
        allow_loose=allow_loose_from(environ),
    )
    return settings.model_copy(update={"api_key": key})


def _with_tls_files(
    settings: HostSettings,
    config_dir: Path,
    path: Path,
    *,
    check: bool,
    environ: Mapping[str, str],
) -> HostSettings:
    """The TLS paths made absolute (relative ones are in the config directory); with ``check``
    the pair is loaded once, so a bad certificate or key fails the load, not the listener."""
    files = tls_files(
        settings.tls_cert_file,
        settings.tls_key_file,
        cert_named_by=f"tls_cert_file in {path}",
        key_named_by=f"tls_key_file in {path}",
        allow_loose=allow_loose_from(environ),
        base_dir=config_dir,
    )
    if files is None:
        return settings
    if check:
        check_tls_files(files)
    return settings.model_copy(
        update={"tls_cert_file": str(files.cert), "tls_key_file": str(files.key)}
    )


def host_tls_files(settings: HostSettings, *, allow_loose: bool) -> TlsFiles | None:
    """The HTTPS certificate and key of loaded ``settings`` (paths already absolute)."""
    return tls_files(
        settings.tls_cert_file,
        settings.tls_key_file,
        cert_named_by="tls_cert_file",
        key_named_by="tls_key_file",
        allow_loose=allow_loose,
    )


def read_api_key_file(path: Path, *, named_by: str, allow_loose: bool) -> str:
    """The bearer key in ``path`` (surrounding whitespace removed), read like the cluster
    secret file; an empty key or one that cannot be a header value is an error."""
    raw = read_private_file(
        path, what="the API key file", named_by=named_by, allow_loose=allow_loose
    )
    try:
        key = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        key = ""
    if not key or not key.isprintable() or not key.isascii():
        raise ConfigurationError(
            f"the API key file {path} named by {named_by} does not hold one line of printable "
            "ASCII text; write the key alone on one line"
        )
    return key


def host_json_schema_text() -> str:
    """The checked-in ``schemas/mlxppd.schema.json`` text (sorted keys, indent 2)."""
    import json

    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": HOST_FILE}
    schema.update(HostSettings.model_json_schema())
    return json.dumps(schema, sort_keys=True, indent=2, ensure_ascii=False) + "\n"
