"""Numbers people can compare: bits per byte beside the loss, and scripts/eval.py reproducing a run's best."""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import make_text, metrics, read_metrics, run_main, run_script, tiny_args, tiny_model
from fault_injection import disk_full_from_step

import checkpoint
import train
from checkpoint import from_checkpoint, load_checkpoint
from data import load_corpus, val_windows
from scripts import eval as eval_script
from scripts import export_hf, import_hf
from tokenizer import CharTokenizer, token_byte_lengths

CPU = torch.device("cpu")


def test_char_model_bits_per_byte_is_the_loss_over_ln2_on_ascii_and_counts_multibyte_characters_bytes():
    tok = CharTokenizer("".join(chr(c) for c in range(32, 82)))  # 50 ASCII characters, one byte each
    ids = torch.randint(0, 50, (100,), generator=torch.Generator().manual_seed(0)).numpy()
    x, y = val_windows(ids, 16)  # 99 targets: the last window is padded
    result = train.evaluate(tiny_model(), x, y, 2, CPU, torch.float32, train.val_byte_count(y, tok, CPU))
    assert result.tokens == 99
    assert result.bpb == pytest.approx(result.loss / math.log(2), rel=1e-12)
    text = "café 😀 中文!"  # and where a character is several bytes: a hand count
    tok = CharTokenizer("".join(sorted(set(text))))
    assert token_byte_lengths(tok)[tok.stoi["😀"]] == 4
    x, y = val_windows(tok.encode_array(text), 4)
    # The targets are every character but the first, "afé 😀 中文!":
    # a f é(2) ' ' 😀(4) ' ' 中(3) 文(3) ! = 17 bytes
    assert train.val_byte_count(y, tok, CPU) == 17 == len(text.encode()) - 1


def train_tiny(out: Path, text_file: Path) -> None:
    """20 steps, an eval every 10, in a fresh interpreter as a user runs it."""
    run_script("train.py", *tiny_args(out, text_file, max_iters=20, eval_interval=10))


@pytest.mark.slow  # a training run and an eval in fresh interpreters: ~30 s on a busy 2-core CPU
def test_eval_script_reproduces_the_logged_best_val_loss_exactly(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    train_tiny(out, text_file)
    best = load_checkpoint(out / "best.pt")
    vals = [r for r in read_metrics(out) if "val_loss" in r]
    assert [r["step"] for r in vals] == [10, 20]
    for r in vals:  # the corpus is ASCII: one byte per character, per token
        assert r["val_bpb"] == pytest.approx(r["val_loss"] / math.log(2), rel=1e-9)
    assert best["last_eval"]["val_loss"] == best["best_val_loss"] == min(r["val_loss"] for r in vals)

    report = json.loads(run_script("-m", "scripts.eval", "--ckpt", str(out), "--json").stdout)
    assert report["val_loss"] == best["best_val_loss"]  # exactly: the same windows, batches and code
    assert report["val_bpb"] == best["last_eval"]["val_bpb"]
    (meta,) = [json.loads(p.read_text()) for p in (tmp_path / "data").glob("*/meta.json")]
    scored = min(4096, meta["val_tokens"] - 1)  # the tiny preset's eval_tokens, or the whole (small) split
    assert report["tokens"] == report["bytes"] == report["chars"] == scored

    text = "Good king, sleep.\nFair lady, wake!\n"
    other = tmp_path / "other.txt"
    other.write_text(text)
    on_file = eval_run(capsys, "--ckpt", str(out), "--data_path", str(other), "--json", "--batch_size", "3")[1]
    assert on_file["tokens"] == on_file["bytes"] == on_file["chars"] == len(text) - 1  # all of it, once
    assert on_file["val_bpb"] == pytest.approx(on_file["val_loss"] / math.log(2), rel=1e-9)


def test_the_log_never_claims_a_best_pt_that_failed_to_save(tmp_path, text_file, monkeypatch, capsys):
    out = tmp_path / "out"
    real_save = checkpoint.save_checkpoint
    disk_full_from_step(monkeypatch, 10)  # step 5's eval saves, step 10's (a new best) fails
    assert run_main(tiny_args(out, text_file, max_iters=10, eval_interval=5)) == 74
    captured = capsys.readouterr()
    assert captured.err.startswith(f"error: could not write {out / 'best.pt'} (No space left on device)")
    val_lines = [line for line in captured.out.splitlines() if "val loss" in line]
    assert len(val_lines) == 1 and val_lines[0].startswith("step      5 |")
    assert val_lines[0].endswith("(best, saved best.pt)")
    assert [r["step"] for r in metrics(out)[1]] == [5, 10]  # the eval ran; its save did not
    monkeypatch.setattr(checkpoint, "save_checkpoint", real_save)  # space again
    assert run_main(tiny_args(out, text_file, max_iters=10, eval_interval=5, resume=True)) == 0
    assert [r["step"] for r in metrics(out)[1]] == [5, 10]  # the resume dropped step 10's record, then redid it


def test_a_kill_right_after_a_save_loses_no_val_record(tmp_path, text_file, monkeypatch):
    """Killed between writing last.pt and the log line, the run still holds the record of that eval."""
    out = tmp_path / "out"
    real_save = checkpoint.save_checkpoint

    def save_then_die(state: dict, path: Path) -> None:
        real_save(state, path)
        if state["step"] == 10 and path.name == "last.pt":
            raise KeyboardInterrupt  # stands in for a SIGKILL: no line printed or record written after this

    monkeypatch.setattr(checkpoint, "save_checkpoint", save_then_die)
    run_main(tiny_args(out, text_file, max_iters=10, eval_interval=5))
    monkeypatch.setattr(checkpoint, "save_checkpoint", real_save)
    assert [r["step"] for r in metrics(out)[1]] == [5, 10]
    assert run_main(tiny_args(out, text_file, max_iters=15, eval_interval=5, resume=True)) == 0
    assert [r["step"] for r in metrics(out)[1]] == [5, 10, 15]


@pytest.mark.slow  # ~5 s
def test_eval_script_scores_imported_weights_like_the_checkpoint_they_came_from(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    train_tiny(out, text_file)
    loaded = from_checkpoint(out / "best.pt")
    export_hf.export(loaded.model, loaded.tokenizer, tmp_path / "hf")  # bias-free: zero biases
    import_hf.main([str(tmp_path / "hf"), str(tmp_path / "imported")])
    capsys.readouterr()
    args = ("--data_path", str(text_file), "--json", "--batch_size", "4")
    from_ckpt = eval_run(capsys, "--ckpt", str(out), *args)[1]
    from_hf = eval_run(capsys, "--ckpt", str(tmp_path / "imported"), *args)[1]
    assert from_hf["tokens"] == from_ckpt["tokens"] > 0
    assert from_hf["val_loss"] == pytest.approx(from_ckpt["val_loss"], abs=1e-5)  # + 0 biases: addmm vs mm
    with pytest.raises(SystemExit, match="2"):  # a char vocabulary need not be the built-in corpus's
        eval_script.main(["--ckpt", str(tmp_path / "imported")])
    assert "pass the text to score with --data_path" in capsys.readouterr().err


def eval_run(capsys, *args: str) -> tuple[int, dict | None, str]:
    """(exit code, the --json report or None, stderr) of an in-process eval."""
    try:
        eval_script.main([*args, "--json"])
    except SystemExit as stopped:
        captured = capsys.readouterr()
        assert captured.out == ""  # stdout holds the JSON or nothing: a prepare's lines go to stderr
        return stopped.code, None, captured.err
    captured = capsys.readouterr()
    return 0, json.loads(captured.out), captured.err  # stdout holds the JSON alone (a prepare's lines: stderr)


def tiny_eval_run(out: Path, text_file: Path, capsys) -> float:
    """A 4-step tiny run with one eval; its logged best val loss. What it printed is read and dropped."""
    assert run_main(tiny_args(out, text_file, max_iters=4, eval_interval=4, eval_tokens=512)) == 0
    capsys.readouterr()
    return load_checkpoint(out / "best.pt")["best_val_loss"]


def test_eval_after_its_text_changed_scores_the_runs_own_split_or_says_what_changed(tmp_path, text_file, capsys):
    """The run's text rewritten after training (its lines reversed): eval scores the run's split, never the new."""
    out, data_dir = tmp_path / "run", text_file.parent / "data"
    best = tiny_eval_run(out, text_file, capsys)
    then = load_checkpoint(out / "best.pt")["corpus"]["fingerprint"]["val"]
    old_hash = hashlib.sha256(text_file.read_bytes()).hexdigest()
    text_file.write_text("".join(reversed(text_file.read_text().splitlines(keepends=True))))
    new_hash = hashlib.sha256(text_file.read_bytes()).hexdigest()
    (split,) = data_dir.iterdir()

    code, report, err = eval_run(capsys, "--ckpt", str(out))  # the run's split is still in data/: scored, and said
    assert code == 0 and report["val_loss"] == best and report["data"].startswith(f"the val split of {split}")
    assert err.count("\n") == 1 and old_hash[:12] in err and new_hash[:12] in err and f"--data_path {text_file}" in err
    assert list(data_dir.iterdir()) == [split]  # nothing prepared

    split.rename(tmp_path / "elsewhere")  # the run's split gone too: refused, twice, and nothing left behind
    for _ in range(2):
        code, report, err = eval_run(capsys, "--ckpt", str(out))
        last = err.splitlines()[-1]  # --json: a prepare's lines go to stderr, before the refusal's one line
        assert code == 2 and last.startswith("error: ") and then[:12] in last and f"--data_path {text_file}" in last
        assert list(data_dir.iterdir()) == []
    text_file.write_text(text_file.read_text().replace("e", "\u00e9"))  # other characters: the same cause named
    code, report, err = eval_run(capsys, "--ckpt", str(out))
    assert code == 2 and "changed since" in err and "another tokenizer" not in err, err
    assert list(data_dir.iterdir()) == []


def test_eval_after_its_text_moved_scores_the_runs_prepared_split_and_takes_a_prepared_folder(tmp_path, text_file,
                                                                                             capsys, monkeypatch):
    """The text moved after training: eval takes the run's split, also as --data_path; a documents folder: refused.
    Bug caught first: eval's header came after the scoring, and its bar only in a terminal: minutes of nothing."""
    out, data_dir = tmp_path / "run", text_file.parent / "data"
    best = tiny_eval_run(out, text_file, capsys)
    with monkeypatch.context() as patched:
        seen, real_evaluate = [], eval_script.evaluate
        patched.setattr(eval_script, "evaluate", lambda *args: seen.append(capsys.readouterr()) or real_evaluate(*args))
        eval_script.main(["--ckpt", str(out), "--batch_size", "1", "--eval_tokens", "1024"])  # 32 windows, one a batch
    assert seen[0].out.startswith(f"# {out / 'best.pt'} (step 4, logged best val loss ")  # before the scoring
    assert "evaluating" in capsys.readouterr().err  # its bar, on stderr
    text_file.rename(tmp_path / "moved.txt")
    (split,) = data_dir.iterdir()
    code, report, err = eval_run(capsys, "--ckpt", str(out))
    assert code == 0 and report["val_loss"] == best and err.count("\n") == 1 and str(text_file) in err
    elsewhere = split.rename(tmp_path / "split")
    code, report, err = eval_run(capsys, "--ckpt", str(out), "--data_path", str(elsewhere))  # the same split, passed
    assert code == 0 and report["val_loss"] == best, err
    code, report, err = eval_run(capsys, "--ckpt", str(out))  # the text and the split gone: what eval takes
    assert code == 2 and err.count("\n") == 1 and "--data_path" in err and "train.bin" in err, err
    assert not data_dir.exists() or list(data_dir.iterdir()) == []
    documents = tmp_path / "documents"
    documents.mkdir()
    (documents / "a.txt").write_text(make_text(12))
    code, report, err = eval_run(capsys, "--ckpt", str(out), "--data_path", str(documents))
    assert code == 2 and err.count("\n") == 1 and f"{documents} holds documents" in err and "text file" in err, err


# ----------------------------------------------------------------------------- objective and metric apart
def test_an_objective_term_trains_but_never_reaches_val_loss_or_best_pt(tmp_path, text_file, capsys):
    """z_loss (an auxiliary loss) is minimised, logged by name, and kept out of val loss, bpb and best.pt."""
    args = dict(max_iters=6, eval_interval=3, eval_tokens=512)
    assert run_main(tiny_args(tmp_path / "plain", text_file, **args)) == 0
    assert run_main(tiny_args(tmp_path / "z", text_file, z_loss=0.5, **args)) == 0  # large, so the term shows
    out = capsys.readouterr().out
    plain, z = (read_metrics(tmp_path / name) for name in ("plain", "z"))
    steps = [r for r in z if "val_loss" not in r]
    assert all(r["z_loss"] > 0.1 for r in steps) and all("z_loss" not in r for r in plain)
    assert f"| z_loss {steps[0]['z_loss']:.4g} |" in out  # the step line names the term
    # Step 1's logged loss is cross-entropy before any update: the same with or without the term...
    assert steps[0]["loss"] == next(r for r in plain if "val_loss" not in r)["loss"]
    # ...and the term is in the gradient: the weights moved elsewhere.
    weights = [load_checkpoint(tmp_path / name / "last.pt")["model"] for name in ("plain", "z")]
    assert not torch.equal(weights[0]["lm_head.weight"], weights[1]["lm_head.weight"])
    # Val loss, bits per byte and best.pt are plain cross-entropy: eval.py scores best.pt exactly so.
    best = load_checkpoint(tmp_path / "z" / "best.pt")
    report = eval_run(capsys, "--ckpt", str(tmp_path / "z" / "best.pt"))[1]
    assert report["val_loss"] == best["best_val_loss"] == min(r["val_loss"] for r in z if "val_loss" in r)
    model = from_checkpoint(tmp_path / "z" / "best.pt").model
    x, y = val_windows(load_corpus(next((tmp_path / "data").glob("*/meta.json")).parent, 32).val, 32, 512)
    with torch.no_grad():
        _, loss_sum, n, aux = model(x, y)
    assert aux["z_loss"] > 0.1 * n  # the model still computes the term; the metric leaves it out
    assert report["val_loss"] == pytest.approx((loss_sum / n).item(), rel=1e-6)
