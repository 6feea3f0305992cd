"""Export a trained run to a folder that Hugging Face transformers loads as GPT-2.

    python -m scripts.export_hf out/finetune_shakespeare hf/shakespeare
    python -c "from transformers import AutoModelForCausalLM as M; M.from_pretrained('hf/shakespeare')"

Writes model.safetensors, config.json, generation_config.json and the tokenizer's files, which AutoTokenizer loads
to our very ids; --peft also PEFT's files of a LoRA run's adapters. Which tools load the folder: docs/interop.md."""
import sys

if not __package__:  # run as a file, `python scripts/export_hf.py`: its folder, not the repo, leads the module path
    print("error: run it from the repo root as a module: python -m scripts.export_hf", file=sys.stderr)
    sys.exit(2)

import contextlib
import json
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from checkpoint import find_checkpoint, from_checkpoint, load_checkpoint
from cli import CheckpointError, CommandLine, HFError, PathError, TinyGPTError, exit_on_errors, run_tool
from finetune import TIED_HEAD, WTE, pad_rows
from model import GPT, GPTConfig
from runtime import atomic_write, atomic_write_text, check_writable, staged_folder
from tokenizer import ASSISTANT, BEGIN, BYTES, END, EOT_TEXT, ROLES, ChatTokenizer

# ----------------------------------------------------------------------------- GPT-2's layout (read: import_hf.py)
# Beyond these tables the layouts differ in shape only: our vocabulary is padded to a multiple of 64, our position
# table may be cropped. Our weights have GPT-2's names (WTE, WPE, TIED_HEAD: finetune.py's).
NAMES = (  # every weight of GPT-2, GPT2LMHeadModel's names; {i} is the block index
    "transformer.wte.weight",  # (V, C): V padded ours, the real vocabulary theirs; also lm_head (tied)
    "transformer.wpe.weight",  # (T, C): block_size rows ours, n_positions theirs
    *(f"transformer.h.{{i}}.{layer}.{kind}" for layer in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc",
                                                          "mlp.c_proj") for kind in ("weight", "bias")),
    "transformer.ln_f.weight", "transformer.ln_f.bias",
)
TRANSPOSED = (  # transformers' Conv1D (GPT-2's original TF code) computes x @ W, W (in, out)
    ".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}  # theirs -> ours
LAYER_NORM_EPS = 1e-5  # GPT-2's epsilon, which is also nn.LayerNorm's default (model.py uses the default)
ANY = None  # in GPT2_OPTIONS: GPT-2's layout holds every value of this option
# Each model option -> the values GPT-2's layout computes. An option not listed (a fork's new one) is GPT-2's only at
# its default: the exports refuse any other value by name, never drop it silently.
GPT2_OPTIONS = {"block_size": ANY, "n_layer": ANY, "n_head": ANY, "n_embd": ANY,  # block_size: n_positions
                "bias": ANY,  # bias-free models export zero biases
                "activation": ("gelu", "gelu_tanh")}  # activation_function gelu / gelu_new (see ACTIVATIONS)


def gpt2_refusals(config: GPTConfig) -> list[str]:
    """Every option of ``config`` GPT-2's layout cannot compute, as "name value (GPT-2: ...)"; [] if none."""
    refusals = []
    for option in fields(config):
        # A training-only option (dropout, z_loss) changes how the weights were trained, not what they compute.
        allowed = ANY if option.name in GPTConfig.TRAINING_ONLY else GPT2_OPTIONS.get(option.name, (option.default,))
        value = getattr(config, option.name)
        if option.name != "vocab_size" and allowed is not ANY and value not in allowed:
            refusals.append(f"{option.name} {value!r} (GPT-2 computes {' or '.join(map(repr, allowed))})")
    return refusals


def expand(n_layer: int) -> list[str]:
    """NAMES with {i} filled in for every block."""
    return [name.format(i=i) for name in NAMES for i in (range(n_layer) if "{i}" in name else [None])]


def convert(name: str, value: torch.Tensor, vocab_rows: int) -> torch.Tensor:
    """One weight into the other layout, both ways: Conv1D transposed, wte's rows zero-padded or cut."""
    if name.endswith(TRANSPOSED):
        return value.t()  # (in, out) <-> (out, in)
    if name == WTE:  # (V, C)
        return pad_rows(value, vocab_rows)
    return value


# GPT-2's printable stand-in for every byte (encoder.py): printable Latin-1 bytes for themselves, others chr(256 + n).
PRINTABLE = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
BYTE_TEXT = {**{b: chr(b) for b in PRINTABLE},
             **{b: chr(256 + n) for n, b in enumerate(b for b in range(BYTES) if b not in PRINTABLE)}}


def bpe_merges(tokens: list[bytes]) -> list[str]:
    """merges.txt's lines for ``tokens`` in rank order: each longer token's two parts as tiktoken's merge loop (lowest
    ranked adjacent pair first, among those ranked below the token) holds them last."""
    ranks, merges = {token: i for i, token in enumerate(tokens)}, []
    for rank, token in enumerate(tokens):
        if len(token) < 2:
            continue
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            best, i = min((ranks.get(parts[j] + parts[j + 1], rank), j) for j in range(len(parts) - 1))
            if best >= rank:
                break
            parts[i: i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) != 2:
            raise HFError(f"BPE token {rank} ({token!r}) is not the merge of two tokens")
        merges.append(f"{byte_text(parts[0])} {byte_text(parts[1])}")
    return merges


def byte_text(token: bytes) -> str:
    """A token's name in vocab.json, merges.txt and a GGUF: its bytes' printable stand-ins."""
    return "".join(BYTE_TEXT[b] for b in token)


# The tokenizers library drops an unknown character silently without an unk_token, and raises if the unk_token is not
# in the vocabulary: the char export (char_files) names this one, so an unknown character raises, as our encode does.
CHAR_UNK = "<unk: a character outside this char model's vocabulary>"


def check_output(out: Path, flag: str, suffix: str = "") -> None:
    """Refuse an export's output where writing would lose something, before anything is loaded: a folder (``suffix``
    "") must be new or empty; a file must be named ``*suffix``, in an existing folder, and be new or of that format."""
    folder = out.parent if suffix else out
    if not suffix and out.is_dir() and any(out.iterdir()):
        raise PathError(f"{out} is not empty; write into a new folder (or delete this one first)")
    if suffix and out.suffix != suffix:
        raise PathError(f"{out}: the export writes only *{suffix} files, never over a checkpoint or any other file; "
                        f"pass a name ending in {suffix}")
    if suffix and out.exists() and not exported_gguf(out):
        raise PathError(f"{out} lacks the mark of a {suffix} file this export wrote (another model, a checkpoint "
                        "renamed, an export of an older version), and only such a file is replaced; pass a new name "
                        "(or delete it first)")
    if suffix and not folder.exists():
        raise PathError(f"{out}: no folder {folder}; make it first (mkdir -p {folder}) or write into an existing one")
    check_writable(folder, flag, ".export-probe")  # a file where the folder should be, read-only


GGUF_MARK = "tinygpt.exported_by"  # a metadata key export_gguf.py writes first: the one GGUF file it may replace


def exported_gguf(path: Path) -> bool:
    """``path`` is a readable GGUF file with the mark near its start (another GGUF model is no export's to replace)."""
    with contextlib.suppress(OSError), open(path, "rb") as f:
        return (head := f.read(1 << 12)).startswith(b"GGUF") and GGUF_MARK.encode() in head
    return False


def check_gpt2(model: GPT) -> None:
    """HFError for a model GPT-2 cannot compute or hold: a folder that loads but computes another model is the worst."""
    config, state = model.config, model.state_dict()
    if refusals := gpt2_refusals(config):
        raise HFError(f"cannot export as GPT-2: the model has {refusals[0]}; transformers' GPT-2 would "
                      "load it and compute another model")
    if unmapped := sorted(set(state) - set(expand(config.n_layer)) - {TIED_HEAD}):
        raise HFError(f"cannot export as GPT-2: weight {unmapped[0]} has no place in GPT-2's layout")


def to_hf(model: GPT) -> dict[str, torch.Tensor]:
    """Our weights in GPT2LMHeadModel's layout (zero biases if bias=False), after check_gpt2's refusals."""
    check_gpt2(model)
    config, state = model.config, model.state_dict()
    out = {}
    for name in expand(config.n_layer):  # bias=False: zeros of the layer's output width
        value = (state[name].detach().float() if name in state
                 else torch.zeros(len(state[name.removesuffix("bias") + "weight"])))
        out[name] = convert(name, value, config.vocab_size).contiguous().clone()  # unshared
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
    """Write the model, its config and tokenizer to a new ``folder``; generation_config.json stops generate() at
    block_size, where the positions end (transformers' default is 20 tokens)."""
    from safetensors.torch import save
    weights, block_size = to_hf(model), model.config.block_size
    # <|endoftext|> starts and ends GPT-2 text; a char model starts from a newline and has no end; a chat model's
    # conversation starts at <|begin|> and its reply ends at <|end|>.
    bos, eos = tokenizer.eot_token, (tokenizer.eot_token if tokenizer.meta()["kind"] == "gpt2" else None)
    if isinstance(tokenizer, ChatTokenizer):
        bos, eos = tokenizer.marker_ids[BEGIN], tokenizer.marker_ids[END]
    files = {"config.json": hf_config(model.config, bos, eos), **tokenizer_files(tokenizer, block_size),
             "generation_config.json": {"bos_token_id": bos, "eos_token_id": eos, "max_length": block_size}}
    check_output(folder, "output folder")  # main() asked before loading; a library caller here
    with staged_folder(folder, "output folder") as staging:  # renamed into place whole, or nothing
        atomic_write(staging / "model.safetensors", lambda f: f.write(save(weights, metadata={"format": "pt"})))
        for name, content in files.items():
            text = content if isinstance(content, str) else json.dumps(content, indent=1, ensure_ascii=False) + "\n"
            atomic_write_text(staging / name, text)
    return [folder / "model.safetensors", *(folder / name for name in files)]


def bpe_tokens(tokenizer) -> list[bytes]:
    """A tiktoken BPE's tokens in id (= rank) order, <|endoftext|> (the last id) left out."""
    return [tokenizer.enc.decode_single_token_bytes(i) for i in range(tokenizer.eot_token)]


# ----------------------------------------------------------------------------- tokenizer files (read: import_hf.py)
CHARS_FILE = "tinygpt_chars.json"  # a char model's vocabulary: token id i is chars[i]
BPE_FILE = "tinygpt_bpe.json"  # a trained BPE's description (BPETokenizer.meta): pattern and ranks


def tokenizer_files(tokenizer, block_size: int) -> dict[str, Any]:
    """File name -> JSON object or text: what AutoTokenizer loads to our ids, with our own description beside it
    (GPT-2's needs none); a chat tokenizer's markers added."""
    if isinstance(tokenizer, ChatTokenizer):
        return with_markers(tokenizer_files(tokenizer.base, block_size), tokenizer.marker_ids)
    meta = tokenizer.meta()
    if meta["kind"] == "char":
        decode = "token id i is the character chars[i]: text = ''.join(chars[i] for i in ids)"
        return {**char_files(tokenizer, block_size), CHARS_FILE: {"chars": list(tokenizer.chars), "decode": decode}}
    files = bpe_files(bpe_tokens(tokenizer), block_size)
    return files if meta["kind"] == "gpt2" else {**files, BPE_FILE: meta}


def bpe_files(tokens: list[bytes], block_size: int) -> dict[str, Any]:
    """A GPT2Tokenizer's files of a byte-level BPE's tokens (then <|endoftext|>): its split pattern is ours."""
    return {"vocab.json": {byte_text(t): i for i, t in enumerate(tokens)} | {EOT_TEXT: len(tokens)},
            "merges.txt": "#version: 0.2\n" + "\n".join(bpe_merges(tokens)) + "\n",
            "tokenizer_config.json": {"tokenizer_class": "GPT2Tokenizer", "bos_token": EOT_TEXT, "eos_token": EOT_TEXT,
                                      "unk_token": EOT_TEXT, "add_prefix_space": False, "model_max_length": block_size}}


def char_files(tokenizer, block_size: int) -> dict[str, Any]:
    """A char vocabulary's files: a BPE with one token per character, no merges, normaliser or pre-tokeniser (spaces
    and newlines are characters), and CHAR_UNK, so that a character outside the vocabulary raises, never vanishes."""
    model = {"type": "BPE", "dropout": None, "unk_token": CHAR_UNK, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
             "vocab": {ch: i for i, ch in enumerate(tokenizer.chars)}, "merges": []}
    # bos: the newline our samples start from, which lm_eval puts before an empty context; it stays text.
    return {"tokenizer.json": {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
                               "normalizer": None, "pre_tokenizer": None, "post_processor": None,
                               "decoder": {"type": "Fuse"}, "model": model},
            "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast",
                                      "bos_token": tokenizer.chars[tokenizer.eot_token],
                                      "clean_up_tokenization_spaces": False, "model_max_length": block_size}}


def with_markers(files: dict[str, Any], markers: dict[str, int]) -> dict[str, Any]:
    """A base tokenizer's files plus the role markers as special added tokens, and the chat template. bos is
    <|begin|>: transformers skips bos when it decodes a reply, and a char base's (a newline) is text."""
    added = [{"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for text, i in markers.items()]
    files = json.loads(json.dumps(files))  # a copy: the base's files stay as they are
    if "tokenizer.json" in files:
        files["tokenizer.json"]["added_tokens"] += added
    else:
        files["tokenizer_config.json"]["added_tokens_decoder"] = {str(token.pop("id")): token for token in added}
    files["tokenizer_config.json"] |= {"additional_special_tokens": list(markers), "bos_token": BEGIN,
                                       "chat_template": chat_template()}
    return files


def chat_template() -> str:
    """tokenizer.render as Jinja, for apply_chat_template; an empty conversation or an unknown role raises, as
    finetune.py refuses them (raise_exception: transformers and llama-cpp-python define it)."""
    known = ", ".join(ROLES)
    roles = "".join(f"{{%- {'elif' if i else 'if'} message['role'] == '{role}' %}}{{{{ '{marker}' }}}}"
                    for i, (role, marker) in enumerate(ROLES.items()))
    return (f"{{%- if not messages %}}{{{{ raise_exception('no messages: a conversation needs a turn') }}}}"
            f"{{%- endif %}}{{{{- '{BEGIN}' }}}}{{%- for message in messages %}}{roles}{{%- else %}}"
            f"{{{{ raise_exception('role ' + message['role'] + ' is not one of {known}') }}}}{{%- endif %}}"
            f"{{{{ message['content'] + '{END}' }}}}{{%- endfor %}}"
            f"{{%- if add_generation_prompt %}}{{{{ '{ASSISTANT}' }}}}{{%- endif %}}")


PEFT_PREFIX = "base_model.model."  # PeftModel wraps GPT2LMHeadModel: its weights' names gain this prefix


def export_peft(state: dict[str, Any], folder: Path) -> list[Path]:
    """A LoRA checkpoint's adapters as PEFT's adapter_config.json and adapter_model.safetensors in ``folder``. Our
    names under PEFT's prefix, untransposed (PEFT's lora_A / lora_B are nn.Linear, as ours); GPT-2's Conv1D bases
    are (in, out), hence fan_in_fan_out."""
    from safetensors.torch import save_file
    if "lora" not in state:
        raise CheckpointError("not a LoRA run: only a run trained with --lora_rank has adapters to export in "
                              "PEFT's format; export the model alone (drop --peft)")
    if state["lora"].get("rows"):
        raise CheckpointError(f"this LoRA run also trained {len(state['lora']['rows'])} embedding rows (its chat "
                              "markers), which PEFT's LoRA files do not hold; export the merged model (drop --peft)")
    saved, base = state["lora"], state["lora"]["base"]
    with contextlib.suppress(TinyGPTError, OSError, RuntimeError):  # an imported base: PEFT's is its Hugging Face one
        base_state = torch.load(find_checkpoint(base, ""), mmap=True, weights_only=True)  # mmap: no weights read
        base = base_state["versions"].get("imported_from", base)
    peft = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": saved["rank"], "lora_alpha": saved["alpha"],
            "lora_dropout": saved["dropout"], "target_modules": list(saved["targets"]), "fan_in_fan_out": True,
            "bias": "none", "base_model_name_or_path": base, "inference_mode": True}
    with staged_folder(folder, "--peft folder") as staging:  # as export's
        save_file({PEFT_PREFIX + name: t.detach().float().contiguous().clone() for name, t in state["model"].items()},
                  str(staging / "adapter_model.safetensors"), metadata={"format": "pt"})
        (staging / "adapter_config.json").write_text(json.dumps(peft, indent=1) + "\n", encoding="utf-8")
    return [folder / "adapter_config.json", folder / "adapter_model.safetensors"]


def main(argv: list[str] | None = None) -> None:
    parser = CommandLine(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="run folder (its best.pt, else last.pt) or a checkpoint file")
    parser.add_argument("out", help="folder to write: a new or an empty one")
    parser.add_argument("--peft", default="", metavar="DIR", help="a LoRA run (--lora_rank): also write its adapters "
                        "to DIR, a new or an empty folder, in PEFT's format, for peft.PeftModel on the base")
    args = parser.parse_args(argv)
    out, peft = Path(args.out), Path(args.peft) if args.peft else None
    with exit_on_errors():  # every folder it writes, before anything loads: each new or empty, --peft's apart from OUT
        check_output(out, "output folder")
        if peft:
            a, b = out.resolve(), peft.resolve()
            if a == b or a in b.parents or b in a.parents:
                raise PathError(f"--peft {peft} and the output folder {out} overlap; give the adapters a folder of "
                                f"their own (e.g. {out}-adapters)")
            check_output(peft, "--peft folder")
        path = find_checkpoint(args.run, "")
        loaded = from_checkpoint(path)
        check_gpt2(loaded.model)  # export's refusal, before --peft's folder is written
        adapters = export_peft(load_checkpoint(path), peft) if peft else []  # refused before writing
        written = export(loaded.model, loaded.tokenizer, out)  # a LoRA run's: merged
    print(f"exported {path} -> {args.out}: {', '.join(p.name for p in written)}")
    if adapters:  # each file under the folder it is in
        print(f"exported its adapters -> {args.peft}: {', '.join(p.name for p in adapters)}")


if __name__ == "__main__":
    run_tool(main)
