"""The GPU suite's image+text row (gpu_suite.py): native Qwen2.5-VL at the 7B's published
shapes (text 3584 x 28 layers, the 32-block windowed tower of width 1280), random weights,
bf16, LoRA r16 on the language model's linear layers, tower frozen, offloaded checkpoints.

A step is one packed micro-batch of image rows built as the collator builds them
(`collate` over `ImageExample`s: host-found image rows, 3-D mRoPE positions, the tower's
window and sequence metadata, data/qwen_vit_meta.py): `IMAGES` images of mixed grids (each
its own patch count: 448 x 448 px is 1,024 patches, 256 image tokens), each with a random
text turn around it, ~16k tokens in all. The tower runs once over all of them, packed by
their own lengths. Reported beside the text rows' columns: images/s and the image-token
share of the batch.

`--dry-run` (gpu_suite.py): the same code on a tiny Qwen2.5-VL on CPU in seconds.
"""

from __future__ import annotations

import random
from typing import Any

import common
import torch
from gpu_rows import LORA, Setup, Variant, attention_backend, measure_steps

from slipstream.data import collate
from slipstream.data.mrope import mrope_positions
from slipstream.data.qwen_vit_meta import VitGeometry
from slipstream.data.vision import ImageExample, image_inputs

MODEL = "qwen2.5-vl-7b"
# (height, width) in patches (14 px): even, as the 2 x 2 merge needs; 16 rows of ~1k tokens.
GRIDS = [(32, 32), (24, 40), (40, 24), (16, 16), (28, 36), (20, 20), (36, 28), (32, 16)]
IMAGES = 16
TOKENS = 16_384
TEXT_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
               num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               max_position_embeddings=32768, tie_word_embeddings=False,
               rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                "mrope_section": [16, 24, 24]})  # fmt: skip
VISION_7B = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                 out_hidden_size=3584, patch_size=14, spatial_merge_size=2,
                 temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
                 hidden_act="silu")  # fmt: skip
TINY_VISION = dict(depth=2, hidden_size=16, intermediate_size=24, num_heads=2,
                   out_hidden_size=64, patch_size=14, spatial_merge_size=2,
                   temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])  # fmt: skip


def shapes(dry: bool) -> dict[str, Any]:
    """config.json of the row's model: the 7B's shapes, or tiny ones for the dry run."""
    if dry:
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
        text, vision = {**common.TINY, "rope_parameters": rope}, TINY_VISION
        vocab = text["vocab_size"]  # the image-side ids inside the tiny vocabulary
        ids = dict(image_token_id=vocab - 3, vision_start_token_id=vocab - 2,
                   vision_end_token_id=vocab - 1)  # fmt: skip
    else:
        text, vision, ids = TEXT_7B, VISION_7B, {}
    return common.hf_config("qwen2_5_vl", text_config=text, vision_config=vision, **ids)


def examples(hf: dict[str, Any], dry: bool, seed: int = 0) -> list[ImageExample]:
    """`IMAGES` image rows (module docstring): [text] <vision_start> image tokens
    <vision_end> [text], labels on the text after the image; pixels random."""
    rng = random.Random(seed)
    vision = hf["vision_config"]
    merge, patch, t = vision["spatial_merge_size"], vision["patch_size"], 2
    geometry = VitGeometry.of(vision, "qwen2_5_vl")
    image_id, start = hf["image_token_id"], hf["vision_start_token_id"]
    end = hf.get("vision_end_token_id", 151653)
    text_ids = min(hf["text_config"]["vocab_size"] - 8, 150_000)  # below the special tokens
    grids = [(4, 6), (2, 2), (6, 4), (2, 4)] if dry else GRIDS
    n_images = 4 if dry else IMAGES
    budget = (256 if dry else TOKENS) // n_images
    out = []
    for k in range(n_images):
        h, w = grids[k % len(grids)]
        n = h * w // merge**2
        words = max(8, budget - n - 2)
        before = [rng.randrange(text_ids) for _ in range(words // 4)]
        after = [rng.randrange(text_ids) for _ in range(words - words // 4)]
        ids = [*before, start, *([image_id] * n), end, *after]
        trainable = [False] * (len(ids) - len(after)) + [True] * len(after)
        pixels = torch.randn(h * w, 3 * t * patch * patch)
        grid = torch.tensor([[1, h, w]])
        positions = mrope_positions(ids, image_id, grid.tolist(), merge)
        out.append(ImageExample(
            ids, trainable, {"pixel_values": pixels, "image_grid_thw": grid}, image_id,
            [(h * patch, w * patch)], [n], positions, tower=geometry,
        ))  # fmt: skip
    return out


def vision_row(v: Variant, setup: Setup) -> dict:
    """ours, everything on, over one packed micro-batch of image rows (module docstring)."""
    from slipstream.peft.lora import apply_lora
    from slipstream.train.optim import build_optimizer

    hf = setup.shapes[v.model]
    model = common.build_random_model(hf, dtype=setup.dtype, device=setup.device)
    apply_lora(model, **LORA)  # the language model's projections; the tower stays frozen
    checkpointing = common.optional("slipstream.memory.offload", "apply_checkpointing")
    pool = checkpointing(model, v.ckpt, double_buffer=v.double_buffer,
                         timing=setup.device.type == "cuda",
                         force=setup.dry and v.ckpt == "offload")  # fmt: skip
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(
        model.named_parameters(), lr=1e-5, weight_decay=0.0, device=torch.device("cuda")
    )
    rows = examples(hf, setup.dry)
    host = collate(rows)
    n_labels = int((host.labels != -100).sum())
    n_image_tokens = sum(ex.image_tokens[0] for ex in rows)

    def step():
        batch = host.to(setup.device)  # the collator's host batch (built once), one copy
        images = image_inputs(batch.fields)
        loss = model.loss(batch.input_ids, batch.labels, batch.seq, reduction="sum",
                          label_positions=batch.label_positions, images=images)  # fmt: skip
        (loss / n_labels).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    row = measure_steps(step, setup, audit=True, offload_pool=pool)
    tokens = len(host.input_ids)
    row.update(
        notes=f"checkpointing={v.ckpt}; {len(rows)} images, {n_image_tokens} of {tokens} "
        "tokens image rows; tower frozen",
        packing="packed (varlen), tower packed by image",
        attention=attention_backend(setup.device, hf["text_config"]),
        tokens=tokens,
        images=len(rows),
    )
    row["images/s"] = len(rows) / row["step s"]
    return row
