"""data.chat_template: a base model's tokenizer has no chat template; the option gives one
(file or text), labels come out as with a tokenizer that ships it, and it is saved with the
run's tokenizer."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers.runs import run_config
from helpers.tokenizers import CHATML_TEMPLATE

from slipstream.checkpoint.tokenizer import load_tokenizer
from slipstream.config import config_from_dict
from slipstream.train import train
from slipstream.train.setup import build_data, set_chat_template


@pytest.fixture
def base_model(tiny_run, tmp_path):
    """tiny_run's model and tokenizer with the chat template taken out (as a base model)."""
    base = tmp_path / "base"
    shutil.copytree(tiny_run[0], base)
    cfg_path = base / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    (base / "chat_template.jinja").unlink(missing_ok=True)
    assert not load_tokenizer(str(base)).chat_template
    return base


def _raw(tiny_run, base, out, **data):
    raw = run_config(tiny_run, out, steps=2)
    raw["model"]["path"] = str(base)
    raw["train"]["finetune"] = "lora"
    raw["lora"] = {"rank": 4, "alpha": 8}
    raw["data"].update(data)
    return raw


def test_a_template_file_trains_a_base_model_and_is_saved(tiny_run, base_model, tmp_path):
    with pytest.raises(ValueError, match="give one as data.chat_template"):
        train(config_from_dict(_raw(tiny_run, base_model, tmp_path / "none")))

    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML_TEMPLATE)
    raw = _raw(tiny_run, base_model, tmp_path / "run", chat_template=str(template))
    cfg = config_from_dict(raw)
    tokenizer = load_tokenizer(str(base_model))
    set_chat_template(tokenizer, cfg.data.chat_template)
    ours = build_data(cfg, tokenizer)
    shipped = build_data(cfg, load_tokenizer(str(tiny_run[0])))  # the template in the folder
    assert [e.input_ids for e in ours.train] == [e.input_ids for e in shipped.train]
    assert [e.trainable for e in ours.train] == [e.trainable for e in shipped.train]

    assert train(cfg)["status"] == "completed"
    assert load_tokenizer(str(tmp_path / "run")).chat_template == CHATML_TEMPLATE


def test_template_text_and_mistakes(tiny_run, base_model):
    tokenizer = load_tokenizer(str(base_model))
    set_chat_template(tokenizer, CHATML_TEMPLATE)  # the text itself
    assert tokenizer.chat_template == CHATML_TEMPLATE
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        set_chat_template(tokenizer, "chatml.jinja")
    with pytest.raises(ValueError, match="does not render a chat"):
        set_chat_template(
            tokenizer, "{% for m in messages %}{{ m.content | nofilter }}{% endfor %}"
        )
    with pytest.raises(ValueError, match="without the assistant's message"):
        set_chat_template(tokenizer, "{{ messages[0]['content'] }}")
