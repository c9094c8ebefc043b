"""The agent's reconcile, as pure data: ``plan(desired, observed) -> actions``.

The desired state comes from the config files (see ``agent.desired``), the observed state from
what this node runs now. ``plan`` compares them and lists what to do, in the order to do it;
``runtime.agent.actions`` carries the actions out. Nothing here touches a socket or a clock, so
every case is a row in a table test.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxppd.core.config.cluster import ElasticPolicy
from mlxppd.core.config.roster import Roster
from mlxppd.core.config.tls import TlsFiles
from mlxppd.core.cpu_weights import CpuWeights
from mlxppd.core.fair_share import DEFAULT_MAX_CHOICES_PER_REQUEST
from mlxppd.core.kv_admission import DEFAULT_STAGE_SEQUENCES
from mlxppd.core.layer_ranges import LayerRange
from mlxppd.core.stages import STANDBY_INDEX

__all__ = [
    "Action",
    "CoordinatorTarget",
    "DesiredState",
    "ObservedState",
    "RebindStage",
    "ReloadStage",
    "ReplanCoordinator",
    "RestartCoordinator",
    "SetGeneration",
    "StageTarget",
    "StartCoordinator",
    "StartStage",
    "StopCoordinator",
    "StopStage",
    "UpdateKvBudget",
    "UpdatePolicy",
    "UpdateRoster",
    "plan",
]


@dataclass(frozen=True)
class StageTarget:
    """A stage worker: where it listens, which layers it holds, how it talks.

    A standby node runs one too, holding no layers (``stage`` is ``STANDBY_INDEX``, ``layers``
    None) until the coordinator gives it a lost stage's; its agent never takes them back."""

    node_id: str
    stage: int
    """stage index (0-based); STANDBY_INDEX (-1) for a standby"""
    num_stages: int
    layers: LayerRange | None
    """the layers the TOML gives this stage; None for a standby"""
    host: str
    port: int
    transport: str
    kv_budget_bytes: int | None = None
    """KV cache budget (bytes); None = unlimited"""
    cpu_weights: CpuWeights = CpuWeights.AUTO
    """how the stage holds its weights on a CPU host"""
    max_sequences: int = DEFAULT_STAGE_SEQUENCES
    """sequences the stage holds KV for (sequences)"""
    model_files: str = ""
    """the directory its tensors come from: the configured model or a prepared copy"""
    awaiting_model: bool = False
    """no model files here yet: it listens holding no layers until ``mlxppctl prepare``"""
    tp_rank: int = 0
    """its rank in a tensor-parallel stage (0: the one the pipeline talks to)"""
    tp_ring: tuple[str, ...] = ()
    """every rank's ring address (host:port), rank order; empty for a stage of one rank"""
    tp_nodes: tuple[str, ...] = ()
    """every rank's node id, rank order; empty for a stage of one rank"""
    tp_addresses: tuple[str, ...] = ()
    """every rank's transport address (host:port), rank order; empty for a stage of one rank"""

    def __post_init__(self) -> None:
        if (self.stage == STANDBY_INDEX) != (self.layers is None):
            raise ValueError(
                f"a stage target has layers exactly when it is not a standby: stage "
                f"{self.stage}, layers {self.layers}"
            )

    @property
    def standby(self) -> bool:
        """A standby node's worker: no layers of its own."""
        return self.stage == STANDBY_INDEX

    @property
    def tensor(self) -> bool:
        """One rank of a tensor-parallel stage."""
        return bool(self.tp_ring)

    def same_layers(self, other: StageTarget) -> bool:
        # A different weight mode means loading the layers again.
        return (self.stage, self.num_stages, self.layers, self.cpu_weights) == (
            other.stage,
            other.num_stages,
            other.layers,
            other.cpu_weights,
        )

    def same_endpoint(self, other: StageTarget) -> bool:
        return (self.host, self.port, self.transport) == (other.host, other.port, other.transport)


@dataclass(frozen=True)
class StageAddress:
    """One stage as the coordinator sees it."""

    node_id: str
    host: str
    port: int


@dataclass(frozen=True)
class CoordinatorTarget:
    """The coordinator: the pipeline it drives and the HTTP API it serves."""

    node_id: str
    http_host: str
    http_port: int
    transport: str
    stages: tuple[StageAddress, ...]
    layers: tuple[LayerRange, ...]
    parallel: int = 64
    """sequences generating at once (every choice of n counts), shared fairly between clients"""
    max_choices_per_request: int = DEFAULT_MAX_CHOICES_PER_REQUEST
    """the most choices (n) one request may ask for"""
    micro_batch_size: int = 0
    """decode sequences per pipeline pass"""
    prompt_cache_entries: int = 8
    """prompt prefixes the stages keep for reuse (0: none)"""
    prefill_chunk_size: int = 0
    """prompt tokens per prefill pass (0: sized per prompt by the coordinator)"""
    api_key: str | None = field(default=None, repr=False)
    cors_origins: tuple[str, ...] = ()
    """origins whose web pages may call the HTTP API (mlxppd.toml cors_origins)"""
    tls: TlsFiles | None = None
    """the HTTPS certificate and key (mlxppd.toml tls_cert_file/tls_key_file); None: HTTP"""

    def pipeline_key(self) -> tuple[object, ...]:
        """What needs a new pipeline (reconnect) when it changes; layers alone do not."""
        return (
            self.transport,
            self.stages,
            self.parallel,
            self.micro_batch_size,
            self.prompt_cache_entries,
            self.prefill_chunk_size,
        )

    def http_key(self) -> tuple[object, ...]:
        return (
            self.http_host,
            self.http_port,
            self.api_key,
            self.cors_origins,
            self.tls,
            self.parallel,
            self.max_choices_per_request,
        )


@dataclass(frozen=True)
class AdvertTarget:
    """This node's DNS-SD advertisement (``runtime/system/dnssd.py``): where and as whom."""

    node_id: str
    cluster: str
    host: str
    """its address in the cluster TOML: the interface it advertises on (loopback: none)"""
    port: int


@dataclass(frozen=True)
class DesiredState:
    """What the config files say this node should be running."""

    node_id: str
    generation: str
    """fingerprint of cluster.toml, the same on every host that has the same file"""
    policy: ElasticPolicy
    stage: StageTarget | None = None
    coordinator: CoordinatorTarget | None = None
    roster: Roster = Roster()
    """the node keys the cluster TOML lists (``[roster]``)"""
    advert: AdvertTarget | None = None
    """this node's DNS-SD advertisement (None: mlxppd.toml turns it off)"""


@dataclass(frozen=True)
class ObservedState:
    """What this node runs now (None: nothing of that kind)."""

    generation: str | None = None
    policy: ElasticPolicy | None = None
    stage: StageTarget | None = None
    coordinator: CoordinatorTarget | None = None
    pipeline_connected: bool = True
    """False once the coordinator lost a stage: it must reconnect"""
    ring_lost: bool = False
    """this tensor-parallel stage lost a rank: its ranks must start again together"""
    roster: Roster | None = None
    """the roster this node's transports believe (None: none yet); last, so the fields
    before it keep their positions"""
    advert: AdvertTarget | None = None
    """the advertisement this node keeps on DNS-SD (None: none)"""


# -- actions -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StartStage:
    target: StageTarget


@dataclass(frozen=True)
class StopStage:
    reason: str


@dataclass(frozen=True)
class ReloadStage:
    """New layers on a live stage: drain its sequences, load, resume (connections stay up)."""

    target: StageTarget


@dataclass(frozen=True)
class RebindStage:
    """New address or transport: listen again, keeping the loaded layers."""

    target: StageTarget


@dataclass(frozen=True)
class UpdateKvBudget:
    target: StageTarget


@dataclass(frozen=True)
class StartCoordinator:
    target: CoordinatorTarget


@dataclass(frozen=True)
class StopCoordinator:
    reason: str


@dataclass(frozen=True)
class RestartCoordinator:
    """Drain, then connect a new pipeline (and rebind HTTP when its address changed)."""

    target: CoordinatorTarget
    reason: str


@dataclass(frozen=True)
class ReplanCoordinator:
    """New layer ranges: drain, wait for every stage to report them, resume."""

    target: CoordinatorTarget


@dataclass(frozen=True)
class UpdatePolicy:
    policy: ElasticPolicy


@dataclass(frozen=True)
class UpdateRoster:
    """Believe these node keys from now on: a removed node's open links close."""

    roster: Roster


@dataclass(frozen=True)
class Advertise:
    """Advertise this node on DNS-SD (replacing any advertisement it kept)."""

    target: AdvertTarget


@dataclass(frozen=True)
class StopAdvertising:
    reason: str


@dataclass(frozen=True)
class SetGeneration:
    """Last: the config generation now in force."""

    generation: str


Action = (
    StartStage
    | StopStage
    | ReloadStage
    | RebindStage
    | UpdateKvBudget
    | StartCoordinator
    | StopCoordinator
    | RestartCoordinator
    | ReplanCoordinator
    | UpdatePolicy
    | UpdateRoster
    | Advertise
    | StopAdvertising
    | SetGeneration
)


def _stage_restart(want: StageTarget, have: StageTarget) -> str | None:
    """Why the worker must stop and start again (None: it changes in place)."""
    if (want.awaiting_model, want.model_files) != (have.awaiting_model, have.model_files):
        return "this node's model files changed (a prepared copy arrived)"
    if want.standby != have.standby:
        old, new = ("standby", "pipeline_stage") if have.standby else ("pipeline_stage", "standby")
        return f"this node's role changed from {old} to {new}"
    if (want.tensor or have.tensor) and want != have:
        # Its ranks shard the layers together and share one ring: nothing changes in place.
        return "a tensor-parallel stage's settings changed; its ranks start again together"
    if want.standby and not want.same_layers(have):
        # A standby's layers are the coordinator's to give (or to have given): its agent never
        # reloads them; new settings for its next adoption take a fresh start.
        return "the standby's stage count or weight mode changed"
    return None


def _stage_actions(want: StageTarget | None, have: StageTarget | None) -> list[Action]:
    if want is None:
        return [StopStage("this node is no longer a stage")] if have is not None else []
    if have is None:
        return [StartStage(want)]
    if (reason := _stage_restart(want, have)) is not None:
        return [StopStage(reason), StartStage(want)]
    out: list[Action] = []
    if not want.same_layers(have):
        out.append(ReloadStage(want))
    if not want.same_endpoint(have):
        out.append(RebindStage(want))
    limits = (want.kv_budget_bytes, want.max_sequences)
    if limits != (have.kv_budget_bytes, have.max_sequences) and not out:
        # A reload already applies the budget of its target.
        out.append(UpdateKvBudget(want))
    return out


def _coordinator_actions(
    want: CoordinatorTarget | None, have: CoordinatorTarget | None, connected: bool
) -> list[Action]:
    if want is None:
        return [StopCoordinator("this node is no longer the coordinator")] if have else []
    if have is None:
        return [StartCoordinator(want)]
    if want.http_key() != have.http_key():
        return [RestartCoordinator(want, "the HTTP address or API key changed")]
    if want.pipeline_key() != have.pipeline_key():
        return [RestartCoordinator(want, "the stages, transport or batching changed")]
    if not connected:
        return [RestartCoordinator(want, "a stage connection was lost")]
    if want.layers != have.layers:
        return [ReplanCoordinator(want)]
    return []


def plan(desired: DesiredState, observed: ObservedState) -> tuple[Action, ...]:
    """The actions that take ``observed`` to ``desired``, in order: stops first (free the
    ports and memory), then the roster, then the stage, then the coordinator, then the
    policy, then the DNS-SD advertisement, then the generation (only once everything it
    describes is in force)."""
    stage = _stage_actions(desired.stage, observed.stage)
    if observed.ring_lost and observed.stage is not None and desired.stage is not None:
        stage = [
            StopStage("a tensor-parallel rank of this stage was lost"),
            StartStage(desired.stage),
        ]
    coordinator = _coordinator_actions(
        desired.coordinator, observed.coordinator, observed.pipeline_connected
    )
    stops = [a for a in stage + coordinator if isinstance(a, StopStage | StopCoordinator)]
    rest = [a for a in stage + coordinator if a not in stops]
    actions: list[Action] = [*stops]
    if desired.roster != observed.roster:
        actions.append(UpdateRoster(desired.roster))  # before starts: they use the new one
    actions += rest
    if desired.policy != observed.policy:
        actions.append(UpdatePolicy(desired.policy))
    if desired.advert != observed.advert:
        # After the roles: a node is found once it serves what it says.
        if desired.advert is None:
            actions.append(StopAdvertising("mlxppd.toml turns DNS-SD advertising off"))
        else:
            actions.append(Advertise(desired.advert))
    if desired.generation != observed.generation:
        actions.append(SetGeneration(desired.generation))
    return tuple(actions)


def describe(action: Action) -> str:
    """One line for the agent's log: the action and what it acts on."""
    name = type(action).__name__
    target = getattr(action, "target", None)
    if isinstance(target, StageTarget):
        r = target.layers
        what = f"stage {target.stage} layers {r.start}-{r.last}" if r else "standby, no layers"
        return f"{name} {what} on {target.host}:{target.port} ({target.transport})"
    if isinstance(target, CoordinatorTarget):
        ranges = ",".join(f"{r.start}-{r.last}" for r in target.layers)
        return f"{name} layers {ranges} http {target.http_host}:{target.http_port}"
    if isinstance(action, Advertise):
        t = action.target
        return f"{name} {t.node_id}.{t.cluster} on DNS-SD ({t.host}:{t.port})"
    if isinstance(action, UpdateRoster):
        return f"{name} {len(action.roster)} node keys: {', '.join(action.roster.node_ids())}"
    return f"{name} {getattr(action, 'reason', '') or getattr(action, 'generation', '')}".strip()
