"""Local training and evaluation loops shared by the algorithms' client and server halves.

Why shared: every algorithm trains "some parameters of some model on local data with SGD"; what
differs is which parameters, which penalty and what happens after each step. Those differences enter
through the arguments, so the loop (seeded shuffling, batching, the optimizer) exists once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

import numpy as np
import torch
from torch import nn

from shared.config import TrainConfig

#: training is single-threaded per process: several client processes share the cores, and a fixed
#: thread count keeps float results identical whichever process trains a device.
torch.set_num_threads(1)


def local_sgd(
    model: nn.Module,
    x: np.ndarray | torch.Tensor,
    y: np.ndarray | torch.Tensor,
    train: TrainConfig,
    seed: int,
    *,
    params: Iterable[nn.Parameter] | None = None,
    penalty: Callable[[nn.Module], torch.Tensor] | None = None,
    after_step: Callable[[nn.Module], None] | None = None,
    epochs: int | None = None,
    steps: int | None = None,
    masks: Mapping[str, torch.Tensor] | None = None,
    lr: Callable[[int], float] | None = None,
) -> dict[str, float]:
    """The one local training loop: SGD over the local data with every ``train.*`` option honoured
    (learning rate, momentum, weight decay, gradient clipping, ``drop_last``, ``local_steps``).

    What differs between algorithms enters through the arguments:

    * ``params`` — which parameters train (default: every one that requires a gradient);
    * ``penalty(model)`` — added to the loss (SpaFL's threshold term, FedMef's extrusion); the
      reported loss is the task loss alone;
    * ``after_step(model)`` — runs after each step (clamps, collapse guards);
    * ``masks`` — parameter name → 0/1 tensor: the gradient is multiplied by it before the step, so a
      pruned position (held at 0) never moves (dynamic pruning's θ ← θ − μ (g ⊙ m));
    * ``lr(step)`` — a per-step learning rate (FedMef's extrusion schedule) instead of ``train.lr``;
    * ``x`` may be a tensor of cached features (EmbracingFL trains the suffix on the cached output
      of the frozen prefix).

    The length is ``epochs`` passes when given, else ``steps`` steps, else ``train.local_steps``
    steps when set (passes over reshuffled data until that many steps are done), else
    ``train.local_epochs`` passes. Returns the mean training loss and the number of steps (and, with
    a schedule, the largest and mean rate used).
    """
    model.train()
    named = dict(model.named_parameters())
    trainable = list(params) if params is not None else [p for p in named.values() if p.requires_grad]
    masked = [(named[name], m) for name, m in (masks or {}).items()]
    opt = torch.optim.SGD(trainable, lr=train.lr, momentum=train.momentum, weight_decay=train.weight_decay)
    rng = np.random.default_rng(seed)
    xt = x if isinstance(x, torch.Tensor) else as_tensor(x, np.float32)
    yt = y if isinstance(y, torch.Tensor) else as_tensor(y, np.int64)
    losses: list[float] = []
    rates: list[float] = []
    loss_fn = nn.CrossEntropyLoss()
    if epochs is None and steps is None:
        steps = train.local_steps
    passes = epochs if epochs is not None else train.local_epochs
    for step, idx in enumerate(
        _minibatches(rng, len(yt), train, passes, None if epochs is not None else steps)
    ):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(xt[idx]), yt[idx])
        total = loss + penalty(model) if penalty is not None else loss
        total.backward()
        for p, m in masked:
            if p.grad is not None:
                p.grad.mul_(m)
        if train.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(trainable, train.clip_grad_norm)
        if lr is not None:
            rate = lr(step)
            for group in opt.param_groups:
                group["lr"] = rate
            rates.append(rate)
        opt.step()
        if after_step is not None:
            after_step(model)
        losses.append(float(loss.detach()))
    out = {"train_loss": float(np.mean(losses)) if losses else 0.0, "steps": float(len(losses))}
    if lr is not None:
        out.update(lr_max=max(rates, default=0.0), lr_mean=float(np.mean(rates)) if rates else 0.0)
    return out


def _minibatches(
    rng: np.random.Generator, n: int, train: TrainConfig, passes: int, steps: int | None
) -> Iterator[torch.Tensor]:
    """The minibatch index tensors of one task: ``passes`` reshuffled passes, or with ``steps`` set,
    passes until exactly that many batches (a short last batch dropped when ``train.drop_last``)."""
    b = train.batch_size
    stop = n - n % b if train.drop_last and n > b else n
    if steps is None:
        for _ in range(passes):
            order = torch.from_numpy(rng.permutation(n))
            for start in range(0, stop, b):
                yield order[start : start + b]
        return
    done = 0
    while stop > 0:
        order = torch.from_numpy(rng.permutation(n))
        for start in range(0, stop, b):
            if done == steps:
                return
            yield order[start : start + b]
            done += 1


def samples_per_task(train: TrainConfig, num_samples: int) -> int:
    """How many samples one task's training processes (forward + backward) on ``num_samples``.

    ``local_epochs × num_samples``, as every FLOPs count assumed before ``local_steps`` existed (a
    dropped last batch is not subtracted); with ``local_steps`` the exact sum of the τ batches'
    sizes, the same batches :func:`local_sgd` runs.
    """
    if train.local_steps is None:
        return num_samples * train.local_epochs
    b = train.batch_size
    stop = num_samples - num_samples % b if train.drop_last and num_samples > b else num_samples
    if stop <= 0:
        return 0
    batches = [min(b, stop - start) for start in range(0, stop, b)]
    full, rest = divmod(train.local_steps, len(batches))
    return full * stop + sum(batches[:rest])


def as_tensor(a: np.ndarray, dtype: type[np.generic]) -> torch.Tensor:
    """``a`` as a tensor sharing its memory, copied only when ``a`` is read-only (a slice of the
    memory-mapped dataset: torch would warn that it cannot guard such memory from writes)."""
    arr = np.ascontiguousarray(a, dtype=dtype)
    return torch.from_numpy(arr if arr.flags.writeable else arr.copy())


@torch.no_grad()
def evaluate(model: nn.Module, x: np.ndarray, y: np.ndarray, batch_size: int = 1024) -> dict[str, float]:
    """Accuracy and mean cross-entropy on (x, y)."""
    model.eval()
    if len(y) == 0:
        return {"accuracy": 0.0, "loss": 0.0}
    correct = 0
    loss_sum = 0.0
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    for start in range(0, len(y), batch_size):
        xb = as_tensor(x[start : start + batch_size], np.float32)
        yb = as_tensor(y[start : start + batch_size], np.int64)
        out = model(xb)
        loss_sum += float(loss_fn(out, yb))
        correct += int((out.argmax(1) == yb).sum())
    return {"accuracy": correct / len(y), "loss": loss_sum / len(y)}
