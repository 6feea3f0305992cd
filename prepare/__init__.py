"""Corpus preparation: a text, a folder of documents or a .jsonl of conversations, tokenized once into train.bin,
val.bin and meta.json (corpora.prepare is the entry). Tokenizers live here too: a corpus is where one is made."""
