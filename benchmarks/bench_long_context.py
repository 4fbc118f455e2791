"""Longest single sequence a SmolLM2-135M-shaped LoRA step trains within an RSS budget:
slipstream (recompute, untiled and MLP in 8 tiles) vs transformers + PEFT (gradient
checkpointing, SDPA) vs Unsloth's CPU backend (`--tools unsloth`: its FastLanguageModel with
its own gradient checkpointing, in its own venv, `--unsloth-python`; docs/benchmarks.md says
how that venv is made).

Each trial is a fresh process that builds the model (SmolLM2-135M's config.json shapes,
random float32 weights: memory does not depend on the values), applies LoRA r16 alpha 32 to
the 7 linears, and runs one training step (forward, backward, AdamW step) over one sequence
of T tokens, every position labelled; it reports its peak RSS (`ru_maxrss`) and seconds.
Peak RSS is affine in T for both (linear-memory attention, linear logits), so the longest T
within the budget is solved from the trials' line through (T, RSS); `--verify` then runs
each tool at that T. slipstream's `plan` estimate for the same settings is printed beside.

Run: `python benchmarks/bench_long_context.py --tokens 1024,2048 --budget-gb 8 [--verify]`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
    rope_theta=100000.0, max_position_embeddings=1 << 20, rms_norm_eps=1e-5,
)  # fmt: skip
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOOLS = {"slipstream": 1, "slipstream-tiled": 8, "hf": None, "unsloth": None}
PEERS = ("hf", "unsloth")


def model_folder(work: Path) -> Path:
    folder = work / "smollm2-135m-shaped"
    if not (folder / "config.json").is_file():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).float().save_pretrained(folder)
    if not (folder / "tokenizer.json").is_file():  # Unsloth's loader wants one; unused here
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {f"t{i}": i for i in range(SMOLLM2_135M["vocab_size"])}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1").save_pretrained(folder)
    return folder


def trial_slipstream(folder: Path, T: int, tiles: int) -> None:
    sys.path.insert(0, str(HERE.parent))
    import torch

    from slipstream.checkpoint.hf import load_model
    from slipstream.memory.offload import apply_checkpointing
    from slipstream.memory.tiled_mlp import apply_mlp_tiling
    from slipstream.ops.frozen_linear import apply_prepacked_linears
    from slipstream.ops.packing import SeqInfo
    from slipstream.peft.lora import apply_lora
    from slipstream.train.optim import build_optimizer

    model = load_model(str(folder), dtype=torch.float32, device=torch.device("cpu"))
    apply_lora(model, rank=16, alpha=32, targets=TARGETS)
    apply_prepacked_linears(model)  # as `train` does on CPU in float32
    apply_mlp_tiling(model, tiles)
    apply_checkpointing(model, "recompute")
    opt = build_optimizer(model.named_parameters(), lr=1e-4, weight_decay=0.0,
                          device=torch.device("cpu"))  # fmt: skip
    ids = torch.randint(0, SMOLLM2_135M["vocab_size"], (T,))
    seq = SeqInfo.from_lengths([T])
    loss = model.loss(ids, ids, seq, reduction="sum", label_positions=torch.arange(T))
    loss.backward()
    opt.step()


def trial_hf(folder: Path, T: int) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                             attn_implementation="sdpa")  # fmt: skip
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, SMOLLM2_135M["vocab_size"], (1, T))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


def trial_unsloth(folder: Path, T: int) -> None:
    """Unsloth's CPU backend (its venv), as its users run it: FastLanguageModel, LoRA r16 on
    the 7 linears with its gradient checkpointing ("unsloth"), one step of TRL's SFTTrainer
    (which Unsloth patches: its chunked cross-entropy) over one row of T tokens."""
    import torch
    import unsloth  # noqa: F401  (first: it patches transformers and TRL)
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer
    from unsloth import FastLanguageModel

    model, tokenizer = FastLanguageModel.from_pretrained(
        str(folder), max_seq_length=T, dtype=torch.float32, load_in_4bit=False
    )
    model = FastLanguageModel.get_peft_model(
        model, r=16, lora_alpha=32, lora_dropout=0, target_modules=TARGETS,
        use_gradient_checkpointing="unsloth", random_state=0,
    )  # fmt: skip
    ids = torch.randint(0, SMOLLM2_135M["vocab_size"], (T,)).tolist()
    config = SFTConfig(
        output_dir=str(folder.parent / "unsloth_out"), per_device_train_batch_size=1,
        max_steps=1, max_length=T, learning_rate=1e-4, use_cpu=True, report_to="none",
        save_strategy="no", logging_steps=10_000, dataloader_num_workers=0, bf16=False,
    )  # fmt: skip
    data = Dataset.from_list([{"input_ids": ids, "labels": ids}])
    SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer).train()


def run_trial(tool: str, T: int, work: Path, python: str = sys.executable) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    cmd = [python, __file__, "--child", tool, "--tokens", str(T), "--work", str(work)]
    start = time.time()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        return {"tool": tool, "tokens": T, "error": done.stderr.strip().splitlines()[-1:]}
    row = json.loads(done.stdout.strip().splitlines()[-1])
    row["wall_s"] = time.time() - start
    return row


def plan_estimate(T: int, tiles: int) -> float:
    sys.path.insert(0, str(HERE.parent))
    import torch

    from slipstream.memory.plan import PlanInputs, estimate

    hf = {**SMOLLM2_135M, "model_type": "llama"}
    inp = PlanInputs(
        hf=hf, device="cpu", dtype=torch.float32, quantization="none", method="lora", rank=16,
        alpha=32, targets=TARGETS, use_dora=False, optimizer="adamw", tokens=T,
        mode="recompute", tiles=tiles, prepack=True, world=1,
    )  # fmt: skip
    return estimate(inp, T, "recompute", tiles).peak / 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1024,2048")
    p.add_argument("--tools", default=",".join(TOOLS))
    p.add_argument("--budget-gb", type=float, default=8.0)
    p.add_argument("--verify", action="store_true", help="run each tool at its solved length")
    p.add_argument("--work", default="/tmp/bench_long_context")
    p.add_argument("--json", default=None)
    p.add_argument("--unsloth-python", default="/work/venvs/unsloth/bin/python")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    work = Path(args.work)
    if args.child:
        T, start = int(args.tokens), time.process_time()
        if args.child == "hf":
            trial_hf(model_folder(work), T)
        elif args.child == "unsloth":
            trial_unsloth(model_folder(work), T)
        else:
            trial_slipstream(model_folder(work), T, TOOLS[args.child])
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
        print(json.dumps({"tool": args.child, "tokens": T, "peak_rss_gb": rss,
                          "cpu_s": time.process_time() - start}))  # fmt: skip
        return 0
    work.mkdir(parents=True, exist_ok=True)
    model_folder(work)
    lengths = [int(t) for t in args.tokens.split(",")]
    results = {}
    for tool in args.tools.split(","):
        python = args.unsloth_python if tool == "unsloth" else sys.executable
        rows = [run_trial(tool, T, work, python) for T in lengths]
        for r in rows:
            print(json.dumps(r), flush=True)
        ok = [r for r in rows if "peak_rss_gb" in r]
        solved = None
        if len(ok) >= 2:
            (a, ra), (b, rb) = [(r["tokens"], r["peak_rss_gb"]) for r in ok[-2:]]
            slope = (rb - ra) / (b - a)
            solved = int(b + (args.budget_gb - rb) / slope) // 64 * 64 if slope > 0 else None
        entry = {"trials": rows, "solved_tokens": solved}
        if tool not in PEERS and solved:
            entry["plan_gb_at_solved"] = plan_estimate(solved, TOOLS[tool])
        if args.verify and solved:
            entry["verify"] = run_trial(tool, solved, work, python)
            print(json.dumps(entry["verify"]), flush=True)
        results[tool] = entry
        print(f"{tool}: longest within {args.budget_gb} GB RSS ~ {solved} tokens", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
