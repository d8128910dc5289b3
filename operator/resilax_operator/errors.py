"""The operator's errors: one base class; leaves also subclass the built-in they mean."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class ResilaxOperatorError(Exception):
    """Base of every error the operator raises on purpose."""


@dataclass(frozen=True)
class SpecProblem:
    """One problem of a JAXJob spec: where (a field path such as `spec.slices.topology`) and what."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class InvalidSpecError(ResilaxOperatorError, ValueError):
    """A JAXJob spec with one or more problems; carries them all (`problems`), in field order."""

    def __init__(self, problems: Sequence[SpecProblem]) -> None:
        self.problems: tuple[SpecProblem, ...] = tuple(problems)
        super().__init__("; ".join(str(p) for p in self.problems) or "invalid spec")


class NameConflictError(ResilaxOperatorError, FileExistsError):
    """An object the job needs (a worker pod, its Service, its token Secret) exists under its name but is
    not the job's: another owner, or none (`observed.owner_uid`). Never adopted."""

    def __init__(self, kind: str, name: str, owner: str) -> None:
        self.kind, self.name, self.owner = kind, name, owner
        super().__init__(f"{kind} {name} exists and is not this job's ({owner})")


class UnknownTopologyError(ResilaxOperatorError, ValueError):
    """An accelerator/topology pair that the topology table does not know; the message lists valid ones."""


class InvalidSettingError(ResilaxOperatorError, ValueError):
    """An operator setting (a `RESILAX_OPERATOR_*` variable) the operator cannot use."""
