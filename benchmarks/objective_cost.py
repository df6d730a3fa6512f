"""The cost of the objective step alone: the XLA work between the log-prob kernel and the gradient kernel.

    PYTHONPATH=. python3 -m benchmarks.objective_cost                      # the realistic configurations
    PYTHONPATH=. python3 -m benchmarks.objective_cost --B 8 --T 2048 --objective grpo

The fused LM-head loss computes the per-token log-probs in a kernel, then the objective in XLA: GMPO's
per-sequence sums of clipped log ratios and token counts (or the GRPO family's per-token surrogate), the loss and
``d loss / d logp`` (``gmpo_jax.objectives.evaluate`` with its gradient, then ``loss_and_aux``). Issue 17 item 4
asks whether that step belongs in the log-prob kernel's epilogue; its time here is the most such a move could
save. Times are pipelined device times (``benchmarks.jax_impls.time_pipelined``) of the step on the workload's
``[B, T]`` log-probs, mask, advantages and old log-probs (``benchmarks/workloads.py``).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks import jax_impls, workloads
from benchmarks.run import DEFAULT_OPTS, REALISTIC_CONFIGS


def objective_step(objective):
    """``(loss, d loss / d logp)`` of ``objective`` on ``[B, T]`` log-probs: the fused loss's XLA step."""
    from gmpo_jax.objectives import PolicyInputs, evaluate, loss_and_aux

    def step(logp, mask, adv, old):
        inputs = PolicyInputs(mask=mask, advantages=adv, old_logps=old)
        denominator = objective.denominator(inputs.mask, inputs.num_items, inputs.segment_ids).astype(jnp.float32)
        num, sums, dlogp = evaluate(objective, logp, inputs, denominator, with_grads=True)
        loss, _ = loss_and_aux(num, denominator, sums, inputs.mask)
        return loss, dlogp

    return jax.jit(step)


def main(argv=None) -> None:
    import gmpo_jax

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--B", type=int)
    p.add_argument("--T", type=int)
    p.add_argument("--objective", default="gmpo", choices=("gmpo", "grpo"))
    p.add_argument("--data", default=DEFAULT_OPTS["data"])
    args = p.parse_args(argv)
    shapes = [(args.B, args.T)] if args.B else sorted({(B, T) for _, B, T in REALISTIC_CONFIGS})
    objective = gmpo_jax.GMPO() if args.objective == "gmpo" else gmpo_jax.GRPO()
    step = objective_step(objective)
    for B, T in shapes:
        # the workload's masks, advantages and old log-probs; log-probs = old ones + noise (H, V do not matter)
        wl = workloads.Workload(data=args.data, seed=0, ratio_noise=DEFAULT_OPTS["ratio_noise"])
        batch = workloads.make_lm_head_batch(B, T, 64, 1024, wl)
        logp = batch.old_logps + 0.1 * jax.random.normal(jax.random.key(1), (B, T))
        call = (logp, batch.mask, batch.advantages, batch.old_logps)
        jax.block_until_ready(step(*call))
        t = jax_impls.time_pipelined(step, call, per_call_ms=0.0, max_ms=1.0)
        print(f"{args.objective} {args.data} {B}x{T}: objective step {t['pipelined_ms'] * 1e3:.1f} us (pipelined)")


if __name__ == "__main__":
    main()
