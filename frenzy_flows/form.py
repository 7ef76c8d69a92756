"""The `frenzy-submit` run form in the Prefect UI: schema touches that make it one a person fills.

Prefect renders a parameter's JSON schema as the form. Two things in a plain pydantic schema
read badly there (seen in Prefect 3.9's UI, docs/ui.md has the screenshots):

* every optional field (``X | None``) becomes ``anyOf: [X, null]``, which the UI shows as a row
  of type tabs with "None" selected and the line 'Property is type "None"' under it
  (``blocks.schema``, which the block editor's schemas share);
* a model given as free text offers no list of the presets.

``RunForm`` is an ``Annotated`` marker for a flow parameter. It rewrites only the schema the UI
and the server see (never validation): optional fields lose their ``null`` choice (an empty
field is left out of the run's parameters, and the flow's default None applies), and the job's
``model`` offers the presets first (a select), then free text or the dimensions. Kept as the
model, the job YAML and the Python API are unchanged.

    def submit_training(job: Annotated[TrainingJob, RunForm()], policy: Annotated[str | None, RunForm()] = None)
"""
from __future__ import annotations

from typing import Any

from blocks.schema import tidy_model, without_null     # the same touches as the block editor


def offer_presets(prop: dict[str, Any], presets: list[str]) -> None:
    """Put a select of ``presets`` before the property's other choices (in place)."""
    choice = {"title": "preset", "type": "string", "enum": list(presets)}
    variants = prop.get("anyOf") or [{k: prop.pop(k) for k in ("type",) if k in prop}]
    prop["anyOf"] = [choice] + [v for v in variants if v]


class RunForm:
    """``Annotated`` marker: the parameter's schema tidied for the run form (see the module doc)."""

    def __get_pydantic_json_schema__(self, core_schema, handler):
        schema = handler(core_schema)
        target = handler.resolve_ref_schema(schema)
        if target.get("type") == "object" and "properties" in target:
            tidy_model(target, handler.resolve_ref_schema)
            model = target["properties"].get("model")
            if model is not None and target.get("title") == "TrainingJob":
                from estimator.models import PRESETS
                offer_presets(model, sorted(PRESETS))
        else:
            without_null(target)
        return schema
