"""Apps: the programs behind the ``mmproxy`` commands, built on the engine like any user's code.
docs/internals.md, ``mmproxy.apps``, has the rest.
"""

__all__: list[str] = []  # the apps are its modules: ``mmproxy.apps.NAME``
