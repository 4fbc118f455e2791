"""Real Hugging Face tokenizers built offline for tests (a few hundred ms each).

`save_test_tokenizer(dir, style)` trains a small byte-level BPE and saves a folder that
`transformers.AutoTokenizer.from_pretrained(dir)` loads: tokenizer.json and
tokenizer_config.json with a chat template. Two template styles:

- "chatml": Qwen/SmolLM2 style `<|im_start|>role\\n ... <|im_end|>\\n`, eos `<|im_end|>`.
- "llama3": `<|begin_of_text|><|start_header_id|>role<|end_header_id|>\\n\\n ... <|eot_id|>`.

Neither template has `{% generation %}` markers, so they test assistant-only labels the hard
way. The corpus is the chitchat-dataset text when installed, else a small built-in one.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

# Qwen2-style split: letters, single digits, punctuation runs, newline runs kept apart, so a
# piece of text between two special tokens tokenizes the same on its own as inside a chat.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

STYLES = {
    "chatml": {
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "config": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None},
        "template": CHATML_TEMPLATE,
    },
    "llama3": {
        "specials": [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ],
        "config": {
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|eot_id|>",
            "pad_token": "<|end_of_text|>",
        },
        "template": LLAMA3_TEMPLATE,
    },
}

_FALLBACK_CORPUS = [
    "Hello, how are you doing today?",
    "I am fine, thanks for asking. What did you do this weekend?",
    "We went hiking in the mountains and then had dinner with friends.",
    "That sounds great! I mostly stayed home and read a book about history.",
    "Do you like music? I have been listening to a lot of jazz lately.",
    "Yes, I play the guitar a little. Numbers like 1, 2, 3 and 42 appear too.",
]


def _corpus(max_conversations: int = 1500) -> list[str]:
    try:
        from slipstream.data.chitchat import chitchat_conversations
    except ImportError:
        return _FALLBACK_CORPUS
    try:
        convs = chitchat_conversations(max_conversations)
    except ValueError:
        return _FALLBACK_CORPUS
    return [turn for conv in convs for turn in conv] + _FALLBACK_CORPUS


def build_tokenizer_object(style: str = "chatml", vocab_size: int = 1024) -> Tokenizer:
    """Train a byte-level BPE with the style's special tokens (ids 0..k-1)."""
    spec = STYLES[style]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=spec["specials"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def save_test_tokenizer(out_dir: str | Path, style: str = "chatml", vocab_size: int = 1024) -> Path:
    """Write an HF tokenizer folder (tokenizer.json, tokenizer_config.json) to `out_dir`."""
    spec = STYLES[style]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer_object(style, vocab_size).save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 8192,
        "clean_up_tokenization_spaces": False,
        "chat_template": spec["template"],
        **spec["config"],
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    special_map = {k: v for k, v in spec["config"].items() if v is not None}
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2))
    return out


def pad_is_eos(out_dir: str | Path) -> None:
    """Make a saved tokenizer's pad token its eos (as SmolLM2's: `<|im_end|>` both), so a
    text ending in the eos ends in the pad too."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = Path(out_dir) / name
        config = json.loads(path.read_text())
        config["pad_token"] = config["eos_token"]
        path.write_text(json.dumps(config, indent=2))
