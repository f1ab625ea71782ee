"""The base of every request body model: null fields count as absent, unknown fields are refused by name."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from services.gateway.errors import UnsupportedFieldError


class Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are refused by `check_extra`, naming them

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    def check_extra(self, path: str, ignored: frozenset[str] = frozenset()) -> None:
        """Refuse fields this model does not declare (``path`` locates the model in the request)."""
        for name in self.model_extra or {}:
            if name not in ignored:
                top = path.split(".")[0] or name
                raise UnsupportedFieldError(top, f"{path + '.' if path else ''}{name}: not supported by this server")


def refuse(param: str, message: str) -> UnsupportedFieldError:
    return UnsupportedFieldError(param, f"{param}: {message}")
