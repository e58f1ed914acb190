"""DALI proxy example 2, with `import mmproxy as dali_proxy`: proxy calls and default_collate.

Run: python examples/dali_proxy_example2.py
"""

import numpy as np
import torch
from nvidia.dali import fn, pipeline_def

import mmproxy as dali_proxy

batch_size = 8


@pipeline_def
def my_pipe(device):
    a = fn.external_source(name="a", no_copy=True)
    b = fn.external_source(name="b", no_copy=True)
    return a + b, a - b


def main():
    with dali_proxy.DALIServer(
            my_pipe(device="cpu", batch_size=batch_size, num_threads=3, device_id=None)) as dali_server:
        outs = []
        for _ in range(batch_size):
            a = np.array(np.random.rand(3, 3), dtype=np.float32)
            b = np.array(np.random.rand(3, 3), dtype=np.float32)
            out0, out1 = dali_server.proxy(a=a, b=b)
            outs.append((a, b, out0, out1))

        outs = torch.utils.data.dataloader.default_collate(outs)

        a, b, a_plus_b, a_minus_b = dali_server.produce_data(outs)
        assert torch.allclose(a + b, a_plus_b) and torch.allclose(a - b, a_minus_b)
        print(f"example 2: a + b and a - b of {tuple(a.shape)} match")


if __name__ == "__main__":
    main()
