"""The items of tinygpt_cloze.yaml, read from the .jsonl beside this file, whatever the working directory.

lm_eval calls ``load`` (the YAML's ``custom_dataset``) with the task's metadata as keyword arguments.
"""
import json
from pathlib import Path

import datasets

ITEMS = Path(__file__).with_name("tinygpt_cloze.jsonl")


def load(**_metadata) -> datasets.DatasetDict:
    rows = [json.loads(line) for line in ITEMS.read_text(encoding="utf-8").splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
