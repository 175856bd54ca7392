"""A response's tokens -> the 32-bit word that keys each of its draws (its position, or its last k tokens).

The keyed sampler's noise is a function of (sample key, word, token), where the word of the draw
of response token i is, by the run's ``rollout.keying``:

* ``position``: i. A response that leaves its draft and meets the draft's text again one token
  later draws with other noise from then on, so the draft never helps again.
* ``context<k>`` (k in 1..8): the k tokens before i (the prompt's tail before the response has k
  of its own) and how often that k-gram preceded an earlier draw of the response, hashed to 32
  bits (splitmix64's low half). A response that meets its draft's text again draws with the
  draft's words again, so the draft's tokens may be accepted from there on
  (docs/results/keying-study.md measured how much more of a rollout its draft then covers).

Exactness needs every draw of a response keyed by a word no earlier draw of it used (shared noise
at a repeated word would make two draws dependent). Counting the k-gram makes a repeat a hash
collision; a word an earlier draw used is then replaced by the next word (mod 2**32) that no
earlier draw used. That linear probe terminates (a response has fewer than 2**32 draws) and, like
the hash, depends only on the prompt's tail and the response before the draw, which every engine
and verifier holds, so they all key a draw alike.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from megatron_bubblespec.config.schema import KEYINGS
from megatron_bubblespec.splitmix import chain

MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class Keying:
    """How a response's draws are keyed: ``context`` tokens of context, 0 for the position."""

    context: int = 0

    @classmethod
    def parse(cls, name: str) -> "Keying":
        if name not in KEYINGS:
            raise ValueError(f"unknown keying {name!r}: use position or context1 .. context8 "
                             "(the last k tokens and their count)")
        return cls(0 if name == "position" else int(name[len("context"):]))

    @property
    def name(self) -> str:
        return f"context{self.context}" if self.context else "position"

    def tracker(self, prompt: Sequence[int], response: Sequence[int] = ()) -> "ResponseWords":
        """The words of the draws after ``response``, followed as tokens are appended."""
        words = ResponseWords(self.context, prompt)
        words.extend(response)
        return words

    def words(self, prompt: Sequence[int], response: Sequence[int],
              draft: Sequence[int] = ()) -> list[int]:
        """The words of the draws of response tokens len(response) .. len(response) +
        len(draft): the draw after ``response`` and after each prefix of ``draft``."""
        return self.tracker(prompt, response).ahead(draft)


class ResponseWords:
    """One response's draw words: ``word`` is the next draw's, ``extend`` appends drawn tokens,
    ``ahead`` gives the words after each prefix of a proposal without appending it."""

    def __init__(self, context: int, prompt: Sequence[int]):
        self.context = context
        self.length = 0                                      # tokens of the response so far
        self.tail = tuple(int(t) for t in list(prompt)[-context:]) if context else ()
        self.seen: Counter = Counter()                       # k-gram -> draws it preceded
        self.used: set[int] = set()                          # words of the draws so far

    def word(self) -> int:
        if not self.context:
            return self.length
        return self._word(self.tail, self.seen[self.tail], self.used.__contains__)

    def extend(self, tokens: Sequence[int]) -> None:
        if not self.context:   # a position is a count: nothing to walk
            self.length += len(tokens)
            return
        for token in tokens:
            self.used.add(self.word())
            self.seen[self.tail] += 1
            self.tail = (self.tail + (int(token),))[-self.context:]
            self.length += 1

    def ahead(self, draft: Sequence[int]) -> list[int]:
        if not self.context:
            return list(range(self.length, self.length + len(draft) + 1))
        tail, seen, used, words = self.tail, Counter(), set(), []
        for token in list(draft) + [None]:
            word = self._word(tail, self.seen[tail] + seen[tail],
                              lambda w: w in used or w in self.used)
            words.append(word)
            if token is not None:
                used.add(word)
                seen[tail] += 1
                tail = (tail + (int(token),))[-self.context:]
        return words

    def _word(self, tail: tuple, count: int, taken) -> int:
        word = chain(*tail, count, len(tail)) & MASK32
        while taken(word):   # a collision with an earlier draw's word: the next free word
            word = (word + 1) & MASK32
        return word
