"""Run and node configuration, parsed once at start-up into pydantic models.

Flower hands apps an untyped ``UserConfig`` (kebab-case keys, scalars); both apps parse it
here, so every value is checked in one place and all problems are reported at once.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Self, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from fedciuic.compression import Codec, get_codec
from fedciuic.crypto import Suite
from fedciuic.deid import (
    DIRECT_WORD,
    NAMES_WORD,
    SECRET_FILE,
    Replacement,
    found_entities,
    listed_entities,
    parse_entities,
)
from fedciuic.errors import ConfigError
from fedciuic.jurisdictions import JURISDICTIONS

REGION_PATTERN = r"^[a-z][a-z0-9_-]{0,31}$"

#: What happens to an update over max-update-norm: refused, or scaled down to it.
NormAction = Literal["reject", "clip"]
OptimizerName = Literal["none", "fedavgm", "fedadam", "fedyogi"]
OPTIMIZERS: tuple[OptimizerName, ...] = get_args(OptimizerName)


def aggregation_rule(method: str) -> tuple[str, float | None]:
    """``fedavg``, ``median`` or ``trimmed-mean:F`` (F in [0, 0.5) trimmed at each end) as the
    rule's name and trimmed fraction (None for the others)."""
    name, _, arg = method.partition(":")
    if name in ("fedavg", "median") and not arg:
        return name, None
    if name == "trimmed-mean":
        try:
            trim = float(arg)
        except ValueError:
            trim = -1.0
        if 0 <= trim < 0.5:
            return name, trim
        raise ValueError(f"trimmed-mean:{arg}: the trimmed fraction must be in [0, 0.5)")
    raise ValueError(f"unknown aggregation {method!r}; use fedavg, median or trimmed-mean:F")


#: What one DP guarantee covers, weakest first: one record, or all of one user's.
PrivacyUnit = Literal["record", "user"]
PRIVACY_UNITS: tuple[PrivacyUnit, ...] = get_args(PrivacyUnit)
#: The unit where none is named (a policy without ``privacy.unit``, anything older).
DEFAULT_PRIVACY_UNIT: PrivacyUnit = PRIVACY_UNITS[0]
#: What a DP release pays for: a ledger line's purpose (docs/privacy.md).
Purpose = Literal["training", "counts", "evaluation"]
TRAINING, COUNTS, EVALUATION = get_args(Purpose)
#: The smallest secure-sum ring offered, in bits (0 chooses one: secagg.ddp.ring_bits).
MIN_RING_BITS = 12


#: What a region's adapter trains and sends (docs/models.md): ``lora`` A and B (averaged
#: factor-wise: inexact), ``lora-fa`` B only, ``lora-sb`` an r x r matrix between them (exact).
AdapterMode = Literal["lora", "lora-fa", "lora-sb"]
ADAPTER_MODES: tuple[AdapterMode, ...] = get_args(AdapterMode)
DEFAULT_ADAPTER_MODE: AdapterMode = ADAPTER_MODES[0]

#: Where a record longer than seq-len is cut (docs/data.md): its end, or its prompt's start
#: so that the response fits; ``right`` drops a record with no response token left.
TruncationSide = Literal["right", "left"]

#: The largest record (bytes in its file) a region reads; a larger one is dropped and
#: counted, never read whole (docs/data.md). The limit itself is at most 1 GiB.
DEFAULT_MAX_RECORD_BYTES = 1 << 20
MAX_RECORD_BYTES_LIMIT = 1 << 30


#: The DP accountant, how per-sample gradients are clipped, the regions' optimiser.
Accountant = Literal["prv", "rdp"]
DPMode = Literal["hooks", "ghost"]
#: Each training process holds a whole copy of the base, or a slice (FSDP2) of a large one.
Sharding = Literal["replicate", "shard"]
LocalOptimizer = Literal["adamw", "sgd"]


def unit_covers(unit: PrivacyUnit, required: PrivacyUnit) -> bool:
    """Whether DP per ``unit`` gives DP per ``required``: user-level implies record-level,
    never the reverse (a user's many records each add to what is learnt about them)."""
    return PRIVACY_UNITS.index(unit) >= PRIVACY_UNITS.index(required)


REPRODUCIBLE_NOISE_WARNING = (
    "fedciuic: INSECURE: insecure-reproducible-noise = true: DP noise and Poisson sampling "
    "are derived from the run config's seed, which the aggregator chooses: it can predict "
    "and subtract the noise, so these updates have NO differential privacy against it. "
    "For tests only; every shipped policy refuses it."
)


#: A codec named in the run config, parsed once into its object; written back as its name.
CodecSpec = Annotated[
    Codec,
    BeforeValidator(get_codec),
    PlainSerializer(str, return_type=str),
    WithJsonSchema({"type": "string"}),
]


#: How the aggregator schedules work: rounds, or FedBuff's buffer (docs/heterogeneity.md).
AggregationMode = Literal["sync", "buffered"]
BUFFERED: AggregationMode = "buffered"

#: Run-config fields written as ``"eu=2,us=1"``: an example, each number's type and range.
REGION_TABLES: dict[str, tuple[str, type[int] | type[float], float, float, str]] = {
    "region_train_processes": ("eu=2,us=1", int, 1, 1024, "a region's count of training processes"),
    "test_region_slowdown": ("us=4", float, 1, 1000, "a slowdown factor (tests only)"),
}


def _kebab(name: str) -> str:
    return name.replace("_", "-")


class _Strict(BaseModel):
    model_config = ConfigDict(
        extra="forbid", frozen=True, alias_generator=_kebab, populate_by_name=True
    )
    #: Set: an unknown key is named with the nearest known key, or else this hint.
    unknown_key_hint: ClassVar[str | None] = None

    @classmethod
    def known_keys(cls) -> list[str]:
        """The keys a user writes (kebab-case)."""
        return [field.alias or name for name, field in cls.model_fields.items()]

    @classmethod
    def from_user_config(
        cls, values: Mapping[str, Any], *, source: str, ignore_unknown: bool = False
    ) -> Self:
        """Validate ``values`` or raise one :class:`ConfigError` (``source:field: message``
        each); ``ignore_unknown`` for mappings others share (a SuperNode's node config)."""
        data = dict(values)
        if ignore_unknown:
            data = {k: v for k, v in data.items() if k in cls.known_keys()}
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            raise ConfigError(_describe(err, source, cls)) from None


def _describe(err: ValidationError, source: str, model: type[_Strict]) -> list[str]:
    """Each problem as ``source:key: message``, by the flat key a user wrote (a check across
    sections names its key in its message)."""
    problems: list[str] = []
    for item in err.errors():
        loc = [str(p) for p in item["loc"]]
        if not loc and item["type"] == "value_error":
            text = item["msg"].removeprefix("Value error, ")
            problems.extend(f"{source}:{line}" for line in text.splitlines())
            continue
        if len(loc) > 1 and loc[0] in model.model_fields:
            loc = loc[1:]
        field = ".".join(loc) or "(all)"
        if item["type"] == "extra_forbidden" and model.unknown_key_hint is not None:
            problems.append(f"{source}:{field}: {_unknown_key(field, model)}")
            continue
        given = item.get("input")
        shown = "" if isinstance(given, dict) else f" (got {given!r})"
        problems.append(f"{source}:{field}: {item['msg']}{shown}")
    return problems


def _unknown_key(key: str, model: type[_Strict]) -> str:
    nearest = difflib.get_close_matches(_kebab(key), model.known_keys(), n=1)
    if nearest:
        return f"unknown key; did you mean {nearest[0]}?"
    return f"unknown key; remove it ({model.unknown_key_hint})"


def _split_region_table(value: Any, info: ValidationInfo) -> Any:
    """``"eu=2,us=1"`` as (region, number) pairs."""
    if not isinstance(value, str):
        return value
    example, kind, *_ = REGION_TABLES[info.field_name or ""]
    table: list[tuple[str, float]] = []
    for item in filter(None, (part.strip() for part in value.split(","))):
        region, sep, number = item.partition("=")
        try:
            table.append((region.strip(), kind(number.strip())))
        except ValueError:
            sep = ""
        if not sep:
            raise ValueError(
                f"{item!r} is not REGION={kind.__name__.upper()}; write it as {example!r}"
            ) from None
    return tuple(table)


def _check_noise_share(value: float, info: ValidationInfo) -> float:
    if value and not info.data.get("secure_aggregation"):
        raise ValueError(
            f"{value:g} needs secure-aggregation = true: distributed noise is shared among "
            "the regions of a secure sum"
        )
    return value


class ModelSpec(_Strict):
    """Which base (a seeded preset or a checkpoint directory), which adapter, what precision."""

    model_config = ConfigDict(protected_namespaces=())

    model_preset: str = "tiny"
    model_path: str = ""
    #: Every party derives the preset's init and the fixed adapter factors from it.
    seed: int = Field(default=0, ge=0)
    lora_rank: int = Field(default=8, ge=1, le=1024)
    lora_alpha: int = Field(default=16, ge=1)
    #: auto (attention projections), auto+mlp, or a comma list of nn.Linear names (models.md).
    lora_targets: str = Field(default="auto", min_length=1)
    adapter_mode: AdapterMode = DEFAULT_ADAPTER_MODE
    #: The frozen base's: auto is bf16 on a GPU that has it, else fp32 (adapters: fp32).
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    #: nf4: a 4-bit base through bitsandbytes (QLoRA), CUDA only; DP over fp32 adapters.
    quantization: Literal["none", "nf4"] = "none"
    #: Recompute activations in the backward pass (less memory, about a third slower).
    gradient_checkpointing: bool = False
    #: Unpickling runs code: pickle-only weights are refused unless true; a deployed region
    #: goes by its own agent config's, never this (docs/models.md).
    allow_pickle_weights: bool = False


class Fields(_Strict):
    """The field names of each shape in this federation's records (docs/data.md)."""

    text_field: str = Field(default="text", min_length=1)
    prompt_field: str = Field(default="prompt", min_length=1)
    response_field: str = Field(default="response", min_length=1)
    messages_field: str = Field(default="messages", min_length=1)
    #: Where a record names its user (user-level DP, privacy-unit = "user").
    user_id_field: str = Field(default="user_id", min_length=1)


class DataSettings(_Strict):
    """How a region reads its records and holds some back (docs/data.md)."""

    #: Simulation: data-root/<region> is each region's data.
    data_root: str = ""
    #: A malformed row refuses the region's data, or is skipped and counted.
    bad_rows: Literal["refuse", "skip"] = "refuse"
    truncation_side: TruncationSide = "right"
    max_record_bytes: int = Field(default=DEFAULT_MAX_RECORD_BYTES, ge=1, le=MAX_RECORD_BYTES_LIMIT)
    max_eval_examples: int = Field(ge=1)
    eval_fraction: float = Field(gt=0, lt=1)


#: max-physical-batch-size's default: small passes keep a region's memory down.
DEFAULT_PHYSICAL_BATCH = 2


class LocalTraining(_Strict):
    """A region's training each round."""

    #: Local DP-SGD (or SGD) steps per round; with a local-time-budget, the most a round takes.
    local_steps: int = Field(ge=1)
    #: Seconds of local training per round (0: off), steps planned from it (heterogeneity.md).
    local_time_budget: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    batch_size: int = Field(ge=1)
    #: Examples per pass of a DP-SGD step (Opacus' max_physical_batch_size; 0: the whole
    #: batch): memory only, not privacy or results.
    max_physical_batch_size: int = Field(default=DEFAULT_PHYSICAL_BATCH, ge=0)
    learning_rate: float = Field(gt=0)
    optimizer: LocalOptimizer = "adamw"
    #: FedProx's (mu / 2) * ||w - w_global||^2 (0: off); data-independent, so no privacy cost.
    proximal_mu: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    #: pyproject.toml's value too; `fedciuic data check` counts records at it by default.
    seq_len: int = Field(default=256, ge=8, le=32_768)
    #: Tests and benchmarks only: some regions' training slowed (``"us=4"``) by sleeping.
    test_region_slowdown: tuple[tuple[str, float], ...] = ()

    _split_tables = field_validator("test_region_slowdown", mode="before")(_split_region_table)

    def slowdown(self, region: str) -> float:
        """How many times slower ``region`` trains (1: not slowed)."""
        return dict(self.test_region_slowdown).get(region, 1.0)


class ServerSettings(_Strict):
    """The optimiser the aggregator steps with on each aggregate (Reddi et al. 2021)."""

    server_learning_rate: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    #: ``none``: add the aggregated delta, times server-learning-rate.
    server_optimizer: OptimizerName = "none"
    #: fedavgm's momentum; fedadam's and fedyogi's beta1.
    server_momentum: float = Field(default=0.9, ge=0, lt=1)
    #: fedadam's and fedyogi's beta2, and their adaptivity tau (Reddi et al.'s epsilon).
    server_beta2: float = Field(default=0.99, ge=0, lt=1)
    server_epsilon: float = Field(default=1e-3, gt=0, allow_inf_nan=False)


class Schedule(_Strict):
    """The aggregator's loop (docs/heterogeneity.md)."""

    num_server_rounds: int = Field(ge=1, le=10_000)
    #: ``sync``: a round waits for every asked region; ``buffered``: FedBuff.
    aggregation_mode: AggregationMode = "sync"
    min_regions: int = Field(default=1, ge=1)
    node_wait_timeout: float = Field(gt=0)
    round_timeout: float = Field(gt=0)
    #: Buffered mode: updates per published adapter; how many versions old an update may be.
    buffer_size: int = Field(default=2, ge=1)
    max_staleness: int = Field(default=4, ge=0)
    #: Rounds missed in a row before rounds stop waiting for a region until it answers (0: never).
    max_missed_rounds: int = Field(default=3, ge=0)

    @property
    def buffered(self) -> bool:
        return self.aggregation_mode == BUFFERED

    @property
    def staleness_allowed(self) -> int:
        """Sync rounds take an update only against the current version."""
        return self.max_staleness if self.buffered else 0

    def staleness_refused(self, version: int, staleness: int) -> str:
        """Why an update ``staleness`` versions old is refused."""
        if self.buffered:
            rule = f"over max-staleness {self.max_staleness}"
        else:
            rule = (
                "a sync round uses an update only against the current global adapter "
                '(aggregation-mode = "buffered" weighs older ones down)'
            )
        return f"computed against global version {version}, {staleness} version(s) old; {rule}"


class DPSettings(_Strict):
    """DP-SGD (with Opacus) in every region (docs/privacy.md)."""

    dp: bool = True
    #: Half the default lifetime budget: a trial run leaves room for more (docs/privacy.md).
    target_epsilon: float = Field(default=4.0, gt=0)
    target_delta: float = Field(default=1e-5, gt=0, lt=1)
    epsilon_budget: float = Field(default=8.0, gt=0)
    max_grad_norm: float = Field(default=1.0, gt=0)
    #: Opacus' secure noise from an unpredictable generator.
    secure_mode: bool = True
    #: Tests only (:data:`REPRODUCIBLE_NOISE_WARNING`); every shipped policy refuses it.
    insecure_reproducible_noise: bool = False
    dp_accountant: Accountant = "prv"
    dp_mode: DPMode = "hooks"
    #: User-level DP-SGD samples users and clips each user's gradient (user-id-field).
    privacy_unit: PrivacyUnit = DEFAULT_PRIVACY_UNIT
    #: At most this many of one unit's examples in a DP-SGD step, clipped as one mean.
    max_examples_per_unit: int = Field(default=4, ge=1, le=1024)
    #: The Gaussian noise's std on a region's count of its units, a charged DP release once
    #: a run (0: the exact count, outside DP, which ``dp_only`` refuses; docs/privacy.md).
    count_noise: float = Field(default=10.0, ge=0, le=1e6, allow_inf_nan=False)
    #: The noise on a region's held-out loss (units' losses clipped to eval-loss-clip), a
    #: charged DP release (0: the exact loss, outside DP, which ``dp_only`` withholds).
    eval_noise: float = Field(default=10.0, ge=0, le=1e6, allow_inf_nan=False)
    eval_loss_clip: float = Field(default=10.0, gt=0, le=1e3, allow_inf_nan=False)

    @field_validator("insecure_reproducible_noise")
    @classmethod
    def _check_noise(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("secure_mode", True):
            raise ValueError(
                "true needs secure-mode = false: reproducible noise is predictable by "
                "whoever knows the run's seed (tests only)"
            )
        return value

    @property
    def noise_warning(self) -> str | None:
        """What a process says at start about where DP noise comes from (None: secure)."""
        if not self.dp:
            return None
        if self.insecure_reproducible_noise:
            return REPRODUCIBLE_NOISE_WARNING
        if not self.secure_mode:
            return (
                "fedciuic: secure-mode is OFF: DP noise and Poisson sampling come from "
                "generators seeded by the operating system, but without Opacus' secure "
                "noise (protection against floating-point attacks); set secure-mode = true "
                "for production runs."
            )
        return None


class ClusterSettings(_Strict):
    """A region's training as a torch.distributed job (docs/cluster.md); a node's value wins."""

    train_processes: int = Field(default=1, ge=1, le=1024)
    #: In simulation, some regions' own count (``"eu=2,us=1"``).
    region_train_processes: tuple[tuple[str, int], ...] = ()
    #: Seconds a collective waits before the region's round fails.
    collective_timeout: float = Field(default=600.0, gt=0)
    train_sharding: Sharding = "replicate"

    _split_tables = field_validator("region_train_processes", mode="before")(_split_region_table)


class SealSettings(_Strict):
    """Sealed updates: X-Wing + AES-256-GCM (or Fernet), signed (docs/envelope.md)."""

    seal: bool = True
    seal_suite: Suite = "xwing-aes256gcm"
    keys_dir: str = ""


class UpdateRules(_Strict):
    """How a region codes its update and what the aggregator accepts (docs/compression.md)."""

    codec: CodecSpec = get_codec("int8")
    #: A larger decoded delta's L2 norm is rejected or clipped (0: off); secure sums clip to it.
    max_update_norm: float = Field(default=50.0, ge=0)
    update_norm_action: NormAction = "reject"
    max_examples: int = Field(default=10_000_000, ge=1)
    #: The most bytes one compressed update may take (sealed or not).
    max_update_bytes: int = Field(default=256 * 2**20, ge=1024)
    aggregation: str = "fedavg"

    @field_validator("aggregation")
    @classmethod
    def _check_aggregation(cls, value: str) -> str:
        aggregation_rule(value)  # ValueError names the known rules
        return value


class PolicySettings(_Strict):
    """Where the jurisdiction policies are, and where the aggregator and relay sit."""

    #: Off only for lab baselines in simulation; a deployed region enforces its own.
    enforce_policies: bool = True
    #: The aggregator's copy of every region's policy (simulation: each region's own too).
    policies_dir: str = ""
    aggregator_jurisdiction: str = "EU"
    relay_jurisdiction: str = ""

    @field_validator("aggregator_jurisdiction", "relay_jurisdiction")
    @classmethod
    def _check_jurisdiction(cls, value: str) -> str:
        if value and value not in JURISDICTIONS:
            raise ValueError(
                f"unknown jurisdiction {value!r}; use an ISO 3166-1 code (or EU, EEA) such as "
                "EU, CN, US"
            )
        return value

    @property
    def relay(self) -> str:
        """Where the relay sits: ``relay-jurisdiction``, or the aggregator's place."""
        return self.relay_jurisdiction or self.aggregator_jurisdiction


class SecureSettings(_Strict):
    """Secure aggregation: the aggregator learns the sum of the regions' clipped updates only."""

    secure_aggregation: bool = False
    #: The fewest regions a secure sum is unmasked from (0: more than half of regions).
    secure_threshold: int = Field(default=0, ge=0)
    #: Bits per value of a masked update (0: secagg.ddp.ring_bits chooses).
    secure_ring_bits: int = Field(default=0, ge=0, le=62)
    #: Distributed DP (0: off): the Skellam noise's std in a sum of secure-threshold regions,
    #: times max-update-norm.
    distributed_noise_multiplier: float = Field(default=0.0, ge=0, allow_inf_nan=False)

    _noise_share = field_validator("distributed_noise_multiplier")(_check_noise_share)

    @field_validator("secure_ring_bits")
    @classmethod
    def _check_ring_bits(cls, value: int) -> int:
        if 0 < value < MIN_RING_BITS:
            raise ValueError(
                f"a ring of at least {MIN_RING_BITS} bits, or 0 to choose it from the regions "
                "and the update's size"
            )
        return value


class DeidSettings(_Strict):
    """De-identification before tokenising (docs/deidentification.md)."""

    deidentify: bool = True
    #: As listed (``direct``, ``names`` unexpanded; :attr:`entities` expands them).
    deid_entities: tuple[str, ...] = (DIRECT_WORD, NAMES_WORD)
    #: ``placeholder`` (``<EMAIL>``) or ``pseudonym`` (``<EMAIL_3f9a1c2b>``, region-keyed).
    deid_replacement: Replacement = "placeholder"
    deid_dictionaries: str = ""

    _entities = field_validator("deid_entities", mode="before")(listed_entities)

    @property
    def entities(self) -> tuple[str, ...]:
        """The entity types scrubbed, expanded and in canonical order (none when off)."""
        return parse_entities(self.deid_entities) if self.deidentify else ()


class OutputSettings(_Strict):
    """Where a run writes, what it keeps, and what it resumes from."""

    output_dir: str = "runs"
    #: The aggregator's audit log folder (default: output-dir/audit).
    audit_dir: str = ""
    #: A run folder to resume from its last checkpoint, or one of its kept checkpoints.
    resume_from: str = ""
    #: How many of the latest aggregator checkpoints to keep (resume-from may name any).
    keep_checkpoints: int = Field(default=1, ge=1, le=10_000)

    @property
    def output_path(self) -> Path:
        return Path(self.output_dir).expanduser().resolve()

    @property
    def audit_path(self) -> Path:
        if self.audit_dir:
            return Path(self.audit_dir).expanduser().resolve()
        return self.output_path / "audit"


class RunConfig(_Strict):
    """The run config shared by the ServerApp and every ClientApp: Flower's flat kebab keys,
    each in the section :data:`RUN_KEYS` names."""

    unknown_key_hint: ClassVar[str | None] = (
        "the run config's keys are those of pyproject.toml's [tool.flwr.app.config]"
    )

    @classmethod
    def known_keys(cls) -> list[str]:
        return list(RUN_KEYS)

    regions: tuple[str, ...] = Field(min_length=1)
    model: ModelSpec
    fields: Fields = Fields()
    data: DataSettings
    training: LocalTraining
    server: ServerSettings = ServerSettings()
    schedule: Schedule
    privacy: DPSettings = DPSettings()
    cluster: ClusterSettings = ClusterSettings()
    sealing: SealSettings = SealSettings()
    compression: UpdateRules = UpdateRules()
    policy: PolicySettings = PolicySettings()
    secure: SecureSettings = SecureSettings()
    deid: DeidSettings = DeidSettings()
    output: OutputSettings = OutputSettings()

    @model_validator(mode="before")
    @classmethod
    def _nest(cls, values: Any) -> Any:
        """Flower's flat keys into their sections (a section given whole stays as is)."""
        if not isinstance(values, Mapping):
            return values
        nested: dict[str, Any] = {}
        for key, value in values.items():
            place = RUN_KEYS.get(key) or RUN_KEYS.get(_kebab(key))
            if place is None or not place[0]:
                nested[key] = value
            else:
                nested.setdefault(place[0], {})[_kebab(place[1])] = value
        missing = [
            k for k in _REQUIRED_KEYS if k not in values and k.replace("-", "_") not in values
        ]
        if missing and "model" not in values:
            raise ValueError("\n".join(f"{key}: Field required" for key in missing))
        for name in RunConfig.model_fields:
            if name != "regions":
                nested.setdefault(name, {})
        return nested

    @model_validator(mode="after")
    def _across_sections(self) -> Self:
        """The checks that read keys of more than one section, each named by its key."""
        problems = [*_check_region_tables(self), *_check_secure(self), *_check_buffer(self)]
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def flat(self) -> dict[str, Any]:
        """Flower's flat form: every key under its kebab-case name, JSON values."""
        values: dict[str, Any] = {}
        for name, value in self.model_dump(by_alias=True, mode="json").items():
            values.update(value if isinstance(value, dict) else {name: value})
        return values

    def canonical_json(self) -> str:
        """This config as the aggregator signs it into every instruction (flat keys,
        sorted, compact); :meth:`from_user_config` reads it back to the same config."""
        values = self.flat()
        for name in REGION_TABLES:
            key = _kebab(name)
            values[key] = ",".join(f"{region}={number}" for region, number in values[key])
        values["regions"] = ",".join(values["regions"])
        values["deid-entities"] = ",".join(values["deid-entities"])
        return json.dumps(values, sort_keys=True, separators=(",", ":"), allow_nan=False)

    def updated(self, **keys: Any) -> RunConfig:
        """This config with some keys changed (snake or kebab names), validated again."""
        return type(self).model_validate({**self.flat(), **keys})

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy; changes go through :meth:`updated`, never pydantic's unvalidated update."""
        if update:
            raise TypeError("RunConfig.model_copy(update=...): use run.updated(key=value)")
        return super().model_copy(deep=deep)

    @field_validator("regions", mode="before")
    @classmethod
    def _split_regions(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(r.strip() for r in value.split(",") if r.strip())
        return value

    @field_validator("regions")
    @classmethod
    def _check_regions(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        bad = [r for r in value if not re.match(REGION_PATTERN, r)]
        if bad:
            raise ValueError(f"region names must be lower-case letters, digits, '-' or '_': {bad}")
        if len(set(value)) != len(value):
            raise ValueError(f"regions are listed twice: {list(value)}")
        return value

    @property
    def unmask_threshold(self) -> int:
        """The fewest regions a secure sum is unmasked from: secure-threshold, or more
        than half of the run's regions (at least 2)."""
        return self.secure.secure_threshold or max(2, len(self.regions) // 2 + 1)

    @property
    def secure_norms(self) -> bool:
        """Whether a secure sum is scaled by the norms its regions send: with DP-SGD (a norm is
        a DP release too) and without distributed noise (whose sensitivity is the clip)."""
        s = self.secure
        return s.secure_aggregation and self.privacy.dp and s.distributed_noise_multiplier == 0

    def region_for_partition(self, partition_id: int) -> str:
        if not 0 <= partition_id < len(self.regions):
            raise ConfigError(
                [
                    f"node config:partition-id: {partition_id} has no region; run config "
                    f"regions are {list(self.regions)}: set num-supernodes to "
                    f"{len(self.regions)} or list more regions"
                ]
            )
        return self.regions[partition_id]


def _sections() -> dict[str, tuple[str, str]]:
    table: dict[str, tuple[str, str]] = {"regions": ("", "regions")}
    for name, field in RunConfig.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, _Strict):
            for inner in kind.model_fields:
                table[_kebab(inner)] = (name, inner)
    return table


#: Each flat run-config key with its section ("" for a top-level key) and its field there.
RUN_KEYS: dict[str, tuple[str, str]] = _sections()
#: Keys a run config must give though their section has a default (the run's seed).
_REQUIRED_KEYS = ("seed",)


def run_key_required(key: str) -> bool:
    """Whether a run config must give ``key`` (it has no default)."""
    section, name = RUN_KEYS[key]
    kind: type[BaseModel] = RunConfig
    if section:
        kind = RunConfig.model_fields[section].annotation  # type: ignore[assignment]
    return key in _REQUIRED_KEYS or kind.model_fields[name].is_required()


def _problem(key: str, message: str, value: Any) -> str:
    return f"{_kebab(key)}: Value error, {message} (got {value!r})"


def _check_region_tables(run: RunConfig) -> list[str]:
    problems = []
    tables = {
        "region_train_processes": run.cluster.region_train_processes,
        "test_region_slowdown": run.training.test_region_slowdown,
    }
    for name, value in tables.items():
        unknown = [r for r, _ in value if r not in run.regions]
        _, _, low, high, what = REGION_TABLES[name]
        bad = [r for r, n in value if not low <= n <= high]
        if unknown:
            message = f"{unknown} are not regions of this run ({', '.join(run.regions)})"
            problems.append(_problem(name, message, value))
        elif bad:
            problems.append(_problem(name, f"{bad}: {what} is {low:g} to {high:g}", value))
    return problems


def _check_secure(run: RunConfig) -> list[str]:
    """What a secure sum needs of the rest of the run (docs/secure-aggregation.md)."""
    problems = []
    secure, regions = run.secure, len(run.regions)
    if secure.secure_aggregation:
        needs = [
            (not run.schedule.buffered, 'aggregation-mode = "sync" (one sum a round)'),
            (
                run.compression.aggregation == "fedavg",
                'aggregation = "fedavg": a robust rule (median, trimmed mean) needs each update, '
                "and with secure aggregation the aggregator sees only their sum",
            ),
            (run.sealing.seal, "seal = true (the regions sign and seal what they send)"),
            (
                run.compression.max_update_norm > 0,
                "max-update-norm > 0 (each region clips its update to it before masking)",
            ),
            (
                not run.compression.codec.sparse,
                f"a dense codec, not codec = {str(run.compression.codec)!r}: each region's "
                "top-k keeps its own coordinates, and a coordinate only one region kept would "
                "carry that region's value alone in the unmasked sum",
            ),
        ]
        missing = [need for ok, need in needs if not ok]
        if missing:
            problems.append(
                _problem("secure_aggregation", "true needs " + "; ".join(missing), True)
            )
    value = secure.secure_threshold
    if value and not regions // 2 < value <= regions:
        message = (
            f"{value}: a secure sum is unmasked from more than half of the {regions} regions "
            f"and at most all of them: use {regions // 2 + 1} to {regions} (0: {regions // 2 + 1})"
        )
        problems.append(_problem("secure_threshold", message, value))
    return problems


def _check_buffer(run: RunConfig) -> list[str]:
    value, regions = run.schedule.buffer_size, len(run.regions)
    if run.schedule.buffered and value > regions:
        message = (
            f"{value} is more than the {regions} regions of this run; a buffer holds "
            f"at most one update per region: use 1 to {regions}"
        )
        return [_problem("buffer_size", message, value)]
    return []


#: Where a simulation's data root holds its regions' dictionaries by default.
SIMULATED_DICTIONARIES = "deid-dictionaries"


def simulated_dictionary(run: RunConfig, region: str) -> str:
    """A simulated region's dictionary, deid-dictionaries/REGION.txt ("": none)."""
    folder = run.deid.deid_dictionaries or (
        str(Path(run.data.data_root) / SIMULATED_DICTIONARIES) if run.data.data_root else ""
    )
    path = Path(folder) / f"{region}.txt"
    return str(path) if folder and path.is_file() else ""


#: What Flower's simulation engine puts in each simulated node's config.
SIMULATED_NODE = "partition-id"


class NodeConfig(_Strict):
    """Which region this is and where its data, state, keys and policy live.

    A deployed region's agent reads it from its own file, never from the aggregator; in
    simulation Flower passes ``partition-id``. A field left None takes the run config's value.
    """

    region: str = Field(pattern=REGION_PATTERN)
    data_path: str = Field(min_length=1)
    #: The region's own persistent state (privacy ledger, ...); default data-path/.fedciuic.
    state_path: str = ""
    epsilon_budget: float | None = Field(default=None, gt=0)
    #: Simulation: these three from keys-dir; peer-bundles "" is aggregator-bundle's folder.
    key_file: str = ""
    aggregator_bundle: str = ""
    peer_bundles: str = ""
    #: The region's jurisdiction policy (YAML): a deployed region without one sends nothing.
    policy: str = ""
    train_processes: int | None = Field(default=None, ge=1, le=1024)
    train_sharding: Sharding | None = None
    #: May it load pickle-only weights (unpickling runs code)? Its own word (None: simulation).
    allow_pickle_weights: bool | None = None
    #: The region's dictionary of names to scrub (one per line).
    deid_dictionary: str = ""
    #: The region's pseudonym key file; default state-path/deid-secret.key (made on first use).
    deid_secret: str = ""
    #: An installed spaCy pipeline, to find PERSON and LOCATION too ("": none).
    deid_ner_model: str = ""
    #: The region's memory's to decide (no privacy at stake).
    max_record_bytes: int | None = Field(default=None, ge=1, le=MAX_RECORD_BYTES_LIMIT)
    max_physical_batch_size: int | None = Field(default=None, ge=0)

    def deid_entities(self, run: RunConfig) -> tuple[str, ...]:
        """The run's deid-entities this region has the means for (a dictionary, a NER model):
        what it scrubs and declares."""
        return found_entities(
            run.deid.entities,
            dictionary=bool(self.deid_dictionary),
            ner_model=bool(self.deid_ner_model),
        )

    def processes(self, run: RunConfig) -> int:
        return self.train_processes or run.cluster.train_processes

    def sharded(self, run: RunConfig) -> bool:
        """Whether this region's processes each hold a slice of the base (FSDP2)."""
        sharding = self.train_sharding or run.cluster.train_sharding
        return sharding == "shard" and self.processes(run) > 1

    def training(self, run: RunConfig) -> LocalTraining:
        if self.max_physical_batch_size is None:
            return run.training
        return run.training.model_copy(
            update={"max_physical_batch_size": self.max_physical_batch_size}
        )

    def record_limit(self, run: RunConfig) -> int:
        return self.max_record_bytes or run.data.max_record_bytes

    def allows_pickle_weights(self, run: RunConfig) -> bool:
        own = self.allow_pickle_weights
        return run.model.allow_pickle_weights if own is None else own

    def model_spec(self, run: RunConfig) -> ModelSpec:
        """The run's model as this region loads it: pickle weights on the region's own word."""
        return run.model.model_copy(
            update={"allow_pickle_weights": self.allows_pickle_weights(run)}
        )

    @property
    def state_dir(self) -> Path:
        return Path(self.state_path or Path(self.data_path) / ".fedciuic").expanduser()

    @property
    def deid_secret_path(self) -> Path:
        if self.deid_secret:
            return Path(self.deid_secret).expanduser()
        return self.state_dir / SECRET_FILE

    @staticmethod
    def is_simulated(node_config: Mapping[str, Any]) -> bool:
        """A simulated node: Flower gave it a partition id and no region of its own."""
        return SIMULATED_NODE in node_config and "region" not in node_config

    @classmethod
    def resolve(cls, node_config: Mapping[str, Any], run: RunConfig) -> NodeConfig:
        if "region" in node_config or "data-path" in node_config:
            node = cls.from_user_config(node_config, source="node config", ignore_unknown=True)
            if node.allow_pickle_weights is None:  # a deployed node's own word, never the run's
                node = node.model_copy(update={"allow_pickle_weights": False})
            if node.region not in run.regions:
                raise ConfigError(
                    [
                        f"node config:region: {node.region!r} is not a region of this run "
                        f"({', '.join(run.regions)}); add it to the run config's regions "
                        "or start this SuperNode with a listed region"
                    ]
                )
            return node
        if SIMULATED_NODE in node_config:
            region = run.region_for_partition(int(node_config[SIMULATED_NODE]))
            if not run.data.data_root:
                raise ConfigError(
                    ["run config:data-root: empty; simulated regions read data-root/<region>"]
                )
            return cls(
                region=region,
                data_path=str(Path(run.data.data_root) / region),
                train_processes=dict(run.cluster.region_train_processes).get(region),
                deid_dictionary=simulated_dictionary(run, region),
            )
        raise ConfigError(
            [
                "node config: neither region/data-path nor partition-id is set; start the "
                "SuperNode with --node-config \"region='eu' data-path='/path/to/eu'\""
            ]
        )
