"""Byte-level tokenizer: needs no download, so the packaged default recipe runs offline.

Ids 0-255 are raw UTF-8 bytes, then BOS and EOS. A model using it needs
``vocab_size >= ByteTokenizer.VOCAB`` (the debug recipes use 320, a multiple of 64).
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.components.tokenizer import BaseTokenizer


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
