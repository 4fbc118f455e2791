"""RLOO (REINFORCE leave-one-out; Ahmadian et al. 2024), as TRL 1.16's `RLOOTrainer`: GRPO's
rollout machinery (objectives/grpo.py: the same generation, seeding, reward functions,
packing, mu and resume rules; the `rloo` section, objectives/rloo_config.py) with RLOO's
formulas (objectives/rloo_loss.py).

A rollout: G completions per prompt, scored; packed by real length; then, with beta > 0,
the policy's log-probs at rollout time (`old`) and the reference's, per completion summed to
sum_t (old_t - ref_t), the KL penalty taken off the reward; leave-one-out advantages over
each group (a group is on one rank), normalised over every rank's completions when asked;
each micro-batch gets its completions' advantages on the device.

The loss is per completion: the sequence-level ratio exp(sum_t logp_t - sum_t old_t),
clipped, times the advantage, the mean over completions (weight = completions). Token
log-probs come from the packed forward through the chunked head and are summed per
completion by host-built segment ids (no sync). A truncated completion with
`mask_truncated_completions` scores no tokens (its sums are 0, as TRL's masked ones).
Metrics: TRL's clip_ratio/low_mean, high_mean, region_mean (per completion) and `entropy`
(the policy's, a token mean over the unmasked completion tokens, from the same chunks of
logits as the log-probs); the rollout adds `kl` (the token mean of old - ref, beta > 0).

Prompts with images: as GRPO's (objectives/grpo_data.py), the tower once a prompt a micro-batch.

Shapes: N scored tokens, S completions of a micro-batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from slipstream import distributed as dist
from slipstream.data.packed import PackedBuilder, PackedView, packed_field
from slipstream.data.vision import build_with_images, image_inputs
from slipstream.objectives.grpo import GRPO
from slipstream.objectives.grpo_data import Sample, sample_images
from slipstream.objectives.logps import segment_sums
from slipstream.objectives.rloo_config import RLOOSection
from slipstream.objectives.rloo_loss import leave_one_out, normalise, sequence_losses


@dataclass(eq=False)
class RLOOBatch(PackedView):
    """S packed prompt+completion sequences; per scored token its completion (`segments`)
    and `mask`; per completion its `advantages` (set after the rollout's log-probs) and
    `sample` (its index in the rollout). Device, set later: `old_logps`, `ref_logps`."""

    num_sequences: int
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None

    segments = packed_field("segments")
    mask = packed_field("mask")
    sample = packed_field("sample")
    advantages = packed_field("advantages")

    @property
    def weight(self) -> int:
        return self.num_sequences


def collate_samples(samples: list[Sample], indices: list[int]) -> RLOOBatch:
    """Pack the rollout's completions `indices` into one RLOOBatch (host tensors)."""
    builder = PackedBuilder(
        segments=("scored", torch.int64), mask=("scored", torch.float32),
        sample=("sequence", torch.int64), advantages=("sequence", torch.float32),
    )  # fmt: skip
    for k, i in enumerate(indices):
        s = samples[i]
        full = s.prompt_ids + s.completion_ids  # only the completion's tokens are scored
        builder.add(full, [(len(s.prompt_ids), len(full))], segments=k,
                    mask=0.0 if s.masked else 1.0, sample=i, advantages=0.0)  # fmt: skip
    # A prompt's images once (grpo_data.sample_images).
    packed = build_with_images(builder, *sample_images([samples[i] for i in indices]))
    return RLOOBatch(packed, len(indices))


class RLOO(GRPO):
    """The objective the trainer runs for train.objective = rloo."""

    name = "rloo"
    section = RLOOSection
    metric_names = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                    "entropy", "entropy/tokens")  # fmt: skip

    def collate_samples(self, samples: list[Sample], indices: list[int]) -> RLOOBatch:
        return collate_samples(samples, indices)

    def needs_old_logps(self) -> bool:
        return self.mu > 1 or self.beta > 0  # the KL penalty needs them at rollout time

    def generate_batches(self, model, tokenizer, prompt_batches, device, *, seeds: list[int]):
        """Generate, score, pack, log-probs, then the advantages (module docstring)."""
        g, G = self.options, self.G
        start = time.perf_counter()
        examples, rows, gen_s = self.sample(model, tokenizer, prompt_batches, device, seeds)
        completions = [r.token_ids for r in rows]
        rewards_SF = self.score(tokenizer, examples, completions)
        total_S = self.rewards.total(rewards_SF)  # NaN: every one None
        truncated = [r.finish_reason == "length" for r in rows]
        masked = [t and g.mask_truncated_completions for t in truncated]
        samples = [Sample(examples[i // G].prompt_ids, c, 0.0, masked[i], examples[i // G].image)
                   for i, c in enumerate(completions)]  # fmt: skip
        batches = self.pack(samples, prompt_batches, device)
        self.add_logps(model, batches)
        kl_S, kl_tokens = self.sequence_kl(batches, len(samples))
        adv_S = leave_one_out(total_S - self.beta * kl_S, G)
        lengths = [len(c) for c in completions]
        gathered = dist.gather_objects(
            (rewards_SF, total_S, lengths, truncated, gen_s, adv_S, kl_tokens)
        )
        if g.normalize_advantages:
            adv_S = normalise(adv_S, torch.cat([x[5] for x in gathered]))
        adv_S = torch.nan_to_num(adv_S, nan=0.0).to(device)
        for b in batches:
            b.packed.fields["advantages"] = adv_S.index_select(0, b.sample)
        if torch.device(device).type == "cuda":  # the rollout's time includes its forwards
            torch.cuda.synchronize(device)
        rollout = self.rollout_stats(gathered)
        if self.beta > 0:
            kl_sum, count = (sum(x[6][i] for x in gathered) for i in (0, 1))
            rollout["stats"]["kl"] = kl_sum / max(count, 1)
        rollout["seconds"] = time.perf_counter() - start
        return batches, rollout

    @torch.no_grad()
    def sequence_kl(self, batches: list[RLOOBatch], S: int) -> tuple[torch.Tensor, tuple]:
        """(per completion sum_t (old_t - ref_t) on the host, (S,) in rollout order; (its
        token sum, unmasked tokens) for the `kl` stat). Zeros without a KL penalty."""
        kl_S = torch.zeros(S)
        if self.beta == 0:
            return kl_S, (0.0, 0)
        total, count = 0.0, 0
        for b in batches:
            per_N = (b.old_logps - b.ref_logps) * b.mask
            seq = segment_sums(per_N, b.segments, b.num_sequences).cpu()
            kl_S[b.sample.cpu()] = seq
            total += float(seq.sum())
            count += int(b.mask.sum())
        return kl_S, (total, count)

    def micro_batch_loss(
        self, model: torch.nn.Module, batch: RLOOBatch
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The clipped sequence-level surrogate summed over the completions, and the clip
        counts (per completion; the meter divides by the completions)."""
        b, S = batch, batch.num_sequences
        images = image_inputs(b.packed.fields)
        nll_N, parts = model.loss(
            b.input_ids, b.labels, b.seq, reduction="none", label_positions=b.positions,
            temperature=self.options.temperature, return_parts=True,
            **({"images": images} if images else {}),
        )  # fmt: skip
        logps_S = segment_sums(-nll_N * b.mask, b.segments, S)
        old_S = (
            segment_sums(b.old_logps * b.mask, b.segments, S)
            if b.old_logps is not None
            else logps_S.detach()
        )
        loss_S, low_S, high_S = sequence_losses(
            logps_S, old_S, b.advantages, epsilon=self.epsilon, epsilon_high=self.epsilon_high
        )
        metrics = {
            "clip_ratio/low_mean": low_S.sum(),
            "clip_ratio/high_mean": high_S.sum(),
            "clip_ratio/region_mean": torch.maximum(low_S, high_S).sum(),
            "entropy": (parts["entropy"] * b.mask).sum(),  # a token mean: see report()
            "entropy/tokens": b.mask.sum(),
        }
        return loss_S.sum(), metrics

    def report(self, sums: dict[str, float], weight: float) -> dict[str, float]:
        """Per completion, but `entropy` TRL's token mean over the unmasked completion tokens."""
        out = {k: v / max(weight, 1) for k, v in sums.items() if not k.startswith("entropy")}
        if "entropy" in sums:
            out["entropy"] = sums["entropy"] / max(sums["entropy/tokens"], 1)
        return out
