"""A call's prompt and embedding width: Options.prompt_name, Options.prompt
and Options.dimensions (KServe's parameters of the same names).

Both are applied as sentence-transformers' ``encode(prompt_name=...,
prompt=..., truncate_dim=...)`` applies them. The prompt is prepended to
each text before tokenizing, and its tokens count towards the model's
limit; a call that asks for none gets the model's default prompt, and an
explicit empty prompt means none at all. Dimensions keep the first N values
of each embedding, and normalization, where the call has it, comes after.

A model whose pooling leaves its prompt out (``include_prompt`` false) has
its engines leave out a fixed count of leading tokens, the default prompt's
(ModelEntry.pooling_skip), fixed when the engines load it (their pooling,
ONNX graph or TensorRT engine has it built in). sentence-transformers
leaves out as many as the call's own prompt has, so a call whose prompt has
that count is served exactly, and one with any other count is refused:
serving it would pool its prompt's tokens, or its text's, differently from
sentence-transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from gateway.echo import quoted
from services import st_config
from services.errors import InvalidInput
from services.proto.berth.v1 import berth_pb2
from services.repository import ModelEntry

if TYPE_CHECKING:
    from tokenizers import Tokenizer


class Prompts:
    """One model's prompts, as a call may ask for them."""

    def __init__(self, entry: ModelEntry, tokenizer: Tokenizer, max_chars: int) -> None:
        self.model = entry.name
        self.named = dict(entry.prompts)
        self.default = entry.prompt
        self.include = entry.include_prompt
        self.max_chars = max_chars
        self.tokenizer = tokenizer
        # Leading tokens the engines leave out of pooling ([CLS] and the
        # default prompt's), where the model leaves its prompt out.
        self.skip = 0 if self.include else entry.pooling_skip()
        self._lengths = {
            name: self.length(prompt)
            for name, prompt in self.named.items()
            if not self.include
        }

    def length(self, prompt: str) -> int:
        """Tokens sentence-transformers leaves out of pooling for
        ``prompt`` (none for the empty one, which it does not apply)."""
        return st_config.prompt_length(self.tokenizer, prompt) if prompt else 0

    def of(self, options: berth_pb2.Options) -> str:
        """The prompt a call's texts get; raises InvalidInput."""
        name = options.prompt_name
        if options.HasField("prompt"):
            if name:
                raise InvalidInput(
                    "set prompt_name or prompt, not both: prompt_name picks one "
                    "of the model's prompts, prompt gives the text of one",
                    field="options.prompt",
                )
            prompt = options.prompt
            if len(prompt) > self.max_chars:
                raise InvalidInput(
                    f"prompt has {len(prompt)} characters, over the limit of "
                    f"{self.max_chars} for model {self.model!r}",
                    field="options.prompt",
                )
            length = None
        elif name:
            if name not in self.named:
                raise InvalidInput(self._unknown(name), field="options.prompt_name")
            prompt, length = self.named[name], self._lengths.get(name)
        else:
            return self.default
        if self.include or prompt == self.default:
            return prompt
        if length is None:
            length = self.length(prompt)
        if length != self.skip:
            where = "options.prompt_name" if name else "options.prompt"
            raise InvalidInput(self._not_poolable(name, prompt, length), field=where)
        return prompt

    def _unknown(self, name: str) -> str:
        if not self.named:
            return (
                f"model {self.model!r} has no prompts, so no prompt named "
                f"{quoted(name)}; send the prompt's text as prompt instead"
            )
        return (
            f"model {self.model!r} has no prompt named {quoted(name)}; its "
            f"prompts are {', '.join(map(repr, sorted(self.named)))}"
        )

    def _not_poolable(self, name: str, prompt: str, length: int) -> str:
        asked = f"prompt {name!r}" if name else f"prompt {quoted(prompt)}"
        counted = f"{length} tokens" if prompt else "no tokens (no prompt)"
        return (
            f"model {self.model!r} leaves its prompt out of pooling "
            "(include_prompt false), and its engines leave out a fixed "
            f"{self.skip} leading tokens, its default prompt's with [CLS]; "
            f"{asked} makes {counted} to leave out, which they cannot do per "
            f"call: use a prompt of {self.skip} tokens, or the default one"
        )


def check_dimensions(entry: ModelEntry, width: int, dimensions: int) -> None:
    """Refuse a call's dimensions (0: the full width) that the model cannot
    give: more than its width, fewer than 1, or any on a classifier."""
    if not dimensions:
        return
    if entry.task != "embed":
        raise InvalidInput(
            f"dimensions {dimensions} asks for a shorter embedding, and model "
            f"{entry.name!r} is a {entry.task} model, which answers "
            "probabilities: leave dimensions unset (0)",
            field="options.dimensions",
        )
    if not 1 <= dimensions <= width:
        raise InvalidInput(
            f"dimensions {dimensions} is out of range for model {entry.name!r}, "
            f"whose embeddings have {width} values: ask for 1 to {width}, or 0 "
            "(unset) for all of them",
            field="options.dimensions",
        )


def truncated(vectors: np.ndarray, dimensions: int) -> np.ndarray:
    """The first ``dimensions`` values of each row (0: every value)."""
    if not dimensions or dimensions >= vectors.shape[1]:
        return vectors
    return vectors[:, :dimensions]
