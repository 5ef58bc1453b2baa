"""Layer-wise splitting of a model into atomic blocks, for partial training (EmbracingFL, LG-FedAvg).

Why a separate module: EmbracingFL (docs/algorithms/embracingfl.md) trains an output-side *suffix* of blocks
and only runs the input-side *prefix* forward, chunk by chunk; LG-FedAvg keeps input-side blocks on the
device and averages the output-side ones. Both need the same three things from a model: its ordered
list of cut-safe blocks, the parameter / state names of each block, and a way to run a consecutive
range of blocks as a module of its own. Nothing here knows any algorithm.

A **block** is the smallest unit a cut may not split (spec §9 item 14):

* the model's top-level children, with nested ``nn.Sequential`` containers expanded (so ResNet's
  ``layer1`` becomes its residual blocks ``layer1.0``, ``layer1.1``, ...; a residual block is atomic,
  a cut inside it would break the skip connection);
* a new block starts at every atom that has parameters and is not a normalisation layer; a norm layer,
  activation, pooling or flatten belongs to the block of the weight layer before it (parameter-free
  atoms before the first weight layer belong to block 1).

So the MLP ``flatten, fc1, relu1, fc2, relu2, fc3`` has blocks ``[flatten fc1 relu1] [fc2 relu2] [fc3]``,
``cnn_digits`` has ``[conv1 bn1 relu1] [conv2 bn2 relu2] [conv3 bn3 relu3 pool flatten] [fc]`` and
ResNet-20 has 11 blocks: the stem, the nine residual blocks, the classifier. Blocks are numbered
ℓ = 1..L from the input side, as in the spec; a cut index ``c`` means "blocks c..L train".

The block modules returned by :meth:`LayerSplit.chain` are the model's own modules (shared, not
copied), so training a suffix chain trains the model's parameters under their usual names.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

#: normalisation layers stay with the weight layer before them (their statistics describe its output)
NORM_LAYERS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LayerNorm, nn.GroupNorm)


@dataclass(frozen=True)
class Block:
    """One cut-safe unit of a model: consecutive atoms (module paths) and what they hold."""

    index: int  # 1-based, from the input side
    atoms: tuple[str, ...]
    #: parameter names (as in ``model.named_parameters()``)
    params: tuple[str, ...]
    #: floating-point ``state_dict`` entries (parameters and float buffers such as BN running stats)
    float_state: tuple[str, ...]
    #: per-sample element counts of the block's input and output
    in_numel: int
    out_numel: int
    #: bytes of the block's parameters and buffers (everything resident while it runs)
    resident_bytes: int


class Chain(nn.Module):
    """Runs a list of the model's own modules in order (a consecutive range of blocks)."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        super().__init__()
        self.steps = nn.ModuleList(modules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.steps:
            x = m(x)
        return x


def _atoms(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    out: list[tuple[str, nn.Module]] = []
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        if isinstance(child, nn.Sequential):
            out.extend(_atoms(child, path + "."))
        else:
            out.append((path, child))
    return out


def _under(name: str, atoms: Iterable[str]) -> bool:
    return any(name.startswith(a + ".") for a in atoms)


class LayerSplit:
    """The block structure of a sequential model (see the module docstring).

    ``input_shape`` is one sample's shape; a probe forward pass on one zero sample (eval mode, no
    gradient) records each block's input and output sizes.
    """

    def __init__(self, model: nn.Module, input_shape: Sequence[int]) -> None:
        if not isinstance(model, nn.Sequential):
            raise ValueError(
                f"layer-wise partial training needs an nn.Sequential model, got {type(model).__name__}"
            )
        atoms = _atoms(model)
        if not atoms:
            raise ValueError("the model has no layers")
        groups: list[list[tuple[str, nn.Module]]] = []
        seen_weight = False
        for name, mod in atoms:
            has_params = any(True for _ in mod.parameters())
            starts = has_params and not isinstance(mod, NORM_LAYERS)
            if starts and seen_weight:
                groups.append([])
            if not groups:
                groups.append([])
            groups[-1].append((name, mod))
            seen_weight = seen_weight or starts
        sizes: dict[str, tuple[int, int]] = {}
        hooks = []
        for name, mod in atoms:
            hooks.append(
                mod.register_forward_hook(
                    lambda m, i, o, name=name: sizes.__setitem__(name, (i[0][0].numel(), o[0].numel()))
                )
            )
        was_training = model.training
        try:
            model.eval()
            with torch.no_grad():
                model(torch.zeros((1, *input_shape)))
        finally:
            model.train(was_training)
            for h in hooks:
                h.remove()
        params = [n for n, _ in model.named_parameters()]
        state = model.state_dict()
        float_state = [k for k, v in state.items() if v.is_floating_point()]
        self.blocks: list[Block] = []
        for i, group in enumerate(groups, start=1):
            names = tuple(n for n, _ in group)
            resident = sum(
                t.numel() * t.element_size() for _, m in group for t in (*m.parameters(), *m.buffers())
            )
            self.blocks.append(
                Block(
                    index=i,
                    atoms=names,
                    params=tuple(p for p in params if _under(p, names)),
                    float_state=tuple(k for k in float_state if _under(k, names)),
                    in_numel=sizes[names[0]][0],
                    out_numel=sizes[names[-1]][1],
                    resident_bytes=resident,
                )
            )
        self.input_shape = tuple(int(d) for d in input_shape)
        covered = {k for b in self.blocks for k in b.float_state}
        if covered != set(float_state):
            missing = sorted(set(float_state) - covered)[:5]
            raise ValueError(f"state entries outside every block: {missing}")

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def _check_cut(self, cut: int) -> None:
        if not 1 <= cut <= self.num_blocks:
            raise ValueError(f"cut index must be in 1..{self.num_blocks}, got {cut}")

    def suffix_params(self, cut: int) -> set[str]:
        """Parameter names of blocks ``cut..L`` (what a client with this cut trains)."""
        self._check_cut(cut)
        return {p for b in self.blocks[cut - 1 :] for p in b.params}

    def suffix_state(self, cut: int) -> list[str]:
        """Float state names of blocks ``cut..L``, in model order (what such a client uploads)."""
        self._check_cut(cut)
        return [k for b in self.blocks[cut - 1 :] for k in b.float_state]

    def cut_of(self, names: Iterable[str]) -> int | None:
        """The cut whose suffix state is exactly ``names``, or None if ``names`` is no suffix."""
        wanted = set(names)
        for cut in range(1, self.num_blocks + 1):
            if set(self.suffix_state(cut)) == wanted:
                return cut
        return None

    def chain(self, model: nn.Module, first: int, last: int) -> Chain:
        """Blocks ``first..last`` (1-based, inclusive) of ``model`` (an instance of the architecture this
        split was built from) as one module sharing ``model``'s own layers."""
        if not 1 <= first <= last <= self.num_blocks:
            raise ValueError(f"block range {first}..{last} outside 1..{self.num_blocks}")
        return Chain([model.get_submodule(a) for b in self.blocks[first - 1 : last] for a in b.atoms])

    def prefix_atoms(self, cut: int) -> tuple[str, ...]:
        """Module paths of blocks ``1..cut-1`` (the frozen, forward-only input side)."""
        self._check_cut(cut)
        return tuple(a for b in self.blocks[: cut - 1] for a in b.atoms)

    def block_of(self, name: str) -> int:
        """The block holding parameter/state/module ``name`` (1-based)."""
        for b in self.blocks:
            if name in b.atoms or _under(name, b.atoms):
                return b.index
        raise KeyError(name)

    def cut_numel(self, cut: int) -> int:
        """Per-sample elements of the activations entering block ``cut`` (the cached features)."""
        self._check_cut(cut)
        return self.blocks[cut - 1].in_numel

    def suffix_resident_bytes(self, cut: int) -> int:
        self._check_cut(cut)
        return sum(b.resident_bytes for b in self.blocks[cut - 1 :])

    def forward_peak_bytes(self, first: int, last: int, batch_size: int, bytes_per: int = 4) -> int:
        """Memory to run blocks ``first..last`` forward without autograd, ``batch_size`` at a time:
        their parameters and buffers plus the largest (input + output) activation pair of one block.

        Why this rule: without autograd a block's input can be freed once its output exists, so the
        peak inside a chunk is one block's input and output together (spec §2.3's chunk-sizing rule).
        """
        blocks = self.blocks[first - 1 : last]
        resident = sum(b.resident_bytes for b in blocks)
        io = max(b.in_numel + b.out_numel for b in blocks)
        return resident + io * batch_size * bytes_per

    def chunks(
        self, cut: int, budget_bytes: int | None, batch_size: int, parts: int = 1
    ) -> list[tuple[int, int]]:
        """Consecutive chunks of the prefix ``1..cut-1`` as inclusive (first, last) block ranges.

        With a budget: greedy, as many consecutive blocks as fit ``forward_peak_bytes <= budget`` (a
        block that does not fit alone still forms its own chunk; admission then refuses the task).
        Without one: the prefix cut into ``parts`` near-equal chunks (the paper's weak clients receive
        the input side "twice", moderate ones once; spec §2.3).
        """
        self._check_cut(cut)
        n = cut - 1
        if n == 0:
            return []
        if budget_bytes is None:
            k = max(1, min(parts, n))
            bounds = [round(i * n / k) for i in range(k + 1)]
            return [(bounds[i] + 1, bounds[i + 1]) for i in range(k)]
        out: list[tuple[int, int]] = []
        start = 1
        for end in range(1, n + 1):
            if end > start and self.forward_peak_bytes(start, end, batch_size) > budget_bytes:
                out.append((start, end - 1))
                start = end
        out.append((start, n))
        return out
