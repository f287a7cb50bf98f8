"""Level-3 fallback at serve time: a model's static-vector twin, numpy only.

While a model's circuit is open the gateway answers from its fallback and
marks the response degraded. The fallback keeps the model's contract: it
takes the token ids the gateway already produces ([CLS] ... [SEP], int32),
returns embeddings of the same width in the same vector space (not
normalized: the gateway normalizes on request, as for the primary), and
probabilities over the same labels in the same order.

A text's vector is the weighted mean of its tokens' static vectors,
L2-normalized, then an affine map into the primary's space
(engine/build/fallback.py says how each part is made). A classifier applies
the primary's own head to it. The artifact, ``<model>/fallback.safetensors``,
holds tensors and string metadata only: loading it never unpickles and never
imports torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from safetensors import safe_open

if TYPE_CHECKING:
    from tokenizers import Tokenizer

from services.repository import ModelEntry, checkpoint_shape

FALLBACK_FILE = "fallback.safetensors"
FORMAT = "berth-fallback/1"
# engine/heads.py's: softmax, one-vs-rest, a sigmoid per label, the scores.
PROBABILITIES = ("softmax", "ovr", "sigmoid", "none")
_TINY = 1e-12


class FallbackError(RuntimeError):
    """A model's fallback artifact is missing, stale or unreadable."""


def fallback_path(entry: ModelEntry) -> Path:
    """Where ``entry``'s fallback artifact lives: beside its berth.json."""
    return Path(entry.root) / FALLBACK_FILE


def _unit(rows: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return rows / np.maximum(norms, _TINY)


def zipf_weights(
    tokenizer: Tokenizer, vocab: int, specials: list[int], a: float
) -> np.ndarray:
    """SIF weight per id, with token frequencies guessed from vocabulary order.

    Ranks count from the first word of two or more letters (BERT's "the" at
    1996); reserved and single-character ids before it take rank 1.
    """
    first = next(
        (
            i
            for i in range(vocab)
            if (token := (tokenizer.id_to_token(i) or "").lstrip("#Ġ▁"))[:1]
            not in ("[", "<")
            and len(token) > 1
            and token.isalpha()
        ),
        0,
    )
    rank = np.maximum(np.arange(vocab) - first + 1, 1).astype(np.float64)
    probability = 1.0 / (rank * np.log(vocab))
    weights = (a / (a + probability)).astype(np.float32)
    weights[specials] = 0.0
    return weights


class FallbackModel:
    """A model's lightweight CPU stand-in: static token vectors, a map, a head."""

    def __init__(
        self,
        name: str,
        task: str,
        vectors: np.ndarray,  # [V, D] float16 or float32: one per token id
        weights: np.ndarray,  # [V] float32: each token's weight in the mean
        matrix: np.ndarray,  # [D, E] float32: unit mean -> primary space
        offset: np.ndarray,  # [E] float32
        normalize: bool = True,  # classify: normalize before the head
        head_weight: np.ndarray | None = None,  # [C, E] float32
        head_bias: np.ndarray | None = None,  # [C] float32
        probability: str = "softmax",
        labels: list[str] | None = None,
    ) -> None:
        vocab, dim = vectors.shape
        if weights.shape != (vocab,) or matrix.ndim != 2 or matrix.shape[0] != dim:
            raise FallbackError(
                f"{name}: fallback shapes disagree: vectors {vectors.shape}, "
                f"weights {weights.shape}, map {matrix.shape}"
            )
        if offset.shape != matrix.shape[1:]:
            raise FallbackError(
                f"{name}: map offset {offset.shape}, expected {matrix.shape[1]}"
            )
        self.name = name
        self.task = task
        self.vectors = vectors
        self.weights = weights.astype(np.float32)
        self.matrix = matrix.astype(np.float32)
        self.offset = offset.astype(np.float32)
        self.normalize = normalize
        self.labels = labels or []
        self.head_weight = head_weight
        self.head_bias = head_bias
        self.probability = probability
        if task == "classify":
            self._check_head()

    def _check_head(self) -> None:
        if self.head_weight is None or self.head_bias is None:
            raise FallbackError(f"{self.name}: a classify fallback needs a head")
        classes, dim = self.head_weight.shape
        if dim != self.embedding_width or self.head_bias.shape != (classes,):
            raise FallbackError(
                f"{self.name}: head {self.head_weight.shape} / "
                f"{self.head_bias.shape} does not fit width {self.embedding_width}"
            )
        if len(self.labels) != classes:
            raise FallbackError(
                f"{self.name}: {len(self.labels)} labels for a {classes}-class head"
            )
        if self.probability not in PROBABILITIES:
            raise FallbackError(f"{self.name}: probability {self.probability!r}")

    @property
    def vocab_size(self) -> int:
        return int(self.vectors.shape[0])

    @property
    def dim(self) -> int:
        return int(self.vectors.shape[1])

    @property
    def embedding_width(self) -> int:
        """Columns of ``embed``: the primary's embedding width (its pooled
        vector through its Dense layers)."""
        return int(self.matrix.shape[1])

    @property
    def width(self) -> int:
        """Columns of ``run``: the embedding size, or the number of labels."""
        return len(self.labels) if self.task == "classify" else self.embedding_width

    @classmethod
    def load(cls, entry: ModelEntry) -> FallbackModel:
        """``entry``'s fallback; FallbackError says how to build a missing one."""
        path = fallback_path(entry)
        if not path.is_file():
            raise FallbackError(
                f"model {entry.name!r} has no fallback ({path} is missing); build "
                "it with `berth build-models`"
            )
        try:
            with safe_open(str(path), framework="numpy") as f:
                meta = f.metadata() or {}
                names = f.keys()  # safe_open is not iterable
                tensors = {name: f.get_tensor(name) for name in names}
        except Exception as exc:  # the Rust reader raises its own error types
            raise FallbackError(f"{path}: unreadable fallback: {exc}") from exc
        if meta.get("format") != FORMAT or meta.get("task") != entry.task:
            raise FallbackError(
                f"{path}: format {meta.get('format')!r} / task {meta.get('task')!r}, "
                f"expected {FORMAT!r} / {entry.task!r}; rebuild it with "
                "`berth build-models --force`"
            )
        # Its checkpoint's: one built for an earlier checkpoint would answer
        # in the wrong width.
        vocab, width = checkpoint_shape(entry.checkpoint_dir)
        if tensors["vectors"].shape != (vocab, width):
            rows, columns = tensors["vectors"].shape
            raise FallbackError(
                f"{path}: it has {rows} token vectors of width {columns}, "
                f"{entry.name}'s checkpoint {vocab} tokens of width {width}; "
                "rebuild it with `berth build-models`"
            )
        labels = entry.label_names()
        if json.loads(meta.get("labels", "[]")) != labels:
            raise FallbackError(
                f"{path}: its labels differ from {entry.name}'s; rebuild it with "
                "`berth build-models --force`"
            )
        return cls(
            name=entry.name,
            task=entry.task,
            vectors=tensors["vectors"],
            weights=tensors["weights"],
            matrix=tensors["map.weight"],
            offset=tensors["map.bias"],
            normalize=entry.normalize,
            head_weight=tensors.get("head.weight"),
            head_bias=tensors.get("head.bias"),
            probability=meta.get("probability", "softmax"),
            labels=labels,
        )

    def tensors(self) -> dict[str, np.ndarray]:
        """What the artifact stores (the builder writes these)."""
        out = {
            "vectors": self.vectors,
            "weights": self.weights,
            "map.weight": self.matrix,
            "map.bias": self.offset,
        }
        if self.head_weight is not None and self.head_bias is not None:
            out["head.weight"] = self.head_weight.astype(np.float32)
            out["head.bias"] = self.head_bias.astype(np.float32)
        return out

    def embed(self, ids_list: list[np.ndarray]) -> np.ndarray:
        """Token ids per text -> float32 [N, E] embeddings, not normalized."""
        count = len(ids_list)
        if not sum(map(len, ids_list)):
            return np.tile(self.offset, (count, 1))
        flat = np.concatenate(ids_list)
        if flat.min() < 0 or flat.max() >= self.vocab_size:
            raise ValueError(
                f"token id {int(flat.max())} is outside {self.name}'s vocabulary "
                f"of {self.vocab_size}"
            )
        # 1. Weighted sum and total weight of each text's tokens, a text at a
        # time: a BLAS vector-matrix product, which runs without the GIL. (One
        # np.add.reduceat over every token's weighted vector holds the GIL
        # throughout: for 256 texts of ~450 tokens, 275 ms of 450 on the dev
        # machine, in which the gateway's event loop, waiting for the GIL,
        # answered nothing; this loop takes 98 ms and holds it at most
        # 2.5 ms at a time.)
        sums = np.empty((count, self.dim), np.float32)
        totals = np.empty(count, np.float32)
        for i, ids in enumerate(ids_list):
            weights = self.weights[ids]
            totals[i] = weights.sum()
            vectors = self.vectors[ids].astype(np.float32, copy=False)
            np.matmul(weights, vectors, out=sums[i])
        # 2. Their mean, made unit length (zero for special tokens only).
        means = sums / np.maximum(totals, _TINY)[:, None]
        # 3. The affine map into the primary's vector space.
        return _unit(means) @ self.matrix + self.offset

    def classify(self, ids_list: list[np.ndarray]) -> np.ndarray:
        """Token ids per text -> float32 [N, C] probabilities, label order."""
        if self.head_weight is None or self.head_bias is None:
            raise FallbackError(f"model {self.name!r} is not a classifier")
        pooled = self.embed(ids_list)
        if self.normalize:
            pooled = _unit(pooled)
        scores = pooled @ self.head_weight.T + self.head_bias
        if self.probability == "none":  # regression: the scores themselves
            return scores.astype(np.float32)
        if self.probability == "sigmoid":  # multi-label
            return (1.0 / (1.0 + np.exp(-scores))).astype(np.float32)
        if self.probability == "softmax":
            exp = np.exp(scores - scores.max(axis=1, keepdims=True))
        else:  # scikit-learn's one-vs-rest: a sigmoid per class, rescaled
            exp = 1.0 / (1.0 + np.exp(-scores))
        return (exp / exp.sum(axis=1, keepdims=True)).astype(np.float32)

    def run(self, ids_list: list[np.ndarray]) -> np.ndarray:
        """What the primary's engine returns for this task: [N, width]."""
        return (
            self.classify(ids_list) if self.task == "classify" else self.embed(ids_list)
        )
