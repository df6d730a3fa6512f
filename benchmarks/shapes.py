"""Named benchmark shapes: real LM heads (ANCHORS.md) and small CPU stand-ins.

Two families:

* ``lm_head`` shapes: hidden ``[B, T, H]`` times an LM-head weight of ``H x V``, then the policy loss
  (issues 2 and 3). Work: ``2 N H V`` flops forward, ``6 N H V`` forward + backward, ``N = B T``.
* ``logits`` shapes: the loss from logits that already exist, ``[B, T + 1, V]`` (issue 5; ``H = 0``).
  Work: read the logits once (forward), plus write ``dlogits`` once (forward + backward).

Each shape lists the ``(B, T)`` pairs the issues name; ``select`` turns ``--shape/--N/--B/--T`` into a
`Config`.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    kind: str  # "lm_head" | "logits"
    H: int  # 0 for logits shapes
    V: int
    batches: tuple[tuple[int, int], ...]  # the (B, T) pairs benchmarked by default
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Config:
    """One benchmarked problem: a named shape at one (B, T)."""

    shape: str
    kind: str
    B: int
    T: int
    H: int
    V: int

    @property
    def N(self) -> int:
        return self.B * self.T

    @property
    def label(self) -> str:
        return f"{self.shape} {self.B}x{self.T}"

    def model_flops(self, mode: str) -> float:
        """LM-head matmul flops: 2NHV for the forward, 6NHV with both gradients (0 for logits)."""
        return (6.0 if mode == "fwd+bwd" else 2.0) * self.N * self.H * self.V

    def logits_bytes(self, itemsize: int = 2) -> int:
        """Bytes of the ``[B, T + 1, V]`` logits (logits shapes)."""
        return self.B * (self.T + 1) * self.V * itemsize

    def floor_bytes(self, mode: str, itemsize: int = 2) -> int:
        """Logits path: read the logits once, and for fwd+bwd write dlogits once."""
        return (2 if mode == "fwd+bwd" else 1) * self.logits_bytes(itemsize)


SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape(
            "qwen2.5-0.5b",
            "lm_head",
            896,
            151936,
            ((1, 512), (8, 2048), (16, 4096), (2, 32768)),
            "Qwen2.5-0.5B LM head (H=896, V=151936)",
        ),
        Shape("llama3-8b", "lm_head", 4096, 128256, ((4, 2048),), "Llama-3-8B LM head (H=4096, V=128256)"),
        Shape(
            "logits-llama3",
            "logits",
            0,
            128256,
            ((2, 1024), (16, 1024)),
            "policy loss from logits [B, T+1, V], V=128256 (Llama-3 vocabulary)",
        ),
        # CPU stand-ins (CI / smoke tests). V deliberately not a multiple of any tile.
        Shape("cpu-tiny", "lm_head", 64, 1000, ((2, 64),), "CPU smoke shape"),
        Shape("cpu-small", "lm_head", 128, 8191, ((2, 128), (4, 256)), "CPU shape"),
        Shape("logits-cpu", "logits", 0, 1000, ((2, 64),), "CPU smoke shape, logits path"),
    )
}


def select(shape: str, *, N: int | None = None, B: int | None = None, T: int | None = None) -> Config:
    """Resolves ``--shape`` with an optional ``--N`` or explicit ``--B/--T`` to a `Config`.

    ``N`` picks the first listed ``(B, T)`` with ``B * T == N`` (for N = 65536 on the Qwen head that is
    16 x 4096; pass ``--B 2 --T 32768`` for the long-sequence variant). Without N/B/T, the first pair.
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {sorted(SHAPES)}")
    s = SHAPES[shape]
    if B is not None or T is not None:
        if B is None or T is None:
            raise ValueError("give both --B and --T (or --N)")
        if N is not None and B * T != N:
            raise ValueError(f"{B=} x {T=} != {N=}")
        b, t = B, T
    elif N is not None:
        match = [bt for bt in s.batches if bt[0] * bt[1] == N]
        if match:
            b, t = match[0]
        else:  # one sequence per 2048 tokens, or a single sequence for short N
            t = 2048 if N % 2048 == 0 and N > 2048 else N
            b = N // t
    else:
        b, t = s.batches[0]
    return Config(shape=s.name, kind=s.kind, B=b, T=t, H=s.H, V=s.V)


def configs(shape: str) -> list[Config]:
    """All default ``(B, T)`` configurations of a named shape."""
    return [select(shape, B=b, T=t) for b, t in SHAPES[shape].batches]
