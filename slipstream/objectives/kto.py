"""KTO (`train.objective: kto`): Kahneman-Tversky optimisation on unpaired preference data,
with the numbers TRL 1.16's `KTOTrainer` gives (data and the KL pairs: kto_data.py).

Per example i, with s_i its summed completion log-prob under the policy, ref_i under the
reference, lr_i = s_i - ref_i, beta, the weights w_d / w_u (`kto.desirable_weight`,
`undesirable_weight`) and the micro-batch's KL estimate
    z = max(0, mean_i (s'_i - ref'_i))   (s', ref': the KL sequences' log-probs, no gradient)
- loss_type kto: desirable  w_d * (1 - sigmoid(beta * (lr_i - z))),
                 undesirable w_u * (1 - sigmoid(beta * (z - lr_i)));
- apo_zero_unpaired: desirable w_d * (1 - sigmoid(beta lr_i)), undesirable w_u *
  sigmoid(beta lr_i), and no KL sequences.
TRL averages these over the micro-batch's examples; the trainer here normalises by examples
(`weight`), so one micro-batch gives TRL's loss exactly and grad-accum and data parallelism
give the mean over the step's examples. z is each micro-batch's own, as TRL computes it
per batch; TRL also averages z over ranks (a collective in every step), which this does
not: 2 ranks give what one process gives with the same micro-batches.

Metrics, TRL's names: `kl` (the mean of the micro-batches' z), `rewards/chosen`,
`rewards/rejected` (beta * lr, means over desirable / undesirable examples), their
difference `rewards/margins`, `logps/chosen`, `logps/rejected` (summed completion log-probs,
the same means), `count/desirable` (the share of desirable examples), `entropy` (the
policy's, a token mean over the completion tokens) and `logits/chosen`, `logits/rejected`
(the mean logit over the vocabulary, token means over each class's completion tokens), both
from the same chunks of logits as the policy's log-probs (ops/loss.py, `with_stats`).

Forwards per micro-batch: the policy on the examples (with gradient); the policy on the KL
sequences and the reference on both (no gradient). The reference with LoRA is the same model
(objectives/reference.py): the starting adapter frozen, or the base. With images
(kto_data.py) each forward passes its stream's image inputs; the tower runs once a prompt in
each of the four forwards.
"""

from __future__ import annotations

from typing import Any

import torch

from slipstream.data.vision import run_image_side
from slipstream.objectives.base import Objective
from slipstream.objectives.kto_data import KTOExample, collate_kto, tokenize_kto
from slipstream.objectives.logps import segment_sums, token_logps
from slipstream.objectives.reference import build_reference

LOSS_TYPES = ("kto", "apo_zero_unpaired")


def kto_losses(
    logps_N: torch.Tensor,
    ref_logps_N: torch.Tensor,
    desirable_N: torch.Tensor,
    kl: torch.Tensor,
    *,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    loss_type: str = "kto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_N, rewards_N = beta * log-ratio, detached); `desirable_N` 1.0 / 0.0."""
    lr = logps_N - ref_logps_N
    if loss_type == "kto":
        chosen = 1 - torch.sigmoid(beta * (lr - kl))
        rejected = 1 - torch.sigmoid(beta * (kl - lr))
    elif loss_type == "apo_zero_unpaired":
        chosen = 1 - torch.sigmoid(beta * lr)
        rejected = torch.sigmoid(beta * lr)
    else:
        raise ValueError(f"kto.loss_type = {loss_type!r}; use {' or '.join(LOSS_TYPES)}")
    loss = torch.where(desirable_N > 0, desirable_weight * chosen, undesirable_weight * rejected)
    return loss, beta * lr.detach()


def kl_estimate(kl_logps_N: torch.Tensor, ref_kl_logps_N: torch.Tensor) -> torch.Tensor:
    """TRL's z: the mean log-ratio of the mismatched sequences, detached, at least 0."""
    return (kl_logps_N - ref_kl_logps_N).mean().detach().clamp(min=0)


class KTO(Objective):
    """The objective the trainer runs for train.objective = kto."""

    name = "kto"
    perplexity = False
    metric_names = ("kl", "rewards/chosen", "rewards/rejected", "logps/chosen",
                    "logps/rejected", "count/desirable", "entropy", "logits/chosen",
                    "logits/rejected", "tokens/chosen", "tokens/rejected")  # fmt: skip

    def __init__(self, cfg: Any = None, **options: Any) -> None:
        """From a RunConfig (the `kto` section, data options) or keyword options (beta,
        desirable_weight, undesirable_weight, loss_type, max_tokens, overlong)."""
        self.reference = None  # set by attach(): a ReferencePolicy
        self.full = self.from_adapter = False
        self.model_path = options.get("model_path")  # its image side reads image rows
        if cfg is None:
            k = options
            self.max_tokens = options.get("max_tokens", 1 << 30)
            self.data_options: dict[str, Any] = {
                "max_tokens": self.max_tokens, "overlong": options.get("overlong", "drop"),
            }  # fmt: skip
        else:
            d, t, k = cfg.data, cfg.train, cfg.kto.model_dump()
            self.max_tokens = min(d.max_tokens or t.tokens_per_batch // 2, t.tokens_per_batch // 2)
            self.data_options = dict(max_tokens=self.max_tokens, overlong=d.overlong,
                                     strict=d.strict)  # fmt: skip
            self.full = cfg.train.finetune == "full"
            self.from_adapter = cfg.model.adapter is not None
            self.model_path = cfg.model.path
        self.beta = k.get("beta", 0.1)
        self.desirable_weight = k.get("desirable_weight", 1.0)
        self.undesirable_weight = k.get("undesirable_weight", 1.0)
        self.loss_type = k.get("loss_type", "kto")
        self.reference_kind = k.get("reference", "start")
        self.with_kl = self.loss_type != "apo_zero_unpaired"

    def attach(self, ctx: Any, data: Any) -> None:
        """The reference policy, before any data-parallel wrapping."""
        self.reference = build_reference(ctx.model, full=self.full, reference=self.reference_kind,
                                         from_adapter=self.from_adapter)  # fmt: skip

    # -- data ---------------------------------------------------------------------------
    def tokenize(self, rows: Any, tokenizer: Any, first_row: int = 0) -> tuple[list, Any]:
        if not hasattr(self, "_image_side"):  # the checkpoint's (None for a text model), once
            self._image_side = run_image_side(self.model_path, tokenizer)
        return tokenize_kto(rows, tokenizer, first_row=first_row, images=self._image_side,
                            **self.data_options)  # fmt: skip

    def length(self, example: KTOExample) -> int:
        return 2 * len(example) if self.with_kl else len(example)  # + its share of KL tokens

    def collate(self, examples: list[KTOExample]) -> Any:
        return collate_kto(examples, with_kl=self.with_kl, max_tokens=self.max_tokens)

    def weight(self, batch: Any) -> int:
        return batch.num_examples

    # -- loss ---------------------------------------------------------------------------
    @staticmethod
    def sequence_logps(model: torch.nn.Module, stream: Any, n: int) -> torch.Tensor:
        """(n,) summed completion log-probs of a stream's sequences."""
        tok = token_logps(model, stream.input_ids, stream.labels, stream.seq, stream.positions,
                          images=stream.images)  # fmt: skip
        return segment_sums(tok, stream.segments, n)

    def micro_batch_loss(
        self, model: torch.nn.Module, batch: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss summed over the batch's examples and metric sums (device tensors, no sync)."""
        if self.reference is None:
            raise RuntimeError("KTO needs a reference policy: call attach() first")
        n, main = batch.num_examples, batch.main
        images = {"images": main.images} if main.images is not None else {}
        nll_N, stats = model.loss(
            main.input_ids, main.labels, main.seq, reduction="none",
            label_positions=main.positions, return_parts=True, **images,
        )  # fmt: skip
        logps = segment_sums(-nll_N, main.segments, n)
        kl = torch.zeros((), device=logps.device)
        with self.reference.active() as ref_model:
            ref_logps = self.sequence_logps(ref_model, batch.main, n)
            if self.with_kl:
                ref_kl = self.sequence_logps(ref_model, batch.kl, n)
        if self.with_kl:
            with torch.no_grad():  # the policy stays in its mode (TRL's no_grad forward)
                kl = kl_estimate(self.sequence_logps(model, batch.kl, n), ref_kl)
        loss_N, rewards = kto_losses(
            logps, ref_logps, batch.desirable, kl, beta=self.beta, loss_type=self.loss_type,
            desirable_weight=self.desirable_weight, undesirable_weight=self.undesirable_weight,
        )  # fmt: skip
        d, shown = batch.desirable, logps.detach()
        u = 1 - d
        d_N = d.index_select(0, main.segments)  # per scored token: its example's class
        return loss_N.sum(), {
            "entropy": stats["entropy"].sum(),
            "logits/chosen": (stats["mean_logit"] * d_N).sum(),
            "logits/rejected": (stats["mean_logit"] * (1 - d_N)).sum(),
            "tokens/chosen": d_N.sum(),
            "tokens/rejected": (1 - d_N).sum(),
            "kl": kl * n,
            "rewards/chosen": (rewards * d).sum(),
            "rewards/rejected": (rewards * u).sum(),
            "logps/chosen": (shown * d).sum(),
            "logps/rejected": (shown * u).sum(),
            "count/desirable": d.sum(),
        }

    def report(self, sums: dict[str, float], weight: float) -> dict[str, float]:
        """Logged values from an interval's sums: per-class means, their margin, kl's mean."""
        chosen = sums["count/desirable"]
        rejected = weight - chosen
        out = {"kl": sums["kl"] / max(weight, 1), "count/desirable": chosen / max(weight, 1)}
        for side, count in (("chosen", chosen), ("rejected", rejected)):
            for what in ("rewards", "logps"):
                if count > 0:
                    out[f"{what}/{side}"] = sums[f"{what}/{side}"] / count
        if chosen > 0 and rejected > 0:
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        tokens = {side: sums.get(f"tokens/{side}", 0) for side in ("chosen", "rejected")}
        if "entropy" in sums:  # token means (TRL's)
            out["entropy"] = sums["entropy"] / max(sum(tokens.values()), 1)
        for side, count in tokens.items():
            if count > 0:
                out[f"logits/{side}"] = sums[f"logits/{side}"] / count
        return out
