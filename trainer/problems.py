"""The training program's own error for bad input found inside it (a retry would fail the same
way): the program reports it as a non-transient ``FRENZY_ERROR``, and the runner does not retry."""


class InputProblem(Exception):
    """Bad input found inside the training program."""
