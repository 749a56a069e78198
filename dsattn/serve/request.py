"""What a client asks of the scheduler and what it gets back, as plain values checked once
at submission (so a bad request fails alone, before it touches the batch)."""

from __future__ import annotations

import dataclasses
import enum
import math

from dsattn.errors import InputError
from dsattn.model import check_tokens


class Finish(enum.Enum):
    """Why a request ended (OpenAI's finish_reason values)."""

    STOP = "stop"  # it drew its eos token (not in its output) or ended with a stop sequence
    LENGTH = "length"  # it produced max_new_tokens
    CANCELLED = "cancelled"  # its client cancelled it (a text stop the server matched)


@dataclasses.dataclass(frozen=True)
class Request:
    """A prompt to continue by up to `max_new_tokens` tokens, sampled as Engine.generate
    samples one row: greedy at temperature 0, else temperature + top-p with
    fold_in(fold_in(PRNGKey(seed), step), 0) at step `step`, so a request's tokens are its
    solo `generate` output whatever else is running. It ends at `eos_id` (not included) or
    once its output ends with one of the `stop` token sequences (included)."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    eos_id: int | None = None
    stop: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "prompt", tuple(int(t) for t in self.prompt))
        object.__setattr__(self, "stop", tuple(tuple(int(t) for t in s) for s in self.stop))

    def check(self, vocab_size: int) -> None:
        """Raise InputError naming the first bad field."""
        if not self.prompt:
            raise InputError("request: the prompt needs at least one token")
        check_tokens(list(self.prompt), vocab_size, "request prompt")
        if (isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int)
                or self.max_new_tokens < 0):
            raise InputError(f"request: max_new_tokens must be an integer >= 0, got "
                             f"{self.max_new_tokens!r}")
        if not 0 <= self.temperature < math.inf:  # NaN fails too
            raise InputError(f"request: temperature must be a finite number >= 0 (0: greedy), "
                             f"got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"request: top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.seed < 2 ** 31:
            raise InputError(f"request: seed must be in [0, 2**31), got {self.seed}")
        if self.eos_id is not None:
            check_tokens([self.eos_id], vocab_size, "request eos_id")
        for s in self.stop:
            if not s:
                raise InputError("request: an empty stop sequence would stop at once")
            check_tokens(list(s), vocab_size, "request stop")

    def stops_after(self, output: list[int]) -> bool:
        """Whether `output` (just extended) now ends with a stop sequence."""
        return any(len(output) >= len(s) and tuple(output[-len(s):]) == s for s in self.stop)


@dataclasses.dataclass(frozen=True)
class Event:
    """One step's news of a request: a new output token, and/or that it finished (then
    `finish` says why; `token` is None when the ending token is not part of the output)."""

    request_id: int
    token: int | None
    finish: Finish | None = None
    cached_tokens: int | None = None  # on a request's first event: prompt tokens it reused
