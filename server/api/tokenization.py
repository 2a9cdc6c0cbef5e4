"""The gateway's tokenizer and chat template, from the stages' tokenizer files or a local folder.

``messages -> (chat template) prompt text -> (tokenizer) prompt token ids``. The engine below
works on token ids only; text and templates stay in the HTTP layer.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from protos.manifest import ShardManifest

log = logging.getLogger(__name__)


def keep_torch_out() -> None:
    """Run this gateway process without torch, as the runtime image does, even where the
    export extra installed it: transformers imports torch whenever it finds it, which costs
    the gateway start-up time and memory (docs/benchmarks.md, "Start-up costs"), though the
    tokenizer and the chat template never use it. Call before transformers is imported, only
    in a process that runs no export (torch already loaded is left alone)."""
    if "torch" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]  # importlib then finds none
    # and no "PyTorch was not found. Models won't be available" notice at start
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


@dataclass
class TextCodec:
    """Encodes prompts (with the chat template) and gives the fast tokenizer for decoding."""

    tokenizer: Tokenizer
    chat: Any  # transformers PreTrainedTokenizerFast, used for apply_chat_template
    eos_ids: frozenset[int]
    has_chat_template: bool
    vocab_size: int  # the model's (logits) vocabulary, read once: the tokenizer's call is slow

    def chat_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The prompt's token ids: ``messages`` (and the offered ``tools``, as
        ``[{"type": "function", "function": {...}}]``) through the chat template.

        A template that refuses the messages (its ``raise_exception``, e.g. a model that takes
        one tool call per message) or fails on them is a ValueError with its reason.
        """
        if not self.has_chat_template:
            raise ValueError("this model has no chat template: use /v1/completions")
        from jinja2 import TemplateError

        try:
            text = self.chat.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=True, tokenize=False
            )
        except TemplateError as exc:
            raise ValueError(f"the model's chat template refused the messages: {exc}") from None
        except (TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"the model's chat template failed on the messages: {exc}") from None
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    @property
    def chat_template(self) -> Any:
        """The chat template (a string, or named templates), or None."""
        return getattr(self.chat, "chat_template", None) if self.has_chat_template else None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def load_codec(folder: Path, manifest: ShardManifest) -> TextCodec:
    from transformers import PreTrainedTokenizerFast

    tokenizer_json = folder / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise ValueError(f"{folder} has no tokenizer.json")
    chat = PreTrainedTokenizerFast.from_pretrained(str(folder))
    template = manifest.tokenizer.chat_template or getattr(chat, "chat_template", None)
    if template:
        chat.chat_template = template
    return TextCodec(
        tokenizer=Tokenizer.from_file(str(tokenizer_json)),
        chat=chat,
        eos_ids=frozenset(manifest.tokenizer.eos_token_ids),
        has_chat_template=bool(template),
        vocab_size=manifest.model.vocab_size,
    )


def codec_from_files(files: dict[str, bytes], manifest: ShardManifest) -> TextCodec:
    """Write fetched tokenizer files to a private temporary folder, load them, and remove the
    folder (the loaded tokenizer keeps nothing open there)."""
    for name in files:
        if "/" in name or "\\" in name or name.startswith("."):
            raise ValueError(f"refusing tokenizer file name {name!r}")
    with tempfile.TemporaryDirectory(prefix="pipeshard-tokenizer-") as tmp:
        folder = Path(tmp)
        for name, data in files.items():
            (folder / name).write_bytes(data)
        return load_codec(folder, manifest)
