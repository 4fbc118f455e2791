"""Loading local files through `datasets`, precise errors, held-out splits."""

import json

import datasets
import pytest

from slipstream.data import load_rows, load_split

ROWS = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(20)]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_each_file_type_loads_the_same_rows(tmp_path):
    ds = datasets.Dataset.from_list(ROWS)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.to_csv(str(tmp_path / "d.csv"), index=False)
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    (tmp_path / "w.json").write_text(json.dumps({"data": ROWS}))
    for name in ("d.parquet", "d.csv", "d.json", "w.json"):
        assert load_rows(str(tmp_path / name)).to_list() == ROWS, name
    assert load_rows(_jsonl(tmp_path / "d.jsonl", ROWS)).to_list() == ROWS


def test_bad_json_line_is_named_by_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:4: invalid JSON"):
        load_rows(str(path))
    path.write_text('{"text": "ok"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: a JSON line must be an object"):
        load_rows(str(path))
    (tmp_path / "bad.json").write_text('[\n{"text": "a"},\n{"text": }\n]')
    with pytest.raises(ValueError, match=r"bad\.json:3: invalid JSON"):
        load_rows(str(tmp_path / "bad.json"))


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".json"])
def test_non_utf8_is_named_by_file_and_line(tmp_path, suffix):
    path = tmp_path / f"latin1{suffix}"
    lines = (
        ['{"text": "fine"}', '{"text": "caf\u00e9"}']
        if suffix != ".csv"
        else ["text", "fine", "caf\u00e9"]
    )
    if suffix == ".json":
        lines = ["[", '{"text": "fine"},', '{"text": "caf\u00e9"}', "]"]
    path.write_bytes("\n".join(lines).encode("latin-1"))
    line = {".jsonl": 2, ".csv": 3, ".json": 3}[suffix]
    with pytest.raises(ValueError, match=rf"latin1\{suffix}:{line}: not UTF-8"):
        load_rows(str(path))


def test_empty_and_missing_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="empty"):
        load_rows(str(tmp_path / "empty.jsonl"))
    with pytest.raises(ValueError, match="does not exist"):
        load_rows(str(tmp_path / "missing.jsonl"))
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(ValueError, match="unknown type '.txt'"):
        load_rows(str(tmp_path / "d.txt"))


def test_split_by_fraction_is_seeded_and_disjoint(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", ROWS)
    train, held = load_split(path, eval_fraction=0.25, seed=3)
    again_train, again_held = load_split(path, eval_fraction=0.25, seed=3)
    other_train, _ = load_split(path, eval_fraction=0.25, seed=4)
    assert len(held) == 5 and len(train) == 15
    assert held.to_list() == again_held.to_list() and train.to_list() == again_train.to_list()
    assert train.to_list() != other_train.to_list()
    prompts = {r["prompt"] for r in train} | {r["prompt"] for r in held}
    assert len(prompts) == 20
    with pytest.raises(ValueError, match="eval_fraction"):
        load_split(path, eval_fraction=1.5)


def test_no_split_without_a_fraction(tmp_path):
    train, held = load_split(_jsonl(tmp_path / "t.jsonl", ROWS))
    assert len(train) == 20 and held is None


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv"])
def test_utf8_bom_is_read(tmp_path, suffix):
    # Windows editors save UTF-8 with a byte-order mark; the rows and column names are the same.
    path = tmp_path / f"bom{suffix}"
    text = {
        ".jsonl": "".join(json.dumps(r) + "\n" for r in ROWS),
        ".json": json.dumps(ROWS),
        ".csv": "prompt,completion\n" + "".join(f"{r['prompt']},{r['completion']}\n" for r in ROWS),
    }[suffix]
    path.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    assert load_rows(str(path)).to_list() == ROWS


def test_cut_off_json_line_names_its_real_column(tmp_path):
    cut = '{"prompt": "q1", "completion": "a1", "x":'  # the line ends where a value should be
    path = tmp_path / "cut.jsonl"
    path.write_text(f'{{"prompt": "q0", "completion": "a0"}}\n{cut}\n{{"prompt": "q2"}}\n')
    at = rf"cut\.jsonl:2: invalid JSON \(Expecting value at column {len(cut) + 1}\)"
    with pytest.raises(ValueError, match=at):
        load_rows(str(path))


def test_columns_of_later_rows_are_kept(tmp_path):
    # datasets' from_list keeps only the first row's keys: a file starting with a messages
    # row lost every later row's prompt/completion.
    rows = [{"text": "a"}, {"prompt": "q", "completion": "c"}]
    loaded = load_rows(_jsonl(tmp_path / "d.jsonl", rows)).to_list()
    assert loaded == [
        {"text": "a", "prompt": None, "completion": None},
        {"text": None, "prompt": "q", "completion": "c"},
    ]
