"""fedfleet's shared library: schemas, codec, transport, algorithms, models, data, devices.

Importing it pins the CPU kernels torch uses to AVX2 (unless the environment already chose):

Why: the same experiment gave a different model on machines with different vector instructions.
The quickstart over RabbitMQ and in one process ended at accuracy 0.9125 on one host and 0.9158 on
another, each reproducible on its own host. MKL, oneDNN and torch's own kernels pick their code
path by CPU, and each path rounds sums differently; over 20 rounds of SGD one rounding apart becomes
a test sample apart. On one AVX2 host, `ATEN_CPU_CAPABILITY=default` changed the final loss from
0.2734 to 0.2805, and `MKL_CBWR=COMPATIBLE` the final accuracy from 0.9158 to 0.9226, while
pinning all three to AVX2 gave that host's own 0.9158 / 0.2734. MKL's pin is ``AVX2,STRICT``: on a
host with AVX-512 (2026-11-28, an "Intel(R) Xeon(R) Processor" with avx512f and amx_tile),
``MKL_CBWR=AVX2`` alone still gave 0.9226, because without ``STRICT`` MKL may keep some of its
faster paths, and ``AVX2,STRICT`` gave 0.9158 (``fedfleet run experiments/quickstart.yaml
--transport inproc`` with each setting). That host's final loss is still 0.2791, not 0.2734, so one
path is not yet pinned. It is not numpy's SIMD (``NPY_DISABLE_CPU_FEATURES``), OpenBLAS's kernels
(``OPENBLAS_CORETYPE=Haswell``) or MKL's instruction set (``MKL_ENABLE_INSTRUCTIONS=AVX2``): each
gave 0.2791 too. With the pins, x86 hosts with AVX2 run the same code paths as far as they reach,
so a documented accuracy is what a re-run gives. (A host with AVX-512 runs a little slower for
it; set the variables yourself to choose another path.) They are read
when torch first computes, so setting them here, before any of fedfleet's code runs a kernel, is
early enough even where torch was imported first (the fork server).
"""

from __future__ import annotations

import os

#: the kernel-path pins (see the module docstring); ``docs/configuration.md`` lists them
NUMERICS_ENV = {"MKL_CBWR": "AVX2,STRICT", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}

for _name, _value in NUMERICS_ENV.items():
    os.environ.setdefault(_name, _value)
