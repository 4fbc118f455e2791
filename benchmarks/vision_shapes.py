"""Offline image+text example: a tiny LLaVA-style model learns to answer questions about
generated pictures of coloured shapes (slipstream/data/shapes.py), on CPU in minutes.

Run: `OMP_NUM_THREADS=2 python benchmarks/vision_shapes.py [--out runs/vision-shapes]`, which
1. writes the model folder: a random LLaVA from transformers' config classes (a CLIP tower over
   56 x 56 pictures in 8 x 8 patches, 49 image tokens; a 4-layer Llama of width 128) with
   SmolLM2's tokenizer (from the built-in GGUF, `<image>` added) and a real LlavaProcessor;
2. writes the data: 1,200 training rows and 150 held-out rows (another seed), a third each of
   "What colour is the shape?", "What shape is it?" and "How many squares are there?";
3. scores the held-out rows (greedy, the reply's first word against the answer), trains with
   `slipstream train configs/vision_shapes.yaml` (everything trains: tower, projector and
   language model, `train.finetune: full`), and scores them again;
4. prints per-question accuracy before and after beside chance, and writes `results.json`.

`--steps N` overrides the config's steps (a quick look: `--steps 20`). The numbers in
docs/vision.md are from this script.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = ROOT / "configs" / "vision_shapes.yaml"
TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_model_folder(out: Path, seed: int = 0) -> Path:
    """The random tiny LLaVA with its tokenizer and processor (module docstring)."""
    import torch
    import transformers

    from slipstream.checkpoint.tokenizer import load_tokenizer
    from slipstream.data.shapes import SIZE

    out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer("smollm2-demo")
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tok.chat_template = TEMPLATE
    image = transformers.CLIPImageProcessor(
        size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE}
    )
    processor = transformers.LlavaProcessor(
        image_processor=image, tokenizer=tok, patch_size=8, num_additional_image_tokens=1,
        vision_feature_select_strategy="default", chat_template=TEMPLATE,
    )  # fmt: skip
    vision = transformers.CLIPVisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        image_size=SIZE, patch_size=8,
    )  # fmt: skip
    text = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    config = transformers.LlavaConfig(
        vision_config=vision.to_dict(), text_config=text.to_dict(),
        image_token_index=tok.convert_tokens_to_ids("<image>"), projector_hidden_act="gelu",
        vision_feature_layer=-1, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(config).float()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def score(model_dir: Path, eval_path: Path, tokenizer_dir: Path) -> dict:
    """Greedy replies to the held-out rows -> {task: accuracy}, plus "all" and a sample."""
    import transformers

    import slipstream
    from slipstream.data.images import images_relative_to

    model = slipstream.load_model(model_dir)
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = [json.loads(line) for line in eval_path.read_text().splitlines()]
    prompts = []
    for row in rows:
        parts = [
            {"type": "image", "path": row["images"][0]},
            {"type": "text", "text": row["messages"][0]["content"][1]["text"]},
        ]
        prompts.append([{"role": "user", "content": parts}])
    with images_relative_to(eval_path):
        out = slipstream.generate(model, prompts, tokenizer=tok, max_new_tokens=4)
    right, total, replies = Counter(), Counter(), Counter()
    for row, c in zip(rows, out):
        words = c.text.strip().split()
        reply = words[0].strip(".,").lower() if words else ""
        answer = row["messages"][1]["content"]
        total[row["task"]] += 1
        right[row["task"]] += reply == answer
        replies[reply] += 1
    result = {task: right[task] / total[task] for task in sorted(total)}
    result["all"] = sum(right.values()) / sum(total.values())
    result["most_common_replies"] = replies.most_common(5)
    return result


def chance(eval_path: Path, train_path: Path) -> dict:
    """Accuracy of always giving each question's most common training answer."""
    train = [json.loads(line) for line in train_path.read_text().splitlines()]
    best = {}
    for task in {r["task"] for r in train}:
        answers = Counter(r["messages"][1]["content"] for r in train if r["task"] == task)
        best[task] = answers.most_common(1)[0][0]
    rows = [json.loads(line) for line in eval_path.read_text().splitlines()]
    right, total = Counter(), Counter()
    for r in rows:
        total[r["task"]] += 1
        right[r["task"]] += r["messages"][1]["content"] == best[r["task"]]
    out = {task: right[task] / total[task] for task in sorted(total)}
    out["all"] = sum(right.values()) / sum(total.values())
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/vision-shapes")
    p.add_argument("--steps", type=int, default=None)
    args = p.parse_args()
    import os

    import yaml

    from slipstream import cli
    from slipstream.data.shapes import write_shapes

    out = Path(args.out)
    start = time.perf_counter()
    model_dir = build_model_folder(out / "model")
    train_path, eval_path = write_shapes(out / "data")
    before = score(model_dir, eval_path, model_dir)
    raw = yaml.safe_load(CONFIG.read_text())
    raw["model"]["path"] = str(model_dir)
    raw["data"]["train"], raw["data"]["eval"] = str(train_path), str(eval_path)
    raw["output_dir"] = str(out / "train")
    if args.steps is not None:
        raw["train"]["steps"] = args.steps
    config = out / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    trained = time.perf_counter()
    code = cli.main(["train", str(config)])
    if code:
        return code
    train_s = time.perf_counter() - trained
    after = score(out / "train", eval_path, out / "train")
    base = chance(eval_path, train_path)
    print(f"{'question':10} {'chance':>7} {'before':>7} {'after':>7}")
    for task in [*sorted(base.keys() - {"all"}), "all"]:
        print(f"{task:10} {base[task]:7.1%} {before[task]:7.1%} {after[task]:7.1%}")
    print(f"replies before: {before['most_common_replies']}")
    print(f"replies after: {after['most_common_replies']}")
    result = {
        "chance": base, "before": before, "after": after, "steps": raw["train"]["steps"],
        "train_s": round(train_s, 1), "total_s": round(time.perf_counter() - start, 1),
        "load_average": os.getloadavg()[0],
    }  # fmt: skip
    (out / "results.json").write_text(json.dumps(result, indent=1))
    print(f"train {train_s:.0f} s, total {result['total_s']:.0f} s; {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
