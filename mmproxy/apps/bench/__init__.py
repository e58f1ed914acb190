"""Bench: the same data through mmproxy, plain PyTorch, DALI's proxy and a pure DALI reader.

``mmproxy bench`` (:func:`run`). Its rooms:

- :mod:`~mmproxy.apps.bench.session`: the run, workload by workload, and the JSON;
- :mod:`~mmproxy.apps.bench.systems`: the table of systems compared, and how each loads;
- :mod:`~mmproxy.apps.bench.pipes`: the DALI systems' pipelines (the graphs of
  :mod:`mmproxy.pipelines` behind a proxy or a reader);
- :mod:`~mmproxy.apps.bench.workers`: what the systems run in DataLoader workers;
- :mod:`~mmproxy.apps.bench.shards`: the synthetic shards, some JPEGs damaged;
- :mod:`~mmproxy.apps.bench.timing` and :mod:`~mmproxy.apps.bench.cpu`: epochs timed, CPU by
  thread group;
- :mod:`~mmproxy.apps.bench.memory`: memory over many epochs;
- :mod:`~mmproxy.apps.bench.report`: ratios, the printed summary, the plot.
"""

from mmproxy.apps.bench.session import run

__all__ = ["run"]
