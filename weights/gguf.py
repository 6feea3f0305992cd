"""A GGUF file that llama.cpp (and Ollama, LM Studio, every runner built on it) loads as GPT-2.

    python -m scripts.export_gguf out/tiny tiny.gguf --dtype f16
    python -c "from llama_cpp import Llama; print(Llama('tiny.gguf').tokenize(b'Hello', add_bos=False))"

Written with llama.cpp's own ``gguf`` package (imported only here, only when exporting): architecture
gpt2, which computes what GPT-2's layout computes, so a model is refused by the same rule as the Hugging
Face export (hf.gpt2_refusals: RoPE, RMSNorm, QK-norm, ReLU² are not GPT-2). The weights are
hf.to_hf's (zero biases for bias=False, the vocabulary unpadded) under gguf's names for GPT-2's
(gguf.TensorNameMap), in nn.Linear's (out, in) layout, which is ggml's: the Conv1D transposes are undone.
The head is tied: llama.cpp uses token_embd when there is no output.weight.

The tokenizer is a byte-level BPE ("gpt2") with GPT-2's pre-tokenizer, which splits text with the
pattern our BPEs use (tokenizers.bpe_pattern), so llama.cpp makes our ids: every token is named by
its bytes in GPT-2's printable stand-ins (tokenizers.bytes_to_unicode) and is NORMAL text, except the
tokenizer's special ids (<|endoftext|>), which are CONTROL. A char vocabulary is such a BPE too: one
token per character, and for a character of several UTF-8 bytes the merges that join its bytes (a
merge never crosses characters, since each starts at a UTF-8 lead byte). Nothing is added to a text:
add_bos_token and add_eos_token are false, as our encode adds nothing.

llama.cpp's GPT-2 computes GELU in its tanh form, from an fp16 table: an exact-GELU model (the
default activation) gives logits that differ within tests/test_gguf.py's tolerance, the same greedy text.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from process.errors import HFError
from weights.hf import LAYER_NORM_EPS, gpt2_refusals, is_transposed, to_hf
from process.files import written_whole
from prepare.tokenizers import bpe_tokenizer_files, bytes_to_unicode
from model import GPT

ARCH = "gpt2"  # llama.cpp's LLM_ARCH_GPT2
DTYPES = ("f32", "f16", "q8_0")  # how the 2-D weights are stored; norms and biases stay f32
TOKENIZER_MODEL = "gpt2"  # llama.cpp's name for a byte-level BPE with merges
PRE_TOKENIZER = "gpt-2"  # GPT-2's split pattern, tiktoken's r50k_pat_str (tokenizers.bpe_pattern)


@dataclass
class Vocabulary:
    """What llama.cpp needs to encode like the repo: token names (id order), their types, the merges."""
    tokens: list[str]
    special: frozenset[int]  # ids typed CONTROL: never made from text (llama.cpp: special=False)
    merges: list[str]  # "left right", both in byte-level names, in the order BPE applies them


def export_gguf(model: GPT, tokenizer, path: Path, dtype: str = "f32", name: str = "tinygpt") -> int:
    """Write ``model`` and ``tokenizer`` to the GGUF file ``path``; returns the number of tensors.

    HFError (one line, naming the option) for a model llama.cpp's gpt2 architecture cannot compute.
    """
    import gguf

    refusals = gpt2_refusals(model.config)
    if refusals:
        raise HFError(f"cannot export as GGUF: the model has {refusals[0]}; llama.cpp's gpt2 architecture "
                      "would load it and compute another model")
    tensors = gguf_tensors(model)  # before the file: a model that does not map writes nothing
    with written_whole(path) as staged:  # a failed write leaves no half file under the name
        writer = gguf.GGUFWriter(str(staged), ARCH)
        write_hparams(writer, model, dtype, name)
        write_vocabulary(writer, vocabulary(tokenizer), tokenizer.eot_token)
        for tensor_name, value in tensors.items():
            data, qtype = stored(value, dtype)
            writer.add_tensor(tensor_name, data, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return len(tensors)


# ----------------------------------------------------------------------------- the weights
def gguf_tensors(model: GPT) -> dict[str, np.ndarray]:
    """hf.to_hf's weights under llama.cpp's gpt2 names, in (out, in) layout, fp32."""
    import gguf

    names = gguf.TensorNameMap(gguf.MODEL_ARCH.GPT2, model.config.n_layer)
    out = {}
    for hf_name, value in to_hf(model).items():  # GPT-2's names, which are ours (hf.NAMES)
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:  # a weight gguf's GPT-2 has no place for: never drop it silently
            raise HFError(f"cannot export as GGUF: weight {hf_name} has no name in llama.cpp's gpt2 architecture")
        if is_transposed(hf_name):
            value = value.t()  # Conv1D's (in, out) back to (out, in): ggml's ne = (in, out)
        out[gguf_name] = value.contiguous().numpy().astype(np.float32)
    return out


def stored(value: np.ndarray, dtype: str):
    """(data, ggml type) of one tensor: 1-D ones (norms, biases) in f32, as llama.cpp's converter keeps them;
    q8_0 needs rows in blocks of 32 values and falls back to f16 for a matrix whose rows are not."""
    import gguf

    types = gguf.GGMLQuantizationType
    if value.ndim == 1 or dtype == "f32":
        return value, types.F32
    block = gguf.GGML_QUANT_SIZES[types.Q8_0][0]
    if dtype == "q8_0" and value.shape[-1] % block == 0:
        return gguf.quants.quantize(value, types.Q8_0), types.Q8_0
    return value.astype(np.float16), types.F16


def write_hparams(writer, model: GPT, dtype: str, name: str) -> None:
    """The shape llama.cpp builds: context length is block_size, the position table's length."""
    import gguf

    config = model.config
    file_types = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                  "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
    writer.add_name(name)
    writer.add_file_type(file_types[dtype])
    writer.add_context_length(config.block_size)
    writer.add_embedding_length(config.n_embd)
    writer.add_feed_forward_length(4 * config.n_embd)
    writer.add_block_count(config.n_layer)
    writer.add_head_count(config.n_head)
    writer.add_layer_norm_eps(LAYER_NORM_EPS)


# ----------------------------------------------------------------------------- the tokenizer
def vocabulary(tokenizer) -> Vocabulary:
    """The tokenizer as llama.cpp's byte-level BPE: a char list or a tiktoken BPE (GPT-2's or our own).

    A chat tokenizer (role markers after its base's ids) would append its markers here, by their text,
    and list them in ``special``: llama.cpp then types them CONTROL and never makes them from text.
    """
    if tokenizer.meta()["kind"] == "char":
        return char_vocabulary(tokenizer.chars)
    return bpe_vocabulary(tokenizer)


def char_vocabulary(chars: str) -> Vocabulary:
    """One token per character, named by its UTF-8 bytes; each multi-byte character's merges, prefix first."""
    to_text = bytes_to_unicode()
    merges: dict[str, None] = {}  # ordered, without repeats: characters share their lead bytes' merges
    for ch in chars:
        names = [to_text[b] for b in ch.encode("utf-8")]
        for end in range(1, len(names)):
            merges["".join(names[:end]) + " " + names[end]] = None
    tokens = ["".join(to_text[b] for b in ch.encode("utf-8")) for ch in chars]
    return Vocabulary(tokens, frozenset(), list(merges))


def bpe_vocabulary(tokenizer) -> Vocabulary:
    """vocab.json and merges.txt of the Hugging Face export, as lists: one source for both formats."""
    files = bpe_tokenizer_files(tokenizer.enc, block_size=0)  # block_size only fills tokenizer_config.json
    tokens = [""] * len(files["vocab.json"])
    for text, token_id in files["vocab.json"].items():
        tokens[token_id] = text
    merges = [line for line in files["merges.txt"].splitlines()[1:] if line]  # after "#version: 0.2"
    return Vocabulary(tokens, frozenset(tokenizer.special_ids), merges)


def write_vocabulary(writer, vocab: Vocabulary, start: int) -> None:
    """Tokens, types, merges and the special ids. ``start`` (<|endoftext|>, a char model's newline) is bos
    and eos: llama.cpp's BPE otherwise takes id 11 for both, and a char model has no end token of its own."""
    import gguf

    writer.add_tokenizer_model(TOKENIZER_MODEL)
    writer.add_tokenizer_pre(PRE_TOKENIZER)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if i in vocab.special else gguf.TokenType.NORMAL
                            for i in range(len(vocab.tokens))])
    writer.add_token_merges(vocab.merges)
    writer.add_bos_token_id(start)
    writer.add_eos_token_id(start)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
