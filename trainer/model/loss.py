"""The training loss: the output projection fused with cross-entropy, in chunks of rows.

`linear_cross_entropy(hidden, weight, targets)` equals `cross_entropy(hidden @ weight.T, targets)`
(`trainer.model.transformer.cross_entropy`, mask semantics included) without ever holding the (tokens x vocab)
logits or their gradient: each chunk of rows is projected, turned into its loss and its gradient
(softmax minus one-hot), and multiplied into the gradients of `hidden` and `weight` while it is
still in cache; the next chunk reuses the buffer. This is the approach of Liger-Kernel's fused
linear cross-entropy, in plain PyTorch.

Why: the logits are the largest activation of a small-model step (2,048 tokens x 4,096 vocab =
32 MiB, and as much again for their gradient; 8,192 x 32,000 in float32 = 1 GiB each for the 1B
config). On CPU each chunk's logits are turned into loss and gradient while they are still in
cache instead of going out to memory and back, which makes the output layer faster; on a GPU it is
the memory that is saved (measured: docs/performance.md, `scripts/bench.py`).

The gradients are computed in the forward pass (they need the softmax, which is only complete
there) and kept for backward, which scales them by the incoming gradient. Without autograd
(`torch.no_grad()`, evaluation) only the loss is computed.
"""

from __future__ import annotations

import torch

CPU_CHUNK_BYTES = 8 << 20  # float32 logits per chunk on CPU: a few MiB stay in L2/L3 cache
GPU_CHUNK_BYTES = 512 << 20  # on a GPU chunks only bound memory; fewer, larger ones launch fewer kernels


def chunk_rows(vocab_size: int, device: torch.device) -> int:
    """Rows per chunk: the float32 logits of a chunk fill about CPU_/GPU_CHUNK_BYTES (at least 64 rows)."""
    budget = CPU_CHUNK_BYTES if device.type == "cpu" else GPU_CHUNK_BYTES
    return max(64, budget // (4 * vocab_size) // 64 * 64)


@torch.compiler.disable  # eager by design: compiling would unroll the chunk loop into one large graph
def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         mask: torch.Tensor | None = None, rows: int | None = None) -> torch.Tensor:
    """Mean next-token loss of logits `hidden @ weight.T`, never materialising them in full.

    hidden: (..., dim); weight: (vocab, dim); targets: (...) int64 in [0, vocab); mask: optional bool
    like targets (False = no loss on that target; the mean still divides by all targets, as
    `trainer.model.transformer.cross_entropy` does). Under autocast the projection runs in the autocast dtype
    and the softmax in float32, as `output(h).float()` would; the loss is float32."""
    if targets.shape != hidden.shape[:-1] or (mask is not None and mask.shape != targets.shape):
        raise ValueError(f"targets {tuple(targets.shape)} / mask must match hidden {tuple(hidden.shape[:-1])}")
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    rows = rows or chunk_rows(weight.shape[0], hidden.device)
    keep = None if mask is None else mask.reshape(-1)
    with torch.autocast(device, enabled=False):
        h, w = hidden.reshape(-1, hidden.shape[-1]).to(dtype), weight.to(dtype)
        if not torch.is_grad_enabled() or not (h.requires_grad or w.requires_grad):
            return _chunked(h, w, targets.reshape(-1), keep, rows, grads=False)[0] / h.shape[0]
        return _LinearCrossEntropy.apply(h, w, targets.reshape(-1), keep, rows)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, keep, rows):  # noqa: ANN001, ANN205 - autograd signature
        loss, grad_hidden, grad_weight = _chunked(hidden, weight, targets, keep, rows, grads=True)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype, ctx.n = weight.dtype, hidden.shape[0]
        return loss / ctx.n

    @staticmethod
    def backward(ctx, grad_loss):  # noqa: ANN001, ANN205
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_loss / ctx.n
        return (grad_hidden * scale.to(grad_hidden.dtype), (grad_weight * scale).to(ctx.weight_dtype),
                None, None, None)


@torch.no_grad()
def _chunked(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, keep: torch.Tensor | None,
             rows: int, grads: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(summed loss, d(sum)/d hidden, d(sum)/d weight in float32) over chunks of `rows` rows."""
    n, vocab = hidden.shape[0], weight.shape[0]
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if grads else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if grads else None
    buffer = torch.empty(min(rows, n), vocab, dtype=torch.float32, device=hidden.device)
    index = torch.arange(min(rows, n), device=hidden.device)
    for start in range(0, n, rows):
        h, t = hidden[start:start + rows], targets[start:start + rows]
        k, i = len(h), index[:len(h)]
        if hidden.dtype == torch.float32:
            logits = torch.mm(h, weight.t(), out=buffer[:k])
        else:
            logits = buffer[:k].copy_(h @ weight.t())
        if logits.device.type == "cpu":
            grad, row_loss = _softmax_and_loss(logits, h, weight, t, i)
        else:  # no host sync per chunk on a GPU (the underflow check), where the extra pass is cheap
            # one fused kernel instead of logsumexp + sub: fewer passes over the chunk (docs/performance.md,
            # "Design choices": the fused output projection + cross-entropy)
            log_probs = torch.log_softmax(logits, dim=-1)
            row_loss = -log_probs[i, t]
            grad = log_probs.exp_() if grads else None  # softmax, in place
        if keep is not None:
            row_loss = row_loss.where(keep[start:start + rows], 0.0)
        loss += row_loss.sum()
        if not grads:
            continue
        grad[i, t] -= 1.0
        if keep is not None:
            grad.mul_(keep[start:start + rows, None])
        g = grad.to(hidden.dtype)
        torch.mm(g, weight, out=grad_hidden[start:start + k])
        if g.dtype == torch.float32:
            grad_weight.addmm_(g.t(), h)
        else:
            grad_weight += (g.t() @ h).float()
    return loss, grad_hidden, grad_weight


def _softmax_and_loss(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                      index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax of `logits`, computed in place, and each row's loss -log p[target]).

    One pass over the logits fewer than log_softmax followed by exp, which counts because this part of
    the CPU step is memory-bound (docs/performance.md, "Design choices": the fused output projection +
    cross-entropy). A target probability under 1e-30 (a
    loss above 69 nats; float32 loses precision further down and underflows to 0) has its row's loss
    recomputed from the log-sum-exp of freshly projected logits (exact to float32 rounding): rare,
    and only those rows."""
    target_logits = logits[index, targets]
    # out= the input: ATen's row-wise soft-max reads each row before writing it; the loss tests
    # compare loss and gradients with the plain cross_entropy, so a kernel that did not would fail them
    probs = torch.softmax(logits, dim=-1, out=logits)
    target_probs = probs[index, targets]
    row_loss = -target_probs.log()
    tiny = (target_probs < 1e-30).nonzero().squeeze(1)
    if len(tiny):
        exact = torch.logsumexp((hidden[tiny] @ weight.t()).float(), dim=-1) - target_logits[tiny]
        row_loss[tiny] = exact
    return probs, row_loss
