"""Tokenizers for traces: the bundled Qwen3 tokenizer or any `tokenizer.json`, plus chat templates.

Chat messages are rendered with the model's Jinja chat template in a sandbox, the way the Hugging
Face ecosystem renders them (trim_blocks, lstrip_blocks, `tojson`, `raise_exception`).
"""

from __future__ import annotations

import functools
import json
import lzma
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agentspec_sim.io import strict_json

BUNDLED = {"qwen3": Path(__file__).parent / "data" / "qwen3"}


class UnknownTokenizerError(ValueError):
    pass


@dataclass(frozen=True, eq=False)
class TraceTokenizer:
    """A loaded tokenizer: encodes text pieces to int32 ids and renders chat messages."""

    name: str
    backend: object  # tokenizers.Tokenizer
    chat_template: str | None
    eot_text: str | None
    bos_text: str | None = None

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @functools.cached_property
    def eot_id(self) -> int | None:
        return None if self.eot_text is None else self.backend.token_to_id(self.eot_text)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text; special tokens written in the text map to their ids."""
        if not texts:
            return []
        encodings = self.backend.encode_batch_fast(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def decode(self, ids: np.ndarray | list[int]) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text the model's chat template makes of `messages`."""
        if self.chat_template is None:
            raise UnknownTokenizerError(f"tokenizer {self.name!r} has no chat template")
        return _compile_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_text or "", eos_token=self.eot_text or "",
        )

    def token_bytes(self) -> list[bytes]:
        """The raw bytes of every token id (index = id), built once and cached; do not mutate.

        This is the token→string map M of AgentSpec (XGrammar-style): drafters feed it to the
        structure automaton without calling the tokenizer per token. Byte-level BPE vocab strings
        (GPT-2 / Qwen) are mapped back through the byte↔unicode table, so a token may hold part of
        a multi-byte UTF-8 character; added and special tokens are their UTF-8 content.
        SentencePiece-style vocabs map `▁` to a space and `<0xNN>` byte-fallback tokens to one
        byte. Ids without a token are b"".
        """
        cached = self.__dict__.get("_token_bytes")
        if cached is not None:
            return cached
        backend = self.backend
        vocab: dict[str, int] = backend.get_vocab(with_added_tokens=False)
        added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
        size = max([*vocab.values(), *added, -1]) + 1
        table = [b""] * size
        decoder_state = str(backend.decoder.__getstate__()) if backend.decoder is not None else ""
        if '"ByteLevel"' in decoder_state:
            # GPT-2's bytes_to_unicode: printable Latin-1 bytes map to themselves, the rest to 256+n.
            printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
            to_byte = {chr(b): b for b in printable}
            to_byte.update({chr(256 + n): b for n, b in enumerate(sorted(set(range(256)) - set(printable)))})
            for text, i in vocab.items():
                try:
                    table[i] = bytes([to_byte[ch] for ch in text])
                except KeyError:  # not a byte-level string after all: keep its UTF-8
                    table[i] = text.encode("utf-8")
        elif '"Metaspace"' in decoder_state or '"ByteFallback"' in decoder_state:
            for text, i in vocab.items():
                if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                    try:
                        table[i] = bytes([int(text[3:5], 16)])
                        continue
                    except ValueError:
                        pass
                table[i] = text.replace("\u2581", " ").encode("utf-8")
        else:  # other decoders (WordPiece…): decode each id once, now, never at use time
            for i in vocab.values():
                table[i] = backend.decode([i], skip_special_tokens=False).encode("utf-8")
        for i, content in added.items():
            table[i] = content.encode("utf-8")
        self.__dict__["_token_bytes"] = table
        return table


@functools.lru_cache(maxsize=8)
def _compile_template(source: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


def _special_text(config: dict, key: str) -> str | None:
    value = config.get(key)
    if isinstance(value, dict):  # {"content": "<|im_end|>", ...} in older configs
        value = value.get("content")
    return value if isinstance(value, str) else None


def _resolve(spec: str, base_dir: Path | None) -> tuple[Path, Path | None]:
    """(tokenizer.json or .json.xz, its tokenizer_config.json if any) for a name or a path."""
    if spec in BUNDLED:
        folder = BUNDLED[spec]
        return folder / "tokenizer.json.xz", folder / "tokenizer_config.json"
    path = Path(spec).expanduser()
    if not path.is_absolute() and base_dir is not None and not path.exists():
        path = base_dir / path
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        known = ", ".join(sorted(BUNDLED))
        raise UnknownTokenizerError(
            f"unknown tokenizer {spec!r}: not a bundled name ({known}) nor a tokenizer.json file"
        )
    config = path.parent / "tokenizer_config.json"
    return path, config if config.is_file() else None


@functools.lru_cache(maxsize=8)
def _load(json_path: Path, config_path: Path | None, name: str) -> TraceTokenizer:
    from tokenizers import Tokenizer

    raw = json_path.read_bytes()
    if json_path.suffix == ".xz":
        raw = lzma.decompress(raw)
    try:
        backend = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as exc:  # the tokenizers library raises plain Exceptions
        raise UnknownTokenizerError(f"{json_path}: not a valid tokenizer.json ({exc})") from None
    config = strict_json.loads(config_path.read_text("utf-8")) if config_path else {}
    return TraceTokenizer(
        name=name,
        backend=backend,
        chat_template=config.get("chat_template") if isinstance(config.get("chat_template"), str) else None,
        eot_text=_special_text(config, "eos_token"),
        bos_text=_special_text(config, "bos_token"),
    )


def load_tokenizer(spec: str, base_dir: Path | None = None) -> TraceTokenizer:
    """The tokenizer named by a trace's meta line: a bundled name or a path (relative to `base_dir`)."""
    json_path, config_path = _resolve(spec, base_dir)
    return _load(json_path.resolve(), config_path.resolve() if config_path else None, spec)


def tokenizer_file(spec: str, base_dir: Path | None = None) -> Path:
    """The tokenizer.json (or .json.xz) file `load_tokenizer(spec, base_dir)` reads."""
    return _resolve(spec, base_dir)[0].resolve()
