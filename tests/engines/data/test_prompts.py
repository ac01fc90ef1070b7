import json

import datasets
import pytest

from engines.data.prompts import load_prompt_rows

ROWS = [
    {"prompt": "1+1=", "answer": "2", "level": 1},
    {"prompt": "2*3=", "answer": "6", "level": 2},
]


@pytest.fixture(autouse=True)
def _private_datasets_cache(tmp_path, monkeypatch):
    """load_dataset writes arrow caches; keep them out of ~/.cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    datasets.disable_progress_bars()


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_jsonl(tmp_path):
    assert load_prompt_rows(_write_jsonl(tmp_path / "p.jsonl", ROWS)) == ROWS


def test_json_array(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(ROWS))
    assert load_prompt_rows(str(path)) == ROWS


def test_parquet(tmp_path):
    path = str(tmp_path / "p.parquet")
    datasets.Dataset.from_list(ROWS).to_parquet(path)
    assert load_prompt_rows(path) == ROWS


def test_save_to_disk_dataset(tmp_path):
    path = str(tmp_path / "ds")
    datasets.Dataset.from_list(ROWS).save_to_disk(path)
    assert load_prompt_rows(path) == ROWS


def test_save_to_disk_dataset_dict_takes_split(tmp_path):
    path = str(tmp_path / "dd")
    test_rows = [{"prompt": "9-4=", "answer": "5", "level": 3}]
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(test_rows)}
    ).save_to_disk(path)
    assert load_prompt_rows(path) == ROWS  # split="train" by default
    assert load_prompt_rows(path, split="test") == test_rows
    with pytest.raises(ValueError, match=r"no split 'validation'.*\['train', 'test'\]"):
        load_prompt_rows(path, split="validation")


def test_custom_keys_are_renamed_and_other_columns_kept(tmp_path):
    rows = [{"question": "What is 3+4?", "solution": "7", "source": "hand"}]
    got = load_prompt_rows(_write_jsonl(tmp_path / "q.jsonl", rows), prompt_key="question", answer_key="solution")
    assert got == [{"prompt": "What is 3+4?", "answer": "7", "source": "hand"}]


def test_numeric_answers_become_strings(tmp_path):
    # JSON 12 loads as int64 and 0.5 as float; the schema promises str.
    got = load_prompt_rows(_write_jsonl(tmp_path / "n.jsonl", [{"prompt": "a", "answer": 12}]))
    assert got == [{"prompt": "a", "answer": "12"}]
    got = load_prompt_rows(_write_jsonl(tmp_path / "f.jsonl", [{"prompt": "a", "answer": 0.5}]))
    assert got == [{"prompt": "a", "answer": "0.5"}]


def test_missing_column_names_column_file_and_existing_columns(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", ROWS)
    with pytest.raises(ValueError) as err:
        load_prompt_rows(path, answer_key="solution")
    message = str(err.value)
    assert "'solution'" in message
    assert path in message
    assert "['prompt', 'answer', 'level']" in message


def test_missing_prompt_column_in_parquet(tmp_path):
    path = str(tmp_path / "p.parquet")
    datasets.Dataset.from_list([{"question": "x", "answer": "1"}]).to_parquet(path)
    with pytest.raises(ValueError, match=r"no column 'prompt' \(prompt_key\).*\['question', 'answer'\]"):
        load_prompt_rows(path)


def test_rename_onto_an_existing_column_is_refused(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "question": "b", "answer": "1"}])
    with pytest.raises(ValueError, match="already has a column 'prompt'"):
        load_prompt_rows(path, prompt_key="question")


def test_non_string_prompt_is_refused(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": [{"role": "user", "content": "hi"}], "answer": "1"}])
    with pytest.raises(ValueError, match="row 0: 'prompt' must be a string"):
        load_prompt_rows(path)


def test_empty_sources(tmp_path):
    empty_jsonl = tmp_path / "e.jsonl"
    empty_jsonl.write_text("")
    empty_json = tmp_path / "e.json"
    empty_json.write_text("[]\n")
    empty_parquet = str(tmp_path / "e.parquet")
    datasets.Dataset.from_list(ROWS).select([]).to_parquet(empty_parquet)
    empty_disk = str(tmp_path / "e_disk")
    datasets.Dataset.from_list(ROWS).select([]).save_to_disk(empty_disk)
    for path in (str(empty_jsonl), str(empty_json), empty_parquet, empty_disk):
        with pytest.raises(ValueError, match="has no rows"):
            load_prompt_rows(path)
    # A DatasetDict whose "test" split is empty: "train" still loads, "test" is refused.
    dd_path = str(tmp_path / "dd")
    full = datasets.Dataset.from_list(ROWS)
    datasets.DatasetDict({"train": full, "test": full.select([])}).save_to_disk(dd_path)
    assert load_prompt_rows(dd_path) == ROWS
    with pytest.raises(ValueError, match="has no rows"):
        load_prompt_rows(dd_path, split="test")


def test_bad_paths(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_prompt_rows(str(tmp_path / "missing.jsonl"))
    csv = tmp_path / "p.csv"
    csv.write_text("prompt,answer\n1+1=,2\n")
    with pytest.raises(ValueError, match="expected a .jsonl/.json/.parquet file"):
        load_prompt_rows(str(csv))
    with pytest.raises(ValueError, match="must name different columns"):
        load_prompt_rows(str(csv), prompt_key="x", answer_key="x")
