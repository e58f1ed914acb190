"""mmproxy.datasets: WebDataset shards into batches whose heavy fields go through servers."""
