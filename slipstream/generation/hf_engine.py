"""Generation through transformers' own `generate`, for generic models whose layers slipstream's
KV cache cannot hold (Gated DeltaNet, Mamba/Mamba2 mixers, LFM2's short convolution: state
carried along the sequence, which transformers' hybrid caches keep).

Same contract as `engine.run` (rows out, prompt-major): the model's LoRA/DoRA modules sit in
transformers' module tree, so its `generate` runs with the adapter applied, unmerged. Each
prompt is one `generate` call over its `samples_per_prompt` copies (no padding, so no padded
state in a recurrent layer); attention runs as transformers' SDPA (its masks, its sliding
windows) for the call. Greedy decoding is transformers' argmax; sampling is its multinomial
under transformers' warpers (temperature, top-k, top-p: the order of ours), seeded from the
caller's generator. Stop tokens, stop strings, length limits and the streamed checks are
`engine._check`'s, read every token (transformers' loop reads the device every step anyway).

Shapes: B rows of one prompt, V vocabulary.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections import Counter

import torch

log = logging.getLogger("slipstream")

_SAID: weakref.WeakSet = weakref.WeakSet()  # models whose engine the log has named


def stateful_layers(model) -> list[str]:
    """The layers of `model` that slipstream's KV cache holds no state for (generic models'
    per-sequence token mixers; empty for every native family)."""
    if getattr(model.config, "implementation", "native") != "transformers":
        return []
    return list(model.per_sequence)


def transformers_reason(model) -> str | None:
    """Why `model` generates on transformers' `generate` (None: on our KV-cache engine): layers
    our cache holds no state for, or attention it does not run (softcapped scores; keys and
    values of other shapes than config.json's head_dim, or shared between layers)."""
    stateful = stateful_layers(model)
    if stateful:
        return f"slipstream's KV cache holds no state for {stateful[0]}"
    if getattr(model.config, "implementation", "native") != "transformers":
        return None
    text = model.hf.config.get_text_config()
    if getattr(text, "attn_logit_softcapping", None):
        return "slipstream's KV-cache engine has no attention softcapping"
    if getattr(text, "kv_lora_rank", None):
        return "multi-head latent attention: keys and values of another shape than head_dim"
    if getattr(text, "num_kv_shared_layers", None) or getattr(text, "global_head_dim", None):
        return "per-layer key/value shapes and K/V shared between layers"
    if "chunked_attention" in (getattr(text, "layer_types", None) or ()):
        return "chunked attention (attention_chunk_size): slipstream's KV-cache engine has none"
    return None


def layer_kinds(model) -> str:
    """'1 Qwen3NextGatedDeltaNet, 1 softmax attention': each decoder layer's token mixers."""
    stateful = stateful_layers(model)
    kinds: Counter = Counter()
    for i, layer in enumerate(model.decoder_layers()):
        mixers = [p.split(".", 2)[2] for p in stateful if p.startswith(f"layers.{i}.")]
        names = [type(layer.get_submodule(m)).__mro__[1].__name__ for m in mixers]
        attention = any(type(m).__name__.endswith("Attention") for m in layer.modules())
        kind = " + ".join(names + (["softmax attention"] if attention else []))
        kinds[kind or "no token mixer"] += 1  # a MoE/MLP-only block (Nemotron-H's)
    return ", ".join(f"{n} {kind}" for kind, n in kinds.items())


def say_engine(model) -> None:
    """Name, once per model, the engine generation runs on and why (per layer kind)."""
    if model in _SAID:
        return
    _SAID.add(model)
    kinds, why = layer_kinds(model), transformers_reason(model)
    if why:
        log.info(
            "generation: %s on transformers' generate and its cache (layers: %s): %s",
            model.config.model_type, kinds, why,
        )  # fmt: skip
    else:
        log.info(
            "generation: %s on slipstream's KV-cache engine (layers: %s)",
            model.config.model_type, kinds,
        )  # fmt: skip


@contextlib.contextmanager
def _transformers_attention(hf):
    """transformers' SDPA (masks and windows built by transformers) for the call; then ours."""
    ours = hf.config._attn_implementation
    hf.set_attn_implementation("sdpa" if hf._supports_sdpa else "eager")
    saved, hf.generation_config = hf.generation_config, _blank_generation_config()
    try:
        yield
    finally:
        hf.generation_config = saved
        hf.set_attn_implementation(ours)


def _blank_generation_config():
    """No checkpoint defaults (generation_config.json's penalties, top-k): only ours apply."""
    from transformers import GenerationConfig

    return GenerationConfig()


def run(model, prompts, rows, *, check, sampling, stop_ids, find_stop, generator, check_every,
        on_check, logprobs, images=None):  # fmt: skip
    """`engine.run` on transformers' `generate` (see the module docstring): `rows` are the
    engine's, `samples_per_prompt` a prompt; `check` is `engine._check`; `images`: {prompt
    index: (its image inputs, image token id)} (generation/images.py PROMPTS_KEY), given to
    `generate` with the token types an image-text model's 3-D positions read."""
    n = len(rows) // len(prompts)
    hf = model.hf
    device = model.input_embeddings().weight.device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), _transformers_attention(hf):
            for i, p in enumerate(prompts):
                mine = rows[i * n : (i + 1) * n]
                if mine[0].limit > 0:
                    ids_BT = torch.tensor([list(p)] * n, device=device)
                    stops = _RowStops(mine, rows, check, set(stop_ids), find_stop, check_every,
                                      on_check, logprobs)  # fmt: skip
                    extra = _image_inputs((images or {}).get(i), p, n, device)
                    _generate(hf, ids_BT, mine[0].limit, sampling, stops, _seed(generator),
                              extra)  # fmt: skip
    finally:
        model.train(was_training)
    for r in rows:
        r.finish_reason = r.finish_reason or "length"
    if on_check is not None:
        on_check(rows)
    return rows


def _image_inputs(prompt_images, prompt, n: int, device) -> dict:
    """`generate`'s image inputs of one prompt (one sample of it): pixels, grids, and the
    token types (1 at image rows, from the host ids) transformers' mRoPE index reads."""
    if prompt_images is None:
        return {}
    inputs, image_token_id = prompt_images
    if n > 1:
        raise ValueError("num_return_sequences > 1 with images on this model: not supported")
    types = torch.tensor([[int(t == image_token_id) for t in prompt]], device=device)
    return {"mm_token_type_ids": types, **{k: v.to(device) for k, v in inputs.items()}}


def _seed(generator: torch.Generator | None) -> int | None:
    if generator is None:
        return None
    return int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))


def _generate(hf, ids_BT, limit, sampling, stops, seed, extra=None) -> None:
    from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

    stop_ids = stops.stop_ids
    config = GenerationConfig(
        max_new_tokens=limit, do_sample=not sampling.greedy,
        temperature=sampling.temperature if not sampling.greedy else 1.0,
        top_k=sampling.top_k, top_p=sampling.top_p, num_beams=1, use_cache=True,
        eos_token_id=sorted(stop_ids) or None, pad_token_id=min(stop_ids, default=0),
    )  # fmt: skip
    fork = torch.random.fork_rng(devices=[ids_BT.device] if ids_BT.is_cuda else [])
    with fork if seed is not None else contextlib.nullcontext():
        if seed is not None:
            torch.manual_seed(seed)
        hf.generate(
            ids_BT, attention_mask=torch.ones_like(ids_BT), generation_config=config,
            logits_processor=LogitsProcessorList([stops.last]),
            stopping_criteria=StoppingCriteriaList([stops]), **(extra or {}),
        )  # fmt: skip


class _LastScores:
    """The last logits processor: keeps the step's final (warped) scores for the log-probs."""

    def __call__(self, input_ids, scores_BV):
        self.scores_BV = scores_BV
        return scores_BV


class _RowStops:
    """A stopping criterion that grows the rows as `engine._check` does, one token a step."""

    def __init__(self, mine, rows, check, stop_ids, find_stop, K, on_check, want_lp) -> None:
        self.mine, self.rows, self.check, self.last = mine, rows, check, _LastScores()
        self.stop_ids, self.find_stop, self.K = stop_ids, find_stop, K
        self.on_check, self.want_lp = on_check, want_lp
        self.live, self.steps = list(range(len(mine))), 0

    def __call__(self, input_ids_BT, scores, **kwargs) -> torch.Tensor:
        token_B = input_ids_BT[:, -1]
        buf_B12 = torch.zeros(len(self.mine), 1, 2, dtype=torch.int32, device=token_B.device)
        buf_B12[:, 0, 0] = token_B.to(torch.int32)
        if self.want_lp:
            logp_BV = self.last.scores_BV.float().log_softmax(-1)
            buf_B12[:, 0, 1] = logp_BV.gather(1, token_B[:, None])[:, 0].view(torch.int32)
        keep = self.check([self.mine[i] for i in self.live], buf_B12[self.live], self.stop_ids,
                      self.find_stop)  # fmt: skip
        self.live = [self.live[i] for i in keep]
        self.steps += 1
        if self.on_check is not None and self.steps % self.K == 0:
            self.on_check(self.rows)
        done_B = torch.ones(len(self.mine), dtype=torch.bool)
        done_B[self.live] = False
        return done_B.to(token_B.device)
