"""The tiny models' tokenizer: a byte-level BPE trained locally on a seeded English-like corpus.

Most of its lines are the corpus's word lists (ruff format puts them one per line).

Owns: the vocabulary size and special tokens, the deterministic corpus (common words,
made-up words, numbers, code-ish lines) and ``train_tokenizer``, which prepends BOS as
Llama's tokenizer does. What it trains is part of every tiny model's cache key
(tinymodel.py hashes ``VOCAB_SIZE`` and ``CORPUS_SEED``; bump ``tinymodel.FORMAT_VERSION``
when the corpus or the training changes).

Must not import vLLM, torch, transformers or anything of the project; needs only
``tokenizers``, imported lazily.
"""

from __future__ import annotations

import random
from typing import Any

VOCAB_SIZE = 4096
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)  # ids 0, 1, 2 (trainer order)
CORPUS_SEED = 1234  # the tokenizer does not depend on the weight seed

_ONSETS = (
    "",
    "b",
    "c",
    "d",
    "f",
    "g",
    "h",
    "j",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "w",
    "z",
    "br",
    "ch",
    "cl",
    "dr",
    "fl",
    "gr",
    "pl",
    "pr",
    "sh",
    "st",
    "th",
    "tr",
)
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "io", "ou", "y")
_CODAS = ("", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "rt", "st", "ck", "x")
_COMMON = (
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "it",
    "was",
    "for",
    "on",
    "are",
    "with",
    "as",
    "at",
    "be",
    "this",
    "have",
    "from",
    "or",
    "one",
    "by",
    "not",
    "but",
    "what",
    "all",
    "were",
    "when",
    "we",
    "there",
    "can",
    "an",
    "your",
    "which",
    "their",
    "said",
    "if",
    "do",
    "will",
    "each",
    "about",
    "how",
    "up",
    "out",
    "them",
    "then",
    "she",
    "many",
    "some",
    "so",
    "these",
    "would",
    "other",
    "into",
    "has",
    "more",
    "her",
    "two",
    "like",
    "him",
    "see",
    "time",
    "could",
    "no",
    "make",
    "than",
    "first",
)


def _corpus(n_sentences: int = 12000) -> list[str]:
    """Deterministic English-like text: common words, made-up words, numbers, code-ish lines."""
    rng = random.Random(CORPUS_SEED)
    words = list(_COMMON)
    while len(words) < 6000:
        words.append(
            "".join(
                rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                for _ in range(rng.randint(1, 3))
            )
        )
    lines = []
    for _ in range(n_sentences):
        kind = rng.random()
        if kind < 0.8:
            ws = [
                rng.choice(_COMMON) if rng.random() < 0.4 else rng.choice(words)
                for _ in range(rng.randint(4, 16))
            ]
            ws[0] = ws[0].capitalize()
            lines.append(" ".join(ws) + rng.choice(".!?,;:"))
        elif kind < 0.9:
            lines.append(" ".join(str(rng.randint(0, 10 ** rng.randint(1, 6))) for _ in range(6)))
        else:
            a, b = rng.choice(words), rng.choice(words)
            lines.append(f"def {a}_{b}(x):\n    return x * {rng.randint(1, 99)} + {a}({b})")
    return lines


def train_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    # Prepend BOS like Llama's tokenizer; ByteLevel post-processing keeps offsets right.
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A $B",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )
    return tok
