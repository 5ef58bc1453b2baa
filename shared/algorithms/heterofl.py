"""HeteroFL (Diao et al., ICLR '21): nested width slices, the ordered baseline of FedDSE.

Spec: ``docs/algorithms/feddse.md`` §7 (HeteroFL is FedDSE's ordered baseline). A device of width
ratio ``r`` trains the *first* ``k_l = max(1, floor(r·m_l))`` units of every hidden layer (the
sub-models are nested); the server sends it only that slice and averages every coordinate over the
devices whose sub-models contain it. Tail units are trained only by wide devices.

Options (``algorithm.options``, all from :class:`shared.models.width_slice.WidthOptions`):

=========================== ============ ==========================================================
option                      default      meaning
=========================== ============ ==========================================================
``capacity``                ``paper``    how r is chosen: ``paper`` / ``levels`` / ``fixed`` / ``budget``
``levels``                  1 .. 1/16    capacity levels 1, 1/2, 1/4, 1/8, 1/16 (``paper``, ``levels``)
``level_probs``             uniform      probabilities of the levels
``fixed_rate``              1.0          r of every device (``fixed``; fallback of ``budget``)
``tier_rates``              {}           r per fleet tier for devices without a memory budget
``budget_grid``             k/16         rates tried against the device's memory budget
``cap_by_budget``           true         a sampled r never exceeds what the memory budget admits
``rounding``                ``floor``    k = floor(r·m) (FedDSE code) or ceil (HeteroFL code), min 1
``weighting``               ``uniform``  holder-mean weights: 1 (paper) or the device's samples
``agg_include_global``      false        authors' code: the old value is one extra vote
``agg_classifier_by_label`` false        classifier rows averaged only over devices with the label
``label_mask``              false        zero the logits of classes absent from the local data
``fan_in_scaling``          false        train-only ×(m_in/k_in) after layers whose inputs were cut
=========================== ============ ==========================================================

The common base of the width-slice family is :mod:`shared.algorithms.width_slicing`.
"""

from __future__ import annotations

from shared.algorithms.width_slicing import WidthSliceStrategy


class HeteroFL(WidthSliceStrategy):
    """HeteroFL: the first ``k_l`` units (see the module docstring)."""

    name = "heterofl"
