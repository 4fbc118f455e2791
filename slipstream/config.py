"""The run config: the composed RunConfig, YAML loading, dotted command-line overrides.

A run is described by one YAML file with the sections `model`, `data`, `lora`, `train` (their
models in `slipstream/config_sections.py`), one
section per objective with options (each defined beside its objective and registered in
`slipstream.objectives.OBJECTIVES`: `preference`, `grpo`), and two top-level keys
(`output_dir`, `resume`). `load_config(path, ["train.lr=1e-4", ...])`
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
import re
import sys
import tempfile
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    create_model,
    model_validator,
)

from slipstream.config_section import Section as _Section
from slipstream.config_section import option as _opt
from slipstream.config_sections import (
    DataSection,
    LoraSection,
    ModelSection,
    TrainSection,
    VisionSection,
)
from slipstream.objectives import (  # names and sections only: no torch import
    objective_sections,
    section_key,
)


class _Run(_Section):
    """The run config's top level and its rules across sections; `RunConfig` is this with the
    sections as fields, the registered objectives' own among them (`_compose`)."""

    @model_validator(mode="after")
    def _best_needs_eval_data(self) -> _Run:
        if self.train.save_best and self.data.eval is None and not self.data.eval_fraction:
            raise ValueError("train.save_best needs eval data: set data.eval or data.eval_fraction")
        return self

    @model_validator(mode="after")
    def _embeddings_need_lora(self) -> _Run:
        if self.lora.train_embeddings and self.train.finetune == "full":
            raise ValueError(
                "lora.train_embeddings is for train.finetune=lora (full trains every weight)"
            )
        if (self.model.add_tokens or self.lora.train_embeddings) and self.model.adapter:
            raise ValueError(
                "model.add_tokens and lora.train_embeddings start a new adapter; with "
                "model.adapter the adapter's own embeddings apply: drop them or model.adapter"
            )
        return self

    @model_validator(mode="after")
    def _objective_rules(self) -> _Run:
        key = section_key(self.train.objective)
        if key is not None:  # the objective's rules across sections (grpo: its group fits)
            getattr(self, key).check_run(self)
        return self


def _compose() -> type[_Run]:
    """RunConfig: the run's sections, then each registered objective's (slipstream/
    objectives/__init__.py), then the top-level keys, in this order in every dump."""
    fields: dict[str, Any] = {
        "model": (ModelSection, Field(description="the checkpoint to fine-tune")),
        "data": (DataSection, Field(description="training and eval data")),
        "lora": (
            LoraSection,
            Field(LoraSection(), description="the adapters (train.finetune=lora)"),
        ),
        "train": (TrainSection, Field(TrainSection(), description="the loop")),
        "vision": (
            VisionSection,
            Field(VisionSection(), description="what trains of an image-text model's vision side"),
        ),
    }
    for key, section in objective_sections().items():
        fields[key] = (section, Field(section(), description=section.meaning))
    fields["output_dir"] = (str, Field(description="where the run writes its results"))
    fields["resume"] = (
        bool | str,
        _opt(
            False,
            "true: the latest checkpoint in output_dir (an error if none); auto: the latest if "
            "any, else start fresh; false: start fresh; or a checkpoint path",
        ),
    )
    return create_model("RunConfig", __base__=_Run, __module__=__name__, **fields)


RunConfig = _compose()


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
    raw = moved_keys(raw)
    _check_keys(raw, RunConfig, prefix="")
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as e:
        raise ValueError(format_validation_error(e)) from None


# Keys that moved (old dotted key -> new): the old spelling still works, with one line on
# stderr; a config saved in an older checkpoint is read the same way, silently.
MOVED_KEYS = {"lora.method": "train.finetune"}


def moved_keys(raw: dict[str, Any], *, say: bool = True) -> dict[str, Any]:
    """`raw` (not changed) with every old key of MOVED_KEYS under its new name; `say`: one
    deprecation line on stderr for each (from the first process only under torchrun)."""
    for old, new in MOVED_KEYS.items():
        (section, key), (new_section, new_key) = old.split("."), new.split(".")
        values, target = raw.get(section), raw.get(new_section) or {}
        if not isinstance(values, dict) or key not in values or not isinstance(target, dict):
            continue
        value = values[key]
        if new_key in target and target[new_key] != value:
            raise ValueError(
                f"config: {old}={value!r} and {new}={target[new_key]!r} disagree; drop {old} "
                f"(now {new})"
            )
        rest = {k: v for k, v in values.items() if k != key}
        raw = {**raw, section: rest, new_section: {**target, new_key: value}}
        if say and os.environ.get("RANK", "0") == "0":
            print(f"slipstream: {old} is deprecated; write {new}: {value} instead",
                  file=sys.stderr)  # fmt: skip
    return raw


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def write_resolved_config(cfg: RunConfig, output_dir: str | os.PathLike) -> Path:
    """Write the resolved config as `config.yaml` in the output dir (atomically)."""
    from slipstream.checkpoint.atomic import atomic_write_text

    return atomic_write_text(Path(output_dir) / "config.yaml", dump_config(cfg))


def check_output_dir(output_dir: str | os.PathLike) -> Path:
    """Prove `output_dir` can be made and written, before any expensive work, leaving nothing
    behind: the folder itself is made with the run's first result (a temp file is written and
    removed in the nearest folder that exists)."""
    out = Path(output_dir)
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(20, "Not a directory")
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".write-test-"):
            pass
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise ValueError(f"output_dir '{out}' is not writable ({reason}); pick another") from None
    return out


def valid_keys(model: type[BaseModel] | None = None, prefix: str = "") -> list[str]:
    """Every dotted key the config accepts, e.g. 'train.lr'."""
    model = RunConfig if model is None else model
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
    """The valid dotted key `key` was probably meant to be: a known alias, or a key whose
    last part is spelled nearly alike (same section first) or contains it; else None, rather
    than a guess that only shares the section's name."""
    section, _, leaf = key.rpartition(".")
    if leaf in KNOWN_ALIASES:
        return KNOWN_ALIASES[leaf]
    keys = valid_keys()
    for pool in ([k for k in keys if k.rpartition(".")[0] == section], keys):
        by_leaf = {k.rpartition(".")[2]: k for k in reversed(pool)}
        match = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.75)
        if match:
            return by_leaf[match[0]]
        if len(leaf) >= 4:
            within = [name for name in by_leaf if leaf.lower() in name]
            if len(within) == 1:
                return by_leaf[within[0]]
    return None


def format_validation_error(e: ValidationError) -> str:
    errors = e.errors()
    first = errors[0]
    loc = ".".join(str(p) for p in first["loc"])
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    if first["type"] == "missing":
        return f"config: missing required key '{loc}'{more}"
    msg = first["msg"].removeprefix("Value error, ")
    if not loc or isinstance(first.get("input"), dict):  # a rule over a section's keys
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


def describe_config(section: str | None = None) -> str:
    """Every key (of one section, or all) with its default and meaning, from the models'
    field descriptions: what `slipstream config [SECTION]` prints."""
    sections = {n: _section_type(f.annotation) for n, f in RunConfig.model_fields.items()}
    if section is not None and sections.get(section) is None:
        names = ", ".join(n for n, sub in sections.items() if sub is not None)
        raise ValueError(f"config: no section '{section}' (sections: {names})")
    rows: list[tuple[str, str, str]] = []
    for name, field in RunConfig.model_fields.items():
        sub = sections[name]
        if section is not None and name != section:
            continue
        if sub is None:
            rows.append((name, _default_text(field), field.description or ""))
            continue
        rows.append((f"{name}:", "", field.description or ""))
        for key, f in sub.model_fields.items():
            rows.append((f"  {key}", _default_text(f), _meaning(f)))
    width = max(len(k) for k, _, _ in rows) + 2
    dwidth = max(len(d) for _, d, _ in rows) + 2
    return "\n".join(f"{k:<{width}}{d:<{dwidth}}{m}".rstrip() for k, d, m in rows)


def _choices(annotation: Any) -> list[str]:
    """The values of the Literals in a type (`Literal[...]`, `list[Literal[...]] | None`)."""
    if typing.get_origin(annotation) is typing.Literal:
        return [str(a) for a in typing.get_args(annotation)]
    return [c for arg in typing.get_args(annotation) for c in _choices(arg)]


def _meaning(field: Any) -> str:
    """A field's description, with its allowed values when it has a fixed set (a Literal,
    or a registry's names) that the description does not already spell out."""
    text = field.description or ""
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    values = list(extra.get("choices") or _choices(field.annotation))
    if any(not re.search(rf"(?<![\w-]){re.escape(v)}(?![\w-])", text) for v in values):
        text += f" [{' | '.join(values)}]"
    return text


def _default_text(field: Any) -> str:
    if field.is_required():
        return "(required)"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return ""
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    return str(value)
