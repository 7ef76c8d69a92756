"""A mistyped block setting is an error, a saved document's stray key is not.

Prefect's ``Block`` keeps keys that are no field (``extra="allow"``), so
``FrenzySettings(polcy="sia")`` made a block with the default policy and said nothing. Blocks
mixing in ``KnownFields`` refuse such a key when a user builds them, naming it and the fields;
when Prefect loads a saved document holding one (written through the API, or a field a later
version dropped) the key is left out with a warning instead, since Prefect's own fallback for a
document that fails validation cannot load it either. No Prefect import.
"""
from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from pydantic import model_validator

# keys Prefect itself puts in a block's data (``model_dump`` carries the type's slug) and the
# private ones it passes a block it loads
PREFECT_BLOCK_KEYS = frozenset({"block_type_slug", "_block_document_id", "_block_document_name", "_is_anonymous"})
# set while Prefect builds a block from a saved document (``KnownFields._from_block_document``)
_LOADING: ContextVar[bool] = ContextVar("frenzy_block_loading", default=False)


class KnownFields:
    """Mixin for a Prefect ``Block``, before ``Block`` in the bases (pydantic collects its
    validator): see the module docstring."""

    @classmethod
    def _from_block_document(cls, block_document):
        token = _LOADING.set(True)
        try:
            return super()._from_block_document(block_document)
        finally:
            _LOADING.reset(token)

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        unknown = sorted(k for k in data if isinstance(k, str) and k not in fields and k not in PREFECT_BLOCK_KEYS)
        if not unknown:
            return data
        if _LOADING.get():
            import warnings
            warnings.warn(f"{cls.__name__}: the saved block's {', '.join(unknown)} is not one of its settings "
                          f"(ignored)", stacklevel=2)
            return {k: v for k, v in data.items() if k not in unknown}
        from estimator.errors import FrenzyInputError
        raise FrenzyInputError(unknown[0], f"is not a setting of {cls.__name__} (its fields: {', '.join(fields)})")
