"""Independent float64 NumPy oracle for SPEC.md (the project's loss contract).

Written from SPEC.md only: it does not import gmpo_jax and shares no code with it. Everything is
float64 with full [B, T, V] logits, and every gradient is derived by hand (no autodiff):

    d loss / d logp   from the formulas of SPEC.md, with its boundary rule: a token is clipped only
                      STRICTLY past its bound, at the exact bound the gradient passes as if unclipped;
    dz = dlogp * (onehot(id) - softmax(z)) / temperature,   z = (h @ W + b) / temperature
    dh = dz @ W^T,  dW = h^T @ dz  (transposed for the [V, H] layout),  db = sum dz.

On-policy (``old_logps=None``) means ``old = stop_gradient(logp)``: the log ratio is exactly 0 but
``d r / d logp = 1``.  Masked positions may hold any id and influence nothing; an unmasked id
outside ``[0, V)`` makes the loss NaN.

Entry points
------------
``spec_logprobs``        per-token log-probs ([B, T], 0 under the mask).
``spec_loss_from_logp``  loss, metrics and d loss / d logp from given per-token log-probs.
``spec_head_vjp``        (dh, dW, db) of the LM head for a given d loss / d logp.
``spec_policy_loss``     all of it from hidden / weight: loss, metrics, dhidden, dweight, dbias.

Packed batches (``segment_ids``, SPEC.md "Packed batches"): each maximal run of equal positive ids in a
row is one sequence and id 0 is padding. The oracle unpacks the sequences into a padded batch, one per
row, evaluates the padded formulas there and scatters ``d loss / d logp`` back. Advantages may be
``[B]`` (per row) or ``[B, T]`` (per token); GMPO's sequence advantage is the mean over its unmasked
tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

RATIO_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
LOSS_TYPES = RATIO_TYPES + ("cispo", "sapo", "gmpo")

f64 = np.float64


def _as64(x):
    return None if x is None else np.asarray(x, dtype=f64)


def _head_weight_hv(weight, weight_layout):
    w = np.asarray(weight, dtype=f64)
    if weight_layout == "hv":
        return w
    if weight_layout == "vh":
        return w.T
    raise ValueError(f"unknown weight_layout {weight_layout!r}")


def _raw_logits(hidden, weight, bias, weight_layout):
    h = np.asarray(hidden, dtype=f64)
    w = _head_weight_hv(weight, weight_layout)
    z = h @ w
    if bias is not None:
        z = z + np.asarray(bias, dtype=f64)
    return z


def _logits(hidden, weight, bias, temperature, weight_layout, softcap=None):
    """``z = cap(h W + b) / temperature``, ``cap(x) = softcap tanh(x / softcap)`` (Gemma) or ``x``."""
    z = _raw_logits(hidden, weight, bias, weight_layout)
    if softcap is not None:
        z = softcap * np.tanh(z / softcap)
    return z / f64(temperature)


def _log_softmax(z):
    zmax = np.max(z, axis=-1, keepdims=True)
    lse = zmax + np.log(np.sum(np.exp(z - zmax), axis=-1, keepdims=True))
    return z - lse


def _mask_bool(mask, shape):
    if mask is None:
        return np.ones(shape, dtype=bool)
    return np.asarray(mask).astype(bool)


def spec_logprobs(hidden, weight, ids, mask=None, *, bias=None, temperature=1.0, weight_layout="hv", softcap=None):
    """logp[b, t] = log_softmax(z[b, t])[ids[b, t]] in float64; 0 where masked; NaN for a bad unmasked id."""
    z = _logits(hidden, weight, bias, temperature, weight_layout, softcap)
    V = z.shape[-1]
    ids = np.asarray(ids)
    m = _mask_bool(mask, ids.shape)
    valid = (ids >= 0) & (ids < V)
    logsm = _log_softmax(z)
    safe = np.where(valid, ids, 0)
    lp = np.take_along_axis(logsm, safe[..., None], axis=-1)[..., 0]
    lp = np.where(valid, lp, np.nan)
    return np.where(m, lp, 0.0)


def spec_entropy(
    hidden, weight, mask=None, *, bias=None, temperature=1.0, weight_layout="hv", vocab_size=None, softcap=None
):
    """H[b, t] = -sum_v p log p of softmax(z[b, t]) over the first ``vocab_size`` columns, float64; 0 masked."""
    z = _logits(hidden, weight, bias, temperature, weight_layout, softcap)
    if vocab_size is not None:
        z = z[..., :vocab_size]
    logsm = _log_softmax(z)
    ent = -np.sum(np.exp(logsm) * logsm, axis=-1)
    return np.where(_mask_bool(mask, ent.shape), ent, 0.0)


def spec_head_vjp(
    hidden, weight, ids, mask, dlogp, *, bias=None, temperature=1.0, weight_layout="hv", softcap=None, dentropy=None
):
    """(dhidden [B,T,H], dweight (declared layout), dbias [V] or None) for cotangent ``dlogp`` [B, T].
    With ``softcap`` the chain rule through ``softcap tanh(x / softcap)``: ``dx = dz (1 - tanh(x / softcap)**2)``.
    ``dentropy`` [B, T]: also a cotangent of each token's entropy ``H``: ``dH/dz = -p (log p + H)``."""
    h = np.asarray(hidden, dtype=f64)
    z = _logits(hidden, weight, bias, temperature, weight_layout, softcap)
    V = z.shape[-1]
    ids = np.asarray(ids)
    m = _mask_bool(mask, ids.shape)
    p = np.exp(_log_softmax(z))
    valid = (ids >= 0) & (ids < V)
    onehot = (np.arange(V) == np.where(valid, ids, -1)[..., None]).astype(f64)
    g = np.where(m, np.asarray(dlogp, dtype=f64), 0.0)[..., None]
    # Select, never multiply by a zero mask: masked rows contribute exactly 0.
    dz = np.where(m[..., None], g * (onehot - p), 0.0) / f64(temperature)
    if dentropy is not None:
        logsm = _log_softmax(z)
        ent = -np.sum(p * logsm, axis=-1, keepdims=True)
        ge = np.where(m, np.asarray(dentropy, dtype=f64), 0.0)[..., None]
        dz = dz + ge * (-p * (logsm + ent)) / f64(temperature)
    if softcap is not None:
        dz = dz * (1.0 - np.tanh(_raw_logits(hidden, weight, bias, weight_layout) / softcap) ** 2)
    w_hv = _head_weight_hv(weight, weight_layout)
    dh = dz @ w_hv.T
    dw_hv = np.einsum("bth,btv->hv", h, dz)
    dw = dw_hv if weight_layout == "hv" else dw_hv.T
    db = None if bias is None else dz.sum(axis=(0, 1))
    return dh, dw, db


@dataclasses.dataclass
class SpecLoss:
    loss: float
    metrics: dict[str, float]
    dlogp: np.ndarray  # d loss / d logp, [B, T]
    logp: np.ndarray  # the per-token log-probs the loss was evaluated at
    scale: float  # the same reduction applied to |per-term contributions| (for relative tolerances)
    margin: float  # smallest distance of an unmasked token's decision variable to a clip/delta bound


@dataclasses.dataclass
class SpecResult(SpecLoss):
    dhidden: np.ndarray = None
    dweight: np.ndarray = None
    dbias: np.ndarray | None = None


def _broadcast_rollout(rollout_is_ratio, B, T):
    ris = np.asarray(rollout_is_ratio, dtype=f64)
    if ris.ndim == 1:
        ris = ris[:, None]
    return np.broadcast_to(ris, (B, T))


def spec_loss_from_logp(
    logp,
    mask,
    advantages,
    *,
    loss_type: str,
    epsilon_low: float | None = None,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    importance_sampling_level: str = "token",
    delta: float | None = None,
    use_bias_correction_kl: bool = False,
    max_completion_length: int | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    old_logps=None,
    ref_logps=None,
    rollout_is_ratio=None,
    num_items_in_batch=None,
    rollout_logps=None,
    rollout_is_mode: str = "token_truncate",
    rollout_is_cap: float = 2.0,
    token_select=None,
) -> SpecLoss:
    """Loss, metrics and d loss / d logp of SPEC.md from per-token log-probs (float64)."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    if epsilon_low is None:
        epsilon_low = 0.4 if loss_type == "gmpo" else 0.2
    if epsilon_high is None:
        epsilon_high = 0.4 if loss_type == "gmpo" else 0.2
    logp = np.asarray(logp, dtype=f64)
    B, T = logp.shape
    m = _mask_bool(mask, (B, T))
    mf = m.astype(f64)
    adv = np.asarray(advantages, dtype=f64)
    if adv.ndim == 1:
        A = np.broadcast_to(adv[:, None], (B, T))
    elif loss_type == "gmpo":  # one advantage per sequence: the mean over its unmasked tokens
        n = _mask_bool(mask, (B, T)).astype(f64)
        A = np.broadcast_to(((n * adv).sum(axis=1) / np.maximum(n.sum(axis=1), 1.0))[:, None], (B, T))
    else:
        A = adv
    # Masked positions influence nothing: replace whatever they hold by 0 before any arithmetic.
    logp = np.where(m, logp, 0.0)
    old = logp if old_logps is None else np.where(m, _as64(old_logps), 0.0)
    r = np.where(m, logp - old, 0.0)  # d r / d logp = 1 (on-policy too)
    L = mf.sum(axis=1)  # [B]
    Lc = np.maximum(L, 1.0)
    Ntot = mf.sum()
    Ntot_c = max(Ntot, 1.0)
    # Rollout correction (SPEC.md "Rollout correction"): d = old - sampler per token, D its sequence sum.
    if rollout_logps is not None:
        d_roll = np.where(m, old - _as64(rollout_logps), 0.0)
        D_roll = d_roll.sum(axis=1)
        seq_mode = rollout_is_mode.startswith("sequence")
        x = np.exp(np.broadcast_to(D_roll[:, None], (B, T)) if seq_mode else d_roll)
        u_roll = (
            np.minimum(x, rollout_is_cap)
            if rollout_is_mode.endswith("truncate")
            else np.where(x > rollout_is_cap, 0.0, x)
        )

    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs ref_logps")
        d = np.where(m, _as64(ref_logps) - logp, 0.0)
        kl = np.exp(d) - d - 1.0
        dkl_dlogp = 1.0 - np.exp(d)
    else:
        kl = np.zeros((B, T))
        dkl_dlogp = np.zeros((B, T))

    margins = [np.inf]

    def margin_of(x, bound, where):
        if np.any(where):
            margins.append(float(np.min(np.abs(x[where] - bound))))

    if rollout_logps is not None and rollout_is_mode.endswith("mask"):  # kept or dropped at the cap
        margin_of(np.log(x), np.log(rollout_is_cap), m)

    if loss_type == "gmpo":
        if importance_sampling_level != "token":
            raise ValueError("gmpo is token level only")
        pos = A > 0
        c = np.where(pos, np.minimum(r, epsilon_high), np.maximum(r, -epsilon_low))
        u = np.where(pos, r <= epsilon_high, r >= -epsilon_low)  # gradient passes at the exact bound
        # the tokens of the geometric mean, and one mismatch weight per sequence (geometric means of
        # token weights; token_mask drops the tokens whose weight exceeds the cap)
        keep = m.copy()
        W = np.ones(B)
        if rollout_is_ratio is not None:
            W = W * np.exp((mf * np.log(np.where(m, _broadcast_rollout(rollout_is_ratio, B, T), 1.0))).sum(axis=1) / Lc)
        if rollout_logps is not None:
            if rollout_is_mode == "token_truncate":
                W = W * np.exp((mf * np.minimum(d_roll, np.log(rollout_is_cap))).sum(axis=1) / Lc)
            elif rollout_is_mode == "token_mask":
                keep = m & ~(np.exp(d_roll) > rollout_is_cap)
                W = W * np.exp((keep * d_roll).sum(axis=1) / np.maximum(keep.sum(axis=1), 1.0))
            else:
                W = W * u_roll[:, 0]
        kf = keep.astype(f64)
        Lk = np.maximum(kf.sum(axis=1), 1.0)
        s = (kf * c).sum(axis=1) / Lk  # [B]
        has = kf.sum(axis=1) > 0
        A_b = A[:, 0]
        live = has & (A_b != 0)
        pol_b = np.where(live, -A_b * W * np.exp(np.where(live, s, 0.0)), 0.0)
        if use_bias_correction_kl:
            klc = kl * np.exp(r)
            dklc = dkl_dlogp * np.exp(r) + kl * np.exp(r)
        else:
            klc, dklc = kl, dkl_dlogp
        kl_b = (mf * klc).sum(axis=1) / Lc
        loss = pol_b.sum() / B + beta * kl_b.sum() / B
        scale = np.abs(pol_b).sum() / B + abs(beta) * np.abs(mf * klc).sum(axis=1).dot(1 / Lc) / B
        sel = m if token_select is None else m & np.asarray(token_select, bool)  # the rest: value, no gradient
        gpol = np.where(
            live[:, None] & keep & u & sel,
            (-(A_b * W * np.exp(np.where(live, s, 0.0))) / (B * Lk))[:, None],
            0.0,
        )
        dlogp = gpol + np.where(m, beta * dklc / (B * Lc)[:, None], 0.0)
        low = r < -epsilon_low
        high = r > epsilon_high
        cl = m & low & (A < 0)
        ch = m & high & (A > 0)
        margin_of(r, epsilon_high, m & (A > 0))
        margin_of(r, -epsilon_low, m & (A < 0))
        den = float(B)
        kl_metric = (mf * klc).sum() / Ntot_c
        kl_raw = (mf * kl).sum() / Ntot_c
    else:
        if importance_sampling_level == "token":
            w = r
        elif importance_sampling_level == "sequence":
            if loss_type in ("cispo", "sapo"):
                raise ValueError("sequence-level IS with cispo / sapo is a configuration error")
            w = np.broadcast_to(((mf * r).sum(axis=1) / Lc)[:, None], (B, T))
        else:
            raise ValueError(f"unknown importance_sampling_level {importance_sampling_level!r}")
        coef = np.exp(w)
        nz = A != 0
        direct = np.zeros((B, T))  # partial d ptl / d logp (logp appearing outside w)
        if loss_type in RATIO_TYPES:
            lo, hi = 1.0 - epsilon_low, 1.0 + epsilon_high
            coef2 = np.clip(coef, lo, hi)
            dcoef2 = ((coef >= lo) & (coef <= hi)).astype(f64)  # clip passes at its bounds
            if delta is not None:
                coef1 = np.minimum(coef, delta)
                dcoef1 = (coef <= delta).astype(f64)
                margin_of(coef, delta, m & nz)
            else:
                coef1, dcoef1 = coef, np.ones((B, T))
            p1, p2 = coef1 * A, coef2 * A
            ptl = np.where(nz, -np.minimum(p1, p2), 0.0)
            # min(p1, p2): the smaller branch; a tie takes the mean of both branches' derivatives (the
            # PyTorch rule). Away from pathological configurations (delta on a clip bound) both tied
            # branches have derivative 1, i.e. the gradient passes at the exact bound.
            dsel = np.where(p1 < p2, dcoef1, np.where(p2 < p1, dcoef2, 0.5 * (dcoef1 + dcoef2)))
            dptl_dw = np.where(nz & (dsel != 0), -A * dsel * coef, 0.0)
            low, high = coef < lo, coef > hi
            margin_of(coef, lo, m & (A < 0))
            margin_of(coef, hi, m & (A > 0))
        elif loss_type == "cispo":
            cc = np.minimum(coef, epsilon_high)  # stop-gradient
            ptl = np.where(nz, -cc * A * logp, 0.0)
            direct = np.where(nz, -cc * A, 0.0)
            dptl_dw = np.zeros((B, T))
            low, high = np.zeros((B, T), bool), coef > epsilon_high
            margin_of(coef, epsilon_high, m & (A > 0))
        else:  # sapo
            tau = np.where(A > 0, sapo_temperature_pos, sapo_temperature_neg)
            x = tau * (coef - 1.0)
            sig = 1.0 / (1.0 + np.exp(-x))
            ptl = np.where(nz, -A * sig * 4.0 / tau, 0.0)
            # d/dw [sigmoid(tau (e^w - 1))] * 4 / tau = 4 sig (1 - sig) e^w; exp(-|x|)-form avoids 0 * inf.
            ex = np.exp(-np.abs(x))
            dsig = ex / (1.0 + ex) ** 2
            dptl_dw = np.where(nz, -A * 4.0 * dsig * coef, 0.0)
            low = high = np.zeros((B, T), bool)
        if rollout_is_ratio is not None:
            ris = _broadcast_rollout(rollout_is_ratio, B, T)
            ptl, direct, dptl_dw = ptl * ris, direct * ris, dptl_dw * ris
        if rollout_logps is not None:
            ptl, direct, dptl_dw = ptl * u_roll, direct * u_roll, dptl_dw * u_roll
        if token_select is not None:  # unselected tokens: no policy term (TRL's entropy mask)
            sel = np.asarray(token_select, bool).astype(f64)
            ptl, direct, dptl_dw = ptl * sel, direct * sel, dptl_dw * sel
        if use_bias_correction_kl:
            ew = np.exp(w)  # unclipped, before delta
            klc = kl * ew
            direct = direct + beta * dkl_dlogp * ew
            dptl_dw = dptl_dw + beta * kl * ew
        else:
            klc = kl
            direct = direct + beta * dkl_dlogp
        ptl = ptl + beta * klc
        # Reduction weights c[b, t] (SPEC "Reductions", sizes of the whole call).
        if loss_type in ("grpo", "sapo"):
            den = float(B)
            cnum = mf / Lc[:, None]
        elif loss_type == "bnpo":
            den = Ntot_c
            cnum = mf
        elif loss_type == "dr_grpo":
            if max_completion_length is None:
                raise ValueError("dr_grpo needs max_completion_length")
            den = float(B * max_completion_length)
            cnum = mf
        else:  # dapo, cispo
            N = Ntot if num_items_in_batch is None else float(num_items_in_batch)
            den = max(N, 1.0)
            cnum = mf
        c = cnum / den
        loss = float(np.sum(np.where(m, c * ptl, 0.0)))
        scale = float(np.sum(np.where(m, c * np.abs(ptl), 0.0)))
        G = np.where(m, c * dptl_dw, 0.0)
        if importance_sampling_level == "token":
            dlogp = G
        else:  # w[b] = sum_t m r / max(L, 1): d w / d logp[b, t] = m / max(L, 1)
            dlogp = (mf / Lc[:, None]) * G.sum(axis=1, keepdims=True)
        dlogp = dlogp + np.where(m, c * direct, 0.0)
        cl = m & low & (A < 0)
        ch = m & high & (A > 0)
        kl_metric = (mf * klc).sum() / Ntot_c
        kl_raw = (mf * kl).sum() / Ntot_c

    metrics = {
        "kl": float(kl_metric) if beta != 0.0 else 0.0,
        "kl_uncorrected": float(kl_raw) if beta != 0.0 else 0.0,
        "clip_fraction": float((cl | ch).sum() / Ntot_c),
        "clip_fraction_low": float(cl.sum() / Ntot_c),
        "clip_fraction_high": float(ch.sum() / Ntot_c),
        "loss_numerator": float(loss * den),
        "loss_denominator": float(den),
        "log_ratio_min": float(r[m].min()) if Ntot > 0 else 0.0,
        "log_ratio_max": float(r[m].max()) if Ntot > 0 else 0.0,
    }
    return SpecLoss(
        loss=float(loss),
        metrics=metrics,
        dlogp=np.where(m, dlogp, 0.0),
        logp=logp,
        scale=float(scale),
        margin=float(min(margins)),
    )


def _runs(segment_ids):
    """``(row, start, stop)`` of every maximal run of equal positive ids, row-major."""
    runs = []
    for b, row in enumerate(np.asarray(segment_ids)):
        t = 0
        while t < len(row):
            u = t
            while u < len(row) and row[u] == row[t]:
                u += 1
            if row[t] > 0:
                runs.append((b, t, u))
            t = u
    return runs


def spec_loss_from_logp_packed(logp, mask, segment_ids, advantages, **kwargs) -> SpecLoss:
    """:func:`spec_loss_from_logp` of a packed batch: its sequences unpacked one per row (padded to the
    longest), the padded formulas, ``d loss / d logp`` scattered back. ``advantages``: ``[B]`` or ``[B, T]``;
    ``old_logps`` / ``ref_logps`` / ``rollout_is_ratio`` ``[B, T]`` (the ratio may be ``[B]`` / ``[B, 1]``)."""
    logp = np.asarray(logp, f64)
    B, T = logp.shape
    runs = _runs(segment_ids)
    S, L = max(len(runs), 1), max([u - t for _, t, u in runs] + [1])
    m = _mask_bool(mask, (B, T)) & (np.asarray(segment_ids) > 0)
    adv = np.asarray(advantages, f64)
    per_token = {"advantages": np.broadcast_to(adv[:, None], (B, T)) if adv.ndim == 1 else adv}
    for name in ("old_logps", "ref_logps", "rollout_is_ratio", "rollout_logps", "token_select"):
        if kwargs.get(name) is not None:
            x = np.asarray(kwargs.pop(name), f64)
            per_token[name] = np.broadcast_to(x.reshape(B, -1), (B, T))

    def unpack(x, fill=0.0):
        out = np.full((S, L), fill, dtype=x.dtype)
        for i, (b, t, u) in enumerate(runs):
            out[i, : u - t] = x[b, t:u]
        return out

    padded = {k: unpack(v) for k, v in per_token.items()}
    res = spec_loss_from_logp(unpack(logp), unpack(m, False), padded.pop("advantages"), **padded, **kwargs)
    dlogp = np.zeros((B, T))
    for i, (b, t, u) in enumerate(runs):
        dlogp[b, t:u] = res.dlogp[i, : u - t]
    # no sequence at all: one empty padded row, so the count normalisers are 1 (the library's max(count, 1))
    return dataclasses.replace(res, dlogp=np.where(m, dlogp, 0.0), logp=np.where(m, logp, 0.0))


def spec_policy_loss(
    hidden,
    weight,
    ids,
    mask,
    advantages,
    *,
    loss_type: str,
    bias=None,
    temperature: float = 1.0,
    weight_layout: str = "hv",
    logp_for_loss=None,
    segment_ids=None,
    top_entropy_quantile: float = 1.0,
    softcap: float | None = None,
    entropy_coef: float | None = None,
    **loss_kwargs: Any,
) -> SpecResult:
    """SPEC loss from hidden states and LM head, with analytic float64 gradients.

    ``loss_kwargs`` are those of :func:`spec_loss_from_logp` (epsilon_low, epsilon_high, beta,
    importance_sampling_level, delta, use_bias_correction_kl, max_completion_length,
    sapo_temperature_pos, sapo_temperature_neg, old_logps, ref_logps, rollout_is_ratio,
    num_items_in_batch).  ``logp_for_loss`` (optional, [B, T]) evaluates the loss at these log-probs
    instead of the float64 ones (e.g. an implementation's own float32 log-probs, so that a ratio built
    to sit exactly on a clip bound is judged on the same side as the implementation sees it); the
    LM-head backward still uses float64 softmax. ``segment_ids``: a packed batch
    (:func:`spec_loss_from_logp_packed`). ``top_entropy_quantile < 1``: only the tokens whose entropy is at
    or above ``np.quantile(entropy[mask], 1 - q)`` get policy gradient (``metrics["entropy_threshold"]``;
    the margin includes the closest entropy's distance to it).
    """
    ids = np.asarray(ids)
    m = _mask_bool(mask, ids.shape)
    if segment_ids is not None:
        m = m & (np.asarray(segment_ids) > 0)
    head = dict(bias=bias, temperature=temperature, weight_layout=weight_layout, softcap=softcap)
    logp = spec_logprobs(hidden, weight, ids, m, **head)
    bad = np.isnan(logp).any()
    lp = logp if logp_for_loss is None else np.where(m, np.asarray(logp_for_loss, f64), 0.0)
    lp_safe = np.where(np.isnan(lp), 0.0, lp)
    threshold, ent_margin = 0.0, np.inf
    if top_entropy_quantile != 1.0:
        ent = spec_entropy(hidden, weight, m, **head)
        threshold = float(np.quantile(ent[m], 1.0 - top_entropy_quantile))
        loss_kwargs = dict(loss_kwargs, token_select=m & (ent >= threshold))
        ent_margin = float(np.min(np.abs(ent[m] - threshold)))
    if segment_ids is None:
        sl = spec_loss_from_logp(lp_safe, m, advantages, loss_type=loss_type, **loss_kwargs)
    else:
        sl = spec_loss_from_logp_packed(lp_safe, m, segment_ids, advantages, loss_type=loss_type, **loss_kwargs)
    sl.metrics["entropy_threshold"] = threshold
    dentropy = None
    if entropy_coef is not None:  # SPEC.md "Entropy term": -c sum w H / denominator, w the KL's aggregation
        if segment_ids is not None:
            raise NotImplementedError("the oracle's entropy term is for padded batches")
        ent = spec_entropy(hidden, weight, m, **head)
        mf = m.astype(f64)
        w = mf / np.maximum(mf.sum(axis=1, keepdims=True), 1.0) if loss_type in ("grpo", "sapo", "gmpo") else mf
        den = sl.metrics["loss_denominator"]
        dentropy = -entropy_coef * w / den
        term = float(np.sum(dentropy * ent))
        sl.loss += term
        sl.metrics["loss_numerator"] += term * den
        sl.scale += abs(term)
    dh, dw, db = spec_head_vjp(hidden, weight, ids, m, sl.dlogp, dentropy=dentropy, **head)
    loss = np.nan if bad else sl.loss
    return SpecResult(
        loss=loss,
        metrics=sl.metrics,
        dlogp=sl.dlogp,
        logp=lp,
        scale=sl.scale,
        margin=min(sl.margin, ent_margin),
        dhidden=dh,
        dweight=dw,
        dbias=db,
    )
