"""Format detection for all five formats and conversion to chat messages."""

import pytest

from slipstream.data import RowError, detect_format, to_messages

ROWS = {
    "messages": {
        "messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    },
    "sharegpt": {
        "conversations": [
            {"from": "system", "value": "S"},
            {"from": "human", "value": "Q"},
            {"from": "gpt", "value": "A"},
        ]
    },
    "prompt_completion": {"prompt": "Q", "completion": "A"},
    "alpaca": {"instruction": "Do X", "input": "with Y", "output": "A"},
    "text": {"text": "just text"},
}


@pytest.mark.parametrize("fmt", list(ROWS))
def test_detect_each_format(fmt):
    assert detect_format(ROWS[fmt]) == fmt


def test_conversions():
    qa = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    assert to_messages(ROWS["messages"], "messages") == qa
    assert to_messages(ROWS["sharegpt"], "sharegpt") == [{"role": "system", "content": "S"}, *qa]
    assert to_messages(ROWS["prompt_completion"], "prompt_completion") == qa
    alpaca = to_messages(ROWS["alpaca"], "alpaca")
    assert alpaca == [
        {"role": "user", "content": "Do X\n\nwith Y"},
        {"role": "assistant", "content": "A"},
    ]
    no_input = to_messages({"instruction": "Do X", "output": "A"}, "alpaca")
    assert no_input[0]["content"] == "Do X"
    assert to_messages(ROWS["text"], "text") == "just text"


def test_priority_and_override():
    both = {**ROWS["messages"], "text": "t"}
    assert detect_format(both) == "messages"
    assert detect_format(both, "text") == "text"
    with pytest.raises(ValueError, match="'chatml' is not one of"):
        detect_format(both, "chatml")
    with pytest.raises(ValueError, match=r"columns \['a', 'b'\]"):
        detect_format(["a", "b"])


@pytest.mark.parametrize(
    "row, fmt, reason",
    [
        ({"prompt": "Q"}, "prompt_completion", "missing_field"),
        ({"prompt": "Q", "completion": 3}, "prompt_completion", "wrong_type"),
        ({"conversations": [{"from": "bot", "value": "x"}]}, "sharegpt", "bad_role"),
        ({"conversations": []}, "sharegpt", "empty"),
        ({"messages": [["user", "hi"]]}, "messages", "wrong_type"),
        ({"text": ""}, "text", "empty"),
    ],
)
def test_malformed_rows_raise_row_error(row, fmt, reason):
    with pytest.raises(RowError) as info:
        to_messages(row, fmt)
    assert info.value.reason == reason
