"""The Ollama Modelfile's TEMPLATE renders a chat as the tokenizer's own chat template does.

Its Go template is rendered (tests/helpers/go_template.py) for chats with and without a system
message, with and without the reply opener, and tokenized as llama.cpp/Ollama would (BOS in
front only when the GGUF says add_bos_token); the ids must equal `apply_chat_template`'s. The
SmolLM2 case is the one that broke: its BOS is `<|im_start|>` (add_bos_token false), and its
template inserts a default system prompt when the chat has none.
"""

import re

import pytest
import torch

from slipstream.checkpoint.gguf_export import export_gguf, modelfile_path, write_modelfile
from tests.helpers.gguf_tokenizer import VOCAB
from tests.helpers.go_template import render
from tests.helpers.models import make_hf_model, ours_from_hf
from tests.helpers.tokenizers import save_test_tokenizer

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

# SmolLM2-135M-Instruct's chat template, as its GGUF and tokenizer_config.json hold it.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHATS = {
    "system+user+assistant": ([("system", "Be brief."), ("user", "Hi!"),
                               ("assistant", "Hello.")], False),
    "system+user, reply": ([("system", "Be brief."), ("user", "Hi!")], True),
    "user, reply (default system)": ([("user", "What is 2+2?")], True),
    "two turns, reply": ([("user", "Hi!"), ("assistant", "Hello."), ("user", "And?")], True),
}  # fmt: skip


def template_of(modelfile: str) -> str:
    found = re.search(r'^TEMPLATE """(.*?)"""$', modelfile, re.S | re.M)
    assert found, modelfile
    return found.group(1)


def assert_renders_as_the_tokenizer(modelfile: str, gguf_path, tok) -> None:
    fields = gguf.GGUFReader(str(gguf_path)).fields
    adds_bos = bool(fields["tokenizer.ggml.add_bos_token"].contents())
    go = template_of(modelfile)
    for name, (turns, prompt) in CHATS.items():
        messages = [{"role": r, "content": c} for r, c in turns]
        text = render(go, {"Messages": [{"Role": r, "Content": c} for r, c in turns]})
        ids = ([tok.bos_token_id] if adds_bos else []) + tok(text, add_special_tokens=False)[
            "input_ids"
        ]
        want = tok.apply_chat_template(messages, add_generation_prompt=prompt)
        want = want["input_ids"] if hasattr(want, "keys") else want
        assert ids == list(want), (name, text)
        assert text.count("<|im_start|>") == tok.apply_chat_template(
            messages, add_generation_prompt=prompt, tokenize=False
        ).count("<|im_start|>"), name


@pytest.fixture(scope="module")
def tiny_model():
    dims = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                num_key_value_heads=2, num_hidden_layers=1)  # fmt: skip
    return ours_from_hf(make_hf_model("llama", **dims))


@pytest.mark.parametrize("style", ["chatml", "smollm2", "llama3"])
def test_modelfile_template_renders_as_the_chat_template(tmp_path, tiny_model, style):
    folder = save_test_tokenizer(tmp_path / "tok", "llama3" if style == "llama3" else "chatml",
                                 vocab_size=VOCAB)  # fmt: skip
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    if style == "smollm2":  # SmolLM2's template, and its BOS: <|im_start|>, not added by encode
        tok.chat_template = SMOLLM2_TEMPLATE
        tok.bos_token = "<|im_start|>"
        tok.save_pretrained(folder)
    with torch.no_grad():
        path = export_gguf(tiny_model, tmp_path / "m.gguf", "f32", tokenizer=tok)
    modelfile = write_modelfile(path).read_text()
    assert modelfile_path(path).name == "m.Modelfile"
    assert_renders_as_the_tokenizer(modelfile, path, tok)
    if style == "smollm2":
        assert "named SmolLM" in template_of(modelfile)  # the default system prompt is in it


def test_go_template_helper_renders_ollama_templates():
    """The test renderer itself, on an Ollama-style template (range, $last, if/else, trims)."""
    go = (
        "{{- range $i, $_ := .Messages }}{{- $last := eq (len (slice $.Messages $i)) 1 -}}"
        '[{{ .Role }}:{{ .Content }}]{{ if and $last (ne .Role "assistant") }}>{{ end }}'
        "{{ end }}"
    )
    msgs = [{"Role": "user", "Content": "a"}, {"Role": "assistant", "Content": "b"}]
    assert render(go, {"Messages": msgs}) == "[user:a][assistant:b]"
    assert render(go, {"Messages": msgs[:1]}) == "[user:a]>"
    with pytest.raises(ValueError):
        render("{{ printf .X }}", {})


@pytest.mark.slow
def test_real_smollm2_gguf_modelfile(tmp_path):
    """The shipped SmolLM2 GGUF (Q4_1): its Modelfile against its own tokenizer (~25 s)."""
    from slipstream.checkpoint.gguf import gguf_tokenizer
    from slipstream.checkpoint.gguf_modelfile import modelfile_text
    from slipstream.sources import smollm2_gguf_path

    path = smollm2_gguf_path()
    assert_renders_as_the_tokenizer(modelfile_text(path), path, gguf_tokenizer(path))
