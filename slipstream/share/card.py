"""The model card (`README.md`) a push uploads, built with `huggingface_hub.ModelCard`.

Metadata (YAML, what the Hub indexes): `base_model` (a hub id, when the base has one),
`library_name` (`peft` for an adapter, else `transformers`), `pipeline_tag`, `license` (the
base's), `datasets` (the run's data sources that are hub ids), `tags`. The text: how to use
it, how it was trained (objective, method, data sizes, the loop's settings, the loss plot),
what it scored (held-out loss before and after from summary.json; each `eval/<task>/<metric>`
line of metrics.jsonl at its last step), and the run's config. Everything is read from the
run folder; nothing in it is written.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import yaml

from slipstream.share.base import Base
from slipstream.share.files import GGUF_IN_REPO, RUN_CONFIG, read_json
from slipstream.sources import DATA_SUFFIXES, is_hub_id

PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
EVAL_PREFIX = "eval/"  # eval-task lines: eval/<task>/<metric> (train.eval_tasks)


def run_config(run: Path) -> dict[str, Any]:
    """The run's config.yaml as a dict ({} when absent: an adapter folder, not a run)."""
    path = run / RUN_CONFIG
    if not path.is_file():
        return {}
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def build_card(
    run: Path, repo_id: str, staged: list[str], base: Base, *, kind: str,
    merge_note: str | None = None,
) -> Any:  # fmt: skip
    """The ModelCard of a push of `run` to `repo_id`, whose repo will hold `staged` (repo
    paths); `kind`: "adapter", "merged" (an adapter merged into its base) or "model"."""
    from huggingface_hub import ModelCard, ModelCardData

    config = run_config(run)
    summary = read_json(run / "summary.json")
    ggufs = [f for f in staged if f.endswith(".gguf")]
    data = ModelCardData(
        base_model=base.hub_id,
        library_name="peft" if kind == "adapter" else "transformers",
        pipeline_tag="image-text-to-text"
        if any(f in staged for f in PROCESSOR_FILES)
        else "text-generation",
        license=base.license,
        datasets=hub_datasets(config) or None,
        tags=tags(config, kind, bool(ggufs)),
    )
    name = repo_id.rpartition("/")[2]
    parts = [
        f"# {name}\n",
        _intro(config, base, kind, merge_note),
        _usage(repo_id, base, kind, ggufs),
        _training(config, summary, staged),
        _evaluation(summary, eval_tasks(run / "metrics.jsonl")),
        _config_block(config),
    ]
    text = "\n".join(p for p in parts if p)
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{text}")


def hub_datasets(config: dict[str, Any]) -> list[str]:
    """The run's train and eval sources that are hub dataset ids (not local files)."""
    d = config.get("data") or {}
    found = []
    for key in ("train", "eval"):
        sources = d.get(key) or []
        for s in [sources] if isinstance(sources, str) else sources:
            local = Path(s).expanduser().exists() or Path(s).suffix.lower() in DATA_SUFFIXES
            if not local and is_hub_id(s) and s not in found:
                found.append(s)
    return found


def tags(config: dict[str, Any], kind: str, gguf: bool) -> list[str]:
    lora = config.get("lora") or {}
    method = lora.get("method", "lora" if kind != "model" else "full")
    found = ["slipstream", (config.get("train") or {}).get("objective", "sft")]
    if method == "lora":
        qlora = (config.get("model") or {}).get("quantization") == "nf4"
        found += ["lora", *(["qlora"] if qlora else [])]
        found += ["dora"] if lora.get("use_dora") else []
    else:
        found.append("full-fine-tuning")
    if gguf:
        found.append("gguf")
    return found


def eval_tasks(metrics: Path) -> dict[str, dict[str, tuple[int, float]]]:
    """{task: {metric: (step, value)}}: each eval/<task>/<metric> at its last logged step."""
    found: dict[str, dict[str, tuple[int, float]]] = {}
    if not metrics.is_file():
        return found
    for line in metrics.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a torn last line of an interrupted write
            continue
        if not isinstance(record, dict):
            continue
        for key, value in record.items():
            task, _, metric = key.removeprefix(EVAL_PREFIX).partition("/")
            if key.startswith(EVAL_PREFIX) and metric and isinstance(value, int | float):
                found.setdefault(task, {})[metric] = (int(record.get("step", 0)), float(value))
    return found


def _intro(config: dict[str, Any], base: Base, kind: str, merge_note: str | None) -> str:
    base_text = f"[{base.hub_id}](https://huggingface.co/{base.hub_id})" if base.hub_id else (
        f"a local model (`{Path(base.given).name}`)"
    )  # fmt: skip
    objective = (config.get("train") or {}).get("objective", "sft")
    what = {
        "adapter": "A LoRA adapter for",
        "merged": "A fine-tune of",
        "model": "A full fine-tune of",
    }[kind]
    text = f"{what} {base_text}, trained with slipstream (objective: `{objective}`)."
    if kind == "merged":
        text += " The adapter is merged into the base weights" + (
            f": {merge_note}" if merge_note else "."
        )
    return text + "\n"


def _usage(repo_id: str, base: Base, kind: str, ggufs: list[str]) -> str:
    lines = ["## Use it\n", "```python"]
    if kind == "adapter":
        lines += ["from peft import AutoPeftModelForCausalLM",
                  "from transformers import AutoTokenizer", "",
                  f'model = AutoPeftModelForCausalLM.from_pretrained("{repo_id}")',
                  f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")']  # fmt: skip
    else:
        lines += ["from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                  f'model = AutoModelForCausalLM.from_pretrained("{repo_id}")',
                  f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")']  # fmt: skip
    lines.append("```")
    if kind != "adapter" or base.hub_id:  # an adapter on a local base: that base is not here
        name = repo_id.rpartition("/")[2]
        lines += ["", f"With slipstream: `hf download {repo_id} --local-dir {name}`, then",
                  "", "```bash", f"slipstream chat {name}", "```"]  # fmt: skip
    if ggufs:
        lines += ["", f"GGUF files (llama.cpp, Ollama; `{GGUF_IN_REPO}/`): "
                  + ", ".join(f"`{Path(g).name}`" for g in ggufs) + ".", "", "```bash"]  # fmt: skip
        for g in ggufs:
            quant = Path(g).stem.rpartition(".")[2].upper()
            lines.append(f"llama-cli -hf {repo_id}:{quant}")
        lines.append("```")
    return "\n".join(lines) + "\n"


def _training(config: dict[str, Any], summary: dict[str, Any], staged: list[str]) -> str:
    if not config and not summary:
        return ""
    t, lora, d = config.get("train") or {}, config.get("lora") or {}, config.get("data") or {}
    rows = [("objective", f"`{t.get('objective', 'sft')}`")]
    if lora.get("method", "lora") == "lora":
        extra = [k for k in ("use_rslora", "use_dora") if lora.get(k)]
        targets = lora.get("targets", "all-linear")
        targets = ", ".join(targets) if isinstance(targets, list) else targets
        rows.append(("method", f"LoRA r={lora.get('rank')}, alpha={lora.get('alpha')}, "
                     f"targets {targets}" + "".join(f", {k}" for k in extra)))  # fmt: skip
        if (config.get("model") or {}).get("quantization") == "nf4":
            rows.append(("base weights", "NF4 (QLoRA)"))
    else:
        rows.append(("method", "full fine-tuning"))
    sources = d.get("train")
    if sources:
        names = [sources] if isinstance(sources, str) else list(sources)
        rows.append(("training data", ", ".join(f"`{_source_name(s)}`" for s in names)))
    report = summary.get("data_report") or {}
    if summary.get("train_examples") is not None:
        text = f"{summary['train_examples']:,} examples"
        if isinstance(report, dict) and report.get("rows") is not None:
            text += f" ({report.get('kept', 0):,} of {report['rows']:,} rows kept"
            text += f", {report.get('target_tokens', 0):,} trained tokens)"
        rows.append(("train examples", text))
    if summary.get("eval_examples"):
        rows.append(("held-out examples", f"{summary['eval_examples']:,}"))
    if summary.get("steps") is not None:
        rows.append(("optimizer steps", f"{summary['steps']:,}"))
    if summary.get("tokens_trained") is not None:
        rows.append(("tokens trained", f"{summary['tokens_trained']:,}"))
    if t.get("lr") is not None:
        rows.append(("learning rate", f"{t['lr']} ({t.get('schedule', 'cosine')}, warmup "
                     f"{t.get('warmup_steps', 0)})"))  # fmt: skip
    if t.get("tokens_per_batch") is not None:
        rows.append(("batch", f"{t['tokens_per_batch']:,} tokens a micro-batch (packed) x "
                     f"{t.get('grad_accum', 1)} accumulated"))  # fmt: skip
    if summary.get("seconds") is not None:
        rows.append(("time", f"{summary['seconds']:.0f} s on {summary.get('device', '?')}"))
    lines = ["## Training\n", "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]
    if "loss.png" in staged:
        lines += ["", "![training and held-out loss](loss.png)"]
    if "reward.png" in staged:
        lines += ["", "![rewards](reward.png)"]
    return "\n".join(lines) + "\n"


def _evaluation(summary: dict[str, Any], tasks: dict[str, dict[str, tuple[int, float]]]) -> str:
    lines = []
    before, after = summary.get("eval_loss_before"), summary.get("eval_loss_after")
    if after is not None:
        lines += ["Held-out data:", "", "| | before | after |", "|---|---|---|",
                  f"| loss | {_num(before)} | {_num(after)} |"]  # fmt: skip
        if summary.get("eval_ppl_after") is not None:
            ppl = _num(summary.get("eval_ppl_before")), _num(summary["eval_ppl_after"])
            lines.append(f"| perplexity | {ppl[0]} | {ppl[1]} |")
    if tasks:
        lines += ["", "Evaluation tasks (lm-evaluation-harness, at the last eval):", "",
                  "| task | metric | value | step |", "|---|---|---|---|"]  # fmt: skip
        for task, metrics in sorted(tasks.items()):
            for metric, (step, value) in sorted(metrics.items()):
                if metric.split(",")[0].endswith("_stderr"):
                    continue
                stderr = metrics.get(metric.replace(",", "_stderr,", 1) if "," in metric
                                     else f"{metric}_stderr")  # fmt: skip
                shown = _num(value) + (f" ± {_num(stderr[1])}" if stderr else "")
                lines.append(f"| {task} | {metric.removesuffix(',none')} | {shown} | {step} |")
    return "## Evaluation\n\n" + "\n".join(lines).lstrip("\n") + "\n" if lines else ""


def _config_block(config: dict[str, Any]) -> str:
    if not config:
        return ""
    text = yaml.safe_dump(config, sort_keys=False).rstrip()
    return ("## Run config\n\n<details><summary>slipstream_config.yaml "
            "(<code>slipstream train slipstream_config.yaml</code> reruns it)</summary>\n\n"
            f"```yaml\n{text}\n```\n\n</details>\n")  # fmt: skip


def _source_name(source: str) -> str:
    return source if is_hub_id(source) and not Path(source).exists() else Path(source).name


def _num(value: Any) -> str:
    if not isinstance(value, int | float) or not math.isfinite(value):
        return "-"
    return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
