"""slipstream's Qwen-VL vision tower (models/qwen_vit.py) and its host-built metadata
(data/qwen_vit_meta.py) against transformers' own (tiny random towers, float32): the
metadata equals what transformers computes from `grid_thw` (cu_seqlens, window order,
rotary positions, interpolation taps) on grids that are and are not multiples of the window;
the features, deepstack features and every gradient (tower parameters, pixels) equal
transformers' tower on several images of different grids in one call; parameter names and
shapes are `model.visual`'s; the forward and backward make no host sync."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers.models import randomise_lora_b
from helpers.tiny_vlm import assert_lora_grads_match, peft_summed_loss, random_image, vlm_folder
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from transformers import vision_utils

import slipstream
from slipstream.data import collate, tokenize_rows
from slipstream.data import qwen_vit_meta as meta
from slipstream.data.vision import ImageExample, ImageProcessing, image_inputs
from slipstream.models.qwen_vit import QwenVisionTower

GRIDS = [(1, 6, 10), (1, 4, 4), (1, 10, 6), (1, 2, 2)]  # (t, h, w) patches; window: 2 units
VISION = dict(depth=3, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=32,
              spatial_merge_size=2, temporal_patch_size=2)  # fmt: skip


def _hf_tower(kind: str, seed: int = 0):
    """transformers' tower of `kind`, weights drawn wide enough that every part matters."""
    if kind == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m

        cfg = transformers.Qwen2_5_VLVisionConfig(
            **VISION, patch_size=14, window_size=56, fullatt_block_indexes=[1]
        )
        cls = m.Qwen2_5_VisionTransformerPretrainedModel
    else:
        from transformers.models.qwen3_vl import modeling_qwen3_vl as m

        cfg = transformers.Qwen3VLVisionConfig(
            **VISION, patch_size=16, num_position_embeddings=16, deepstack_visual_indexes=[0, 2]
        )
        cls = m.Qwen3VLVisionModel
    torch.manual_seed(seed)
    tower = cls._from_config(cfg).float()
    for p in tower.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return tower.eval()


def _pixels(cfg, grids, seed=1):
    n = sum(t * h * w for t, h, w in grids)
    g = torch.Generator().manual_seed(seed)
    width = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    return torch.randn(n, width, generator=g)


@pytest.mark.parametrize(
    "grids", [GRIDS, [(1, 8, 8)], [(2, 4, 6), (1, 14, 2)], [(1, 2, 16), (1, 12, 4)]]
)
def test_metadata_equals_transformers(grids):
    g = torch.tensor(grids)
    positions = vision_utils.get_vision_position_ids(g, 2)
    window = meta.vit_metadata(grids, meta.VitGeometry("window", 14, 2, window=2))
    index, cu_windows = vision_utils.get_vision_window_index(g, 2, window_size=56, patch_size=14)
    assert torch.equal(window[meta.WINDOW_INDEX], index)
    assert torch.equal(window[meta.WINDOW_SEQ].cu_seqlens, cu_windows)
    assert torch.equal(window[meta.WINDOW_REVERSE], torch.argsort(index))
    assert torch.equal(window[meta.SEQ].cu_seqlens, vision_utils.get_vision_cu_seqlens(g))
    in_windows = positions.view(-1, 4, 2)[index].reshape(-1, 2)  # transformers permutes cos/sin
    assert torch.equal(window[meta.ROTARY_POSITIONS], in_windows)
    learned = meta.vit_metadata(grids, meta.VitGeometry("learned", 16, 2, side=4))
    taps, weights = vision_utils.get_vision_interpolation_indices_and_weights(
        g, 4, mode="bilinear", align_corners=True, spatial_merge_size=2
    )
    assert torch.equal(learned[meta.INTERP_INDEX], taps)
    assert torch.equal(learned[meta.INTERP_WEIGHT], weights)
    assert torch.equal(learned[meta.ROTARY_POSITIONS], positions)
    assert learned[meta.SEQ].lengths == tuple(h * w for t, h, w in grids for _ in range(t))
    assert meta.WINDOW_SEQ not in learned


def test_geometry_from_configs_and_bad_grid():
    qwen25 = transformers.Qwen2_5_VLVisionConfig(window_size=112, patch_size=14)
    assert meta.VitGeometry.of(qwen25) == meta.VitGeometry("window", 14, 2, window=4)
    assert meta.VitGeometry.of(qwen25.to_dict(), "qwen2_5_vl") == meta.VitGeometry.of(qwen25)
    qwen3 = transformers.Qwen3VLVisionConfig(num_position_embeddings=2304)
    assert meta.VitGeometry.of(qwen3) == meta.VitGeometry("learned", 16, 2, side=48)
    with pytest.raises(ValueError, match="multiple of merge 2"):
        meta.vit_metadata([(1, 3, 4)], meta.VitGeometry.of(qwen3))


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_tower_and_gradients_equal_transformers(kind):
    hf = _hf_tower(kind)
    ours = QwenVisionTower.adopt(hf)
    theirs = {n: p for n, p in hf.named_parameters()}
    assert {n: p for n, p in ours.named_parameters()}.keys() == theirs.keys()
    assert all(p is theirs[n] for n, p in ours.named_parameters())  # the same objects
    fresh = QwenVisionTower.from_config(hf.config.to_dict(), kind)  # config.json's dict
    assert {n: p.shape for n, p in fresh.named_parameters()} == {
        n: p.shape for n, p in theirs.items()
    }
    pixels = _pixels(hf.config, GRIDS).requires_grad_()
    images = {"pixel_values": pixels, "image_grid_thw": torch.tensor(GRIDS),
              **meta.vit_metadata(GRIDS, ours.geometry)}  # fmt: skip
    feats, deepstack = ours(pixels, images)
    ref = hf(pixels, grid_thw=images["image_grid_thw"], return_dict=True)
    ref_deep = getattr(ref, "deepstack_features", None) or []
    assert len(deepstack) == len(ref_deep) == (2 if kind == "qwen3_vl" else 0)
    assert feats.shape == (sum(h * w for _, h, w in GRIDS) // 4, 32)
    scale = ref.pooler_output.abs().max().item()
    torch.testing.assert_close(feats, ref.pooler_output, rtol=1e-5, atol=1e-5 * scale)
    for a, b in zip(deepstack, ref_deep):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
    # transformers' own callers (its get_image_features, e.g. in its generate) get its object.
    called = ours(pixels, grid_thw=images["image_grid_thw"], return_dict=True)
    torch.testing.assert_close(called.pooler_output, feats, rtol=0, atol=0)
    for a, b in zip(getattr(called, "deepstack_features", None) or [], deepstack, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # Every gradient: one weighted sum of all outputs, through both towers.
    g = torch.Generator().manual_seed(2)
    weights = [torch.randn(f.shape, generator=g) for f in (feats, *deepstack)]
    params = [pixels, *theirs.values()]
    ours_g = torch.autograd.grad(sum((w * f).sum() for w, f in zip(weights, [feats, *deepstack])),
                                 params)  # fmt: skip
    ref_outs = [ref.pooler_output, *ref_deep]
    ref_g = torch.autograd.grad(sum((w * f).sum() for w, f in zip(weights, ref_outs)), params)
    for name, a, b in zip(["pixels", *theirs], ours_g, ref_g):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * b.abs().max().item(), msg=name)


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_tower_forward_and_backward_make_no_host_sync(kind):
    hf = _hf_tower(kind)
    ours = QwenVisionTower.adopt(hf)
    pixels = _pixels(hf.config, GRIDS).requires_grad_()
    images = meta.vit_metadata(GRIDS, ours.geometry)
    with slipstream.count_syncs() as syncs:
        feats, deepstack = ours(pixels, images)
        (feats.sum() + sum(d.sum() for d in deepstack)).backward()
    assert syncs.total == 0, syncs
    with slipstream.count_syncs() as theirs:  # what transformers' tower makes (docs/vision.md)
        hf(pixels, grid_thw=torch.tensor(GRIDS), return_dict=True).pooler_output.sum().backward()
    assert theirs.total > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_tower_matches_cpu_without_a_sync(kind, dtype):
    """On CUDA: bf16 takes varlen attention (non-causal), float32 one SDPA call per image or
    window; both against the CPU float32 tower, forward and the pixels' gradient, no sync."""
    import copy

    hf = _hf_tower(kind)
    ours = QwenVisionTower.adopt(hf)
    pixels = _pixels(hf.config, GRIDS).requires_grad_()
    images = meta.vit_metadata(GRIDS, ours.geometry)
    ref, ref_deep = ours(pixels, images)
    (ref_grad,) = torch.autograd.grad(ref.sum() + sum(d.sum() for d in ref_deep), pixels)
    cuda = QwenVisionTower.adopt(copy.deepcopy(hf).to("cuda", dtype))
    moved = {k: v.to("cuda") for k, v in images.items()}
    on_cuda = pixels.detach().to("cuda", dtype).requires_grad_()
    with slipstream.count_syncs() as syncs:
        feats, deepstack = cuda(on_cuda, moved)
        (feats.float().sum() + sum(d.float().sum() for d in deepstack)).backward()
    assert syncs.total == 0, syncs
    loose = dtype == torch.bfloat16  # 3 blocks of wide random weights in bf16
    for got, want in ((feats, ref), *zip(deepstack, ref_deep), (on_cuda.grad, ref_grad)):
        scale = want.abs().max().item()
        tol = (
            {"rtol": 5e-2, "atol": 5e-2 * scale} if loose else {"rtol": 1e-4, "atol": 1e-5 * scale}
        )
        torch.testing.assert_close(got.float().cpu(), want.detach(), **tol)


# ----------------------------------------------------------------- on the generic image path


def _row(sizes, reply, k):
    images = [random_image(h, w, seed=h + w + k) for h, w in sizes]
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": "Describe it."}]
    turns = [{"role": "user", "content": parts}, {"role": "assistant", "content": reply}]
    return {"messages": turns, "images": images}


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def qwen(request, tmp_path_factory):
    kind = request.param
    folder = vlm_folder(tmp_path_factory.mktemp(kind), kind)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    side = ImageProcessing.from_model(str(folder), tok)
    text = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}
    sizes = [[(50, 90)], [(100, 60), (30, 30)], [(9, 70), (40, 40), (64, 32)]]
    rows = [_row(s, r, k) for k, (s, r) in enumerate(zip(sizes, ["Wide.", "Two.", "Three."]))]
    examples, _ = tokenize_rows([*rows, text], tok, max_tokens=1024, images=side)
    return kind, folder, tok, side, examples


def _hf_inputs(ex, side):
    ids = torch.tensor([ex.input_ids])
    if not isinstance(ex, ImageExample):
        return {"input_ids": ids}
    return {
        "input_ids": ids,
        "mm_token_type_ids": (ids == side.image_token_id).int(),
        **ex.model_inputs(),
    }


def _generic(folder):
    """The generic path (`auto` takes the native Qwen2.5-VL family)."""
    return slipstream.load_model(folder, implementation="transformers")


def _tower_lora(folder):
    """The generic model with LoRA on every linear of the tower's blocks too (vision.tower:
    lora; the merger stays frozen)."""
    from slipstream.config_sections import VisionSection
    from slipstream.train.setup import vision_training

    model = _generic(folder)
    vision_training(model, VisionSection(tower="lora"), "lora", before_lora=True)
    slipstream.apply_lora(model, rank=4, alpha=8, targets="all-linear")
    return model


def test_generic_model_runs_our_tower_and_a_training_step_makes_no_host_sync(qwen):
    kind, folder, _, _, examples = qwen
    batch = collate(examples)
    images = image_inputs(batch.fields)
    assert images[meta.SEQ].lengths == tuple(h * w for _, h, w in images["image_grid_thw"].tolist())
    for model in (_generic(folder), _tower_lora(folder)):
        assert type(model.hf.model.visual) is QwenVisionTower
        if not slipstream.peft.lora.lora_modules(model):
            slipstream.apply_lora(model, rank=4, alpha=8)  # the default: a frozen tower
            assert model.image_features(images).grad_fn is None  # no graph kept for it
        moved = batch.to("cpu")
        images = image_inputs(moved.fields)
        with slipstream.count_syncs() as syncs:  # the whole step: tower, embedding, LM, loss
            loss = model.loss(moved.input_ids, moved.labels, moved.seq, reduction="sum",
                              label_positions=moved.label_positions, images=images)  # fmt: skip
            loss.backward()
        assert syncs.total == 0, syncs


def test_tower_lora_loss_grads_logits_and_export_equal_transformers_and_peft(qwen, tmp_path):
    kind, folder, tok, side, examples = qwen
    ours = _tower_lora(folder)
    wrapped = list(slipstream.peft.lora.lora_modules(ours))
    assert "model.visual.blocks.0.attn.qkv" in wrapped
    assert not [n for n in wrapped if ".merger." in n]
    randomise_lora_b(ours)
    slipstream.save_adapter(ours, tmp_path / "adapter")
    b = collate(examples)
    loss = ours.loss(b.input_ids, b.labels, b.seq, reduction="sum",
                     label_positions=b.label_positions, images=image_inputs(b.fields))  # fmt: skip
    loss.backward()
    hf = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "adapter", is_trainable=True).eval()
    assert "model.visual.blocks.0.attn.qkv" in {
        n.removeprefix("base_model.model.") for n, m in peft_model.named_modules()
        if isinstance(m, LoraLayer)
    }  # fmt: skip
    ref = peft_summed_loss(peft_model, examples, lambda ex: _hf_inputs(ex, side))
    torch.testing.assert_close(loss, ref, rtol=1e-4, atol=1e-5)
    assert_lora_grads_match(ours, peft_model)
    assert [n for n, p in ours.named_parameters() if ".visual.blocks." in n and p.grad is not None]
    ex = examples[2]  # three images of different grids
    c = collate([ex])
    with torch.no_grad():
        got = ours.eval()(c.input_ids, c.seq, images=image_inputs(c.fields))
        expected = peft_model(**_hf_inputs(ex, side)).logits[0]
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    slipstream.export_merged(ours, tmp_path / "merged", tokenizer=tok)
    back = transformers.AutoModelForImageTextToText.from_pretrained(
        tmp_path / "merged", dtype=torch.float32
    ).eval()
    assert type(back.model.visual) is not QwenVisionTower  # transformers' own, our weights
    with torch.no_grad():
        torch.testing.assert_close(back(**_hf_inputs(ex, side)).logits[0], got, rtol=1e-4,
                                   atol=1e-5)  # fmt: skip


def test_a_cli_run_trains_the_tower_lora_on_the_generic_path(qwen, tmp_path):
    """`slipstream train` (2 steps, vision.tower: lora) through the trainer's batches (the
    tower's SeqInfos moved with them); the adapter's tower factors load in peft."""
    import json

    import yaml

    from slipstream import cli

    kind, folder, *_ = qwen
    (tmp_path / "pics").mkdir()
    rows = []
    for i, (h, w) in enumerate([(50, 90), (100, 60), (30, 30), (64, 32)]):
        random_image(h, w, seed=i).save(tmp_path / "pics" / f"{i}.png")
        parts = [{"type": "image"}, {"type": "text", "text": "Which is it?"}]
        turns = [{"role": "user", "content": parts},
                 {"role": "assistant", "content": f"Picture {i}."}]  # fmt: skip
        rows.append({"messages": turns, "images": [f"pics/{i}.png"]})
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = {
        "model": {"path": str(folder), "implementation": "transformers"},
        "data": {"train": str(tmp_path / "train.jsonl")},
        "train": {"finetune": "lora", "lr": 1e-2, "steps": 2, "tokens_per_batch": 256,
                  "log_every": 1, "device": "cpu"},
        "lora": {"rank": 4, "alpha": 8, "targets": "all-linear"},
        "vision": {"tower": "lora"},
        "output_dir": str(tmp_path / "out"),
    }  # fmt: skip
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    assert cli.main(["train", str(tmp_path / "run.yaml")]) == 0
    hf = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "out")
    factors = dict(peft_model.named_parameters())
    key = "base_model.model.model.visual.blocks.0.attn.qkv.lora_B.default.weight"
    assert factors[key].abs().max() > 0  # trained (B starts at zero)
