"""Nothing executed: a checkpoint is data. No load in this repo can run code from a pickle."""
from __future__ import annotations

import ast
import os
import pickle
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_main, tiny_args

import sample
from checkpoint import REQUIRED_KEYS, load_checkpoint, save_checkpoint
from cli import CheckpointError


class Payload:
    """Unpickling this creates a folder: the stand-in for any code an attacker wants to run."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def malicious_checkpoint(path: Path, marker: Path, with_digest: bool) -> None:
    """A checkpoint whose 'model' runs code when unpickled; with the digest only weights_only stops it."""
    state = {key: {} for key in REQUIRED_KEYS} | {"step": 1, "model": Payload(marker)}
    path.parent.mkdir(parents=True, exist_ok=True)
    if with_digest:
        save_checkpoint(state, path)
    else:
        torch.save(state, path)


def test_the_payload_is_live(tmp_path):
    # Without this, the refusals below could pass because the payload never worked.
    malicious_checkpoint(tmp_path / "evil.pt", tmp_path / "marker", with_digest=True)
    with zipfile.ZipFile(tmp_path / "evil.pt") as archive:
        pickled = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    pickle.loads(pickled)  # a plain unpickler runs it
    assert (tmp_path / "marker").is_dir()


@pytest.mark.parametrize("with_digest, refusal", [(True, "refused to load ("), (False, "not a tinygpt checkpoint")])
def test_malicious_checkpoint_is_refused_by_train_resume_and_by_sample(tmp_path, text_file, capsys, with_digest,
                                                                      refusal):
    """With a valid digest only weights_only stops it; without, the digest check does, before unpickling."""
    out, marker = tmp_path / "out", tmp_path / "marker"
    malicious_checkpoint(out / "last.pt", marker, with_digest)
    before = (out / "last.pt").read_bytes()
    assert run_main(tiny_args(out, text_file, resume="true")) == 2
    assert run_main(["--ckpt", str(out / "last.pt"), "--device", "cpu"], sample.main) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 2 and all(e.startswith(f"error: {out / 'last.pt'}: {refusal}") for e in errors), errors
    assert not marker.exists()
    assert (out / "last.pt").read_bytes() == before


# torch.save's stand-ins end with two bytes for save_checkpoint's digest to replace (a zip's comment length): the
# file passes the integrity check and only the unpickler can refuse it.
@pytest.mark.parametrize("writer, why", [
    (lambda obj, f: f.write(pickle.dumps(obj, protocol=4) + bytes(2)), "Unsupported operand 149"),  # a bare pickle
    (torch.save, "GLOBAL posix.mkdir whose module posix is blocked"),
    (lambda obj, f: f.write(b"hello world" + bytes(2)), "KeyError: 101"),  # no pickle: the error's type
], ids=["plain pickle", "torch.save", "garbage"])
def test_a_refusal_with_a_valid_digest_says_what_the_unpickler_rejected(tmp_path, monkeypatch, writer, why):
    path, marker = tmp_path / "evil.pt", tmp_path / "marker"
    with monkeypatch.context() as patched:
        patched.setattr(torch, "save", writer)
        malicious_checkpoint(path, marker, with_digest=True)
    with warnings.catch_warnings(record=True) as warned, pytest.raises(CheckpointError) as refused:
        warnings.simplefilter("always")
        load_checkpoint(path)
    reason = str(refused.value).removeprefix(f"{path}: refused to load (").removesuffix(")")
    assert why in reason and "\n" not in reason and len(reason) <= 300, str(refused.value)
    assert warned == []  # torch's "Detected pickle protocol 4" warning would be a second line of output
    assert not marker.exists()


def python_sources() -> list[Path]:
    ignored = {".git", ".venv", "venv", "data", "out", "__pycache__"}
    return [p for p in REPO.rglob("*.py") if not ignored & set(p.relative_to(REPO).parts)]


def test_source_never_loads_with_weights_only_false():
    loads = 0
    for path in python_sources():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value.id if isinstance(node.func.value, ast.Name) else ""
                where = f"{path.relative_to(REPO)}:{node.lineno}"
                flag = next((k.value for k in node.keywords if k.arg == "weights_only"), None)
                if (owner, node.func.attr) == ("torch", "load") or flag is not None:  # any load(weights_only=..)
                    loads += 1
                    assert isinstance(flag, ast.Constant) and flag.value is True, \
                        f"{where}: a load without weights_only=True"
                is_test = path.parent.name == "tests"
                assert is_test or (owner, node.func.attr) not in (("pickle", "load"), ("pickle", "loads")), \
                    f"{where}: pickle load in product code"
    assert loads >= 2  # checkpoint.py's load and the schema test's: the scan does find calls

