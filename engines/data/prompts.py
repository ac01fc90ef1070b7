"""Load prompt datasets for RL post-training through the ``datasets`` library.

Schema of every row returned by :func:`load_prompt_rows`:

- ``prompt`` (str): the text given to the model.
- ``answer`` (str): the reference the reward checks (numbers in the file are turned into strings,
  so ``12`` becomes ``"12"``).
- any other column, unchanged: passed to reward functions as keyword columns, one list per column
  aligned with the prompts (``reward(prompts, completions, answer=[...], level=[...])``).

Accepted sources: a ``.jsonl``/``.json`` file (JSON lines, or one JSON array of objects), a
``.parquet`` file, or a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``.
"""

from __future__ import annotations

import json
import os

import datasets

_JSON_SUFFIXES = (".jsonl", ".json")
_PARQUET_SUFFIXES = (".parquet",)


def load_prompt_rows(
    path: str,  # .jsonl/.json file, .parquet file, or a save_to_disk folder
    *,
    prompt_key: str = "prompt",  # column holding the prompt; renamed to "prompt"
    answer_key: str = "answer",  # column holding the reference answer; renamed to "answer"
    split: str = "train",  # split taken from a DatasetDict folder; files have only "train"
) -> list[dict]:
    """Rows of the dataset at ``path`` as dicts with ``"prompt"``, ``"answer"`` and the other columns."""
    if prompt_key == answer_key:
        raise ValueError(f"prompt_key and answer_key are both {prompt_key!r}; they must name different columns")
    ds = _load(path, split)
    if len(ds) == 0:
        raise ValueError(f"prompt dataset {path} has no rows")
    columns = list(ds.column_names)
    for role, key in (("prompt_key", prompt_key), ("answer_key", answer_key)):
        if key not in columns:
            raise ValueError(f"prompt dataset {path} has no column {key!r} ({role}); its columns are {columns}")
    for target, key in (("prompt", prompt_key), ("answer", answer_key)):
        if key != target and target in columns:
            raise ValueError(
                f"prompt dataset {path} already has a column {target!r} besides {key!r}, so renaming "
                f"{key!r} to {target!r} would drop one; set {target}_key={target!r} or remove a column"
            )
    rows = []
    for i, record in enumerate(ds.to_list()):
        prompt, answer = record.pop(prompt_key), record.pop(answer_key)
        if not isinstance(prompt, str):
            raise ValueError(f"prompt dataset {path} row {i}: {prompt_key!r} must be a string, got {prompt!r}")
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        if not isinstance(answer, str):
            raise ValueError(f"prompt dataset {path} row {i}: {answer_key!r} must be a string, got {answer!r}")
        rows.append({"prompt": prompt, "answer": answer, **record})
    return rows


def _load(path: str, split: str) -> datasets.Dataset:
    if not os.path.exists(path):
        raise FileNotFoundError(f"prompt dataset {path} does not exist")
    if os.path.isdir(path):
        return _load_folder(path, split)
    lower = path.lower()
    if lower.endswith(_JSON_SUFFIXES):
        builder = "json"
    elif lower.endswith(_PARQUET_SUFFIXES):
        builder = "parquet"
    else:
        raise ValueError(
            f"prompt dataset {path}: expected a {'/'.join(_JSON_SUFFIXES + _PARQUET_SUFFIXES)} file "
            "or a folder written by save_to_disk"
        )
    # The builders fail on a file with no rows (StopIteration for json, "corresponds to no data" for
    # parquet), so empty files are caught first to give the error this module promises.
    if _file_has_no_rows(path, builder):
        raise ValueError(f"prompt dataset {path} has no rows")
    return datasets.load_dataset(builder, data_files=path, split="train")


def _load_folder(path: str, split: str) -> datasets.Dataset:
    folder = path
    dict_json = os.path.join(path, datasets.config.DATASETDICT_JSON_FILENAME)
    if os.path.isfile(dict_json):  # a DatasetDict: load only the asked-for split's folder
        with open(dict_json, encoding="utf-8") as f:
            splits = json.load(f)["splits"]
        if split not in splits:
            raise ValueError(f"prompt dataset {path} has no split {split!r}; its splits are {splits}")
        folder = os.path.join(path, split)
    # load_from_disk fails with an IndexError on a saved dataset without rows (no arrow files at all).
    state_json = os.path.join(folder, datasets.config.DATASET_STATE_JSON_FILENAME)
    if os.path.isfile(state_json):
        with open(state_json, encoding="utf-8") as f:
            if not json.load(f).get("_data_files", [None]):
                raise ValueError(f"prompt dataset {folder} has no rows")
    return datasets.load_from_disk(folder)


def _file_has_no_rows(path: str, builder: str) -> bool:
    if builder == "parquet":
        import pyarrow.parquet as pq  # a dependency of datasets

        return pq.read_metadata(path).num_rows == 0
    with open(path, encoding="utf-8") as f:
        head = f.read(4096)
    return "".join(head.split()) in ("", "[]") and len(head) < 4096
