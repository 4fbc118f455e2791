"""Tiny random image-text checkpoints with their processors, built offline for tests: a
byte-level BPE tokenizer with the model's image tokens added and a chat template that prints
image parts, the model type's processor (or, where its class needs torchvision, its image
processor alone), and the model from transformers' config classes, float32.

`vlm_folder(out, kind)` writes a folder `load_model`, `AutoProcessor` and
`AutoModelForImageTextToText` read; `random_image(h, w, seed)` a PIL image;
`write_images(folder, sizes)` PNG files.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from helpers.tokenizers import save_test_tokenizer

# A ChatML template over content parts: `image` parts print PLACEHOLDER.
TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ 'PLACEHOLDER' }}"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
VISION = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2)
TEXT = dict(
    hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=512, initializer_range=0.2,
)  # fmt: skip


QWEN_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
GEMMA3_TOKENS = {
    "boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
    "eoi_token": "<end_of_image>",
}  # fmt: skip
# Gemma 4's begin-of-image, image (what the template prints), end-of-image, video and audio
# tokens (test stand-ins; config.json names them by id).
GEMMA4_TOKENS = ["<|image>", "<|image|>", "<image|>", "<|video|>", "<|audio|>", "<|audio>",
                 "<audio|>"]  # fmt: skip
IDEFICS3_TOKENS = [
    "<image>", "<fake_token_around_image>", "<global-img>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 5) for c in range(1, 5)),
]  # fmt: skip


def random_image(height: int, width: int, seed: int = 0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((height, width, 3)) * 255).astype("uint8"))


def write_images(folder: Path, sizes: list[tuple[int, int]]) -> list[str]:
    """PNG files img{i}.png of these (height, width) in `folder`; their names."""
    names = []
    for i, (h, w) in enumerate(sizes):
        names.append(f"img{i}.png")
        random_image(h, w, seed=i).save(folder / names[-1])
    return names


def write_picture_rows(folder: Path, sizes: list[tuple[int, int]], n: int = 6) -> Path:
    """`n` image rows asking "Which is it?" of one of the pictures of these sizes (written to
    folder/pics, referenced by relative path), answered "Picture k."; the jsonl path."""
    (folder / "pics").mkdir(parents=True, exist_ok=True)
    names = write_images(folder / "pics", sizes)
    rows = []
    for i in range(n):
        k = i % len(names)
        parts = [{"type": "image"}, {"type": "text", "text": "Which is it?"}]
        turns = [{"role": "user", "content": parts},
                 {"role": "assistant", "content": f"Picture {k}."}]  # fmt: skip
        rows.append({"messages": turns, "images": [f"pics/{names[k]}"]})
    data = folder / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def run_config(path: Path, folder: Path, data: Path, out: Path, **sections) -> Path:
    """A 2-step LoRA run's YAML at `path` (r4, lr 1e-2, 256 tokens a batch, CPU); `sections`
    update the config's sections (`train={...}`, `lora={...}`, `vision={...}`)."""
    import yaml

    raw = {
        "model": {"path": str(folder)},
        "data": {"train": str(data)},
        "train": {"finetune": "lora", "lr": 1e-2, "steps": 2, "tokens_per_batch": 256,
                  "log_every": 1, "device": "cpu"},
        "lora": {"rank": 4, "alpha": 8},
        "output_dir": str(out),
    }  # fmt: skip
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    path.write_text(yaml.safe_dump(raw))
    return path


def _tokenizer(out: Path, tokens: list[str], placeholder: str, named: dict | None = None):
    """`named`: model-specific special tokens the processor reads as attributes
    (`tokenizer.boi_token`: Gemma 3)."""
    from transformers import AutoTokenizer

    save_test_tokenizer(out, "chatml", vocab_size=300)
    tok = AutoTokenizer.from_pretrained(out, **({"extra_special_tokens": named} if named else {}))
    if tokens:
        tok.add_special_tokens({"additional_special_tokens": tokens})
    tok.chat_template = TEMPLATE.replace("PLACEHOLDER", placeholder)
    return tok


def vlm_folder(
    out: Path,
    kind: str = "llava",
    seed: int = 0,
    text: dict | None = None,
    vision: dict | None = None,
) -> Path:
    """A saved tiny `kind` checkpoint with processor files (module docstring); `text`:
    Gemma 3's, Gemma 4's or Qwen2.5-VL's text config overrides; `vision`: Qwen2.5-VL's tower
    config overrides (benchmarks/bench_vision.py's wider model)."""
    import transformers

    out = Path(out)
    if kind == "llava":
        tok = _tokenizer(out, ["<image>"], "<image>")
        image = transformers.CLIPImageProcessor(
            size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}
        )
        processor = transformers.LlavaProcessor(
            image_processor=image, tokenizer=tok, patch_size=7, num_additional_image_tokens=1,
            vision_feature_select_strategy="default", chat_template=tok.chat_template,
        )  # fmt: skip
        vision = transformers.CLIPVisionConfig(**VISION, image_size=28, patch_size=7)
        config = transformers.LlavaConfig(
            vision_config=vision.to_dict(),
            text_config=transformers.LlamaConfig(vocab_size=len(tok), **TEXT).to_dict(),
            image_token_index=tok.convert_tokens_to_ids("<image>"),
            projector_hidden_act="gelu", vision_feature_layer=-1,
        )  # fmt: skip
    elif kind == "qwen2_5_vl":  # its processor class needs torchvision: the image one only
        tok = _tokenizer(out, QWEN_TOKENS, "".join(QWEN_TOKENS))
        processor = transformers.Qwen2VLImageProcessor(
            min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16, patch_size=14, merge_size=2
        )
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}
        vision = dict(
            depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=32,
            patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
            fullatt_block_indexes=[0],
        ) | (vision or {})  # fmt: skip
        config = transformers.Qwen2_5_VLConfig(
            text_config={**TEXT, "vocab_size": len(tok), "rope_parameters": rope, **(text or {})},
            vision_config=vision,
            image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
            vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        )
    elif kind == "mistral3":  # PixtralProcessor needs torchvision: its image processor only
        tok = _tokenizer(out, ["[IMG]", "[IMG_BREAK]", "[IMG_END]"], "[IMG]")
        processor = transformers.PixtralImageProcessor(size={"longest_edge": 56}, patch_size=7)
        vision = transformers.PixtralVisionConfig(**VISION, image_size=56, patch_size=7, head_dim=8)
        config = transformers.Mistral3Config(
            vision_config=vision.to_dict(),
            text_config=transformers.MistralConfig(vocab_size=len(tok), **TEXT).to_dict(),
            image_token_index=tok.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2,
            vision_feature_layer=-1,
        )  # fmt: skip
    elif kind == "qwen3_vl":  # deepstack: tower features also enter the first decoder layers
        tok = _tokenizer(out, QWEN_TOKENS, "".join(QWEN_TOKENS))
        processor = transformers.Qwen2VLImageProcessor(
            min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 16, patch_size=16, merge_size=2
        )
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
                "mrope_interleaved": True}  # fmt: skip
        vision = dict(
            depth=2, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=32,
            patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
            num_position_embeddings=16, deepstack_visual_indexes=[0, 1],
        )  # fmt: skip
        config = transformers.Qwen3VLConfig(
            text_config=dict(vocab_size=len(tok), rope_parameters=rope, **TEXT),
            vision_config=vision,
            image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
            vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        )
    elif kind in ("qwen3_5", "qwen3_5_moe"):  # DeltaNet + gated attention, interleaved mRoPE
        tok = _tokenizer(out, QWEN_TOKENS, "".join(QWEN_TOKENS))
        processor = transformers.Qwen2VLImageProcessor(
            min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 16, patch_size=16, merge_size=2
        )
        # head_dim 16, half of it rotary: 4 frequencies, t/h/w each own at least one.
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                "mrope_interleaved": True, "partial_rotary_factor": 0.5}  # fmt: skip
        text = dict(
            TEXT, vocab_size=len(tok), rope_parameters=rope, head_dim=16,
            layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
            linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        )  # fmt: skip
        if kind == "qwen3_5_moe":
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                        shared_expert_intermediate_size=16)  # fmt: skip
        vision = dict(
            depth=2, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=32,
            patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
            num_position_embeddings=16,
        )  # fmt: skip
        config_class = (
            transformers.Qwen3_5Config if kind == "qwen3_5" else transformers.Qwen3_5MoeConfig
        )
        config = config_class(
            text_config=text, vision_config=vision,
            image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
            vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
            vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"),
        )  # fmt: skip
    elif kind == "gemma3":  # a SigLIP tower pooled to 4 tokens an image, seen bidirectionally
        tok = _tokenizer(out, [], GEMMA3_TOKENS["boi_token"], GEMMA3_TOKENS)
        tok.save_pretrained(out)  # the processor reads the named tokens from the saved files
        tok = transformers.AutoTokenizer.from_pretrained(out)
        tok.chat_template = TEMPLATE.replace("PLACEHOLDER", GEMMA3_TOKENS["boi_token"])
        image = transformers.Gemma3ImageProcessor(size={"height": 28, "width": 28})
        processor = transformers.Gemma3Processor(
            image_processor=image, tokenizer=tok, image_seq_length=4,
            chat_template=tok.chat_template,
        )  # fmt: skip
        text = {**dict(
            TEXT, vocab_size=len(tok), query_pre_attn_scalar=12, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
        ), **(text or {})}  # fmt: skip
        config = transformers.Gemma3Config(
            text_config=text,
            vision_config=dict(VISION, image_size=28, patch_size=7),
            mm_tokens_per_image=4,
            boi_token_index=tok.boi_token_id,
            eoi_token_index=tok.eoi_token_id,
            image_token_index=tok.image_token_id,
        )
    elif kind == "gemma4":  # patches of each image's own grid, pooled 3x3; Gemma4Processor
        # builds a video processor (torchvision): the image processor alone is saved.
        tok = _tokenizer(out, GEMMA4_TOKENS, GEMMA4_TOKENS[1])
        processor = transformers.Gemma4ImageProcessorPil(
            patch_size=4, max_soft_tokens=70, pooling_kernel_size=3
        )
        from helpers.tiny_hf import gemma4_text

        text = {**TEXT, **gemma4_text(2), "vocab_size": len(tok),
                "vocab_size_per_layer_input": len(tok), "use_bidirectional_attention": "vision",
                "pad_token_id": 0, **(text or {})}  # fmt: skip
        vision = dict(
            VISION, num_key_value_heads=2, head_dim=8, patch_size=4, pooling_kernel_size=3,
            position_embedding_size=256,
        )  # fmt: skip
        ids = dict(zip(("boi_token_id", "image_token_id", "eoi_token_id", "video_token_id",
                        "audio_token_id", "boa_token_id", "eoa_token_index"),
                       tok.convert_tokens_to_ids(GEMMA4_TOKENS)))  # fmt: skip
        config = transformers.Gemma4Config(text_config=text, vision_config=vision, **ids)
    elif kind == "idefics3":  # images split into crops + a global view, 4 tokens each
        tok = _tokenizer(out, IDEFICS3_TOKENS, "<image>")
        image = transformers.Idefics3ImageProcessor(
            size={"longest_edge": 56}, max_image_size={"longest_edge": 28}
        )
        processor = transformers.Idefics3Processor(
            image_processor=image, tokenizer=tok, image_seq_len=4,
            chat_template=tok.chat_template,
        )  # fmt: skip
        vision = transformers.Idefics3VisionConfig(**VISION, image_size=28, patch_size=7)
        config = transformers.Idefics3Config(
            vision_config=vision.to_dict(),
            text_config=transformers.LlamaConfig(vocab_size=len(tok), **TEXT).to_dict(),
            image_token_id=tok.convert_tokens_to_ids("<image>"), scale_factor=2,
        )  # fmt: skip
    elif kind == "smolvlm":  # Idefics3's layout; its processor class needs torchvision (video)
        tok = _tokenizer(out, IDEFICS3_TOKENS, "<image>")
        processor = transformers.SmolVLMImageProcessor(
            size={"longest_edge": 56}, max_image_size={"longest_edge": 28}
        )
        vision = transformers.SmolVLMVisionConfig(**VISION, image_size=28, patch_size=7)
        config = transformers.SmolVLMConfig(
            vision_config=vision.to_dict(),
            text_config=transformers.LlamaConfig(vocab_size=len(tok), **TEXT).to_dict(),
            image_token_id=tok.convert_tokens_to_ids("<image>"), scale_factor=2,
        )  # fmt: skip
        (out / "processor_config.json").write_text(
            json.dumps({"image_seq_len": 4, "processor_class": "SmolVLMProcessor"})
        )
    else:
        raise ValueError(kind)
    processor.save_pretrained(out)
    tok.save_pretrained(out)
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(config).float()
    model.save_pretrained(out)
    (out / "slipstream_test.json").write_text(json.dumps({"kind": kind}))
    return out


def qwen2_5_vl_as_llama_cpp(folder: Path, seed: int = 0) -> Path:
    """The tiny Qwen2.5-VL of `vlm_folder` rebuilt as llama.cpp's qwen2.5vl graph runs it: two
    tower blocks, the first windowed and the second full (fullatt_block_indexes [1]), its fixed
    112-px window, random weights; the image processor allows up to 64 merged tokens (a 224 x
    112 picture stays as it is: two windows)."""
    import transformers

    cfg = json.loads((folder / "config.json").read_text())
    cfg["vision_config"].update(depth=2, fullatt_block_indexes=[1], window_size=112)
    (folder / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(seed)
    config = transformers.AutoConfig.from_pretrained(folder)
    transformers.AutoModelForImageTextToText.from_config(config).float().save_pretrained(folder)
    pre = json.loads((folder / "preprocessor_config.json").read_text())
    pre["max_pixels"] = 28 * 28 * 64
    pre["size"] = {**(pre.get("size") or {}), "longest_edge": 28 * 28 * 64}
    (folder / "preprocessor_config.json").write_text(json.dumps(pre))
    return folder


def qwen3_vl_as_llama_cpp(folder: Path, seed: int = 0) -> Path:
    """The tiny Qwen3-VL of `vlm_folder` rebuilt as llama.cpp's qwen3vl runs it: mRoPE
    sections its interleaved M-RoPE turns as transformers does ([2, 1, 1] over the 4
    frequencies: every one covered) and a third decoder layer, so the two deepstack features
    end before the last (checkpoint/gguf_qwen_vl.py says why); random weights."""
    import transformers

    cfg = json.loads((folder / "config.json").read_text())
    cfg["text_config"]["rope_parameters"]["mrope_section"] = [2, 1, 1]
    cfg["text_config"]["num_hidden_layers"] = 3
    (folder / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(seed)
    config = transformers.AutoConfig.from_pretrained(folder)
    transformers.AutoModelForImageTextToText.from_config(config).float().save_pretrained(folder)
    return folder


def mistral3_as_llama_cpp(folder: Path, seed: int = 0) -> Path:
    """The tiny Mistral 3 of `vlm_folder` rebuilt as llama.cpp's pixtral graph runs it: two
    tower blocks whose MLP is gated by SiLU (as Mistral Small 3.1's), the projector's norm eps
    1e-5 (llama.cpp's one eps; MistralConfig's default is 1e-6), random weights."""
    import transformers

    cfg = json.loads((folder / "config.json").read_text())
    # weights of 0.3 (transformers' 0.02 leaves attention uniform: RoPE would not show)
    cfg["vision_config"].update(hidden_act="silu", num_hidden_layers=2, initializer_range=0.2)
    cfg["text_config"]["rms_norm_eps"] = 1e-5
    (folder / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(seed)
    config = transformers.AutoConfig.from_pretrained(folder)
    transformers.AutoModelForImageTextToText.from_config(config).float().save_pretrained(folder)
    return folder


# Ministral 3's RoPE on the tiny text model, chosen so each part shows within a short prompt:
# positions from 16 on get the attention temperature (1 + 0.3 log 2 there); at base 100 and
# head_dim 8 the YaRN ramp spans frequencies 0..3 with beta_slow 0.25 (0..1 with 1, so the
# betas matter); factor 4 with mscale_all_dim 1 gives attention factor 1 (1.14 without it).
MINISTRAL3_ROPE = dict(
    rope_type="yarn", rope_theta=100.0, factor=4.0, original_max_position_embeddings=16,
    beta_fast=16.0, beta_slow=0.25, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.3,
)  # fmt: skip


def ministral3_text(folder: Path, **rope) -> Path:
    """The tiny Mistral 3 of `vlm_folder` with a Ministral 3 language model (its config only:
    the weights are a Mistral's); `rope`: MINISTRAL3_ROPE overrides (None drops a key). Then
    `mistral3_as_llama_cpp` builds its weights."""
    cfg = json.loads((folder / "config.json").read_text())
    text = {k: v for k, v in cfg["text_config"].items() if k not in ("rope_theta", "rope_scaling")}
    params = {k: v for k, v in {**MINISTRAL3_ROPE, **rope}.items() if v is not None}
    cfg["text_config"] = {**text, "model_type": "ministral3", "rope_parameters": params}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def peft_summed_loss(peft_model, examples, inputs) -> torch.Tensor:
    """transformers + peft's loss summed over labelled tokens, one example at a time
    (`inputs(ex)`: the model's keyword inputs of one example), backpropagated."""
    ref = 0
    for ex in examples:
        labels = torch.tensor([[i if t else -100 for i, t in zip(ex.input_ids, ex.trainable)]])
        out = peft_model(**inputs(ex), labels=labels)
        ref = ref + out.loss * int((labels[0, 1:] != -100).sum())
    ref.backward()
    return ref


def assert_tower_grads_match(ours, theirs, ours_model, theirs_model, least: int = 10) -> None:
    """The same random weighting of two towers' equal outputs backpropagated: every
    parameter's gradient equal (1e-4 rel, 1e-5 of its largest entry), at least `least` of
    them reached (every layer took part)."""
    weights = torch.randn_like(theirs)
    (theirs * weights).sum().backward()
    (ours * weights).sum().backward()
    grads = 0
    for (name, p), (_, q) in zip(ours_model.named_parameters(), theirs_model.named_parameters()):
        if q.grad is not None:
            grads += 1
            scale = q.grad.abs().max()
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5 * scale, msg=name)
    assert grads > least


def lora_step_matches_peft(ours, folder, examples, hf_inputs, adapter_dir, tower: str):
    """One LoRA step of our native image-text model (LoRA applied, `tower` "lora" or
    "frozen") against transformers + peft with our saved adapter: the same modules wrapped
    (the tower's only with tower LoRA), summed loss and every LoRA gradient equal, the
    tower's adapters reached. -> (the peft model, the packed batch's images)."""
    import transformers
    from peft import PeftModel

    import slipstream
    from slipstream.data import collate
    from slipstream.data.vision import image_inputs

    tower_prefix = f"{ours.vision['tower']}."
    wrapped = list(slipstream.peft.lora.lora_modules(ours))
    on_tower = [n for n in wrapped if n.startswith(tower_prefix)]
    assert bool(on_tower) == (tower == "lora") and len(wrapped) > len(on_tower)
    slipstream.save_adapter(ours, adapter_dir)
    b = collate(examples)
    images = image_inputs(b.fields)
    loss = ours.loss(b.input_ids, b.labels, b.seq, reduction="sum",
                     label_positions=b.label_positions, images=images)  # fmt: skip
    loss.backward()
    hf = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf.eval(), adapter_dir, is_trainable=True).eval()
    theirs = [n for n, _ in peft_model.named_modules() if n.endswith(".lora_A")]
    assert len(theirs) == len(wrapped)  # the same modules wrapped in peft, tower or not
    ref = peft_summed_loss(peft_model, examples, hf_inputs)
    torch.testing.assert_close(loss, ref, rtol=1e-4, atol=1e-5)
    assert_lora_grads_match(ours, peft_model)
    if tower == "lora":  # the tower's adapters got gradients
        grads = [p.grad for n, p in ours.named_parameters() if n.startswith(tower_prefix)
                 and p.requires_grad]  # fmt: skip
        assert grads and all(g is not None and g.abs().max() > 0 for g in grads)
    return peft_model, images


def packed_equals_alone(ours, examples, images) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Our logits of the packed micro-batch equal each example's alone (1e-4): (packed,
    [each example's alone])."""
    from slipstream.data import collate
    from slipstream.data.vision import image_inputs

    b = collate(examples)
    packed = ours(b.input_ids, b.seq, images=images)
    alone = [ours(c.input_ids, c.seq, images=image_inputs(c.fields))
             for c in (collate([ex]) for ex in examples)]  # fmt: skip
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-4, atol=1e-5)
    return packed, alone


def assert_lora_grads_match(ours, peft_model) -> None:
    """Every trained tensor's gradient equals peft's (1e-4 of its largest entry: float32);
    stacked expert factors compared in peft's layout (helpers.peft_grads)."""
    from helpers.peft_grads import lora_grads
    from slipstream.peft.names import adapter_key, model_layout, peft_path

    theirs = {n.replace(".default", ""): p for n, p in peft_model.named_parameters()}
    grads = lora_grads(ours)  # peft's keys (a native family's names mapped to its tree)
    layout = model_layout(ours)
    trained = [n for n, p in ours.named_parameters() if p.requires_grad and "lora_" not in n]
    grads.update({adapter_key(peft_path(n, layout)): ours.get_parameter(n).grad for n in trained})
    assert grads and set(grads) == {n for n, p in theirs.items() if p.requires_grad}
    for key, grad in grads.items():
        scale = theirs[key].grad.abs().max()
        torch.testing.assert_close(grad, theirs[key].grad, rtol=1e-4, atol=1e-4 * scale)


def randomise_constant_tensors(folder: Path, seed: int = 0, scale: float = 0.2) -> None:
    """Rewrite the checkpoint's constant tensors (norms at 1, biases and Gemma 3's projector at
    0 as transformers initialises them) with random values, so a comparison sees them."""
    from safetensors.torch import load_file, save_file

    path = Path(folder) / "model.safetensors"
    state = load_file(path)
    gen = torch.Generator().manual_seed(seed)
    for name, t in state.items():
        if t.is_floating_point() and t.numel() > 1 and bool((t == t.flatten()[0]).all()):
            state[name] = t + scale * torch.randn(t.shape, generator=gen, dtype=t.dtype)
    save_file(state, path, metadata={"format": "pt"})


TINY_AUDIO = dict(model_type="gemma4_audio", hidden_size=16, num_hidden_layers=1,
                  num_attention_heads=2, subsampling_conv_channels=[4, 4],
                  output_proj_dims=16)  # fmt: skip


def with_audio_tower(folder: Path, seed: int = 0) -> Path:
    """The tiny Gemma 4 of `vlm_folder` rebuilt with a tiny audio tower (as E2B/E4B have one),
    random weights."""
    import transformers

    cfg = json.loads((folder / "config.json").read_text())
    cfg["audio_config"] = TINY_AUDIO
    (folder / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(seed)
    config = transformers.AutoConfig.from_pretrained(folder)
    transformers.AutoModelForImageTextToText.from_config(config).float().save_pretrained(folder)
    return folder
