"""Host syncs per training step for every model family, every feature on (CPU audit).

Run: `python benchmarks/bench_syncs.py` (seconds) or `--quick` (the same, fewer tokens).
For each `model_type` in `slipstream.models.FAMILIES`: a tiny random-initialised model, LoRA
(`slipstream.peft.lora.apply_lora`, when built), activation checkpointing with offload
(`slipstream.memory.offload.apply_checkpointing`, when built; on CPU the module decides what
offload means there), then one training step as the trainer runs it: summed loss / labelled
tokens, backward, grad-norm clip, the trainer's CUDA optimizer (fused AdamW: its step counters
live on the device), zero_grad. The second step is audited with `count_syncs()`, which judges
each op by what it would do on CUDA, so 0 here means 0 on the GPU. Target: 0 in every row.
"""

from __future__ import annotations

import argparse
import json

import common
import torch

from slipstream.debug import count_syncs

COLUMNS = ["model_type", "kind", "features", "fwd+bwd syncs", "optimizer syncs", "where"]

# Config keys a family needs beyond common.TINY for its tiny model to be valid.
EXTRA = {
    "mistral": {"sliding_window": None},
    # both layer types (two RoPEs), a window shorter than the sequences
    "gemma3_text": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8},
}
# Gemma 4: full layers of their own head dim with k = v, per-layer inputs (a small table:
# the default is 262144 x L*256), the last 2 of 4 layers reusing the first 2's K/V.
EXTRA["gemma4_text"] = {
    "num_hidden_layers": 4, "sliding_window": 8, "global_head_dim": 32,
    "num_global_key_value_heads": 1, "attention_k_eq_v": True, "num_kv_shared_layers": 2,
    "use_double_wide_mlp": True, "vocab_size_per_layer_input": 256,
    "hidden_size_per_layer_input": 16, "final_logit_softcapping": 30.0,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
}  # fmt: skip
# The image+text gemma3 builds its language model from text_config: the tiny sizes go there
# (at the top level they were ignored, and the published 4B text model was built: 150 s, 13 GB).
# Its tower too (transformers' defaults are a 224-px SigLIP, 14 patches a side, whose 256
# soft tokens do not tile it): 4 patches a side pooled to 2 x 2.
EXTRA["gemma3"] = {
    "text_config": {**common.TINY, **EXTRA["gemma3_text"]}, "mm_tokens_per_image": 4,
    "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                      "num_attention_heads": 2, "image_size": 56, "patch_size": 14},
}  # fmt: skip
# Qwen3.5: a DeltaNet layer and an attention layer, small linear-attention heads.
QWEN35 = {"layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
          "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
          "shared_expert_intermediate_size": 32}  # fmt: skip
for kind in ("qwen3_5", "qwen3_5_moe"):
    EXTRA[f"{kind}_text"] = QWEN35
    EXTRA[kind] = {"text_config": {**common.TINY, **QWEN35, "model_type": f"{kind}_text"}}
EXTRA["gemma4"] = {"text_config": {**common.TINY, **EXTRA["gemma4_text"]}}
# Qwen-VL: mRoPE sections over the tiny head's 8 frequencies, a 1-2 layer tower of width 16
# (transformers' default towers are the published 0.6B ones).
_QWEN_VIT = {"hidden_size": 16, "intermediate_size": 24, "num_heads": 2, "out_hidden_size": 64,
             "spatial_merge_size": 2, "temporal_patch_size": 2}  # fmt: skip
for kind, interleaved, tower in (
    ("qwen2_5_vl", False, {"depth": 1, "patch_size": 14, "window_size": 56,
                           "fullatt_block_indexes": [0]}),
    ("qwen3_vl", True, {"depth": 2, "patch_size": 16, "num_position_embeddings": 16,
                        "deepstack_visual_indexes": [0, 1]}),
):  # fmt: skip
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    if interleaved:
        rope["mrope_interleaved"] = True
    EXTRA[kind] = {
        "text_config": {**common.TINY, "rope_parameters": rope},
        "vision_config": {**_QWEN_VIT, **tower},
    }
for kind in ("qwen3_5", "qwen3_5_moe"):
    EXTRA[kind]["vision_config"] = {**_QWEN_VIT, "depth": 1, "patch_size": 16,
                                    "num_position_embeddings": 16}  # fmt: skip
# Rows beyond one per model_type: (row label, model_type, config keys beyond common.TINY).
VARIANTS = [
    ("gemma4_text (MoE)", "gemma4_text", {**EXTRA["gemma4_text"], "enable_moe_block": True,
     "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 16}),  # 26B-A4B's block
]  # fmt: skip


def apply_features(model: torch.nn.Module, moe: bool) -> list[str]:
    """LoRA (all linear layers, plus the experts of MoE blocks), then checkpointing/offload,
    each if its module exists; returns the names of what was applied."""
    features = []
    apply_lora = common.optional("slipstream.peft.lora", "apply_lora")
    if apply_lora is not None:
        apply_lora(model, rank=8, alpha=16, targets="all-linear")
        features.append("lora")
        if moe:  # all-linear also wraps the stacked experts of MoE blocks
            features.append("expert lora")
    else:
        model.requires_grad_(True)
        features.append("full (no lora module)")
    apply_checkpointing = common.optional("slipstream.memory.offload", "apply_checkpointing")
    if apply_checkpointing is not None:
        apply_checkpointing(model, "offload")
        features.append("checkpointing (offload mode; on CPU it recomputes)")
    return features


def measure(model_type: str, tokens: int, extra: dict | None = None, label: str = "") -> dict:
    from slipstream.train.optim import build_optimizer

    extra = EXTRA.get(model_type, {}) if extra is None else extra
    hf = common.hf_config(model_type, **{**common.TINY, **extra})
    model = common.build_random_model(hf).train()
    moe = any("expert" in name for name, _ in model.named_parameters())
    features = apply_features(model, moe)
    params = [p for p in model.parameters() if p.requires_grad]
    # device=cuda picks what the trainer runs on a GPU (fused AdamW) without needing one.
    optimizer = build_optimizer(
        model.named_parameters(), lr=1e-4, weight_decay=0.0, device=torch.device("cuda")
    )
    lengths = common.split_lengths(tokens, 3)
    ids, labels, seq = common.random_batch(lengths, hf["vocab_size"])
    num_labels = sum(n - 1 for n in lengths)  # host int, as the collator gives it

    for _ in range(2):  # the first step creates optimizer state; audit the second
        with count_syncs() as model_syncs:
            loss = model.loss(ids, labels, seq, reduction="sum")
            (loss / num_labels).backward()
        with count_syncs() as optim_syncs:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    sites = {**model_syncs.sites, **optim_syncs.sites}
    return {
        "model_type": label or model_type,
        "kind": "MoE" if moe else "dense",
        "features": " + ".join(features),
        "fwd+bwd syncs": model_syncs.total,
        "optimizer syncs": optim_syncs.total,
        "where": "; ".join(f"{op} at {site}" for op, site in sites.items()) or "-",
        "loss": loss.item(),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer tokens: a smoke run")
    ap.add_argument("--json", help="also write the rows and run info to this file")
    args = ap.parse_args(argv)
    from slipstream.models import FAMILIES

    tokens = 96 if args.quick else 512
    rows = []
    runs = [(t, t, None) for t in sorted(FAMILIES)] + VARIANTS
    for label, model_type, extra in runs:
        try:
            rows.append(measure(model_type, tokens, extra, label))
        except Exception as e:  # one broken family must not hide the others
            rows.append({"model_type": label, "where": f"error: {type(e).__name__}: {e}"})
    info = common.run_info()
    command = "python benchmarks/bench_syncs.py" + (" --quick" if args.quick else "")
    print(f"Host syncs per training step (second step, {tokens} tokens in 3 sequences)")
    print(common.header(info, command))
    print(common.markdown_table(rows, COLUMNS))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows}, f)
    return rows


if __name__ == "__main__":
    main()
