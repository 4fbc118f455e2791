"""The generic family on CPU: what running transformers' modeling code costs against a native
family, and what packing is worth on a model type with no native code.

Run: `python benchmarks/bench_generic.py [--reps 3] [--json FILE]` (minutes on 2 cores),
`--quick` (seconds, tiny shapes: the test suite's smoke run).

1. native vs generic: one random checkpoint (transformers' `from_config`, saved) loaded by the
   native family and by the generic one (`model.implementation: transformers`), for llama,
   qwen3 and qwen3_moe (hidden 256, 4 layers, vocab 8192; MoE 8 experts top-2); LoRA r16 on
   q/k/v/o (+ gate/up/down on the dense types: generic MoE experts take no LoRA yet), the
   trainer's CPU setup (frozen linears prepacked, every layer checkpointed: recompute), one
   step = `model.loss` on the labelled positions of 1,024 packed tokens in 7 sequences,
   backward, AdamW. Timed interleaved; syncs = `count_syncs` over loss + backward.
2. packed vs padded: OLMo 2 (no native family) at a small real shape (hidden 384, MLP 1024,
   4 layers, 6/2 heads, the SmolLM2 tokenizer's vocab 49152) on chitchat conversations
   tokenized by our SFT path (assistant-only labels, cut at 512 tokens). A step is the
   examples our best-fit packer puts in one 2,048-token batch; slipstream runs them packed
   (generic family, as above), transformers + PEFT as one right-padded batch of the same
   examples (attention_mask, SDPA, gradient checkpointing, peft LoRA r16 on all linear
   layers, the same AdamW). tokens/s counts real tokens only; "computed" counts the padded
   batch's positions.

Prediction: native vs generic near 1.0x (the same GEMMs; transformers' modules add Python
dispatch, a few % at these sizes); packed vs padded about the padding ratio (chitchat's
lengths vary ~5x within a batch: 1.5-2x).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import common
import torch

from slipstream.debug import count_syncs

COLUMNS = ["part", "model", "variant", "tokens/step", "computed/step", "ms/step", "tokens/s",
           "vs base", "syncs/step", "loss (step 0)"]  # fmt: skip
SHAPE = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
             num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
             vocab_size=8192, num_experts=8, num_experts_per_tok=2,
             max_position_embeddings=4096, tie_word_embeddings=False)  # fmt: skip
QUICK = dict(SHAPE, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             vocab_size=512, num_experts=4)  # fmt: skip
OLMO2 = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=4,
             num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=4096,
             tie_word_embeddings=False)  # fmt: skip
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def save_random(model_type: str, shape: dict, folder: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **shape)
    AutoModelForCausalLM.from_config(config).float().save_pretrained(folder)


def trainer_setup(model, targets):
    """What `slipstream train` does on CPU: LoRA, prepacked frozen linears, recompute."""
    from slipstream.memory.offload import apply_checkpointing
    from slipstream.ops.frozen_linear import apply_prepacked_linears
    from slipstream.peft.lora import apply_lora

    apply_lora(model, rank=16, alpha=32, targets=targets)
    apply_prepacked_linears(model)
    apply_checkpointing(model, "recompute")
    model.train()
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)


def our_step(model, opt, ids, labels, seq, positions, losses, key):
    def step():
        loss = model.loss(ids, labels, seq, reduction="sum", label_positions=positions)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.setdefault(key, loss.item() / len(positions))  # the first: LoRA B = 0, equal

    return step


def syncs_of(model, ids, labels, seq, positions) -> int:
    with count_syncs() as c:
        model.loss(ids, labels, seq, reduction="sum", label_positions=positions).backward()
    model.zero_grad(set_to_none=True)
    return c.total


def native_vs_generic(model_type: str, shape: dict, tokens: int, reps: int) -> list[dict]:
    from slipstream.checkpoint.hf import load_model

    folder = tempfile.mkdtemp(prefix=f"bench_generic_{model_type}_")
    save_random(model_type, shape, folder)
    lengths = common.split_lengths(tokens, 7)
    ids, labels, seq = common.random_batch(lengths, shape["vocab_size"])
    positions = (labels != -100).nonzero()[:, 0]
    # MoE: attention only. The MLP names reach the experts on both paths, and natively also
    # a dense MLP beside them (Gemma 4's), which the generic path cannot adapt: other work.
    moe = "moe" in model_type or bool(shape.get("enable_moe_block"))
    targets = ATTENTION + ([] if moe else MLP)
    models, fns, losses = {}, {}, {}
    for impl in ("native", "transformers"):
        model = load_model(folder, dtype=torch.float32, implementation=impl)
        opt = trainer_setup(model, targets)
        models[impl] = model
        fns[impl] = our_step(model, opt, ids, labels, seq, positions, losses, impl)
    syncs = {impl: syncs_of(m, ids, labels, seq, positions) for impl, m in models.items()}
    times = common.time_interleaved(fns, reps=reps, warmup=1)
    return [
        {"part": "native vs generic", "model": model_type,
         "variant": "native family" if impl == "native" else "generic (transformers' code)",
         "tokens/step": tokens, "computed/step": tokens, "ms/step": times[impl] * 1e3,
         "tokens/s": tokens / times[impl], "vs base": times["native"] / times[impl],
         "syncs/step": syncs[impl], "loss (step 0)": losses[impl]}
        for impl in ("native", "transformers")
    ]  # fmt: skip


def chitchat_batches(tokenizer, budget: int, steps: int, max_tokens: int):
    from slipstream.data import chitchat_rows, pack_examples, tokenize_rows

    rows = chitchat_rows(steps * budget // 64 + 64, max_turns=6)
    examples, _ = tokenize_rows(rows, tokenizer, max_tokens=max_tokens)
    batches = pack_examples([len(e) for e in examples], budget)
    return [[examples[i] for i in b] for b in batches[: steps + 1]]  # +1: the warm-up


def padded_inputs(examples, pad_id: int) -> dict:
    """transformers' batch of `examples`: right-padded, labels unshifted (-100: not a target)."""
    width = max(len(e) for e in examples)
    ids = torch.full((len(examples), width), pad_id)
    mask = torch.zeros(len(examples), width, dtype=torch.long)
    labels = torch.full((len(examples), width), -100)
    for i, e in enumerate(examples):
        n = len(e)
        ids[i, :n], mask[i, :n] = torch.tensor(e.input_ids), 1
        labels[i, :n] = torch.tensor([t if y else -100 for t, y in zip(e.input_ids, e.trainable)])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def packed_vs_padded(shape: dict, budget: int, steps: int, max_tokens: int) -> list[dict]:
    import peft
    from transformers import AutoModelForCausalLM

    from slipstream.checkpoint.gguf import gguf_tokenizer, smollm2_gguf_path
    from slipstream.checkpoint.hf import load_model
    from slipstream.data import collate

    tokenizer = gguf_tokenizer(smollm2_gguf_path())
    folder = tempfile.mkdtemp(prefix="bench_generic_olmo2_")
    save_random("olmo2", {**shape, "vocab_size": len(tokenizer)}, folder)
    batches = chitchat_batches(tokenizer, budget, steps, max_tokens)
    real = [sum(len(e) for e in b) for b in batches]

    ours = load_model(folder, dtype=torch.float32)
    opt = trainer_setup(ours, ATTENTION + MLP)
    hf = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="sdpa"
    )
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules=ATTENTION + MLP, lora_dropout=0.0)
    hf = peft.get_peft_model(hf, lora).train()
    hf_opt = torch.optim.AdamW([p for p in hf.parameters() if p.requires_grad], lr=1e-4)
    packed = [collate(b) for b in batches]
    padded = [padded_inputs(b, tokenizer.pad_token_id or 0) for b in batches]

    def run(step_fn) -> tuple[list[float], float]:
        """Seconds of each step after the warm-up, and the warm-up's loss (LoRA B = 0: the
        base model's, the same for both sides)."""
        times, first = [], None
        for i in range(len(batches)):
            start = time.perf_counter()
            loss = step_fn(i)
            if i:
                times.append(time.perf_counter() - start)
            first = loss if first is None else first
        return times, first

    def ours_step(i):
        b = packed[i]
        loss = ours.loss(b.input_ids, b.labels, b.seq, reduction="sum",
                         label_positions=b.label_positions)  # fmt: skip
        (loss / b.num_labels).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item() / b.num_labels

    def hf_step(i):
        loss = hf(**padded[i]).loss
        loss.backward()
        hf_opt.step()
        hf_opt.zero_grad(set_to_none=True)
        return loss.item()

    b = packed[0]
    syncs = syncs_of(ours, b.input_ids, b.labels, b.seq, b.label_positions)
    with count_syncs() as c:
        hf(**padded[0]).loss.backward()
    hf.zero_grad(set_to_none=True)
    ours_t, ours_loss = run(ours_step)
    hf_t, hf_loss = run(hf_step)
    tokens = sum(real[1:]) / steps
    computed = sum(p["input_ids"].numel() for p in padded[1:]) / steps
    common_row = {"part": "packed vs padded (chitchat)", "model": "olmo2 (no native family)",
                  "tokens/step": round(tokens)}  # fmt: skip
    ours_s, hf_s = sum(ours_t) / steps, sum(hf_t) / steps
    return [
        {**common_row, "variant": "transformers + PEFT, padded", "computed/step": round(computed),
         "ms/step": hf_s * 1e3, "tokens/s": tokens / hf_s, "vs base": 1.0,
         "syncs/step": c.total, "loss (step 0)": hf_loss},
        {**common_row, "variant": "slipstream generic, packed", "computed/step": round(tokens),
         "ms/step": ours_s * 1e3, "tokens/s": tokens / ours_s, "vs base": hf_s / ours_s,
         "syncs/step": syncs, "loss (step 0)": ours_loss},
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes, one rep: a smoke run")
    ap.add_argument("--reps", type=int, default=3, help="timed steps per variant")
    ap.add_argument("--tokens", type=int, default=1024, help="part 1: packed tokens a step")
    ap.add_argument("--budget", type=int, default=2048, help="part 2: tokens a packed batch")
    ap.add_argument("--json", help="also write the rows and run info to this file")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier timing)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape, olmo, reps, tokens, budget = SHAPE, OLMO2, args.reps, args.tokens, args.budget
    if args.quick:
        shape, reps, tokens, budget = QUICK, 1, 256, 512
        olmo = dict(OLMO2, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4)  # fmt: skip
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    rows = []
    for model_type in ("llama", "qwen3", "qwen3_moe"):
        rows += native_vs_generic(model_type, shape, tokens, reps)
    rows += packed_vs_padded(olmo, budget, reps, max_tokens=512 if not args.quick else 128)
    info = {**common.run_info(), "load": os.getloadavg()[0]}
    given = argv if argv is not None else sys.argv[1:]
    print(f"generic family, CPU float32, {args.threads} thread(s), load average "
          f"{info['load']:.1f}")  # fmt: skip
    print(common.header(info, " ".join(["python benchmarks/bench_generic.py", *given])))
    print(common.markdown_table(rows, COLUMNS))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
