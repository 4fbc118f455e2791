"""The run config: pydantic models, YAML loading, dotted command-line overrides.

A run is described by one YAML file with five sections (`model`, `data`, `lora`, `train`) and
two top-level keys (`output_dir`, `resume`). `load_config(path, ["train.lr=1e-4", ...])`
reads the file, applies the overrides (values parsed with YAML scalar rules, so `1e-4`,
`true`, `null` and `[q_proj,v_proj]` mean what they look like), and validates.

Every user mistake becomes a `ValueError` with one line that names the key: an unknown or
mistyped key gets the closest valid key as a suggestion, an out-of-range value gets the rule
it broke and the value it got.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import tempfile
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)


class _Section(BaseModel):
    # extra="forbid" is a backstop: unknown keys are caught earlier, with a suggestion.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(_Section):
    path: str = Field(description="HF checkpoint folder (config.json + *.safetensors) or GGUF file")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 GPU, fp32 CPU
    quantization: Literal["none", "nf4"] = "none"
    # A PEFT adapter folder to start from (e.g. an SFT run's output), for every objective:
    # with LoRA its factors (and r, alpha, targets) replace the lora section's fresh ones;
    # with lora.method=full it is merged into the weights first.
    adapter: str | None = None


class DataSection(_Section):
    # A local jsonl/json/parquet/csv file or a hub dataset id, or a list of them (mixed
    # formats allowed): their examples are pooled, then packed and shuffled together.
    train: str | list[str]
    split: str | None = None  # for hub datasets: which split (train and eval file alike)
    eval: str | list[str] | None = None  # held-out source(s); or use eval_fraction (per source)
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    format: str = "auto"  # auto-detected from the columns unless given
    # A .jinja file or the template text, replacing the tokenizer's chat template (base models
    # have none); saved with the tokenizer, so `slipstream generate` and transformers use it.
    chat_template: str | None = None
    train_on: Literal["assistant", "all"] = "assistant"
    max_tokens: int | None = Field(None, gt=0)  # per example; default: train.tokens_per_batch
    overlong: Literal["truncate", "drop"] = "drop"
    strict: bool = False  # a bad row is fatal instead of counted and skipped
    num_proc: int | None = Field(None, gt=0)

    @field_validator("train", "eval")
    @classmethod
    def _sources(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and (not value or len(set(value)) != len(value)):
            raise ValueError("give one or more sources, each once")
        return value

    @model_validator(mode="after")
    def _one_eval_source(self) -> DataSection:
        if self.eval is not None and self.eval_fraction > 0:
            raise ValueError("set data.eval or data.eval_fraction, not both")
        return self


class LoraSection(_Section):
    method: Literal["lora", "full"] = "lora"  # full: every parameter is trained
    rank: int = Field(16, gt=0)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    targets: str | list[str] = "all-linear"
    use_rslora: bool = False
    use_dora: bool = False  # DoRA: a trained magnitude per output row (slipstream/peft/dora.py)
    plus_ratio: float | None = Field(None, gt=0)  # LoRA+: B factors at this multiple of the lr


class TrainSection(_Section):
    # What the loss is: sft (labelled tokens); slipstream/objectives/ lists the others.
    objective: str = "sft"
    lr: float = Field(2e-4, gt=0)
    schedule: Literal["linear", "cosine", "constant"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    steps: int | None = Field(None, gt=0)  # when set, wins over epochs
    epochs: float | None = Field(None, gt=0)  # default 1 when steps is not set
    tokens_per_batch: int = Field(8192, gt=0)  # per micro-batch, packed without padding
    grad_accum: int = Field(1, gt=0)
    clip: float | None = Field(1.0, gt=0)  # max grad norm; null: no clipping
    weight_decay: float = Field(0.0, ge=0)
    optimizer: Literal["adamw", "adamw_8bit"] = "adamw"  # adamw_8bit: bitsandbytes 8-bit states
    seed: int = 0
    eval_every: int = Field(0, ge=0)  # 0: eval at start and end only
    # Fixed prompts the model answers (greedy) at each eval, into the log and metrics.jsonl.
    sample_prompts: list[str] = Field(default_factory=list)
    sample_max_new_tokens: int = Field(64, gt=0)
    save_every: int = Field(0, ge=0)  # 0: no mid-run checkpoints
    keep_checkpoints: int = Field(2, gt=0)
    log_every: int = Field(10, gt=0)
    activation_checkpointing: Literal["auto", "offload", "recompute", "none"] = "auto"
    compile: bool = False  # regional torch.compile of attention/MLP blocks (slipstream/compile.py)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # Under torchrun: auto = ddp for LoRA/QLoRA, fsdp (FSDP2) for full fine-tuning.
    parallel: Literal["auto", "none", "ddp", "fsdp"] = "auto"
    dist_timeout_s: float = Field(1800.0, gt=0)  # a rank waits this long in a collective
    # MoE load-balancing loss weight; null: the checkpoint's own (config.json's
    # router_aux_loss_coef if output_router_logits, else off); 0: off
    router_aux_loss_coef: float | None = Field(None, ge=0)

    @field_validator("objective")
    @classmethod
    def _known_objective(cls, value: str) -> str:
        from slipstream.objectives import OBJECTIVES

        if value not in OBJECTIVES:
            raise ValueError(f"unknown objective; use one of {', '.join(OBJECTIVES)}")
        return value


class PreferenceSection(_Section):
    """train.objective = dpo | orpo | simpo (slipstream/objectives/preference.py)."""

    beta: float = Field(0.1, gt=0)  # DPO's KL weight (IPO's tau); ORPO's lambda; SimPO's beta
    loss_type: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"  # DPO only
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)  # conservative DPO / SimPO
    simpo_gamma: float = 0.5  # SimPO's target margin
    # DPO's reference with LoRA: start = the starting adapter, frozen (the base when the
    # adapter is fresh); base = the model with adapters disabled. Full fine-tuning: a copy.
    reference: Literal["start", "base"] = "start"
    # Compute the reference log-probs of every pair once before training (no frozen copy
    # of the model kept with full fine-tuning; no reference forward per step).
    precompute_reference: bool = False


class RunConfig(_Section):
    model: ModelSection
    data: DataSection
    lora: LoraSection = LoraSection()
    train: TrainSection = TrainSection()
    preference: PreferenceSection = PreferenceSection()
    output_dir: str
    resume: bool | str = False  # true: latest checkpoint in output_dir; or a checkpoint path


def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> RunConfig:
    """Read `path` (YAML), apply `key=value` overrides, validate. One-line ValueError on misuse."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark else ""
            raise ValueError(f"{path}{where}: not valid YAML ({getattr(e, 'problem', e)})") from e
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"{path}: the top level must be a mapping of sections (model: ...)")
        raw = loaded or {}
    for item in overrides:
        key, value = _parse_override(item)
        _set_dotted(raw, key, value)
    return config_from_dict(raw)


def config_from_dict(raw: dict[str, Any]) -> RunConfig:
    """Validate a plain dict (as read from YAML) into a RunConfig."""
    _check_keys(raw, RunConfig, prefix="")
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as e:
        raise ValueError(format_validation_error(e)) from None


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def write_resolved_config(cfg: RunConfig, output_dir: str | os.PathLike) -> Path:
    """Write the resolved config as `config.yaml` in the output dir (atomically)."""
    from slipstream.checkpoint.atomic import atomic_write_text

    return atomic_write_text(Path(output_dir) / "config.yaml", dump_config(cfg))


def check_output_dir(output_dir: str | os.PathLike) -> Path:
    """Create `output_dir` and prove it writable, before any expensive work."""
    out = Path(output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise ValueError(f"output_dir '{out}' is not writable ({reason}); pick another") from None
    return out


def valid_keys(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    """Every dotted key the config accepts, e.g. 'train.lr'."""
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        sub = _section_type(field.annotation)
        if sub is not None:
            keys.extend(valid_keys(sub, prefix + name + "."))
    return keys


# Names other trainers use for our keys: spelling distance alone would not find these.
KNOWN_ALIASES = {
    "learning_rate": "train.lr",
    "max_steps": "train.steps",
    "num_train_epochs": "train.epochs",
    "num_epochs": "train.epochs",
    "batch_size": "train.tokens_per_batch",
    "gradient_accumulation_steps": "train.grad_accum",
    "max_grad_norm": "train.clip",
    "gradient_checkpointing": "train.activation_checkpointing",
    "r": "lora.rank",
    "lora_r": "lora.rank",
    "lora_rank": "lora.rank",
    "lora_alpha": "lora.alpha",
    "lora_dropout": "lora.dropout",
    "target_modules": "lora.targets",
    "max_seq_length": "data.max_tokens",
    "max_length": "data.max_tokens",
    "dataset": "data.train",
    "model_name_or_path": "model.path",
}


def closest_key(key: str) -> str | None:
    """The valid dotted key nearest to `key` (known aliases, full path, then the last part)."""
    leaf = key.rsplit(".", 1)[-1]
    if leaf in KNOWN_ALIASES:
        return KNOWN_ALIASES[leaf]
    keys = valid_keys()
    match = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    if match:
        return match[0]
    by_leaf = {k.rsplit(".", 1)[-1]: k for k in keys if "." in k}
    match = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)
    return by_leaf[match[0]] if match else None


def format_validation_error(e: ValidationError) -> str:
    errors = e.errors()
    first = errors[0]
    loc = ".".join(str(p) for p in first["loc"])
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    if first["type"] == "missing":
        return f"config: missing required key '{loc}'{more}"
    msg = first["msg"].removeprefix("Value error, ")
    if not loc:  # a model-level rule (e.g. two keys that exclude each other)
        return f"config: {msg}{more}"
    return f"config: {loc}: {msg} (got {first.get('input')!r}){more}"


def _section_type(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _check_keys(raw: Any, model: type[BaseModel], prefix: str) -> None:
    if not isinstance(raw, dict):
        return  # pydantic reports the wrong type with the key named
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        field = model.model_fields.get(key) if isinstance(key, str) else None
        if field is None:
            hint = closest_key(str(dotted))
            suggestion = f" (did you mean '{hint}'?)" if hint else ""
            raise ValueError(f"config: unknown key '{dotted}'{suggestion}")
        sub = _section_type(field.annotation)
        if sub is not None:
            if value is not None and not isinstance(value, dict):
                raise ValueError(f"config: '{dotted}' must be a section (a mapping of keys)")
            _check_keys(value, sub, dotted + ".")


def _parse_override(item: str) -> tuple[str, Any]:
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"override '{item}' must look like key=value (e.g. train.lr=1e-4)")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text  # not a YAML scalar: keep the literal string
    # PyYAML reads `1e-4` as a string (YAML 1.1 wants `1.0e-4`); users mean a number.
    if isinstance(value, str) and "e" in value.lower():
        with contextlib.suppress(ValueError):
            value = float(value)
    return key, value


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            raise ValueError(f"override '{key}': '{where}' is a value, not a section")
        node = child
    node[parts[-1]] = value
