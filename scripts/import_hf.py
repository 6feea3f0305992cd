"""Hugging Face GPT-2 weights into a run folder, which train.py's --init_from and sample.py's --ckpt then take.

    python -m scripts.import_hf gpt2 out/gpt2                    # GPT-2 (124M) from the hub (or its cache)
    python -m scripts.import_hf hf/shakespeare out/shakespeare   # a folder export_hf.py wrote, or any in GPT-2's layout
    python train.py --config finetune_shakespeare                # fine-tune it (the preset's init_from is out/gpt2)

Every key and shape is checked against config.json, and the tokenizer is read back from the folder's files
(docs/interop.md). The run folder holds one best.pt: the weights in fp32, a config of their shape and the tokenizer,
and no training (step 0, no optimizer state: --init_from starts from it, nothing resumes it)."""
import sys

if not __package__:  # run as a file, `python scripts/import_hf.py`: its folder, not the repo, leads the module path
    print("error: run it from the repo root as a module: python -m scripts.import_hf", file=sys.stderr)
    sys.exit(2)

import json
import math
import os
import re
from dataclasses import fields, replace
from pathlib import Path

import torch

from checkpoint import FORMAT_VERSION, git_state, save_checkpoint
from cli import CommandLine, ConfigError, HFError, exit_on_errors, run_tool
from config import TrainConfig, as_dict, validate
from finetune import TIED_HEAD, WTE, Pretrained
from model import GPT, GPTConfig
from scripts.export_hf import (ACTIVATIONS, BPE_FILE, BYTE_TEXT, CHARS_FILE, LAYER_NORM_EPS, TRANSPOSED, bpe_merges,
                               check_output, convert, expand)
from tokenizer import BYTES, EOT_TEXT, GPT2_VOCAB, MARKERS, bpe_pattern, tokenizer_vocab_size

NOT_WEIGHTS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers in GPT2Model's files
PREFIX = "transformer."  # GPT2LMHeadModel's keys have it, GPT2Model's (the hub's gpt2) do not

HUB_NAMES = {name: f"openai-community/{name}" for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")}
HUB_PROBE_TIMEOUT = 5.0  # seconds the hub may take to answer one request before it counts as unreachable
CONFIG_RULES = (  # config.json fields that change the computation: (name, GPT-2's default, what this model does)
    ("activation_function", "gelu_new", tuple(ACTIVATIONS)),
    ("layer_norm_epsilon", LAYER_NORM_EPS, (LAYER_NORM_EPS,)),
    ("n_inner", None, (None,)),  # null: the MLP is 4 * n_embd wide
    ("scale_attn_weights", True, (True,)),  # attention logits divided by sqrt(hs)
    ("scale_attn_by_inverse_layer_idx", False, (False,)),
    ("tie_word_embeddings", True, (True,)),
)
NO_TOKENIZER = (f"known: GPT-2's BPE, {GPT2_VOCAB} tokens; our {CHARS_FILE} or {BPE_FILE}; or the standard "
                "tokenizer.json, or vocab.json + merges.txt, of a char list or a byte-level BPE")
TEXT_BYTE = {text: b for b, text in BYTE_TEXT.items()}  # a byte-level token's printable name, back to its bytes


# ----------------------------------------------------------------------------- the weights
def load_pretrained(source: str, bias: bool = True) -> Pretrained:
    """Hugging Face GPT-2 weights (a hub name or a folder) under our names, every key and shape checked."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    weights, config_file = locate(source)
    try:
        raw = load_file(str(weights))
    except (SafetensorError, OSError) as err:
        raise HFError(f"{weights}: not a readable .safetensors file ({str(err)[:160]})") from None
    tensors = {key if key.startswith(PREFIX) or key == TIED_HEAD else PREFIX + key: value.float()
               for key, value in raw.items()}  # GPT2LMHeadModel's names, in fp32
    config = replace(read_shape(config_file), bias=bias)
    if (tokenizer := read_tokenizer(weights.parent, config.vocab_size)) is None:
        raise HFError(f"{weights.parent}: no tokenizer for a vocabulary of {config.vocab_size} ({NO_TOKENIZER})")
    return Pretrained(config, to_ours(tensors, config, source), source, tokenizer, config.block_size)


def locate(source: str) -> tuple[Path, Path]:
    """(model.safetensors, config.json) of a folder or a hub name (OWNER/NAME, never a typo'd path)."""
    folder = Path(source)
    if not folder.exists():
        if source in HUB_NAMES or (re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", source) and not Path(folder.parts[0]).is_dir()
                                   and folder.suffix not in (".pt", ".safetensors")):
            return download(HUB_NAMES.get(source, source))
        raise HFError(f"{source}: no such folder; pass a folder in the Hugging Face GPT-2 layout, or a hub name "
                      f"({', '.join(HUB_NAMES)} or OWNER/NAME)")
    if not folder.is_dir():
        raise HFError(f"{folder}: a file; pass the folder holding it (a GPT-2 folder: model.safetensors, config.json)")
    for name in ("model.safetensors", "config.json"):  # config.json says the model's shape
        if not (folder / name).is_file():
            raise HFError(f"{folder}: no {name}; a Hugging Face GPT-2 folder holds model.safetensors and config.json")
    return folder / "model.safetensors", folder / "config.json"


def download(repo_id: str) -> tuple[Path, Path]:
    """model.safetensors and config.json via huggingface_hub's cache; the cache alone if the hub does not answer."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import EntryNotFoundError
    unreachable = None if constants.is_offline_mode() else hub_unreachable(repo_id)
    try:
        config, weights = (huggingface_hub.hf_hub_download(repo_id, name, local_files_only=bool(unreachable))
                           for name in ("config.json", "model.safetensors"))
    except (OSError, EntryNotFoundError) as err:  # offline, not cached, no such repo or file, HTTP errors
        reason = (f"cannot reach {constants.ENDPOINT}: {unreachable}" if unreachable else
                  f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:120]}")
        raise HFError(f"could not get {repo_id} from the Hugging Face hub ({reason}) nor from its cache, and there "
                      f"is no local folder of that name; where there is network run `hf download {repo_id} "
                      "model.safetensors config.json --local-dir DIR`, copy DIR here and import DIR "
                      "(HF_HUB_OFFLINE=1 skips the hub when the files are in its cache)") from None
    return Path(weights), Path(config)


def hub_unreachable(repo_id: str) -> str | None:
    """Why the hub cannot be reached, or None if it answers: one request, where hf_hub_download retries ~25 s."""
    import httpx2  # huggingface_hub's HTTP client, installed with it
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
    try:
        get_hf_file_metadata(hf_hub_url(repo_id, "config.json"),
                             timeout=float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or HUB_PROBE_TIMEOUT))
    except (httpx2.TransportError, OfflineModeIsEnabled) as err:  # refused, timed out, no DNS, HF_HUB_OFFLINE=1
        return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
    except HfHubHTTPError:  # the hub answered (a missing or gated repo): hf_hub_download says what
        return None


def read_shape(config_file: Path) -> GPTConfig:
    """The model config.json describes (block_size: n_positions), if GPT-2's code computes it as ours (CONFIG_RULES)."""
    try:
        hf = json.loads(config_file.read_text())
    except (OSError, ValueError) as err:
        raise HFError(f"{config_file}: not readable JSON ({err})") from None
    if hf.get("model_type") != "gpt2":
        raise HFError(f"{config_file}: model_type {hf.get('model_type')!r}, not 'gpt2': only GPT-2's layout "
                      "maps onto this model")
    if hf.get("n_inner") == 4 * hf.get("n_embd", 0):  # the default MLP width, written out
        hf["n_inner"] = None
    for name, default, allowed in CONFIG_RULES:
        if hf.get(name, default) not in allowed:
            raise HFError(f"{config_file}: {name} is {hf.get(name, default)!r}; this model computes "
                          f"{' or '.join(map(repr, allowed))}")
    try:
        config = GPTConfig(vocab_size=int(hf["vocab_size"]), block_size=int(hf["n_positions"]),
                           n_layer=int(hf["n_layer"]), n_head=int(hf["n_head"]), n_embd=int(hf["n_embd"]), bias=True,
                           activation=ACTIVATIONS[hf.get("activation_function", "gelu_new")])
        validate(TrainConfig(**{name: getattr(config, name) for name in ("block_size", "n_layer", "n_head", "n_embd")}))
    except KeyError as err:
        raise HFError(f"{config_file}: no {err.args[0]}") from None
    except (TypeError, ValueError, ConfigError) as err:  # a size of "x" or 0, an n_embd that n_head does not divide
        raise HFError(f"{config_file}: {err}") from None
    return config


def to_ours(tensors: dict[str, torch.Tensor], config: GPTConfig, source: str) -> dict[str, torch.Tensor]:
    """Check every key and shape against ``config``, then transpose and pad."""
    names = expand(config.n_layer)
    given = {key for key in tensors if not key.endswith(NOT_WEIGHTS) and key != TIED_HEAD}
    missing, unexpected = [name for name in names if name not in given], sorted(given - set(names))
    if missing or unexpected:
        raise HFError(f"{source}: missing key {missing[0]}" if missing else
                      f"{source}: unexpected key {unexpected[0]} for a {config.n_layer}-layer GPT-2")
    with torch.device("meta"):  # shapes only: no memory, no init time even for gpt2-xl
        expected = GPT(replace(config, bias=True)).state_dict()
    state = {}
    for name in names:
        value, want = tensors[name], tuple(expected[name].shape)
        want = (config.vocab_size, want[1]) if name == WTE else want[::-1] if name.endswith(TRANSPOSED) else want
        if tuple(value.shape) != want:  # the file's wte has the real vocabulary's rows, unpadded
            raise HFError(f"{source}: {name} has shape {tuple(value.shape)}, expected {want} from its config.json")
        if name.endswith(".bias") and not config.bias:
            if value.count_nonzero():
                raise HFError(f"{source}: {name} is not zero (max |b| {value.abs().max():.3g}) but the model has "
                              "bias=False; import with --bias true")
            continue  # an exported bias-free model: its zero biases carry nothing
        state[name] = convert(name, value, config.padded_vocab_size).contiguous()
    if TIED_HEAD in tensors and not torch.equal(tensors[TIED_HEAD], tensors[WTE]):
        raise HFError(f"{source}: {TIED_HEAD} differs from {WTE}; this model ties the two")
    return {**state, TIED_HEAD: state[WTE]}


# ----------------------------------------------------------------------------- the tokenizer, from its files
def read_tokenizer(folder: Path, vocab_size: int) -> dict | None:
    """A folder's tokenizer description, if it can tell (read_base_tokenizer), with the markers its config lists."""
    try:  # the markers' list: transformers 5's save_pretrained names it extra_special_tokens
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        chat = list(MARKERS) in map(config.get, ("additional_special_tokens", "extra_special_tokens"))
    except (OSError, ValueError, AttributeError):  # not a readable JSON object: the base's reading says what is wrong
        chat = False
    base = read_base_tokenizer(folder, vocab_size - (len(MARKERS) if chat else 0))
    return {**base, "chat_tokens": list(MARKERS)} if base and chat else base


def read_base_tokenizer(folder: Path, vocab_size: int) -> dict | None:
    """Our own file, GPT-2's by its size, else the standard files (tokenizer.json, or vocab.json + merges.txt)."""
    for kind, name, what in (("char", CHARS_FILE, "char list"), ("bpe", BPE_FILE, "BPE")):
        if (folder / name).is_file():
            try:
                meta = json.loads((folder / name).read_text(encoding="utf-8"))
                meta = {"kind": "char", "chars": "".join(meta["chars"])} if kind == "char" else meta
                valid = kind == "char" or meta["kind"] == "bpe" and isinstance(meta["pattern"], str)
                size = tokenizer_vocab_size(meta) if valid else None
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise HFError(f"{folder / name}: not a tinygpt {what} ({type(err).__name__}: {err})") from None
            if size != vocab_size:
                raise HFError(f"{folder / name}: a {what} of {size} tokens for a vocabulary of {vocab_size}")
            return meta
    return {"kind": "gpt2"} if vocab_size == GPT2_VOCAB else read_standard_files(folder, vocab_size)


def read_standard_files(folder: Path, vocab_size: int) -> dict | None:
    """A char list or a byte-level BPE (named by BYTE_TEXT, id = rank, merges as ``bpe_merges`` derives them) rebuilt
    from tokenizer.json, else vocab.json + merges.txt; None without them. HFError for any other: other ids."""
    try:
        if (folder / "tokenizer.json").is_file():
            saved = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
            if (model := saved["model"])["type"] != "BPE":
                raise HFError(f"{folder / 'tokenizer.json'}: a {model['type']} model, not a BPE this repo encodes")
            vocab = {**model["vocab"], **{token["content"]: token["id"] for token in saved.get("added_tokens", [])}}
            # tokenizers writes a merge as "a b" (before 0.20) or ["a", "b"]
            merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in model["merges"]]
            byte_level = (saved.get("pre_tokenizer") or {}).get("type") == "ByteLevel"
        elif (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
            lines = (folder / "merges.txt").read_text(encoding="utf-8").splitlines()
            merges = [line for line in lines if line and not line.startswith("#version")]
            vocab, byte_level = json.loads((folder / "vocab.json").read_text(encoding="utf-8")), True
        else:
            return None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise HFError(f"{folder}: its tokenizer files are not readable ({type(err).__name__}: {err})") from None
    vocab = {text: i for text, i in vocab.items() if text not in MARKERS or i != vocab_size + MARKERS.index(text)}
    if sorted(vocab.values()) != list(range(vocab_size)):  # a chat model's markers, in place, are read_tokenizer's
        odd = next((f"{t!r} has id {i}" for t, i in vocab.items() if not 0 <= i < vocab_size), f"{len(vocab)} tokens")
        raise HFError(f"{folder}: its tokenizer does not fit the weights' ids 0..{vocab_size - 1} and any chat markers "
                      f"after them ({odd}); save beside them the tokenizer they were exported with")
    tokens = sorted(vocab, key=vocab.__getitem__)  # in id order
    if not byte_level and not merges:
        chars = "".join(tokens)
        if len(chars) != vocab_size or chars != "".join(sorted(chars)):
            raise HFError(f"{folder}: its tokenizer.json is not a char vocabulary (one character a token, sorted)")
        return {"kind": "char", "chars": chars}
    if not byte_level or tokens[-1] != EOT_TEXT:
        raise HFError(f"{folder}: its tokenizer is not a byte-level BPE ending in {EOT_TEXT}, nor a char list")
    try:
        ranks = [bytes(TEXT_BYTE[ch] for ch in token) for token in tokens[:-1]]
    except KeyError:
        raise HFError(f"{folder}: a token of its vocabulary is not in byte-level form") from None
    if len({token for token in ranks if len(token) == 1}) != BYTES:
        raise HFError(f"{folder}: its BPE lacks some of the {BYTES} single bytes: not every text encodes")
    if bpe_merges(ranks) != merges:
        raise HFError(f"{folder}: its merges are not the ones its ids imply: tiktoken would encode other ids")
    return {"kind": "bpe", "pattern": bpe_pattern(), "ranks": [token.hex() for token in ranks]}


# ----------------------------------------------------------------------------- the run folder
def run_state(imported: Pretrained) -> dict:
    """A checkpoint of no training (checkpoint.REQUIRED_KEYS): the weights, a config of their shape, the tokenizer."""
    shape = {f.name: getattr(imported.config, f.name) for f in fields(GPTConfig) if f.name != "vocab_size"}
    tokenizer, source = imported.tokenizer, imported.source  # a folder's absolute: what PEFT's files name as base
    source = str(Path(source).resolve()) if Path(source).exists() else source
    cfg = replace(TrainConfig(), **shape, batch_size=8, tokenizer=tokenizer["kind"],  # batch_size: eval's windows
                  **({"bpe_vocab_size": tokenizer_vocab_size(tokenizer)} if tokenizer["kind"] == "bpe" else {}))
    model = GPT(imported.config)
    model.load_state_dict(imported.state)  # every weight, or torch says which: what --init_from will load
    return {"format_version": FORMAT_VERSION, "model": model.state_dict(), "optimizer": {}, "scaler": {}, "step": 0,
            "time_s": 0.0, "best_val_loss": math.nan, "config": as_dict(cfg), "tokenizer": tokenizer, "rng": {},
            "rng_per_rank": [], "precision": "float32", "versions": {"imported_from": source, **git_state()},
            "last_eval": {}, "corpus": None}


def main(argv: list[str] | None = None) -> None:
    parser = CommandLine(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help=f"a hub name ({', '.join(HUB_NAMES)} or OWNER/NAME), or a folder holding "
                        "model.safetensors and config.json")
    parser.add_argument("out", help="run folder to write: a new or an empty one")
    parser.add_argument("--bias", default="true", choices=("true", "false"),
                        help="false: drop the biases, which must all be zero (a bias-free model's export)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    with exit_on_errors():
        check_output(out, "output folder")  # before minutes of download
        imported = load_pretrained(args.source, bias=args.bias == "true")
        save_checkpoint(run_state(imported), out / "best.pt")
    config = imported.config
    print(f"imported {args.source} -> {out / 'best.pt'}: {config.n_layer} layers, {config.n_head} heads, n_embd "
          f"{config.n_embd}, {config.block_size} positions, {imported.tokenizer['kind']} tokenizer"
          f"{' with chat markers' if 'chat_tokens' in imported.tokenizer else ''} of "
          f"{config.vocab_size:,} tokens; fine-tune it with --init_from {out}, sample it with --ckpt {out}")


if __name__ == "__main__":
    run_tool(main)
