"""One error type for every bad input, so every front end reports it the same way.

The CLI prints ``str(err)`` on one line and exits with status 2; flows fail the run with it.
"""
import math


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
            # the layout whole (gpus = dp x tp x pp x cp); vpp and offload where the plan has them
            extra = "".join(f" {k}={getattr(c, k)}" for k, plain in (("vpp", 1), ("offload", "none"))
                            if getattr(c, k, plain) != plain)
            where = (f"; closest plan: {getattr(c, 'gpus', '?')} x {getattr(c, 'gpu_type', '?')} "
                     f"(dp={getattr(c, 'dp', '?')} tp={getattr(c, 'tp', '?')} pp={getattr(c, 'pp', '?')} "
                     f"cp={getattr(c, 'cp', 1)}{extra} "
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


def check_number(field: str, value, *, low: float = 0.0, high: float = float("inf"), low_open: bool = True,
                 integer: bool = False, what: str = ""):
    """``value`` as a finite number (an int where ``integer``) above ``low`` (at it too unless
    ``low_open``) and at most ``high``; else one FrenzyInputError naming ``field`` and the range.
    The one range check of the numbers users type (flags, mix files, plan margins): NaN, inf
    and absurd sizes are refused before anything runs."""
    kind = "an integer" if integer else "a finite number"
    rule = f"must be {kind} {'>' if low_open else '>='} {low:g}"
    if math.isfinite(high):
        rule += f" and <= {high:,g}" if not integer else f" and <= {int(high):,}"
    if what:
        rule += f" ({what})"
    ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
          and (value > low if low_open else value >= low) and value <= high
          and (not integer or float(value).is_integer()))
    if not ok:
        raise FrenzyInputError(field, f"{rule}, got {value!r}")
    return int(value) if integer else float(value)
