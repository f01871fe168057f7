"""Installs EPL's hooks into TensorFlow (optimizer and session); called by epl.init."""
from epl import optimizer_hooks
from epl.runtime import session


def install() -> None:
    """Install every hook (idempotent)."""
    optimizer_hooks.install()
    session.install()
