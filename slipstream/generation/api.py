"""`slipstream.generate`: prompts in (text, chat messages or token ids), `Completion`s out.

Conventions:
- A completion's `token_ids` end with the stop token when one ended it (so its log-prob is
  there for RL); `text` is decoded without special tokens and cut before a stop string.
- Stop tokens: eos, pad and the end-of-turn tokens the tokenizer knows (`stop_token_ids`),
  or without a tokenizer the `eos_token_id` of config.json; `stop` adds strings and ids.
- Output order: prompt-major, `num_return_sequences` completions a prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import slipstream.generation.engine as engine
from slipstream.generation.options import check_options
from slipstream.generation.sampling import Sampling

# End-of-turn tokens of common chat templates (ChatML/Qwen/SmolLM2, Llama 3, Phi-3, Gemma,
# GPT-OSS harmony): a reply stops at whichever of them the vocabulary has, or at eos.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|return|>")


TextSink = Callable[[int, str], None]  # (completion index, new text)


@dataclass
class Completion:
    prompt_index: int
    token_ids: list[int]
    text: str | None
    logprobs: list[float] | None
    finish_reason: str  # "stop" or "length"


def generate(
    model,
    prompts: Sequence[Any],
    *,
    tokenizer: Any = None,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop: str | Sequence[str | int] | None = None,
    seed: int | None = None,
    num_return_sequences: int = 1,
    return_logprobs: bool = False,
) -> list[Completion]:
    """Complete each prompt (a string, a chat message list, or token ids) with the model.

    temperature 0 is greedy; the same seed gives the same outputs."""
    return generate_rows(model, prompts, tokenizer=tokenizer, max_new_tokens=max_new_tokens,
                         temperature=temperature, top_p=top_p, top_k=top_k, stop=stop, seed=seed,
                         num_return_sequences=num_return_sequences,
                         return_logprobs=return_logprobs)  # fmt: skip


def generate_rows(model, prompts, *, tokenizer=None, max_new_tokens=256, temperature=0.0,
                  top_p=1.0, top_k=0, stop=None, seed=None, num_return_sequences=1,
                  return_logprobs=False, check_every: int = engine.CHECK_EVERY,
                  on_text: TextSink | None = None,
                  stop_token_ids: Sequence[int] | None = None) -> list[Completion]:  # fmt: skip
    """`generate` with the engine's knobs: `check_every` tokens between stop checks,
    `on_text(i, new_text)` called with each completion's text as it grows (streaming), and
    `stop_token_ids` in place of the default stop tokens (`stop_token_ids(tokenizer)`:
    slipstream eval stops where transformers' generate does)."""
    check_options(max_new_tokens=max_new_tokens, num_return_sequences=num_return_sequences)
    sampling = Sampling(float(temperature), float(top_p), int(top_k))
    from slipstream.generation.images import image_prompts, packed_prompt_images

    prompts = _check_prompts(prompts)
    with_images = image_prompts(model, prompts, tokenizer)  # chat prompts with image parts
    ids = [
        with_images[i].input_ids if i in with_images else prompt_ids(p, tokenizer, i)
        for i, p in enumerate(prompts)
    ]
    images = packed_prompt_images(with_images, [len(p) for p in ids])
    context = model.config.hf.get("max_position_embeddings")
    for i, p in enumerate(ids):
        if context is not None and len(p) >= context:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens; the model's context is {context} "
                "(max_position_embeddings): shorten it to leave room for the reply"
            )
    stop_strings, stop_ids = _stops(stop, tokenizer, model, stop_token_ids)
    device = model.input_embeddings().weight.device
    generator = None
    if seed is not None:
        generator = torch.Generator(device).manual_seed(seed)
    texts = _Texts(tokenizer, stop_strings)
    on_check = None
    if on_text is not None:
        on_check = lambda rows: [on_text(i, texts.grow(i, r)) for i, r in enumerate(rows)]  # noqa: E731
    rows = engine.run(model, ids, samples_per_prompt=num_return_sequences,
                      max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids,
                      find_stop=texts.find_stop if stop_strings else None,
                      max_positions=context, generator=generator, check_every=check_every,
                      on_check=on_check, logprobs=return_logprobs, images=images)  # fmt: skip
    return [
        Completion(
            prompt_index=r.prompt_index,
            token_ids=r.token_ids,
            text=texts.text(r) if tokenizer is not None else None,
            logprobs=r.logprobs if return_logprobs else None,
            finish_reason=r.finish_reason or "length",
        )
        for r in rows
    ]


def _check_prompts(prompts) -> list[Any]:
    if isinstance(prompts, (str, torch.Tensor)) or not isinstance(prompts, Sequence):
        raise ValueError(
            "prompts must be a list (of strings, of chat message lists or of token-id lists); "
            f"got {type(prompts).__name__}: wrap a single prompt in a list"
        )
    if len(prompts) == 0:
        raise ValueError("prompts is an empty list; give at least one prompt")
    return list(prompts)


def as_prompt(text: str, tokenizer: Any, raw: bool) -> Any:
    """A user message through the chat template when the tokenizer has one, else the text."""
    if raw or not getattr(tokenizer, "chat_template", None):
        return text
    return [{"role": "user", "content": text}]


def prompt_ids(prompt: Any, tokenizer: Any, index: int = 0) -> list[int]:
    """Token ids of one prompt: text (tokenized), chat messages (template with the
    generation prompt) or token ids (as they are)."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"prompt {index} is an empty string; give some text")
        _need_tokenizer(tokenizer, index, "a string")
        ids = tokenizer(prompt)["input_ids"]
    elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, dict) for m in prompt):
        _need_tokenizer(tokenizer, index, "a chat message list")
        messages = [_text_message(m, index, i) for i, m in enumerate(prompt)]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding (transformers 5)
            ids = ids["input_ids"]
    elif isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
        ids = prompt
    else:
        raise ValueError(
            f"prompt {index} is {type(prompt).__name__}; give a string, a list of chat "
            "messages ({'role': ..., 'content': ...}) or a list of token ids"
        )
    if len(ids) == 0:
        raise ValueError(f"prompt {index} is empty (no tokens); give at least one token")
    return list(ids)


def _text_message(message: dict, index: int, i: int) -> dict:
    """A message whose content is a list of text parts, with the parts joined as training
    joins them (data/formats.py); an image part is an error (no vision model here)."""
    if not isinstance(message.get("content"), list):
        return message
    from slipstream.data.formats import text_content
    from slipstream.data.rows import RowError

    try:
        return {**message, "content": text_content(message["content"], f"message {i}")}
    except RowError as e:
        raise ValueError(f"prompt {index}: {e.detail}") from None


def _need_tokenizer(tokenizer: Any, index: int, what: str) -> None:
    if tokenizer is None:
        raise ValueError(f"prompt {index} is {what}; pass tokenizer= or give token ids")


def stop_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """eos, pad and the END_OF_TURN tokens that `tokenizer` knows."""
    ids = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in END_OF_TURN if t in vocab)
    return tuple(sorted(i for i in ids if i is not None))


def _stops(stop, tokenizer, model, defaults=None) -> tuple[list[str], set[int]]:
    if defaults is not None:
        ids = set(defaults)
    elif tokenizer is not None:
        ids = set(stop_token_ids(tokenizer))
    else:
        eos = model.config.hf.get("eos_token_id")
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    items = [stop] if isinstance(stop, (str, int)) else list(stop or [])
    strings = [s for s in items if isinstance(s, str)]
    if "" in strings:
        raise ValueError("stop has an empty string; give non-empty stop strings")
    if strings and tokenizer is None:
        raise ValueError("stop strings need a tokenizer to read the text; pass tokenizer=")
    ids.update(s for s in items if isinstance(s, int))
    return strings, ids


class _Texts:
    """Decoding on the host: stop strings, final texts, streamed increments."""

    def __init__(self, tokenizer: Any, stop_strings: list[str]) -> None:
        self.tokenizer, self.stop_strings = tokenizer, stop_strings
        self.sent: dict[int, int] = {}

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def find_stop(self, row: engine.Row, start: int) -> int | None:
        """Tokens to keep when a stop string ends in tokens [start:] of `row`, else None."""
        if not any(s in self.decode(row.token_ids) for s in self.stop_strings):
            return None
        for end in range(max(start, 1), len(row.token_ids) + 1):
            text = self.decode(row.token_ids[:end])
            if any(s in text for s in self.stop_strings):
                return end
        return None

    def text(self, row: engine.Row) -> str:
        text = self.decode(row.token_ids)
        cuts = [text.find(s) for s in self.stop_strings if s in text]
        return text[: min(cuts)] if cuts else text

    def grow(self, i: int, row: engine.Row) -> str:
        """The text of row i not yet returned by `grow` (held back while it could still turn
        into a stop string)."""
        if self.tokenizer is None:
            return ""
        text = self.text(row)
        if row.finish_reason is None:  # hold back a tail that may start a stop string
            for s in self.stop_strings:
                for k in range(len(s) - 1, 0, -1):
                    if text.endswith(s[:k]):
                        text = text[:-k]
                        break
            text = text.rstrip("\ufffd")  # an incomplete multi-byte character
        new, self.sent[i] = text[self.sent.get(i, 0) :], max(len(text), self.sent.get(i, 0))
        return new


def chat_reply(model, tokenizer: Any, prompt: str, max_new_tokens: int = 64) -> str:
    """The model's greedy reply to one user message, through the tokenizer's chat template."""
    messages = [{"role": "user", "content": prompt}]
    out = generate(model, [messages], tokenizer=tokenizer, max_new_tokens=max_new_tokens)
    return out[0].text.strip()


def greedy_generate(
    model, prompt_ids: list[int], max_new_tokens: int = 40, stop_ids: tuple[int, ...] = ()
) -> list[int]:
    """Token ids generated after `prompt_ids`, stopping at any of `stop_ids` (not included)."""
    if not prompt_ids:
        raise ValueError("greedy_generate: prompt_ids is empty; give at least one token.")
    rows = engine.run(model, [prompt_ids], max_new_tokens=max_new_tokens, sampling=Sampling(),
                      stop_ids=stop_ids)  # fmt: skip
    ids = rows[0].token_ids
    return ids[:-1] if rows[0].finish_reason == "stop" else ids
