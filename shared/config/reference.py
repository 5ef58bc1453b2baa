"""Every config key, its type, default, bounds and meaning, as one Markdown page.

Why generated: the pydantic models are the only authority on what a config may say (they validate
every file), and their ``#:`` comments say why each key exists. A hand-written reference would drift
from them; this one is rebuilt from them, and a test fails when ``docs/configuration.md`` is stale.
The algorithms' ``Options`` models are included, so one page answers "what can I set?" — and so
are the process settings a deployment gives through the environment (``Settings``: the broker's
addresses, queue type and reconnect budget, ports, users), each under the variable it is read from.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from typing import Any

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from shared import NUMERICS_ENV
from shared.config import (
    AlgorithmConfig,
    BoundsConfig,
    DatasetConfig,
    EmulationConfig,
    ExperimentConfig,
    HostsConfig,
    ModelConfig,
    ProcessConfig,
    RobustConfig,
    Settings,
    TrainConfig,
)

#: top-level sections in the order a config file usually has them
SECTIONS: tuple[tuple[str, type[BaseModel]], ...] = (
    ("dataset", DatasetConfig),
    ("model", ModelConfig),
    ("algorithm", AlgorithmConfig),
    ("train", TrainConfig),
    ("processes", ProcessConfig),
    ("hosts", HostsConfig),
    ("emulation", EmulationConfig),
    ("bounds", BoundsConfig),
    ("robust", RobustConfig),
)

_FIELD = re.compile(r"^(\s+)([A-Za-z_][A-Za-z0-9_]*)\s*:")


def field_comments(cls: type) -> dict[str, str]:
    """The ``#:`` comment block right above each field of ``cls`` (joined into one paragraph).

    Read from the source because comments are not objects; inherited fields take their comments
    from the class that defines them.
    """
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass in (object, BaseModel) or not issubclass(klass, BaseModel):
            continue
        try:
            lines = inspect.getsource(klass).splitlines()
        except (OSError, TypeError):
            continue
        pending: list[str] = []
        body_indent: str | None = None
        for line in lines[1:]:
            stripped = line.strip()
            if stripped.startswith("#:"):
                pending.append(stripped[2:].strip())
                continue
            m = _FIELD.match(line)
            if m and (body_indent is None or m.group(1) == body_indent):
                body_indent = m.group(1)
                if pending and m.group(2) in klass.model_fields:
                    out[m.group(2)] = " ".join(pending)
            if stripped and not stripped.startswith("#"):
                pending = []
    return out


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " \\| ".join(f"`{v}`" for v in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is tuple and typing.get_args(tp)[-1:] == (Ellipsis,):
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    return getattr(tp, "__name__", str(tp)).replace("NoneType", "null")


def _bounds(info: FieldInfo) -> str:
    marks: tuple[tuple[type, str, str], ...] = (
        (annotated_types.Ge, "ge", "≥"),
        (annotated_types.Gt, "gt", ">"),
        (annotated_types.Le, "le", "≤"),
        (annotated_types.Lt, "lt", "<"),
    )
    parts = []
    for meta in info.metadata:
        for kind, attr, sign in marks:
            if isinstance(meta, kind):
                parts.append(f"{sign} {getattr(meta, attr)}")
        pattern = getattr(meta, "pattern", None)
        if pattern:
            parts.append(f"matches `{pattern}`")
    return ", ".join(parts)


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "**required**"
    value = info.default_factory() if info.default_factory is not None else info.default  # type: ignore[call-arg]
    if value is PydanticUndefined:
        return "**required**"
    if isinstance(value, BaseModel):
        return "(section)"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1e6:
        return f"`{value:g}`"
    return f"`{value}`" if value != {} else "`{}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def model_table(cls: type[BaseModel], prefix: str = "") -> list[str]:
    """One Markdown table of ``cls``'s fields (nested sections are left to their own tables)."""
    notes = field_comments(cls)
    rows = ["| key | type | default | bounds | meaning |", "|---|---|---|---|---|"]
    for name, info in cls.model_fields.items():
        tp = info.annotation
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            continue
        rows.append(
            f"| `{prefix}{name}` | {_type_name(tp)} | {_default(info)} | {_bounds(info)} "
            f"| {_cell(notes.get(name, ''))} |"
        )
    return rows


#: variables read from the environment outside ``Settings``, with what they mean (a test checks the
#: code reads no other)
OTHER_ENV: dict[str, str] = {
    **{
        name: f"the CPU code path of MKL, torch and oneDNN; unset: `{value}`, set by `import shared` so "
        "that every x86 host with AVX2 computes the same model (other paths round differently: the "
        "quickstart ended at 0.9125 on one host and 0.9158 on another). Set it to use another path"
        for name, value in NUMERICS_ENV.items()
    },
    "HOSTNAME": "a client host's and an aggregator's default identity when `--id` is not given (a "
    "pod's name on Kubernetes; an aggregator's queue is named after it, so two must never share one); "
    "unset: the machine's host name",
    "XDG_CACHE_HOME": "the base of the cache directory when `FEDFLEET_CACHE_DIR` is unset (the XDG "
    "convention): the cache is `$XDG_CACHE_HOME/fedfleet`; unset: `~/.cache`, or the temporary directory "
    "when there is no home directory",
}


def env_name(name: str, info: FieldInfo) -> str:
    """The environment variable a ``Settings`` field is read from: its alias, else the prefix and
    its name (pydantic-settings matches either case; the page shows upper case)."""
    alias = info.validation_alias
    if isinstance(alias, str):
        return alias
    return f"{Settings.model_config.get('env_prefix', '')}{name}".upper()


def settings_table() -> list[str]:
    """One row per process setting, named by its environment variable."""
    notes = field_comments(Settings)
    rows = ["| variable | type | default | bounds | meaning |", "|---|---|---|---|---|"]
    for name, info in Settings.model_fields.items():
        rows.append(
            f"| `{env_name(name, info)}` | {_type_name(info.annotation)} | {_default(info)} | "
            f"{_bounds(info)} | {_cell(notes.get(name, ''))} |"
        )
    for var, meaning in OTHER_ENV.items():
        rows.append(f"| `{var}` | str | (see meaning) |  | {_cell(meaning)} |")
    return rows


def _doc(obj: object) -> str:
    doc = inspect.getdoc(obj) or ""
    return doc.split("\n\n")[0].replace("\n", " ")


def config_reference() -> str:
    """The whole reference page (``docs/configuration.md``)."""
    from shared import algorithms
    from shared.data.datasets import DATASET_NAMES
    from shared.models import MODELS

    out = [
        "# Configuration reference",
        "",
        "<!-- generated by `fedfleet reference` from shared/config and the algorithms' Options; "
        "do not edit by hand (a test compares) -->",
        "",
        "An experiment is one YAML file. Unknown keys are errors that name the closest valid key; "
        "`fedfleet validate CONFIG --resolved` prints a config with every default filled in. "
        "The device fleet (`fleet:`) has its own page: [fleets.md](fleets.md).",
        "",
        "## Top level",
        "",
        *model_table(ExperimentConfig),
    ]
    for section, cls in SECTIONS:
        out += ["", f"## `{section}`", "", _doc(cls), "", *model_table(cls, f"{section}.")]
        if cls is DatasetConfig:
            out += ["", "Datasets: " + ", ".join(f"`{n}`" for n in DATASET_NAMES) + "."]
        if cls is ModelConfig:
            out += ["", "Models: " + ", ".join(f"`{n}`" for n in MODELS) + "."]
    out += [
        "",
        "## Process settings (environment)",
        "",
        "Deployment concerns, not experiment design: every process (server, aggregator, client host, "
        "`fedfleet run`) reads these from its environment, and they are not part of a config file. "
        "A value that does not fit is an error at start that names the variable. "
        "The broker settings are explained, with measurements, in [broker.md](broker.md).",
        "",
        *settings_table(),
    ]
    out += [
        "",
        "## Algorithms and their `algorithm.options`",
        "",
        "Each algorithm validates its own options; an unknown option is an error. "
        "Algorithm pages with results: [algorithms/](algorithms/).",
    ]
    for name in sorted(algorithms.REGISTRY):
        strategy = algorithms.REGISTRY[name]
        out += ["", f"### `{name}`", ""]
        module = inspect.getmodule(strategy)
        summary = _doc(module) if module is not None else ""
        if summary:
            out += [summary, ""]
        if strategy.Options.model_fields:
            out += model_table(strategy.Options, "algorithm.options.")
        else:
            out += ["No options."]
    return "\n".join(out) + "\n"
