"""Qwen3.5 on CPU: the native family (models/qwen3_5.py: the packed chunked Gated DeltaNet)
against the generic one (transformers' modeling code, its DeltaNet run once per packed
sequence) on the same random checkpoint, one LoRA training step each.

Run: `python benchmarks/bench_qwen3_5.py [--reps 5] [--json FILE]` (a few minutes on 2 cores),
`--quick` (seconds, tiny shapes).

Shape: hidden 256, 4 layers (3 Gated DeltaNet + 1 gated attention, Qwen3.5's 3:1), 8/4 heads
of 32 (attention), DeltaNet 4 key heads / 8 value heads of 32, vocab 8192; MoE: 8 experts of
256 top-2 and a shared expert of 256. A step: `model.loss` on the labelled positions of 2,048
packed tokens in 8 sequences (random lengths >= 16, most spanning several 64-token chunks),
backward, AdamW over LoRA r16 on the attention and DeltaNet projections (+ the MLP's on the
dense model; on the MoE both adapt attention and DeltaNet only: the MLP names reach the
shared expert and the experts natively, the experts alone on the generic path). Timed
interleaved; syncs = `count_syncs` over loss and backward.

Prediction: native ahead by the per-sequence split the generic path needs (8 DeltaNet calls
a layer instead of one, each on 64-token chunks) and transformers' module overhead:
1.2-2x at this size; syncs 0 for both.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import common
import torch

from slipstream.debug import count_syncs

COLUMNS = ["model", "variant", "tokens/step", "ms/step", "tokens/s", "vs generic",
           "syncs/step", "loss"]  # fmt: skip
SHAPE = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
             shared_expert_intermediate_size=256, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, head_dim=32, vocab_size=8192,
             num_experts=8, num_experts_per_tok=2, linear_num_key_heads=4,
             linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
             max_position_embeddings=4096, tie_word_embeddings=False)  # fmt: skip
QUICK = dict(SHAPE, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
             shared_expert_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=512, num_experts=4, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=16)  # fmt: skip
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj",
           "gate_proj", "up_proj", "down_proj"]  # fmt: skip


def save_random(model_type: str, shape: dict, folder: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **shape)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)


def trainer_step(folder: str, implementation: str, moe: bool, ids, labels, seq):
    """One LoRA step as the trainer runs it on CPU -> (step fn, syncs in loss + backward)."""
    from slipstream.checkpoint.hf import load_model
    from slipstream.peft.lora import apply_lora

    model = load_model(folder, implementation=implementation).train()
    # MoE: no MLP names (natively gate/up/down_proj name the shared expert's linears and the
    # experts, on the generic path the experts alone): both paths train the same factors.
    apply_lora(model, rank=16, alpha=32, targets=TARGETS[:7] if moe else TARGETS)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    positions = (labels != -100).nonzero()[:, 0]

    def step():
        loss = model.loss(ids, labels, seq, label_positions=positions)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    step()
    with count_syncs() as syncs:
        model.loss(ids, labels, seq, label_positions=positions).backward()
    opt.zero_grad(set_to_none=True)
    return step, syncs.total


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from transformers.utils import logging

    logging.set_verbosity_error()
    shape, tokens = (QUICK, 256) if args.quick else (SHAPE, 2048)
    lengths = common.split_lengths(tokens, 8)
    ids, labels, seq = common.random_batch(lengths, shape["vocab_size"])
    rows = []
    for model_type in ("qwen3_5_text", "qwen3_5_moe_text"):
        moe = "moe" in model_type
        with tempfile.TemporaryDirectory() as folder:
            save_random(model_type, shape, folder)
            steps, syncs = {}, {}
            for variant in ("native", "transformers"):
                steps[variant], syncs[variant] = trainer_step(
                    folder, variant, moe, ids, labels, seq
                )
            times = common.time_interleaved(steps, reps=1 if args.quick else args.reps)
        for variant in ("native", "transformers"):
            rows.append({
                "model": model_type, "variant": "generic" if variant == "transformers" else variant,
                "tokens/step": tokens, "ms/step": 1e3 * times[variant],
                "tokens/s": tokens / times[variant],
                "vs generic": times["transformers"] / times[variant],
                "syncs/step": syncs[variant], "loss": float(steps[variant]()),
            })  # fmt: skip
    info = common.run_info()
    print(common.header(info, "python benchmarks/bench_qwen3_5.py" + (" --quick" * args.quick)))
    print(common.markdown_table(rows, COLUMNS))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
