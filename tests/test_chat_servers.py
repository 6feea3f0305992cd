"""One conversation, one greedy reply, everywhere: `python -m scripts.chat --temp 0`, llama.cpp on the GGUF export (and
its OpenAI-compatible server) and transformers' pipeline on the HF export give the same text. Localhost only."""
from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO, tiny_run, write_chats

import train
from checkpoint import from_checkpoint
from config import make_config
from scripts import chat as chat_script
from scripts import export_gguf, export_hf
from scripts.export_gguf import CONTEXT_ROWS
from tokenizer import render

pytestmark = [pytest.mark.interop, pytest.mark.slow]  # llama.cpp, its server, openai, transformers; ~1 min in all
SYSTEM, USERS = "the lord", ["the king", "sweet lord"]  # a system prompt and two user turns
KINDS = ["char", "bpe", pytest.param("gpt2", marks=pytest.mark.network)]  # gpt2: the ranks come from PyPI once
STEPS = {"char": 400, "bpe": 400, "gpt2": 100}  # enough that replies end at <|end|> (or, char's second, the window)
SERVER_START_S = 90  # a loaded 2-core machine imports the server and maps the model in ~5 s
PLAIN_GREEDY = {"repeat_penalty": 1.0}  # llama_cpp.server's default 1.1 changes a greedy reply


@pytest.fixture(scope="module")
def openai():
    return pytest.importorskip("openai", reason="the OpenAI client and llama.cpp's server: "
                               "pip install -r requirements-llama.txt")


@pytest.fixture(scope="module")
def chat_runs(tmp_path_factory):
    """Factory: a tiny chat run of the tokenizer kind, trained once: (run folder, .gguf, HF folder)."""
    root = tmp_path_factory.mktemp("chats")
    chats = write_chats(root / "chats.jsonl", n=200)
    made = {}

    def build(kind: str) -> tuple[Path, Path, Path]:
        if kind not in made:
            cfg = make_config("tiny", **tiny_run(root / kind, chats) | dict(
                tokenizer=kind, bpe_vocab_size=300, block_size=128, max_iters=STEPS[kind], eval_interval=STEPS[kind],
                log_interval=STEPS[kind]))
            train.train(cfg)
            export_gguf.main([cfg.out_dir, str(root / f"{kind}.gguf")])
            export_hf.main([cfg.out_dir, str(root / f"{kind}-hf")])
            made[kind] = Path(cfg.out_dir), root / f"{kind}.gguf", root / f"{kind}-hf"
        return made[kind]
    return build


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def served(chat_runs, llama_cpp, openai):
    """Factory: an openai client of `python -m llama_cpp.server` on a kind's GGUF at a free localhost port."""
    servers, started = {}, []
    try:
        def serve(kind: str):
            if kind not in servers:
                port, (_, gguf_file, _) = free_port(), chat_runs(kind)
                command = ["-m", "llama_cpp.server", "--model", str(gguf_file), "--n_ctx", "0", "--n_threads", "1",
                           "--n_threads_batch", "1", "--host", "127.0.0.1", "--port", str(port)]
                log = gguf_file.with_suffix(".server.log")  # a file, not a pipe: nobody reads it while it runs
                with open(log, "w") as out:
                    proc = subprocess.Popen([sys.executable, *command], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
                started.append(proc)
                wait_until_up(proc, f"http://127.0.0.1:{port}/v1/models", log)
                servers[kind] = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=60,
                                              max_retries=0)
            return servers[kind]
        yield serve
    finally:
        for proc in started:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_until_up(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"llama_cpp.server exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if json.load(answer)["data"]:
                    return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"llama_cpp.server did not answer {url} within {SERVER_START_S} s")


def ours(run: Path, monkeypatch, capsys) -> list[str]:
    """The replies `python -m scripts.chat --ckpt RUN --temp 0 --system SYSTEM` gives to USERS typed on stdin."""
    replies, keep = [], chat_script.Dialogue.reply

    def recorded(dialogue, text: str) -> None:
        replies.append(text)
        keep(dialogue, text)
    monkeypatch.setattr(chat_script.Dialogue, "reply", recorded)
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(user + "\n" for user in USERS)))
    chat_script.main(["--ckpt", str(run), "--temp", "0", "--system", SYSTEM, "--device", "cpu"])
    capsys.readouterr()
    return replies


def conversation(replies: list[str]) -> list[list[dict]]:
    """The messages that ask for each reply: the system prompt, the user turns and our replies so far."""
    turns = [{"role": "system", "content": SYSTEM}]
    asks = []
    for user, reply in zip(USERS, replies):
        turns.append({"role": "user", "content": user})
        asks.append(list(turns))
        turns.append({"role": "assistant", "content": reply})
    return asks


@pytest.mark.parametrize("kind", KINDS)
def test_one_conversation_gets_our_greedy_reply_from_llama_cpp_its_server_and_transformers(
        chat_runs, served, llama_cpp, kind, monkeypatch, capsys):
    """Each reply of scripts.chat, asked again with the same messages: the same text, ending where ours does."""
    transformers = pytest.importorskip("transformers")
    run, gguf_file, hf_folder = chat_runs(kind)
    replies = ours(run, monkeypatch, capsys)
    loaded = from_checkpoint(run / "best.pt")
    tokenizer, block_size = loaded.tokenizer, loaded.model.config.block_size
    llm = llama_cpp.Llama(str(gguf_file), n_ctx=0, n_threads=1, n_threads_batch=1, verbose=False)
    client = served(kind)
    pipe = transformers.pipeline("text-generation", model=str(hf_folder), device="cpu")
    finishes = []
    for messages, reply in zip(conversation(replies), replies):
        as_pairs = [(m["role"], m["content"]) for m in messages]
        expected = render(tokenizer, as_pairs, reply=True)
        text = llama_cpp.llama_chat_format.Jinja2ChatFormatter(
            llm.metadata["tokenizer.chat_template"], eos_token="", bos_token="")(messages=messages).prompt
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == expected  # llama.cpp makes our ids
        room = block_size - len(expected)  # scripts.chat's bound, the rest of the window: llama.cpp's is larger
        theirs = llm.create_chat_completion(messages, temperature=0, max_tokens=room)["choices"][0]
        assert theirs["message"]["content"] == reply
        answer = client.chat.completions.create(model="any", messages=messages, temperature=0, max_tokens=room,
                                                extra_body=PLAIN_GREEDY)
        assert answer.choices[0].message.content == reply
        ended = "length" if len(tokenizer.encode(reply)) == room else "stop"  # at the window, or at <|end|>
        assert answer.choices[0].finish_reason == theirs["finish_reason"] == ended
        finishes.append(ended)
        stream = client.chat.completions.create(model="any", messages=messages, temperature=0, max_tokens=room,
                                                extra_body=PLAIN_GREEDY, stream=True)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == reply
        generated = pipe(messages, max_new_tokens=room, do_sample=False)[0]["generated_text"]
        assert generated[-1] == {"role": "assistant", "content": reply}
        assert "<|" not in reply  # never a marker: each stops at <|end|> or the window
    assert finishes == {"char": ["stop", "length"]}.get(kind, ["stop", "stop"])  # both ends are met


def test_the_server_answers_an_empty_conversation_with_the_templates_error(served, openai):
    with pytest.raises(openai.APIStatusError) as empty:
        served("char").chat.completions.create(model="any", messages=[])
    assert empty.value.status_code == 500 and "no messages: a conversation needs a turn" in empty.value.message


def test_a_conversation_longer_than_the_window_is_answered_or_refused_and_the_server_answers_the_next(
        chat_runs, served, openai):
    """Bug caught: past block_size the server aborted. Now a reply, or context_length_exceeded, and it lives."""
    client = served("char")

    def ask(content: str):
        return client.chat.completions.create(model="any", messages=[{"role": "user", "content": content}],
                                              temperature=0, max_tokens=8, extra_body=PLAIN_GREEDY).choices[0]
    before = ask(USERS[0]).message.content
    past_the_window = ask("the king " * 15)  # ~140 tokens with the markers: positions 128 and on, untrained
    assert past_the_window.finish_reason in ("length", "stop") and "<|" not in past_the_window.message.content
    with pytest.raises(openai.BadRequestError) as refused:
        ask("the king " * 300)  # ~2,700 tokens: past the 2,048 positions the file declares
    assert refused.value.code == "context_length_exceeded"
    assert f"maximum context length is {CONTEXT_ROWS} tokens" in refused.value.message
    assert ask(USERS[0]).message.content == before  # alive, and as it was
