"""What a run is made of before the loop starts, and what it leaves behind: the data
(loaded, tokenized and packed: `build_data`), the model (weights, then LoRA/DoRA or full
training, then checkpointing and compile: `build_model`), the tokenizer, the device and dtype,
the seeds, and the saved result (`save_result`). `prepare_run` (run.py) calls these in order.
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slipstream import distributed as dist
from slipstream.checkpoint.atomic import atomic_write_files
from slipstream.config import RunConfig
from slipstream.device import choose_dtype
from slipstream.models.moe_block import has_router_loss, set_router_aux_loss_coef
from slipstream.peft.vision import vision_training


@dataclass
class RunData:
    """Tokenized examples and the packed batches (lists of example indices) over them."""

    train: list[Any]
    train_batches: list[list[int]]
    eval: list[Any]
    eval_batches: list[list[int]]
    report: Any
    packing_efficiency: float
    formats: dict[str, str] = dataclasses.field(default_factory=dict)  # source -> row format


def build_data(cfg: RunConfig, tokenizer: Any, objective: Any = None) -> RunData:
    """Load, tokenize (as the objective does) and split each source, pool them and pack;
    report what was skipped, truncated or dropped."""
    from slipstream.checkpoint.model_type import check_model_source
    from slipstream.data import load_rows, load_split, pack_examples, packing_efficiency
    from slipstream.data.load import EmptySplitError
    from slipstream.data.row_shards import merge_reports
    from slipstream.objectives import build_objective
    from slipstream.sources import check_run_paths, sources_of

    check_run_paths(cfg)  # every file, before the first is read
    m = cfg.model  # a model we cannot build: said before tokenizing
    check_model_source(m.path, "model.path", m.implementation, m.trust_remote_code)
    d, t = cfg.data, cfg.train
    objective = objective if objective is not None else build_objective(cfg)
    examples, eval_examples, reports, formats = [], [], [], {}
    sources = sources_of(d.train)
    for source in sources:
        try:
            rows, eval_rows = load_split(
                source, eval_fraction=d.eval_fraction, seed=t.seed, split=d.split
            )
        except EmptySplitError:  # the rows' own problems (none usable) are the news, if any
            rows = load_rows(source, split=d.split)
            _tokenize_source(objective, tokenizer, rows, source, "train")
            raise
        part, report = _tokenize_source(objective, tokenizer, rows, source, "train")
        examples += part
        reports.append(report)
        formats[source] = report.format_text()
        if eval_rows is not None:
            eval_examples += _tokenize_source(objective, tokenizer, eval_rows, source, "eval")[0]
        if len(sources) > 1:
            dist.print_main(f"slipstream: {source}: {report.summary()}")
    for source in sources_of(d.eval):
        rows = load_rows(source, split=d.split)
        part, eval_report = _tokenize_source(objective, tokenizer, rows, source, "eval")
        eval_examples += part
        formats.setdefault(source, eval_report.format_text())
    report = merge_reports(reports)
    report.format = ", ".join(dict.fromkeys(getattr(r, "format", "") for r in reports))
    lengths = [objective.length(ex) for ex in examples]
    train_batches = pack_examples(lengths, t.tokens_per_batch)
    eval_lengths = [objective.length(ex) for ex in eval_examples]
    eval_batches = pack_examples(eval_lengths, t.tokens_per_batch) if eval_examples else []
    efficiency = packing_efficiency(lengths, train_batches, t.tokens_per_batch)
    dist.print_main(
        f"slipstream: {len(examples)} train / {len(eval_examples)} eval examples, "
        f"{len(train_batches)} batches, packing {efficiency:.1%}; {report.summary()}"
    )
    return RunData(
        examples, train_batches, eval_examples, eval_batches, report, efficiency, formats
    )


def _tokenize_source(objective: Any, tokenizer: Any, rows: Any, source: str, what: str):
    """(examples, DataReport) of one source's rows. Under torchrun each rank tokenizes a
    slice and all get every example back, in row order: every rank packs the same batches."""
    from slipstream.data.images import images_relative_to
    from slipstream.data.row_shards import tokenize_sharded

    def tokenize(part, first_row):
        return objective.tokenize(part, tokenizer, first_row)

    try:
        with images_relative_to(source):  # a row's image paths are relative to its file
            examples, report = tokenize_sharded(tokenize, rows, what)
    except ValueError as e:
        raise ValueError(f"data source '{source}' ({what}): {e}") from None
    if not examples:
        raise ValueError(f"data source '{source}': no usable examples ({report.summary()})")
    if warning := report.warning():
        dist.print_main(f"slipstream: warning: data source '{source}' ({what}): {warning}")
    return examples, report


def image_implementation(cfg: RunConfig, examples: list) -> str | None:
    """ "transformers" when the data holds image rows and `model.implementation: auto` would
    take a native family that trains text only while the generic image-text path trains the
    checkpoint's image side (models.IMAGE_TEXT_ON_GENERIC, empty now); else None."""
    from slipstream.checkpoint.model_type import model_config
    from slipstream.data.vision import ImageExample
    from slipstream.models import image_text_implementation
    from slipstream.objectives.grpo_data import PromptExample
    from slipstream.objectives.kto_data import KTOExample
    from slipstream.objectives.pairs import PairExample

    def images(e: Any) -> bool:  # an image row; a preference pair, KTO row or RL prompt with images
        if isinstance(e, PromptExample):
            return e.image is not None
        with_images = isinstance(e, (PairExample, KTOExample)) and e.images is not None
        return isinstance(e, ImageExample) or with_images

    if cfg.model.implementation != "auto" or not any(images(e) for e in examples):
        return None
    implementation = image_text_implementation(model_config(cfg.model.path))
    return None if implementation == "auto" else implementation


def build_model(
    cfg: RunConfig, device: torch.device, tokenizer: Any = None, plan: Any = None
) -> torch.nn.Module:
    """Load weights (NF4 for QLoRA), grow the vocabulary for `model.add_tokens` (the
    tokenizer's, after `add_tokens`), then LoRA (and trained embeddings) or full training,
    then (CPU) frozen weights prepacked, then MLP tiling, checkpointing and compile. `plan`
    (memory.plan.Plan, which `prepare_run` makes first) gives the checkpointing mode and tiles."""
    from slipstream.checkpoint.hf import load_model

    quantize = None if cfg.model.quantization == "none" else cfg.model.quantization
    if quantize and cfg.train.finetune == "full":
        raise ValueError("model.quantization=nf4 trains adapters only; set train.finetune=lora")
    dtype, why = choose_dtype(cfg.model.dtype, device)
    what = f"{str(dtype).removeprefix('torch.')}{', NF4' if quantize else ''}"
    dist.print_main(f"slipstream: dtype {what} ({why})")
    dist.print_main(f"slipstream: loading the model weights from {cfg.model.path} ({what})...")
    start = time.perf_counter()
    model = load_model(
        cfg.model.path, dtype=dtype, device=device, quantize=quantize,
        implementation=cfg.model.implementation, trust_remote_code=cfg.model.trust_remote_code,
    )  # fmt: skip
    dist.print_main(f"slipstream: model loaded in {time.perf_counter() - start:.0f} s")
    dist.print_main(f"slipstream: model {model.load_path}")
    if cfg.train.router_aux_loss_coef is not None:
        if cfg.train.router_aux_loss_coef > 0 and not has_router_loss(model):
            raise ValueError(
                "train.router_aux_loss_coef > 0 needs a MoE model whose routers have a "
                f"load-balancing loss ({model.config.model_type} has none); unset it"
            )
        set_router_aux_loss_coef(model, cfg.train.router_aux_loss_coef)
    new_ids = grow_vocab(model, tokenizer, cfg.model.add_tokens)
    if cfg.model.adapter is not None:
        from slipstream.checkpoint.adapter import load_adapter
        from slipstream.sources import check_adapter_dir

        # The adapter's own r, alpha and targets (adapter_config.json) win over `lora`'s.
        load_adapter(model, check_adapter_dir(cfg.model.adapter, "model.adapter"))
        if cfg.train.finetune == "full":  # full fine-tuning starts from the merged weights
            from slipstream.peft.lora import merge_lora

            merge_lora(model)
    vision_training(model, cfg.vision, cfg.train.finetune, before_lora=True)
    if cfg.train.finetune == "lora" and cfg.model.adapter is None:
        from slipstream.peft.lora import apply_lora

        lo = cfg.lora
        apply_lora(
            model, rank=lo.rank, alpha=lo.alpha, dropout=lo.dropout, targets=lo.targets,
            use_rslora=lo.use_rslora, use_dora=lo.use_dora,
        )  # fmt: skip
        if new_ids or lo.train_embeddings:
            from slipstream.peft.embeddings import apply_embedding_training, new_token_rows

            rows = new_token_rows(model, new_ids, lo.train_embeddings)
            apply_embedding_training(model, rows=rows, full=lo.train_embeddings)
    elif cfg.train.finetune == "full":
        model.requires_grad_(True)
    vision_training(model, cfg.vision, cfg.train.finetune, before_lora=False)
    # Not under compile (dynamo cannot trace oneDNN's packed weights) nor FSDP2 (shards).
    prepack = not cfg.train.compile and cfg.train.parallel != "fsdp"
    if cfg.train.prepack and prepack and device.type == "cpu":
        from slipstream.ops.frozen_linear import apply_prepacked_linears

        packed, held = apply_prepacked_linears(model)
        if packed:
            dist.print_main(
                f"slipstream: {packed} frozen linear weights packed once for oneDNN "
                f"({held / 2**20:.0f} MiB more memory; train.prepack=false to skip)"
            )
    tiles = cfg.train.mlp_tiles if isinstance(cfg.train.mlp_tiles, int) else 1
    tiles = plan.tiles if plan is not None else tiles
    if tiles > 1:
        from slipstream.memory.tiled_mlp import apply_mlp_tiling

        apply_mlp_tiling(model, tiles)
    mode = cfg.train.activation_checkpointing if plan is None else plan.mode
    if mode == "auto":  # offload pays on a GPU; on CPU there is no device memory to save
        mode = "offload" if device.type == "cuda" else "recompute"
    if mode != "none":
        from slipstream.memory.offload import apply_checkpointing

        apply_checkpointing(model, mode)
    if cfg.train.compile:
        from slipstream.compile import apply_compile

        apply_compile(model)
    return model


def add_tokens(tokenizer: Any, tokens: list[str]) -> None:
    """`model.add_tokens` into the tokenizer (before the data is tokenized); tokens it already
    has keep their ids."""
    if tokens:
        added = tokenizer.add_tokens(list(tokens))
        dist.print_main(f"slipstream: {added} of model.add_tokens' {len(tokens)} tokens are new")


def grow_vocab(model: torch.nn.Module, tokenizer: Any, tokens: list[str]) -> list[int]:
    """The ids of `tokens` (after `add_tokens`); the embedding (and head) grown to the
    tokenizer's length where it is longer, new rows at the mean of the old ones."""
    if not tokens:
        return []
    if tokenizer is None:
        raise ValueError("model.add_tokens: build_model needs the run's tokenizer")
    from slipstream.peft.embeddings import resize_vocab

    ids = tokenizer.convert_tokens_to_ids(list(tokens))
    added = resize_vocab(model, len(tokenizer))
    if added:
        dist.print_main(f"slipstream: embedding grown by {added} rows (their mean to start)")
    return ids


def save_result(model: torch.nn.Module, tokenizer: Any, out: Path, cfg: RunConfig) -> None:
    """The adapter (PEFT layout) or the full model (HF layout), plus the tokenizer files."""
    if cfg.train.finetune == "full":
        from slipstream.checkpoint.hf import save_model

        save_model(model, out, tokenizer=tokenizer)
    else:
        from slipstream.checkpoint.adapter import save_adapter

        # The base as load_model noted it (a GGUF's hub id); a model passed in: the config's.
        base = None if getattr(model, "name_or_path", None) else cfg.model.path
        save_adapter(model, out, base_model_name_or_path=base)
        from slipstream.checkpoint.hf import copy_processor_files

        copy_processor_files(model, out)  # generate/export with images read them here
    if hasattr(tokenizer, "save_pretrained"):  # into a temp folder, then renamed file by file
        atomic_write_files(out, tokenizer.save_pretrained)


def set_chat_template(tokenizer: Any, template: str | None) -> None:
    """data.chat_template (a .jinja file, or the template itself) replaces the tokenizer's;
    checked once on a two-turn chat, so a broken template is one error, not every row
    skipped."""
    from slipstream.sources import chat_template_text

    if template is None:
        return
    tokenizer.chat_template = chat_template_text(template)
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    try:
        text = tokenizer.apply_chat_template(chat, tokenize=False)
    except Exception as e:  # jinja's own errors: syntax, undefined names, raise_exception
        raise ValueError(f"data.chat_template does not render a chat: {e}") from None
    if "Hello" not in text:
        raise ValueError("data.chat_template renders a chat without the assistant's message")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


def report_dict(report: Any) -> Any:
    if dataclasses.is_dataclass(report):
        return {k: dict(v) if isinstance(v, dict) else v for k, v in vars(report).items()}
    return report if isinstance(report, dict) else str(report)
