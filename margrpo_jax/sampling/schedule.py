"""Static (numpy) per-step schedules of the MAR decoder, so that shapes inside the jitted loop are static.

MAR's cosine schedule over ``N`` steps and ``L`` tokens: after step ``s`` the number still masked is
``n_s = clamp(floor(L cos(pi/2 (s+1)/N)), 1, m_s - 1)`` (``m_s`` masked before the step) and 0 after the
last step; step ``s`` decodes ``m_s - n_s`` tokens. NOVA's (:func:`rounded_cosine_schedule`):
``m_i = round(L cos(pi/2 i/N))`` (half to even, as numpy and torch round), ``counts_i = m_i - m_{i+1}``, zero
counts dropped (L = 1024, N = 64: 63 steps 1, 2, 2, 3, ...). CFG at step ``s``: ``constant`` = w, ``linear`` =
``1 + (w - 1) (L - n_s) / L`` (Muse-style, with MAR's pre-override ``n_s`` at the last step).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class MaskSchedule:
  counts: np.ndarray   # (N,) tokens decoded at each step
  starts: np.ndarray   # (N,) tokens already decoded before each step
  remaining: np.ndarray  # (N,) n_s of MAR (tokens kept masked, before the last-step override)

  @property
  def num_steps(self) -> int:
    return len(self.counts)

  @property
  def max_count(self) -> int:
    return int(self.counts.max())


def cosine_schedule(seq_len: int, num_steps: int) -> MaskSchedule:
  if not 1 <= num_steps <= seq_len:
    raise ValueError(f"num_steps={num_steps} must lie in [1, {seq_len}] for {seq_len} tokens")
  masked, counts, remaining = seq_len, [], []
  for s in range(num_steps):
    n = int(math.floor(seq_len * math.cos(math.pi / 2 * (s + 1) / num_steps)))
    n = max(1, min(masked - 1, n))
    remaining.append(n)
    if s == num_steps - 1:
      n = 0
    counts.append(masked - n)
    masked = n
  counts = np.array(counts, np.int32)
  return MaskSchedule(counts=counts, starts=np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32),
                      remaining=np.array(remaining, np.int32))


def rounded_cosine_schedule(seq_len: int, num_steps: int) -> MaskSchedule:
  """NOVA's schedule (module docstring); ``remaining`` = tokens still masked after each step."""
  if num_steps < 1:
    raise ValueError(f"num_steps={num_steps} must be at least 1")
  m = np.round(np.cos(math.pi / 2 * np.arange(num_steps + 1) / num_steps) * seq_len).astype(np.int64)
  counts = m[:-1] - m[1:]
  counts = counts[counts > 0].astype(np.int32)
  starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32)
  return MaskSchedule(counts=counts, starts=starts, remaining=(seq_len - starts - counts).astype(np.int32))


CFG_SCHEDULES = ("linear", "constant")  # sampling.cfg_schedule: MAR's scale rising with the known share | fixed


def cfg_schedule(sched: MaskSchedule, seq_len: int, scale: float, kind: str = "linear") -> np.ndarray:
  """Per-step guidance scale (N,), float32."""
  if kind == "constant":
    return np.full(sched.num_steps, scale, np.float32)
  if kind == "linear":
    return (1.0 + (scale - 1.0) * (seq_len - sched.remaining) / seq_len).astype(np.float32)
  raise ValueError(f"cfg_schedule={kind!r} is not one of {', '.join(CFG_SCHEDULES)}")


@functools.lru_cache(maxsize=256)
def _segments(starts: tuple, counts: tuple, max_segments: int, token_cost: float, row_cost: float
              ) -> tuple[tuple[int, int], ...]:
  n, inf = len(counts), float("inf")
  best = [[inf] * (n + 1) for _ in range(max_segments + 1)]  # best[u][h]: steps 0..h-1 in u segments
  cut = [[0] * (n + 1) for _ in range(max_segments + 1)]
  best[0][0] = 0.0
  for u in range(1, max_segments + 1):
    for hi in range(1, n + 1):
      rows = 0
      for lo in range(hi - 1, -1, -1):  # the segment lo..hi-1 at the shape of its largest prefix and count
        rows = max(rows, counts[lo])
        c = best[u - 1][lo] + (hi - lo) * (token_cost * starts[hi - 1] + row_cost * rows)
        if c < best[u][hi]:
          best[u][hi], cut[u][hi] = c, lo
  u = min(range(1, max_segments + 1), key=lambda k: (best[k][n], k))
  out, hi = [], n
  while u:
    out.append((cut[u][hi], hi))
    hi, u = cut[u][hi], u - 1
  return tuple(reversed(out))


def segments(sched: MaskSchedule, max_segments: int, token_cost: float, row_cost: float
             ) -> tuple[tuple[int, int], ...]:
  """Consecutive runs ``(lo, hi)`` of AR steps, at most ``max_segments``, each sampled at one static shape (the
  largest known prefix ``starts[hi - 1]`` for the encoder, the largest count for the head), chosen to minimise
  ``sum_s token_cost * known_s + row_cost * rows_s`` (dynamic programming; one segment per step when
  ``max_segments >= N``: every step at its own shape, as the official loop)."""
  return _segments(tuple(int(s) for s in sched.starts), tuple(int(c) for c in sched.counts),
                   max(1, min(int(max_segments), sched.num_steps)), float(token_cost), float(row_cost))
