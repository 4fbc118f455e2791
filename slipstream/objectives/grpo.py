"""GRPO (and its DAPO / Dr. GRPO loss variants): RL on verifiable rewards, as one objective
of the shared trainer (docs/grpo.md; the formulas in grpo_loss.py; data in grpo_data.py).

One optimizer step: the loop collates the step's prompt batches and hands them to
`rollout(ctx, step, prompt_batches)` (ctx: objectives/base.py `HookContext`), which
1. generates G completions per prompt (`generation.engine`, LoRA unmerged, eval mode, no
   grad), one prompt batch at a time, sampling seeded from (train.seed, rollout index, the
   batch's place among the step's prompt batches over all ranks): a resumed run, and the
   same step on any number of ranks, draw the same completions,
2. scores them with the reward functions (host) and turns rewards into group-normalised
   advantages (a group is one prompt's G completions, always on one rank),
3. packs the prompt+completion sequences by their real length into micro-batches within
   `train.tokens_per_batch` (never more micro-batches than prompt batches; under torchrun
   every rank the same number), with advantages and per-token loss scales built on the
   host, and, on the device, the old log-probs (mu > 1) and the reference's (beta > 0).
The loop then runs its usual accumulation over those micro-batches: `micro_batch_loss` is
the clipped surrogate over completion tokens, log-probs through the chunked LM head, no host
sync. Prompts with images (grpo_data.py) generate with their images (`slipstream.generate`'s image
path: the prefill writes the features, the KV cache as for text) and each micro-batch holds a
prompt's images once, its G completions' rows sharing the tower's features.
`iterations_per_batch` = mu: one rollout serves mu consecutive optimizer steps (its
prompts drawn once); mu = 1 takes the old log-probs as the detached current ones (ratio 1,
as TRL). A run resumed in the middle of a rollout's mu steps rolls those prompt batches out
again with the resumed weights (exact resume needs save_every a multiple of mu). A prompt
example's packed length is G * (prompt + max_completion_tokens), so a
prompt batch's completions always fit one micro-batch.

Rollout statistics (rewards, lengths, generation time) are gathered over ranks once per
rollout and logged through the meter's host stats (train/meter.py `add_rollout`).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from slipstream import distributed as dist
from slipstream.data.rows import row_columns
from slipstream.data.vision import image_inputs, run_image_side
from slipstream.objectives.base import HookContext, OnlineObjective
from slipstream.objectives.grpo_config import GRPOSection
from slipstream.objectives.grpo_data import (
    PromptBatch,
    PromptExample,
    RolloutBatch,
    Sample,
    check_prompt_column,
    collate_rollouts,
    pack_sequences,
    split_to,
    tokenize_prompts,
)
from slipstream.objectives.grpo_loss import advantages, nanstd, token_losses
from slipstream.objectives.logps import token_logps


def rollout_seed(seed: int, index: int, position: int) -> int:
    """The sampling seed of prompt batch `position` among the step's (all ranks') in rollout
    `index` of a run seeded `seed` (train.seed): the same completions on any number of ranks."""
    return ((seed * 1_000_003 + index) * 65_537 + position) % (1 << 62)


def build_rewards(specs: list[dict]) -> Any:
    """The config's reward functions (slipstream/rewards)."""
    from slipstream.rewards import build_rewards as build

    return build(specs)


def completion_stats(lengths: list[int], truncated: list[bool]) -> dict[str, float]:
    """TRL's `completions/*` stats of a rollout (every rank's completions): lengths in tokens
    (the eos counted), `clipped_ratio` the share cut at the limit, and the lengths of those
    that ended (all 0 when none did, as TRL logs them)."""
    ended = [n for n, t in zip(lengths, truncated, strict=True) if not t] or [0]
    return {
        "completions/mean_length": sum(lengths) / len(lengths),
        "completions/min_length": float(min(lengths)),
        "completions/max_length": float(max(lengths)),
        "completions/clipped_ratio": sum(truncated) / len(truncated),
        "completions/mean_terminated_length": sum(ended) / len(ended),
        "completions/min_terminated_length": float(min(ended)),
        "completions/max_terminated_length": float(max(ended)),
    }


class GRPO(OnlineObjective):
    """The objective the trainer runs for train.objective = grpo."""

    name = "grpo"
    perplexity = False
    metric_names = ("clip_ratio/region_mean", "kl")
    section = GRPOSection  # its options (RLOO: its own section, the same machinery)

    def __init__(
        self, cfg: Any = None, *, rewards: Any = None, model_path: str | None = None,
        **options: Any,
    ) -> None:  # fmt: skip
        """From a RunConfig (the `grpo` section), or without one from keyword options named
        as the section's keys (tests, the Python API); `rewards` a RewardFunctions-like
        object (default: built from `grpo.rewards`); `model_path` (without a config): the
        checkpoint whose image processor reads prompts with images."""
        if cfg is not None:
            g, d, t = getattr(cfg, self.section.key), cfg.data, cfg.train
            self.budget = t.tokens_per_batch
            self.data_options = dict(overlong=d.overlong, strict=d.strict)
            self.full = cfg.train.finetune == "full"
            self.from_adapter = cfg.model.adapter is not None
            self.model_path = cfg.model.path
        else:
            g = self.section.from_options(type(self).__name__, options)
            self.budget = 1 << 30
            self.data_options = {}
            self.full = self.from_adapter = False
            self.model_path = model_path
        self.options = g
        self.G, self.mu, self.beta = g.num_generations, g.iterations_per_batch, g.beta
        self.epsilon = g.epsilon
        self.epsilon_high = g.epsilon_high if g.epsilon_high is not None else g.epsilon
        self.rewards = rewards if rewards is not None else build_rewards(g.rewards)
        self.reference = None  # attach(): a ReferencePolicy when beta > 0
        self.iterations = self.mu  # the loop draws prompts once per `iterations` steps
        self._cached: tuple[int, list[RolloutBatch]] | None = None

    def attach(self, ctx: HookContext, data: Any) -> None:
        """The KL reference (beta > 0), before any data-parallel wrapping."""
        from slipstream.objectives.reference import build_reference

        if self.beta > 0:
            self.reference = build_reference(
                ctx.model, full=self.full, reference=self.options.reference,
                from_adapter=self.from_adapter,
            )  # fmt: skip

    # -- data ---------------------------------------------------------------------------
    def tokenize(self, rows: Any, tokenizer: Any, first_row: int = 0) -> tuple[list, Any]:
        columns = row_columns(rows)
        check_prompt_column(columns)
        missing = sorted(set(getattr(self.rewards, "columns_needed", ())) - set(columns))
        if missing:
            raise ValueError(
                f"grpo.rewards read the column(s) {', '.join(missing)}, which the data lacks "
                f"(columns: {sorted(columns)})"
            )
        return tokenize_prompts(rows, tokenizer, max_prompt_tokens=self.options.max_prompt_tokens,
                                first_row=first_row, images=self._images(tokenizer),
                                **self.data_options)  # fmt: skip

    def _images(self, tokenizer: Any) -> Any:
        """The checkpoint's image side (None for a text model or without a path), built once."""
        if not hasattr(self, "_image_side"):
            self._image_side = run_image_side(self.model_path, tokenizer)
        return self._image_side

    def length(self, example: PromptExample) -> int:
        return self.G * (len(example.prompt_ids) + self.options.max_completion_tokens)

    def collate(self, examples: list[PromptExample]) -> Any:
        return PromptBatch(list(examples))

    def weight(self, batch: RolloutBatch) -> int:
        return batch.weight

    # -- rollout ------------------------------------------------------------------------
    def rollout(self, ctx: HookContext, step: int, prompt_batches: list[PromptBatch]):
        """-> (training micro-batches on the run's device, host stats of this rollout, or
        {} when the step reuses the last rollout (mu > 1))."""
        index = (step - 1) // self.mu
        if self._cached is not None and self._cached[0] == index:
            return self._cached[1], {}
        world, rank = ctx.world_size, ctx.rank
        seeds = [
            rollout_seed(ctx.seed, index, rank + world * k) for k in range(len(prompt_batches))
        ]
        batches, stats = self.generate_batches(ctx.model, ctx.tokenizer, prompt_batches, ctx.device,
                                               seeds=seeds)  # fmt: skip
        if self.mu > 1:  # kept for the rollout's next mu - 1 steps only
            self._cached = (index, batches)
        return batches, stats

    def generate_batches(self, model, tokenizer, prompt_batches, device, *, seeds: list[int]):
        """Generate (each prompt batch with its seed), score, pack (module docstring)."""
        g, G = self.options, self.G
        start = time.perf_counter()
        examples, rows, gen_s = self.sample(model, tokenizer, prompt_batches, device, seeds)
        completions = [r.token_ids for r in rows]
        rewards_SF = self.score(tokenizer, examples, completions)
        total_S = self.rewards.total(rewards_SF)  # NaN: every one None
        truncated = [r.finish_reason == "length" for r in rows]
        lengths = [len(c) for c in completions]
        gathered = dist.gather_objects((rewards_SF, total_S, lengths, truncated, gen_s))
        batch_std = None
        if g.scale_rewards == "batch":
            batch_std = float(nanstd(torch.cat([x[1] for x in gathered])))
        adv_S, _ = advantages(total_S, G, g.scale_rewards, batch_std)
        samples = [
            Sample(examples[i // G].prompt_ids, c, float(adv_S[i]),
                   truncated[i] and g.mask_truncated_completions, examples[i // G].image)
            for i, c in enumerate(completions)
        ]  # fmt: skip
        batches = self.pack(samples, prompt_batches, device)
        self.add_logps(model, batches)
        if torch.device(device).type == "cuda":  # the rollout's time includes its forwards
            torch.cuda.synchronize(device)
        rollout = self.rollout_stats(gathered)
        rollout["seconds"] = time.perf_counter() - start  # generation, rewards, log-probs
        return batches, rollout

    def sample(self, model, tokenizer, prompt_batches, device, seeds: list[int]):
        """(the prompt batches' examples, G completions of each, prompt-major, the seconds
        it took): each prompt batch sampled with its seed."""
        from slipstream.generation.sampling import Sampling

        examples = [ex for b in prompt_batches for ex in b.examples]
        sampling = Sampling(self.options.temperature, self.options.top_p)
        start = time.perf_counter()
        rows = []
        with dist.gathered_for_generation(model):  # FSDP2: no collective while decoding
            for b, seed in zip(prompt_batches, seeds, strict=True):
                generator = torch.Generator(device).manual_seed(seed)
                rows += self._complete(model, tokenizer, b.examples, sampling, self.G, generator)
        return examples, rows, time.perf_counter() - start

    def _complete(self, model, tokenizer, examples, sampling, per_prompt=1, generator=None):
        """`per_prompt` completions of each example's prompt (no log-probs: the policy's come
        from the packed forward), up to max_completion_tokens or a stop token."""
        from slipstream.generation import engine
        from slipstream.generation.api import stop_token_ids
        from slipstream.generation.images import packed_prompt_images

        prompts = [ex.prompt_ids for ex in examples]
        with_images = {i: ex.image for i, ex in enumerate(examples) if ex.image is not None}
        return engine.run(
            model, prompts, samples_per_prompt=per_prompt,
            max_new_tokens=self.options.max_completion_tokens, logprobs=False,
            sampling=sampling, stop_ids=stop_token_ids(tokenizer), generator=generator,
            max_positions=model.config.hf.get("max_position_embeddings"),
            images=packed_prompt_images(with_images, [len(p) for p in prompts]),
        )  # fmt: skip

    def score(self, tokenizer, examples: list[PromptExample], completions,
              per_prompt: int | None = None) -> torch.Tensor:  # fmt: skip
        """(S, F) rewards of the completions, `per_prompt` (default G) a prompt in order
        (TRL's reward-function arguments)."""
        G = per_prompt or self.G
        texts = [tokenizer.decode(c, skip_special_tokens=True) for c in completions]
        prompts = [examples[i // G].prompt for i in range(len(texts))]
        shown = [
            [{"role": "assistant", "content": t}] if isinstance(p, list) else t
            for p, t in zip(prompts, texts, strict=True)
        ]
        keys = {k for ex in examples for k in ex.columns}
        columns = {k: [examples[i // G].columns.get(k) for i in range(len(texts))] for k in keys}
        rows = [examples[i // G].row for i in range(len(texts))]
        return self.rewards(prompts, shown, columns, rows, completion_ids=list(completions))

    @torch.no_grad()
    def evaluate(self, ctx: HookContext, examples: list, batches: list[list[int]]) -> dict:
        """Held-out eval: the mean reward (total and per function) of one greedy completion
        per eval prompt, one eval batch of prompts at a time; under torchrun each rank its
        share, gathered. `loss` is minus the mean reward, so `train.save_best` keeps the
        best-reward weights."""
        from slipstream.generation.sampling import Sampling

        model, tokenizer = ctx.model, ctx.tokenizer
        parts = [torch.zeros(0, len(self.rewards.names))]
        # Ranks may hold one eval batch more than others: FSDP2 gathers once around them all.
        with dist.gathered_for_generation(model):
            for batch in batches[ctx.rank :: ctx.world_size]:
                prompts = [examples[i] for i in batch]
                rows = self._complete(model, tokenizer, prompts, Sampling(0.0))
                parts.append(self.score(tokenizer, prompts, [r.token_ids for r in rows], 1))
        r_SF = torch.cat([r for rank in dist.gather_objects(parts) for r in rank])
        reward = float(self.rewards.total(r_SF).nanmean())
        per_function = {
            f"rewards/{name}/mean": float(r_SF[:, f].nanmean())
            for f, name in enumerate(self.rewards.names)
        }
        return {"loss": -reward, "reward": reward, **per_function}

    def pack(self, samples: list[Sample], prompt_batches: list[PromptBatch], device) -> list:
        G, n = self.G, 0
        fallback = []
        for b in prompt_batches:  # their own grouping fits by construction
            fallback.append(list(range(n, n + G * len(b.examples))))
            n += G * len(b.examples)
        bins = pack_sequences([len(s) for s in samples], self.budget, fallback)
        if dist.world_size() > 1:  # every rank the same number of micro-batches
            bins = split_to(bins, max(dist.gather_objects(len(bins))))
        return [self.collate_samples(samples, b).to(device) for b in bins]

    def collate_samples(self, samples: list[Sample], indices: list[int]) -> RolloutBatch:
        """One micro-batch of the rollout's completions `indices` (host tensors)."""
        g = self.options
        return collate_rollouts([samples[i] for i in indices], g.loss_type,
                                g.max_completion_tokens)  # fmt: skip

    def needs_old_logps(self) -> bool:
        """The policy's log-probs are kept from rollout time (mu > 1: the ratio's base)."""
        return self.mu > 1

    @torch.no_grad()
    def add_logps(self, model, batches: list[RolloutBatch]) -> None:
        """Old log-probs (`needs_old_logps`) and the reference's (beta > 0), on the device."""
        T = self.options.temperature
        if self.needs_old_logps():
            was_training = model.training
            model.eval()
            for b in batches:
                b.old_logps = self.token_logps(model, b, T)
            model.train(was_training)
        if self.reference is not None:
            with self.reference.active() as ref:
                for b in batches:
                    b.ref_logps = self.token_logps(ref, b, T)

    @staticmethod
    def token_logps(model, b: RolloutBatch, temperature: float) -> torch.Tensor:
        """(N,) log-probs of the batch's scored tokens; its prompts' images, if any, through
        the tower once a prompt (grpo_data.sample_images)."""
        return token_logps(model, b.input_ids, b.labels, b.seq, b.positions, temperature,
                           images=image_inputs(b.packed.fields))  # fmt: skip

    def rollout_stats(self, gathered: list) -> dict[str, Any]:
        """Host stats over every rank's completions (TRL's metric names where it has one)."""
        r_SF = torch.cat([x[0] for x in gathered])
        total_S = torch.cat([x[1] for x in gathered])
        lengths = [n for x in gathered for n in x[2]]
        truncated = [t for x in gathered for t in x[3]]
        gen_s = max(x[4] for x in gathered)  # the step waits for the slowest rank
        _, zero_S = advantages(total_S, self.G, "group")
        stats = {
            "reward": float(total_S.nanmean()),
            "reward_std": float(nanstd(total_S)),
            "frac_reward_zero_std": float(zero_S.float().mean()),
            **completion_stats(lengths, truncated),
            "gen_time_s": gen_s,
            "gen_tokens_per_s": sum(lengths) / max(gen_s, 1e-9),
        }
        for f, name in enumerate(self.rewards.names):
            stats[f"rewards/{name}/mean"] = float(r_SF[:, f].nanmean())
            stats[f"rewards/{name}/std"] = float(nanstd(r_SF[:, f]))
        return {"stats": stats}

    # -- loss ---------------------------------------------------------------------------
    def micro_batch_loss(
        self, model: torch.nn.Module, batch: RolloutBatch
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The clipped surrogate summed with the loss type's per-token scales, and metric
        sums: `clip_ratio/region_mean` and `kl` (beta > 0) as token means times the batch's
        weight (device tensors, no host sync)."""
        b, T = batch, self.options.temperature
        logps_N = self.token_logps(model, b, T)
        old_N = b.old_logps if b.old_logps is not None else logps_N.detach()
        loss_N, clipped_N, kl_N = token_losses(
            logps_N, old_N, b.advantages, epsilon=self.epsilon, epsilon_high=self.epsilon_high,
            beta=self.beta, ref_N=b.ref_logps,
        )  # fmt: skip
        loss = (loss_N * b.scales).sum()
        metrics = {"clip_ratio/region_mean": (clipped_N * b.mask).sum() * b.metric_scale}
        if kl_N is not None:
            metrics["kl"] = (kl_N.detach() * b.mask).sum() * b.metric_scale
        return loss, metrics
