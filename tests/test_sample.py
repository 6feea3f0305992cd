"""Sampling: the KV cache is exact, the filters keep exactly the right tokens, batches, seeds, streaming
and the command line. All fp32 on CPU, tiny models, a few seconds in all."""
from __future__ import annotations

import io
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, make_text, run_script, tiny_model

import sample as sample_module
from checkpoint import FORMAT_VERSION, save_checkpoint
from config import as_dict, make_config, model_config
from model import GPT, GPTConfig, attention, visible_keys
from sample import (
    Continuations,
    KVCache,
    NextTokenLogits,
    filter_logits,
    generate,
    main,
    next_token_probs,
    pick_next,
    prompt_ids,
    unescape,
    window_start,
)
from scripts import chat as chat_script
from tokenizer import CharTokenizer

NEG_INF = float("-inf")


def varied_model(block_size: int = 16, seed: int = 0) -> GPT:
    """A tiny model whose greedy output changes with the context.

    At GPT-2's init (std 0.02) a random model repeats one token forever, which would let a broken
    cache pass; weights of std 0.2 make the next token depend on the whole context.
    """
    model = tiny_model(block_size=block_size, seed=seed).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


def random_ids(B: int, T: int, seed: int = 1, vocab: int = 50) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))  # (B, T)


def greedy_with_logits(model: GPT, idx: torch.Tensor, steps: int, use_cache: bool,
                       keep: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens (B, T + steps) and the logits of every step (B, steps, vocab)."""
    next_logits = NextTokenLogits(model, idx.size(0), use_cache, keep)
    all_logits = []
    with torch.no_grad():
        for _ in range(steps):
            logits = next_logits(idx)  # (B, vocab)
            all_logits.append(logits)
            idx = torch.cat([idx, logits.argmax(dim=-1, keepdim=True)], dim=1)
    return idx, torch.stack(all_logits, dim=1)


def kept(logits: list[float], **kw) -> set[int]:
    """Ids that survive filter_logits on one row of hand-built logits."""
    out = filter_logits(torch.tensor([logits]), **kw)[0]
    return {i for i, x in enumerate(out.tolist()) if x != NEG_INF}


# ----------------------------------------------------------------------------- KV cache: masks
def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Textbook attention where query i is at position S + i and sees keys 0 .. S + i."""
    T, L = q.size(2), k.size(2)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, nh, T, L)
    allowed = torch.arange(L)[None, :] <= torch.arange(L - T, L)[:, None]  # (T, L)
    return scores.masked_fill(~allowed, NEG_INF).softmax(dim=-1) @ v  # (B, nh, T, hs)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plain_causal: bool = True) -> torch.Tensor:
    """model.attention of T new queries after S cached keys, with visible_keys' mask, as a layer computes it."""
    T, S = q.size(2), k.size(2) - q.size(2)
    mask = visible_keys(GPTConfig(vocab_size=1, block_size=S + T), S, T, q.device)  # (T, S + T)
    return attention(q, k, v, mask, plain_causal, 0.0)


@pytest.mark.parametrize("S, T", [(0, 5), (4, 1), (4, 3), (1, 6)])
@pytest.mark.parametrize("plain_causal", [True, False], ids=["SDPA's own causal paths", "the mask"])
def test_cached_attention_masks_like_textbook_attention(S, T, plain_causal):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, T, 8, generator=gen)
    k, v = torch.randn(2, 2, S + T, 8, generator=gen), torch.randn(2, 2, S + T, 8, generator=gen)
    torch.testing.assert_close(cached_attention(q, k, v, plain_causal), naive_attention(q, k, v), atol=1e-6, rtol=0)


def test_is_causal_with_one_query_is_the_wrong_mask():
    """Why decode does not use is_causal: SDPA aligns it top-left, hiding all keys but the first."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 1, 8, generator=gen)  # one new token after four cached ones
    k, v = torch.randn(1, 1, 5, 8, generator=gen), torch.randn(1, 1, 5, 8, generator=gen)
    top_left = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(top_left, v[:, :, :1])  # sees key 0 only
    assert not torch.allclose(cached_attention(q, k, v), top_left)


def test_prefill_decode_and_extension_equal_one_full_forward():
    model = varied_model()
    idx = random_ids(3, 16)
    full, _, _, _ = model(idx)  # (3, 16, vocab)
    cache = KVCache(model.config, 3)
    parts = [model(idx[:, a:b], cache=cache)[0] for a, b in [(0, 5), (5, 6), (6, 7), (7, 12), (12, 16)]]
    assert cache.length == 16
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=0)


def test_cache_takes_the_dtype_of_the_keys_under_autocast():
    model = varied_model()
    idx = random_ids(2, 12)
    cache = KVCache(model.config, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full, _, _, _ = model(idx)  # (2, 12, vocab)
        parts = [model(idx[:, :8], cache=cache)[0], model(idx[:, 8:9], cache=cache)[0],
                 model(idx[:, 9:], cache=cache)[0]]
    assert cache.layers[0].k.dtype == torch.bfloat16
    torch.testing.assert_close(torch.cat(parts, dim=1).float(), full.float(), atol=0.1, rtol=0.05)


def test_cache_refuses_to_run_past_block_size():
    model = varied_model()
    cache = KVCache(model.config, 1)
    model(random_ids(1, 16), cache=cache)
    with pytest.raises(ValueError, match="exceeds block_size"):
        model(random_ids(1, 1), cache=cache)
    cache.reset()  # positions restart at 0; the stale keys past length are never read
    fresh = random_ids(1, 3, seed=5)
    torch.testing.assert_close(model(fresh, cache=cache)[0], model(fresh)[0], atol=1e-5, rtol=0)


def test_forward_without_a_cache_still_trains():
    model = tiny_model(block_size=16)
    idx, targets = random_ids(2, 16), random_ids(2, 16, seed=2)
    logits, loss_sum, n, _ = model(idx, targets)
    expected = torch.nn.functional.cross_entropy(logits.reshape(32, 50), targets.reshape(32), reduction="sum")
    torch.testing.assert_close(loss_sum, expected)
    loss_sum.backward()
    assert n.item() == 32 and model.transformer.wpe.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="exceeds block_size"):
        model(random_ids(1, 17))


# ----------------------------------------------------------------------------- KV cache: generation
def test_window_start_policy_table():
    bs, keep = 16, 8
    assert window_start(None, 5, bs, keep) == 0  # short prompt: all of it
    assert window_start(None, 16, bs, keep) == 0  # exactly block_size: all of it
    assert window_start(None, 23, bs, keep) == 7  # long prompt: the last block_size tokens
    assert window_start(0, 16, bs, keep) == 0  # still fits: grow
    assert window_start(0, 17, bs, keep) == 9  # one past block_size: restart with the last keep
    assert window_start(9, 25, bs, keep) == 9  # 16 tokens from 9: fits
    assert window_start(9, 26, bs, keep) == 18
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


def test_cached_sampling_equals_uncached_with_the_same_seed():
    model = varied_model(block_size=16)
    runs = [generate(model, random_ids(3, 4), 40, temperature=1.5, top_k=20, top_p=0.95, use_cache=use_cache,
                     generator=torch.Generator().manual_seed(0)) for use_cache in (True, False)]
    assert torch.equal(runs[0], runs[1])


def test_cached_logits_equal_full_forward_over_the_policy_windows():
    """Reference written out by hand, independent of window_start: block 16, keep 8, prompt 5."""
    model = varied_model(block_size=16)
    ids, logits = greedy_with_logits(model, random_ids(1, 5), 30, use_cache=True)
    for step in range(30):
        n = 5 + step  # tokens known when this step predicts
        start = 0 if n <= 16 else 9 if n <= 25 else 18 if n <= 34 else None
        expected = model(ids[:, start:n])[0][:, -1]  # (1, vocab)
        torch.testing.assert_close(logits[:, step], expected, atol=1e-5, rtol=0)


def test_keep_block_size_is_the_classic_sliding_window():
    model = varied_model(block_size=16)
    idx = random_ids(1, 5)
    ids = generate(model, idx, 30, temperature=0, use_cache=True, keep=16)
    expected = idx
    with torch.no_grad():
        for _ in range(30):
            logits = model(expected[:, -16:])[0][:, -1]  # (1, vocab)
            expected = torch.cat([expected, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(ids, expected)


def test_batch_rows_equal_separate_runs():
    model = varied_model()
    idx = random_ids(3, 6)  # three different prompts in one batch
    batch = generate(model, idx, 25, temperature=0)
    for row in range(3):
        assert torch.equal(batch[row: row + 1], generate(model, idx[row: row + 1], 25, temperature=0))


def test_padded_vocab_ids_are_never_produced():
    model = varied_model()  # vocab 50, padded to 64
    with torch.no_grad():
        model.lm_head.weight[50:] = 100.0  # make every padded id overwhelmingly "likely"
    gen = torch.Generator().manual_seed(0)
    for temp in (0.0, 1.0, 5.0):
        out = generate(model, random_ids(4, 3), 20, temperature=temp, generator=gen)
        assert out.max().item() < 50


# ----------------------------------------------------------------------------- filters
def test_top_k_keeps_the_k_largest():
    assert kept([1.0, 3.0, 2.0, 5.0, 4.0], top_k=2) == {3, 4}
    assert kept([1.0, 3.0, 2.0, 5.0, 4.0], top_k=1) == {3}
    assert kept([1.0, 3.0, 2.0], top_k=10) == {0, 1, 2}  # k > V: everything
    assert kept([1.0, 3.0, 2.0], top_k=0) == {0, 1, 2}  # off


def test_top_k_keeps_ties_with_the_kth():
    assert kept([1.0, 2.0, 2.0, 0.0], top_k=2) == {1, 2}
    assert kept([3.0, 1.0, 3.0, 3.0], top_k=1) == {0, 2, 3}


PROBS = [0.125, 0.5, 0.0625, 0.25, 0.0625]  # shuffled, so the filter must map ranks back to ids


@pytest.mark.parametrize("top_p, expected", [
    (1e-9, {1}),  # a tiny p keeps exactly the top token
    (0.4, {1}),
    (0.6, {1, 3}),  # 0.5 < 0.6: the second token is needed
    (0.8, {1, 3, 0}),
    (0.9, {1, 3, 0, 2, 4}),  # 0.875 < 0.9 needs a 0.0625 token, and its tie comes with it
    (1.0, {0, 1, 2, 3, 4}),  # off
])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, expected):
    assert kept([math.log(p) for p in PROBS], top_p=top_p) == expected


def test_top_p_ties_at_the_top_and_rows_are_independent():
    logits = torch.tensor([[2.0, 2.0, 0.0], [0.0, 0.0, 5.0]])
    out = filter_logits(logits, top_p=1e-9)
    assert torch.equal(out.isfinite(), torch.tensor([[True, True, False], [False, False, True]]))


def test_top_p_applies_to_the_distribution_left_by_top_k():
    logits = [math.log(p) for p in (0.4, 0.3, 0.2, 0.1)]
    assert kept(logits, top_p=0.5) == {0, 1}  # 0.4 falls short of 0.5
    assert kept(logits, top_k=2, top_p=0.5) == {0}  # renormalised over two: 0.4 / 0.7 = 0.57 reaches 0.5
    assert kept(logits, top_k=2, top_p=0.65) == {0, 1}


def test_sampling_only_draws_from_the_kept_set():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]]).repeat(500, 1)  # (500, 5)
    gen = torch.Generator().manual_seed(0)
    drawn = pick_next(logits, temperature=1.0, top_k=3, generator=gen)  # (500, 1)
    assert set(drawn.flatten().tolist()) == {2, 3, 4}


def test_temperature_zero_is_argmax_and_draws_nothing():
    gen = torch.Generator().manual_seed(0)
    before = gen.get_state()
    assert pick_next(torch.tensor([[0.1, 0.7, 0.2]]), 0.0, generator=gen).tolist() == [[1]]
    assert torch.equal(gen.get_state(), before)


def test_seeded_generator_is_reproducible_and_global_rng_untouched():
    model = varied_model()
    global_state = torch.get_rng_state()
    runs = [generate(model, random_ids(3, 4), 20, temperature=1.0, generator=torch.Generator().manual_seed(s))
            for s in (7, 7, 8)]
    assert torch.equal(torch.get_rng_state(), global_state)
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    assert not torch.equal(runs[0][0], runs[0][1])  # one generator, different rows


# ----------------------------------------------------------------------------- streaming text
class PieceTokenizer:
    """Token i is the bytes ``pieces[i]``: pieces that cut characters, the worst case for streaming."""

    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces

    def decode_bytes(self, ids: list[int]) -> bytes:
        return b"".join(self.pieces[i] for i in ids)


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
    tok = PieceTokenizer([data[i: i + group] for i in range(0, len(data), group)])
    pieces, rows = streamed(tok, range(len(tok.pieces)))
    rows.finish()
    assert "".join(pieces) == rows.texts[0] == TRICKY
    assert all("\ufffd" not in piece for piece in pieces)
    if group == 1:
        emoji_at = len(TRICKY[:TRICKY.index("🎉")].encode("utf-8"))
        assert pieces[emoji_at: emoji_at + 3] == ["", "", ""]  # first 3 of 4 bytes: held
        assert pieces[emoji_at + 3] == "🎉"


def test_streamed_text_flushes_an_unfinished_character_as_replacement():
    pieces, rows = streamed(PieceTokenizer(["ok🎉".encode("utf-8")[:-1]]), [0])
    assert pieces == ["ok"]
    rows.finish()
    assert rows.texts == ["ok\ufffd"]


def test_char_tokenizer_streams_like_it_decodes():
    tok = CharTokenizer("".join(sorted(set(TRICKY))))
    pieces, _ = streamed(tok, tok.encode(TRICKY))
    assert "".join(pieces) == TRICKY == tok.decode(tok.encode(TRICKY))


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
             "rng": {}, "rng_per_rank": [], "precision": "float32", "versions": {}, "last_eval": {},
             "corpus": {}}
    path = tmp_path / "out" / "best.pt"
    save_checkpoint(state, path)
    return path


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def spy_forward(monkeypatch, on_call) -> None:
    """Call on_call(idx) before every GPT forward."""
    real = GPT.forward

    def forward(self, idx, *args, **kwargs):
        on_call(idx)
        return real(self, idx, *args, **kwargs)
    monkeypatch.setattr(GPT, "forward", forward)


def test_num_samples_is_one_batch(ckpt, monkeypatch, capsys):
    batch_sizes = []
    spy_forward(monkeypatch, lambda idx: batch_sizes.append(idx.size(0)))
    main(["--ckpt", str(ckpt), "--num-samples", "3", "--max-new-tokens", "10", "--no-stream"])
    assert batch_sizes == [3] * 10  # one forward per new token, each for all samples
    assert capsys.readouterr().out.count("-" * 40) == 3


def test_stream_prints_while_generating_and_matches_batch_output(ckpt, monkeypatch):
    common = ["--ckpt", str(ckpt), "--prompt", "KING:", "--max-new-tokens", "40", "--temp", "0",
              "--num-samples", "2"]  # 5 + 40 tokens: past the tiny preset's block_size of 32
    outputs = []
    for flags in ([], ["--no-stream"], ["--no-stream", "--no-cache"]):  # a terminal: streams by default
        terminal = FakeTerminal()
        monkeypatch.setattr(sys, "stdout", terminal)
        printed_before_forward = []
        spy_forward(monkeypatch, lambda idx: printed_before_forward.append(len(terminal.getvalue())))
        main(common + flags)
        outputs.append(terminal.getvalue())
        grew = len(set(printed_before_forward)) > 1
        assert grew == (not flags)  # streaming: the text grows between forwards; otherwise not
    assert outputs[0] == outputs[1] == outputs[2]
    assert outputs[0].split("\n")[1].startswith("KING:")


def test_empty_prompt_starts_from_the_start_token(ckpt, monkeypatch, capsys):
    first_inputs = []
    spy_forward(monkeypatch, lambda idx: first_inputs.append(idx.tolist()))
    main(["--ckpt", str(ckpt), "--max-new-tokens", "4", "--no-stream"])
    tok = CharTokenizer("".join(sorted(set(make_text()))))
    assert first_inputs[0] == [[tok.stoi["\n"]]] == [prompt_ids(tok, "")]
    sample = capsys.readouterr().out.split("\n", 1)[1].split("-" * 40)[0]
    assert len(sample) == 4 + 1  # the 4 new characters and print's newline, not the start token


def test_prompt_file_and_unknown_characters(ckpt, tmp_path, capsys):
    (tmp_path / "prompt.txt").write_text("QUEEN:\n")
    main(["--ckpt", str(ckpt), "--prompt-file", str(tmp_path / "prompt.txt"), "--max-new-tokens", "3",
          "--temp", "0", "--no-stream"])
    assert capsys.readouterr().out.split("\n", 1)[1].startswith("QUEEN:\n")
    for flags in (["--prompt", "KING: €"], ["--prompt-file", str(tmp_path / "missing.txt")]):
        with pytest.raises(SystemExit) as exit_info:
            main(["--ckpt", str(ckpt), *flags])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1
    assert "--prompt-file" in err and "--data_path" not in err  # the fix names the flag that was used


def test_sample_script_runs_as_a_command(ckpt):
    result = run_script("sample.py", "--ckpt", str(ckpt.parent), "--num-samples", "2", "--max-new-tokens", "20",
                        "--top-k", "5", "--top-p", "0.9", "--seed", "3")
    assert result.stdout.count("-" * 40) == 2 and result.stderr == ""


def test_threads_is_train_pys_flag_and_zero_keeps_torchs_default(ckpt, monkeypatch, capsys):
    """`--threads 1` (two jobs on 2 cores, one each) as train.py takes it; a negative count is refused, exit 2."""
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    for threads, expected in (("1", [1]), ("0", [])):
        calls.clear()
        main(["--ckpt", str(ckpt), "--threads", threads, "--max-new-tokens", "2", "--no-stream"])
        assert calls == expected
    with pytest.raises(SystemExit) as exit_info:
        main(["--ckpt", str(ckpt), "--threads", "-1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "--threads" in err


# ----------------------------------------------------------------------------- stop strings
def samples_of(ckpt: Path, capsys, *flags: str) -> list[str]:
    """main's printed samples (prompt included, separators and the header line removed)."""
    main(["--ckpt", str(ckpt), "--prompt", "KING:", "--max-new-tokens", "60", "--no-stream", *flags])
    out = capsys.readouterr().out.split("\n", 1)[1]
    return [chunk.removeprefix("\n").removesuffix("\n") for chunk in out.split("-" * 40)[:-1]]


def first_cut(text: str, stops: list[str]) -> str:
    return text[:min((text.find(s) for s in stops if s in text), default=len(text))]


@pytest.mark.parametrize("flags", [["--temp", "0"], ["--temp", "1.0", "--num-samples", "3", "--seed", "5"]])
def test_each_sample_ends_at_its_first_stop_string(ckpt, capsys, flags):
    """Each row stops on its own (batched), at the earliest of several stops, a stop spanning two tokens
    included; one that never appears changes nothing; the KV cache gives the text --no-cache gives."""
    full = samples_of(ckpt, capsys, *flags)
    span = full[0][len("KING:") + 3:][:2]  # two characters (two char tokens) the first sample does produce
    never = "never-produced"
    for stops in ([span], [never], [span, full[-1][-3:-1], never]):
        stop_flags = [f for stop in stops for f in ("--stop", stop)]
        cut = samples_of(ckpt, capsys, *flags, *stop_flags)
        assert cut == ["KING:" + first_cut(row[len("KING:"):], stops) for row in full], stops
        assert samples_of(ckpt, capsys, *flags, *stop_flags, "--no-cache") == cut
    assert samples_of(ckpt, capsys, *flags, "--stop", never) == full


def test_generation_ends_once_every_sample_has_stopped(ckpt, monkeypatch, capsys):
    forwards = []
    spy_forward(monkeypatch, lambda idx: forwards.append(idx.size(1)))
    common = ["--ckpt", str(ckpt), "--prompt", "KING:", "--max-new-tokens", "60", "--no-stream", "--temp", "1"]
    main(common)
    new_text = capsys.readouterr().out.split("\n", 1)[1].split("-" * 40)[0][len("KING:"):]
    stop = new_text[10:12]  # made by new tokens 11 and 12, or earlier where the pair occurs before
    forwards.clear()
    main(common + ["--stop", stop])
    assert len(forwards) == new_text.index(stop) + len(stop) < 60  # a forward per token up to the stop, no more


def test_streaming_never_prints_a_stop_string_even_in_part(ckpt, monkeypatch):
    common = ["--ckpt", str(ckpt), "--prompt", "KING:", "--max-new-tokens", "60", "--temp", "1"]
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    main(common + ["--no-stream"])
    new_text = terminal.getvalue().split("\n", 1)[1].split("-" * 40)[0][len("KING:"):]
    stop = new_text[7:10]
    kept = new_text[:new_text.index(stop)]
    seen = []  # what the terminal showed of the continuation before each forward
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    spy_forward(monkeypatch, lambda idx: seen.append(terminal.getvalue().partition("KING:")[2]))
    main(common + ["--stop", stop])
    assert terminal.getvalue().split("\n", 1)[1] == "KING:" + kept + "\n" + "-" * 40 + "\n"
    assert all(kept.startswith(shown) for shown in seen)  # never a character of the stop, not even its first
    assert any(shown for shown in seen)  # while it did stream


def test_continuations_hold_back_a_possible_stop_and_end_at_end_of_text():
    tok = CharTokenizer("abcdn")
    ids = lambda text: torch.tensor([[tok.stoi[c]] for c in text]).T  # noqa: E731 - (1, len)
    rows = Continuations(tok, 1, ["abc"], end_ids={tok.stoi["n"]})
    for c in "dab":
        rows.push(ids(c)[:, :1])
    assert rows.texts == ["dab"] and rows.printable(0) == "d"  # "ab" could still become "abc"
    rows.push(ids("d"))
    assert rows.printable(0) == "dabd" and not rows.all_done()
    rows.push(ids("n"))  # the end-of-text token: ends the row, and is no text
    rows.push(ids("a"))
    assert rows.all_done() and rows.texts == ["dabd"]
    assert unescape(r"\n\n") == "\n\n" and unescape(r"a\tb\\n") == "a\tb\\n" and unescape("é\\x") == "é\\x"


def test_the_end_of_text_token_stops_a_bpe_model_unless_told_not_to(ckpt, monkeypatch, capsys):
    """A char vocabulary has no end-of-text token; GPT-2's has one, which --stop-at-eot (default) obeys.
    A char stands in for it here: the tokenizer's special_ids say which ids end a sample."""
    full = samples_of(ckpt, capsys, "--temp", "0")[0]
    ender = full[len("KING:") + 4]
    real_init = CharTokenizer.__init__

    def with_an_end(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.special_ids = frozenset({self.stoi[ender]})

    monkeypatch.setattr(CharTokenizer, "__init__", with_an_end)
    assert samples_of(ckpt, capsys, "--temp", "0") == ["KING:" + full[len("KING:"):].split(ender)[0]]
    assert samples_of(ckpt, capsys, "--temp", "0", "--no-stop-at-eot") == [full]


# ----------------------------------------------------------------------------- scripts.chat on a text model
def test_chat_script_on_a_text_model_loads_once_and_continues_each_line(ckpt):
    result = subprocess.run([sys.executable, "-m", "scripts.chat", "--ckpt", str(ckpt), "--max-new-tokens", "20",
                             "--temp", "0"], cwd=REPO, input="KING:\nQUEEN:\n", capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.startswith("# continuing each prompt")  # it says which of its two modes it is in
    samples = result.stdout.split("\n", 1)[1].split("-" * 40 + "\n")
    assert samples[0].startswith("KING:") and samples[1].startswith("QUEEN:") and samples[2] == ""


def feed(monkeypatch, lines: list) -> None:
    """input() returns these lines in turn; an exception instance is raised instead (EOFError at the end)."""
    queue = list(lines)

    def fake_input(prompt: str = "") -> str:
        item = queue.pop(0) if queue else EOFError()
        if isinstance(item, BaseException):
            raise item
        return item
    monkeypatch.setattr("builtins.input", fake_input)


def test_multiline_prompts_end_at_an_empty_line(ckpt, monkeypatch, capsys):
    feed(monkeypatch, ["KING:", "the", "", "QUEEN:", ""])
    chat_script.main(["--ckpt", str(ckpt), "--multiline", "--max-new-tokens", "5", "--temp", "0", "--no-stream"])
    samples = capsys.readouterr().out.split("\n", 1)[1].split("-" * 40 + "\n")
    assert samples[0].startswith("KING:\nthe") and samples[1].startswith("QUEEN:") and samples[2] == ""


def test_ctrl_c_while_generating_returns_to_the_prompt_and_at_the_prompt_quits(ckpt, monkeypatch, capsys):
    calls = []
    real_generate = sample_module.generate

    def interrupted_first(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(sample_module, "generate", interrupted_first)
    feed(monkeypatch, ["KING:", "QUEEN:", KeyboardInterrupt(), "never read"])
    chat_script.main(["--ckpt", str(ckpt), "--max-new-tokens", "5", "--temp", "0", "--no-stream"])
    out = capsys.readouterr().out
    assert len(calls) == 2 and out.split("\n", 1)[1].split("-" * 40 + "\n")[1].startswith("QUEEN:")
    assert out.endswith("-" * 40 + "\n")  # nothing printed after Ctrl-C at the prompt


def test_the_prompt_loop_says_what_a_prompt_lacks_and_asks_again(ckpt, monkeypatch, capsys):
    feed(monkeypatch, ["KING: €", "KING:"])
    chat_script.main(["--ckpt", str(ckpt), "--max-new-tokens", "3", "--temp", "0", "--no-stream"])
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1
    assert captured.out.split("\n", 1)[1].startswith("KING:")


# ----------------------------------------------------------------------------- sampling: temperature
LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])  # (1, 5): distinct values, no ties


@pytest.mark.parametrize("temperature", [0.25, 0.5, 1.0, 2.0, 4.0])
def test_the_sampling_distribution_at_temperature_t_is_softmax_of_logits_over_t(temperature):
    """Bug caught: pick_next multiplies the logits by T instead of dividing (wrong at every T but 1)."""
    assert torch.equal(next_token_probs(LOGITS, temperature), F.softmax(LOGITS / temperature, dim=-1))


def test_low_temperature_sharpens_and_high_temperature_flattens():
    """Bug caught: logits multiplied by T (T < 1 would flatten, T > 1 sharpen)."""
    temperatures = [0.25, 0.5, 1.0, 2.0, 4.0]
    probs = [next_token_probs(LOGITS, t)[0] for t in temperatures]
    top = [p.max().item() for p in probs]
    entropy = [-(p * p.log()).sum().item() for p in probs]
    assert top == sorted(top, reverse=True) and len(set(top)) == len(top)  # colder: the top token gains
    assert entropy == sorted(entropy) and len(set(entropy)) == len(entropy)  # hotter: closer to uniform
    assert probs[0].argmax() == probs[-1].argmax() == 0  # the ranking itself never changes


def test_draws_follow_the_tempered_distribution():
    """Bug caught: logits multiplied by T. 40000 draws with a fixed generator: each token's frequency
    lies within 5 standard deviations (< 0.013) of softmax(logits / T); T = 0.5 against T = 2 moves
    the top token's probability by ~0.3."""
    n, temperature = 40_000, 0.5
    draws = pick_next(LOGITS.repeat(n, 1), temperature, generator=torch.Generator().manual_seed(0))  # (n, 1)
    frequency = torch.bincount(draws.flatten(), minlength=5).double() / n  # (5,)
    expected = F.softmax(LOGITS[0].double() / temperature, dim=-1)  # (5,)
    tolerance = 5 * (expected * (1 - expected) / n).sqrt()
    assert ((frequency - expected).abs() < tolerance).all(), (frequency.tolist(), expected.tolist())


# ----------------------------------------------------------------------------- sampling: top-p boundary
SORTED_PROBS = (0.5, 0.25, 0.125, 0.0625, 0.0625)  # dyadic: softmax and cumsum are exact in float32


@pytest.mark.parametrize("top_p, n_kept", [(0.5, 1), (0.75, 2), (0.875, 3), (0.5 + 1e-6, 2), (0.75 - 1e-6, 2)])
def test_top_p_stops_where_the_mass_reaches_p_exactly(top_p, n_kept):
    """Bug caught: `above <= top_p` in filter_logits (a token is kept although the ones above it
    already reach p). docs/sampling.md: the smallest set whose probability *reaches* P."""
    logits = torch.tensor([[math.log(p) for p in SORTED_PROBS]])  # (1, 5)
    assert F.softmax(logits, dim=-1).cumsum(-1)[0].tolist() == [0.5, 0.75, 0.875, 0.9375, 1.0]  # the premise: exact
    kept = filter_logits(logits, top_p=top_p)[0].isfinite().tolist()
    assert kept == [True] * n_kept + [False] * (5 - n_kept)
