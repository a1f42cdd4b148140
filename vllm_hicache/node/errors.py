"""The node tier's one error type, for what the environment or another
member decided (sizes, tmpfs space, a busy or inconsistent tier); bad
arguments are ValueError/TypeError as everywhere else."""


class NodeTierError(RuntimeError):
    """The node tier cannot be joined or used as asked; the message says why
    and what to change."""
