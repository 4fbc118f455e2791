"""New tokens and trained embeddings, in peft 0.21's layout (`model.add_tokens`,
`lora.train_embeddings`).

- `resize_vocab(model, size)`: the embedding (and an untied head) grow to `size` rows, each
  new row the mean of the existing ones (transformers' `mean_resizing`, without the 1e-9
  scaled noise it samples around the mean: exact, so a resumed run rebuilds the same rows).
- `TrainableTokens`: only some rows of an embedding or head train (peft's
  `trainable_token_indices`). Its layout is peft's `TrainableTokensWrapper`:
  `original_module` (the frozen layer) and `token_adapter.trainable_tokens_delta` (n, D),
  which holds those rows' values, not a difference (peft writes them over the base rows,
  so a base whose new rows were initialised differently still loads the same model).
  `.weight` is the effective matrix (the base with the rows written in): what a tied LM head
  and the chunked loss read (`CausalLM.lm_head_weight`). The lookup itself replaces only
  the looked-up rows, by a host-built slot table: no (V, D) copy per forward.
- Whole matrices (peft's `modules_to_save`): the weight itself is trained in place; with
  tied embeddings the one shared matrix, saved with `ensure_weight_tying` as peft does.

`apply_embedding_training` records what it did in `model.lora_config` (the keys
adapter_config.json takes); `embedding_tensors` / `load_embedding_tensors` give and take the
adapter file's tensors under peft's keys. Shapes: V vocabulary, D hidden size, n rows.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.peft.names import adapter_key, model_layout, peft_path

EMBED, HEAD = "model.embed_tokens", "lm_head"  # our paths; peft's short names are the last part
SHORT = {EMBED: "embed_tokens", HEAD: "lm_head"}
DELTA = "token_adapter.trainable_tokens_delta"


@torch.no_grad()
def _grow(weight: torch.Tensor, size: int) -> torch.Tensor:
    old = weight.shape[0]
    mean_D = weight.float().mean(0)
    extra = mean_D.to(weight.dtype).expand(size - old, -1)
    return torch.cat([weight, extra])


def resize_vocab(model: nn.Module, size: int) -> int:
    """Grow the embedding and an untied head to `size` rows (new rows: the mean of the old);
    -> rows added (0 when the model already has that many or more)."""
    embed = model.input_embeddings()
    old = embed.weight.shape[0]
    if size <= old:
        return 0
    embed.weight = nn.Parameter(_grow(embed.weight, size), requires_grad=False)
    embed.num_embeddings = size
    if not model.config.tie_word_embeddings:
        head = model.lm_head
        head.weight = nn.Parameter(_grow(head.weight, size), requires_grad=False)
        head.out_features = size
    model.config = dataclasses.replace(model.config, vocab_size=size)
    hf = model.config.hf
    hf["vocab_size"] = size
    if isinstance(hf.get("text_config"), dict):
        hf["text_config"]["vocab_size"] = size
    return size - old


class _TokenAdapter(nn.Module):
    def __init__(self, rows_nD: torch.Tensor) -> None:
        super().__init__()
        # float32 masters for a half-precision base, as LoRA's factors (peft/lora.py).
        dtype = torch.float32 if rows_nD.element_size() < 4 else rows_nD.dtype
        self.trainable_tokens_delta = nn.Parameter(rows_nD.detach().to(dtype).clone())


class TrainableTokens(nn.Module):
    """An embedding or head whose rows `token_ids` train, the rest frozen (module docstring)."""

    def __init__(self, base: nn.Module, token_ids: list[int]) -> None:
        super().__init__()
        self.original_module = base
        self.token_ids = list(token_ids)
        V = base.weight.shape[0]
        index = torch.tensor(self.token_ids, dtype=torch.long, device=base.weight.device)
        self.token_adapter = _TokenAdapter(base.weight.detach().index_select(0, index))
        slot = torch.full((V,), -1, dtype=torch.long)
        slot[torch.tensor(self.token_ids, dtype=torch.long)] = torch.arange(len(self.token_ids))
        self.register_buffer("index_n", index, persistent=False)
        self.register_buffer("slot_V", slot.to(base.weight.device), persistent=False)

    @property
    def delta(self) -> torch.Tensor:
        return self.token_adapter.trainable_tokens_delta

    @property
    def weight(self) -> torch.Tensor:
        """The effective (V, D) matrix: the base with the trained rows written in."""
        w = self.original_module.weight
        return w.index_copy(0, self.index_n, self.delta.to(w.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.original_module, nn.Linear):  # an untied head read as a layer
            return F.linear(x, self.weight)
        out = self.original_module(x)
        slot = self.slot_V[x]
        rows = F.embedding(slot.clamp(min=0), self.delta.to(out.dtype))
        scale = getattr(self.original_module, "scale", None)  # Gemma's sqrt(D), by dtype
        if isinstance(scale, dict):
            rows = rows * scale.get(out.dtype, scale[torch.float32])
        return torch.where((slot >= 0).unsqueeze(-1), rows, out)

    def merged(self) -> nn.Module:
        """The base layer with the trained rows written into its weight."""
        with torch.no_grad():
            w = self.original_module.weight
            w.index_copy_(0, self.index_n, self.delta.to(w.dtype))
        return self.original_module


def embedding_paths(model: nn.Module, names) -> list[str]:
    """Our module paths for peft's short names (`embed_tokens`, `lm_head`): with tied
    embeddings both mean the one shared matrix, the embedding's."""
    paths = [EMBED if n == "embed_tokens" else HEAD for n in names]
    if model.config.tie_word_embeddings:
        paths = [EMBED] if paths else []
    return list(dict.fromkeys(paths))


def new_token_rows(model: nn.Module, token_ids: list[int], full: list[str]) -> dict:
    """peft's `trainable_token_indices` for training the rows `token_ids` of the embedding
    and the (untied) head, except where the whole matrix (`full`) trains."""
    whole = embedding_paths(model, full)
    every = embedding_paths(model, ["embed_tokens", "lm_head"])
    return {SHORT[p]: list(token_ids) for p in every if p not in whole and token_ids}


def apply_embedding_training(
    model: nn.Module, *, rows: dict[str, list[int]] | None = None, full: list[str] = ()
) -> None:
    """Train the whole embedding / head matrices named in `full` and the rows `rows[name]`
    of the others (peft's modules_to_save and trainable_token_indices). After LoRA is
    applied (it freezes all else); records peft's keys in `model.lora_config`."""
    whole = embedding_paths(model, list(full))
    for path in whole:
        model.get_submodule(path).weight.requires_grad_(True)
    for short, ids in (rows or {}).items():
        path = EMBED if short == "embed_tokens" else HEAD
        parent, _, attr = path.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, attr, TrainableTokens(getattr(owner, attr), ids))
    cfg = model.lora_config
    if whole:
        cfg["modules_to_save"] = [SHORT[p] for p in whole]
        if model.config.tie_word_embeddings:
            cfg["ensure_weight_tying"] = True
    if rows:
        cfg["trainable_token_indices"] = {k: list(v) for k, v in rows.items()}


def adapter_embeddings(cfg: dict, source) -> tuple[dict[str, list[int]], list[str]]:
    """(trainable rows by layer, whole matrices) of an adapter_config.json, or a one-line
    error for what slipstream cannot represent (another module, a bad index)."""
    full = list(dict.fromkeys(str(n).rsplit(".", 1)[-1] for n in cfg.get("modules_to_save") or ()))
    rows = cfg.get("trainable_token_indices") or {}
    if isinstance(rows, list):  # peft: a list means the input embedding
        rows = {"embed_tokens": rows}
    for key, names in (("modules_to_save", full), ("trainable_token_indices", list(rows))):
        bad = [n for n in names if str(n).rsplit(".", 1)[-1] not in SHORT.values()]
        if bad:
            raise ValueError(
                f"{source}: {key}={cfg[key]!r} is not supported by slipstream for {bad[0]!r} "
                "(only embed_tokens and lm_head train that way); make the adapter without it"
            )
    clean = {}
    for key, ids in rows.items():
        if not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise ValueError(f"{source}: trainable_token_indices[{key!r}] must list token ids")
        clean[str(key).rsplit(".", 1)[-1]] = ids
    return clean, full


def prepare_embeddings(model, cfg: dict, tensors: dict, vocab: int | None, source) -> None:
    """Grow the model's vocabulary to what the adapter was trained with (its recorded size,
    its matrices' rows, its largest token id) and set up its trained embeddings."""
    rows, full = adapter_embeddings(cfg, source)
    if not rows and not full or any(isinstance(m, TrainableTokens) for m in model.modules()):
        return
    sizes = [vocab or 0, *(max(ids) + 1 for ids in rows.values() if ids)]
    sizes += [t.shape[0] for k, t in tensors.items() if k.endswith(("embed_tokens.weight",
                                                                   "lm_head.weight"))]  # fmt: skip
    resize_vocab(model, max(sizes))
    apply_embedding_training(model, rows=rows, full=full)


def _key(model: nn.Module, path: str) -> str:
    return adapter_key(peft_path(path, model_layout(model)))


def embedding_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """peft key -> tensor of the trained embedding rows and matrices (for save_adapter)."""
    cfg = model.lora_config or {}
    found = {}
    for short in cfg.get("modules_to_save") or ():
        path = EMBED if short == "embed_tokens" else HEAD
        found[f"{_key(model, path)}.weight"] = weight = model.get_submodule(path).weight
        if model.config.tie_word_embeddings:  # peft reads the tied head's copy too
            found[f"{_key(model, HEAD)}.weight"] = weight.detach().clone()
    for short in cfg.get("trainable_token_indices") or {}:
        path = EMBED if short == "embed_tokens" else HEAD
        found[f"{_key(model, path)}.{DELTA}"] = model.get_submodule(path).delta
    return found


def merge_trainable_tokens(model: nn.Module) -> None:
    """Write trained rows into their base weights and put the plain layers back."""
    for name, module in list(model.named_modules()):
        if isinstance(module, TrainableTokens):
            parent, _, attr = name.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            setattr(owner, attr, module.merged())
