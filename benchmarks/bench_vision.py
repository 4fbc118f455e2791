"""Image+text training on CPU: slipstream's packed micro-batches against transformers + peft
on the same examples as one right-padded batch (what TRL's vision collator feeds the model).

Run: `python benchmarks/bench_vision.py [--reps 3] [--json FILE]` (minutes on 2 cores),
`--quick` (seconds, tiny shapes: a smoke run); `--trl [--rows 480]`: against TRL's
SFTTrainer itself, on a tiny Idefics3 (`trl_vs_ours`; about a minute).

Model: a random Qwen2.5-VL (tests/helpers/tiny_vlm.py's, text hidden 32 x2 layers; the
default run widens nothing: the tower and the padding are what differ), LoRA r4 on the
language model, tower frozen. Data: chats of one or two random images whose sizes vary
(28..140 px a side, so 1..25 feature rows an image) and replies of 2..30 words. A step is
the examples the best-fit packer puts in one `--tokens` batch; slipstream runs them packed
(`model.loss` over the labelled positions, backward), transformers + peft as one batch
padded to its longest example (attention_mask, mm_token_type_ids, the same pixel patches and
grids), forward + backward. tokens/s counts real tokens; images/s images; "computed" the
padded batch's positions.

Prediction: about the padding ratio (real / computed), here 1.3-2x; the vision tower costs
the same in both (it runs once over the same patches).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.tiny_vlm import random_image, vlm_folder  # noqa: E402

import slipstream  # noqa: E402
from slipstream.data import collate, pack_examples, tokenize_rows  # noqa: E402
from slipstream.data.vision import ImageExample, ImageProcessing, image_inputs  # noqa: E402

WORDS = [
    "the",
    "red",
    "blue",
    "green",
    "square",
    "circle",
    "small",
    "large",
    "left",
    "right",
    "top",
    "bottom",
    "one",
    "two",
]


# `--wide`: a Qwen2.5-VL whose widths are nearer a real one's than the tests' (text hidden 512
# x 4 layers, head_dim 64, GQA 8/2; tower width 128 x 2 blocks) and images up to 448 px a
# side (up to 256 feature rows each), so the layers, not the per-step overheads, set the time.
WIDE_TEXT = dict(
    hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=2, head_dim=64, initializer_range=0.02, max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]},
)  # fmt: skip
WIDE_VISION = dict(
    hidden_size=128, intermediate_size=256, depth=2, num_heads=4, out_hidden_size=512,
    window_size=112, fullatt_block_indexes=[1],
)  # fmt: skip
WIDE_MAX_SIDE = 448


def rows(n: int, seed: int, max_side: int = 140) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        sizes = [(rng.randint(28, max_side), rng.randint(28, max_side))
                 for _ in range(rng.randint(1, 2))]  # fmt: skip
        images = [
            random_image(h, w, seed=seed * 1000 + i * 3 + k) for k, (h, w) in enumerate(sizes)
        ]
        parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": "Describe."}]
        reply = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 30)))
        turns = [{"role": "user", "content": parts}, {"role": "assistant", "content": reply}]
        out.append({"messages": turns, "images": images})
    return out


def padded_inputs(examples: list[ImageExample], side: ImageProcessing, pad: int) -> dict:
    """One right-padded batch of the examples, as transformers takes it."""
    longest = max(len(ex) for ex in examples)
    ids = torch.full((len(examples), longest), pad)
    labels = torch.full((len(examples), longest), -100)
    mask = torch.zeros((len(examples), longest), dtype=torch.long)
    for b, ex in enumerate(examples):
        n = len(ex)
        ids[b, :n] = torch.tensor(ex.input_ids)
        labels[b, :n] = torch.tensor([i if t else -100 for i, t in zip(ex.input_ids, ex.trainable)])
        mask[b, :n] = 1
    return dict(
        input_ids=ids, attention_mask=mask, labels=labels,
        mm_token_type_ids=(ids == side.image_token_id).int(),
        pixel_values=torch.cat([ex.model_inputs()["pixel_values"] for ex in examples]),
        image_grid_thw=torch.cat([ex.model_inputs()["image_grid_thw"] for ex in examples]),
    )  # fmt: skip


def trl_vs_ours(args) -> dict:
    """One epoch over the same rows: TRL's SFTTrainer (its vision collator: the processor on
    each step's rows, right-padded; batches of a fixed number of rows, the packed run's mean;
    its loss on every token, this template having no generation markers: the same compute)
    against slipstream's packed micro-batches (rows tokenized beforehand, timed apart; the
    images processed again per batch in `collate`, data/vision.py), both LoRA r4 on the
    language model with AdamW; a tiny Idefics3 (images of mixed sizes: 2-5 crops each, so
    pixels pad too). `trl_s` is the trainer's `train_runtime`."""
    import math

    import datasets
    from peft import LoraConfig
    from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    with tempfile.TemporaryDirectory() as tmp:
        folder = vlm_folder(Path(tmp) / "model", "idefics3")
        tok = AutoTokenizer.from_pretrained(folder)
        data = rows(args.rows, 0)
        for row in data:  # text parts in every turn (one arrow type per column)
            reply = row["messages"][1]
            reply["content"] = [{"type": "text", "text": reply["content"]}]
        start = time.perf_counter()
        side = ImageProcessing.from_model(str(folder), tok)
        examples, _ = tokenize_rows(data, tok, max_tokens=args.tokens, images=side)
        prep_s = time.perf_counter() - start
        batches = pack_examples([len(ex) for ex in examples], args.tokens)
        per_step = max(1, math.ceil(len(examples) / len(batches)))
        real = sum(len(ex) for ex in examples)
        images = sum(len(ex.sizes) for ex in examples)
        ours = slipstream.load_model(folder)
        slipstream.apply_lora(ours, rank=4, alpha=8)
        opt = torch.optim.AdamW([p for p in ours.parameters() if p.requires_grad], lr=1e-4)
        start = time.perf_counter()
        for b in batches:
            batch = collate([examples[i] for i in b])
            loss = ours.loss(batch.input_ids, batch.labels, batch.seq, reduction="sum",
                             label_positions=batch.label_positions,
                             images=image_inputs(batch.fields))  # fmt: skip
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        ours_s = time.perf_counter() - start
        hf = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
        linears = r"(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
        lora = LoraConfig(
            r=4, lora_alpha=8, target_modules=rf"model\.text_model\.layers\.\d+\.{linears}"
        )
        trainer = SFTTrainer(
            model=hf, processing_class=AutoProcessor.from_pretrained(folder), peft_config=lora,
            train_dataset=datasets.Dataset.from_list(data),
            args=SFTConfig(
                output_dir=str(Path(tmp) / "trl"), per_device_train_batch_size=per_step,
                num_train_epochs=1, learning_rate=1e-4, lr_scheduler_type="constant",
                logging_steps=1000, save_strategy="no", report_to=[], use_cpu=True,
                bf16=False, dataloader_num_workers=0, max_length=None, seed=0,
            ),
        )  # fmt: skip
        start = time.perf_counter()
        out = trainer.train()
        trl_wall_s = time.perf_counter() - start
        trl_s = out.metrics["train_runtime"]  # the trainer's own: its training loop only
        trl_steps = trainer.state.global_step
        # What TRL's batches compute: each batch padded to its longest row.
        order = list(range(len(examples)))
        computed = sum(
            len(order[i : i + per_step]) * max(len(examples[j]) for j in order[i : i + per_step])
            for i in range(0, len(order), per_step)
        )  # the trainer's sampler shuffles: its own batches differ, a like-for-like estimate
    report = {
        "model": "idefics3", "rows": args.rows, "tokens": real, "images": images,
        "slipstream_micro_batches": len(batches), "trl_steps": trl_steps,
        "trl_rows_per_step": per_step, "trl_padded_positions_est": computed,
        "slipstream_prep_s": round(prep_s, 2), "slipstream_s": round(ours_s, 2),
        "trl_s": round(trl_s, 2), "trl_wall_s": round(trl_wall_s, 2),
        "trl_num_tokens": out.metrics.get("num_tokens"),
        "slipstream_tokens_per_s": round(real / ours_s, 1),
        "trl_tokens_per_s": round(real / trl_s, 1),
        "slipstream_images_per_s": round(images / ours_s, 2),
        "trl_images_per_s": round(images / trl_s, 2),
        "speedup": round(trl_s / ours_s, 2),
        "speedup_with_prep": round(trl_s / (ours_s + prep_s), 2),
        "load_average": os.getloadavg()[0],
    }  # fmt: skip
    return report


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rows", type=int, default=48)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--trl", action="store_true", help="against TRL's SFTTrainer (Idefics3)")
    p.add_argument("--wide", action="store_true", help="a wider Qwen2.5-VL, images to 448 px")
    p.add_argument(
        "--implementation",
        choices=["transformers", "native"],
        default="transformers",
        help="slipstream's path: the generic one (the published rows) or native",
    )
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.tokens, args.reps = 8, 256, 1
    if args.trl:
        report = trl_vs_ours(args)
        print(json.dumps(report, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
        return report
    torch.manual_seed(0)
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        wide = dict(text=WIDE_TEXT, vision=WIDE_VISION) if args.wide else {}
        folder = vlm_folder(Path(tmp), "qwen2_5_vl", **wide)
        max_side = 140
        if args.wide:  # the processor's pixel budget up to 448 x 448
            max_side = WIDE_MAX_SIDE
            pre = folder / "preprocessor_config.json"
            config = json.loads(pre.read_text())
            config["max_pixels"] = config["size"]["longest_edge"] = max_side * max_side
            pre.write_text(json.dumps(config))
        tok = AutoTokenizer.from_pretrained(folder)
        side = ImageProcessing.from_model(str(folder), tok)
        data = rows(args.rows, 0, max_side)
        examples, _ = tokenize_rows(data, tok, max_tokens=args.tokens, images=side)
        batches = pack_examples([len(ex) for ex in examples], args.tokens)
        # transformers: the generic path, as docs/benchmarks.md's first rows were measured.
        ours = slipstream.load_model(folder, implementation=args.implementation)
        slipstream.apply_lora(ours, rank=4, alpha=8)
        hf = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
        linears = r"(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
        targets = rf"model\.language_model\.layers\.\d+\.{linears}"
        theirs = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
        pad = tok.pad_token_id or 0
        results = {"ours": [], "padded": []}
        real = sum(len(ex) for ex in examples)
        images = sum(len(ex.sizes) for ex in examples if isinstance(ex, ImageExample))
        computed = sum(len(b) * max(len(examples[i]) for i in b) for b in batches)
        for _ in range(args.reps):
            for name in results:
                start = time.perf_counter()
                for b in batches:
                    chosen = [examples[i] for i in b]
                    if name == "ours":
                        batch = collate(chosen)
                        loss = ours.loss(batch.input_ids, batch.labels, batch.seq, reduction="sum",
                                         label_positions=batch.label_positions,
                                         images=image_inputs(batch.fields))  # fmt: skip
                    else:
                        loss = theirs(**padded_inputs(chosen, side, pad)).loss
                    loss.backward()
                results[name].append(time.perf_counter() - start)
    best = {k: min(v) for k, v in results.items()}
    report = {
        "implementation": args.implementation, "wide": args.wide,
        "rows": args.rows, "micro_batches": len(batches), "tokens": real, "images": images,
        "padded_positions": computed, "padding_ratio": round(real / computed, 3),
        "load_average": os.getloadavg()[0],
    }  # fmt: skip
    for name, seconds in best.items():
        report[f"{name}_s"] = round(seconds, 3)
        report[f"{name}_tokens_per_s"] = round(real / seconds, 1)
        report[f"{name}_images_per_s"] = round(images / seconds, 2)
    report["speedup"] = round(best["padded"] / best["ours"], 2)
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
