"""One error type for every bad input, so every front end reports it the same way.

The CLI prints ``str(err)`` on one line and exits with status 2; flows fail the run with it.
"""


class FrenzyInputError(ValueError):
    """Bad input: names the offending field and the rule it breaks."""

    def __init__(self, field: str, rule: str):
        self.field = field
        self.rule = rule
        super().__init__(f"{field}: {rule}")


class DoesNotFitError(FrenzyInputError):
    """No plan on any GPU type in the inventory holds the job.

    ``closest`` is the plan that came nearest; ``shortfall_gib`` is by how much it misses.
    """

    def __init__(self, closest: object | None, shortfall_gib: float, detail: str = ""):
        self.closest = closest
        self.shortfall_gib = shortfall_gib
        where = ""
        if closest is not None:
            c = closest
            where = (f"; closest plan: {getattr(c, 'gpus', '?')} x {getattr(c, 'gpu_type', '?')} "
                     f"(dp={getattr(c, 'dp', '?')} tp={getattr(c, 'tp', '?')} pp={getattr(c, 'pp', '?')} "
                     f"zero={getattr(c, 'zero', '?')} act_ckpt={getattr(c, 'act_ckpt', '?')} "
                     f"micro_batch={getattr(c, 'micro_batch', '?')}) misses by {shortfall_gib:.2f} GiB")
        super().__init__("job", f"fits no GPU in the inventory{where}{(' ' + detail) if detail else ''}")


def from_validation_error(err, prefix: str = "") -> FrenzyInputError:
    """Turn a pydantic ValidationError into one FrenzyInputError naming the first bad field."""
    first = err.errors()[0]
    loc = ".".join(str(x) for x in first.get("loc", ()) if x != "__root__")
    msg = first.get("msg", "invalid")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
        # our validators already say "field: rule"
        if ": " in msg and not loc:
            field, _, rule = msg.partition(": ")
            return FrenzyInputError(prefix + field, rule)
    return FrenzyInputError(prefix + (loc or "input"), msg)
