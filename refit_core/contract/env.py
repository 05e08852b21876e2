"""Environment overrides: the one module of refit that reads ``os.environ``.

Settings travel as typed objects (:class:`~refit_core.contract.options.RefitOptions`); these variables are
documented overrides for quick experiments, applied once, when a sender or receiver is created. A
value set here counts as set explicitly on this rank (see :mod:`refit_core.contract.options`): set it on the
train side alone, or the same on both sides. It wins over a value set in code, and the rank logs a warning
saying so.

========================== ================================ =====================================
variable                   setting                          values
========================== ================================ =====================================
``REFIT_NCCL_COMMS``       ``nccl.comms_per_link``          a positive integer
``REFIT_NCCL_BACKEND``     ``nccl.backend``                 ``auto``, ``nccl4py``, ``torch``
``REFIT_ZERO_COPY``        ``messages.zero_copy``           ``1`` or ``0``
``REFIT_DIRECT_MIN_BYTES`` ``messages.direct_min_bytes``    bytes (an integer)
``REFIT_MESSAGES``         ``messages.mode``                ``units`` or ``runs``
``REFIT_JOB``              ``job`` (local)                  this refit job's name
``REFIT_SECRET``           ``secret`` (local)               the job's shared secret (never sent)
``REFIT_INSECURE``         ``insecure`` (local)             ``1``: run without a secret (unsafe)
========================== ================================ =====================================

Without ``REFIT_SECRET`` or ``RefitOptions.secret`` (and unless ``insecure``), a rank started by torchrun
takes its secret from torchrun's run id (``TORCHELASTIC_RUN_ID``) where that is a random UUID, as
``torchrun --standalone`` makes: every rank of that torchrun derives the same one (:func:`launcher_secret`).

``REFIT_PLUGINS`` (comma-separated plugin names; unset loads all, empty loads none) selects plugins;
plugins read their own documented ``REFIT_*`` variables through :func:`read`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from refit_core.contract.errors import OptionError
from refit_core.contract.options import RefitOptions

log = logging.getLogger("refit")

PLUGINS = "REFIT_PLUGINS"
TORCHRUN_RUN_ID = "TORCHELASTIC_RUN_ID"


@dataclass(frozen=True)
class Override:
    """An environment variable that overrides one setting of :class:`RefitOptions`."""

    variable: str
    setting: str
    parse: Callable[[str], Any]


def _integer(text: str) -> int:
    return int(text.strip())


def _flag(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected 1 or 0")


OVERRIDES = (
    Override("REFIT_NCCL_COMMS", "nccl.comms_per_link", _integer),
    Override("REFIT_NCCL_BACKEND", "nccl.backend", str.strip),
    Override("REFIT_ZERO_COPY", "messages.zero_copy", _flag),
    Override("REFIT_JOB", "job", str.strip),
    Override("REFIT_SECRET", "secret", str),
    Override("REFIT_INSECURE", "insecure", _flag),
    Override("REFIT_DIRECT_MIN_BYTES", "messages.direct_min_bytes", _integer),
    Override("REFIT_MESSAGES", "messages.mode", str.strip),
)


def read(variable: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The value of a documented ``REFIT_*`` variable, or None when unset."""
    if not variable.startswith("REFIT_"):
        raise ValueError(f"{variable}: refit reads only its own REFIT_* variables")
    return (os.environ if environ is None else environ).get(variable)


def values_of(variables: Iterable[str], environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """Other programs' variables (NCCL's...) as they are set now, for reports; never a refit setting."""
    source = os.environ if environ is None else environ
    return {name: source.get(name) for name in variables}


def plugin_selection(environ: Mapping[str, str] | None = None) -> set[str] | None:
    """The plugin names ``REFIT_PLUGINS`` allows, or None when it is unset (load every plugin)."""
    wanted = read(PLUGINS, environ)
    return None if wanted is None else {n.strip() for n in wanted.split(",") if n.strip()}


def launcher_secret(environ: Mapping[str, str] | None = None) -> str | None:
    """The secret every rank of one launch shares without being told: derived from torchrun's run id
    when that is a random UUID (``torchrun --standalone`` makes one per run; a name given with
    ``--rdzv-id`` is no secret and gives none). None: the launcher shares nothing usable."""
    run_id = (os.environ if environ is None else environ).get(TORCHRUN_RUN_ID, "")
    try:
        random_id = uuid.UUID(run_id).version == 4
    except ValueError:
        random_id = False
    return hashlib.sha256(f"refit secret of torchrun run {run_id}".encode()).hexdigest()[:32] if random_id else None


def with_overrides(options: RefitOptions, environ: Mapping[str, str] | None = None) -> RefitOptions:
    """``options`` with every override set in the environment applied (as explicit settings); without a
    secret (and unless ``insecure``), the launcher's (:func:`launcher_secret`), as a default."""
    options = _overridden(options, environ)
    if options.secret is None and not options.insecure:
        derived = launcher_secret(environ)
        if derived is not None:
            return options.overridden({"secret": derived}, explicit=False)
    return options


def _overridden(options: RefitOptions, environ: Mapping[str, str] | None) -> RefitOptions:
    values: dict[str, Any] = {}
    for override in OVERRIDES:
        text = read(override.variable, environ)
        if text is None or not text.strip():
            continue
        try:
            values[override.setting] = override.parse(text)
        except ValueError as exc:
            raise OptionError(f"{override.variable}={text!r} (setting {override.setting}): {exc}") from None
    if not values:
        return options
    _warn_of_replaced(options, values)
    try:
        return options.overridden(values)
    except OptionError as exc:
        variables = ", ".join(o.variable for o in OVERRIDES if o.setting in values)
        raise OptionError(f"{exc} (from the environment: {variables})") from None


def _warn_of_replaced(options: RefitOptions, values: Mapping[str, Any]) -> None:
    """Log each setting given in code that an environment variable replaces with another value (a secret's
    values are not shown): two programs that set their own secrets in code are one job when both inherit one
    ``REFIT_SECRET``."""
    variables = {o.setting: o.variable for o in OVERRIDES}
    for setting in sorted(values.keys() & options.explicit):
        current: Any = options
        for part in setting.split("."):
            current = getattr(current, part)
        if current != values[setting]:
            shown = "" if setting == "secret" else f" ({current!r} in code, {values[setting]!r} from the environment)"
            log.warning("refit: %s in the environment overrides %s set in code%s", variables[setting], setting, shown)


__all__ = ["OVERRIDES", "PLUGINS", "TORCHRUN_RUN_ID", "Override", "launcher_secret", "plugin_selection", "read",
           "values_of", "with_overrides"]
