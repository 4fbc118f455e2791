"""Knowledge distillation from a frozen teacher (`train.objective: distill`, the `distill`
section; docs/distill.md): TRL 1.16's generalised JSD (ops/jsd.py: beta 0 = forward KL, 1 =
reverse KL, between: the mixture's JSD; both distributions at `temperature`) over the
labelled tokens, GKD's (Agarwal et al. 2024) mix of off-policy and on-policy data.

Data: SFT's rows and labels (objectives/sft.py: the chat template, assistant-only targets).
Off-policy the targets are the dataset's completions. With probability `lmbda` a micro-batch
is on-policy instead (TRL's GKD draws once per micro-batch): each example's prompt (its tokens
before the last labelled span) is completed by the student, sampled at `temperature` (top-k
0, top-p 1, as TRL) up to `max_completion_tokens` or a stop token, and those tokens become
the targets. The draw and the sampling are seeded from (train.seed, step, the batch's place
in the step's global window): the same on any number of ranks and after a resume. With
lmbda > 0 an example's packed length counts its prompt + max_completion_tokens, so an
on-policy batch always fits the token budget.

The teacher: `distill.teacher` (any model slipstream loads) in `teacher_dtype` (auto: the
run's), or NF4 (`teacher_quantization`), frozen, in eval mode, never wrapped or sharded; it
must share the student's vocabulary (and tokenizer, when it has tokenizer files). One step
runs the student's backbone, the teacher's backbone without grad, then the divergence over
the labelled rows chunk by chunk (never both models' (T, V) float32 logits at once).

Loss sum = the divergence summed over the micro-batch's labelled tokens, weight = those
tokens (TRL's `num_items_in_batch` normalisation); metric `entropy`: the student's mean
entropy per token (TRL's DistillationTrainer's). No host sync in `micro_batch_loss`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from slipstream import distributed as dist
from slipstream.data.packed import PackedView
from slipstream.objectives.base import HookContext, OnlineObjective
from slipstream.objectives.distill_config import FSDP_REFUSAL, DistillSection
from slipstream.objectives.sft import SFT
from slipstream.ops.jsd import linear_jsd


@dataclass(eq=False)
class DistillBatch(PackedView):
    """SFT's packed batch (data/packed.py) and the examples it holds: the prompts an
    on-policy rollout completes."""

    examples: list[Any] = field(default_factory=list)

    num_labels = property(lambda self: self.packed.num_labels)
    label_positions = property(lambda self: self.packed.label_positions)


def last_span_start(trainable: list[bool]) -> int:
    """The index of the first token of the last run of targets (len when there is none)."""
    end = len(trainable)
    while end > 0 and not trainable[end - 1]:
        end -= 1
    start = end
    while start > 0 and trainable[start - 1]:
        start -= 1
    return start if end > 0 else len(trainable)


class Distill(OnlineObjective):
    """The objective the trainer runs for train.objective = distill."""

    name = "distill"
    perplexity = False
    metric_names = ("entropy",)

    def __init__(self, cfg: Any = None, *, teacher: Any = None, **options: Any) -> None:
        """From a RunConfig (its `distill` section), or keyword options named as the
        section's keys; `teacher` a loaded model (tests, the Python API)."""
        self.sft = SFT(cfg)
        if cfg is not None:
            o, t = cfg.distill, cfg.train
            self.dtype, self.prepack, self.budget = cfg.model.dtype, t.prepack, t.tokens_per_batch
            self.parallel = dist.parallel_options(cfg)
        else:
            o = DistillSection.from_options("Distill", options)
            self.dtype, self.prepack, self.budget, self.parallel = "auto", False, 1 << 30, None
        self.options = o
        self.beta, self.temperature, self.lmbda = o.beta, o.temperature, o.lmbda
        self.online = self.lmbda > 0  # on-policy micro-batches: the loop calls rollout
        self.teacher = teacher

    # -- the teacher ----------------------------------------------------------------------
    def attach(self, ctx: HookContext, data: Any) -> None:
        """Load the frozen teacher on the run's device and check the vocabularies."""
        if dist.shards_parameters(self.parallel):  # train.parallel=auto, full fine-tuning
            raise ValueError(FSDP_REFUSAL)
        if self.teacher is None:
            self.teacher = load_teacher(self.options, self.dtype, ctx.device, self.prepack)
        check_same_vocabulary(ctx.model, self.teacher, ctx.tokenizer, self.options.teacher)

    # -- data (SFT's) ---------------------------------------------------------------------
    def tokenize(self, rows: Any, tokenizer: Any, first_row: int = 0) -> tuple[list, Any]:
        return self.sft.tokenize(rows, tokenizer, first_row)

    def length(self, example: Any) -> int:
        if self.lmbda == 0:
            return len(example.input_ids)
        prompt = last_span_start(example.trainable)
        room = max(len(example.input_ids), prompt + self.options.max_completion_tokens)
        return min(room, self.budget)  # an on-policy completion is cut to what fits

    def collate(self, examples: list[Any]) -> DistillBatch:
        return DistillBatch(self.sft.collate(examples), list(examples))

    def weight(self, batch: Any) -> int:
        return batch.num_labels

    # -- on-policy batches ----------------------------------------------------------------
    def rollout(self, ctx: HookContext, step: int, window: list[Any]):
        """-> (the step's micro-batches: each on-policy with probability lmbda, seeded; host
        stats). Off-policy batches are the window's own."""
        start = time.perf_counter()
        batches, on, lengths = [], 0, []
        for k, batch in enumerate(window):
            place = ctx.rank + ctx.world_size * k  # in the step's global window
            seed = ((ctx.seed * 1_000_003 + step) * 65_537 + place) % (1 << 62)
            generator = torch.Generator(ctx.device).manual_seed(seed)
            draw = float(torch.rand((), generator=generator, device=ctx.device))
            if draw >= self.lmbda:  # TRL: on-policy when random() <= lmbda
                batches.append(batch)
                continue
            examples, n = self.on_policy(ctx.model, ctx.tokenizer, batch.examples, generator)
            batches.append(self.collate(examples).to(ctx.device))
            on, lengths = on + 1, lengths + n
        gathered = dist.gather_objects((on, len(window), lengths))
        n_all = [n for g in gathered for n in g[2]]
        stats = {"on_policy": sum(g[0] for g in gathered) / max(sum(g[1] for g in gathered), 1)}
        if n_all:
            stats["completions/mean_length"] = sum(n_all) / len(n_all)
        return batches, {"stats": stats, "seconds": time.perf_counter() - start}

    @torch.no_grad()
    def evaluate(self, ctx: HookContext, examples: list, batches: list[list[int]]) -> dict:
        """Held-out loss and entropy per labelled token on the dataset's completions
        (off-policy, as TRL evaluates); each rank its share, summed over ranks."""
        model, device = ctx.model, ctx.device
        was_training = model.training
        model.eval()
        loss_sum = entropy_sum = torch.zeros((), device=device)
        count = 0
        for indices in batches[ctx.rank :: ctx.world_size]:
            batch = self.collate([examples[i] for i in indices]).to(device)
            loss, metrics = self.micro_batch_loss(model, batch)
            loss_sum, entropy_sum = loss_sum + loss, entropy_sum + metrics["entropy"]
            count += batch.num_labels
        model.train(was_training)
        loss, entropy, count = dist.sum_over_ranks([loss_sum, entropy_sum, count], device).tolist()
        return {"loss": loss / max(count, 1), "entropy": entropy / max(count, 1)}

    @torch.no_grad()
    def on_policy(self, model, tokenizer, examples, generator):
        """Examples whose targets are the student's own completions of their prompts."""
        from slipstream.data.labels import Example
        from slipstream.generation import engine
        from slipstream.generation.api import stop_token_ids
        from slipstream.generation.sampling import Sampling

        prompts = [ex.input_ids[: last_span_start(ex.trainable)] for ex in examples]
        with dist.gathered_for_generation(model):
            rows = engine.run(
                model, prompts, max_new_tokens=self.options.max_completion_tokens,
                sampling=Sampling(self.temperature), stop_ids=stop_token_ids(tokenizer),
                generator=generator, logprobs=False,
                max_positions=model.config.hf.get("max_position_embeddings"),
            )  # fmt: skip
        out = []
        for ex, p, r in zip(examples, prompts, rows, strict=True):
            c = list(r.token_ids)[: self.length(ex) - len(p)]  # within the packed length
            out.append(Example(list(p) + c, [False] * len(p) + [True] * len(c)))
        return out, [len(ex.input_ids) - last_span_start(ex.trainable) for ex in out]

    # -- loss -----------------------------------------------------------------------------
    def micro_batch_loss(
        self, model: torch.nn.Module, batch: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The divergence summed over the labelled tokens, and the student's entropy sum."""
        positions = batch.label_positions
        h_ND = model.hidden_states(batch.input_ids, batch.seq).index_select(0, positions)
        with torch.no_grad():
            h_t_NE = self.teacher.hidden_states(batch.input_ids, batch.seq)
            h_t_NE = h_t_NE.index_select(0, positions)
        loss, entropy = linear_jsd(
            h_ND, model.lm_head_weight(), h_t_NE, self.teacher.lm_head_weight(),
            beta=self.beta, temperature=self.temperature,
        )  # fmt: skip
        return loss, {"entropy": entropy}


def load_teacher(options: Any, dtype_name: str, device: torch.device, prepack: bool):
    """The frozen teacher: `teacher_dtype` (auto: the run's `model.dtype`), or NF4."""
    from slipstream.checkpoint.hf import load_model
    from slipstream.device import choose_dtype

    name = dtype_name if options.teacher_dtype == "auto" else options.teacher_dtype
    dtype, _ = choose_dtype(name, device)
    nf4 = options.teacher_quantization == "nf4"
    dist.print_main(f"slipstream: loading the teacher {options.teacher} ({dtype}"
                    f"{', NF4' if nf4 else ''})...")  # fmt: skip
    teacher = load_model(options.teacher, dtype=dtype, device=device,
                         quantize="nf4" if nf4 else None)  # fmt: skip
    teacher.requires_grad_(False).eval()
    if prepack and device.type == "cpu":
        from slipstream.ops.frozen_linear import apply_prepacked_linears

        apply_prepacked_linears(teacher)
    return teacher


def check_same_vocabulary(model, teacher, tokenizer: Any, teacher_path: str) -> None:
    """One line when the teacher's vocabulary (head rows, tokenizer) is not the student's
    (`tokenizer`: the run's)."""
    s, t = model.lm_head_weight().shape[0], teacher.lm_head_weight().shape[0]
    if s != t:
        raise ValueError(
            f"distill.teacher {teacher_path} has a vocabulary of {t} tokens, the student "
            f"{s}: teacher and student must share a tokenizer"
        )
    from slipstream.checkpoint.tokenizer import load_tokenizer

    try:
        theirs = load_tokenizer(teacher_path).get_vocab()
    except (ValueError, OSError):  # no tokenizer files beside the teacher: the head decides
        return
    ours = tokenizer.get_vocab() if tokenizer is not None else theirs
    differ = sorted(set(theirs.items()) ^ set(ours.items()))
    if differ:
        raise ValueError(
            f"distill.teacher {teacher_path}: its tokenizer differs from the student's "
            f"({len(differ)} entries, e.g. {differ[0][0]!r}): teacher and student must share one"
        )
