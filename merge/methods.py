"""Merge specifications: a mergekit method by name, its parameters, compute dtype and seed.

Any method mergekit registers can be named; parameters are scalars (broadcast to every expert) or
mappings from expert name to value, exactly as a mergekit YAML would give them per model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class MergeSpec(BaseModel):
    """How to merge: method name, its parameters, the dtype to compute in, and the RNG seed."""

    model_config = ConfigDict(extra="forbid")

    method: str = "task_arithmetic"
    parameters: dict[str, Any] = Field(default_factory=lambda: {"weight": 1.0})
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    seed: int = 0

    @field_validator("method")
    @classmethod
    def _known_method(cls, value: str) -> str:
        available = available_methods()
        if value not in available:
            raise ValueError(f"unknown merge method {value!r}; mergekit offers {available}")
        return value

    def method_object(self) -> Any:
        from mergekit.merge_methods import get

        return get(self.method)

    def uses_base(self) -> bool:
        """False for methods that ignore a base model (linear, karcher…): experts only go in."""
        contract = self.method_object().spec.contract
        return str(getattr(contract.base, "value", contract.base)) != "ignored"

    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

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
