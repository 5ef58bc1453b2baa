"""FedTiny (Huang et al. 2022) as the FedMef paper runs it: federated dynamic pruning, nothing else.

The whole protocol is :class:`~shared.algorithms.dynamic_pruning.DynamicPruning` (see its module):
every device trains the same sparse model θ ⊙ m from a random mask at the target density, and every
ΔR rounds the server drops the smallest aggregated weights and grows the pruned positions with the
largest aggregated gradients. FedTiny here has standard convs with BatchNorm, no extrusion and no
activation pruning; its adaptive BN selection and progressive pruning are removed, as in the FedMef
paper's comparison.
"""

from __future__ import annotations

from shared.algorithms.dynamic_pruning import DynamicPruning


class FedTiny(DynamicPruning):
    """FedTiny as the FedMef paper runs it: the protocol above, standard BN convs, nothing else."""

    name = "fedtiny"
