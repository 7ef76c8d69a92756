"""Policy registry: ``get_policy(name)`` builds a fresh policy (policies keep per-job caches).

A plain dict so every policy module adds one line; all policies implement
``scheduler.types.Policy`` and run unchanged live and in the simulator.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

from estimator.errors import FrenzyInputError
from scheduler.types import Policy

from .fifo_user import FifoUser
from .frenzy import FrenzyPolicy
from .frenzy_paper import FrenzyPaperPolicy
from .gavel import Gavel
from .sia import Sia, SiaNoProfile
from .tiresias import Tiresias

POLICIES: dict[str, Callable[..., Policy]] = {
    "frenzy": FrenzyPolicy,
    "frenzy-paper": FrenzyPaperPolicy,
    "fifo-user": FifoUser,
    "gavel": Gavel,
    "sia": Sia,
    "sia-noprofile": SiaNoProfile,
    "tiresias": Tiresias,
}


def policy_factory(name: str) -> Callable[..., Policy]:
    """The class registered as ``name``; ``FrenzyInputError`` naming the known ones otherwise."""
    try:
        return POLICIES[name]
    except (KeyError, TypeError):               # TypeError: not a name at all (a list, a dict)
        raise FrenzyInputError("policy", f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None


def get_policy(name: str, **kwargs: Any) -> Policy:
    """A new instance of the policy registered as ``name`` (keyword arguments go to it); an
    option the policy does not take is one line naming it and the policy."""
    factory = policy_factory(name)
    params = inspect.signature(factory).parameters       # the constructor's keywords are its options
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        unknown = [k for k in kwargs if k not in params]
        if unknown:
            raise FrenzyInputError("policy option", f"{name} takes no option {unknown[0]!r}")
    return factory(**kwargs)
