"""Installs EPL's hooks into TensorFlow (optimizer, session, savers); called by epl.init."""
from epl import optimizer_hooks, sharded_variable
from epl.runtime import session


def install() -> None:
    """Install every hook (idempotent)."""
    optimizer_hooks.install()
    session.install()
    sharded_variable.install_saver_support()
