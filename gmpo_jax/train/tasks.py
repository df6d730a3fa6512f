"""Verifiable-reward tasks: a character tokenizer, prompt generators and reward functions.

A `Task` makes prompts from a NumPy generator and scores decoded completions on the host. Built in:

* ``reverse`` -- ``"3141>"`` -> ``"1413"``: reverse a digit string.
* ``add`` -- ``"031+457="`` -> ``"0488"``: add two zero-padded numbers; the answer has ``digits + 1``
  zero-padded digits.

Both reward an exact answer with 1 and add ``partial_credit`` per answer position that is right, the end
of the answer counting as one more position (the completion stops, with EOS, right after the last
character). A random policy thus already sees a graded signal; with 3 digits and ``partial_credit=0.1``
a perfect answer scores 1 + 4 x 0.1 = 1.4. Without the end-position credit a policy that writes the digits
right but never samples EOS gets no signal to stop, and can stall there.

A user hook ``--task module:function`` names either a `Task` instance or a TRL-style reward function
``function(prompts: list[str], completions: list[str]) -> Sequence[float]``; a reward function scores the
prompts of the built-in task ``--prompt-task`` (default ``reverse``). Completions are decoded up to and
without the first EOS.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["Task", "Tokenizer", "TOKENIZER", "TokenMap", "make_task", "reverse_task", "add_task"]

RewardFn = Callable[[list, list], Sequence[float]]


class Tokenizer:
    """Character tokenizer shared by every task: ``<pad>`` = 0, ``<eos>`` = 1, then ``0-9 + = >``.

    Attributes:
      pad_id: 0. eos_id: 1. vocab_size: 15 (the model may use a larger, padded vocabulary).
    """

    pad_id = 0
    eos_id = 1
    chars = "0123456789+=>"

    def __init__(self):
        self._to_id = {c: i + 2 for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        """Number of token ids used by the tokenizer (special tokens included)."""
        return len(self.chars) + 2

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no EOS appended).

        Raises:
          ValueError: a character outside ``0-9 + = >``.
        """
        try:
            return [self._to_id[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the tokenizer alphabet {self.chars!r}") from None

    def encode_batch(self, texts: Sequence[str]) -> np.ndarray:
        """``[N, P]`` int32 ids of equal-length ``texts``.

        Raises:
          ValueError: the texts do not all have the same length (prompts are not padded).
        """
        rows = [self.encode(t) for t in texts]
        if len({len(r) for r in rows}) > 1:
            raise ValueError("all prompts of a batch must have the same length (prompts are not padded)")
        return np.asarray(rows, dtype=np.int32)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` up to (without) the first EOS; padding is skipped, unknown ids become ``?``."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i == self.pad_id:
                continue
            out.append(self.chars[i - 2] if 2 <= i < self.vocab_size else "?")
        return "".join(out)


TOKENIZER = Tokenizer()


@dataclasses.dataclass(frozen=True)
class TokenMap:
    """The policy's token id of each task token: how task text becomes model ids and back.

    ``model_ids[k]`` is the policy id of `TOKENIZER` id ``k`` (``<pad>``, ``<eos>``, ``0-9 + = >``). The
    identity map (`TokenMap.identity`) is the toy model's and a randomly initialised Qwen3's: the
    policy's ids 0..14 are the task's. A pretrained checkpoint maps the characters to its own tokens
    (`gmpo_jax.train.hf_checkpoint.checkpoint_token_map`). Sampling is over the policy's whole vocabulary: an id
    that is no task token decodes as ``?`` (a wrong character), so nothing is truncated or renormalised.

    Attributes:
      model_ids: 15 policy ids >= 0, indexed by task token id; distinct, except that pad may equal EOS
        (pad only follows EOS, and decoding stops at the EOS).
      source: one line saying where the map comes from (shown in the run header).

    Raises:
      ValueError: wrong length, a negative id, or two tokens sharing an id (other than pad = EOS).
    """

    model_ids: tuple[int, ...]
    source: str = "identity"

    def __post_init__(self):
        ids = tuple(int(i) for i in self.model_ids)
        if len(ids) != TOKENIZER.vocab_size or len(set(ids[1:])) != len(ids) - 1 or ids[0] in ids[2:] or min(ids) < 0:
            raise ValueError(f"model_ids must be {TOKENIZER.vocab_size} distinct ids >= 0, got {self.model_ids}")
        object.__setattr__(self, "model_ids", ids)
        object.__setattr__(self, "_to_task", {m: k for k, m in enumerate(ids)})  # pad = EOS decodes as EOS

    @classmethod
    def identity(cls) -> TokenMap:
        """Task id ``k`` is policy id ``k`` (pad 0, EOS 1, digits 2-11, ``+ = >`` 12-14)."""
        return cls(tuple(range(TOKENIZER.vocab_size)), "identity (task ids 0-14)")

    @property
    def pad_id(self) -> int:
        """Policy id written after EOS (masked out of the loss)."""
        return self.model_ids[TOKENIZER.pad_id]

    @property
    def eos_id(self) -> int:
        """Policy id that ends a completion."""
        return self.model_ids[TOKENIZER.eos_id]

    def encode_batch(self, texts: Sequence[str]) -> np.ndarray:
        """``[N, P]`` int32 policy ids of equal-length ``texts`` (one token per character).

        Raises:
          ValueError: as `Tokenizer.encode_batch`.
        """
        ids = TOKENIZER.encode_batch(texts)
        if self.model_ids == tuple(range(TOKENIZER.vocab_size)):
            return ids
        return np.asarray(self.model_ids, np.int32)[ids]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of policy ``ids`` up to (without) the first EOS; pad skipped, other ids ``?``."""
        out = []
        for i in ids:
            k = self._to_task.get(int(i), -1)
            if k == TOKENIZER.eos_id:
                break
            if k == TOKENIZER.pad_id:
                continue
            out.append(TOKENIZER.chars[k - 2] if k >= 2 else "?")
        return "".join(out)


@dataclasses.dataclass(frozen=True)
class Task:
    """A verifiable-reward task.

    Attributes:
      name: label used in run names and plots.
      prompt_length: characters per prompt (all prompts have this length).
      answer_length: characters of a correct answer; the default ``max_completion_length`` is
        ``answer_length + 1`` (room for EOS).
      make_prompts: ``(rng: np.random.Generator, n: int) -> list[str]`` of ``n`` prompts.
      reward_fn: ``(prompts: list[str], completions: list[str]) -> Sequence[float]``.
      answer_fn: optional ``prompt -> answer``; when given, `exact_match` reports the fraction of
        completions equal to the answer (a metric only; the reward is ``reward_fn``'s).
    """

    name: str
    prompt_length: int
    answer_length: int
    make_prompts: Callable[[np.random.Generator, int], list]
    reward_fn: RewardFn
    answer_fn: Callable[[str], str] | None = None

    def exact_match(self, prompts: Sequence[str], completions: Sequence[str]) -> float:
        """Fraction of ``completions`` equal to their prompt's answer; NaN without ``answer_fn``."""
        if self.answer_fn is None or not completions:
            return float("nan")
        return float(np.mean([self.answer_fn(p) == c for p, c in zip(prompts, completions)]))

    def rewards(self, prompts: Sequence[str], completions: Sequence[str]) -> np.ndarray:
        """``[N]`` float32 rewards of decoded ``completions``.

        Raises:
          ValueError: the reward function returned the wrong number of values or a non-finite one.
        """
        r = np.asarray(self.reward_fn(list(prompts), list(completions)), dtype=np.float32).reshape(-1)
        if r.shape[0] != len(completions):
            raise ValueError(
                f"task {self.name!r}: reward function returned {r.shape[0]} values for {len(completions)} completions"
            )
        if not np.all(np.isfinite(r)):
            raise ValueError(f"task {self.name!r}: reward function returned a non-finite value")
        return r


def _graded_reward(answers: Sequence[str], completions: Sequence[str], partial_credit: float) -> list[float]:
    out = []
    for ans, comp in zip(answers, completions):
        correct = sum(1 for a, c in zip(ans, comp) if a == c) + (len(comp) == len(ans))
        out.append(float(comp == ans) + partial_credit * correct)
    return out


def _digits(rng: np.random.Generator, n: int, digits: int) -> np.ndarray:
    return rng.integers(0, 10, size=(n, digits))


def reverse_task(digits: int = 3, partial_credit: float = 0.1) -> Task:
    """Reverse a string of ``digits`` digits: prompt ``"3141>"``, answer ``"1413"``.

    Reward: 1 for the exact answer (then EOS) + ``partial_credit`` per correct answer position, the
    end (a completion of exactly ``digits`` characters) counting as one.
    """

    def make_prompts(rng, n):
        return ["".join(map(str, row)) + ">" for row in _digits(rng, n, digits)]

    def answer_fn(prompt):
        return prompt[:-1][::-1]

    def reward_fn(prompts, completions):
        return _graded_reward([answer_fn(p) for p in prompts], completions, partial_credit)

    return Task(f"reverse{digits}", digits + 1, digits, make_prompts, reward_fn, answer_fn)


def add_task(digits: int = 3, partial_credit: float = 0.1) -> Task:
    """Add two ``digits``-digit numbers: prompt ``"031+457="``, answer ``"0488"`` (``digits + 1`` wide).

    Reward: 1 for the exact answer (then EOS) + ``partial_credit`` per correct answer position, the
    end (a completion of exactly ``digits + 1`` characters) counting as one.
    """

    def make_prompts(rng, n):
        a = rng.integers(0, 10**digits, size=n)
        b = rng.integers(0, 10**digits, size=n)
        return [f"{x:0{digits}d}+{y:0{digits}d}=" for x, y in zip(a, b)]

    def answer_fn(prompt):
        x, y = prompt[:-1].split("+")
        return f"{int(x) + int(y):0{digits + 1}d}"

    def reward_fn(prompts, completions):
        return _graded_reward([answer_fn(p) for p in prompts], completions, partial_credit)

    return Task(f"add{digits}", 2 * digits + 2, digits + 1, make_prompts, reward_fn, answer_fn)


_BUILTIN = {"reverse": reverse_task, "add": add_task}


def make_task(spec: str, *, digits: int = 3, partial_credit: float = 0.1, prompt_task: str = "reverse") -> Task:
    """Resolve ``--task``: a built-in name or a ``module:function`` hook.

    Args:
      spec: ``"reverse"``, ``"add"``, or ``"module:attr"`` naming a `Task` or a reward function
        ``(prompts, completions) -> rewards``.
      digits: difficulty of the built-in task (also of the prompts a hook reward function scores).
      partial_credit: reward per correct answer position of the built-in tasks.
      prompt_task: built-in task whose prompts a hook reward function scores.

    Returns:
      The `Task`.

    Raises:
      ValueError: the hook cannot be imported or is neither a `Task` nor callable (one line, naming
        ``--task``).
    """
    if spec in _BUILTIN:
        return _BUILTIN[spec](digits, partial_credit)
    module_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--task {spec!r} cannot be loaded: {type(e).__name__}: {e}") from None
    if isinstance(obj, Task):
        return obj
    if not callable(obj):
        raise ValueError(f"--task {spec!r} is neither a Task nor a reward function (prompts, completions) -> rewards")
    base = _BUILTIN[prompt_task](digits, partial_credit)
    return dataclasses.replace(base, name=attr, reward_fn=obj, answer_fn=None)
