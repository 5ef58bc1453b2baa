"""Models: shapes, the parameter counts the specs pin, determinism, options and layer names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from shared.data import load_dataset
from shared.models import MODEL_NAMES, BasicBlock, ResNet, Scaler, build_model, model_options, num_parameters

# name -> (input shape, classes) used to exercise every model
SHAPES: dict[str, tuple[tuple[int, ...], int]] = {
    "mlp": ((1, 8, 8), 10),
    "cnn_digits": ((1, 8, 8), 10),
    "cnn": ((1, 28, 28), 62),
    "lenet5_caffe": ((1, 28, 28), 10),
    "lenet5_fmnist": ((1, 28, 28), 10),
    "cnn7": ((3, 32, 32), 10),
    "lenet_cifar": ((3, 32, 32), 10),
    "lenet_emnist": ((1, 28, 28), 62),
    "cnn_digits_pool": ((1, 8, 8), 10),
    "tinycnn": ((1, 8, 8), 10),
    "cnn_feddse": ((1, 28, 28), 10),
    "resnet20": ((3, 32, 32), 10),
    "resnet18": ((3, 32, 32), 100),
}


def weights_of(model: nn.Module, kind: type[nn.Module] | tuple[type[nn.Module], ...]) -> int:
    """Entries of the weight tensors (biases excluded) of the conv/linear layers of type ``kind``."""
    return sum(
        m.weight.numel()
        for m in model.modules()
        if isinstance(m, nn.Conv2d | nn.Linear) and isinstance(m, kind)
    )


def test_every_registered_model_is_exercised() -> None:
    assert set(SHAPES) == set(MODEL_NAMES)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_output_shape_and_backward(name: str) -> None:
    shape, classes = SHAPES[name]
    model = build_model(name, shape, classes, seed=0)
    x = torch.randn(3, *shape)
    out = model(x)
    assert out.shape == (3, classes)
    assert torch.isfinite(out).all()
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    model.eval()
    with torch.no_grad():
        assert model(x[:1]).shape == (1, classes)


@pytest.mark.parametrize(
    ("name", "shape", "classes", "options", "expected"),
    [
        # EmbracingFL Table 1 (incl. BN gamma/beta and the stage-1 projection shortcut)
        ("resnet20", (3, 32, 32), 10, {}, 272_762),
        ("resnet20", (3, 32, 32), 10, {"stage1_projection": False}, 272_762 - 256 - 32),
        # the benchmark MLP 64-128-64-10 (FedDSE §8: Params(1) = 17,226)
        ("mlp", (1, 8, 8), 10, {}, 17_226),
        ("mlp", (1, 8, 8), 10, {"hidden": [64, 32]}, 6_570),  # Hermes §8
        ("mlp", (1, 8, 8), 10, {"bias": False}, 17_024),  # SpaFL §8 (no biases)
        ("mlp", (561,), 6, {"hidden": [300, 100]}, 199_306),  # Hermes HAR
        ("cnn", (1, 28, 28), 62, {}, 6_603_710),  # LEAF FEMNIST CNN, EmbracingFL Table 1
        ("cnn", (1, 28, 28), 62, {"hidden": 128}, 832 + 51_264 + 3136 * 128 + 128 + 129 * 62),
        ("lenet5_caffe", (1, 28, 28), 10, {}, 430_500),  # SpaFL FMNIST
        ("lenet5_fmnist", (1, 28, 28), 10, {}, 44_426),  # LeNet-5 (1998) on 28x28
        ("lenet_cifar", (3, 32, 32), 10, {}, 62_006),  # Hermes IC-CIFAR10
        ("lenet_emnist", (1, 28, 28), 62, {}, 539_358),  # Hermes IC-EMNIST
        ("cnn_feddse", (1, 28, 28), 10, {}, 1_556_874),  # FedDSE §4.2
    ],
)
def test_parameter_counts_match_the_specs(
    name: str, shape: tuple[int, ...], classes: int, options: dict[str, Any], expected: int
) -> None:
    assert num_parameters(build_model(name, shape, classes, **options)) == expected


def test_resnet20_stage_breakdown() -> None:
    """EmbracingFL §4.3's per-part counts, which its capacity table is built from."""
    model = build_model("resnet20", (3, 32, 32), 10)
    assert isinstance(model, ResNet)
    stem_and_stage1 = sum(num_parameters(getattr(model, n)) for n in ("conv1", "bn1", "layer1"))
    assert stem_and_stage1 == 14_768
    assert num_parameters(model.get_submodule("layer2")) == 51_648
    assert (
        num_parameters(model.get_submodule("layer3")) + num_parameters(model.get_submodule("fc")) == 206_346
    )
    blocks = model.blocks()
    assert len(blocks) == 9 and all(isinstance(b, BasicBlock) for b in blocks)
    assert all(not isinstance(b.shortcut, nn.Identity) for b in (blocks[0], blocks[3], blocks[6]))
    assert all(isinstance(b.shortcut, nn.Identity) for i, b in enumerate(blocks) if i % 3)
    assert all(m.bias is None for m in model.modules() if isinstance(m, nn.Conv2d))


def test_spafl_models_match_weight_and_threshold_counts() -> None:
    lenet = build_model("lenet5_caffe", (1, 28, 28), 10)
    assert weights_of(lenet, (nn.Conv2d, nn.Linear)) == 430_500
    assert sum(m.weight.shape[0] for m in lenet.modules() if isinstance(m, nn.Conv2d | nn.Linear)) == 580
    cnn7 = build_model("conv4", (3, 32, 32), 10)  # the code name is an alias
    assert weights_of(cnn7, (nn.Conv2d, nn.Linear)) == 804_800
    assert sum(m.weight.shape[0] for m in cnn7.modules() if isinstance(m, nn.Conv2d | nn.Linear)) == 650
    resnet18 = build_model("resnet18", (3, 32, 32), 100)
    assert weights_of(resnet18, nn.Conv2d) == 11_159_232
    assert sum(m.weight.shape[0] for m in resnet18.modules() if isinstance(m, nn.Conv2d)) == 4_800


def test_mlp_on_real_digits_batch() -> None:
    ds = load_dataset("digits")
    model = build_model("mlp", ds.input_shape, ds.num_classes, seed=0)
    assert [n for n, _ in model.named_parameters()] == [
        "fc1.weight",
        "fc1.bias",
        "fc2.weight",
        "fc2.bias",
        "fc3.weight",
        "fc3.bias",
    ]
    assert [tuple(p.shape) for p in model.parameters()][::2] == [(128, 64), (64, 128), (10, 64)]
    logits = model(torch.from_numpy(ds.x_train[:32]))
    assert logits.shape == (32, 10)


def test_init_is_deterministic_under_manual_seed() -> None:
    torch.manual_seed(123)
    a = build_model("resnet20", (3, 32, 32), 10)
    torch.manual_seed(123)
    b = build_model("resnet20", (3, 32, 32), 10)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(va, vb)
    c = build_model("resnet20", (3, 32, 32), 10)  # RNG advanced: a different draw
    assert not torch.equal(a.state_dict()["conv1.weight"], c.state_dict()["conv1.weight"])


def test_seed_option_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(5)
    expected_next = torch.rand(1)
    torch.manual_seed(5)
    a = build_model("mlp", (1, 8, 8), 10, seed=7)
    assert torch.equal(torch.rand(1), expected_next)
    b = build_model("mlp", (1, 8, 8), 10, seed=7)
    c = build_model("mlp", (1, 8, 8), 10, seed=8)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.state_dict()["fc1.weight"], c.state_dict()["fc1.weight"])


def test_unknown_names_and_options_are_explained() -> None:
    with pytest.raises(ValueError, match="valid names: mlp, cnn_digits"):
        build_model("vgg16", (3, 32, 32), 10)
    with pytest.raises(ValueError, match="did you mean 'hidden'"):
        build_model("mlp", (1, 8, 8), 10, hiden=[32])
    with pytest.raises(ValueError, match="valid options: none"):
        build_model("lenet_cifar", (3, 32, 32), 10, width=2)
    assert model_options("mlp") == ("hidden", "bias")
    with pytest.raises(ValueError, match="num_classes"):
        build_model("mlp", (1, 8, 8), 0)


def test_image_models_check_their_input() -> None:
    with pytest.raises(ValueError, match=r"needs an image input shape \(C, H, W\)"):
        build_model("cnn_digits", (64,), 10)
    with pytest.raises(ValueError, match="too small"):
        build_model("lenet5_caffe", (1, 8, 8), 10)
    with pytest.raises(ValueError, match="positive"):
        build_model("mlp", (1, 8, 8), 10, hidden=[0])
    # The FEMNIST CNN adapts its dense layer to the input (CIFAR: 8x8x64 features).
    model = build_model("cnn", (3, 32, 32), 10, hidden=64)
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


def test_static_bn_and_scaler() -> None:
    static = build_model("cnn_digits", (1, 8, 8), 10, track_running_stats=False)
    assert not any("running_mean" in k for k in static.state_dict())
    tracked = build_model("cnn_digits", (1, 8, 8), 10)
    assert any("running_mean" in k for k in tracked.state_dict())
    half = build_model("cnn_feddse", (1, 28, 28), 10, rate=0.5)
    assert [m.out_channels for m in half.modules() if isinstance(m, nn.Conv2d)] == [32, 64, 128, 256]
    assert not any("running" in k for k in half.state_dict())  # static BN by default
    scaler = Scaler(0.25)
    x = torch.ones(2, 3)
    assert torch.equal(scaler.train()(x), x * 4) and torch.equal(scaler.eval()(x), x)
    with pytest.raises(ValueError, match="rate"):
        build_model("cnn_feddse", (1, 28, 28), 10, rate=1.5)


def test_tinycnn_variants() -> None:
    plain = build_model("tinycnn", (1, 8, 8), 10)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in plain.modules())
    fc = plain.get_submodule("fc")
    assert isinstance(fc, nn.Linear) and fc.in_features == 512
    with_bn = build_model("tinycnn", (1, 8, 8), 10, batch_norm=True, bias=False)
    assert sum(isinstance(m, nn.BatchNorm2d) for m in with_bn.modules()) == 2
    assert with_bn.state_dict()["conv1.weight"].numel() * 32 == 4_608  # FedMef §8: dense conv1 is 4,608 bits


def test_layer_names_are_stable() -> None:
    keys = list(build_model("resnet20", (3, 32, 32), 10).state_dict())
    assert keys[0] == "conv1.weight"
    assert "layer1.0.shortcut.conv.weight" in keys and "layer3.2.bn2.bias" in keys and keys[-1] == "fc.bias"
    keys = list(build_model("cnn", (1, 28, 28), 62).state_dict())
    assert keys == [f"{layer}.{p}" for layer in ("conv1", "conv2", "fc1", "fc2") for p in ("weight", "bias")]


def test_model_init_config_applies_to_every_algorithm(tmp_path: Path) -> None:
    """``model.init: he_normal`` gives N(0, 2/fan_in) weights and zero biases, the same w(0) on every
    call (server and clients agree without shipping it) and for every algorithm alike; ``default``
    keeps the builder's init; an unknown scheme is refused when the config is read."""
    from shared.config import ConfigError, load_config
    from shared.experiment import Experiment
    from tests.conftest import write_config

    def w0(name: str, init: str, algorithm: str = "fedavg") -> dict[str, torch.Tensor]:
        model = {"name": "mlp", "init": init}
        cfg = write_config(tmp_path / name, model=model, algorithm={"name": algorithm})
        exp = Experiment.build(load_config(cfg))
        first, again = exp.model().state_dict(), exp.model().state_dict()
        assert all(torch.equal(first[k], again[k]) for k in first)
        return first

    he = w0("he.yaml", "he_normal")
    default = w0("default.yaml", "default")
    for k, w in he.items():
        if k.endswith("weight"):
            fan_in = w[0].numel()
            assert abs(float(w.std()) - (2 / fan_in) ** 0.5) < 0.15 * (2 / fan_in) ** 0.5, k
            assert not torch.equal(w, default[k])
        else:
            assert not w.any(), f"{k}: biases start at 0"
    assert any(default[k].any() for k in default if k.endswith("bias"))
    hermes = w0("hermes.yaml", "he_normal", "hermes")
    assert all(torch.equal(he[k], hermes[k]) for k in he), "the same w(0) for every algorithm"
    with pytest.raises(ConfigError, match="init"):
        load_config(write_config(tmp_path / "bad.yaml", model={"name": "mlp", "init": "xavier"}))
