"""Assistant-only targets under ChatML and Llama-3 templates (no generation markers), and the
counted skips / errors of tokenize_rows."""

import json

import pytest
from helpers.tokenizers import save_test_tokenizer
from transformers import AutoTokenizer

from slipstream.data import encode_chat, rows_from_list, tokenize_rows

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello friend"},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "Sure.\nGoodbye now"},
]


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    return AutoTokenizer.from_pretrained(
        save_test_tokenizer(tmp_path_factory.mktemp("c"), "chatml")
    )


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    return AutoTokenizer.from_pretrained(
        save_test_tokenizer(tmp_path_factory.mktemp("l"), "llama3")
    )


def _expected(tok, segments):
    """Ids and mask from (piece, trainable) segments; `<|...|>` pieces are single tokens."""
    ids, mask = [], []
    for piece, trainable in segments:
        if piece.startswith("<|"):
            piece_ids = [tok.convert_tokens_to_ids(piece)]
        else:
            piece_ids = tok(piece, add_special_tokens=False)["input_ids"]
        ids += piece_ids
        mask += [trainable] * len(piece_ids)
    return ids, mask


def test_chatml_assistant_mask_is_exact(chatml):
    S, E = "<|im_start|>", "<|im_end|>"
    ids, mask = _expected(chatml, [
        (S, 0), ("system\nBe brief.", 0), (E, 0), ("\n", 0),
        (S, 0), ("user\nHi there", 0), (E, 0), ("\n", 0),
        (S, 0), ("assistant\n", 0), ("Hello friend", 1), (E, 1), ("\n", 0),
        (S, 0), ("user\nBye", 0), (E, 0), ("\n", 0),
        (S, 0), ("assistant\n", 0), ("Sure.\nGoodbye now", 1), (E, 1), ("\n", 0),
    ])  # fmt: skip
    ex = encode_chat(chatml, CONVERSATION, "assistant")
    assert ex.input_ids == ids
    assert ex.trainable == [bool(m) for m in mask]


def test_llama3_assistant_mask_is_exact(llama3):
    B, H, EH, T = "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"
    ids, mask = _expected(llama3, [
        (B, 0),
        (H, 0), ("system", 0), (EH, 0), ("\n\nBe brief.", 0), (T, 0),
        (H, 0), ("user", 0), (EH, 0), ("\n\nHi there", 0), (T, 0),
        (H, 0), ("assistant", 0), (EH, 0), ("\n\n", 0), ("Hello friend", 1), (T, 1),
        (H, 0), ("user", 0), (EH, 0), ("\n\nBye", 0), (T, 0),
        (H, 0), ("assistant", 0), (EH, 0), ("\n\n", 0), ("Sure.\nGoodbye now", 1), (T, 1),
    ])  # fmt: skip
    ex = encode_chat(llama3, CONVERSATION, "assistant")
    assert ex.input_ids == ids
    assert ex.trainable == [bool(m) for m in mask]


def test_train_on_all_and_text_format(chatml):
    ex = encode_chat(chatml, CONVERSATION, "all")
    assert (
        all(ex.trainable)
        and ex.input_ids == encode_chat(chatml, CONVERSATION, "assistant").input_ids
    )
    examples, report = tokenize_rows([{"text": "hello world"}], chatml, max_tokens=64)
    ids = chatml("hello world", add_special_tokens=False)["input_ids"] + [chatml.eos_token_id]
    assert examples[0].input_ids == ids and all(examples[0].trainable)
    assert report.kept == 1


def test_bad_rows_are_counted_and_skipped(chatml):
    good = {"messages": CONVERSATION[1:3]}
    rows = [
        good,
        {"messages": [{"role": "user", "content": "only a question"}]},  # all masked
        {"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]},  # missing
        {"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]},
        {"messages": "not a list"},
        {"messages": [{"role": "wizard", "content": "hi"}]},
        good,
    ]
    examples, report = tokenize_rows(rows, chatml, max_tokens=256)
    assert len(examples) == report.kept == 2
    assert report.rows == 7
    assert dict(report.skipped) == {
        "all_masked": 1,
        "missing_field": 1,
        "wrong_type": 2,
        "bad_role": 1,
    }
    line = report.summary()
    assert "skipped 5" in line and "row 1: all_masked" in line and "\n" not in line
    with pytest.raises(ValueError, match="data row 1: all_masked"):
        tokenize_rows(rows, chatml, max_tokens=256, strict=True)


def test_mixed_types_from_jsonl_are_skipped_not_fatal(chatml, tmp_path):
    from slipstream.data import load_rows

    path = tmp_path / "mixed.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", '
                    '"content": "b"}]}\n{"messages": "oops"}\n')  # fmt: skip
    examples, report = tokenize_rows(load_rows(str(path)), chatml, max_tokens=64)
    assert report.kept == 1 and report.skipped["wrong_type"] == 1


def test_overlong_truncate_and_drop_are_counted(chatml):
    long = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "word " * 200},
        ]
    }
    short = {"messages": CONVERSATION[1:3]}
    examples, report = tokenize_rows([long, short], chatml, max_tokens=40)
    assert report.truncated == 1 and report.dropped == 0 and report.kept == 2
    assert max(len(e) for e in examples) == 40
    examples, report = tokenize_rows([long, short], chatml, max_tokens=40, overlong="drop")
    assert report.dropped == 1 and report.kept == 1 and "dropped 1" in report.summary()
    # Truncation that cuts off the whole reply leaves nothing to learn: a counted skip.
    late = {
        "messages": [
            {"role": "user", "content": "word " * 100},
            {"role": "assistant", "content": "x"},
        ]
    }
    _, report = tokenize_rows([late, short], chatml, max_tokens=40)
    assert report.skipped["all_masked"] == 1 and report.truncated == 1


def test_errors_for_no_template_empty_and_all_bad(chatml, tmp_path):
    plain = AutoTokenizer.from_pretrained(save_test_tokenizer(tmp_path, "chatml"))
    plain.chat_template = None
    with pytest.raises(ValueError, match="needs a chat template"):
        tokenize_rows([{"messages": CONVERSATION}], plain, max_tokens=64)
    with pytest.raises(ValueError, match="empty"):
        tokenize_rows([], chatml, max_tokens=64)
    with pytest.raises(ValueError, match="no usable examples"):
        tokenize_rows([{"messages": [{"role": "user", "content": "q"}]}], chatml, max_tokens=64)
    with pytest.raises(ValueError, match="cannot detect the data format"):
        tokenize_rows([{"foo": "bar"}], chatml, max_tokens=64)
    with pytest.raises(ValueError, match="train_on"):
        tokenize_rows([{"text": "a"}], chatml, max_tokens=64, train_on="user")


def test_parallel_map_matches_serial(chatml):
    rows = rows_from_list([{"messages": CONVERSATION}, {"messages": "bad"}] * 6)
    serial, r1 = tokenize_rows(rows, chatml, max_tokens=64, num_proc=1)
    parallel, r2 = tokenize_rows(rows, chatml, max_tokens=64, num_proc=2)
    assert [e.input_ids for e in serial] == [e.input_ids for e in parallel]
    assert [e.trainable for e in serial] == [e.trainable for e in parallel]
    assert r1.summary() == r2.summary() and r1.skipped["wrong_type"] == 6


# Like Qwen3: only the reply after the last user message gets an (empty) think block, so an
# earlier reply renders differently as the last message than inside the full conversation.
THINK_TEMPLATE = (
    "{% set ns = namespace(last=0) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last = loop.index0 %}"
    "{% endif %}{% endfor %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if m['role'] == 'assistant' and loop.index0 > ns.last %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% endif %}{{ m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_reply_rendered_differently_when_last_still_gets_targets(chatml, tmp_path):
    tok = AutoTokenizer.from_pretrained(save_test_tokenizer(tmp_path, "chatml"))
    tok.chat_template = THINK_TEMPLATE
    S, E = "<|im_start|>", "<|im_end|>"
    ids, mask = _expected(tok, [
        (S, 0), ("user\nHi there", 0), (E, 0), ("\n", 0),
        (S, 0), ("assistant\n", 0), ("Hello friend", 1), (E, 1), ("\n", 0),
        (S, 0), ("user\nBye", 0), (E, 0), ("\n", 0),
        (S, 0), ("assistant\n", 0), ("<think>\n\n</think>\n\nSure.\nGoodbye now", 1), (E, 1),
        ("\n", 0),
    ])  # fmt: skip
    ex = encode_chat(tok, CONVERSATION[1:], "assistant")
    assert ex.input_ids == ids
    assert ex.trainable == [bool(m) for m in mask]


def test_template_error_is_a_counted_skip(chatml, tmp_path):
    tok = AutoTokenizer.from_pretrained(save_test_tokenizer(tmp_path, "chatml"))
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('no system role') }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    rows = [{"messages": CONVERSATION}, {"messages": CONVERSATION[1:]}]
    examples, report = tokenize_rows(rows, tok, max_tokens=256)
    assert report.kept == 1 and report.skipped["template_error"] == 1
    assert "no system role" in report.first_skip


def parts(*texts):
    return [{"type": "text", "text": t} for t in texts]


def test_text_parts_are_joined_and_image_parts_counted(chatml, tmp_path):
    from slipstream.data import load_rows

    # TRL's / OpenAI's content parts: joined with nothing between (what part-aware chat
    # templates render), so the example equals the one of the plain string.
    plain = {"messages": CONVERSATION[1:3]}
    as_parts = {
        "messages": [
            {"role": "user", "content": parts("Hi ", "there")},
            {"role": "assistant", "content": parts("Hello friend")},
        ]
    }
    image = {"type": "image_url", "image_url": {"url": "https://x/cat.png"}}
    with_image = {
        "messages": [
            {"role": "user", "content": [image, *parts("What is it?")]},
            {"role": "assistant", "content": "A cat."},
        ]
    }
    audio = {"messages": [{"role": "user", "content": [{"type": "audio"}]}]}
    path = tmp_path / "parts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (plain, as_parts, with_image, audio)))
    examples, report = tokenize_rows(load_rows(str(path)), chatml, max_tokens=256)
    assert len(examples) == 2 and examples[0] == examples[1]
    assert dict(report.skipped) == {"image_part": 1, "wrong_type": 1}
    assert "row 2: image_part: turn 0 part 0 is 'image_url': image parts need a vision model" in (
        report.summary()
    )
    # Only part lists: Arrow types the parts as structs (absent keys None); read the same.
    path.write_text("".join(json.dumps(r) + "\n" for r in (as_parts, with_image)))
    typed, report = tokenize_rows(load_rows(str(path)), chatml, max_tokens=256)
    assert typed == examples[:1] and dict(report.skipped) == {"image_part": 1}


def test_mixed_formats_are_each_read_and_counted(chatml, tmp_path):
    from slipstream.data import load_rows

    chats = [{"messages": CONVERSATION[1:3]}] * 3
    pairs = [{"prompt": "Hi there", "completion": "Hello friend"}] * 2
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in chats + pairs))
    examples, report = tokenize_rows(load_rows(str(path)), chatml, max_tokens=256)
    # Each row in its own format: prompt/completion is the same chat, so the same example.
    assert report.kept == 5 and len({tuple(e.input_ids) for e in examples}) == 1
    assert dict(report.formats) == {"messages": 3, "prompt_completion": 2}
    assert report.summary().startswith("data (messages 3 rows, prompt_completion 2 rows): 5 rows")
    assert report.warning() is None
    # A format given by name reads every row in it: the others are skipped, and more than a
    # quarter skipped is a warning of its own.
    examples, report = tokenize_rows(
        load_rows(str(path)), chatml, max_tokens=256, format="messages"
    )
    assert report.kept == 3 and report.skipped["missing_field"] == 2
    assert report.warning() == (
        "2 of 5 rows (40%) are not trained on (missing_field 2; first: row 3: missing_field: "
        "no 'messages')"
    )
    _, report = tokenize_rows(chats * 3 + pairs[:1], chatml, max_tokens=256, format="messages")
    assert report.warning() is None  # 1 of 10: said in the summary only
