"""Export a trained run to one GGUF file, which llama.cpp (Ollama, LM Studio, llama-cpp-python) runs as GPT-2.

    python -m scripts.export_gguf out/tiny tiny.gguf --dtype f16
    python -c "from llama_cpp import Llama; print(Llama('tiny.gguf').tokenize(b'Hello', add_bos=False))"

Written with llama.cpp's ``gguf`` package as its gpt2 architecture: the Hugging Face export's weights in ggml's
(out, in) layout, the tokenizer as a byte-level BPE that makes our ids (char, bpe, gpt2 and chat runs alike). OUT is
a new .gguf file or one this export wrote; an existing folder gets FOLDER/<run>.gguf. Details: docs/interop.md."""
import sys

if not __package__:  # run as a file, `python scripts/export_gguf.py`: its folder, not the repo, leads the module path
    print("error: run it from the repo root as a module: python -m scripts.export_gguf", file=sys.stderr)
    sys.exit(2)

from pathlib import Path

import numpy as np
import torch

from checkpoint import find_checkpoint, from_checkpoint
from cli import CommandLine, HFError, exit_on_errors, fail, install_hint, run_tool
from finetune import WPE, WTE
from model import GPT
from runtime import one_line, written_whole
from scripts.export_hf import (BYTE_TEXT, GGUF_MARK, LAYER_NORM_EPS, TRANSPOSED, bpe_merges, bpe_tokens, byte_text,
                               chat_template, check_output, gpt2_refusals, to_hf)
from tokenizer import BEGIN, END, EOT_TEXT, ChatTokenizer

CONTEXT_ROWS = 2048  # the fewest positions a file declares: no runner's default context is longer
N_CTX_ROUNDING = 256  # llama.cpp rounds every context up to a multiple of this (GGML_PAD in llama_context)


def export_gguf(model: GPT, tokenizer, path: Path, dtype: str = "f32", name: str = "tinygpt") -> int:
    """Write ``model`` and ``tokenizer`` to the GGUF file ``path``; returns the number of tensors."""
    import gguf
    if refusals := gpt2_refusals(model.config):
        raise HFError(f"cannot export as GGUF: the model has {refusals[0]}; llama.cpp's gpt2 architecture "
                      "would load it and compute another model")
    tokens, merges = vocabulary(tokenizer)
    tensors = gguf_tensors(model, len(tokens))  # before the file: a model that does not map writes nothing
    with one_line(path.parent, "output folder"), written_whole(path) as staged:  # a failure leaves no half file
        writer = gguf.GGUFWriter(str(staged), "gpt2")  # llama.cpp's LLM_ARCH_GPT2
        write_metadata(writer, model, tokenizer, tokens, merges, dtype, name)
        for tensor_name, value in tensors.items():
            data, ggml_type = stored(value, dtype)
            writer.add_tensor(tensor_name, data, raw_dtype=ggml_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return len(tensors)


def gguf_tensors(model: GPT, n_tokens: int) -> dict[str, np.ndarray]:
    """to_hf's weights under llama.cpp's gpt2 names, (out, in), fp32: the embedding with a row of zeros for each
    token past the model's vocabulary (a char export's <|endoftext|>: logit 0)."""
    import gguf
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.GPT2, model.config.n_layer)
    out = {}
    for hf_name, value in to_hf(model).items():
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:  # a weight gguf's GPT-2 has no place for: never drop it silently
            raise HFError(f"cannot export as GGUF: weight {hf_name} has no name in llama.cpp's gpt2 architecture")
        value = value.t() if hf_name.endswith(TRANSPOSED) else value  # Conv1D's (in, out) back to ggml's (out, in)
        if hf_name == WTE:  # (V, C) -> (n_tokens, C)
            value = torch.cat([value, value.new_zeros(n_tokens - len(value), value.size(1))])
        if hf_name == WPE:  # (context_rows, C): row p is trained row p mod block_size (docs/interop.md)
            value = value[torch.arange(context_rows(len(value))) % len(value)]
        out[gguf_name] = value.contiguous().numpy().astype(np.float32)
    return out


def context_rows(block_size: int) -> int:
    """The positions a file declares and its table holds: at least CONTEXT_ROWS and block_size, a multiple of
    N_CTX_ROUNDING, so llama.cpp's context (n_ctx 0, rounded up) never passes the table: past it llama.cpp aborts."""
    return -(-max(CONTEXT_ROWS, block_size) // N_CTX_ROUNDING) * N_CTX_ROUNDING


def stored(value: np.ndarray, dtype: str) -> tuple[np.ndarray, object]:
    """(data, ggml type): 1-D in f32, as llama.cpp's converter; q8_0 falls back to f16 for rows not in blocks of 32."""
    import gguf
    types = gguf.GGMLQuantizationType
    if value.ndim == 1 or dtype == "f32":
        return value, types.F32
    if dtype == "q8_0" and value.shape[-1] % gguf.GGML_QUANT_SIZES[types.Q8_0][0] == 0:
        return gguf.quants.quantize(value, types.Q8_0), types.Q8_0
    return value.astype(np.float16), types.F16


def vocabulary(tokenizer) -> tuple[list[str], list[str]]:
    """(token names in id order, merges) as llama.cpp's byte-level BPE. A char vocabulary: one token per character,
    named by its UTF-8 bytes, then <|endoftext|> (without an end token llama.cpp ended each reply at its newline)."""
    if isinstance(tokenizer, ChatTokenizer):  # <|end|> ends its replies: a char base's added end token is left out
        tokens, merges = vocabulary(tokenizer.base)
        return [*tokens[:tokenizer.base.vocab_size], *tokenizer.markers], merges
    if tokenizer.meta()["kind"] != "char":
        tokens = bpe_tokens(tokenizer)
        return [*map(byte_text, tokens), EOT_TEXT], bpe_merges(tokens)
    names = [[BYTE_TEXT[b] for b in ch.encode("utf-8")] for ch in tokenizer.chars]
    merges = {"".join(name[:end]) + " " + name[end]: None for name in names for end in range(1, len(name))}
    # llama.cpp refuses a file without merges, and gguf writes no empty array: an all-ASCII vocabulary gets one that
    # changes no tokenization (two NULs, never encoded). The end token goes after every character: no id moves.
    return ["".join(name) for name in names] + [EOT_TEXT], list(merges) or [f"{BYTE_TEXT[0]} {BYTE_TEXT[0]}"]


def write_metadata(writer, model: GPT, tokenizer, tokens: list[str], merges: list[str], dtype: str, name: str) -> None:
    """The shape llama.cpp builds, then the tokenizer: special ids and tokens past the vocabulary are CONTROL (never
    made from text); bos and eos always set (unset, llama.cpp takes id 11, a character); a chat's template."""
    import gguf
    config, types = model.config, gguf.LlamaFileType
    writer.add_string(GGUF_MARK, "scripts.export_gguf")  # near the start: what check_output looks for
    writer.add_name(name)
    writer.add_file_type({"f32": types.ALL_F32, "f16": types.MOSTLY_F16, "q8_0": types.MOSTLY_Q8_0}[dtype])
    writer.add_context_length(context_rows(config.block_size))
    writer.add_embedding_length(config.n_embd)
    writer.add_feed_forward_length(4 * config.n_embd)
    writer.add_block_count(config.n_layer)
    writer.add_head_count(config.n_head)
    writer.add_layer_norm_eps(LAYER_NORM_EPS)
    writer.add_tokenizer_model("gpt2")  # llama.cpp's byte-level BPE with merges
    writer.add_tokenizer_pre("gpt-2")  # GPT-2's split pattern (tokenizer.bpe_pattern)
    writer.add_token_list(tokens)
    control = set(tokenizer.special_ids) | set(range(tokenizer.vocab_size, len(tokens)))
    writer.add_token_types([gguf.TokenType.CONTROL if i in control else gguf.TokenType.NORMAL
                            for i in range(len(tokens))])
    writer.add_token_merges(merges)
    chat = isinstance(tokenizer, ChatTokenizer)
    writer.add_bos_token_id(tokenizer.marker_ids[BEGIN] if chat else tokenizer.eot_token)
    writer.add_eos_token_id(tokenizer.marker_ids[END] if chat else tokens.index(EOT_TEXT))
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    if chat:
        writer.add_eot_token_id(tokenizer.marker_ids[END])
        writer.add_chat_template(chat_template())


def main(argv: list[str] | None = None) -> None:
    parser = CommandLine(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="run folder (its best.pt, else last.pt) or a checkpoint file")
    parser.add_argument("out", help="the .gguf file to write (one this export wrote is replaced) or a folder: "
                        "FOLDER/<run>.gguf")
    parser.add_argument("--dtype", choices=("f32", "f16", "q8_0"), default="f32",
                        help="how the matrices are stored: f32 (exact), f16 (half the size), q8_0 (8-bit blocks)")
    args = parser.parse_args(argv)
    if not args.out:  # Path("") is the current folder
        parser.error("OUT is empty: pass the .gguf file to write, or a folder to write FOLDER/<run>.gguf in")
    with exit_on_errors():  # the paths first, then gguf, before a checkpoint is loaded
        path = find_checkpoint(args.run, "")
        run_name = Path(path).resolve().parent.name
        out = Path(args.out) / f"{run_name}.gguf" if Path(args.out).is_dir() else Path(args.out)
        check_output(out, "output folder", ".gguf")
        try:
            import gguf  # noqa: F401
        except ImportError:
            fail(f"the GGUF export writes with llama.cpp's gguf package: {install_hint('gguf')}")
        loaded = from_checkpoint(path)
        count = export_gguf(loaded.model, loaded.tokenizer, out, args.dtype, name=run_name)
    folder_note = f" ({args.out} is a folder: the file is named for the run)" if out != Path(args.out) else ""
    print(f"exported {path} -> {out}: {count} tensors, {args.dtype}{folder_note}")


if __name__ == "__main__":
    run_tool(main)
