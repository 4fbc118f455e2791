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
  plus the chosen sequences' NLL over *every* token, prompt included (as TRL's ORPOTrainer),
  token-averaged over the micro-batch; rewards beta*a; no reference.

The trainer normalises by pairs (`weight`): a micro-batch returns the sum over its pairs, so
grad-accum and torchrun equal one big batch for DPO and SimPO exactly; ORPO's NLL term enters
each micro-batch as its token mean times its pairs (one micro-batch: exactly TRL's).
Metrics (TRL's names, summed over pairs; the trainer divides by pairs): `rewards/chosen`,
`rewards/rejected`, `rewards/margins`, `rewards/accuracies`, `logps/chosen`, `logps/rejected`
(summed log-probs for DPO, averages for SimPO and ORPO, as TRL reports them); ORPO adds
`nll_loss`, `log_odds_ratio`, `log_odds_chosen`.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F

from slipstream.data.rows import row_columns
from slipstream.objectives.base import HookContext, Objective
from slipstream.objectives.logps import segment_sums, token_logps
from slipstream.objectives.pairs import PairExample, check_pair_columns, collate_pairs
from slipstream.objectives.preference_config import PreferenceSection
from slipstream.objectives.reference import adapters_disabled, build_reference

OBJECTIVES = ("dpo", "orpo", "simpo")
REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                  "logps/chosen", "logps/rejected")  # fmt: skip
ORPO_METRICS = ("nll_loss", "log_odds_ratio", "log_odds_chosen")


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
    """(loss_P, chosen rewards_P, rejected rewards_P) from summed log-probs (module docstring)."""
    c, r = chosen_P - ref_chosen_P, rejected_P - ref_rejected_P
    delta = c - r
    if loss_type == "sigmoid":
        loss = -F.logsigmoid(beta * delta) * (1 - label_smoothing)
        if label_smoothing:
            loss = loss - F.logsigmoid(-beta * delta) * label_smoothing
    elif loss_type == "ipo":
        if chosen_tokens_P is None or rejected_tokens_P is None:
            raise ValueError("ipo needs the completion token counts")
        per_token = c / chosen_tokens_P.clamp(min=1) - r / rejected_tokens_P.clamp(min=1)
        loss = (per_token - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        loss = torch.relu(1 - beta * delta)
    else:
        raise ValueError(f"preference.loss_type = {loss_type!r}; use sigmoid, ipo or hinge")
    return loss, beta * c.detach(), beta * r.detach()


def simpo_losses(
    chosen_avg_P: torch.Tensor,
    rejected_avg_P: torch.Tensor,
    *,
    beta: float,
    gamma: float,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss_P, chosen rewards_P, rejected rewards_P) from average log-probs."""
    z = chosen_avg_P - rejected_avg_P - gamma / beta
    loss = -F.logsigmoid(beta * z) * (1 - label_smoothing)
    if label_smoothing:
        loss = loss - F.logsigmoid(-beta * z) * label_smoothing
    return loss, beta * chosen_avg_P.detach(), beta * rejected_avg_P.detach()


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate on both sides of -log 2."""
    below = x < -0.6931471805599453
    return torch.where(below, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_odds(
    chosen_avg_P: torch.Tensor, rejected_avg_P: torch.Tensor, *, beta: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(odds-ratio loss_P = -beta logsigmoid(o), log-odds o_P, chosen, rejected rewards)."""
    a_c, a_r = chosen_avg_P.float(), rejected_avg_P.float()
    log_odds = (a_c - a_r) - (log1mexp(a_c) - log1mexp(a_r))
    return -beta * F.logsigmoid(log_odds), log_odds, beta * a_c.detach(), beta * a_r.detach()


class Preference(Objective):
    """The objective the trainer runs for train.objective = dpo | orpo | simpo."""

    perplexity = False

    def __init__(self, cfg: Any = None, *, name: str = "dpo", **options: Any) -> None:
        """From a RunConfig (`train.objective`, the `preference` section, data options), or,
        without one, from keyword options named as the section's keys."""
        self.reference = None  # set by attach(): a ReferencePolicy, or None (precomputed)
        if cfg is None:
            self.name = name
            p = PreferenceSection.from_options("Preference", options)
            self.data_options: dict[str, Any] = {"max_tokens": 1 << 30}
            self.full = self.from_adapter = False
        else:
            p, d, t = cfg.preference, cfg.data, cfg.train
            self.name = t.objective
            # Each sequence of a pair within max_tokens; both together within the batch budget.
            self.data_options = dict(
                max_tokens=min(d.max_tokens or t.tokens_per_batch // 2, t.tokens_per_batch // 2),
                overlong=d.overlong, strict=d.strict,
            )  # fmt: skip
            self.full, self.from_adapter = cfg.lora.method == "full", cfg.model.adapter is not None
        self.options = p
        self.beta, self.loss_type = p.beta, p.loss_type
        self.label_smoothing, self.gamma = p.label_smoothing, p.simpo_gamma
        self.metric_names = REWARD_METRICS + (ORPO_METRICS if self.name == "orpo" else ())

    def attach(self, ctx: HookContext, data: Any) -> None:
        """Before training (and before any data-parallel wrapping): DPO's reference policy
        (objectives/reference.py), or its log-probs precomputed once for every pair."""
        if self.name != "dpo":
            return
        p, full, from_adapter, model = self.options, self.full, self.from_adapter, ctx.model
        device = ctx.device
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
                    batch = collate_pairs(pairs).to(device)
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
        return tokenize_pairs(rows, tokenizer, first_row=first_row, **self.data_options)

    def length(self, example: PairExample) -> int:
        return len(example)

    def collate(self, examples: list[PairExample]) -> Any:
        ref = None
        if all(ex.ref is not None for ex in examples) and self.name == "dpo":
            ref = [ex.ref for ex in examples]
        return collate_pairs(examples, score_prompt=self.name == "orpo", ref_logps=ref)

    def weight(self, batch: Any) -> int:
        return batch.num_pairs

    # -- loss ---------------------------------------------------------------------------
    def sequence_logps(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """(3P,) summed log-probs: completion of each sequence (2P), then each pair's
        chosen prompt (P; scored for ORPO only)."""
        tok_N = token_logps(model, batch.input_ids, batch.labels, batch.seq, batch.positions)
        return segment_sums(tok_N, batch.segments, 3 * batch.num_pairs)

    def reference_logps(self, batch: Any) -> torch.Tensor:
        """(2P,) the reference policy's summed completion log-probs (chosen, rejected, ...)."""
        if batch.ref_logps is not None:
            return batch.ref_logps
        if self.reference is None:
            raise RuntimeError("DPO needs a reference policy: call attach(ctx, data) first")
        with self.reference.active() as ref_model:
            return self.sequence_logps(ref_model, batch)[: 2 * batch.num_pairs]

    def micro_batch_loss(
        self, model: torch.nn.Module, batch: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss summed over the batch's pairs and metric sums (device tensors, no sync)."""
        P = batch.num_pairs
        ref_CR = self.reference_logps(batch).view(P, 2) if self.name == "dpo" else None
        seg = self.sequence_logps(model, batch)
        logps_CR = seg[: 2 * P].view(P, 2)
        tokens_CR = batch.completion_tokens.view(P, 2)
        metrics: dict[str, torch.Tensor] = {}
        if self.name == "dpo":
            loss_P, rc, rr = dpo_losses(
                logps_CR[:, 0], logps_CR[:, 1], ref_CR[:, 0], ref_CR[:, 1],
                beta=self.beta, loss_type=self.loss_type, label_smoothing=self.label_smoothing,
                chosen_tokens_P=tokens_CR[:, 0], rejected_tokens_P=tokens_CR[:, 1],
            )  # fmt: skip
            shown_CR = logps_CR
            loss = loss_P.sum()
        else:
            avg_CR = logps_CR / tokens_CR.clamp(min=1)
            shown_CR = avg_CR
            if self.name == "simpo":
                loss_P, rc, rr = simpo_losses(
                    avg_CR[:, 0], avg_CR[:, 1], beta=self.beta, gamma=self.gamma,
                    label_smoothing=self.label_smoothing,
                )  # fmt: skip
                loss = loss_P.sum()
            else:  # orpo: every chosen token's NLL, prompt included, token-averaged
                loss_P, log_odds, rc, rr = orpo_odds(avg_CR[:, 0], avg_CR[:, 1], beta=self.beta)
                nll = -(logps_CR[:, 0].sum() + seg[2 * P :].sum()) / max(batch.num_chosen_tokens, 1)
                loss = loss_P.sum() + nll * P
                metrics["nll_loss"] = nll.detach() * P
                metrics["log_odds_ratio"] = F.logsigmoid(log_odds).detach().sum()
                metrics["log_odds_chosen"] = log_odds.detach().sum()
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
