"""Export a trained run to one GGUF file, which llama.cpp (Ollama, LM Studio, llama-cpp-python) runs as GPT-2.

    python -m scripts.export_gguf out/tiny tiny.gguf --dtype f16
    python -c "from llama_cpp import Llama; print(Llama('tiny.gguf').tokenize(b'Hello', add_bos=False))"

The weights, the context length (block_size) and the tokenizer, which llama.cpp encodes to our very ids
(char, bpe and gpt2 runs alike); needs the gguf package (requirements-interop.txt). A model llama.cpp's
GPT-2 cannot compute (RoPE, RMSNorm, ...) is refused in one line.
OUT is a new .gguf file, or a GGUF file to replace, never anything else (a checkpoint, a log: hf.check_output);
an existing folder gets FOLDER/<run>.gguf.

Written with llama.cpp's own ``gguf`` package (imported only to export) as its gpt2 architecture, so the rule of the
Hugging Face export refuses a model (hf.gpt2_refusals), and the weights are hf.to_hf's under gguf's names, in ggml's
(out, in) layout: the Conv1D transposes are undone. The head is tied: llama.cpp uses token_embd. The tokenizer is
a byte-level BPE with GPT-2's pre-tokenizer (our BPEs' split pattern), so llama.cpp makes our ids: a token is named
by its bytes in GPT-2's printable stand-ins and is NORMAL text, but for the special ids (<|endoftext|>: CONTROL). A
char vocabulary is such a BPE: a token per character, with merges that join a multi-byte character's bytes (never
across characters: each starts at a UTF-8 lead byte). Nothing is added to a text, as our encode adds nothing.
llama.cpp computes GELU in its tanh form from an fp16 table: an exact-GELU model's logits differ a little
(within tests/test_gguf.py's tolerance), its greedy text does not.

llama.cpp needs two things of a file that our checkpoint does not hold, and gets them here (docs/interop.md measures
both). An end token: llama.cpp stops a generation at the declared eos (a byte-level BPE's <|endoftext|>), but a char
vocabulary has none, and its newline there ended every reply at its first line; so a char export adds <|endoftext|>
after the characters, CONTROL (no text makes it) with an embedding row of zeros (its logit is exactly 0, below every
character's wherever the model prefers one). And a row of the position table for every position of llama.cpp's
context: past the table's end llama.cpp aborts the whole process (a GGML_ASSERT in get_rows: a server, with every
conversation on it), and the table must be as long as the declared context length. So the file declares
context_rows(block_size) positions, at least CONTEXT_ROWS (llama-cpp-python's default contexts, 512 and its server's
2048, fit; llama.cpp's own default is the file's): block_size trained rows, then the same rows again in turn.
Within them a request never crashes a runner, and one past them is refused (llama-cpp-python: context_length_exceeded);
what the model writes past block_size is near noise, as the docs measure.

A chat model (a ChatTokenizer: finetune.py's markers after its base's ids) carries its conversation format as
runners read it: the markers are CONTROL tokens (llama.cpp makes them from a rendered template, never from a user's
text), <|end|> is the end of a turn (eos and eot: llama.cpp ends a reply there, llama-cpp-python's template formatter
stops at it), and tokenizer.chat_template is the transformers export's template (hf_tokenizer.chat_template).
"""
from __future__ import annotations

import sys

if not __package__:  # run as a file, `python scripts/export_gguf.py`: its folder, not the repo, leads the module path
    print("error: run it from the repo root as a module: python -m scripts.export_gguf", file=sys.stderr)
    sys.exit(2)

from pathlib import Path

import numpy as np
import torch

from checkpoint import LAYER_NORM_EPS, WPE, WTE, find_checkpoint, from_checkpoint, gpt2_refusals, is_transposed
from config import CommandLine, HFError, TinyGPTError, exit_on, fail, install_hint
from finetune import BEGIN
from model import GPT
from runtime import written_whole
from scripts.export_hf import bpe_tokens, chat_template, check_output, to_hf
from tokenizer import BYTE_TEXT, END, EOT_TEXT, ChatTokenizer, bpe_merges, byte_text

ARCH = "gpt2"  # llama.cpp's LLM_ARCH_GPT2
DTYPES = ("f32", "f16", "q8_0")  # how the 2-D weights are stored; norms and biases stay f32
TOKENIZER_MODEL = "gpt2"  # llama.cpp's name for a byte-level BPE with merges
PRE_TOKENIZER = "gpt-2"  # GPT-2's split pattern, tiktoken's r50k_pat_str (tokenizers.bpe_pattern)
# The fewest positions a file declares: no runner's default context is longer (llama-cpp-python's server's is 2048).
CONTEXT_ROWS = 2048
N_CTX_ROUNDING = 256  # llama.cpp rounds every context up to a multiple of this (GGML_PAD in llama_context)


def export_gguf(model: GPT, tokenizer, path: Path, dtype: str = "f32", name: str = "tinygpt") -> int:
    """Write ``model`` and ``tokenizer`` to the GGUF file ``path``; returns the number of tensors. HFError (one
    line, naming the option) for a model llama.cpp's gpt2 architecture cannot compute."""
    import gguf

    refusals = gpt2_refusals(model.config)
    if refusals:
        raise HFError(f"cannot export as GGUF: the model has {refusals[0]}; llama.cpp's gpt2 architecture "
                      "would load it and compute another model")
    tokens, merges = vocabulary(tokenizer)
    tensors = gguf_tensors(model, len(tokens))  # before the file: a model that does not map writes nothing
    with written_whole(path) as staged:  # a failed write leaves no half file under the name
        writer = gguf.GGUFWriter(str(staged), ARCH)
        write_metadata(writer, model, tokenizer, tokens, merges, dtype, name)
        for tensor_name, value in tensors.items():
            data, ggml_type = stored(value, dtype)
            writer.add_tensor(tensor_name, data, raw_dtype=ggml_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return len(tensors)


# ----------------------------------------------------------------------------- the weights
def gguf_tensors(model: GPT, n_tokens: int) -> dict[str, np.ndarray]:
    """hf.to_hf's weights under llama.cpp's gpt2 names, in (out, in) layout, fp32: the embedding with a row of zeros
    for each token past the model's vocabulary (a char export's <|endoftext|>), the position table in
    context_rows(block_size) rows (position_rows)."""
    import gguf

    names = gguf.TensorNameMap(gguf.MODEL_ARCH.GPT2, model.config.n_layer)
    out = {}
    for hf_name, value in to_hf(model).items():  # GPT-2's names, which are ours (hf.NAMES)
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:  # a weight gguf's GPT-2 has no place for: never drop it silently
            raise HFError(f"cannot export as GGUF: weight {hf_name} has no name in llama.cpp's gpt2 architecture")
        value = value.t() if is_transposed(hf_name) else value  # Conv1D's (in, out) back to (out, in): ggml's
        if hf_name == WTE:  # (V, C) -> (n_tokens, C)
            value = torch.cat([value, value.new_zeros(n_tokens - len(value), value.size(1))])
        if hf_name == WPE:
            value = position_rows(value)
        out[gguf_name] = value.contiguous().numpy().astype(np.float32)
    return out


def context_rows(block_size: int) -> int:
    """The positions a file declares and its table holds: at least CONTEXT_ROWS and block_size, a multiple of
    N_CTX_ROUNDING, so llama.cpp's context taken from the file (n_ctx 0, rounded up) is never past the table."""
    return -(-max(CONTEXT_ROWS, block_size) // N_CTX_ROUNDING) * N_CTX_ROUNDING


def position_rows(wpe: torch.Tensor) -> torch.Tensor:
    """The position table (block_size, C) as llama.cpp indexes it: context_rows(block_size) rows, row p being trained
    row p mod block_size. Any rows would keep llama.cpp from aborting; these cost the least: over the `small` run's
    val text, cross-entropy past the window was 2.9-3.3 nats with them, 3.5-3.6 with zeros or the last row
    repeated, 1.53 inside it (docs/interop.md, "Past the window")."""
    return wpe[torch.arange(context_rows(len(wpe))) % len(wpe)]  # (rows, C)


def stored(value: np.ndarray, dtype: str) -> tuple[np.ndarray, object]:
    """(data, ggml type) of one tensor: 1-D ones (norms, biases) in f32, as llama.cpp's converter keeps
    them; q8_0 needs rows in blocks of 32 values and falls back to f16 for a matrix whose rows are not."""
    import gguf

    types = gguf.GGMLQuantizationType
    if value.ndim == 1 or dtype == "f32":
        return value, types.F32
    if dtype == "q8_0" and value.shape[-1] % gguf.GGML_QUANT_SIZES[types.Q8_0][0] == 0:
        return gguf.quants.quantize(value, types.Q8_0), types.Q8_0
    return value.astype(np.float16), types.F16


# ----------------------------------------------------------------------------- the tokenizer
def vocabulary(tokenizer) -> tuple[list[str], list[str]]:
    """(token names in id order, merges) of the tokenizer as llama.cpp's byte-level BPE: a tiktoken BPE (GPT-2's or
    our own) as the Hugging Face export names it (tokenizer.py); a char list one token per character,
    named by its UTF-8 bytes, with each multi-byte character's merges, prefix first, then <|endoftext|> (the end token
    llama.cpp needs). A chat tokenizer: its base's, then the markers under their own text (CONTROL tokens: llama.cpp
    matches them only in a rendered template)."""
    if isinstance(tokenizer, ChatTokenizer):  # <|end|> ends its replies: a char base's added end token is left out
        tokens, merges = vocabulary(tokenizer.base)
        return [*tokens[:tokenizer.base.vocab_size], *tokenizer.markers], merges
    if tokenizer.meta()["kind"] != "char":
        tokens = bpe_tokens(tokenizer)
        return [*map(byte_text, tokens), EOT_TEXT], bpe_merges(tokens)
    names = [[BYTE_TEXT[b] for b in ch.encode("utf-8")] for ch in tokenizer.chars]
    # ordered, without repeats: characters share their lead bytes' merges
    merges = {"".join(name[:end]) + " " + name[end]: None for name in names for end in range(1, len(name))}
    # llama.cpp's gpt2 tokenizer refuses a file without merges, and gguf writes no empty array: an all-ASCII
    # vocabulary gets one merge that changes no tokenization (two NULs, which a char vocabulary never encodes).
    # Then the end token llama.cpp needs and a char vocabulary lacks: after every character, so no id moves.
    return ["".join(name) for name in names] + [EOT_TEXT], list(merges) or [f"{BYTE_TEXT[0]} {BYTE_TEXT[0]}"]


def write_metadata(writer, model: GPT, tokenizer, tokens: list[str], merges: list[str], dtype: str,
                   name: str) -> None:
    """The shape llama.cpp builds (context length: the position table's rows, context_rows), then the tokenizer:
    ``tokens``, their types (the special ids and the tokens past the model's vocabulary are CONTROL: never made from
    text) and ``merges``. bos is our start id (what an empty prompt begins with: <|endoftext|>, a char model's
    newline); eos, where llama.cpp ends a generation, is <|endoftext|>, the last token (a char export's own), never
    text. Either unset, llama.cpp's BPE takes id 11, a character of a char vocabulary. A chat model's conversation
    starts at <|begin|> (bos, as in the transformers export), its reply ends at <|end|> (eos and eot), and its
    template is written for the runners that format a conversation (llama-server, llama-cpp-python, Ollama)."""
    import gguf

    config, types = model.config, gguf.LlamaFileType
    writer.add_name(name)
    writer.add_file_type({"f32": types.ALL_F32, "f16": types.MOSTLY_F16, "q8_0": types.MOSTLY_Q8_0}[dtype])
    writer.add_context_length(context_rows(config.block_size))  # the position table's rows: llama.cpp's n_ctx 0
    writer.add_embedding_length(config.n_embd)
    writer.add_feed_forward_length(4 * config.n_embd)
    writer.add_block_count(config.n_layer)
    writer.add_head_count(config.n_head)
    writer.add_layer_norm_eps(LAYER_NORM_EPS)
    writer.add_tokenizer_model(TOKENIZER_MODEL)
    writer.add_tokenizer_pre(PRE_TOKENIZER)
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
    parser.add_argument("out", help="the .gguf file to write (a GGUF file there is replaced), or a folder for "
                                    "FOLDER/<run>.gguf")
    parser.add_argument("--dtype", choices=DTYPES, default="f32",
                        help="how the matrices are stored: f32 (exact), f16 (half the size), q8_0 (8-bit blocks)")
    args = parser.parse_args(argv)
    try:  # the paths first: without gguf installed too, and before a checkpoint is loaded
        path = find_checkpoint(args.run)
        run_name = Path(path).resolve().parent.name
        out = Path(args.out) / f"{run_name}.gguf" if Path(args.out).is_dir() else Path(args.out)
        check_output(out, "output folder", ".gguf")
    except TinyGPTError as err:  # one line and its exit code (config.py)
        exit_on(err)
    try:
        import gguf  # noqa: F401 - only to say how to get it before a checkpoint is loaded
    except ImportError:
        fail(f"the GGUF export writes with llama.cpp's gguf package: {install_hint('gguf')}")
    try:
        loaded = from_checkpoint(path)
        count = export_gguf(loaded.model, loaded.tokenizer, out, args.dtype, name=run_name)
    except TinyGPTError as err:
        exit_on(err)
    folder_note = f" ({args.out} is a folder: the file is named for the run)" if out != Path(args.out) else ""
    print(f"exported {path} -> {out}: {count} tensors, {args.dtype}{folder_note}")


if __name__ == "__main__":
    main()
