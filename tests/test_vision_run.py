"""Image+text runs through the CLI on a tiny LLaVA: `slipstream preview` shows each image's
size after resizing and its feature rows; `slipstream train` trains LoRA on the language
model from a jsonl whose image paths are relative to it, and the adapter loads in peft on
AutoModelForImageTextToText; a data file whose every image is missing is one line, exit 2."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
import yaml
from helpers.tiny_vlm import vlm_folder, write_images, write_picture_rows
from peft import PeftModel

from slipstream import cli


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision_run")
    folder = vlm_folder(root / "model", "llava")
    (root / "data" / "pics").mkdir(parents=True)
    names = write_images(root / "data" / "pics", [(40, 60), (30, 30), (12, 50)])
    rows = []
    for i in range(12):
        pics = [f"pics/{names[i % 3]}"] + ([f"pics/{names[(i + 1) % 3]}"] if i % 2 else [])
        parts = [{"type": "image"} for _ in pics] + [{"type": "text", "text": "Which is it?"}]
        reply = f"It is picture {i % 3}."
        turns = [{"role": "user", "content": parts}, {"role": "assistant", "content": reply}]
        rows.append({"messages": turns, "images": pics})
    data = root / "data" / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder, data, root


def _config(run_dir, out, **train):
    folder, data, root = run_dir
    raw = {
        "model": {"path": str(folder)},
        "data": {"train": str(data)},
        "train": {
            "finetune": "lora",
            "lr": 1e-2,
            "steps": 2,
            "tokens_per_batch": 256,
            "log_every": 1,
            "device": "cpu",
            **train,
        },  # fmt: skip
        "lora": {"rank": 4, "alpha": 8},
        "output_dir": str(out),
    }
    path = root / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_preview_shows_image_sizes_and_rows(run_dir, tmp_path, capsys):
    assert cli.main(["preview", str(_config(run_dir, tmp_path / "out"))]) == 0
    out = capsys.readouterr().out
    assert "<image 1: 28x28, rows " in out and "rows 12: kept 12, skipped 0" in out
    assert "<image><image>" not in out  # the feature rows are one marker, not 16 tokens


def test_train_then_the_adapter_loads_in_peft_on_the_image_text_model(run_dir, tmp_path):
    folder, _, _ = run_dir
    out = tmp_path / "out"
    assert cli.main(["train", str(_config(run_dir, out))]) == 0
    losses = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in losses if "loss" in r] == [1, 2]
    hf = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, out)
    assert not [n for n, _ in peft_model.named_modules() if "vision_tower" in n and "lora_A" in n]
    # The processor files travel with the adapter: the run folder holds the whole processor.
    processor = transformers.AutoProcessor.from_pretrained(out)
    assert processor.image_token == "<image>" and processor.patch_size == 7


def test_missing_images_are_one_line_exit_2(run_dir, tmp_path, capsys):
    folder, data, root = run_dir
    bad = root / "elsewhere.jsonl"  # the same rows, away from their pictures
    bad.write_text(data.read_text())
    raw = yaml.safe_load(_config(run_dir, tmp_path / "out").read_text())
    raw["data"]["train"] = str(bad)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert cli.main(["preview", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "image_missing 12" in err[0] and "pics/img0.png" in err[0]


def test_generate_with_image_from_the_run_folder(run_dir, tmp_path, capsys):
    folder, data, _ = run_dir
    out = tmp_path / "out"
    assert cli.main(["train", str(_config(run_dir, out))]) == 0
    image = str(data.parent / "pics" / "img1.png")
    capsys.readouterr()
    argv = ["generate", str(out), "Which is it?", "--image", image, "--max-new-tokens", "5"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    import slipstream
    from slipstream.checkpoint.adapter import load_adapter

    model = load_adapter(slipstream.load_model(folder), out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    prompt = [{"role": "user", "content": [{"type": "image", "path": image},
                                           {"type": "text", "text": "Which is it?"}]}]  # fmt: skip
    (c,) = slipstream.generate(model, [prompt], tokenizer=tok, max_new_tokens=5)
    assert printed == c.text.strip()
    capsys.readouterr()
    assert cli.main(["generate", str(out), "hi", "--image", "nope.png"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--image nope.png: no such image file" in err[0]


def test_generate_a_jsonl_of_image_prompts(run_dir, tmp_path):
    import slipstream

    folder, data, _ = run_dir
    prompts = [
        [{"role": "user", "content": [{"type": "image", "path": "pics/img0.png"},
                                      {"type": "text", "text": "Which is it?"}]}],
        [{"role": "user", "content": "Hello"}],
    ]  # fmt: skip
    src, out = data.parent / "prompts.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"messages": p}) + "\n" for p in prompts))
    argv = ["generate", str(folder), "--input", str(src), "--output", str(out),
            "--max-new-tokens", "4"]  # fmt: skip
    assert cli.main(argv) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    prompts[0][0]["content"][0]["path"] = str(data.parent / "pics" / "img0.png")
    expected = slipstream.generate(slipstream.load_model(folder), prompts, tokenizer=tok,
                                   max_new_tokens=4)  # fmt: skip
    assert [r["token_ids"] for r in rows] == [c.token_ids for c in expected]
    assert rows[0]["token_ids"] != rows[1]["token_ids"]


def test_chat_with_an_image_answers_as_generate(run_dir, monkeypatch, capsys):
    import io

    import slipstream

    folder, data, _ = run_dir
    image = str(data.parent / "pics" / "img2.png")
    monkeypatch.setattr("sys.stdin", io.StringIO("Which is it?\n/exit\n"))
    assert cli.main(["chat", str(folder), "--image", image, "--max-new-tokens", "4"]) == 0
    reply = capsys.readouterr().out.split("assistant> ")[1].split("\n")[0]
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    prompt = [{"role": "user", "content": [{"type": "image", "path": image},
                                           {"type": "text", "text": "Which is it?"}]}]  # fmt: skip
    (c,) = slipstream.generate(slipstream.load_model(folder), [prompt], tokenizer=tok,
                               max_new_tokens=4)  # fmt: skip
    assert reply.strip() == c.text.strip() and reply.strip()


def test_gemma3_image_rows_train_natively_and_generate_with_an_image(tmp_path, capsys):
    """Gemma 3's native family trains image rows (no switch to transformers' code); its
    adapter loads in peft and on the generic image-text path, which generates the same."""
    import slipstream
    from slipstream.checkpoint.adapter import load_adapter

    root = tmp_path
    folder = vlm_folder(root / "model", "gemma3")
    data = write_picture_rows(root / "data", [(40, 60), (30, 30)])
    out = root / "out"
    assert cli.main(["train", str(_config((folder, data, root), out))]) == 0
    said = capsys.readouterr()
    assert "gemma3: native family" in said.out + said.err
    hf = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, out)
    lora = [n for n, _ in peft_model.named_modules() if n.endswith("lora_A")]
    assert lora and not [n for n in lora if "vision_tower" in n]
    image = str(data.parent / "pics" / "img1.png")  # write_images' names
    argv = ["generate", str(out), "Which is it?", "--image", image, "--max-new-tokens", "4"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    model = load_adapter(slipstream.load_model(folder, implementation="transformers"), out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    prompt = [{"role": "user", "content": [{"type": "image", "path": image},
                                           {"type": "text", "text": "Which is it?"}]}]  # fmt: skip
    (c,) = slipstream.generate(model, [prompt], tokenizer=tok, max_new_tokens=4)
    assert printed == c.text.strip()
    # A text prompt: the same.
    assert cli.main(["generate", str(out), "Which is it?", "--max-new-tokens", "4"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    chat = [[{"role": "user", "content": "Which is it?"}]]  # as the CLI wraps a prompt
    (c,) = slipstream.generate(model, chat, tokenizer=tok, max_new_tokens=4)
    assert printed == c.text.strip()


def test_two_ranks_train_image_rows_as_one_process(run_dir, tmp_path):
    """Under torchrun each rank tokenizes its share of the rows and every rank collates
    examples another rank made: their images travel as sources (data/images.py), so each
    rank reprocesses them with its own image processor. Two DDP ranks at grad_accum 1 make
    the losses one process makes at grad_accum 2 (the same global batches)."""
    from helpers.runs import losses
    from helpers.torchrun import check, train_job

    single = yaml.safe_load(_config(run_dir, tmp_path / "single", grad_accum=2).read_text())
    single["model"]["dtype"] = "float32"
    assert cli.main(["train", str(_write(tmp_path / "single.yaml", single))]) == 0
    raw = yaml.safe_load(_config(run_dir, tmp_path / "ddp", parallel="ddp").read_text())
    raw["model"]["dtype"] = "float32"
    check(train_job(raw, tmp_path))
    one, two = losses(tmp_path / "single"), losses(tmp_path / "ddp")
    assert sorted(one) == sorted(two) == [1, 2]
    assert all(abs(one[s] - two[s]) <= 1e-4 * abs(one[s]) for s in one), (one, two)


def _write(path, raw):
    path.write_text(yaml.safe_dump(raw))
    return path
