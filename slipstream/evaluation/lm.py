"""slipstream's model as an lm-evaluation-harness `LM` (registered there as "slipstream").

Tokenization, windows and stop rules are lm-eval's HFLM's, so that the same model gives the
same numbers (tests/test_evaluation.py checks each request against HFLM's); the work is
slipstream's:
- `loglikelihood` (lm-eval's `TemplateLM` tokenizes context and continuation as HFLM does)
  and `loglikelihood_rolling` (lm-eval's rolling windows over the document, as HFLM) go to
  `evaluation.scoring.score`: packed token-budget batches, the head on scored rows only, one
  host read a batch;
- `generate_until`: the KV-cache engine (`generation.api.generate_rows`), prompts batched by
  their generation kwargs, stopped by lm-eval's `until` strings (and the eos text, as HFLM)
  and the eos token ids transformers' generate stops at, the context left-truncated to
  `max_length - max_gen_toks` as HFLM does.

On CPU in float32 the linear layers run on weights packed once per call
(generation/packed_linear.py), for the scoring batches as for generation.
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from slipstream.evaluation.scoring import score
from slipstream.generation.packed_linear import packed_linears

DEFAULT_MAX_LENGTH = 2048  # HFLM's when neither config nor tokenizer says
SEQLEN_KEYS = ("n_positions", "max_position_embeddings", "n_ctx")  # HFLM's order
TOKENIZER_INFINITY = 1000000000000000019884624838656  # transformers' "no limit"
SAMPLING_KEYS = {"do_sample", "temperature", "top_p", "top_k", "until", "max_gen_toks"}


def model_max_length(hf: dict, tokenizer: Any) -> int:
    """The context length lm-eval's HFLM gives a model: config (its text_config first), then
    the tokenizer's model_max_length, then 2048."""
    cfg = hf.get("text_config") or hf
    for key in SEQLEN_KEYS:
        if cfg.get(key) is not None:
            return int(cfg[key])
    limit = getattr(tokenizer, "model_max_length", None)
    if limit is not None and limit != TOKENIZER_INFINITY:
        return int(limit)
    return DEFAULT_MAX_LENGTH


def eos_token_ids(hf: dict, tokenizer: Any) -> set[int]:
    """What transformers' generate stops at (config.json's eos_token_id), and the tokenizer's
    eos, whose text HFLM stops at."""
    eos = (hf.get("text_config") or hf).get("eos_token_id", hf.get("eos_token_id"))
    ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


@register_model("slipstream")
class SlipstreamLM(TemplateLM):
    """`SlipstreamLM(model, tokenizer)`; by name, once this module is imported:
    `lm_eval.simple_evaluate(model="slipstream", model_args="pretrained=MODEL_OR_RUN_DIR")`
    (with `base=`, `device=`, `dtype=`, `max_length=`, `tokens_per_batch=` as wanted)."""

    def __init__(
        self,
        model: Any = None,
        tokenizer: Any = None,
        *,
        pretrained: str | None = None,
        base: str | None = None,
        device: str | None = None,
        dtype: str = "auto",
        max_length: int | None = None,
        tokens_per_batch: int = 8192,
        batch_size: int | str | None = None,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        progress: bool = True,
        **ignored: Any,
    ) -> None:
        super().__init__()
        if model is None:
            if pretrained is None:
                raise ValueError("SlipstreamLM needs a model and tokenizer, or pretrained=PATH")
            from slipstream.evaluation.tasks import load_for_eval

            model, tokenizer = load_for_eval(pretrained, base=base, device=device or "auto",
                                             dtype=dtype)  # fmt: skip
        self.model, self.tokenizer = model, tokenizer
        self._max_length = int(max_length) if max_length else None
        self.tokens_per_batch = int(tokens_per_batch)
        self.gen_batch_size = int(batch_size) if str(batch_size).isdigit() else 32
        self.add_bos_token, self.custom_prefix_token_id = add_bos_token, prefix_token_id
        self.progress = progress
        self._device = model.lm_head_weight().device
        self._warned: set[str] = set()

    # -- what lm-eval reads of a model ---------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length or model_max_length(self.model.config.hf, self.tokenizer)

    @property
    def max_gen_toks(self) -> int:
        return 256

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt=True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )  # fmt: skip

    def get_model_info(self) -> dict:
        return {"model_source": str(getattr(self.model, "source", "")),
                "model_dtype": str(self.model.lm_head_weight().dtype)}  # fmt: skip

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   left_truncate_len: int | None = None, **kwargs) -> list[int]:  # fmt: skip
        """HFLM's: the tokenizer's special tokens unless the text starts with the prefix
        token's text (or `add_bos_token` says otherwise)."""
        special = {}
        if add_special_tokens is not None:
            special = {"add_special_tokens": add_special_tokens}
        elif self.add_bos_token is not None:
            special = {"add_special_tokens": self.add_bos_token}
        if add_special_tokens is None and has_bos_prefix(
            string, self.tokenizer.decode(self.prefix_token_id)
        ):
            special = {"add_special_tokens": False}
        ids = self.tokenizer.encode(string, **special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # -- log-likelihoods -----------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """requests: ((context, continuation) or None, context ids, continuation ids)."""
        pairs = [(ctx, cont) for _, ctx, cont in requests]
        with self._bar(len(pairs), "loglikelihood", disable_tqdm) as bar, self._packed() as head:
            answers = score(self.model, pairs, max_length=self.max_length,
                            tokens_per_batch=self.tokens_per_batch, head=head,
                            on_batch=bar.update)  # fmt: skip
        for (key, _, _), answer in zip(requests, answers, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document in lm-eval's rolling windows of `max_length` tokens, each token
        predicted once, the first after the prefix token; all windows scored together."""
        windows, owners = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            ids = self.tok_encode(text)
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    ids, prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                    context_len=1)):  # fmt: skip
                windows.append((None, ctx, cont))
                owners.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[i] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # -- generation ----------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, as the task's kwargs say) continuations, cut at `until`."""
        from slipstream.generation.api import generate_rows

        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        out: list[str | None] = [None] * len(requests)
        eos_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        stop_ids = eos_token_ids(self.model.config.hf, self.tokenizer)
        with self._bar(len(requests), "generate_until", disable_tqdm) as bar:
            for members in groups.values():
                kw = normalize_gen_kwargs(requests[members[0]].args[1], self.max_gen_toks)
                until = handle_stop_sequences(kw.pop("until", None), eos=eos_text)
                sampling = self._sampling(kw)
                room = self.max_length - sampling["max_new_tokens"]
                if room < 1:
                    raise ValueError(
                        f"max_gen_toks={sampling['max_new_tokens']} leaves no room for a prompt "
                        f"in the model's {self.max_length} tokens; lower it or raise max_length"
                    )
                prompts = [self._prompt_ids(requests[i].args[0], room) for i in members]
                order = sorted(range(len(members)), key=lambda j: -len(prompts[j]))
                for start in range(0, len(order), self.gen_batch_size):
                    part = order[start : start + self.gen_batch_size]
                    done = generate_rows(
                        self.model, [prompts[j] for j in part], tokenizer=self.tokenizer,
                        stop=[s for s in until if s], stop_token_ids=stop_ids, **sampling,
                    )  # fmt: skip
                    for j, c in zip(part, done, strict=True):
                        i = members[j]
                        out[i] = postprocess_generated_text(c.text, until, None)
                        self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
                    bar.update(len(part))
        return out  # type: ignore[return-value]

    def _prompt_ids(self, context: str, room: int) -> list[int]:
        """HFLM's batch encoding of one context: no special tokens when it starts with the
        bos text, else the tokenizer's (or `add_bos_token`); the last `room` tokens."""
        special = {}
        if has_bos_prefix(context, getattr(self.tokenizer, "bos_token", None)):
            special = {"add_special_tokens": False}
        elif self.add_bos_token is not None:
            special = {"add_special_tokens": self.add_bos_token}
        ids = self.tokenizer(context, **special)["input_ids"]
        if len(ids) > room:
            self._warn_once(
                "truncate", f"a generate_until context of {len(ids)} tokens is left-truncated "
                f"to {room} (max_length - max_gen_toks), as HFLM does",
            )  # fmt: skip
        return ids[-room:]

    def _sampling(self, kw: dict) -> dict:
        """lm-eval's normalised generation kwargs -> generate_rows' sampling arguments."""
        ignored = sorted(set(kw) - SAMPLING_KEYS)
        if ignored:
            self._warn_once(str(ignored), f"generation kwargs {', '.join(ignored)} are not "
                            "supported by slipstream eval and are ignored")  # fmt: skip
        temperature = float(kw.get("temperature") or 0.0) if kw.get("do_sample") else 0.0
        if kw.get("do_sample") and temperature == 0.0:
            temperature = 1.0  # transformers' default for sampling
        return dict(max_new_tokens=int(kw["max_gen_toks"]), temperature=temperature,
                    top_p=float(kw.get("top_p") or 1.0), top_k=int(kw.get("top_k") or 0),
                    seed=1234 if temperature > 0 else None)  # fmt: skip

    # -- helpers -------------------------------------------------------------------------
    def _bar(self, total: int, what: str, disable: bool) -> tqdm:
        return tqdm(total=total, desc=f"slipstream eval: {what}", unit="req", file=sys.stderr,
                    disable=disable or not self.progress or None)  # fmt: skip

    @contextmanager
    def _packed(self):
        """No grad, the linears on weights packed once for this call (CPU float32); yields
        the LM head as a function."""
        with (
            torch.no_grad(),
            packed_linears(self.model, self.model.lm_head_weight(), self.tokens_per_batch) as head,
        ):
            yield head

    def _warn_once(self, key: str, text: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            print(f"slipstream eval: warning: {text}", file=sys.stderr)
