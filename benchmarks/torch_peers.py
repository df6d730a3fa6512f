"""PyTorch peers, measured beside ours when torch with CUDA and the peer package are importable.

* ``cce_gmpo``: GMPO (SPEC.md) written on Apple Cut-Cross-Entropy's per-token losses:
  ``-logp = cut_cross_entropy.linear_cross_entropy(e [N, H], c [V, H], ids, reduction="none")``, then the
  GMPO loss in torch, gradients by autograd. Default variant: CCE's default gradient filter
  (``filter_eps="high"``: vocabulary blocks whose softmax is below bf16 eps/32 are skipped in the backward);
  variant ``filter_eps=None``: no filtering (exact gradients, the same work as ours).
* ``liger_grpo``: Liger-Kernel's ``LigerFusedLinearGRPOLoss`` (chunked, ``chunk_size=1`` sequence per chunk
  by default, ``loss_type="grpo"``, ``beta=0``; Liger 0.8.5 has no GMPO and the loss arithmetic is
  negligible next to the LM head). Weight layout [V, H]. Its forward already computes the gradients, so
  only ``fwd+bwd`` is meaningful.
* ``liger_triton`` (logits path): Liger's ``triton_grpo_loss(logits [B, T+1, V], ...)``, ``loss_type="grpo"``,
  ``reduce=True``. Default ``inplace=False`` (dlogits in a fresh buffer, like ours); variant ``inplace``
  writes dlogits over the logits (then the logits hold gradients after the first call: same bytes moved).

LM head: the same batch as the JAX worker (``benchmarks.workloads``, ``--data peaked|flat|peaked-live``),
read from the ``.npz`` the JAX worker of the same configuration saved (else made by a
``python -m benchmarks.workloads --save`` subprocess: JAX and torch never share a CUDA process). Masked
positions get ``ignore_index=-100`` (CCE skips them, as we do). With ``grad_acc``, the relative L2 error
of the hidden and weight gradients against a float32 torch dense oracle (full float32 logits, no TF32)
on the same bf16 inputs is recorded, on the first ``oracle_T`` positions when the logits would not fit.
Logits path: flat data only (torch's generator, N(0, logits_std^2) logits).
Timing: CUDA events around each call, median of >= 10 after warm-up. Peak: ``torch.cuda.
max_memory_allocated()`` after ``reset_peak_memory_stats()`` per mode (inputs included), so every mode's
peak is exact.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from benchmarks import _common
from benchmarks.shapes import Config

PEERS = {"cce_gmpo": "cut_cross_entropy", "liger_grpo": "liger_kernel", "liger_triton": "liger_kernel"}
PEER_DIST = {"cut_cross_entropy": "cut-cross-entropy", "liger_kernel": "liger-kernel"}


def _versions(module: str) -> dict[str, Any]:
    return {
        "torch": _common.pkg_version("torch"),
        "triton": _common.pkg_version("triton"),
        "peer_version": _common.pkg_version(PEER_DIST[module]),
    }


def gmpo_from_logp(logp, mask, adv, old, eps_low: float = 0.4, eps_high: float = 0.4):
    """GMPO of SPEC.md in torch: log-space clip by advantage sign, masked mean, geometric mean."""
    import torch

    B = logp.shape[0]
    r = logp - old
    c = torch.where(adv[:, None] > 0, torch.clamp(r, max=eps_high), torch.clamp(r, min=-eps_low))
    m = mask.to(torch.float32)
    cnt = m.sum(-1)
    s = (m * c).sum(-1) / cnt.clamp(min=1.0)
    return torch.where(cnt > 0, -adv * torch.exp(s), torch.zeros_like(s)).sum() / B


def _mask(torch, B: int, T: int, kind: str, gen, device):
    if kind == "full":
        return torch.ones(B, T, dtype=torch.int64, device=device)
    lengths = T - torch.randint(0, T // 4 + 1, (B,), generator=gen, device=device)
    return (torch.arange(T, device=device)[None, :] < lengths[:, None]).to(torch.int64)


GRAD_ORACLE_BYTES = 12 * 2**30
IGNORE_INDEX = -100


def oracle_T(cfg: Config, budget: int | None = None) -> int:
    """As ``benchmarks.jax_impls.oracle_T`` (kept framework-free here)."""
    budget = GRAD_ORACLE_BYTES if budget is None else budget
    if cfg.B * cfg.T * cfg.V * 4 <= budget:
        return cfg.T
    return max(128, (budget // (cfg.B * cfg.V * 4)) // 128 * 128)


def _batch_file(cfg: Config, data: str, seed: int) -> str:
    """The workload's .npz: saved by the JAX worker, else generated now in a JAX subprocess."""
    import subprocess
    import sys

    path = _common.cache_path(cfg.B, cfg.T, cfg.H, cfg.V, data, seed)
    if not os.path.exists(path):
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.workloads",
            "--B",
            str(cfg.B),
            "--T",
            str(cfg.T),
            "--H",
            str(cfg.H),
            "--V",
            str(cfg.V),
            "--data",
            data,
            "--seed",
            str(seed),
            "--save",
            path,
        ]
        subprocess.run(cmd, check=True, cwd=_common.REPO_ROOT, capture_output=True, text=True, timeout=300)
    return path


def _lm_head_inputs(torch, cfg: Config, opts: dict[str, Any], device):
    """(hidden [B, T, H] bf16, weight [V, H] bf16, ids (masked: -100), mask, adv, old) on the GPU."""
    import numpy as np

    if opts["mask"] != "full":
        raise NotImplementedError("the legacy --mask ragged is for the JAX workers; --data peaked has ragged masks")
    with np.load(_batch_file(cfg, opts["data"], opts["seed"])) as f:
        a = {k: f[k] for k in f.files}
    bf16 = lambda x: torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).to(device)  # noqa: E731
    hidden = bf16(a["hidden"])
    weight = bf16(np.ascontiguousarray(a["weight"].T))  # [V, H]
    mask = torch.from_numpy(a["mask"].astype(np.int64)).to(device)
    ids = torch.from_numpy(a["ids"].astype(np.int64)).to(device)
    ids = torch.where(mask.bool(), ids, torch.full_like(ids, IGNORE_INDEX))
    adv = torch.from_numpy(a["advantages"].astype(np.float32)).to(device)
    old = torch.from_numpy(a["old_logps"].astype(np.float32)).to(device)
    return hidden, weight, ids, mask, adv, old


def _dense_logp(torch, h, w, ids):
    """float32 log-probs of ids (ignored positions: 0) through full float32 logits."""
    z = h.float().reshape(-1, h.shape[-1]) @ w.float().T
    lp = torch.log_softmax(z, dim=-1)
    i = ids.reshape(-1)
    out = lp.gather(1, i.clamp(min=0)[:, None])[:, 0]
    return torch.where(i >= 0, out, torch.zeros_like(out)).reshape(ids.shape)


def _grad_accuracy(torch, cfg: Config, args, filter_eps) -> dict[str, Any]:
    """CCE's gradients vs the float32 dense oracle, on the first oracle_T positions."""
    from cut_cross_entropy import linear_cross_entropy

    T2 = oracle_T(cfg)
    hidden, weight, ids, mask, adv, old = args
    h = hidden[:, :T2].detach().contiguous().requires_grad_(True)
    w = weight.detach().requires_grad_(True)
    ids2, mask2, old2 = ids[:, :T2].contiguous(), mask[:, :T2], old[:, :T2]
    B = h.shape[0]
    kw = {} if filter_eps == "default" else {"filter_eps": filter_eps}
    nll = linear_cross_entropy(
        h.reshape(B * T2, -1), w, ids2.reshape(-1), reduction="none", ignore_index=IGNORE_INDEX, **kw
    )
    got = torch.autograd.grad(gmpo_from_logp(-nll.float().reshape(B, T2), mask2, adv, old2), (h, w))
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        hf = h.detach().float().requires_grad_(True)  # float32 leaves: float32 gradients
        wf = w.detach().float().requires_grad_(True)
        ref = torch.autograd.grad(gmpo_from_logp(_dense_logp(torch, hf, wf, ids2), mask2, adv, old2), (hf, wf))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev

    def rel(g, r):
        return round(float(torch.linalg.vector_norm(g.float() - r.float()) / torch.linalg.vector_norm(r.float())), 6)

    out = {
        "grad_acc_N": B * T2,
        "grad_oracle": "torch float32 dense (full logits, no TF32)",
        "grad_rel_err_hidden": rel(got[0], ref[0]),
        "grad_rel_err_weight": rel(got[1], ref[1]),
    }
    if T2 != cfg.T:
        out["grad_acc_note"] = f"oracle on the first {T2} of {cfg.T} positions of each sequence (memory)"
    return out


def _logits_inputs(torch, cfg: Config, opts: dict[str, Any], device):
    B, T, V = cfg.B, cfg.T, cfg.V
    gen = torch.Generator(device=device).manual_seed(opts["seed"])
    logits = torch.randn(B, T + 1, V, dtype=torch.bfloat16, device=device, generator=gen)
    logits.mul_(opts["logits_std"])
    ids = torch.randint(0, V, (B, T), device=device, generator=gen)
    adv = torch.randn(B, dtype=torch.float32, device=device, generator=gen)
    mask = _mask(torch, B, T, opts["mask"], gen, device).to(torch.int32).contiguous()
    with torch.no_grad():
        old = torch.empty(B, T, dtype=torch.float32, device=device)
        for b in range(B):
            for s in range(0, T, 64):
                z = logits[b, s : min(s + 64, T)].float()
                old[b, s : s + z.shape[0]] = z.gather(1, ids[b, s : s + z.shape[0], None])[:, 0] - torch.logsumexp(
                    z, -1
                )
        old += opts["ratio_noise"] * torch.randn(B, T, device=device, generator=gen)
    return logits, ids, mask, adv, old


def _steps(torch, impl: str, cfg: Config, args, opts) -> list[tuple[str, str | None, Callable]]:
    """(mode, variant, step) triples; each step returns (loss, grads...) or loss."""
    out: list[tuple[str, str | None, Callable]] = []
    if impl == "cce_gmpo":
        from cut_cross_entropy import linear_cross_entropy

        hidden, weight, ids, mask, adv, old = args
        B, T, H = hidden.shape
        h_leaf = hidden.requires_grad_(True)
        w_leaf = weight.requires_grad_(True)

        def make(filter_kw: dict[str, Any], grad: bool):
            def step():
                nll = linear_cross_entropy(
                    h_leaf.reshape(B * T, H),
                    w_leaf,
                    ids.reshape(-1),
                    reduction="none",
                    ignore_index=IGNORE_INDEX,
                    **filter_kw,
                )
                loss = gmpo_from_logp(-nll.float().reshape(B, T), mask, adv, old)
                return (loss, *torch.autograd.grad(loss, (h_leaf, w_leaf)))

            def no_grad_step():  # detached inputs: CCE then skips its backward-only work (logit averages)
                with torch.no_grad():
                    nll = linear_cross_entropy(
                        hidden.detach().reshape(B * T, H),
                        weight.detach(),
                        ids.reshape(-1),
                        reduction="none",
                        ignore_index=IGNORE_INDEX,
                        **filter_kw,
                    )
                    return gmpo_from_logp(-nll.float().reshape(B, T), mask, adv, old)

            return step if grad else no_grad_step

        # the default variant passes no filter_eps (CCE's own default, "high" in 25.1.1: skip backward
        # blocks whose softmax is below a bf16-derived threshold); "filter_eps=None" computes every block
        for mode in opts["modes"]:
            out.append((mode, None, make({}, mode == "fwd+bwd")))
            if mode == "fwd+bwd" and opts.get("cce_no_filter", True):
                out.append((mode, "filter_eps=None", make({"filter_eps": None}, True)))
    elif impl == "liger_grpo":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        hidden, weight, ids, mask, adv, old = args
        h_leaf = hidden.requires_grad_(True)
        w_leaf = weight.requires_grad_(True)
        mod = LigerFusedLinearGRPOLoss(
            beta=0.0,
            use_ref_model=False,
            chunk_size=opts.get("liger_chunk_size", 1),
            loss_type="grpo",
            epsilon_low=0.2,
            epsilon_high=0.2,
            temperature=1.0,
            compiled=True,
        )

        ids = ids.clamp(min=0)  # Liger takes the mask instead of an ignore index

        def fwd_bwd():
            loss, _metrics = mod(h_leaf, w_leaf, ids, mask, adv, old_per_token_logps=old)
            return (loss, *torch.autograd.grad(loss, (h_leaf, w_leaf)))

        def fwd():
            with torch.no_grad():
                return mod(h_leaf, w_leaf, ids, mask, adv, old_per_token_logps=old)[0]

        for mode in opts["modes"]:
            out.append(
                (
                    mode,
                    None if mode == "fwd+bwd" else "forward computes gradients too",
                    fwd_bwd if mode == "fwd+bwd" else fwd,
                )
            )
    elif impl == "liger_triton":
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss

        logits, ids, mask, adv, old = args
        leaf = logits.requires_grad_(True)

        def make(grad: bool, inplace: bool):
            def call():
                loss, _metrics = triton_grpo_loss(
                    leaf,
                    old,
                    None,
                    ids,
                    adv,
                    mask,
                    temperature=1.0,
                    beta=0.0,
                    eps_low=0.2,
                    eps_high=0.2,
                    inplace=inplace,
                    loss_type="grpo",
                    reduce=True,
                )
                return loss

            if grad:

                def step():
                    loss = call()
                    return (loss, *torch.autograd.grad(loss, (leaf,)))

                return step

            def no_grad_step():
                with torch.no_grad():
                    return call()

            return no_grad_step

        for mode in opts["modes"]:
            out.append((mode, None, make(mode == "fwd+bwd", False)))
        if "fwd+bwd" in opts["modes"] and opts.get("liger_inplace", True):
            out.append(("fwd+bwd", "inplace", make(True, True)))  # last: it overwrites the logits
    else:
        raise ValueError(f"unknown peer {impl!r}")
    return out


def _time(torch, step: Callable, opts: dict[str, Any]) -> dict[str, Any]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    first = step()
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    vals = first if isinstance(first, tuple) else (first,)
    loss = vals[0].detach().float()
    checks: dict[str, Any] = {"loss": float(loss), "finite": bool(torch.isfinite(loss))}
    norms = []
    for g in vals[1:]:
        checks["finite"] &= bool(torch.isfinite(g).all())
        norms.append(round(float(torch.linalg.vector_norm(g, dtype=torch.float32)), 6))
    if norms:
        checks["grad_norms"] = norms
    del first, vals, loss
    # the peak counts the warm-up and timed calls (the same work as the first), not the checks above
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed() -> float:
        start.record()
        step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e-3

    est = compile_s
    for _ in range(max(1, opts["warmup"])):  # warm-up; the last one estimates the call time
        est = timed()
        if est > 0.5:  # slow calls: one warm-up is plenty
            break
    times = [timed() for _ in range(_common.n_iters(est, opts["iters"], opts["min_time_s"]))]
    stats = _common.timing_stats(times)
    stats.update(checks, compile_s=round(compile_s, 3), timer="cuda_event")
    return stats


def run_impl(cfg: Config, impl: str, modes: list[str], opts: dict[str, Any]) -> list[dict[str, Any]]:
    """Times one peer on one configuration, per workload in ``opts["datas"]`` (default ``[opts["data"]]``)
    and per mode / variant; one record each (``torch.cuda`` peaks are reset per step, so all are exact)."""
    records: list[dict[str, Any]] = []
    opts = dict(opts, modes=modes)
    module = PEERS.get(impl)
    datas = list(opts.get("datas") or [opts["data"]])

    def fail(status: str, error: str, data: str, mode_variants):
        for mode, variant in mode_variants:
            rec = _common.base_record(
                cfg, impl, mode, status=status, error=error, data=data, variant=variant or opts.get("variant")
            )
            _common.emit(rec)
            records.append(rec)

    try:
        import torch

        if module is None:
            raise ValueError(f"unknown peer {impl!r}")
        __import__(module)
        if not torch.cuda.is_available():
            raise RuntimeError("torch.cuda.is_available() is False")
    except Exception as exc:  # noqa: BLE001
        for data in datas:
            fail("unavailable", _common.short_error(exc), data, [(m, None) for m in modes])
        return records

    device = torch.device("cuda")
    name = torch.cuda.get_device_name()
    for data in datas:
        dopts = dict(opts, data=data)
        common = dict(
            device=_common.device_slug(name),
            device_name=name,
            seed=opts["seed"],
            mask=opts["mask"],
            data=data,
            **_versions(module),
        )
        try:
            if cfg.kind == "lm_head":
                args = _lm_head_inputs(torch, cfg, dopts, device)
                grads_bytes = args[0].nbytes + args[1].nbytes
                common.update(
                    weight_layout="vh",
                    weight_f32_gib=_common.gib(cfg.H * cfg.V * 4),
                    objective="GMPO()" if impl == "cce_gmpo" else "GRPO(loss_type='grpo')",
                )
            else:
                if data != "flat":
                    raise NotImplementedError("the torch logits peer runs on flat data only")
                args = _logits_inputs(torch, cfg, dopts, device)
                grads_bytes = args[0].nbytes
                common.update(
                    logits_std=opts["logits_std"],
                    logits_gib=_common.gib(args[0].nbytes),
                    objective="GRPO(loss_type='grpo')",
                )
            torch.cuda.synchronize()
            common["inputs_gib"] = _common.gib(sum(a.nbytes for a in args))
            steps = _steps(torch, impl, cfg, args, dopts)
        except Exception as exc:  # noqa: BLE001
            fail(_common.classify_error(exc), _common.short_error(exc), data, [(m, None) for m in modes])
            continue

        for mode, variant, step in steps:
            label = variant
            variant = ",".join(x for x in (variant, opts.get("variant")) if x) or None
            rec = _common.base_record(cfg, impl, mode, variant=variant, **common)
            rec["grads_gib"] = _common.gib(grads_bytes if mode == "fwd+bwd" else 0)
            try:
                stats = _time(torch, step, opts)
                rec.update(stats)
                rec["peak_gib"] = _common.gib(torch.cuda.max_memory_allocated())
                rec["peak_exact"] = True
                rec["status"] = "ok" if stats.get("finite", True) else "nonfinite"
                rec.update(_common.throughput(cfg, mode, stats["median_ms"]))
                if impl == "cce_gmpo" and mode == "fwd+bwd" and opts.get("grad_acc"):
                    try:
                        filter_eps = None if label == "filter_eps=None" else "default"
                        rec.update(_grad_accuracy(torch, cfg, args, filter_eps))
                    except Exception as exc:  # noqa: BLE001 - the timing stands
                        rec["grad_acc_error"] = _common.short_error(exc)
                    torch.cuda.empty_cache()
            except Exception as exc:  # noqa: BLE001
                rec.update(status=_common.classify_error(exc), error=_common.short_error(exc))
                torch.cuda.empty_cache()
            _common.emit(rec)
            records.append(rec)
        del args, steps
        torch.cuda.empty_cache()
    return records
