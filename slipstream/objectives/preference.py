"""Preference objectives on packed pairs: DPO (sigmoid, IPO, hinge), ORPO and SimPO, with
the numbers TRL 1.16 gives (`DPOTrainer`; `ORPOTrainer` and `CPOTrainer(loss_type="simpo",
cpo_alpha=0)` in `trl.experimental`).

Per pair i, with s = summed completion log-prob, n = completion tokens, a = s / n (average),
ref = the reference policy's s, beta, gamma and eps = label_smoothing from the config:
- DPO: c = s_c - ref_c, r = s_r - ref_r (log-ratios), delta = c - r, rewards beta*c, beta*r;
  sigmoid: -(1-eps) logsigmoid(beta delta) - eps logsigmoid(-beta delta) (eps > 0 is
  conservative DPO; TRL 1.16's sigmoid has no eps, so eps = 0 is its loss);
  ipo: (c/n_c - r/n_r - 1/(2 beta))^2 (TRL's per-token IPO); hinge: relu(1 - beta delta).
- SimPO: z = a_c - a_r - gamma/beta; -(1-eps) logsigmoid(beta z) - eps logsigmoid(-beta z);
  rewards beta*a; no reference.
- ORPO: log-odds o = (a_c - a_r) - (log(1-e^a_c) - log(1-e^a_r)); per pair -beta logsigmoid(o),
  plus the chosen sequences' NLL over *every* token, prompt included (as TRL's ORPOTrainer;
  with images, an image's own tokens are left out: they are never targets, and TRL's ORPO
  reads no images), token-averaged over the micro-batch; rewards beta*a; no reference.

The trainer normalises by pairs (`weight`): a micro-batch returns the sum over its pairs, so
grad-accum and torchrun equal one big batch for DPO and SimPO exactly; ORPO's NLL term enters
each micro-batch as its token mean times its pairs (one micro-batch: exactly TRL's).
Code: `PairObjective` holds what the five share (pairs packed chosen then rejected, the
summed log-probs of each sequence, the reference policy, the metrics); `DPO`, `IPO`,
`DPOHinge`, `SimPO` and `ORPO` each add only their loss (`pair_loss`). `train.objective=dpo`
builds the one `preference.loss_type` names (`dpo(cfg)`); `pair_objective(name, **options)`
builds one without a run config.

Metrics (TRL's names, summed over pairs; the trainer divides by pairs): `rewards/chosen`,
`rewards/rejected`, `rewards/margins`, `rewards/accuracies`, `logps/chosen`, `logps/rejected`
(summed log-probs for DPO, averages for SimPO and ORPO, as TRL reports them); ORPO adds
`nll_loss`, `log_odds_ratio`, `log_odds_chosen`.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from slipstream.data.rows import row_columns
from slipstream.data.vision import image_inputs, run_image_side
from slipstream.objectives.base import HookContext, Objective
from slipstream.objectives.logps import segment_sums, token_logps
from slipstream.objectives.pairs import PairExample, check_pair_columns, collate_pairs
from slipstream.objectives.preference_config import PreferenceSection
from slipstream.objectives.reference import adapters_disabled, build_reference

REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                  "logps/chosen", "logps/rejected")  # fmt: skip


def sigmoid_loss(delta_P: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """-(1-eps) logsigmoid(beta delta) - eps logsigmoid(-beta delta): DPO's and SimPO's."""
    loss = -F.logsigmoid(beta * delta_P) * (1 - label_smoothing)
    if label_smoothing:
        loss = loss - F.logsigmoid(-beta * delta_P) * label_smoothing
    return loss


def ipo_loss(
    c_P: torch.Tensor, r_P: torch.Tensor, c_tokens_P: torch.Tensor, r_tokens_P: torch.Tensor,
    beta: float,
) -> torch.Tensor:  # fmt: skip
    """(c/n_c - r/n_r - 1/(2 beta))^2 from the log-ratios (TRL's per-token IPO)."""
    per_token = c_P / c_tokens_P.clamp(min=1) - r_P / r_tokens_P.clamp(min=1)
    return (per_token - 1 / (2 * beta)) ** 2


def hinge_loss(delta_P: torch.Tensor, beta: float) -> torch.Tensor:
    return torch.relu(1 - beta * delta_P)


def dpo_losses(
    chosen_P: torch.Tensor,
    rejected_P: torch.Tensor,
    ref_chosen_P: torch.Tensor,
    ref_rejected_P: torch.Tensor,
    *,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_tokens_P: torch.Tensor | None = None,
    rejected_tokens_P: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss_P, chosen rewards_P, rejected rewards_P) from summed log-probs (module
    docstring): the functional form of DPO's three losses."""
    c, r = chosen_P - ref_chosen_P, rejected_P - ref_rejected_P
    if loss_type == "sigmoid":
        loss = sigmoid_loss(c - r, beta, label_smoothing)
    elif loss_type == "ipo":
        if chosen_tokens_P is None or rejected_tokens_P is None:
            raise ValueError("ipo needs the completion token counts")
        loss = ipo_loss(c, r, chosen_tokens_P, rejected_tokens_P, beta)
    elif loss_type == "hinge":
        loss = hinge_loss(c - r, beta)
    else:
        raise ValueError(f"preference.loss_type = {loss_type!r}; use sigmoid, ipo or hinge")
    return loss, beta * c.detach(), beta * r.detach()


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate on both sides of -log 2."""
    below = x < -0.6931471805599453
    return torch.where(below, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_log_odds(chosen_avg_P: torch.Tensor, rejected_avg_P: torch.Tensor) -> torch.Tensor:
    """o = (a_c - a_r) - (log(1 - e^a_c) - log(1 - e^a_r)), from average log-probs."""
    a_c, a_r = chosen_avg_P.float(), rejected_avg_P.float()
    return (a_c - a_r) - (log1mexp(a_c) - log1mexp(a_r))


@dataclass
class PairScores:
    """One micro-batch's log-probs, a row per pair (columns: chosen, rejected)."""

    sums_CR: torch.Tensor  # (P, 2) summed completion log-probs
    tokens_CR: torch.Tensor  # (P, 2) completion tokens
    prompt_P: torch.Tensor  # (P,) chosen prompts' summed log-probs (scored for ORPO only)
    chosen_tokens: int  # host: every chosen token, prompts included (ORPO's NLL)

    @property
    def averages_CR(self) -> torch.Tensor:
        return self.sums_CR / self.tokens_CR.clamp(min=1)


class PairObjective(Objective):
    """What the pair objectives share; a subclass sets its name and class flags and adds its
    loss. `pair_loss(z_CR, scores)` gets z: the log-prob each pair's loss compares, the
    completion's sum minus the reference's with one (DPO's log-ratios), else its average
    (SimPO, ORPO); rewards are beta * z, and the `logps/*` metrics the log-probs before the
    reference's are taken off."""

    name: ClassVar[str]
    perplexity = False
    metric_names: ClassVar[tuple[str, ...]] = REWARD_METRICS
    uses_reference: ClassVar[bool] = False  # DPO's family: log-ratios to a reference policy
    averaged: ClassVar[bool] = False  # z of average log-probs (SimPO, ORPO), else sums
    scores_prompt: ClassVar[bool] = False  # ORPO: the chosen prompts' tokens are scored too

    def __init__(self, cfg: Any = None, **options: Any) -> None:
        """From a RunConfig (the `preference` section, data options), or, without one,
        from keyword options named as the section's keys."""
        self.reference = None  # set by attach(): a ReferencePolicy, or None (precomputed)
        if cfg is None:
            p = PreferenceSection.from_options(type(self).__name__, options)
            self.data_options: dict[str, Any] = {"max_tokens": 1 << 30}
            self.full = self.from_adapter = False
            self.model_path = None
        else:
            p, d, t = cfg.preference, cfg.data, cfg.train
            # Each sequence of a pair within max_tokens; both together within the batch budget.
            self.data_options = dict(
                max_tokens=min(d.max_tokens or t.tokens_per_batch // 2, t.tokens_per_batch // 2),
                overlong=d.overlong, strict=d.strict,
            )  # fmt: skip
            self.full = cfg.train.finetune == "full"
            self.from_adapter = cfg.model.adapter is not None
            self.model_path = cfg.model.path
        self.options = p
        self.beta, self.label_smoothing, self.gamma = p.beta, p.label_smoothing, p.simpo_gamma

    def attach(self, ctx: HookContext, data: Any) -> None:
        """Before training (and before any data-parallel wrapping): DPO's reference policy
        (objectives/reference.py), or its log-probs precomputed once for every pair."""
        if not self.uses_reference:
            return
        p, full, from_adapter, model = self.options, self.full, self.from_adapter, ctx.model
        if not p.precompute_reference:
            self.reference = build_reference(
                model, full=full, reference=p.reference, from_adapter=from_adapter
            )
            return
        base = not full and (p.reference == "base" or not from_adapter)
        was_training = model.training
        model.eval()
        with torch.no_grad(), adapters_disabled(model) if base else nullcontext():
            for examples, batches in ((data.train, data.train_batches),
                                      (data.eval, data.eval_batches)):  # fmt: skip
                for indices in batches:
                    pairs = [examples[i] for i in indices]
                    batch = collate_pairs(pairs).to(ctx.device)
                    logps = self.sequence_logps(model, batch)[: 2 * len(pairs)].tolist()
                    for k, ex in enumerate(pairs):  # one host read per batch, before training
                        ex.ref = (logps[2 * k], logps[2 * k + 1])
        model.train(was_training)
        self.reference = None

    # -- data ---------------------------------------------------------------------------
    def tokenize(self, rows: Any, tokenizer: Any, first_row: int = 0) -> tuple[list, Any]:
        from slipstream.objectives.pairs import tokenize_pairs

        columns = row_columns(rows)
        check_pair_columns(columns, self.name)
        images = self._images(tokenizer)
        return tokenize_pairs(
            rows, tokenizer, first_row=first_row, images=images, **self.data_options
        )

    def _images(self, tokenizer: Any) -> Any:
        """The checkpoint's image side (None for a text model), built once."""
        if not hasattr(self, "_image_side"):
            self._image_side = run_image_side(self.model_path, tokenizer)
        return self._image_side

    def length(self, example: PairExample) -> int:
        return len(example)

    def collate(self, examples: list[PairExample]) -> Any:
        ref = None
        if self.uses_reference and all(ex.ref is not None for ex in examples):
            ref = [ex.ref for ex in examples]
        return collate_pairs(examples, score_prompt=self.scores_prompt, ref_logps=ref)

    def weight(self, batch: Any) -> int:
        return batch.num_pairs

    # -- loss ---------------------------------------------------------------------------
    def sequence_logps(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """(3P,) summed log-probs: completion of each sequence (2P), then each pair's
        chosen prompt (P; scored for ORPO only). Pairs with images: the tower runs once a
        pair (objectives/pairs.py)."""
        images = image_inputs(batch.packed.fields)
        tok_N = token_logps(model, batch.input_ids, batch.labels, batch.seq, batch.positions,
                            images=images)  # fmt: skip
        return segment_sums(tok_N, batch.segments, 3 * batch.num_pairs)

    def reference_logps(self, batch: Any) -> torch.Tensor:
        """(2P,) the reference policy's summed completion log-probs (chosen, rejected, ...)."""
        if batch.ref_logps is not None:
            return batch.ref_logps
        if self.reference is None:
            raise RuntimeError("DPO needs a reference policy: call attach(ctx, data) first")
        with self.reference.active() as ref_model:
            return self.sequence_logps(ref_model, batch)[: 2 * batch.num_pairs]

    def pair_loss(
        self, z_CR: torch.Tensor, scores: PairScores
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the loss summed over the pairs, extra metric sums): the subclass's formula."""
        raise NotImplementedError

    def micro_batch_loss(
        self, model: torch.nn.Module, batch: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss summed over the batch's pairs and metric sums (device tensors, no sync)."""
        P = batch.num_pairs
        ref_CR = self.reference_logps(batch).view(P, 2) if self.uses_reference else None
        seg = self.sequence_logps(model, batch)
        scores = PairScores(seg[: 2 * P].view(P, 2), batch.completion_tokens.view(P, 2),
                            seg[2 * P :], batch.num_chosen_tokens)  # fmt: skip
        shown_CR = scores.averages_CR if self.averaged else scores.sums_CR
        z_CR = shown_CR - ref_CR if ref_CR is not None else shown_CR
        loss, metrics = self.pair_loss(z_CR, scores)
        rc, rr = self.beta * z_CR[:, 0].detach(), self.beta * z_CR[:, 1].detach()
        metrics.update(
            {
                "rewards/chosen": rc.sum(),
                "rewards/rejected": rr.sum(),
                "rewards/margins": (rc - rr).sum(),
                "rewards/accuracies": (rc > rr).float().sum(),
                "logps/chosen": shown_CR[:, 0].detach().sum(),
                "logps/rejected": shown_CR[:, 1].detach().sum(),
            }
        )
        return loss, metrics


class DPO(PairObjective):
    """DPO's sigmoid loss on the log-ratios (label_smoothing > 0: conservative DPO)."""

    name = "dpo"
    uses_reference = True

    def pair_loss(self, z_CR, scores):
        return sigmoid_loss(z_CR[:, 0] - z_CR[:, 1], self.beta, self.label_smoothing).sum(), {}


class IPO(PairObjective):
    """preference.loss_type=ipo: the per-token log-ratio margin regressed to 1 / (2 beta)."""

    name = "dpo"
    uses_reference = True

    def pair_loss(self, z_CR, scores):
        tokens_CR = scores.tokens_CR
        return ipo_loss(
            z_CR[:, 0], z_CR[:, 1], tokens_CR[:, 0], tokens_CR[:, 1], self.beta
        ).sum(), {}


class DPOHinge(PairObjective):
    """preference.loss_type=hinge: relu(1 - beta * the log-ratio margin)."""

    name = "dpo"
    uses_reference = True

    def pair_loss(self, z_CR, scores):
        return hinge_loss(z_CR[:, 0] - z_CR[:, 1], self.beta).sum(), {}


class SimPO(PairObjective):
    """The average log-prob margin past gamma / beta; no reference."""

    name = "simpo"
    averaged = True

    def pair_loss(self, z_CR, scores):
        margin_P = z_CR[:, 0] - z_CR[:, 1] - self.gamma / self.beta
        return sigmoid_loss(margin_P, self.beta, self.label_smoothing).sum(), {}


class ORPO(PairObjective):
    """-beta logsigmoid(log-odds ratio) per pair plus every chosen token's NLL (prompt
    included) averaged over the micro-batch's chosen tokens, times its pairs; no reference."""

    name = "orpo"
    averaged = True
    scores_prompt = True
    metric_names = (*REWARD_METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen")

    def pair_loss(self, z_CR, scores):
        P = len(z_CR)
        log_odds = orpo_log_odds(z_CR[:, 0], z_CR[:, 1])
        chosen_logps = scores.sums_CR[:, 0].sum() + scores.prompt_P.sum()
        nll = -chosen_logps / max(scores.chosen_tokens, 1)
        loss = (-self.beta * F.logsigmoid(log_odds)).sum() + nll * P
        return loss, {
            "nll_loss": nll.detach() * P,
            "log_odds_ratio": F.logsigmoid(log_odds).detach().sum(),
            "log_odds_chosen": log_odds.detach().sum(),
        }


DPO_LOSSES: dict[str, type[PairObjective]] = {"sigmoid": DPO, "ipo": IPO, "hinge": DPOHinge}


def dpo(cfg: Any = None, **options: Any) -> PairObjective:
    """train.objective=dpo: the DPO loss `preference.loss_type` names."""
    p = cfg.preference if cfg is not None else PreferenceSection.from_options("dpo", options)
    return DPO_LOSSES[p.loss_type](cfg, **options)


def pair_objective(name: str, cfg: Any = None, **options: Any) -> PairObjective:
    """The pair objective `name` (dpo | orpo | simpo) from a run config or keyword options."""
    return {"dpo": dpo, "orpo": ORPO, "simpo": SimPO}[name](cfg, **options)
