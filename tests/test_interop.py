"""Exports that survive a round trip (docs/interop.md): ids, text, limits and tokenizer come back."""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from conftest import REPO, docs_snippet, make_text, randomized, run_script, tiny_model

import sample
import tokenizer
from cli import DataError, HFError
from scripts import export_hf, import_hf
from scripts.export_hf import BPE_FILE, CHARS_FILE
from scripts.import_hf import read_tokenizer
from scripts.prepare import main as prepare_main
from tokenizer import CharTokenizer, data_home, tokenizer_from_meta, train_bpe

pytestmark = pytest.mark.interop  # transformers, PEFT, ONNX Runtime, lm_eval (requirements-interop.txt)
transformers = pytest.importorskip("transformers")

TEXT = make_text()
UNKNOWN = "Ünïcödé café 🚀 我\tend"  # none of these accents, the emoji, the CJK character nor the tab is in TEXT


def export(folder: Path, kind: str = "char", block_size: int = 16, seed: int = 0) -> tuple[Path, object, object]:
    tokenizer = CharTokenizer("".join(sorted(set(TEXT)))) if kind == "char" else train_bpe([TEXT], 300, "TEXT")
    model = randomized(tiny_model(vocab_size=tokenizer.vocab_size, block_size=block_size, seed=seed), 0.3)
    export_hf.export(model, tokenizer, folder)
    return folder, model, tokenizer


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_transformers_loads_the_export_without_a_warning_to_our_ids_and_our_greedy_text(tmp_path, kind):
    folder, model, ours = export(tmp_path / "hf", kind, block_size=32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        theirs = transformers.AutoTokenizer.from_pretrained(folder)
    assert len(theirs) == ours.vocab_size
    probes = [TEXT[:500], "KING:\nThe lord speaks.\n\n", "   ", "a" * 40]
    for probe in probes + ([UNKNOWN, "\n\n\tend   of  line \n  x", "x \r\n\u00a0y"] if kind == "bpe" else []):
        assert theirs.encode(probe) == ours.encode(probe), probe
        assert theirs.decode(ours.encode(probe)) == probe
    prompt = torch.tensor([ours.encode("KING:\nThe")])
    greedy = transformers.GPT2LMHeadModel.from_pretrained(folder).eval().generate(
        prompt, max_new_tokens=10, do_sample=False, attention_mask=torch.ones_like(prompt))
    mine = sample.generate(model, prompt, 10, temperature=0)
    n = min(mine.shape[1], greedy.shape[1])  # a BPE export stops at <|endoftext|>; our row continues
    assert torch.equal(greedy[0, :n], mine[0, :n])
    if kind == "char":  # Bug caught: without an unk_token transformers dropped unknown characters, silently
        for text in (UNKNOWN, "a\tb", "café"):
            with pytest.raises(DataError, match="characters not in the model's vocabulary"):
                ours.encode(text)
            with pytest.raises(Exception, match=f"Unk token `{export_hf.CHAR_UNK}` not found in the vocabulary"):
                theirs.encode(text)
        assert theirs.unk_token is None  # no id was added for it


def test_generate_in_transformers_stops_at_block_size_and_sample_says_it(tmp_path, capsys):
    """Bug caught: without generation_config.json generate() ran to 20 tokens, past the positions."""
    folder, model, tokenizer = export(tmp_path / "hf", block_size=16)
    assert json.loads((folder / "generation_config.json").read_text())["max_length"] == 16
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    prompt = torch.tensor([tokenizer.encode("KING:")])
    greedy = theirs.generate(prompt, do_sample=False, attention_mask=torch.ones_like(prompt))  # no max_new_tokens
    assert greedy.shape == (1, 16)
    assert torch.equal(greedy, sample.generate(model, prompt, 11, temperature=0))
    with pytest.raises(IndexError):  # what past block_size does in transformers: the reason for the recipe below
        theirs.generate(prompt, do_sample=False, max_new_tokens=13, attention_mask=torch.ones_like(prompt))
    import_hf.main([str(folder), str(tmp_path / "run")])
    capsys.readouterr()
    sample.main(["--ckpt", str(tmp_path / "run"), "--prompt", "KING:", "--temp", "0", "--max-new-tokens", "3",
                 "--no-stream", "--device", "cpu"])
    assert "; block_size 16: past it the window slides" in capsys.readouterr().out.splitlines()[0]
    ids = prompt  # the docs' sliding-window recipe for transformers continues as sample.py does
    scope = {"model": theirs, "ids": ids, "torch": torch}
    exec(docs_snippet("# slide the window in transformers", "interop.md"), scope)  # noqa: S102 - the docs' recipe
    ours = sample.generate(model, ids, 40, temperature=0, keep=16)  # keep = block_size: the classic sliding window
    assert scope["ids"].shape == (1, 45) and torch.equal(scope["ids"], ours)


# ----------------------------------------------------------------------------- round trips keep the tokenizer
@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_the_tokenizer_is_rebuilt_from_tokenizer_json_or_vocab_and_merges(tmp_path, kind):
    folder, _, ours = export(tmp_path / "hf", kind)
    saved = tmp_path / "saved"  # as save_pretrained leaves it: the standard files only
    transformers.AutoTokenizer.from_pretrained(folder).save_pretrained(saved)
    assert not (saved / CHARS_FILE).exists() and not (saved / BPE_FILE).exists()
    assert read_tokenizer(saved, ours.vocab_size) == ours.meta()
    if kind == "bpe":  # a GPT2Tokenizer's own files, without tokenizer.json
        (folder / BPE_FILE).unlink()
        assert read_tokenizer(folder, ours.vocab_size) == ours.meta()
        merges = (folder / "merges.txt").read_text().splitlines()
        (folder / "merges.txt").write_text("\n".join([merges[0], merges[2], merges[1], *merges[3:]]) + "\n")
        with pytest.raises(HFError, match="merges are not the ones its ids imply"):
            read_tokenizer(folder, ours.vocab_size)


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_a_peft_merged_export_comes_back_through_import_hf_with_equal_logits(tmp_path, kind):
    """LoRA on c_attn of the exported GPT-2, merged, saved the way PEFT users save (no tinygpt_*.json)."""
    peft = pytest.importorskip("peft")
    folder, _, ours = export(tmp_path / "hf", kind)
    base = transformers.AutoModelForCausalLM.from_pretrained(folder)
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"],
                                                     fan_in_fan_out=True, init_lora_weights=False))
    merged = lora.merge_and_unload().eval()  # init_lora_weights=False: B is random, so the merge changes c_attn
    merged.save_pretrained(tmp_path / "merged")
    transformers.AutoTokenizer.from_pretrained(folder).save_pretrained(tmp_path / "merged")
    pretrained = import_hf.load_pretrained(str(tmp_path / "merged"))
    assert pretrained.tokenizer == ours.meta()
    back = sample.GPT(pretrained.config)
    back.load_state_dict(pretrained.state)
    idx = torch.randint(0, ours.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        theirs, original = merged(idx).logits, transformers.AutoModelForCausalLM.from_pretrained(folder)(idx).logits
        mine = back.eval()(idx)[0]
    assert (mine - theirs).abs().max() < 1e-5 and (original - theirs).abs().max() > 1e-3


# ----------------------------------------------------------------------------- paths follow the config
def test_a_relative_data_dir_is_under_the_repo_wherever_the_command_runs(tmp_path, monkeypatch):
    """Bug caught: a relative data_dir was the working directory's: run elsewhere, it prepared again."""
    corpus, elsewhere = tmp_path / "corpus.txt", tmp_path / "elsewhere"
    corpus.write_text(TEXT)
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    relative = os.path.relpath(tmp_path / "cache", REPO)  # relative to the repo: tmp_path/cache; to cwd: not
    prepare_main(["--data_path", str(corpus), "--data_dir", relative])
    assert len(list((tmp_path / "cache").glob("corpus-*-char-val0.1/train.bin"))) == 1
    assert data_home("data") == REPO / "data" and data_home(tmp_path) == tmp_path
    seen = []
    monkeypatch.setattr(tokenizer, "GPT2Tokenizer", seen.append)  # where tokenizer_from_meta caches GPT-2's ranks
    tokenizer_from_meta({"kind": "gpt2"}, Path("data"))
    assert seen == [REPO / "data"]


# ----------------------------------------------------------------------------- ONNX Runtime and lm_eval's command line
ONNX_TOL = 4e-6  # logits, fp32 on both sides; seen: 1.0e-6 (char), 7.2e-7 (bpe), on logits up to 2.7
CLI_TOL = 1e-6  # summed log-probabilities near -40, one request a batch on both sides; seen: 0.0 on all 160 (CPU)
LOCAL_TASKS = REPO / "scripts" / "harness_tasks"  # scripts/harness.py's offline task, read without lm_eval


class Logits(torch.nn.Module):
    """The exported GPT-2 as a user hands it to torch.onnx.export: ids in, logits out, no cache to trace."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, use_cache=False).logits  # (B, T, vocab)


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_onnx_runtime_runs_the_export_with_our_logits(tmp_path, kind):
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (requirements-dev.txt)")
    pytest.importorskip("onnxscript", reason="onnxscript is not installed (requirements-dev.txt)")
    folder, model, tokenizer = export(tmp_path / "hf", kind, block_size=16)
    theirs = Logits(transformers.AutoModelForCausalLM.from_pretrained(folder).eval())
    idx = torch.randint(0, tokenizer.vocab_size, (3, 16), generator=torch.Generator().manual_seed(5))
    dims = {"input_ids": {0: torch.export.Dim("batch"), 1: torch.export.Dim("T", max=16)}}
    torch.onnx.export(theirs, (idx[:2],), tmp_path / "model.onnx", dynamo=True, input_names=["input_ids"],
                      output_names=["logits"], dynamic_shapes=dims, verbose=False)
    session = ort.InferenceSession(tmp_path / "model.onnx", providers=["CPUExecutionProvider"])
    for ids in (idx[:2], idx[:, :5]):  # the traced shape and another batch and length
        onnx_logits = torch.from_numpy(session.run(["logits"], {"input_ids": ids.numpy()})[0])
        with torch.no_grad():
            ours = model(ids)[0]  # (B, T, vocab)
        assert onnx_logits.shape == ours.shape and (onnx_logits - ours).abs().max() < ONNX_TOL


def cloze_char_model() -> tuple[object, CharTokenizer]:
    """A random char model of the cloze task's characters, block_size 32: lm_eval truncates on the left."""
    items = [json.loads(line) for line in (LOCAL_TASKS / "tinygpt_cloze.jsonl").read_text().splitlines()]
    text = TEXT + "".join(d["context"] + " " + " ".join(d["choices"]) for d in items)
    tokenizer = CharTokenizer("".join(sorted(set(text))))
    model = tiny_model(vocab_size=tokenizer.vocab_size, block_size=32, seed=1).eval()
    n = sum(p.numel() for p in model.parameters())  # random everywhere, as export() makes its models
    torch.nn.utils.vector_to_parameters(0.3 * torch.randn(n, generator=torch.Generator().manual_seed(1)),
                                        model.parameters())
    return model, tokenizer


@pytest.mark.slow  # lm_eval's command line indexes all of its tasks before it runs ours: ~25 s
def test_lm_evals_command_line_scores_a_char_export_as_our_adapter_does(tmp_path, monkeypatch):
    pytest.importorskip("lm_eval", reason="lm_eval is not installed (requirements-dev.txt): no CLI check")
    from lm_eval.api.instance import Instance

    from scripts import harness
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # inherited by the command below
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    model, tokenizer = cloze_char_model()
    export_hf.export(model, tokenizer, tmp_path / "export")
    run_script("-m", "lm_eval", "run", "--model", "hf", "--model_args", f"pretrained={tmp_path / 'export'}",
               "--include_path", str(LOCAL_TASKS), "--tasks", "tinygpt_cloze", "--device", "cpu",
               "--output_path", str(tmp_path / "out"), "--log_samples")
    (samples,) = (tmp_path / "out").glob("*/samples_tinygpt_cloze_*.jsonl")
    pairs, theirs = [], []  # (context, continuation), (log-likelihood, is_greedy) per request
    for doc in map(json.loads, samples.read_text().splitlines()):
        requests = [doc["arguments"][f"gen_args_{i}"] for i in range(len(doc["arguments"]))]
        pairs += [(r["arg_0"], r["arg_1"]) for r in requests]
        theirs += [(float(ll), greedy == "True") for ll, greedy in doc["filtered_resps"]]  # logged as strings
    assert len(pairs) == 160  # 40 items x 4 choices
    assert any(len(tokenizer.encode(c + x)) - 1 > 32 for c, x in pairs)  # some inputs lost their oldest tokens
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i) for i, p in enumerate(pairs)]
    ours = harness.TinyGPTLM(model, tokenizer, batch_size=1).loglikelihood(requests)  # as the CLI batches
    assert [greedy for _, greedy in ours] == [greedy for _, greedy in theirs]
    assert max(abs(mine - ref) for (mine, _), (ref, _) in zip(ours, theirs)) <= CLI_TOL
