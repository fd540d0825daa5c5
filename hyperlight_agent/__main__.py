# Before anything else: a SIGTERM while the agent is still importing must stop it cleanly, not
# kill it with the default action (signals.py says what each signal means).
from .signals import install_early

install_early()

from .cli import exit_now, main  # noqa: E402 - after the handlers, on purpose

exit_now(main())
