"""The run config's own sections: `model`, `data`, `lora` and `train` (pydantic, torch-free).

Each objective's section lives beside its objective (`slipstream/objectives/*_config.py`);
`slipstream.config` composes them all into `RunConfig` and owns loading and key checks.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from slipstream.config_section import Section as _Section
from slipstream.config_section import option as _opt
from slipstream.objectives import OBJECTIVES  # names only: no torch import


class ModelSection(_Section):
    path: str = Field(
        description="HF checkpoint folder, .gguf file, hub id, or a built-in name (smollm2-demo)"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = _opt(
        "auto", "weights' dtype; auto: bf16 on GPU and on CPUs with AMX or AVX512-BF16"
    )
    quantization: Literal["none", "nf4"] = _opt("none", "nf4: QLoRA (4-bit base, bitsandbytes)")
    adapter: str | None = _opt(
        None,
        "PEFT adapter folder to start from (LoRA: its factors, r, alpha, targets and dropout "
        "win over lora's; full: merged in first)",
    )
    implementation: Literal["auto", "native", "transformers"] = _opt(
        "auto",
        "auto: slipstream's native family where there is one, else transformers' modeling code "
        "(any causal LM transformers builds); native / transformers force one",
    )
    trust_remote_code: bool = _opt(
        False, "allow a checkpoint's own modeling code (config.json auto_map): runs its Python"
    )
    add_tokens: list[str] = Field(
        default_factory=list,
        description="tokens added to the tokenizer; new embedding rows start at the mean, "
        "and train (with LoRA: those rows only, unless lora.train_embeddings names the matrix)",
    )

    @field_validator("add_tokens")
    @classmethod
    def _distinct_tokens(cls, value: list[str]) -> list[str]:
        if any(not t for t in value) or len(set(value)) != len(value):
            raise ValueError("give each token once, none empty")
        return value


class DataSection(_Section):
    train: str | list[str] = Field(
        description="jsonl/json/parquet/csv file or hub dataset id, or a list (pooled)"
    )
    split: str | None = _opt(None, "hub datasets: which split (train and eval alike)")
    eval: str | list[str] | None = _opt(None, "held-out source(s); or use eval_fraction")
    eval_fraction: float = _opt(0.0, "share of each train source held out for eval", ge=0.0, lt=1.0)
    format: str = _opt(
        "auto",
        "auto (each row's, from its columns) | messages | sharegpt | prompt_completion | alpaca "
        "| text",
    )
    chat_template: str | None = _opt(
        None, "a .jinja file or the template text, replacing the tokenizer's (saved with it)"
    )
    train_on: Literal["assistant", "all"] = _opt("assistant", "which tokens are trained")
    max_tokens: int | None = _opt(
        None, "longest example in tokens; default: train.tokens_per_batch", gt=0
    )
    overlong: Literal["truncate", "drop"] = _opt("drop", "what happens to a longer example")
    strict: bool = _opt(False, "a bad row is fatal instead of counted and skipped")
    num_proc: int | None = _opt(None, "tokenizer processes; default: several over 20k rows", gt=0)

    @field_validator("train", "eval")
    @classmethod
    def _sources(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and (not value or len(set(value)) != len(value)):
            raise ValueError("give one or more sources, each once")
        return value

    @model_validator(mode="after")
    def _one_eval_source(self) -> DataSection:
        if self.eval is not None and self.eval_fraction > 0:
            raise ValueError(
                "data.eval and data.eval_fraction are both set; drop one "
                "(e.g. data.eval_fraction=0 to use data.eval)"
            )
        return self


VisionTrain = Literal["frozen", "lora", "full"]


class VisionSection(_Section):
    tower: VisionTrain = _opt(
        "frozen", "image-text models: the vision tower frozen | lora | full (full fine-tuning)"
    )
    projector: VisionTrain = _opt(
        "frozen", "image-text models: the projector into the language model, as tower"
    )


class LoraSection(_Section):
    rank: int = _opt(16, "LoRA rank r", gt=0)
    alpha: float = _opt(32.0, "LoRA alpha (scale alpha / rank)", gt=0)
    dropout: float = _opt(0.0, "dropout on the LoRA input", ge=0.0, lt=1.0)
    targets: str | list[str] = _opt(
        "all-linear", "all-linear or names (q_proj, ...; lm_head: an untied head)"
    )
    use_rslora: bool = _opt(False, "rank-stabilised scale alpha / sqrt(rank)")
    use_dora: bool = _opt(False, "DoRA: a trained magnitude per output row")
    plus_ratio: float | None = _opt(None, "LoRA+: B factors at this multiple of the lr", gt=0)
    train_embeddings: list[Literal["embed_tokens", "lm_head"]] = Field(
        default_factory=list,
        description="whole matrices trained beside the adapters (peft's modules_to_save)",
    )


class TrainSection(_Section):
    objective: str = Field(
        "sft",
        description="what the loss is (slipstream/objectives/; docs/preference.md, docs/grpo.md)",
        json_schema_extra={"choices": list(OBJECTIVES)},  # `slipstream config` lists them
    )
    finetune: Literal["lora", "full"] = _opt(
        "lora",
        "lora: adapters (the lora section; QLoRA with model.quantization=nf4); full: "
        "every weight trained",
    )
    lr: float = _opt(2e-4, "peak learning rate", gt=0)
    schedule: Literal["linear", "cosine", "constant"] = _opt("cosine", "lr schedule after warmup")
    warmup_steps: int | float = _opt(
        0, "steps of linear warmup, or a fraction < 1 of the run's steps (0.05)", ge=0
    )
    steps: int | None = _opt(None, "optimizer steps; when set, wins over epochs", gt=0)
    epochs: float | None = _opt(None, "passes over the data; default 1 when steps is unset", gt=0)
    tokens_per_batch: int = _opt(8192, "tokens per micro-batch, packed without padding", gt=0)
    grad_accum: int = _opt(1, "micro-batches per optimizer step", gt=0)
    clip: float | None = _opt(1.0, "max grad norm; null: no clipping", gt=0)
    weight_decay: float = _opt(0.0, "AdamW weight decay", ge=0)
    optimizer: Literal["adamw", "adamw_8bit"] = _opt(
        "adamw", "adamw_8bit: bitsandbytes 8-bit states (full fine-tuning, one GPU)"
    )
    seed: int = _opt(0, "seeds data order, LoRA init and dropout")
    eval_every: int = _opt(0, "eval every N steps; 0: at start and end only", ge=0)
    sample_prompts: list[str] = Field(
        default_factory=list,
        description="prompts the model answers (greedy) at each eval, into the log and metrics",
    )
    sample_max_new_tokens: int = _opt(64, "reply length of sample_prompts", gt=0)
    eval_tasks: list[str] = Field(
        default_factory=list,
        description="lm-eval tasks run at each eval (pip install 'slipstream[eval]'), logged "
        "as eval/<task>/<metric>",
    )
    eval_tasks_limit: float | None = _opt(
        None, "documents a task for eval_tasks (a fraction < 1: of each)", gt=0
    )
    eval_tasks_include_path: str | None = _opt(None, "a folder of task YAMLs for eval_tasks")
    save_every: int = _opt(0, "checkpoint every N steps; 0: no mid-run checkpoints", ge=0)
    keep_checkpoints: int = _opt(2, "how many mid-run checkpoints to keep", gt=0)
    skip_nonfinite: int = _opt(
        0, "steps with a NaN/inf loss or grad norm to skip (counted) before stopping", ge=0
    )
    log_every: int = _opt(10, "log every N steps (one host sync each)", gt=0)
    activation_checkpointing: Literal["auto", "offload", "recompute", "none"] = _opt(
        "auto", "auto: offload on GPU, recompute on CPU"
    )
    mlp_tiles: Literal["auto", "off"] | int = _opt(
        "auto", "MLP over the tokens in N tiles (long sequences); auto: when untiled won't fit"
    )
    memory: Literal["check", "auto", "off"] = _opt(
        "check", "plan memory first (slipstream plan); auto: it picks checkpointing and tiles"
    )
    compile: bool = _opt(False, "regional torch.compile of attention and MLP blocks")
    prepack: bool = _opt(
        True, "CPU, float32: frozen linear weights (LoRA/QLoRA bases) packed once for oneDNN"
    )
    device: str = _opt("auto", "auto | cpu | cuda | cuda:N")
    threads: int | None = _opt(
        None, "CPU threads; default: OMP_NUM_THREADS if set, else the physical cores", gt=0
    )
    parallel: Literal["auto", "none", "ddp", "fsdp"] = _opt(
        "auto", "under torchrun; auto: ddp for LoRA/QLoRA, fsdp (FSDP2) for full"
    )
    sequence_parallel: int = _opt(
        1, "under torchrun: split each micro-batch's tokens over N ranks (Ulysses)", ge=1
    )
    dist_timeout_s: float = _opt(1800.0, "seconds a rank waits in a collective", gt=0)
    router_aux_loss_coef: float | None = _opt(
        None, "MoE load-balancing loss weight; null: the checkpoint's own; 0: off", ge=0
    )

    report_to: list[Literal["tensorboard", "wandb"]] | None = _opt(
        None, "metrics also to tensorboard, wandb; unset: tensorboard when installed"
    )
    save_best: bool = _opt(False, "keep the best-eval checkpoint (eval_every) beside the latest")
    push_to_hub: str | None = _opt(
        None, "a Hub repo id (NAME or NAMESPACE/NAME): push the result there when the run completes"
    )
    push_private: bool = _opt(False, "push_to_hub makes a new repo private")

    @field_validator("push_to_hub")
    @classmethod
    def _hub_repo_id(cls, value: str | None) -> str | None:
        from slipstream.share.upload import check_repo_id

        return value if value is None else check_repo_id(value, "push_to_hub")

    @field_validator("report_to", mode="before")
    @classmethod
    def _one_reporter(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _best_needs_evals(self) -> TrainSection:
        if self.save_best and not self.eval_every:
            raise ValueError("train.save_best needs train.eval_every > 0 (evals during the run)")
        return self

    @field_validator("mlp_tiles", "memory", mode="before")
    @classmethod
    def _off_as_written(cls, value: Any) -> Any:
        """`off` as the user wrote it: YAML 1.1 (PyYAML, in a file and in key=value) reads a
        bare off as False, which made `train.memory=off` an error."""
        return "off" if value is False else value

    @field_validator("mlp_tiles")
    @classmethod
    def _tiles_positive(cls, value: str | int) -> str | int:
        if isinstance(value, int) and value < 1:
            raise ValueError("give a tile count >= 1 (1 or off: untiled), or auto")
        return value

    @field_validator("warmup_steps")
    @classmethod
    def _whole_steps_or_fraction(cls, value: int | float) -> int | float:
        if value >= 1 and value != int(value):
            raise ValueError(f"give whole steps (>= 1) or a fraction below 1, not {value}")
        return int(value) if value >= 1 else value

    @field_validator("objective")
    @classmethod
    def _known_objective(cls, value: str) -> str:
        if value not in OBJECTIVES:
            raise ValueError(f"unknown objective; use one of {', '.join(OBJECTIVES)}")
        return value
