"""The texts the end-to-end benchmark sends, and when it sends them.

A realistic mix: mostly short assistant-style queries, a long tail of
paragraphs (lognormal lengths), every text distinct so that the response
cache never answers a served step. Arrivals are a Poisson process, each
arrival given to a random client process (so each client's share is a
Poisson stream too).
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import numpy as np

# Short queries: the test suite's utterances, plus slots to vary them.
SLOTS = ["please", "now", "for me", "tomorrow", "tonight", "again", "quickly"]
# Long-tail paragraphs are drawn from these sentences.
PROSE = [
    "The quarterly report shows revenue growing faster than operating costs.",
    "Our support team answers most tickets within four business hours.",
    "Customers on the annual plan can export their data at any time.",
    "The new warehouse in Rotterdam doubles our storage for spare parts.",
    "Please restart the router before calling the help desk again.",
    "Battery life dropped sharply after the latest firmware update.",
    "The recipe calls for two cups of flour and a pinch of salt.",
    "Shipping to remote islands can take up to three extra weeks.",
    "Refunds are issued to the original payment method within ten days.",
    "The museum is closed on Mondays except during school holidays.",
    "Engineers traced the outage to an expired certificate on the proxy.",
    "Tenants must give sixty days of notice before moving out.",
    "The trail climbs steeply for two miles before reaching the lake.",
    "Most users never change the default privacy settings.",
    "A cold front will bring heavy rain and strong winds by Thursday.",
    "The committee postponed its vote until the audit is complete.",
    "Interest on the savings account is paid monthly.",
    "The flight was delayed because of fog at the destination airport.",
    "Version 2.3 fixes a memory leak in the image uploader.",
    "Children under twelve travel free when accompanied by an adult.",
    "The contract renews automatically unless cancelled in writing.",
    "Our model answers questions about billing, shipping and returns.",
    "Cook the onions slowly until they turn a deep golden brown.",
    "The library lends laptops to students for up to two weeks.",
]


def make_texts(n: int, seed: int) -> list[str]:
    """n distinct texts: lognormal word counts, median ~11, long tail to 200
    (at most ~240 tokens: within minilm's 256)."""
    from tests.texts import UTTERANCES

    rng = random.Random(seed)
    texts = []
    for i in range(n):
        words = min(200, max(2, round(rng.lognormvariate(math.log(11), 0.9))))
        if words <= 14:
            text = f"{rng.choice(UTTERANCES)} {rng.choice(SLOTS)}"
        else:
            parts: list[str] = []
            while len(parts) < words:
                parts.extend(rng.choice(PROSE).split())
            text = " ".join(parts[:words])
        texts.append(f"{text} {i}")  # a number makes every text distinct
    return texts


def token_lengths(texts: list[str], tokenizer_file: Path) -> np.ndarray:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return np.array([len(e.ids) for e in tokenizer.encode_batch(texts)])


def text_mix(texts: list[str], tokenizer_file: Path) -> dict[str, Any]:
    """How many texts, and their lengths in tokens (the model's tokenizer)."""
    lengths = token_lengths(texts, tokenizer_file)
    return {
        "texts": len(texts),
        "tokens_p50": int(np.percentile(lengths, 50)),
        "tokens_p90": int(np.percentile(lengths, 90)),
        "tokens_p99": int(np.percentile(lengths, 99)),
        "tokens_max": int(lengths.max()),
        "tokens_mean": round(float(lengths.mean()), 1),
    }


def arrivals(
    texts: list[str], rate: float, clients: int, seed: int
) -> list[tuple[list[str], list[float]]]:
    """``texts`` as Poisson arrivals at ``rate``, each given to a random one
    of ``clients``: each client's texts and their offsets (seconds after the
    common start)."""
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in texts:
        t += rng.expovariate(rate)
        offsets.append(t)
    shares: list[tuple[list[str], list[float]]] = [([], []) for _ in range(clients)]
    for text, offset in zip(texts, offsets, strict=True):
        mine = shares[rng.randrange(clients)]
        mine[0].append(text)
        mine[1].append(offset)
    return shares
