"""Byte-level tokenizer: needs no download, so the packaged default recipe runs offline.

Ids 0-255 are raw UTF-8 bytes, then BOS and EOS. A model using it needs
``vocab_size >= ByteTokenizer.VOCAB`` (the debug recipes use 320, a multiple of 64).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torchtitan.components.tokenizer import BaseTokenizer, HuggingFaceTokenizer

from framework.errors import UserError


class ByteTokenizer(BaseTokenizer):
    BOS = 256
    EOS = 257
    VOCAB = 258

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config | None = None, *, tokenizer_path: str | None = None):
        super().__init__()
        self.bos_id, self.eos_id = self.BOS, self.EOS
        self.bos_token, self.eos_token = "<bos>", "<eos>"

    def encode(self, text: str = "", *, add_bos: bool = True, add_eos: bool = True, **_) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.BOS] if add_bos else []) + ids + ([self.EOS] if add_eos else [])

    def decode(self, token_ids, **_) -> str:
        return bytes(int(t) for t in token_ids if int(t) < 256).decode("utf-8", errors="replace")

    @property
    def vocab_size(self) -> int:
        return self.VOCAB

    def get_vocab_size(self) -> int:
        return self.VOCAB


TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt")  # what torchtitan's HF tokenizer reads


def check_hf_tokenizer(path: str, model_vocab: int) -> int:
    """A HF tokenizer folder that the trainer can load and whose ids fit the model (before launch).

    Returns the tokenizer's vocabulary size (added tokens included); raises UserError naming
    ``data.tokenizer`` for a missing folder, no tokenizer files, a file that does not load, or
    ids beyond the model's embedding table.
    """
    where = f"data.tokenizer={path}"
    p = Path(path)
    if not p.is_dir():
        raise UserError(where, "no tokenizer folder there (tokenizer.json and tokenizer_config.json).",
                        "Download the model's tokenizer files there, or use data.tokenizer=byte.")
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        have = sorted(f.name for f in p.iterdir())[:6]
        raise UserError(where, f"the folder holds no tokenizer files (looked for {', '.join(TOKENIZER_FILES)}; "
                        f"found {', '.join(have) or 'nothing'}).", "Copy the model's tokenizer.json and "
                        "tokenizer_config.json there (save_pretrained of its tokenizer writes both), or use "
                        "data.tokenizer=byte.")
    try:
        tok = HuggingFaceTokenizer(tokenizer_path=str(p))
    except Exception as e:  # a corrupt tokenizer.json / tokenizer_config.json
        raise UserError(where, f"the tokenizer does not load: {type(e).__name__}: {str(e).splitlines()[0][:200]}.",
                        "Restore the tokenizer files from the model's original folder.") from None
    vocab = max([tok.get_vocab_size()] + [i + 1 for i in (tok.bos_id, tok.eos_id) if i is not None])
    if vocab > model_vocab:
        raise UserError(where, f"the tokenizer has {vocab} ids (0..{vocab - 1}), the model's vocabulary is "
                        f"{model_vocab}: ids from {model_vocab} on have no embedding row.",
                        f"Use the model's own tokenizer, or set model.vocab_size={-(-vocab // 64) * 64} (a new "
                        "model; not with a checkpoint).")
    return vocab
