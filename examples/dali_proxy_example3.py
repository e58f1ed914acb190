"""DALI proxy example 3, with `import mmproxy as dali_proxy`: torch's own DataLoader, then
`produce_data` in the loop.

Run: python examples/dali_proxy_example3.py [--data IMAGEFOLDER]
"""

import torch
import torchvision
from dali_proxy_example1 import DEVICE_ID, main, read_filepath, rn50_train_pipe

import mmproxy as dali_proxy


def run(jpeg, batch_size, nworkers):
    pipe = rn50_train_pipe(batch_size=batch_size, num_threads=2, device_id=DEVICE_ID)
    with dali_proxy.DALIServer(pipe) as dali_server:
        dataset = torchvision.datasets.ImageFolder(jpeg, transform=dali_server.proxy,
                                                   loader=read_filepath)
        # Using PyTorch DataLoader directly
        loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=nworkers,
                                             drop_last=True)
        for data, target in loader:
            # replaces the output reference with actual data
            data = dali_server.produce_data(data)
            assert data.shape == (batch_size, 3, 224, 224)
        print(f"example 3: last batch {tuple(data.shape)}, targets {target.tolist()}")


if __name__ == "__main__":
    main(run)
