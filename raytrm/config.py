"""Typed, validated configs: model, data, training, the experiment and the profile.

Every field carries a one-line description and its validation rule (raytrm.schema). The schema's loading and YAML
functions are re-exported here, so a caller needs only `from raytrm import config as cfg`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from raytrm.errors import ConfigError
from raytrm.schema import applies, check_applies, read_versioned_yaml, spec
from raytrm.schema import describe as describe
from raytrm.schema import dump_yaml as dump_yaml
from raytrm.schema import from_dict as from_dict
from raytrm.schema import load as load
from raytrm.schema import read_yaml as read_yaml
from raytrm.schema import to_dict as to_dict
from raytrm.schema import write_text_atomic as write_text_atomic
from raytrm.schema import write_yaml as write_yaml

PROFILE_SCHEMA_VERSION = 1
THERMAL_STATES = ("nominal", "fair", "serious", "critical")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda", "mps")
SYNC_MODES = ("auto", "exact", "compressed", "local")
#: What a resumed run may change: how long it goes on.
RESUMABLE_CHANGES = {("training", "steps"), ("training", "time_budget_s")}
#: Training fields that belong to a machine, not to the experiment: a distributed run's workers take them from the
#: profile of their tier, or from their tier; a checkpoint may be resumed with other values of them.
MACHINE_SETTINGS = (
    "micro_batch_size",
    "grad_accum_steps",
    "threads",
    "interop_threads",
    "dataloader_workers",
    "memory_budget_mb",
    "thermal_cap",
    "thermal_action",
    "device",
)


# ---------------------------------------------------------------------------------------------------------------
# The configs


TRM = ("trm",)
TRANSFORMER = ("transformer",)
HF = ("hf",)
NATIVE = ("trm", "transformer")  # raytrm's own models, whose shape the config sets
TEXT_MODELS = ("transformer", "hf")


@dataclass
class ModelConfig:
    """The network: TRM (attention or mlp_t), a plain byte-level transformer, or a Hugging Face transformers model
    (language model or classifier).

    One flat config for every family; each field says which families it applies to, and setting a field away from
    its default for a family it does not apply to is an error (a typo'd experiment, not a silent no-op).
    """

    name: str = spec("trm", "model family", choices=("trm", "transformer", "hf"))
    variant: str = spec(
        "mlp_t",
        "TRM block mixer: self-attention, or an MLP across positions",
        choices=("attention", "mlp_t"),
        when=TRM,
    )
    hidden_size: int = spec(512, "width of the residual stream", ge=8, when=NATIVE)
    num_heads: int = spec(8, "attention heads (TRM attention variant, transformer)", ge=1, when=NATIVE)
    expansion: float = spec(4.0, "SwiGLU expansion factor before the 2/3 rule and rounding to 256", gt=0, when=NATIVE)
    L_layers: int = spec(2, "blocks in the one recursive network", ge=1, when=TRM)
    H_cycles: int = spec(
        3, "outer recursion rounds per supervision step (all but the last without gradient)", ge=1, when=TRM
    )
    L_cycles: int = spec(6, "latent updates per outer round", ge=1, when=TRM)
    pos_encodings: str = spec("none", "positional encoding", choices=("rope", "learned", "none"), when=TRM)
    rope_theta: float = spec(10000.0, "RoPE base", gt=0, when=NATIVE)
    rms_norm_eps: float = spec(1e-5, "RMSNorm epsilon", gt=0, when=NATIVE)
    puzzle_emb_len: int = spec(16, "positions prepended for the puzzle embedding (0 disables it)", ge=0, when=TRM)
    halt_max_steps: int = spec(16, "most supervision steps a sample gets before it is halted", ge=1, when=TRM)
    halt_exploration_prob: float = spec(
        0.1, "probability a slot is forced to run a random minimum of steps", ge=0, le=1, when=TRM
    )
    halt_at_eval: bool = spec(
        False, "at evaluation, stop a sample when q_halt > 0 instead of running all steps", when=TRM
    )
    task: str = spec(
        "lm",
        "transformer and hf: a language model (next byte or token), or a document classifier",
        choices=("lm", "classify"),
        when=TEXT_MODELS,
    )
    layers: int = spec(4, "transformer blocks", ge=1, when=TRANSFORMER)
    seq_len: int = spec(
        256,
        "tokens per training sequence (transformer: bytes; hf: the most kept of a record, longer ones truncated)",
        ge=8,
        when=TEXT_MODELS,
    )
    dropout: float = spec(0.0, "dropout after attention and MLP", ge=0, le=0.9, when=TRANSFORMER)
    tie_embeddings: bool = spec(True, "share the input embedding with the output head (lm)", when=TRANSFORMER)
    pooling: str = spec(
        "mean",
        "classifier pooling: mean over tokens, or the first token",
        choices=("mean", "first"),
        when=TRANSFORMER,
    )
    gradient_checkpointing: bool = spec(
        False, "recompute block activations in backward to save memory", when=TRANSFORMER
    )
    path: str | None = spec(
        None,
        "hf: the transformers model, a local directory (as save_pretrained writes one) or a hub name transformers "
        "resolves and caches",
        when=HF,
    )
    lora_rank: int | None = spec(
        None,
        "hf: LoRA (peft) of this rank: only the adapters and a classifier's head train; None = the whole model",
        ge=1,
        when=HF,
    )
    lora_alpha: float = spec(16.0, "hf: LoRA's scale numerator (the update is scaled by alpha / rank)", gt=0, when=HF)
    lora_dropout: float = spec(0.0, "hf: dropout on LoRA's input", ge=0, le=0.9, when=HF)
    lora_targets: list | None = spec(
        None, "hf: names of the modules LoRA wraps; None = peft's choice for the architecture", when=HF
    )
    lora_merge: bool = spec(
        True,
        "hf with LoRA: RUN_DIR/model holds the weights with the adapters merged in (a whole model); false: the "
        "adapters and a classifier's head alone, a few MB, which transformers loads onto model.path's weights",
        when=HF,
    )
    forward_dtype: str = spec("auto", "dtype of the forward pass; auto lets the device module choose", choices=DTYPES)

    def validate(self, source: str, prefix: str = "model") -> None:
        check_applies(self, source, prefix)
        if self.name == "hf" and not self.path:
            raise ConfigError(
                source,
                f"{prefix}.path",
                None,
                "a transformers model: a local directory or a hub name",
                "give model.path (flag: --model-path DIR)",
            )
        if self.lora_rank is None and self.lora_targets is not None:
            raise ConfigError(
                source, f"{prefix}.lora_targets", self.lora_targets, "unset without lora_rank", "set lora_rank too"
            )
        if self.lora_rank is None and not self.lora_merge:
            raise ConfigError(
                source,
                f"{prefix}.lora_merge",
                False,
                "true without lora_rank (a whole model has no adapters to keep apart)",
                "set lora_rank too, or drop lora_merge",
            )
        if (
            self.name in NATIVE
            and (self.name == "transformer" or self.variant == "attention")
            and (self.hidden_size % self.num_heads)
        ):
            raise ConfigError(
                source,
                f"{prefix}.num_heads",
                self.num_heads,
                f"a divisor of hidden_size {self.hidden_size}",
                "pick heads that divide the width",
            )
        if self.name == "trm" and self.variant == "mlp_t" and self.pos_encodings == "rope":
            raise ConfigError(
                source,
                f"{prefix}.pos_encodings",
                "rope",
                "'none' or 'learned' for the mlp_t variant",
                "mlp_t mixes positions with an MLP and has no attention to rotate",
            )


def model_fields(name: str) -> tuple[str, ...]:
    """The ModelConfig fields that apply to the model family `name`."""
    return tuple(f.name for f in dataclasses.fields(ModelConfig) if applies(f, name))


PUZZLES = ("sudoku", "maze")
TEXT = ("text",)
RECORDS = ("records",)
LABELLED = ("text", "records")
#: The data kinds each model family trains on (raytrm.families registers the same).
DATA_KINDS = {"trm": PUZZLES, "transformer": TEXT, "hf": RECORDS}


@dataclass
class DataConfig:
    """The dataset: generated Sudoku or maze, a directory in the TRM reference layout, text (the byte transformer),
    or a user's records (a Hugging Face model: CSV, JSONL or Parquet)."""

    name: str = spec("sudoku", "dataset kind", choices=("sudoku", "maze", "text", "records"))
    path: str | None = spec(
        None,
        "dataset directory in the reference layout, or for text a file, a directory of files, or JSONL/CSV; for "
        "records a CSV, JSONL or Parquet file; None generates one into the cache (text: the Python standard "
        "library's sources)",
    )
    train_puzzles: int = spec(2000, "base puzzles generated for training", ge=1, when=PUZZLES)
    test_puzzles: int = spec(200, "base puzzles generated for evaluation", ge=1, when=PUZZLES)
    augment: int = spec(8, "augmented copies per training puzzle (0 = originals only)", ge=0, when=PUZZLES)
    givens: int = spec(36, "Sudoku clues left in each puzzle: fewer is harder", ge=17, le=80, when=("sudoku",))
    maze_size: int = spec(30, "maze side length in cells", ge=5, when=("maze",))
    seed: int = spec(0, "generator seed")
    text_field: str = spec("text", "the field (JSONL) or column (CSV) holding a document's text", when=TEXT)
    label_field: str = spec(
        "label", "the field (JSONL) or column (CSV, Parquet) holding a document's class label", when=LABELLED
    )
    text_fields: list = spec(
        ["text"],
        "records: the fields whose texts make a record's text, joined with the tokenizer's separator (a subject "
        "and a body, say)",
        when=RECORDS,
    )
    validation_path: str | None = spec(
        None, "records: the held-out records; None = a stratified, seeded share of path", when=RECORDS
    )
    validation_share: float = spec(
        0.1, "records: the share of path held out when no validation_path is given", gt=0, le=0.5, when=RECORDS
    )
    stream_above_mb: float = spec(
        200.0,
        "a token cache larger than this (MiB) is read from disk on demand, not loaded into memory",
        gt=0,
        when=TEXT,
    )
    in_memory_below_mb: float = spec(
        100.0,
        "a token cache smaller than this (MiB) is loaded into memory; between the two, free memory decides",
        gt=0,
        when=TEXT,
    )

    def validate(self, source: str, prefix: str = "data") -> None:
        check_applies(self, source, prefix)
        if self.in_memory_below_mb > self.stream_above_mb:
            raise ConfigError(
                source,
                f"{prefix}.in_memory_below_mb",
                self.in_memory_below_mb,
                f"a value <= stream_above_mb ({self.stream_above_mb})",
                "lower in_memory_below_mb or raise stream_above_mb",
            )


@dataclass
class TrainConfig:
    """How to train: batch shape, threads, optimizer, schedule and stopping."""

    global_batch_size: int = spec(256, "samples per optimizer step, over all workers and accumulation", ge=1)
    micro_batch_size: int | None = spec(None, "samples per forward/backward; None = global / accumulation", ge=1)
    grad_accum_steps: int = spec(1, "micro-batches per optimizer step", ge=1)
    threads: int | None = spec(None, "torch intra-op threads; None = the tier's default", ge=1)
    interop_threads: int | None = spec(None, "torch inter-op threads; None = the tier's default", ge=1)
    dataloader_workers: int = spec(0, "data loader worker processes", ge=0)
    memory_budget_mb: int | None = spec(
        None, "training memory budget in MiB: the micro-batch adapts to stay under it; None = no adaptation", ge=64
    )
    thermal_cap: str | None = spec(
        None, "hottest thermal state tolerated; above it the guard sheds load; None = no guard", choices=THERMAL_STATES
    )
    thermal_action: str = spec(
        "threads",
        "how the thermal guard sheds load first: fewer threads or a smaller micro-batch",
        choices=("threads", "micro_batch"),
    )
    optimizer: str = spec("adamw", "optimizer of the network weights", choices=("adamw", "adam_atan2"))
    lr: float = spec(1e-4, "peak learning rate", gt=0)
    betas: list = spec([0.9, 0.95], "Adam betas [beta1, beta2]")
    weight_decay: float = spec(1.0, "decoupled weight decay", ge=0)
    puzzle_emb_lr: float = spec(1e-4, "SignSGD learning rate of the puzzle embedding", ge=0)
    puzzle_emb_weight_decay: float = spec(1.0, "decoupled weight decay of the puzzle embedding", ge=0)
    warmup_steps: int = spec(100, "linear warm-up steps", ge=0)
    schedule: str = spec("constant", "learning rate after warm-up", choices=("constant", "cosine"))
    min_lr_ratio: float = spec(0.1, "cosine floor as a fraction of lr", ge=0, le=1)
    grad_clip: float | None = spec(None, "clip the global gradient norm to this; None = no clipping", gt=0)
    ema: bool = spec(True, "keep an exponential moving average of the weights for evaluation")
    ema_decay: float = spec(0.999, "EMA decay per step", ge=0, le=1)
    ema_warmup: bool = spec(
        True, "ramp the EMA decay as (1+n)/(10+n) up to ema_decay; false = the reference's constant"
    )
    dtype: str = spec("auto", "training dtype; auto lets the device module choose", choices=DTYPES)
    device: str = spec("auto", "compute device; auto picks cuda, then mps, then cpu", choices=DEVICES)
    compile: str = spec(
        "auto",
        "torch.compile of the model's repeated region: auto (cuda, with CUDA graphs over the regions the model names "
        "for them: TRM's round, the transformer's forward; mps where torch can; eager on a cpu), on (without CUDA "
        "graphs), off, or cudagraphs (on cuda: CUDA graphs over the model's named regions, or every compiled region "
        "of a model that names none)",
        choices=("auto", "on", "off", "cudagraphs"),
    )
    steps: int | None = spec(None, "optimizer steps to run; None = until the time budget", ge=1)
    time_budget_s: float | None = spec(None, "wall-clock budget in seconds; None = until steps", gt=0)
    log_interval: int = spec(10, "steps between metrics lines", ge=1)
    eval_interval: int | None = spec(None, "steps between evaluations; None = only at the end", ge=1)
    checkpoint_interval: int | None = spec(None, "steps between checkpoints; None = only at the end", ge=1)
    seed: int = spec(0, "seed of weights, data order and halting exploration")
    # -- training health (raytrm.train.run.health): live checks of the loss and the gradient --
    health_checks: bool = spec(
        True, "warn, with the fix, when the run is not learning, goes non-finite, spikes, rises or plateaus"
    )
    not_learning_steps: int = spec(
        40, "steps in a row after the warm-up at the labels' entropy and chance accuracy that mean 'not learning'", ge=1
    )
    plateau_steps: int = spec(200, "steps in which the loss falling less than 1% is a plateau", ge=1)
    early_stop: bool = spec(
        False, "end the run when it is not learning, goes non-finite or reaches a plateau (evaluated and saved)"
    )
    # -- sync across workers (raytrm.sync.strategy): ignored by a run alone --------------------------------------
    sync_mode: str = spec(
        "auto",
        "how workers combine their work: auto (chosen from the measured link and step, re-chosen when the sync "
        "share drifts), exact (gradients summed every step), compressed (summed in bf16 with error feedback), "
        "local (rounds of sync_every steps alone, then the parameter deltas averaged by an outer optimizer)",
        choices=SYNC_MODES,
    )
    sync_every: int | None = spec(
        None, "H: inner steps per round in local mode; None = the fewest that keep sync under 5% of a step", ge=1
    )
    sync_overlap: int | None = spec(
        None,
        "inner steps a local round's exchange may travel behind (the outer update lands that many steps late); "
        "0 = wait for it at the round's end; None = chosen from the link in auto mode, else 0",
        ge=0,
    )
    outer_lr: float = spec(1.0, "local mode: the outer optimizer's learning rate on the averaged deltas", gt=0)
    outer_momentum: float = spec(
        0.0, "local mode: the outer optimizer's Nesterov momentum (0 = plain averaging at outer_lr 1)", ge=0
    )

    def validate(self, source: str, prefix: str = "training") -> None:
        self._validate_sync(source, prefix)
        micro = self.micro_batch_size
        if micro is not None and micro * self.grad_accum_steps != self.global_batch_size:
            raise ConfigError(
                source,
                f"{prefix}.micro_batch_size",
                micro,
                f"micro_batch_size x grad_accum_steps ({self.grad_accum_steps}) = global_batch_size "
                f"({self.global_batch_size})",
                "change one of the three or leave micro_batch_size unset",
            )
        if micro is None and self.global_batch_size % self.grad_accum_steps:
            raise ConfigError(
                source,
                f"{prefix}.grad_accum_steps",
                self.grad_accum_steps,
                f"a divisor of global_batch_size {self.global_batch_size}",
                "pick an accumulation count that divides the global batch",
            )
        if len(self.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.betas):
            raise ConfigError(source, f"{prefix}.betas", self.betas, "two numbers in [0, 1)", "e.g. [0.9, 0.95]")

    def _validate_sync(self, source: str, prefix: str) -> None:
        rounds = self.sync_mode in ("auto", "local")
        for name in ("sync_every", "sync_overlap"):
            if getattr(self, name) is not None and not rounds:
                raise ConfigError(
                    source,
                    f"{prefix}.{name}",
                    getattr(self, name),
                    f"unset with sync_mode {self.sync_mode} (it sizes local rounds)",
                    "drop it, or set sync_mode: local (or auto)",
                )
        if self.outer_momentum >= 1:
            raise ConfigError(source, f"{prefix}.outer_momentum", self.outer_momentum, "a number in [0, 1)", "e.g. 0.9")
        if self.sync_every is not None and self.sync_overlap is not None and self.sync_overlap >= self.sync_every:
            raise ConfigError(
                source,
                f"{prefix}.sync_overlap",
                self.sync_overlap,
                f"fewer than sync_every ({self.sync_every}) steps: a round's update must land before the next closes",
                "lower sync_overlap or raise sync_every",
            )

    @property
    def micro_batch(self) -> int:
        return self.micro_batch_size or self.global_batch_size // self.grad_accum_steps


@dataclass
class ExperimentConfig:
    """What `raytrm train --config FILE` reads: the model, the data and how to train."""

    model: ModelConfig = spec(ModelConfig(), "the network")
    data: DataConfig = spec(DataConfig(), "the dataset")
    training: TrainConfig = spec(TrainConfig(), "the training loop")

    def validate(self, source: str, prefix: str = "") -> None:
        check_model_data(self.model, self.data, source)


def check_model_data(model: ModelConfig, data: DataConfig, source: str) -> None:
    """Each family trains on its own data kinds (DATA_KINDS); any other pairing is one clear error."""
    wanted = DATA_KINDS[model.name]
    if data.name not in wanted:
        raise ConfigError(
            source,
            "data.name",
            data.name,
            f"{' or '.join(wanted)} for model.name {model.name}",
            "pair text with model.name: transformer (flags: --model transformer), records with model.name: hf "
            "(--model hf), or a puzzle dataset with model.name: trm",
        )


@dataclass
class HardwareSummary:
    """The machine a profile was tuned on, as `raytrm probe` saw it."""

    chip: str = spec("", "chip or CPU name")
    model: str = spec("", "machine model")
    memory_gb: float = spec(0.0, "total memory in GiB", ge=0)
    device: str = spec("cpu", "compute device", choices=("cpu", "cuda", "mps"))
    performance_cores: int = spec(0, "performance (or all, where there are no kinds) cores", ge=0)
    efficiency_cores: int = spec(0, "efficiency cores", ge=0)


@dataclass
class Limits:
    """The tier's limits a profile must respect."""

    memory_budget_mb: int = spec(0, "training memory budget in MiB", ge=1)
    thermal_cap: str = spec("fair", "highest thermal state tolerated while training", choices=THERMAL_STATES)


@dataclass
class Measured:
    """What the tuner measured for the profile's settings."""

    samples_per_sec: float = spec(0.0, "sustained training samples per second after warm-up", ge=0)
    peak_memory_mb: float = spec(0.0, "measured peak memory in MiB", ge=0)
    thermal_max: str = spec("nominal", "hottest thermal state seen", choices=(*THERMAL_STATES, "unknown"))
    objective: dict = spec({}, "the objective value(s) of the trial, by name")
    trial: int | None = spec(None, "Optuna trial number", ge=0)
    study: str | None = spec(None, "Optuna study name and storage")
    sync: dict = spec(
        {},
        "on a cluster of several machines: the link the tuner measured between them (mbit_s, latency_ms), the step "
        "(step_s), and the sync mode chosen from them (mode, every, overlap, predicted_share, fewest_every, reason)",
    )


@dataclass
class Profile:
    """The product's central artifact: the best settings for one machine tier."""

    raytrm_profile: int = spec(PROFILE_SCHEMA_VERSION, "profile schema version", choices=(PROFILE_SCHEMA_VERSION,))
    tier: str = spec("", "tier name from tiers.yaml")
    hardware: HardwareSummary = spec(HardwareSummary(), "the machine it was tuned on")
    model: ModelConfig = spec(ModelConfig(), "the network")
    data: DataConfig = spec(DataConfig(), "the dataset")
    training: TrainConfig = spec(TrainConfig(), "the training loop")
    limits: Limits = spec(Limits(), "the tier's limits")
    measured: Measured = spec(Measured(), "what the tuner measured")

    def validate(self, source: str, prefix: str = "") -> None:
        check_model_data(self.model, self.data, source)
        if self.limits.memory_budget_mb < 1:  # left out: the default 0 is no budget, and would not read back
            raise ConfigError(
                source,
                "limits.memory_budget_mb",
                None,
                "the tier's memory budget in MiB (>= 1)",
                "add limits: {memory_budget_mb: N}, or export the profile again with `raytrm export RUN_DIR`",
            )


# ---------------------------------------------------------------------------------------------------------------
# Profiles


def load_profile(path: str | os.PathLike) -> Profile:
    """Read a profile; a missing or newer schema version is refused with the fix."""
    missing = "this is not a raytrm profile; export one with `raytrm export RUN_DIR`"
    again = "export the profile again with this version (`raytrm export RUN_DIR`)"
    data = read_versioned_yaml(path, "raytrm_profile", PROFILE_SCHEMA_VERSION, missing, again)
    return from_dict(Profile, data, str(path))
