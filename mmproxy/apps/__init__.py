"""Apps: the programs behind the ``mmproxy`` commands, built on the engine like any user's code.

- :mod:`mmproxy.apps.demo`: ``mmproxy demo``, shards through an image and an audio server;
- :mod:`mmproxy.apps.shards`: ``mmproxy make-shards``, a folder into WebDataset shards;
- :mod:`mmproxy.apps.bench`: ``mmproxy bench``, mmproxy side by side with plain PyTorch, DALI's
  proxy and a pure DALI reader;
- :mod:`mmproxy.apps.data` (the shards of ``--data``) and :mod:`mmproxy.apps.noise` (decoder
  warnings on stderr counted for the demo's summary) serve them.

Each app has a ``run(args)`` taking the parsed command line (:mod:`mmproxy.cli` parses it) and
returning the exit code. Apps import the engine (``mmproxy``, ``mmproxy.datasets``,
``mmproxy.pipelines``, ``mmproxy.testing``); the engine never imports an app.
"""

__all__: list[str] = []  # the apps are its modules: ``mmproxy.apps.NAME``
