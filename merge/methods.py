"""Merge specifications: a mergekit method by name, its parameters, dtypes and RNG seed.

Any method mergekit registers can be named; parameters are scalars (broadcast to every expert) or
mappings from expert name to value, as a mergekit YAML gives them per model. A spec reads from
and writes to mergekit's YAML, so a merge can be reproduced with `mergekit-yaml`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from skillswarm.merge.tensors import CheckpointTensors

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DtypeName = Literal["float32", "bfloat16", "float16"]
MAX_YAML_CHARS = 1 << 20
MAX_DOCUMENT_DEPTH = 32
MAX_DOCUMENT_NODES = 10_000
_YAML_KEYS = {"merge_method", "parameters", "models", "dtype", "out_dtype", "base_model"}
_SCALAR_TYPES = (bool, int, float, str)


class MergeConfigError(ValueError):
    """A merge specification or mergekit YAML that cannot drive a merge; says what to change."""


class MergeSpec(BaseModel):
    """How to merge: method, its parameters, the compute and output dtypes, and the RNG seed.

    `seed` seeds torch's global generator right before the first tensor is merged, as
    `mergekit-yaml --random-seed` does; only randomized methods (DARE, DELLA) draw from it.
    `out_dtype` None keeps each tensor's dtype from the base checkpoint.
    """

    model_config = ConfigDict(extra="forbid")

    method: str = "task_arithmetic"
    parameters: dict[str, Any] = Field(default_factory=lambda: {"weight": 1.0})
    dtype: DtypeName = "float32"
    out_dtype: DtypeName | None = None
    seed: int = 0

    @field_validator("method")
    @classmethod
    def _known_method(cls, value: str) -> str:
        available = available_methods()
        if value not in available:
            raise ValueError(f"unknown merge method {value!r}; mergekit offers {available}")
        return value

    @model_validator(mode="after")
    def _parameters_fit_method(self) -> MergeSpec:
        specs = {p.name: p for p in self.method_object().spec.parameters}
        for name, value in self.parameters.items():
            if name not in specs:
                raise ValueError(
                    f"{self.method} takes no parameter {name!r}; its parameters are {sorted(specs)}"
                )
            values = value.values() if isinstance(value, Mapping) else [value]
            if isinstance(value, Mapping) and _is_shared(specs[name]):
                raise ValueError(
                    f"{self.method} parameter {name!r} is shared by all inputs: give one value, "
                    "not one per expert"
                )
            for item in values:
                _validate_value(specs[name], item, f"{self.method} parameter {name!r}")
        missing = [p.name for p in specs.values() if p.required and p.name not in self.parameters]
        if missing:
            raise ValueError(f"{self.method} needs parameter(s) {missing}")
        return self

    def method_object(self) -> Any:
        from mergekit.merge_methods import get

        return get(self.method)

    def uses_base(self) -> bool:
        """False for methods that ignore a base model (linear, karcher…): experts only go in."""
        contract = self.method_object().spec.contract
        return str(getattr(contract.base, "value", contract.base)) != "ignored"

    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def torch_out_dtype(self) -> torch.dtype | None:
        """The dtype every floating tensor is written in, or None to keep the base's."""
        return None if self.out_dtype is None else _DTYPES[self.out_dtype]

    def bound_parameters(self, expert_names: Sequence[str]) -> dict[str, Any]:
        """Parameters as mergekit's merge_tensors takes them for inputs ids=["base", *experts]."""
        bound: dict[str, Any] = {}
        for key, value in self.parameters.items():
            if isinstance(value, Mapping):
                missing = [n for n in expert_names if n not in value]
                if missing:
                    raise ValueError(f"parameter {key} gives no value for {missing}")
                bound[key] = {n: value[n] for n in expert_names}
            else:
                bound[key] = value
        return bound

    @classmethod
    def from_mergekit_yaml(
        cls,
        text: str,
        expert_names: Sequence[str] | Mapping[str, str] | None = None,
        *,
        seed: int = 0,
    ) -> MergeSpec:
        """Read a mergekit YAML (or a fragment of one) into a spec.

        Understood keys: merge_method, parameters (global), models (each `model:` plus its own
        `parameters:`), dtype, out_dtype, base_model (only to recognise the base among models).
        `expert_names` names the experts: a sequence when the YAML's `model:` values are those
        names, a mapping from `model:` value to expert name otherwise, or None to take the names
        from `models:`. With names, per-input parameters become mappings over every expert (a
        model's own value, else the global one, else mergekit's default). The seed is not part of
        mergekit's YAML (it is `mergekit-yaml --random-seed`), so it is passed here.
        """
        raw = _load_yaml_mapping(text)
        unknown = sorted(set(raw) - _YAML_KEYS)
        if unknown:
            raise MergeConfigError(
                f"mergekit YAML keys {unknown} are not supported by the streaming merge; "
                f"use only {sorted(_YAML_KEYS)}"
            )
        method = raw.get("merge_method")
        if not isinstance(method, str):
            raise MergeConfigError("mergekit YAML needs `merge_method: <name>`")
        known = available_methods()
        if method not in known:
            raise MergeConfigError(f"unknown merge method {method!r}; mergekit offers {known}")
        from mergekit.merge_methods import get

        param_specs = {p.name: p for p in get(method).spec.parameters}
        uses_base = str(get(method).spec.contract.base.value) != "ignored"
        base_ref = raw.get("base_model")
        if base_ref is not None and not isinstance(base_ref, str):
            raise MergeConfigError("base_model must be a single model reference string")
        if base_ref is not None and not uses_base:
            raise MergeConfigError(
                f"{method} ignores a base model here, but mergekit would merge base_model in as "
                "one more input; drop base_model, or list that model as an expert"
            )
        global_params = _parameter_block(raw.get("parameters"), "top-level parameters")
        model_params = _model_blocks(raw.get("models"), base_ref)
        for where, block in model_params.items():
            for name in block:
                if name in param_specs and _is_shared(param_specs[name]):
                    raise MergeConfigError(
                        f"model {where}: parameter {name!r} of {method} is shared by all inputs "
                        "and mergekit ignores it per model; set it under the top-level parameters"
                    )
        names = _expert_name_map(model_params, expert_names)
        for name in set(global_params).union(*model_params.values()):
            if name not in param_specs:
                raise MergeConfigError(
                    f"{method} takes no parameter {name!r}; its parameters are "
                    f"{sorted(param_specs)}"
                )

        parameters: dict[str, Any] = {}
        for name, spec in param_specs.items():
            label = f"{method} parameter {name!r}"
            given_per_model = any(name in block for block in model_params.values())
            if _is_shared(spec) or names is None:  # names is None: no model lists parameters
                if name in global_params:
                    parameters[name] = _validate_value(spec, global_params[name], label)
                continue
            if name not in global_params and not given_per_model:
                continue
            per_expert: dict[str, Any] = {}
            for reference, expert in names.items():
                block = model_params.get(reference, {})
                if name in block:
                    value = block[name]
                elif name in global_params:
                    value = global_params[name]
                elif not spec.required:
                    value = spec.default
                else:
                    raise MergeConfigError(f"{label} has no value for model {reference!r}")
                per_expert[expert] = _validate_value(spec, value, f"{label} of {reference!r}")
            parameters[name] = per_expert
        missing = [n for n, s in param_specs.items() if s.required and n not in parameters]
        if missing:
            raise MergeConfigError(f"{method} needs parameter(s) {missing}, globally or per model")
        fields: dict[str, Any] = {"method": method, "parameters": parameters, "seed": seed}
        for key in ("dtype", "out_dtype"):
            if raw.get(key) is not None:
                if raw[key] not in _DTYPES:
                    raise MergeConfigError(f"{key} {raw[key]!r} is not one of {sorted(_DTYPES)}")
                fields[key] = raw[key]
        try:
            return cls(**fields)
        except ValidationError as exc:
            raise MergeConfigError(f"mergekit YAML does not make a valid merge: {exc}") from exc

    def to_mergekit_yaml(
        self, base_path: str | Path, expert_paths: Mapping[str, str | Path]
    ) -> str:
        """The full mergekit config that performs this merge of `base_path` + the experts.

        `expert_paths` maps each expert name to its Hugging Face folder, in merge order. Without
        out_dtype in the spec, the base's floating dtype is written out (mergekit takes one).
        Run it with `mergekit-yaml CONFIG OUT` plus `mergekit_cli_options()` to reproduce the
        merge bit for bit.
        """
        names = list(expert_paths)
        if not names:
            raise MergeConfigError("a mergekit config needs at least one expert")
        try:
            bound = self.bound_parameters(names)
        except ValueError as exc:
            raise MergeConfigError(str(exc)) from exc
        global_params = {k: v for k, v in bound.items() if not isinstance(v, Mapping)}
        models = []
        for name in names:
            own = {k: v[name] for k, v in bound.items() if isinstance(v, Mapping)}
            entry: dict[str, Any] = {"model": str(expert_paths[name])}
            if own:
                entry["parameters"] = own
            models.append(entry)
        config: dict[str, Any] = {"merge_method": self.method}
        if self.uses_base():
            config["base_model"] = str(base_path)
        config["models"] = models
        if global_params:
            config["parameters"] = global_params
        config["dtype"] = self.dtype
        config["out_dtype"] = self.out_dtype or _base_float_dtype(Path(base_path))
        header = (
            f"# mergekit-yaml THIS_FILE OUT_DIR --random-seed {self.seed} "
            "--num-threads <torch threads of the merging process>\n"
        )
        return header + yaml.safe_dump(config, sort_keys=False)

    def mergekit_cli_options(self, num_threads: int | None = None) -> list[str]:
        """`mergekit-yaml` options that reproduce a merge by this spec bit for bit.

        Besides the seed, torch's intra-op thread count must match the merging process's
        (default: this process's now): full-tensor sums, such as DARE's rescaling, add up in
        per-thread chunks on tensors over 32768 elements, so their last bits follow the count.
        """
        threads = num_threads if num_threads is not None else torch.get_num_threads()
        return ["--random-seed", str(self.seed), "--num-threads", str(threads)]


def available_methods() -> list[str]:
    """Names of every merge method mergekit has registered."""
    from mergekit.merge_methods import registered_methods

    names = []
    for method in registered_methods():
        name = getattr(method, "method_name", None)
        if name is None:
            spec = getattr(method, "spec", None)
            name = getattr(spec, "name", None) if spec is not None else None
        if name is None and hasattr(method, "name"):
            name = method.name() if callable(method.name) else method.name
        if isinstance(name, str):
            names.append(name)
    return sorted(set(names))


def _is_shared(parameter: Any) -> bool:
    return str(parameter.scope.value) == "shared"


def _validate_value(parameter: Any, value: Any, label: str) -> Any:
    if not isinstance(value, _SCALAR_TYPES):
        raise MergeConfigError(
            f"{label}: {value!r} is not a scalar; per-layer gradients (lists) and filtered "
            "values are not supported by the streaming merge"
        )
    try:
        return parameter.validate(value)
    except ValidationError as exc:
        raise MergeConfigError(f"{label}: {value!r} is not a valid value: {exc}") from exc


def check_document_shape(document: Any, what: str) -> Any:
    """`document` (parsed JSON or YAML) if it nests at most MAX_DOCUMENT_DEPTH deep and holds at
    most MAX_DOCUMENT_NODES values, counting each YAML alias use again (so that aliases cannot
    multiply it); else MergeConfigError. Stops at the first bound passed."""
    pending: list[tuple[Any, int]] = [(document, 1)]
    nodes = 0
    while pending:
        value, depth = pending.pop()
        nodes += 1
        if depth > MAX_DOCUMENT_DEPTH or nodes > MAX_DOCUMENT_NODES:
            raise MergeConfigError(
                f"{what} nests deeper than {MAX_DOCUMENT_DEPTH} levels or holds more than "
                f"{MAX_DOCUMENT_NODES} values"
            )
        if isinstance(value, dict):
            pending += [(item, depth + 1) for pair in value.items() for item in pair]
        elif isinstance(value, list | tuple):
            pending += [(item, depth + 1) for item in value]
    return document


def _flow_depth(text: str) -> int:
    """How deep `[` and `{` nest in `text`, quotes or not: an upper bound of the YAML's flow
    nesting, found before the parser (whose scanner is quadratic in it) sees the text."""
    depth = deepest = 0
    for char in text:
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth = max(0, depth - 1)
    return deepest


def _load_yaml_mapping(text: str) -> dict[str, Any]:
    if len(text) > MAX_YAML_CHARS:
        raise MergeConfigError(f"mergekit YAML is {len(text)} characters; at most {MAX_YAML_CHARS}")
    if _flow_depth(text) > MAX_DOCUMENT_DEPTH:
        raise MergeConfigError(f"the mergekit YAML nests deeper than {MAX_DOCUMENT_DEPTH} levels")
    try:
        raw = check_document_shape(yaml.safe_load(text), "the mergekit YAML")
    except yaml.YAMLError as exc:
        raise MergeConfigError(f"malformed mergekit YAML: {exc}") from exc
    except RecursionError as exc:
        raise MergeConfigError(f"the mergekit YAML nests too deeply to read ({exc})") from exc
    if not isinstance(raw, dict):
        raise MergeConfigError(f"mergekit YAML must be a mapping, not {type(raw).__name__}")
    return raw


def _parameter_block(block: Any, where: str) -> dict[str, Any]:
    if block is None:
        return {}
    if not isinstance(block, dict) or not all(isinstance(k, str) for k in block):
        raise MergeConfigError(f"{where} must map parameter names to values")
    return block


def _model_blocks(models: Any, base_ref: str | None) -> dict[str, dict[str, Any]]:
    """Per-model parameters of the non-base models, in YAML order."""
    if models is None:
        return {}
    if not isinstance(models, list):
        raise MergeConfigError("models must be a list of `- model: <reference>` entries")
    blocks: dict[str, dict[str, Any]] = {}
    for index, entry in enumerate(models):
        if not isinstance(entry, dict) or not isinstance(entry.get("model"), str):
            raise MergeConfigError(f"models[{index}] needs `model: <reference>`")
        extra = sorted(set(entry) - {"model", "parameters"})
        if extra:
            raise MergeConfigError(f"models[{index}] has unsupported keys {extra}")
        reference = entry["model"]
        if reference in blocks:
            raise MergeConfigError(f"model {reference!r} is listed twice")
        params = _parameter_block(entry.get("parameters"), f"parameters of {reference!r}")
        if reference != base_ref:
            blocks[reference] = params
    return blocks


def _expert_name_map(
    model_params: Mapping[str, Any], expert_names: Sequence[str] | Mapping[str, str] | None
) -> dict[str, str] | None:
    """YAML model reference -> expert name, or None when the YAML names no experts."""
    if expert_names is None:
        return {ref: ref for ref in model_params} if model_params else None
    if isinstance(expert_names, str):
        raise MergeConfigError("expert_names must be a sequence or mapping of names, not a str")
    if isinstance(expert_names, Mapping):
        mapping = dict(expert_names)
    else:
        mapping = {name: name for name in expert_names}
    if len(set(mapping.values())) != len(mapping):
        raise MergeConfigError(f"expert names must be unique: {list(mapping.values())}")
    if model_params and set(model_params) != set(mapping):
        raise MergeConfigError(
            f"the YAML's models {sorted(model_params)} must be exactly the experts "
            f"{sorted(mapping)}: every expert is merged"
        )
    return mapping


def _base_float_dtype(base_path: Path) -> str:
    found = {
        str(dtype).removeprefix("torch.")
        for dtype, _ in CheckpointTensors(base_path).meta.values()
        if dtype.is_floating_point
    }
    if len(found) != 1:
        raise MergeConfigError(
            f"mergekit writes one out_dtype but {base_path} holds floating dtypes "
            f"{sorted(found)}; set out_dtype in the merge spec"
        )
    (name,) = found
    if name not in _DTYPES:
        raise MergeConfigError(f"{base_path} is in {name}; set out_dtype in the merge spec")
    return name
