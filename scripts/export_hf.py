"""Export a trained run to a folder that Hugging Face transformers loads as GPT-2.

    python -m scripts.export_hf out/finetune_shakespeare hf/shakespeare
    python -c "from transformers import AutoModelForCausalLM as M; M.from_pretrained('hf/shakespeare')"

Writes model.safetensors, config.json (GPT2LMHeadModel), generation_config.json (generate() stops at block_size,
where the positions end) and the tokenizer, which AutoTokenizer loads to our very ids: vocab.json and merges.txt for
a byte-level BPE, tokenizer.json for a char model (checkpoint.py). docs/interop.md says which tools load the folder
and what each does past block_size.
"""
from __future__ import annotations

import sys

if not __package__:  # run as a file, `python scripts/export_hf.py`: its folder, not the repo, leads the module path
    print("error: run it from the repo root as a module: python -m scripts.export_hf", file=sys.stderr)
    sys.exit(2)

import json
import os
from pathlib import Path
from typing import Any

import torch

from checkpoint import (
    ACTIVATIONS,
    LAYER_NORM_EPS,
    TIED_HEAD,
    convert,
    expand,
    find_checkpoint,
    from_checkpoint,
    gpt2_refusals,
    load_checkpoint,
)
from config import CheckpointError, CommandLine, HFError, PathError, TinyGPTError, exit_on
from model import GPT, GPTConfig
from runtime import atomic_write, atomic_write_text, check_writable
from tokenizer import (
    ASSISTANT,
    BEGIN,
    BPE_FILE,
    CHAR_UNK,
    CHARS_FILE,
    END,
    EOT_TEXT,
    ROLES,
    ChatTokenizer,
    bpe_merges,
    byte_text,
)

# ----------------------------------------------------------------------------- export
# The first bytes of each file format an export writes, by the name's suffix: the one kind of file it may replace.
FILE_MAGIC = {".gguf": b"GGUF"}


def check_output(out: Path, flag: str, suffix: str = "") -> None:
    """Refuse an export's output before anything is loaded or written, where writing would lose something: a folder
    (``suffix`` "") must be new or empty (a run's checkpoints, another model's files that would load beside ours);
    a file must be named ``*suffix``, in a folder that exists, and be new or a file of that format (FILE_MAGIC),
    never a checkpoint, a log or the file the export reads. Then the folder must take a file (check_writable)."""
    folder = out.parent if suffix else out
    if not suffix and out.is_dir() and any(out.iterdir()):
        raise PathError(f"{out} is not empty; export into a new folder (or delete this one first)")
    if suffix and out.suffix != suffix:
        raise PathError(f"{out}: the export writes only *{suffix} files, never over a checkpoint or any other file; "
                        f"pass a name ending in {suffix}")
    if suffix and out.exists() and not starts_with(out, FILE_MAGIC[suffix]):
        raise PathError(f"{out} is not a {suffix} file an export wrote (a checkpoint renamed?), and only such a file "
                        "is replaced; pass a new name (or delete it first)")
    if suffix and not folder.exists():
        raise PathError(f"{out}: no folder {folder}; make it first (mkdir -p {folder}) or write into an existing one")
    check_writable(folder, flag, f".export-probe-{os.getpid()}")  # a file where the folder should be, read-only


def starts_with(path: Path, magic: bytes) -> bool:
    """``path`` is a file whose first bytes are ``magic`` (False for a folder, or a file it cannot read)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(magic)) == magic
    except OSError:
        return False


def check_gpt2(model: GPT) -> None:
    """HFError for a model with an option GPT-2 cannot compute or a weight NAMES lacks: a GPT-2 folder that loads but
    computes something else is the worst export."""
    config, state = model.config, model.state_dict()
    refusals = gpt2_refusals(config)
    if refusals:
        raise HFError(f"cannot export as GPT-2: the model has {refusals[0]}; transformers' GPT-2 would "
                      "load it and compute another model")
    unmapped = sorted(set(state) - set(expand(config.n_layer)) - {TIED_HEAD})
    if unmapped:
        raise HFError(f"cannot export as GPT-2: weight {unmapped[0]} has no place in GPT-2's layout")


def to_hf(model: GPT) -> dict[str, torch.Tensor]:
    """Our weights in GPT2LMHeadModel's layout (zero biases if bias=False); check_gpt2's refusals first."""
    check_gpt2(model)
    config, state = model.config, model.state_dict()
    out = {}
    for name in expand(config.n_layer):  # bias=False: GPT-2 has every bias, so zeros of the layer's output width
        value = (state[name].detach().float() if name in state
                 else torch.zeros(len(state[name.removesuffix("bias") + "weight"])))
        out[name] = convert(name, value, config.vocab_size, config.block_size).contiguous().clone()  # unshared
    return out


def hf_config(config: GPTConfig, bos: int | None, eos: int | None) -> dict[str, Any]:
    """config.json for transformers' GPT2LMHeadModel with this model's shape."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": config.vocab_size,
            "n_positions": config.block_size, "n_ctx": config.block_size, "n_embd": config.n_embd,
            "n_layer": config.n_layer, "n_head": config.n_head, "n_inner": None,
            "activation_function": next(theirs for theirs, ours in ACTIVATIONS.items() if ours == config.activation),
            "layer_norm_epsilon": LAYER_NORM_EPS, "resid_pdrop": config.dropout, "embd_pdrop": config.dropout,
            "attn_pdrop": config.dropout, "initializer_range": 0.02, "scale_attn_weights": True,
            "tie_word_embeddings": True, "use_cache": True, "bos_token_id": bos, "eos_token_id": eos,
            "dtype": "float32"}


def export(model: GPT, tokenizer, folder: Path) -> list[Path]:
    """Write model.safetensors, config.json, generation_config.json (generate() stops at block_size tokens, where the
    position table ends, not transformers' default 20) and the tokenizer's files to a new ``folder``."""
    from safetensors.torch import save

    weights, block_size = to_hf(model), model.config.block_size
    # <|endoftext|> starts and ends GPT-2 text; a char model starts from a newline and has no end; a chat model's
    # conversation starts at <|begin|> and its reply ends at <|end|>.
    bos, eos = tokenizer.eot_token, (tokenizer.eot_token if tokenizer.meta()["kind"] == "gpt2" else None)
    if isinstance(tokenizer, ChatTokenizer):
        bos, eos = tokenizer.marker_ids[BEGIN], tokenizer.marker_ids[END]
    files = {"config.json": hf_config(model.config, bos, eos), **tokenizer_files(tokenizer, block_size),
             "generation_config.json": {"bos_token_id": bos, "eos_token_id": eos, "max_length": block_size}}
    check_output(folder, "output folder")  # scripts/export_hf.py asked before loading; a library caller here
    folder.mkdir(parents=True, exist_ok=True)
    # Each file whole or absent (files.atomic_write): a kill mid-export never leaves a truncated one to load.
    atomic_write(folder / "model.safetensors", lambda f: f.write(save(weights, metadata={"format": "pt"})))
    for name, content in files.items():
        text = content if isinstance(content, str) else json.dumps(content, indent=1, ensure_ascii=False) + "\n"
        atomic_write_text(folder / name, text)
    return [folder / "model.safetensors", *(folder / name for name in files)]


def bpe_tokens(tokenizer) -> list[bytes]:
    """A tiktoken BPE's tokens in id (= rank) order, <|endoftext|> (the last id) left out."""
    return [tokenizer.enc.decode_single_token_bytes(i) for i in range(tokenizer.eot_token)]


# ----------------------------------------------------------------------------- writing (export)
def tokenizer_files(tokenizer, block_size: int) -> dict[str, Any]:
    """Files AutoTokenizer loads to the same ids as ours (file name -> JSON object or text), with our own
    description beside them (OWN_FILES; GPT-2's needs none) for init_from; a chat tokenizer's markers added."""
    if isinstance(tokenizer, ChatTokenizer):
        return with_markers(tokenizer_files(tokenizer.base, block_size), tokenizer.marker_ids)
    meta = tokenizer.meta()
    if meta["kind"] == "char":
        decode = "token id i is the character chars[i]: text = ''.join(chars[i] for i in ids)"
        return {**char_files(tokenizer, block_size), CHARS_FILE: {"chars": list(tokenizer.chars), "decode": decode}}
    files = bpe_files(bpe_tokens(tokenizer), block_size)
    return files if meta["kind"] == "gpt2" else {**files, BPE_FILE: meta}


def bpe_files(tokens: list[bytes], block_size: int) -> dict[str, Any]:
    """vocab.json, merges.txt and tokenizer_config.json of a byte-level BPE's tokens (then <|endoftext|>): a
    GPT2Tokenizer, whose split pattern is the one our BPEs use (tokenizers.bpe_pattern)."""
    return {"vocab.json": {byte_text(t): i for i, t in enumerate(tokens)} | {EOT_TEXT: len(tokens)},
            "merges.txt": "#version: 0.2\n" + "\n".join(bpe_merges(tokens)) + "\n",
            "tokenizer_config.json": {"tokenizer_class": "GPT2Tokenizer", "bos_token": EOT_TEXT,
                                      "eos_token": EOT_TEXT, "unk_token": EOT_TEXT, "add_prefix_space": False,
                                      "model_max_length": block_size}}


def char_files(tokenizer, block_size: int) -> dict[str, Any]:
    """tokenizer.json and tokenizer_config.json of a char vocabulary: a BPE with one token per character, no merges,
    no normaliser and no pre-tokeniser (spaces and newlines are characters like any other), a decoder that joins
    the tokens as they are, and CHAR_UNK, so that a character outside the vocabulary raises, never vanishes."""
    model = {"type": "BPE", "dropout": None, "unk_token": CHAR_UNK, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
             "vocab": {ch: i for i, ch in enumerate(tokenizer.chars)}, "merges": []}
    # bos: the newline that starts our samples (config.json's bos_token_id), which lm_eval's hf backend puts
    # before an empty context. It stays text: the vocabulary's own id, encoded and decoded as a newline.
    return {"tokenizer.json": {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
                               "normalizer": None, "pre_tokenizer": None, "post_processor": None,
                               "decoder": {"type": "Fuse"}, "model": model},
            "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast",
                                      "bos_token": tokenizer.chars[tokenizer.eot_token],
                                      "clean_up_tokenization_spaces": False, "model_max_length": block_size}}


def with_markers(files: dict[str, Any], markers: dict[str, int]) -> dict[str, Any]:
    """A base tokenizer's files and a chat tokenizer's role markers, as special added tokens (never split,
    never made from text): in tokenizer.json (char) or tokenizer_config.json's added_tokens_decoder (BPE);
    and the template (chat_template), so that transformers' apply_chat_template makes our ids. The start token is
    <|begin|>: transformers skips bos when it decodes a reply, and a char base's (a newline, or a space) is text."""
    added = [{"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for text, i in markers.items()]
    files = json.loads(json.dumps(files))  # a copy: the base's files stay as they are
    if "tokenizer.json" in files:
        files["tokenizer.json"]["added_tokens"] += added
    else:
        files["tokenizer_config.json"]["added_tokens_decoder"] = {str(token.pop("id")): token for token in added}
    files["tokenizer_config.json"]["additional_special_tokens"] = list(markers)
    files["tokenizer_config.json"]["bos_token"] = BEGIN
    files["tokenizer_config.json"]["chat_template"] = chat_template()
    return files


def chat_template() -> str:
    """finetune.py's template as Jinja: apply_chat_template renders the same markers around the same texts. An
    empty conversation or a role outside ROLES raises, as the data's reading refuses them (finetune.py):
    raise_exception is the error a template raises, which transformers and llama-cpp-python define (both tested)."""
    known = ", ".join(ROLES)
    roles = "".join(f"{{%- {'elif' if i else 'if'} message['role'] == '{role}' %}}{{{{ '{marker}' }}}}"
                    for i, (role, marker) in enumerate(ROLES.items()))
    return (f"{{%- if not messages %}}{{{{ raise_exception('no messages: a conversation needs a turn') }}}}"
            f"{{%- endif %}}{{{{- '{BEGIN}' }}}}{{%- for message in messages %}}{roles}{{%- else %}}"
            f"{{{{ raise_exception('role ' + message['role'] + ' is not one of {known}') }}}}{{%- endif %}}"
            f"{{{{ message['content'] + '{END}' }}}}{{%- endfor %}}"
            f"{{%- if add_generation_prompt %}}{{{{ '{ASSISTANT}' }}}}{{%- endif %}}")


PEFT_PREFIX = "base_model.model."  # PeftModel wraps GPT2LMHeadModel: its weights' names gain this prefix


# ----------------------------------------------------------------------------- PEFT's format
def export_peft(state: dict[str, Any], folder: Path) -> list[Path]:
    """A LoRA checkpoint's adapters as PEFT's adapter_config.json and adapter_model.safetensors in ``folder``.

    The weights keep our names under PEFT's prefix, untransposed: PEFT's lora_A / lora_B are nn.Linear layers
    whatever the base (A (rank, in), B (out, rank), as ours). GPT-2's four matrices are transformers Conv1D
    layers, (in, out), hence fan_in_fan_out, which transposes only the base weight when PEFT merges. PEFT fills
    every config field left out with its default.
    """
    from safetensors.torch import save_file

    if "lora" not in state:
        raise CheckpointError("not a LoRA run: only a run trained with --lora_rank has adapters to export in "
                              "PEFT's format; export the model alone (drop --peft)")
    if state["lora"].get("rows"):
        raise CheckpointError(f"this LoRA run also trained {len(state['lora']['rows'])} embedding rows (its chat "
                              "markers), which PEFT's LoRA files do not hold; export the merged model (drop --peft)")
    folder.mkdir(parents=True, exist_ok=True)
    weights, config = folder / "adapter_model.safetensors", folder / "adapter_config.json"
    save_file({PEFT_PREFIX + name: t.detach().float().contiguous().clone() for name, t in state["model"].items()},
              str(weights), metadata={"format": "pt"})
    saved = state["lora"]
    peft = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": saved["rank"], "lora_alpha": saved["alpha"],
            "lora_dropout": saved["dropout"], "target_modules": list(saved["targets"]), "fan_in_fan_out": True,
            "bias": "none", "base_model_name_or_path": saved["base"], "inference_mode": True}
    config.write_text(json.dumps(peft, indent=1) + "\n", encoding="utf-8")
    return [config, weights]


def check_folders(out: Path, peft: Path | None) -> None:
    """Every folder the export writes, before anything is loaded or written: each new or empty (hf.check_output),
    and --peft's apart from OUT (each would be written into the other, half-made when the second is refused)."""
    check_output(out, "output folder")
    if peft is None:
        return
    a, b = out.resolve(), peft.resolve()
    if a == b or a in b.parents or b in a.parents:
        raise PathError(f"--peft {peft} and the output folder {out} overlap; give the adapters a folder of their "
                        f"own (e.g. {out}-adapters)")
    check_output(peft, "--peft folder")


def main(argv: list[str] | None = None) -> None:
    parser = CommandLine(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="run folder (its best.pt, else last.pt) or a checkpoint file")
    parser.add_argument("out", help="folder to write: a new or an empty one")
    parser.add_argument("--peft", default="", metavar="DIR",
                        help="a LoRA run (--lora_rank): also write its adapters to DIR, a new or an empty folder, in "
                             "PEFT's format (adapter_config.json, adapter_model.safetensors), for peft.PeftModel on "
                             "the base")
    args = parser.parse_args(argv)
    out, peft = Path(args.out), Path(args.peft) if args.peft else None
    try:
        check_folders(out, peft)  # before loading anything
        path = find_checkpoint(args.run)
        loaded = from_checkpoint(path)
        check_gpt2(loaded.model)  # hf.export's refusal, before --peft's folder is written
        adapters = export_peft(load_checkpoint(path), peft) if peft else []  # refused before writing
        written = export(loaded.model, loaded.tokenizer, out) + adapters  # a LoRA run's: merged
    except TinyGPTError as err:  # one line and its exit code (config.py)
        exit_on(err)
    print(f"exported {path} -> {args.out}: {', '.join(p.name for p in written)}")


if __name__ == "__main__":
    main()
