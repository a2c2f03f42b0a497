"""The MoE check models' task: a lagged lookup chain, whose next letter needs a two-letter table.

A sequence of letters where each next letter is looked up in a fixed table from two earlier ones:
``next = TABLE[z[-far]][z[-near]]`` (the current letter and the one four before it: near 1, far 5), TABLE's
rows random permutations of the letters (seeded: every machine makes the same task). The check prompts are
chains in which no lookup repeats, so no answer letter can be copied from earlier in the prompt.

Why a table of two letters: a token-wise map (a fixed permutation, arithmetic on one token id) is linear in
the one-hot token, so the embeddings or attention's OV circuit compute it with no experts at all (the old
alphabet was one). A random table of two letters is not linear in them, and it is not addition either (whose
structure attention-only networks are known to learn). What attention alone can still do was measured with
``bench/check_models.py`` (docs/check-models.md): gpt-oss's far letter is out of its sliding layer's window
(4), only its full layer reaches it, and its attention-only twin does not learn the task; Qwen3's full
attention does learn it without experts. So the check models' dependence on their experts is made by their
training (sparkbuild/models/moe/trained.py) and proven on each model before it is cached: with the experts' output
zeroed, halved or doubled, answers flip.

torch is imported only when called.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cached_property
from typing import Any

ALPHABET = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True, kw_only=True)
class Task:
    letters: int
    near: int
    far: int
    # Letters in a training sequence; a prompt is its first ``length - answer`` letters.
    length: int
    answer: int
    prompts: int
    seed: int

    @property
    def alphabet(self) -> str:
        return ALPHABET[: self.letters]

    def describe(self) -> str:
        return (
            f"next = TABLE[z[-{self.far}]][z[-{self.near}]] over the letters {self.alphabet!r}; TABLE's rows are "
            f"random permutations (seed {self.seed}); the first {self.far} letters of a chain are free"
        )

    @cached_property
    def table(self) -> Any:
        """[letters, letters]: row r a random permutation of the letters."""
        torch: Any = importlib.import_module("torch")
        generator = torch.Generator().manual_seed(self.seed)
        return torch.stack([torch.randperm(self.letters, generator=generator) for _ in range(self.letters)])

    def chains(self, starts: Any) -> Any:
        """[n, length] letter indices continuing each row of ``starts`` ([n, far]) by the table."""
        torch: Any = importlib.import_module("torch")
        columns = list(starts.T)
        while len(columns) < self.length:
            columns.append(self.table[columns[-self.far], columns[-self.near]])
        return torch.stack(columns, 1)

    def sample(self, n: int, generator: Any) -> Any:
        """``n`` chains from random starts."""
        torch: Any = importlib.import_module("torch")
        return self.chains(torch.randint(0, self.letters, (n, self.far), generator=generator))

    def text(self, chain: list[int]) -> str:
        return " ".join(self.alphabet[i] for i in chain)

    def check_prompts(self) -> list[tuple[str, str]]:
        """``prompts`` (prompt, answer) texts: chains from seeded starts in which no lookup (pair of operands)
        repeats, so no answer letter can be copied from an earlier occurrence of the same lookup."""
        torch: Any = importlib.import_module("torch")
        generator = torch.Generator().manual_seed(self.seed + 1)
        cut = self.length - self.answer
        found: list[list[int]] = []
        while len(found) < self.prompts:
            chain = [int(v) for v in self.sample(1, generator)[0]]
            lookups = [(chain[i - self.far], chain[i - self.near]) for i in range(self.far, self.length)]
            if len(set(lookups)) == len(lookups) and chain[:cut] not in [f[:cut] for f in found]:
                found.append(chain)
        return [(self.text(c[:cut]), " " + self.text(c[cut:])) for c in found]

    def corpus(self, n: int) -> list[str]:
        """Sample chains as text, for learning the tokenizer and for llm-compressor's calibration."""
        torch: Any = importlib.import_module("torch")
        generator = torch.Generator().manual_seed(self.seed + 2)
        return [self.text(c) for c in self.sample(n, generator).tolist()]


class Encoder:
    """Letter indices to token ids: each letter is one token (``a``) at the start and one (`` a``) after it."""

    def __init__(self, task: Task, fast: Any) -> None:
        torch: Any = importlib.import_module("torch")
        first = [fast.convert_tokens_to_ids(c) for c in task.alphabet]
        spaced = [fast.convert_tokens_to_ids("Ġ" + c) for c in task.alphabet]
        for c, a, b in zip(task.alphabet, first, spaced, strict=True):
            ids = fast.encode(f"{c} {c}")
            if ids != [a, b]:
                raise ValueError(f"the tokenizer splits the letter {c!r} into {ids}, not one token each: change the corpus")
        self.first, self.spaced = torch.tensor(first), torch.tensor(spaced)

    def __call__(self, chains: Any) -> Any:
        ids = self.spaced[chains]
        ids[:, 0] = self.first[chains[:, 0]]
        return ids
