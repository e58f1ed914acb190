"""The loader side: an epoch's iterator, resolving references into outputs, where each
worker stands, the workers' start and end."""
