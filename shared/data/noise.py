"""Gaussian feature noise on a dataset: the *noisy digits* variant of Hermes' spec §8.1.

Why a dataset transform and not an algorithm option: a comparison is only fair if every method
sees the same noisy data, and FedAvg or HeteroFL have no reason to know about noise. So it is
``dataset.feature_noise_std`` in the config, applied once in ``Experiment.build`` for every
algorithm and every service alike.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from shared.data.datasets import Dataset
from shared.seeding import derive_seed


def noise_seed(experiment_seed: int) -> int:
    """The noise realisation of an experiment seed (shared by every algorithm of that seed)."""
    return derive_seed(experiment_seed, "feature-noise")


def add_feature_noise(x: np.ndarray, std: float, seed: int) -> np.ndarray:
    """``x + N(0, std²)`` per sample, the noise a pure function of ``(seed, the clean sample)``.

    Keyed by the sample's bytes rather than its position, so noise added to a slice of the data and
    to the whole dataset give bit-identical noisy samples (a test checks it), and neither a train
    limit nor a partition changes which noise a sample gets. (The 1,797 digits are pairwise
    distinct, so no two of them share a noise draw.)
    """
    if std <= 0:
        return x
    out = np.empty(x.shape, dtype=np.float32)
    key = int(seed).to_bytes(8, "little", signed=False)
    for i, sample in enumerate(np.asarray(x, dtype=np.float32)):
        h = derive_seed(key.hex(), np.ascontiguousarray(sample, dtype="<f4").tobytes().hex())
        out[i] = sample + np.random.default_rng(h).normal(0.0, std, sample.shape).astype(np.float32)
    return out


def noisy_dataset(ds: Dataset, std: float, seed: int) -> Dataset:
    """The whole dataset with :func:`add_feature_noise` on train and test."""
    if std <= 0:
        return ds
    return dataclasses.replace(
        ds, x_train=add_feature_noise(ds.x_train, std, seed), x_test=add_feature_noise(ds.x_test, std, seed)
    )
