"""Sampling: the exact KV cache, the filters, batches, seeds, streaming and the command line."""
from __future__ import annotations

import io
import math
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import ctrl_c_at_the_first_call, make_text, run_main, tiny_model

import sample as sample_module
from checkpoint import FORMAT_VERSION, load_checkpoint, save_checkpoint
from config import REPO, as_dict, make_config, model_config
from model import GPT
from sample import (Continuations, KVCache, NextTokenLogits, filter_logits, generate, main, pick_next, unescape,
                    window_start)
from scripts import chat as chat_script
from tokenizer import CharTokenizer


def varied_model(block_size: int = 16, seed: int = 0) -> GPT:
    """Weights of std 0.2: at GPT-2's init greedy output repeats one token, which would let a broken cache pass."""
    model = tiny_model(block_size=block_size, seed=seed).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


def random_ids(B: int, T: int, seed: int = 1, vocab: int = 50) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))  # (B, T)


def greedy_with_logits(model: GPT, idx: torch.Tensor, steps: int, use_cache: bool, keep: int = 0) -> tuple:
    """Greedy tokens (B, T + steps) and the logits of every step (B, steps, vocab)."""
    next_logits, all_logits = NextTokenLogits(model, use_cache, keep), []
    with torch.no_grad():
        for _ in range(steps):
            all_logits.append(next_logits(idx))  # (B, vocab)
            idx = torch.cat([idx, all_logits[-1].argmax(dim=-1, keepdim=True)], dim=1)
    return idx, torch.stack(all_logits, dim=1)


# ----------------------------------------------------------------------------- KV cache
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_decode_and_extension_equal_one_full_forward(dtype):
    model, idx = varied_model(), random_ids(3, 16)
    cache = KVCache(model.config, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        full = model(idx).logits  # (3, 16, vocab)
        parts = [model(idx[:, a:b], cache=cache).logits for a, b in [(0, 5), (5, 6), (6, 7), (7, 12), (12, 16)]]
    assert cache.length == 16 and cache.layers[0].k.dtype == dtype
    tolerance = dict(atol=1e-5, rtol=0) if dtype == torch.float32 else dict(atol=0.1, rtol=0.05)
    torch.testing.assert_close(torch.cat(parts, dim=1).float(), full.float(), **tolerance)


def test_a_forward_past_block_size_is_refused_with_or_without_a_cache():
    model = varied_model()
    cache = KVCache(model.config, 1)
    model(random_ids(1, 16), cache=cache)
    for idx, past in ((random_ids(1, 1), cache), (random_ids(1, 17), None)):
        with pytest.raises(ValueError, match="exceeds block_size"):
            model(idx, cache=past)


def test_window_start_policy_table():
    bs, keep = 16, 8
    assert window_start(None, 5, bs, keep) == window_start(None, 16, bs, keep) == 0  # a prompt that fits: all of it
    assert window_start(None, 23, bs, keep) == 7  # long prompt: the last block_size tokens
    assert window_start(0, 16, bs, keep) == 0 and window_start(9, 25, bs, keep) == 9  # still fits: grow
    assert window_start(0, 17, bs, keep) == 9 and window_start(9, 26, bs, keep) == 18  # one past: the last keep
    assert window_start(7, 24, bs, bs) == 8  # keep = block_size: the classic sliding window


@pytest.mark.parametrize("prompt_len", [5, 16, 23])  # shorter than, equal to, longer than block_size
@pytest.mark.parametrize("keep", [0, 1, 16])  # default block_size // 2, extremes
def test_cached_greedy_equals_uncached_past_block_size(prompt_len, keep):
    model = varied_model(block_size=16)
    idx = random_ids(2, prompt_len)
    cached_ids, cached_logits = greedy_with_logits(model, idx, 40, use_cache=True, keep=keep)
    plain_ids, plain_logits = greedy_with_logits(model, idx, 40, use_cache=False, keep=keep)
    assert torch.equal(cached_ids, plain_ids)
    torch.testing.assert_close(cached_logits, plain_logits, atol=1e-5, rtol=0)
    assert len(set(cached_ids[0, prompt_len:].tolist())) > 3  # a real test: the text varies


@pytest.mark.parametrize("keep", [0, 16])
def test_cached_logits_equal_full_forward_over_the_policy_windows(keep):
    """The reference, by hand: keep 0 (the default, 8) restarts the window at 9, then 18; keep 16 slides."""
    model = varied_model(block_size=16)
    ids, logits = greedy_with_logits(model, random_ids(1, 5), 30, use_cache=True, keep=keep)
    for step in range(30):
        n = 5 + step  # tokens known when this step predicts
        start = max(0, n - 16) if keep == 16 else 0 if n <= 16 else 9 if n <= 25 else 18
        expected = model(ids[:, start:n]).logits[:, -1]  # (1, vocab)
        torch.testing.assert_close(logits[:, step], expected, atol=1e-5, rtol=0)
        assert ids[0, n] == expected.argmax()


def test_batch_rows_equal_separate_runs():
    model, idx = varied_model(), random_ids(3, 6)  # three different prompts in one batch
    batch = generate(model, idx, 25, temperature=0)
    for row in range(3):
        assert torch.equal(batch[row: row + 1], generate(model, idx[row: row + 1], 25, temperature=0))


# ----------------------------------------------------------------------------- filters and temperature
def kept(logits: list[float], **kw) -> set[int]:
    """Ids that survive filter_logits on one row of hand-built logits."""
    return {i for i, x in enumerate(filter_logits(torch.tensor([logits]), **kw)[0].tolist()) if x != -math.inf}


def test_top_k_keeps_the_k_largest_and_their_ties():
    assert kept([1.0, 3.0, 2.0, 5.0, 4.0], top_k=2) == {3, 4}
    assert kept([1.0, 3.0, 2.0], top_k=10) == {0, 1, 2}  # k > V: everything
    assert kept([1.0, 3.0, 2.0], top_k=0) == {0, 1, 2}  # off
    assert kept([1.0, 2.0, 2.0, 0.0], top_k=2) == {1, 2}
    assert kept([3.0, 1.0, 3.0, 3.0], top_k=1) == {0, 2, 3}


@pytest.mark.parametrize("top_p, expected", [
    (1e-9, {1}),  # a tiny p keeps exactly the top token
    (0.5, {1}), (0.5 + 1e-6, {1, 3}),  # the mass reaches p exactly at 0.5: `above <= top_p` would keep one more
    (0.75 - 1e-6, {1, 3}), (0.75, {1, 3}), (0.875, {1, 3, 0}),
    (0.9, {1, 3, 0, 2, 4}),  # 0.875 < 0.9 needs a 0.0625 token, and its tie comes with it
    (1.0, {0, 1, 2, 3, 4}),  # off
])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, expected):
    logits = [math.log(p) for p in (0.125, 0.5, 0.0625, 0.25, 0.0625)]  # shuffled: ranks map back to ids; dyadic
    assert F.softmax(torch.tensor(logits), -1).sort(descending=True).values.cumsum(-1).tolist() == \
        [0.5, 0.75, 0.875, 0.9375, 1.0]  # the premise: exact in float32
    assert kept(logits, top_p=top_p) == expected


def test_top_p_applies_to_the_distribution_left_by_top_k_row_by_row_with_ties():
    out = filter_logits(torch.tensor([[2.0, 2.0, 0.0], [0.0, 0.0, 5.0]]), top_p=1e-9)
    assert torch.equal(out.isfinite(), torch.tensor([[True, True, False], [False, False, True]]))
    logits = [math.log(p) for p in (0.4, 0.3, 0.2, 0.1)]
    assert kept(logits, top_p=0.5) == {0, 1}  # 0.4 falls short of 0.5
    assert kept(logits, top_k=2, top_p=0.5) == {0}  # renormalised over two: 0.4 / 0.7 = 0.57 reaches 0.5
    assert kept(logits, top_k=2, top_p=0.65) == {0, 1}


def test_sampling_only_draws_from_the_kept_set_and_temperature_zero_draws_nothing():
    gen = torch.Generator().manual_seed(0)
    drawn = pick_next(torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]]).repeat(500, 1), 1.0, top_k=3, generator=gen)
    assert set(drawn.flatten().tolist()) == {2, 3, 4}
    before = gen.get_state()
    assert pick_next(torch.tensor([[0.1, 0.7, 0.2]]), 0.0, generator=gen).tolist() == [[1]]
    assert torch.equal(gen.get_state(), before)
    # Bug caught: logits / 1e-45 overflow to inf, and softmax of inf - inf is NaN: torch.multinomial raised.
    for tiny in (1e-45, 1e-46):  # and 1e-46, 0 in float32: the largest's shifted 0 / 0 was a NaN too
        assert pick_next(torch.tensor([[2.0, 1.0, 3.0, -1.0]]), tiny, generator=gen).item() == 2  # greedy, not NaN


def test_sampling_draws_from_its_seeded_generator_alone_with_or_without_the_cache():
    model, global_state = varied_model(block_size=16), torch.get_rng_state()
    runs = [generate(model, random_ids(3, 4), 40, temperature=1.5, top_k=20, top_p=0.95, use_cache=use_cache,
                     generator=torch.Generator().manual_seed(seed)) for seed, use_cache in
            [(7, True), (7, True), (8, True), (7, False)]]  # 44 tokens: past block_size, the window restarts
    assert torch.equal(torch.get_rng_state(), global_state)
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[3]) and not torch.equal(runs[0], runs[2])
    assert not torch.equal(runs[0][0], runs[0][1])  # one generator, different rows


def test_draws_follow_the_tempered_distribution():
    """Bug caught: logits multiplied by T (5 sigma is < 0.013; T = 0.5 against 2 moves the top token's p by ~0.3)."""
    n, temperature = 40_000, 0.5
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])  # (1, 5): distinct values, no ties
    draws = pick_next(logits.repeat(n, 1), temperature, generator=torch.Generator().manual_seed(0))  # (n, 1)
    frequency = torch.bincount(draws.flatten(), minlength=5).double() / n  # (5,)
    expected = F.softmax(logits[0].double() / temperature, dim=-1)  # (5,)
    assert ((frequency - expected).abs() < 5 * (expected * (1 - expected) / n).sqrt()).all(), frequency


# ----------------------------------------------------------------------------- streaming text
def piece_tokenizer(pieces: list[bytes]) -> SimpleNamespace:
    """Token i is the bytes ``pieces[i]``: pieces that cut characters, the worst case for streaming."""
    return SimpleNamespace(pieces=pieces, decode_bytes=lambda ids: b"".join(pieces[i] for i in ids))


TRICKY = "naïve — 日本語 🎉🇫🇷!"


def streamed(tokenizer, ids) -> tuple[list[str], Continuations]:
    """The text each token adds to a Continuations row as it arrives, and the rows (not yet finished)."""
    rows, pieces = Continuations(tokenizer, 1, [], set()), []
    for i in ids:
        before = len(rows.texts[0])
        rows.push(torch.tensor([[i]]))
        pieces.append(rows.texts[0][before:])
    return pieces, rows


@pytest.mark.parametrize("group", [1, 2, 3, 5])  # tokens of 1, 2, 3 or 5 bytes, cutting characters
def test_streamed_text_never_holds_half_a_character(group):
    data = TRICKY.encode("utf-8")
    tok = piece_tokenizer([data[i: i + group] for i in range(0, len(data), group)])
    pieces, rows = streamed(tok, range(len(tok.pieces)))
    rows.finish()
    assert "".join(pieces) == rows.texts[0] == TRICKY and all("\ufffd" not in piece for piece in pieces)
    if group == 1:
        emoji_at = len(TRICKY[:TRICKY.index("🎉")].encode("utf-8"))
        assert pieces[emoji_at: emoji_at + 4] == ["", "", "", "🎉"]  # first 3 of 4 bytes: held


def test_streamed_text_flushes_an_unfinished_character_as_replacement_and_chars_stream_as_they_decode():
    pieces, rows = streamed(piece_tokenizer(["ok🎉".encode("utf-8")[:-1]]), [0])
    assert pieces == ["ok"]
    rows.finish()
    assert rows.texts == ["ok\ufffd"]
    tok = CharTokenizer("".join(sorted(set(TRICKY))))
    assert "".join(streamed(tok, tok.encode(TRICKY))[0]) == TRICKY == tok.decode(tok.encode(TRICKY))


def test_continuations_hold_back_a_possible_stop_and_end_at_end_of_text(capsys):
    tok = CharTokenizer("abcdn")
    rows = Continuations(tok, 1, ["abc"], end_ids={tok.stoi["n"]}, show=True)
    for c in "dab":
        rows.push(torch.tensor([[tok.stoi[c]]]))
    assert rows.texts == ["dab"] and capsys.readouterr().out == "d"  # "ab" could still become "abc"
    rows.push(torch.tensor([[tok.stoi["d"]]]))
    assert capsys.readouterr().out == "abd" and not all(rows.done)
    for c in "na":  # the end-of-text token ends the row, and is no text
        rows.push(torch.tensor([[tok.stoi[c]]]))
    assert all(rows.done) and rows.texts == ["dabd"]
    assert unescape(r"\n\n") == "\n\n" and unescape(r"a\tb\\n") == "a\tb\\n" and unescape("é\\x") == "é\\x"


# ----------------------------------------------------------------------------- command line
@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """A random-init char checkpoint of the tiny preset (sampling does not need a trained model)."""
    cfg = make_config("tiny", device="cpu", out_dir=str(tmp_path / "out"), data_dir=str(tmp_path / "data"))
    tokenizer = CharTokenizer("".join(sorted(set(make_text()))))
    torch.manual_seed(0)
    model = GPT(model_config(cfg, tokenizer.vocab_size))
    state = {"format_version": FORMAT_VERSION, "model": model.state_dict(), "optimizer": {}, "scaler": {},
             "step": 0, "time_s": 0.0, "best_val_loss": math.inf, "config": as_dict(cfg), "tokenizer": tokenizer.meta(),
             "rng": {}, "rng_per_rank": [], "precision": "float32", "versions": {}, "last_eval": {}, "corpus": {}}
    save_checkpoint(state, tmp_path / "out" / "best.pt")
    return tmp_path / "out" / "best.pt"


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def spy_forward(monkeypatch, on_call) -> None:
    """Call on_call(idx) before every GPT forward."""
    real = GPT.forward
    monkeypatch.setattr(GPT, "forward", lambda self, idx, *args, **kw: on_call(idx) or real(self, idx, *args, **kw))


def test_num_samples_is_one_batch_and_streaming_prints_while_generating_what_a_batch_prints(ckpt, monkeypatch):
    common = ["--ckpt", str(ckpt), "--prompt", "KING:", "--max-new-tokens", "40", "--temp", "0",
              "--num-samples", "3"]  # 5 + 40 tokens: past the tiny preset's block_size of 32
    outputs, forwards = [], []  # forwards: (batch size, characters printed so far) at each forward
    spy_forward(monkeypatch, lambda idx: forwards.append((idx.size(0), len(sys.stdout.getvalue()))))
    for flags in ([], ["--no-stream"], ["--no-stream", "--no-cache"]):  # a terminal: streams by default
        monkeypatch.setattr(sys, "stdout", terminal := FakeTerminal())
        forwards.clear()
        main(common + flags)
        outputs.append(terminal.getvalue())
        assert [size for size, _ in forwards] == [3] * 40  # one forward per new token, each for all samples
        assert (len({printed for _, printed in forwards}) > 1) == (not flags)  # streaming: the text grows meanwhile
    assert outputs[0] == outputs[1] == outputs[2] and outputs[0].count("-" * 40) == 3
    assert outputs[0].split("\n")[1].startswith("KING:")


def test_empty_prompt_starts_from_the_start_token(ckpt, monkeypatch, capsys):
    first_inputs = []
    spy_forward(monkeypatch, lambda idx: first_inputs.append(idx.tolist()))
    main(["--ckpt", str(ckpt), "--max-new-tokens", "4", "--no-stream"])
    assert first_inputs[0] == [[CharTokenizer("".join(sorted(set(make_text())))).stoi["\n"]]]
    sample = capsys.readouterr().out.split("\n", 1)[1].split("-" * 40)[0]
    assert len(sample) == 4 + 1  # the 4 new characters and print's newline, not the start token


def test_ctrl_c_while_sampling_is_one_line_and_exit_130(ckpt, monkeypatch, capsys):
    ctrl_c_at_the_first_call(monkeypatch, sample_module, "generate")
    code, err = run_main(["--ckpt", str(ckpt)], main), capsys.readouterr().err
    assert code == 130 and err.startswith("error: interrupted") and err.count("\n") == 1, err


@pytest.mark.parametrize("script", ["train.py", "sample.py"])
def test_ctrl_c_while_torch_imports_ends_the_process_without_a_traceback(script):
    """Ctrl-C in the seconds `import torch` takes: the process ends as on SIGINT, not in an import's traceback."""
    ctrl_c_at_import_torch = ("import builtins, os, runpy, signal, sys\nreal = builtins.__import__\n"
                              "def importing(name, *args, **kwargs):\n    if name == 'torch':\n"
                              "        os.kill(os.getpid(), signal.SIGINT)\n    return real(name, *args, **kwargs)\n"
                              f"builtins.__import__ = importing\nsys.argv = ['{script}']\n"
                              f"runpy.run_path('{script}', run_name='__main__')\n")
    result = subprocess.run([sys.executable, "-c", ctrl_c_at_import_torch], cwd=REPO, capture_output=True, timeout=60)
    assert result.returncode == -signal.SIGINT and result.stderr == b"", result.stderr[-300:]


def test_a_closed_stdout_ends_sampling_quietly_as_sigpipe_would(ckpt):
    """`| head`: the reader gone, exit 141 (SIGPIPE's, as a shell says) and no traceback; tools end alike (run_tool)."""
    child = subprocess.Popen([sys.executable, "sample.py", "--ckpt", str(ckpt)], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    child.stdout.close()  # before its first line: that write fails
    assert child.wait(timeout=120) == 141 and child.stderr.read() == b""

def test_a_prompt_file_or_escapes_and_threads_as_train_py_takes_them(ckpt, tmp_path, monkeypatch, capsys):
    """A newline from a file or as --prompt's \\n; `--threads 1` as train.py takes it; 0 keeps torch's default."""
    (tmp_path / "prompt.txt").write_text("QUEEN:\n")
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    for flags in (["--prompt-file", str(tmp_path / "prompt.txt"), "--threads", "1"], ["--prompt", r"QUEEN:\n"]):
        main(["--ckpt", str(ckpt), *flags, "--max-new-tokens", "3", "--temp", "0", "--no-stream"])
        assert capsys.readouterr().out.split("\n", 1)[1].startswith("QUEEN:\n")
    assert calls == [1]


# ----------------------------------------------------------------------------- stop strings
def samples_of(ckpt: Path, capsys, *flags: str) -> list[str]:
    """main's printed samples (prompt included, separators and the header line removed)."""
    main(["--ckpt", str(ckpt), "--prompt", "KING:", "--max-new-tokens", "60", "--no-stream", *flags])
    out = capsys.readouterr().out.split("\n", 1)[1]
    return [chunk.removeprefix("\n").removesuffix("\n") for chunk in out.split("-" * 40)[:-1]]


@pytest.mark.parametrize("flags", [["--temp", "0"], ["--temp", "1.0", "--num-samples", "3", "--seed", "5"]])
def test_each_sample_ends_at_its_first_stop_string(ckpt, capsys, flags):
    """Each row stops on its own, at the earliest of several stops, one spanning two tokens included."""
    full = samples_of(ckpt, capsys, *flags)
    span = full[0][len("KING:") + 3:][:2]  # two characters (two char tokens) the first sample does produce
    for stops in ([span], ["never-produced"], [span, full[-1][-3:-1], "never-produced"]):
        stop_flags = [f for stop in stops for f in ("--stop", stop)]
        cut = samples_of(ckpt, capsys, *flags, *stop_flags)
        first_cut = [min((row.find(s, len("KING:")) for s in stops if s in row[len("KING:"):]), default=len(row))
                     for row in full]
        assert cut == [row[:at] for row, at in zip(full, first_cut)], stops
        assert samples_of(ckpt, capsys, *flags, *stop_flags, "--no-cache") == cut


def test_streaming_never_prints_a_stop_string_even_in_part_and_generation_ends_at_it(ckpt, monkeypatch):
    common = ["--ckpt", str(ckpt), "--prompt", "KING:", "--max-new-tokens", "60", "--temp", "1"]
    monkeypatch.setattr(sys, "stdout", terminal := FakeTerminal())
    main(common + ["--no-stream"])
    new_text = terminal.getvalue().split("\n", 1)[1].split("-" * 40)[0][len("KING:"):]
    stop = new_text[7:10]
    kept_text = new_text[:new_text.index(stop)]
    seen = []  # what the terminal showed of the continuation before each forward
    monkeypatch.setattr(sys, "stdout", terminal := FakeTerminal())
    spy_forward(monkeypatch, lambda idx: seen.append(terminal.getvalue().partition("KING:")[2]))
    main(common + ["--stop", stop])
    assert terminal.getvalue().split("\n", 1)[1] == "KING:" + kept_text + "\n" + "-" * 40 + "\n"
    assert all(kept_text.startswith(shown) for shown in seen)  # never a character of the stop, not even its first
    assert any(shown for shown in seen)  # while it did stream
    assert len(seen) == len(kept_text) + len(stop) < 60  # a forward per token up to the stop, no more


def test_the_end_of_text_token_stops_a_bpe_model_unless_told_not_to(ckpt, monkeypatch, capsys):
    """A char stands in for GPT-2's end-of-text token: the tokenizer's special_ids say which ids end a sample."""
    full = samples_of(ckpt, capsys, "--temp", "0")[0]
    ender, real_init = full[len("KING:") + 4], CharTokenizer.__init__

    def with_an_end(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.special_ids = frozenset({self.stoi[ender]})

    monkeypatch.setattr(CharTokenizer, "__init__", with_an_end)
    assert samples_of(ckpt, capsys, "--temp", "0") == ["KING:" + full[len("KING:"):].split(ender)[0]]
    assert samples_of(ckpt, capsys, "--temp", "0", "--no-stop-at-eot") == [full]


# ----------------------------------------------------------------------------- scripts.chat on a text model
def feed(monkeypatch, lines: list) -> None:
    """input() returns these lines in turn; an exception instance is raised instead (EOFError at the end)."""
    queue = iter([*lines, EOFError()])

    def fake_input(prompt: str = "") -> str:
        if isinstance(item := next(queue), BaseException):
            raise item
        return item
    monkeypatch.setattr("builtins.input", fake_input)


def test_sample_takes_a_run_folder_and_chat_continues_each_prompt_of_a_text_model(ckpt, monkeypatch, capsys):
    main(["--ckpt", str(ckpt.parent), "--num-samples", "2", "--max-new-tokens", "20", "--top-k", "5", "--top-p", "0.9",
          "--seed", "3"])
    out, err = capsys.readouterr()
    assert out.count("-" * 40) == 2 and err == ""
    feed(monkeypatch, ["KING:", "the", "", "QUEEN:", ""])  # --multiline: a prompt ends at an empty line
    chat_script.main(["--ckpt", str(ckpt), "--max-new-tokens", "20", "--temp", "0", "--multiline", "--no-stream"])
    out, err = capsys.readouterr()
    assert err == "" and out.startswith("# continuing each prompt")  # it says which of its two modes it is in
    samples = out.split("\n", 1)[1].split("-" * 40 + "\n")
    assert samples[0].startswith("KING:\nthe") and samples[1].startswith("QUEEN:") and samples[2] == ""


def test_the_prompt_loop_refuses_a_bad_prompt_in_one_line_and_ctrl_c_stops_or_quits(ckpt, monkeypatch, capsys):
    calls = ctrl_c_at_the_first_call(monkeypatch, sample_module, "generate")
    feed(monkeypatch, ["KING: €", "KING:", "QUEEN:", KeyboardInterrupt(), "never read"])
    chat_script.main(["--ckpt", str(ckpt), "--max-new-tokens", "5", "--temp", "0", "--no-stream"])
    out, err = capsys.readouterr()
    samples = out.split("\n", 1)[1].split("-" * 40 + "\n")
    assert err.startswith("error: ") and err.count("\n") == 1  # a character the vocabulary lacks: said, asked again
    assert len(calls) == 2 and samples[1].startswith("QUEEN:")
    assert samples[-1] == ""  # nothing printed after Ctrl-C at the prompt


def test_weights_that_do_not_fit_the_code_are_refused_in_one_line(ckpt, capsys):
    """A checkpoint of other code (an option added since, its default new): exit 2, not torch's traceback."""
    state = load_checkpoint(ckpt)
    state["model"] = {k: v[:1] if k.endswith("c_fc.weight") else v for k, v in state["model"].items()}
    save_checkpoint(state, ckpt)
    code, err = run_main(["--ckpt", str(ckpt)], main), capsys.readouterr().err
    assert code == 2 and "its weights do not fit" in err and err.count("\n") == 1, err
