"""Regenerate ``configs/data/reasoning/{train,heldout}.jsonl`` from reasoning-gym, deterministically.

Three reasoning-gym datasets with short prompts, each with fixed seeds (train and heldout use different
seeds); every row carries ``rg_dataset``/``rg_config``/``rg_index`` for the ``reasoning_gym`` reward.

    python configs/data/make_reasoning.py          # rewrites the two files
    python configs/data/make_reasoning.py --check  # exits 1 if they differ from what it would write
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engines.rewards.reasoning_gym import make_rows  # noqa: E402

OUT_DIR = Path(__file__).resolve().parent / "reasoning"

# (reasoning-gym dataset, its config): settings chosen to keep prompts under ~200 characters.
DATASETS = [
    ("basic_arithmetic", {"min_terms": 2, "max_terms": 3, "max_digits": 2, "operators": ["+", "-", "*"],
                          "allow_parentheses": False, "allow_negation": False}),
    ("letter_counting", {"min_words": 3, "max_words": 6}),
    ("leg_counting", {"min_animals": 2, "max_animals": 3, "max_instances": 5}),
]
SPLITS = {"train": (12, 1001), "heldout": (4, 2002)}  # split -> (rows per dataset, seed)


def build() -> dict[str, list[dict]]:
    """Rows of each split: every dataset's rows in ``DATASETS`` order."""
    return {split: [row for name, config in DATASETS for row in make_rows(name, size, seed, **config)]
            for split, (size, seed) in SPLITS.items()}


def render(rows: list[dict]) -> str:
    """JSON lines, one row each, as the files hold them."""
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for split, rows in build().items():
        path, text = OUT_DIR / f"{split}.jsonl", render(rows)
        if check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(str(path))
            continue
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {len(rows)} rows to {path}")
    if stale:
        print(f"out of date: {', '.join(stale)}; run python configs/data/make_reasoning.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
