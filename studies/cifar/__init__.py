"""The CIFAR-10 study: networks, data, baselines, trainer, sweeps and records."""
