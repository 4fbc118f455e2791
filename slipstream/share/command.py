"""`slipstream push RUN_DIR REPO_ID`: its arguments and handler (registered by cli.py)."""

from __future__ import annotations

import argparse
from typing import Any

EPILOG = (
    "The token is huggingface_hub's own (HF_TOKEN, or `hf auth login`); HF_ENDPOINT picks "
    "another endpoint. Uploaded: the adapter (or with --merged the merged model), the "
    "tokenizer, slipstream_config.yaml, loss.png, a model card README.md, and what the flags "
    "add; never checkpoints, the lock or summaries. A merged model and GGUF files are "
    "written to a temporary folder ($TMPDIR), never into the run."
)


def add_push_command(sub: Any) -> None:
    # fmt: off
    p = sub.add_parser(
        "push", help="upload a run (adapter or merged model, tokenizer, GGUF, model card) to "
        "the Hugging Face Hub", epilog=EPILOG,
    )
    p.add_argument("run_dir", help="a finished run's output_dir (or a PEFT adapter folder)")
    p.add_argument("repo_id", help="NAME (your namespace) or NAMESPACE/NAME")
    p.add_argument("--private", action="store_true",
                   help="make a new repo private (an existing one keeps its visibility)")
    p.add_argument("--merged", action="store_true",
                   help="upload the adapter merged into its base (a full model) instead")
    p.add_argument("--gguf", nargs="+", metavar="TYPE", default=[],
                   help="also GGUF files of these types (f16, q8_0, q4_k_m, ...) into gguf/; "
                   "RUN/gguf/'s own when `slipstream export` made them of these weights")
    p.add_argument("--revision", help="the branch to commit to (made from main if new)")
    p.add_argument("--logs", action="store_true",
                   help="also the training logs: metrics.jsonl and tensorboard/ events")
    p.add_argument("--stage", metavar="DIR",
                   help="write the folder that would be uploaded into DIR (new or empty; "
                   "the run's files linked) and upload nothing")
    # fmt: on
    p.set_defaults(run=cmd_push)


def cmd_push(args: argparse.Namespace) -> int:
    from slipstream.share.push import push_run

    done = push_run(
        args.run_dir, args.repo_id, private=args.private, merged=args.merged, gguf=args.gguf,
        revision=args.revision, logs=args.logs, stage=args.stage,
    )  # fmt: skip
    files = done["files"]
    if args.stage:
        print(f"slipstream: staged {len(files)} files in {args.stage} (nothing uploaded): "
              + ", ".join(files))  # fmt: skip
    else:
        print(f"slipstream: pushed {len(files)} files to {done['url']} ({done['commit']})")
    return 0
