"""Time estimates the conductor ranks workers by: prefill, queue, KV transfer and decode step (TBT).

Every model is linear in its coefficients, so profiling samples fit it by least squares and measured
timings refit it online. Online refits are ridge-regularized toward the profile's coefficients, so a
handful of noisy measurements nudges the model instead of swinging it, and forget old samples
exponentially, so a machine whose speed changes is relearned.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

import numpy as np


def least_squares(features: np.ndarray, y: np.ndarray, prior: np.ndarray | None = None,
                  prior_weight: float = 0.0, weights: np.ndarray | None = None) -> np.ndarray:
    """Least squares on relative error (timing noise is proportional to the time), clipped at zero,
    optionally pulled toward ``prior`` (ridge; prior_weight counts as that many samples); ``weights``
    scale each sample (an online fit's forgetting)."""
    w = 1.0 / np.maximum(y, 1e-9)
    if weights is not None:
        w = w * np.sqrt(weights)
    features, y = features * w[:, None], y * w
    # Columns span ~1e10 (attention pairs) down to 1 (constant): scale to unit RMS so lstsq is stable.
    scale = np.sqrt(np.mean(features**2, axis=0)) if len(features) else np.ones(features.shape[1])
    scale[scale == 0] = 1.0
    a, b = features / scale, y
    if prior is not None and prior_weight > 0:
        k = features.shape[1]
        a = np.vstack([a, np.sqrt(prior_weight) * np.eye(k)])
        b = np.concatenate([b, np.sqrt(prior_weight) * prior * scale])
    coef = np.linalg.lstsq(a, b, rcond=None)[0] / scale
    return np.maximum(coef, 0.0)  # a negative time coefficient is noise, never physics


def _fit(model_cls, samples, prior, prior_weight: float):
    """Least squares of a two-input linear model (``model_cls.features``) on ``(x1, x2, seconds)`` rows."""
    arr = np.asarray(list(samples), dtype=float).reshape(-1, 3)
    return _fit_rows(model_cls, model_cls.features(arr[:, 0], arr[:, 1]), arr[:, 2], prior, prior_weight)


def _fit_rows(model_cls, features: np.ndarray, seconds: np.ndarray, prior, prior_weight: float,
              weights: np.ndarray | None = None):
    """Least squares of a linear model straight on its feature rows (a row may sum several inputs)."""
    coef = least_squares(np.asarray(features, dtype=float).reshape(-1, 3), np.asarray(seconds, dtype=float),
                         None if prior is None else prior.coef, prior_weight, weights)
    return model_cls(*map(float, coef))


def prefill_features(new, cached) -> tuple:
    """``(attention_pairs, new, 1)`` of a prefill of ``new`` tokens on top of ``cached`` ones, the terms
    `PrefillModel` is linear in. attention_pairs = new*cached + new*(new+1)/2 is the number of (query, key)
    pairs causal attention computes. Plain arithmetic, so scalars stay Python floats (the per-request
    paths: load reports, routed work, the simulator) and arrays broadcast."""
    return new * cached + new * (new + 1) / 2, new, 1.0


@dataclass(frozen=True)
class PrefillModel:
    """``T = per_pair_s * attention_pairs + per_token_s * new + fixed_s`` (see `prefill_features`).

    The per-token term covers the dense layers. Identifiable from prompts without any cache.
    """

    per_pair_s: float
    per_token_s: float
    fixed_s: float

    @staticmethod
    def features(new, cached) -> np.ndarray:
        new, cached = np.asarray(new, dtype=float), np.asarray(cached, dtype=float)
        return np.stack(np.broadcast_arrays(*prefill_features(new, cached)), axis=-1)

    @cached_property
    def coef(self) -> np.ndarray:
        return np.array([self.per_pair_s, self.per_token_s, self.fixed_s])

    def predict(self, new, cached):
        """Seconds to prefill ``new`` tokens on top of ``cached`` ones (scalars or arrays)."""
        pairs, new, one = prefill_features(new, cached)
        return self.per_pair_s * pairs + self.per_token_s * new + self.fixed_s * one

    @classmethod
    def fit(cls, samples: Iterable[tuple[int, int, float]], prior: PrefillModel | None = None,
            prior_weight: float = 0.0) -> PrefillModel:
        """Fit from ``(new_tokens, cached_tokens, seconds)`` samples."""
        return _fit(cls, samples, prior, prior_weight)

    @classmethod
    def fit_rows(cls, features, seconds, prior: PrefillModel | None = None, prior_weight: float = 0.0,
                 weights=None) -> PrefillModel:
        """Fit from feature rows: an engine step that computed several chunks is one row, the sum of its
        chunks' `prefill_features` (the model is linear, so the step's time is the sum of theirs)."""
        return _fit_rows(cls, features, seconds, prior, prior_weight, weights)


@dataclass(frozen=True)
class DecodeModel:
    """One decode step: ``T = fixed_s + per_seq_s * batch + per_context_token_s * context_tokens``.

    The fixed part is reading the weights once per step; the context part is reading every running
    sequence's KV cache, which grows by ``batch`` tokens each step.
    """

    fixed_s: float
    per_seq_s: float
    per_context_token_s: float

    @staticmethod
    def features(batch, context) -> np.ndarray:
        batch, context = np.asarray(batch, dtype=float), np.asarray(context, dtype=float)
        return np.stack([np.ones_like(batch), batch, context], axis=-1)

    @cached_property
    def coef(self) -> np.ndarray:
        return np.array([self.fixed_s, self.per_seq_s, self.per_context_token_s])

    def predict(self, batch, context):
        """Seconds of one step with ``batch`` sequences holding ``context`` tokens in all."""
        return self.fixed_s + self.per_seq_s * batch + self.per_context_token_s * context

    def run_time(self, batch: int, context: int, steps: int) -> float:
        """Seconds of ``steps`` consecutive steps of a fixed batch (context grows by batch per step)."""
        return steps * self.predict(batch, context) + self.per_context_token_s * batch * steps * (steps - 1) / 2

    def steps_to_reach(self, batch: int, context: int, seconds: float) -> int:
        """Smallest step count whose ``run_time`` is at least ``seconds`` (0 when seconds <= 0)."""
        if seconds <= 0:
            return 0
        a, b = self.predict(batch, context), self.per_context_token_s * batch
        # run_time(k) = (b/2) k^2 + (a - b/2) k: take the positive root, then fix float rounding.
        k = seconds / a if b == 0 else (-(a - b / 2) + np.sqrt((a - b / 2) ** 2 + 2 * b * seconds)) / b
        k = max(int(np.ceil(k)), 1)
        while k > 1 and self.run_time(batch, context, k - 1) >= seconds:
            k -= 1
        while self.run_time(batch, context, k) < seconds:
            k += 1
        return k

    @classmethod
    def fit(cls, samples: Iterable[tuple[int, int, float]], prior: DecodeModel | None = None,
            prior_weight: float = 0.0) -> DecodeModel:
        """Fit from ``(batch_size, context_tokens, seconds)`` samples of single steps."""
        return _fit(cls, samples, prior, prior_weight)

    @classmethod
    def fit_rows(cls, features, seconds, prior: DecodeModel | None = None, prior_weight: float = 0.0,
                 weights=None) -> DecodeModel:
        return _fit_rows(cls, features, seconds, prior, prior_weight, weights)


@dataclass(frozen=True)
class Link:
    """A transport between two holders: ``seconds = latency_s + bytes / bandwidth_Bps``."""

    bandwidth_Bps: float
    latency_s: float

    def time(self, nbytes):
        return self.latency_s + nbytes / self.bandwidth_Bps

    @classmethod
    def fit(cls, samples: Iterable[tuple[float, float]], default: Link) -> Link:
        """Least squares of ``(bytes, seconds)`` transfers; the default's latency where the sizes cannot
        separate latency from bandwidth (one size, or a fit without a positive slope)."""
        arr = np.asarray(list(samples), dtype=float).reshape(-1, 2)
        arr = arr[(arr[:, 0] > 0) & (arr[:, 1] > 0)]
        if not len(arr):
            return default
        latency = default.latency_s
        if len(np.unique(arr[:, 0])) > 1:
            inv_bw, lat = least_squares(np.stack([arr[:, 0], np.ones(len(arr))], axis=1), arr[:, 1])
            if inv_bw > 0:
                return cls(float(1.0 / inv_bw), float(lat))
        seconds = np.maximum(arr[:, 1] - latency, 1e-9)
        return cls(float(np.sum(arr[:, 0]) / np.sum(seconds)), latency)


# Loopback gRPC-class guesses, until measured transfers replace them per pair.
DEFAULT_PEER_LINK = Link(1e9, 1e-3)
DEFAULT_POOL_LINK = Link(5e8, 2e-3)


class TransferModel:
    """Per-kind default links ("peer": worker to worker, "pool": the shared pool tier), refined per
    (source, destination) pair by an exponential average of measured bandwidth."""

    def __init__(self, peer: Link, pool: Link, alpha: float = 0.2):
        self.defaults = {"peer": peer, "pool": pool}
        self.pairs: dict[str, dict[str, Link]] = {}  # src -> dst -> measured link
        self.alpha = alpha

    def link(self, src: str, dst: str, kind: str = "peer") -> Link:
        return self.pairs.get(src, {}).get(dst) or self.defaults[kind]

    def observe(self, src: str, dst: str, nbytes: int, seconds: float, kind: str = "peer") -> None:
        old = self.link(src, dst, kind)
        measured = nbytes / max(seconds - old.latency_s, 1e-6)
        bw = (1 - self.alpha) * old.bandwidth_Bps + self.alpha * measured
        self.pairs.setdefault(src, {})[dst] = Link(bw, old.latency_s)


class _OnlineFit:
    """Measured feature rows, weighted by exponential forgetting (a sample ``k`` samples old counts
    ``decay**k``: a machine that changes speed is relearned), ridge-pulled toward the prior (the start-up
    profile, taken on an idle machine). Refits after 1, 2, 4, ... samples, then every ``every``."""

    def __init__(self, prior, window: int, every: int, prior_weight: float, decay: float):
        self.prior, self.every, self.prior_weight, self.decay = prior, every, prior_weight, decay
        self.rows: deque[tuple[np.ndarray, float]] = deque(maxlen=window)
        self.pending, self.next_refit = 0, 1

    def observe(self, features, seconds: float):
        """Returns a refitted model when it is time to refit, else None."""
        self.rows.append((np.asarray(features, dtype=float), float(seconds)))
        self.pending += 1
        if self.pending < self.next_refit:
            return None
        self.pending, self.next_refit = 0, min(2 * self.next_refit, self.every)
        feats = np.array([f for f, _ in self.rows])
        secs = np.array([t for _, t in self.rows])
        weights = self.decay ** np.arange(len(secs) - 1, -1, -1, dtype=float)
        return type(self.prior).fit_rows(feats, secs, self.prior, self.prior_weight, weights)


def exposed_handoff_s(transfer_s: float, prefill_s: float, layers: int, latency_s: float = 0.0) -> float:
    """The part of a prefill -> decode KV hand-off that the request waits for after its prefill ends.

    Streamed layer by layer, layer l leaves once it is computed: with L layers each taking prefill_s/L to
    compute and transfer_s/L to send, the last byte lands ``max(T_x - T_c, 0) + min(T_x, T_c)/L`` after the
    compute ends (the link's latency on top); ``layers=1`` is a hand-off after the prefill (all exposed).
    Scalars only: it runs once per decision and once per simulated prefill."""
    return latency_s + max(transfer_s - prefill_s, 0.0) + min(transfer_s, prefill_s) / max(layers, 1)


class Estimator:
    """The bundle the conductor asks: prefill, queue, transfer and decode-step times.

    ``layers`` is how many pieces the prefill -> decode hand-off streams in (the model's layers when KV
    is sent layer by layer; 1 when it is sent after the prefill), see `exposed_handoff_s`."""

    def __init__(self, prefill: PrefillModel, decode: DecodeModel, transfer: TransferModel,
                 kv_bytes_per_token: int, *, layers: int = 1, window: int = 512, refit_every: int = 32,
                 prior_weight: float = 16.0, decay: float = 0.99):
        self.prefill, self.decode, self.transfer = prefill, decode, transfer
        self.kv_bytes_per_token, self.layers = kv_bytes_per_token, layers
        self._prefill_fit = _OnlineFit(prefill, window, refit_every, prior_weight, decay)
        self._decode_fit = _OnlineFit(decode, window, refit_every, prior_weight, decay)
        # What a request's first token costs beyond queue, copy, prefill and hand-off (RPCs, admission,
        # waits for engine step boundaries), learned from measured TTFTs; 0 until one was measured.
        self.request_overhead_s = 0.0

    @classmethod
    def from_samples(cls, prefill_samples: Iterable[tuple[int, int, float]],
                     decode_samples: Iterable[tuple[int, int, float]], kv_bytes_per_token: int,
                     peer: Link = DEFAULT_PEER_LINK, pool: Link = DEFAULT_POOL_LINK, layers: int = 1) -> Estimator:
        """Fit from workers' start-up profiling: (new, cached, seconds) prefills and (batch, context,
        seconds) decode steps. The default links are loopback gRPC-class guesses; measured transfers
        (`Conductor.observe_transfer`) replace them per pair. ``layers``: pieces the hand-off streams in."""
        prefill, decode = list(prefill_samples), list(decode_samples)
        if not prefill or not decode:
            raise ValueError("profiling gave no prefill or no decode samples")
        return cls(PrefillModel.fit(prefill), DecodeModel.fit(decode), TransferModel(peer, pool), kv_bytes_per_token,
                   layers=layers)

    def queue_time(self, feature_sums: np.ndarray):
        """Seconds of prefill work waiting: the model is linear, so summed features give summed time."""
        return feature_sums @ self.prefill.coef

    def transfer_time(self, tokens, src: str, dst: str, kind: str = "peer"):
        return self.transfer.link(src, dst, kind).time(np.asarray(tokens) * self.kv_bytes_per_token)

    def handoff_s(self, tokens, prefill_s, src: str, dst: str) -> tuple[float, float]:
        """(seconds the whole prompt KV takes over the src -> dst link, the part of it the request waits
        for after its prefill: `exposed_handoff_s`)."""
        link = self.transfer.link(src, dst)
        moving = tokens * self.kv_bytes_per_token / link.bandwidth_Bps
        return link.latency_s + moving, exposed_handoff_s(moving, prefill_s, self.layers, link.latency_s)

    def observe_prefill(self, new_tokens: int, cached_tokens: int, seconds: float) -> None:
        self.observe_prefill_step(prefill_features(new_tokens, cached_tokens), seconds)

    def observe_prefill_step(self, features, seconds: float) -> None:
        """A measured engine step: ``features`` is the sum of its chunks' `prefill_features`."""
        self.prefill = self._prefill_fit.observe(features, seconds) or self.prefill

    def observe_ttft(self, measured_s: float, modelled_s: float, alpha: float = 0.1) -> None:
        """A request's measured TTFT against the modelled part of its estimate: the rest is overhead. A
        running median (steps of ``alpha`` of the gap, at most the gap): one slow request, queued behind
        a burst the reports had not shown, does not move it far."""
        gap = measured_s - modelled_s - self.request_overhead_s
        step = min(abs(gap), alpha * max(modelled_s + self.request_overhead_s, 1e-3))
        self.request_overhead_s = max(0.0, self.request_overhead_s + (step if gap > 0 else -step))

    def observe_decode_step(self, batch_size: int, context_tokens: int, seconds: float) -> None:
        self.decode = self._decode_fit.observe(DecodeModel.features(batch_size, context_tokens), seconds) or self.decode
